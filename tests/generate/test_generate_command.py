"""`vlmcore generate` on the tiny demo model: the answer on stdout is transformers' greedy answer
to the same chat prompt (its processor's encoding of the image), and a video and a stage's
final/ weights run through the same command; refusals are one line with exit code 2."""

import io
from contextlib import redirect_stdout

import numpy as np
import pytest
import torch
from helpers import perturbed, write_final_checkpoint
from helpers import tiny_hf_snapshot as tiny_snapshot
from PIL import Image
from transformers import Qwen3VLForConditionalGeneration

from vlmcore import cli
from vlmcore.data.media.encoder import SampleEncoder
from vlmcore.data.media.processor import load_processor
from vlmcore.data.media.video import encode_clip
from vlmcore.generate import SamplingSettings, generate
from vlmcore.generate.command import encode_prompt, load_model


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    root = tmp_path_factory.mktemp("generate")
    model = tiny_snapshot("qwen3_vl", root / "model")
    rng = np.random.default_rng(0)
    image = root / "image.png"
    Image.fromarray(rng.integers(0, 255, (64, 96, 3), dtype=np.uint8)).save(image)
    video = root / "clip.mp4"
    frames = [rng.integers(0, 255, (64, 64, 3), dtype=np.uint8) for _ in range(8)]
    video.write_bytes(encode_clip(frames, 4, codec="mpeg4"))
    return model, image, video


def run_cli(*argv):
    out = io.StringIO()
    with redirect_stdout(out):
        code = cli.main(["generate", *map(str, argv)])
    return code, out.getvalue()


def test_answer_equals_transformers_generate_on_the_processor_encoding(demo):
    model, image, _ = demo
    code, out = run_cli(
        "--model", model, "--prompt", "What is in the picture?", "--image", image, "--max-new-tokens", 6
    )
    assert code == 0
    processor = load_processor(model)  # transformers' own (image-only without torchvision)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is in the picture?"}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = processor(text=[text], images=[Image.open(image)], return_tensors="pt")
    hf = Qwen3VLForConditionalGeneration.from_pretrained(model).eval()
    ref = hf.generate(**inputs, max_new_tokens=6, do_sample=False, suppress_tokens=[hf.config.image_token_id])
    answer = processor.tokenizer.decode(ref[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert out == answer + "\n"


def test_a_video_and_sampled_answers(demo):
    model, _, video = demo
    code, out = run_cli(
        "--model", model, "--prompt", "Describe.", "--video", video, "--max-new-tokens", 4,
        "--temperature", 0.9, "--n", 2, "--seed", 3,
    )  # fmt: skip
    assert code == 0
    encoder = SampleEncoder(model)
    prompt = encode_prompt(encoder, "Describe.", [], str(video))
    assert prompt.video_grid_thw is not None and prompt.pixel_values_videos.dtype == torch.float32
    settings = SamplingSettings(max_new_tokens=4, temperature=0.9, n=2, seed=3)
    samples = generate(load_model(str(model), None, "cpu"), [prompt], settings, tokenizer=encoder.tokenizer)
    assert out == "".join(f"--- sample {i}\n{s.text}\n" for i, s in enumerate(samples))


def test_a_stages_final_weights(demo, tmp_path):
    """--checkpoint final/ --model snapshot: the trained weights answer, not the snapshot's."""
    model, image, _ = demo
    trained = perturbed(load_model(str(model), None, "cpu"), seed=2)
    final = write_final_checkpoint(trained, tmp_path / "train" / "sft")
    argv = ("--model", model, "--prompt", "Hello", "--image", image, "--max-new-tokens", 5)
    code, out = run_cli(*argv, "--checkpoint", final)
    assert code == 0
    encoder = SampleEncoder(model)
    prompt = encode_prompt(encoder, "Hello", [str(image)], None)
    [expected] = generate(trained, [prompt], SamplingSettings(max_new_tokens=5), tokenizer=encoder.tokenizer)
    assert out == expected.text + "\n"
    assert run_cli(*argv)[1] != out, "the snapshot's answer: the checkpoint was not used"


def test_help_and_refusals(demo, capsys):
    model, image, _ = demo
    code, out = run_cli("--help")
    assert code == 0 and "--checkpoint" in out and "--video" in out
    refusals = {
        ("--top-p", "1.5"): "top_p",
        ("--n", "2"): "n=2",  # several samples of greedy decoding
        ("--max-new-tokens", "100000"): "max_position_embeddings",
    }
    for extra, message in refusals.items():
        code, out = run_cli("--model", model, "--prompt", "hi", "--image", image, *extra)
        assert code == 2 and out == ""
        assert message in capsys.readouterr().err
