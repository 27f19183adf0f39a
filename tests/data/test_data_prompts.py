"""RL prompt data through `vlmcore prepare` and `vlmcore pack`: a question with its media and the
reference answer, stored so that an RL stage reads back the prompt, the answer and the fields its
rewards need; bad rows counted by reason."""

import json
import logging

import pytest
from helpers import make_clip, make_demo_model_dir, write_jsonl

from vlmcore.data import IGNORE_INDEX
from vlmcore.data.media.encoder import SampleEncoder
from vlmcore.data.pack.dataset import pack
from vlmcore.data.prepare.dataset import prepare
from vlmcore.data.prepare.prompts import prompt_of
from vlmcore.data.shards import iter_shard_samples, shard_paths
from vlmcore.data.synthetic.image import generate

SEQ_LEN = 256


def prompt_rows(image_names: list[str]) -> list[dict]:
    """Good prompts in each accepted layout, then one bad row of each reason."""
    good = [
        {"image": image_names[0], "question": "<image>\nHow many circles?", "answer": 3, "task": "count"},
        {"images": [image_names[1]], "question": "What color is the shape?", "answer": "red"},  # no tag: added
        {
            "images": [image_names[2]],
            "prompt": [
                {"role": "user", "content": "<image>\nLook."},
                {"role": "assistant", "content": "I see it."},
                {"role": "user", "content": "Which letter? (A) red (B) blue"},
            ],  # fmt: skip
            "answer": "B",
            "choices": ["red", "blue"],
        },
        {"question": "What is 1/2 + 1/4?", "answer": "\\frac{3}{4}", "solution": "Add the quarters."},
        {"video": "clip.mp4", "question": "<video>\nWhat moves?", "answer": "a green square"},
    ]
    bad = [
        {"image": image_names[3], "question": "<image>\nHow many?"},  # prompt_missing_answer
        {"question": "Colour?", "answer": "  "},  # prompt_missing_answer
        {"question": "", "answer": "red"},  # prompt_missing_question
        {"prompt": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}], "answer": "x"},
        {"image": "images/missing.png", "question": "<image>\nWhat?", "answer": "x"},  # missing_image
        {"question": "Which?", "answer": ["a", "b"]},  # malformed_row: an answer is text or a number
        {"caption": "a red circle", "image": image_names[4]},  # malformed_row: not a prompt row
    ]
    return good + bad


@pytest.fixture(scope="module")
def prompt_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("rl_prompts")
    model = make_demo_model_dir(root / "model")
    generate(root / "raw", num_train=5, num_eval=1, seed=5)
    (root / "raw" / "clip.mp4").write_bytes(make_clip("libx264", "mp4", frames=8, rate=4, width=64, height=48))
    images = [f"images/train_{i:06d}.png" for i in range(5)]
    source = write_jsonl(root / "raw" / "prompts.jsonl", prompt_rows(images))
    return root, model, source


def stored_samples(folder) -> list[dict]:
    return [json.loads(s.data["json"]) for shard in shard_paths(folder) for s in iter_shard_samples(shard)]


def test_prompt_rows_prepare_with_their_answers_and_bad_rows_counted_by_reason(prompt_data, caplog):
    root, _, source = prompt_data
    with caplog.at_level(logging.WARNING):
        stats = prepare([f"prompts:{source}"], root / "data", shard_size=4, max_bad_fraction=0.7)
    assert stats["samples"] == 5 and stats["samples_by_kind"]["prompt"] == 5
    assert stats["videos"] == 1 and stats["images"] == 3
    assert stats["bad"]["skipped_by_reason"] == {
        "prompt_missing_answer": 2,
        "prompt_missing_question": 2,
        "missing_image": 1,
        "malformed_row": 2,
    }
    assert f"{source}:6" in caplog.text and "prompt_missing_answer" in caplog.text  # file and line named

    by_answer = {prompt_of(sample)[1]: sample for sample in stored_samples(root / "data")}
    assert set(by_answer) == {"3", "red", "B", "\\frac{3}{4}", "a green square"}
    turns, answer, fields = prompt_of(by_answer["3"])
    assert turns == [{"role": "user", "content": "<image>\nHow many circles?"}] and fields == {"task": "count"}
    turns, _, fields = prompt_of(by_answer["B"])
    assert [turn["role"] for turn in turns] == ["user", "assistant", "user"] and fields == {"choices": ["red", "blue"]}
    assert prompt_of(by_answer["red"])[0][0]["content"].startswith("<image>")  # the missing tag added
    assert prompt_of(by_answer["\\frac{3}{4}"])[2] == {"solution": "Add the quarters."}
    assert prompt_of(by_answer["a green square"])[0][0]["content"].startswith("<video>")


def test_prompt_samples_pack_as_conversations_labelled_on_the_reference_answer(prompt_data):
    root, model, source = prompt_data
    if not (root / "data").exists():
        prepare([f"prompts:{source}"], root / "data", shard_size=4, max_bad_fraction=0.7)
    packed = root / "packed"
    pack_stats = pack(root / "data", model, packed, seq_len=SEQ_LEN, max_patches=512, shard_size=4)
    assert pack_stats["samples"] == 5
    segments = [segment for pack_json in stored_samples(packed) for segment in pack_json["segments"]]
    assert len(segments) == 5
    encoder = SampleEncoder(packed / "model")
    for segment in segments:
        turns, answer, _ = prompt_of(segment["sample"])  # what an RL stage reads back from a pack
        assert turns[-1]["role"] == "user"
        if segment.get("videos"):
            continue  # the video's token count needs its clip decoded: the text-only check below is for images
        enc = encoder.encode_text(segment["sample"], [tuple(size) for size in segment["image_sizes"]])
        assert len(enc.input_ids) == segment["num_tokens"]
        labelled = encoder.tokenizer.decode([t for t in enc.labels if t != IGNORE_INDEX])
        assert labelled == answer + "<|im_end|>"  # only the reference answer after the prompt
