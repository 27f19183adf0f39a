"""Generation speed: prefill and decode tokens a second of vlmcore.generate against transformers'
`generate` on the same model, batch and settings.

    OMP_NUM_THREADS=1 python benchmarks/generation.py --preset tiny  # CPU, a tiny Qwen3-VL and Qwen3.5
    OMP_NUM_THREADS=1 python benchmarks/generation.py --preset 0.5b  # CPU, Qwen3-0.6B's shape
    python benchmarks/generation.py --preset 2b,8b --device cuda     # one GPU, Qwen3-VL-2B / 8B text shapes, bf16

Each preset is a random model of a published shape, built by transformers and saved, then loaded
natively (vlmcore.models.from_pretrained): the two implementations hold the same weights. A batch
of text prompts of different lengths (the longest `--prompt-len`, the others shorter by equal
steps) is generated greedily for `--new-tokens` tokens with no stop token by both, and the
tokens are checked equal. transformers gets the prompts left-padded (its layout), vlmcore packed
(its prefill is the training forward). Prefill tokens/s: the prompts' tokens over the time of a
generation of one token; decode tokens/s: the further tokens over the rest of the time of the
full generation (median of `--repeats`; CPU time on the CPU, wall time on a GPU). On a GPU, the batch-1 decode step is also set against its
floor: the bytes of the weights read once from the GPU's memory at its published bandwidth.
Prints a table and writes benchmarks/results/generation_<device>[_<presets>].json.
"""

import argparse
import functools
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from vlmcore.generate import Prompt, SamplingSettings, generate  # noqa: E402
from vlmcore.models import from_pretrained  # noqa: E402

VISION = dict(
    depth=2,
    hidden_size=64,
    intermediate_size=128,
    num_heads=2,
    patch_size=16,
    spatial_merge_size=2,
    temporal_patch_size=2,
    out_hidden_size=128,
    num_position_embeddings=64,
)
TINY_TEXT = dict(
    vocab_size=1024,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
)
VL_SPECIAL = dict(image_token_id=1000, video_token_id=1001, vision_start_token_id=1002, vision_end_token_id=1003)


def qwen3_vl_text(hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int) -> dict:
    return dict(
        vocab_size=151936,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=128,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 5e6,
            "mrope_section": [24, 20, 20],
            "mrope_interleaved": True,
        },
    )


# preset: (transformers config class, model class, config kwargs, dtype, batch, prompt length, new tokens)
PRESETS = {
    "tiny-qwen3_vl": (
        "Qwen3VLConfig",
        "Qwen3VLForConditionalGeneration",
        dict(
            vision_config=VISION,
            text_config=dict(
                TINY_TEXT,
                rope_parameters={
                    "rope_type": "default",
                    "rope_theta": 5e6,
                    "mrope_section": [8, 4, 4],
                    "mrope_interleaved": True,
                },
            ),
            **VL_SPECIAL,
        ),
        "float32",
        8,
        128,
        32,
    ),
    "tiny-qwen3_5": (
        "Qwen3_5Config",
        "Qwen3_5ForConditionalGeneration",
        dict(
            vision_config=VISION,
            text_config=dict(
                TINY_TEXT,
                linear_conv_kernel_dim=4,
                linear_key_head_dim=32,
                linear_value_head_dim=32,
                linear_num_key_heads=2,
                linear_num_value_heads=4,
                rope_parameters={
                    "rope_type": "default",
                    "rope_theta": 1e7,
                    "partial_rotary_factor": 0.25,
                    "mrope_section": [2, 1, 1],
                    "mrope_interleaved": True,
                },
            ),
            **VL_SPECIAL,
        ),
        "float32",
        8,
        128,
        32,
    ),
    # Qwen3-0.6B's published shape (text), fp32 on the CPU.
    "0.5b": (
        "Qwen3Config",
        "Qwen3ForCausalLM",
        dict(
            vocab_size=151936,
            hidden_size=1024,
            intermediate_size=3072,
            num_hidden_layers=28,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=128,
            tie_word_embeddings=True,
        ),
        "float32",
        4,
        128,
        16,
    ),
    # Qwen3-VL-2B / 8B-Instruct's text shapes (the vision tower left small: text prompts), bf16.
    "2b": (
        "Qwen3VLConfig",
        "Qwen3VLForConditionalGeneration",
        dict(
            vision_config=VISION,
            text_config=dict(qwen3_vl_text(2048, 6144, 28, 16, 8), tie_word_embeddings=True),
            **VL_SPECIAL,
        ),
        "bfloat16",
        16,
        512,
        128,
    ),
    "8b": (
        "Qwen3VLConfig",
        "Qwen3VLForConditionalGeneration",
        dict(vision_config=VISION, text_config=qwen3_vl_text(4096, 12288, 36, 32, 8), **VL_SPECIAL),
        "bfloat16",
        16,
        512,
        128,
    ),
}
PRESET_GROUPS = {"tiny": ["tiny-qwen3_vl", "tiny-qwen3_5"]}
GPU_BANDWIDTH = {"H100": 3.35e12, "H200": 4.8e12, "A100": 2.0e12, "GH200": 4.0e12}  # bytes/s, published


