"""The synthetic demo data, the demo tokenizer and the processor files."""

import filecmp
import json

import torch
from PIL import Image
from transformers import AutoImageProcessor, AutoTokenizer

from vlmcore.cli import main
from vlmcore.data.media.processor import load_processor, write_processor_files
from vlmcore.data.media.tokenizer import QWEN_SPECIAL_TOKENS, build_demo_tokenizer, special_token_ids
from vlmcore.data.media.video import VideoSettings, decode_frames, plan_video, probe
from vlmcore.data.synthetic import video as synthetic_video
from vlmcore.data.synthetic.image import COLORS, QUESTIONS, SHAPES, corpus_texts, generate


def read_jsonl(path):
    return [json.loads(line) for line in open(path)]


def test_generate_is_deterministic_and_well_formed(tmp_path):
    meta = generate(tmp_path / "a", num_train=30, num_eval=12, seed=5)
    assert main(["synth", "--out", str(tmp_path / "b"), "--num-train", "30", "--num-eval", "12", "--seed", "5"]) == 0
    generate(tmp_path / "c", num_train=30, num_eval=12, seed=6)
    same = filecmp.dircmp(tmp_path / "a", tmp_path / "b")
    assert not same.diff_files and not same.left_only and not same.right_only
    assert not filecmp.dircmp(tmp_path / "a" / "images", tmp_path / "b" / "images").diff_files
    assert filecmp.dircmp(tmp_path / "a" / "images", tmp_path / "c" / "images").diff_files

    root = tmp_path / "a"
    captions = read_jsonl(root / "captions.jsonl")
    conversations = read_jsonl(root / "conversations.jsonl")
    evals = read_jsonl(root / "eval.jsonl")
    assert len(captions) == len(conversations) == 30 and len(evals) == 12
    sizes = {Image.open(root / c["image"]).size for c in captions}
    assert len(sizes) > 10 and any(w % 32 or h % 32 for w, h in sizes)
    assert all(32 <= s <= 112 for size in sizes for s in size)
    for conv in conversations:
        tags = sum(m["content"].count("<image>") for m in conv["messages"])
        assert tags == len(conv["images"]) and [m["role"] for m in conv["messages"]][::2] == ["user"] * (
            len(conv["messages"]) // 2
        )
    assert any(len(c["images"]) == 2 for c in conversations)
    assert any(len(c["messages"]) > 2 for c in conversations)
    train_images = {c["image"] for c in captions}
    for row in evals:
        assert row["image"] not in train_images
        assert row["choices"] == QUESTIONS[row["kind"]][1] and 0 <= row["answer"] < len(row["choices"])
    assert meta["chance"] == {"color": 1 / len(COLORS), "shape": 1 / len(SHAPES), "side": 0.5}
    assert json.loads((root / "meta.json").read_text()) == meta


def test_preference_pairs_answer_about_their_image(tmp_path):
    """The DPO demo's pairs: the chosen side is the scene's answer to the pair's question (the
    caption names the colour and shape of a train image; a held-out pair asks the question of its
    eval row, on the same image), the rejected side another choice of that question; the pairs
    pass `vlmcore prepare` as a preference source with none bad."""
    from vlmcore.data.prepare.dataset import prepare

    meta = generate(tmp_path / "a", num_train=30, num_eval=12, seed=5)
    root = tmp_path / "a"
    pairs = read_jsonl(root / "preference.jsonl")
    held_out = read_jsonl(root / "preference_eval.jsonl")
    assert meta["num_preference"] == len(pairs) == 30 and meta["num_preference_eval"] == len(held_out) == 12
    captions = {c["image"]: c["caption"] for c in read_jsonl(root / "captions.jsonl")}
    evals = {row["image"]: row for row in read_jsonl(root / "eval.jsonl")}
    for pair in pairs + held_out:
        question, choices = QUESTIONS[pair["kind"]]
        assert pair["prompt"] == f"<image>\n{question}" and len(pair["images"]) == 1
        assert pair["chosen"] != pair["rejected"] and {pair["chosen"], pair["rejected"]} <= set(choices)
    for pair in pairs:
        caption_words = captions[pair["images"][0]].rstrip(".").split(" ")
        if pair["kind"] in ("color", "shape"):
            assert pair["chosen"] in caption_words and pair["rejected"] not in caption_words, pair
    for pair in held_out:
        row = evals[pair["images"][0]]
        assert pair["kind"] == row["kind"] and pair["chosen"] == row["choices"][row["answer"]]
    assert len({pair["kind"] for pair in pairs}) == 3

    stats = prepare([f"preference:{root / 'preference.jsonl'}"], tmp_path / "prepared", images=root)
    assert stats["samples"] == 30 and stats["bad"]["skipped"] == 0, stats


