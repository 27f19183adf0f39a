"""Preference data (DPO) through `vlmcore prepare`, `vlmcore pack` and the loader: pairs kept whole
in one pack and one row, both sides with the same prompt and media, bad pairs counted by reason."""

import json
import logging
from collections import Counter
from itertools import islice

import pytest
from helpers import make_clip, make_demo_model_dir, write_jsonl

from vlmcore.data import IGNORE_INDEX
from vlmcore.data.load.loader import build_loader
from vlmcore.data.load.rows import whole_pairs
from vlmcore.data.media.encoder import SampleEncoder
from vlmcore.data.pack.dataset import pack
from vlmcore.data.prepare.dataset import prepare
from vlmcore.data.shards import iter_shard_samples, shard_paths
from vlmcore.data.synthetic.image import generate

SEQ_LEN = 256


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict:
    return {"role": "assistant", "content": text}


def preference_rows(image_names: list[str]) -> list[dict]:
    """Good pairs in each accepted layout, then one bad pair of each reason."""
    good = []
    for i, image in enumerate(image_names):
        if i % 3 == 0:  # an explicit prompt, answers as strings
            good.append(
                {"images": [image], "prompt": "<image>\nWhat color is it?", "chosen": "red", "rejected": "a blue"}
            )
        elif i % 3 == 1:  # TRL's implicit prompt: whole conversations sharing their first turns
            prompt = [user("<image>\nWhat shape is it?"), assistant("Let me look."), user("And?")]
            good.append({"images": [image], "chosen": prompt + [assistant("A circle.")], "rejected": prompt + [assistant("Blue.")]})  # fmt: skip
        else:  # prompt and sides as turns
            good.append({"image": image, "prompt": [user("Describe it.")], "chosen": [assistant("A red circle.")], "rejected": [assistant("Nothing.")]})  # fmt: skip
    good.append(
        {"video": "clip.mp4", "prompt": "<video>\nWhat moves?", "chosen": "A green square.", "rejected": "A cat."}
    )
    bad = [
        {"images": [image_names[0]], "prompt": "<image>\nWhat color?", "chosen": "red"},
        {"images": [image_names[0]], "prompt": "<image>\nWhat color?", "chosen": "red", "rejected": ""},
        {"chosen": [user("Color?"), assistant("red")], "rejected": [user("Shape?"), assistant("a circle")]},
        {
            "images": [image_names[0]],
            "chosen_images": [image_names[0]],
            "rejected_images": [image_names[1]],
            "prompt": "<image>\nColor?",
            "chosen": "red",
            "rejected": "blue",
        },  # fmt: skip
        {"images": [image_names[0]], "prompt": "Color?", "chosen": "red", "rejected": "<image>\nblue"},
    ]
    return good + bad


@pytest.fixture(scope="module")
def preference_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("dpo_data")
    model = make_demo_model_dir(root / "model")
    generate(root / "raw", num_train=12, num_eval=1, seed=3)
    (root / "raw" / "clip.mp4").write_bytes(make_clip("libx264", "mp4", frames=8, rate=4, width=64, height=48))
    images = [f"images/train_{i:06d}.png" for i in range(12)]
    source = write_jsonl(root / "raw" / "pairs.jsonl", preference_rows(images))
    return root, model, source


def test_preference_pairs_prepare_pack_and_load_whole(preference_data, caplog):
    root, model, source = preference_data
    with caplog.at_level(logging.WARNING):
        stats = prepare([f"preference:{source}"], root / "data", shard_size=4, max_bad_fraction=0.5)
    assert stats["samples"] == 13 and stats["samples_by_kind"]["preference"] == 13
    assert stats["bad"]["skipped_by_reason"] == {
        "preference_missing_side": 2,
        "preference_different_prompts": 1,
        "preference_different_media": 2,
    }
    # Each bad pair is logged with its file and line.
    assert f"{source}:14" in caplog.text and "preference_missing_side" in caplog.text

    packed = root / "packed"
    pack_stats = pack(root / "data", model, packed, seq_len=SEQ_LEN, max_patches=512, shard_size=4)
    assert pack_stats["samples"] == 13 and pack_stats["pairs"] == 13
    packs = [json.loads(s.data["json"])["segments"] for shard in shard_paths(packed) for s in iter_shard_samples(shard)]
    for segments in packs:
        roles = [segment.get("preference") for segment in segments]
        assert roles == ["chosen", "rejected"] * (len(roles) // 2)
        for chosen, rejected in zip(segments[::2], segments[1::2]):
            assert chosen["key"] == rejected["key"]
            assert chosen["images"] == rejected["images"] and chosen.get("videos") == rejected.get("videos")
            answer_from = chosen["sample"]["answer_from"]
            assert chosen["sample"]["messages"][:answer_from] == rejected["sample"]["messages"][:answer_from]
    assert sum(len(segments) for segments in packs) == 26

    # The loader: every pair in one row, both sides as the encoder makes them, the answers alone labelled.
    encoder = SampleEncoder(packed / "model")
    sides = {(segment["key"], segment["preference"]): segment for segments in packs for segment in segments}
    for dp_rank in (0, 1):
        loader = build_loader(packed, dp_rank=dp_rank, dp_world=2, micro_batch_size=1, seed=0, num_workers=0)
        for batch in islice(loader, 4):
            keys = batch.row_keys
            assert batch.pairs is not None and len(batch.pairs) >= 1
            bounds = batch.cu_seqlens.tolist()
            ids = batch.input_ids.flatten()
            labels = batch.labels.flatten()
            for chosen, rejected in batch.pairs.tolist():
                assert rejected == chosen + 1
                chosen_ids = ids[bounds[chosen] : bounds[chosen + 1]]
                rejected_ids = ids[bounds[rejected] : bounds[rejected + 1]]
                first_label = int((labels[bounds[chosen] : bounds[chosen + 1]] != IGNORE_INDEX).nonzero()[0])
                assert (chosen_ids[: first_label + 1] == rejected_ids[: first_label + 1]).all()
            assert keys  # the rows' packs
    # Only the answer after the shared prompt is labelled, even where the prompt has an assistant turn.
    implicit = [side for side in sides.values() if side["sample"]["answer_from"] == 3]
    assert len(implicit) == 8  # four pairs
    for segment in implicit:
        enc = encoder.encode_text(segment["sample"], [tuple(size) for size in segment["image_sizes"]])
        assert len(enc.input_ids) == segment["num_tokens"]
        answer = segment["sample"]["messages"][-1]["content"]
        assert encoder.tokenizer.decode([t for t in enc.labels if t != IGNORE_INDEX]) == answer + "<|im_end|>"


def test_a_pair_that_lost_a_side_is_left_out_whole():
    """The loader keeps a pair only with both its sides (same sample key, chosen then rejected)."""
    roles = [("a", "chosen"), ("a", "rejected"), ("b", "chosen"), ("c", "rejected"), ("d", None), ("e", "chosen")]
    roles += [("e", "rejected")]
    segments = [(key, None, [], [], role) for key, role in roles]
    skipped = Counter()
    kept = whole_pairs(segments, "000000001", skipped)
    assert [(key, role) for key, _, _, _, role in kept] == [("a", "chosen"), ("a", "rejected"), ("d", None), ("e", "chosen"), ("e", "rejected")]  # fmt: skip
    assert skipped == {"preference_side_left_out": 2}