def build(preset: str, out: Path, device: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    import transformers

    config_class, model_class, kwargs, dtype, *_ = PRESETS[preset]
    config = getattr(transformers, config_class)(**kwargs)
    torch.manual_seed(0)
    with torch.device(device):
        hf = getattr(transformers, model_class)(config).to(getattr(torch, dtype)).eval()
    hf.save_pretrained(out)
    native = from_pretrained(out, dtype=getattr(torch, dtype), device=device).eval()
    return hf, native


def prompts_of(batch: int, longest: int, vocab: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    lengths = [longest - i * longest // (2 * batch) for i in range(batch)]  # from longest to about half
    return [torch.randint(0, min(vocab, 900), (n,), generator=generator) for n in lengths]


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def hf_generate(hf: torch.nn.Module, prompts: list[torch.Tensor], new_tokens: int) -> list[list[int]]:
    longest = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, longest - len(p) :], mask[row, longest - len(p) :] = p, 1
    device = hf.device
    with torch.no_grad():
        out = hf.generate(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            suppress_tokens=suppressed(hf.config),
        )
    return out[:, longest:].tolist()


def suppressed(config: object) -> list[int] | None:
    ids = [getattr(config, name, None) for name in ("image_token_id", "video_token_id")]
    return [i for i in ids if i is not None] or None


def native_generate(model: torch.nn.Module, prompts: list[torch.Tensor], new_tokens: int) -> list[list[int]]:
    samples = generate(model, [Prompt(p) for p in prompts], SamplingSettings(max_new_tokens=new_tokens))
    return [s.tokens for s in samples]


def timed(fn, device: str, repeats: int) -> tuple[float, object]:  # noqa: ANN001 (a generate call)
    """Median seconds of `repeats` calls: wall time on a GPU; on the CPU the process's CPU time
    (run with OMP_NUM_THREADS=1), which other work on a shared machine does not inflate."""
    clock = time.perf_counter if device.startswith("cuda") else time.process_time
    times, result = [], None
    for _ in range(repeats):
        synchronize(device)
        start = clock()
        result = fn()
        synchronize(device)
        times.append(clock() - start)
    return statistics.median(times), result


def measure(preset: str, device: str, repeats: int, batch: int | None) -> dict:
    _, _, _, dtype, default_batch, prompt_len, new_tokens = PRESETS[preset]
    batch = batch or default_batch
    with tempfile.TemporaryDirectory() as tmp:
        hf, native = build(preset, Path(tmp) / "model", device)
    prompts = prompts_of(batch, prompt_len, native.config.get_text_config().vocab_size)
    prompt_tokens = sum(len(p) for p in prompts)
    row = dict(preset=preset, dtype=dtype, batch=batch, prompt_tokens=prompt_tokens, new_tokens=new_tokens)
    for name, run, model in (("transformers", hf_generate, hf), ("vlmcore", native_generate, native)):
        run(model, prompts, 2)  # warm-up
        prefill_s, _ = timed(functools.partial(run, model, prompts, 1), device, repeats)
        total_s, tokens = timed(functools.partial(run, model, prompts, new_tokens), device, repeats)
        row[name] = dict(
            prefill_tokens_per_s=prompt_tokens / prefill_s,
            decode_tokens_per_s=batch * (new_tokens - 1) / max(total_s - prefill_s, 1e-9),
            total_s=total_s,
        )
        row[f"{name}_tokens"] = tokens
    row["same_tokens"] = row.pop("transformers_tokens") == row.pop("vlmcore_tokens")
    for kind in ("prefill", "decode"):
        row[f"{kind}_speedup"] = row["vlmcore"][f"{kind}_tokens_per_s"] / row["transformers"][f"{kind}_tokens_per_s"]
    if device.startswith("cuda"):
        row["batch1_decode"] = batch_one_floor(native, prompts[0], new_tokens, device, repeats)
    del hf, native
    return row


def batch_one_floor(model: torch.nn.Module, prompt: torch.Tensor, new_tokens: int, device: str, repeats: int) -> dict:
    """The batch-1 decode step's time against reading the weights once at the GPU's bandwidth."""
    name = torch.cuda.get_device_name()
    bandwidth = next((bw for key, bw in GPU_BANDWIDTH.items() if key in name), None)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    prefill_s, _ = timed(functools.partial(native_generate, model, [prompt], 1), device, repeats)
    total_s, _ = timed(functools.partial(native_generate, model, [prompt], new_tokens), device, repeats)
    step_s = (total_s - prefill_s) / (new_tokens - 1)
    floor_s = weight_bytes / bandwidth if bandwidth else None
    return dict(gpu=name, weight_bytes=weight_bytes, step_ms=step_s * 1e3, floor_ms=floor_s and floor_s * 1e3)


def print_table(rows: list[dict]) -> None:
    head = f"{'preset':<14} {'batch':>5} {'impl':<12} {'prefill tok/s':>14} {'decode tok/s':>13} {'total s':>8}"
    print(head)
    print("-" * len(head))
    for row in rows:
        for impl in ("transformers", "vlmcore"):
            r = row[impl]
            print(
                f"{row['preset']:<14} {row['batch']:>5} {impl:<12} {r['prefill_tokens_per_s']:>14.0f} "
                f"{r['decode_tokens_per_s']:>13.1f} {r['total_s']:>8.2f}"
            )
        print(
            f"{'':<14} {'':>5} {'speed-up':<12} {row['prefill_speedup']:>13.2f}x {row['decode_speedup']:>12.2f}x"
            f"   same tokens: {row['same_tokens']}"
        )
        if "batch1_decode" in row:
            b = row["batch1_decode"]
            print(
                f"{'':<20} batch-1 decode step {b['step_ms']:.2f} ms, weights-read floor {b['floor_ms']} ms ({b['gpu']})"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="tiny", help=f"comma-separated: {', '.join([*PRESET_GROUPS, *PRESETS])}")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each generation (median)")
    parser.add_argument("--batch", type=int, help="prompts per batch (default: the preset's)")
    parser.add_argument("--out", help="results JSON (default: benchmarks/results/generation_<device>[_<presets>].json)")
    args = parser.parse_args()
    presets = [p for name in args.preset.split(",") for p in PRESET_GROUPS.get(name, [name])]
    unknown = [p for p in presets if p not in PRESETS]
    if unknown:
        parser.error(f"--preset: unknown {unknown}; known: {[*PRESET_GROUPS, *PRESETS]}")
    rows = [measure(p, args.device, args.repeats, args.batch) for p in presets]
    print_table(rows)
    suffix = "" if args.preset == "tiny" else "_" + args.preset.replace(",", "_")
    out = Path(args.out or Path(__file__).parent / "results" / f"generation_{args.device.split(':')[0]}{suffix}.json")
    machine = dict(
        platform=platform.platform(),
        processor=platform.processor(),
        cpus=torch.get_num_threads(),
        torch=torch.__version__,
        gpu=torch.cuda.get_device_name() if args.device.startswith("cuda") else None,
    )
    out.write_text(json.dumps(dict(machine=machine, rows=rows), indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