def test_rl_prompts_ask_about_their_image_with_the_scene_as_reference(tmp_path):
    """The RL demo's prompts: each asks the question of its kind about one image, its reference
    answer is that scene's word (the caption's colour and shape; a held-out prompt's is its eval
    row's answer), and they pass `vlmcore prepare` as a prompt source with none bad."""
    from vlmcore.data.prepare.dataset import prepare

    meta = generate(tmp_path / "a", num_train=30, num_eval=12, seed=5)
    root = tmp_path / "a"
    prompts = read_jsonl(root / "prompts.jsonl")
    held_out = read_jsonl(root / "prompts_eval.jsonl")
    assert meta["num_prompts"] == len(prompts) == 30 and meta["num_prompts_eval"] == len(held_out) == 12
    captions = {c["image"]: c["caption"] for c in read_jsonl(root / "captions.jsonl")}
    evals = {row["image"]: row for row in read_jsonl(root / "eval.jsonl")}
    for prompt in prompts + held_out:
        question, choices = QUESTIONS[prompt["kind"]]
        assert prompt["question"] == f"<image>\n{question}" and prompt["answer"] in choices
    for prompt in prompts:
        if prompt["kind"] in ("color", "shape"):
            assert prompt["answer"] in captions[prompt["image"]].rstrip(".").split(" "), prompt
    for prompt in held_out:
        row = evals[prompt["image"]]
        assert prompt["kind"] == row["kind"] and prompt["answer"] == row["choices"][row["answer"]]
    assert len({prompt["kind"] for prompt in prompts}) == 3

    stats = prepare([f"prompts:{root / 'prompts.jsonl'}"], tmp_path / "prepared", images=root)
    assert stats["samples"] == 30 and stats["samples_by_kind"] == {"conversation": 0, "text": 0, "prompt": 30}
    assert stats["bad"]["skipped"] == 0, stats


def test_demo_tokenizer(tmp_path):
    texts = corpus_texts(0)
    assert texts == corpus_texts(0)
    assert all(q in texts for q, _ in QUESTIONS.values())
    tokenizer = build_demo_tokenizer(tmp_path, texts, vocab_size=512)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (tmp_path / name).is_file()
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert len(loaded) <= 512
    ids = special_token_ids(loaded)
    assert ids == special_token_ids(tokenizer)
    assert loaded.convert_ids_to_tokens(ids["image_token_id"]) == "<|image_pad|>"
    assert (
        len(
            {
                ids[k]
                for k in (
                    "image_token_id",
                    "video_token_id",
                    "vision_start_token_id",
                    "vision_end_token_id",
                    "eos_token_id",
                )
            }
        )
        == 5
    )
    for token in QWEN_SPECIAL_TOKENS:
        assert len(loaded(token, add_special_tokens=False)["input_ids"]) == 1
    for text in texts[:50]:
        assert loaded.decode(loaded(text)["input_ids"]) == text
    rendered = loaded.apply_chat_template(
        [
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What color is the shape?"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "red"}]},
        ],
        tokenize=False,
    )
    assert rendered == (
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What color is the shape?<|im_end|>\n"
        "<|im_start|>assistant\nred<|im_end|>\n"
    )


def test_processor_files_load_offline_without_torchvision(tmp_path):
    build_demo_tokenizer(tmp_path, corpus_texts(0))
    write_processor_files(tmp_path, min_pixels=32 * 32, max_pixels=64 * 64)
    image_processor = AutoImageProcessor.from_pretrained(tmp_path)
    assert type(image_processor).__name__ == "Qwen2VLImageProcessorPil"
    processor = load_processor(tmp_path)
    assert "Qwen3VLProcessor" in [c.__name__ for c in type(processor).__mro__]
    out = processor(text=["<|vision_start|><|image_pad|><|vision_end|>hi"], images=[Image.new("RGB", (100, 50))])
    assert out["image_grid_thw"].tolist() == [[1, 2, 4]]  # 100x50 -> 128x64 > max_pixels -> 64x32
    assert out["pixel_values"].shape == (8, 1536)
    assert out["input_ids"][0].count(processor.image_token_id) == 2


def sampled_frames(path):
    """The 8 frames the demo model's video processor samples from a clip (its default settings)."""
    data = path.read_bytes()
    info = probe(data)
    plan = plan_video({"kind": "file", **info.as_dict()}, VideoSettings(min_pixels=32 * 32, max_pixels=2 * 128 * 128))
    assert (info.frames, info.fps, info.codec, plan.grid) == (16, 4.0, "mpeg4", (4, 4, 4))
    return decode_frames(data, plan.indices).float()


def shapes_seen(frame):
    """(colour name, centre (x, y)) of what differs from the background, by nearest named colour."""
    out = []
    for name, rgb in COLORS.items():
        mask = (frame - torch.tensor(rgb, dtype=torch.float32)[:, None, None]).abs().amax(0) < 40
        if mask.sum() > 30:
            ys, xs = mask.nonzero(as_tuple=True)
            out.append((name, (xs.float().mean().item(), ys.float().mean().item())))
    return out


def test_video_demo_answers_are_in_the_sampled_frames(tmp_path):
    """Each held-out answer can be read off the frames the model is given, and not off one frame."""
    meta = synthetic_video.generate(tmp_path / "a", num_train=6, num_eval=24, seed=2)
    assert (
        main(
            [
                "synth",
                "--kind",
                "video",
                "--out",
                str(tmp_path / "b"),
                "--num-train",
                "6",
                "--num-eval",
                "24",
                "--seed",
                "2",
            ]
        )
        == 0
    )
    same = filecmp.dircmp(tmp_path / "a" / "videos", tmp_path / "b" / "videos")
    assert not same.diff_files and not same.left_only and len(same.common) == 30
    root = tmp_path / "a"
    assert meta["eval_count_by_kind"] == {"direction": 8, "order": 8, "count": 8}
    conversations = read_jsonl(root / "conversations.jsonl")
    assert all(c["messages"][0]["content"].startswith("<video>\n") for c in conversations)
    assert {c["video"] for c in read_jsonl(root / "captions.jsonl")} == {c["video"] for c in conversations}
    for row in read_jsonl(root / "eval.jsonl"):
        answer = row["choices"][row["answer"]]
        seen = [shapes_seen(frame) for frame in sampled_frames(root / row["video"])]
        assert all(len(s) <= 1 for s in seen), row["id"]
        if row["kind"] == "direction":
            (_, start), (_, end) = seen[0][0], seen[-1][0]
            dx, dy = end[0] - start[0], end[1] - start[1]
            moved = ("right" if dx > 0 else "left") if abs(dx) > abs(dy) else ("down" if dy > 0 else "up")
            assert moved == answer and max(abs(dx), abs(dy)) > 20, row["id"]
        elif row["kind"] == "order":
            colors = [s[0][0] for s in seen]
            assert colors[0] == answer and colors[-1] != answer and len(set(colors)) == 2, row["id"]
        else:
            corners = [(x // 32, y // 32) for _, (x, y) in (s[0] for s in seen)]
            groups = [corners[i : i + 2] for i in range(0, len(corners), 2)]  # the model's frame groups
            jumps = sum(first != second for first, second in groups)
            assert len(set(corners)) == 2 and jumps == synthetic_video.COUNTS.index(answer) + 1, row["id"]
            # Every jump falls inside a frame group, none between two.
            assert all(a[1] == b[0] for a, b in zip(groups, groups[1:])), row["id"]
