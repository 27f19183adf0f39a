"""Forward + backward time of the native models vs transformers, same weights, same batch.

    OMP_NUM_THREADS=1 python benchmarks/models.py            # CPU, small configs (~3 min)
    python benchmarks/models.py --device cuda --dtype bfloat16

Each case builds a random transformers model, saves it, loads it with
`vlmcore.models.from_pretrained`, then times `cross_entropy(model(...).logits).backward()` for
both: median of --repeat rounds after a warm-up, the models taking turns; on CPU the clock is
CPU time (see `time_interleaved`). The native model also runs the same row packed as 4 segments
(`cu_seqlens`; the VL rows hold one image per segment). Families: Qwen3, Qwen3-VL (DeepStack at
2 vision layers), Qwen3.5 (3 Gated DeltaNet layers + 1 gated attention layer). GFLOP is the
training cost of the unpacked row by `vlmcore.models.flops` (LLM + vision tower). Prints a table
and writes benchmarks/results/models.json.
"""

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers
from common import write_results

import vlmcore.models as models
from vlmcore.models import flops
from vlmcore.tiny import BENCHMARK_SPECIAL, BENCHMARK_VISION, benchmark_config

FAMILIES = ("qwen3", "qwen3_vl", "qwen3_5")
SEGMENTS = 4
IMAGE_GRID = (1, 16, 24)  # patches; one image of 96 LLM tokens in each segment


def hf_model(family: str):
    config = benchmark_config(family)
    cls = {
        "qwen3": transformers.Qwen3ForCausalLM,
        "qwen3_vl": transformers.Qwen3VLForConditionalGeneration,
        "qwen3_5": transformers.Qwen3_5ForConditionalGeneration,
    }[family]
    return cls(config)


def batch(family: str, seq_len: int, generator):
    """One row of `seq_len` tokens, for the VL families with one image at the start of each of the
    SEGMENTS equal segments (so that the row can also run packed)."""
    ids = torch.randint(0, 4000, (1, seq_len), generator=generator)
    if family == "qwen3":
        return dict(input_ids=ids)
    t, h, w = IMAGE_GRID
    image_tokens = t * h * w // BENCHMARK_VISION["spatial_merge_size"] ** 2
    if seq_len // SEGMENTS <= image_tokens:
        raise ValueError(
            f"--seq-len {seq_len}: each of the {SEGMENTS} segments must hold an image of "
            f"{image_tokens} tokens (use at least {SEGMENTS * (image_tokens + 1)})"
        )
    for start in range(0, seq_len, seq_len // SEGMENTS):
        ids[0, start + 1 : start + 1 + image_tokens] = BENCHMARK_SPECIAL["image_token_id"]
    grid = torch.tensor([IMAGE_GRID] * SEGMENTS)
    pixels = torch.randn(SEGMENTS * t * h * w, 3 * 2 * 16 * 16, generator=generator)
    return dict(input_ids=ids, pixel_values=pixels, image_grid_thw=grid)


def time_interleaved(steps: dict, repeat: int, device) -> dict:
    """Median milliseconds of each `step()`; the first round is a warm-up. On CPU the clock is the
    process's CPU time, which other jobs on a shared machine do not inflate (with one thread it
    equals the compute time); on CUDA it is wall time between synchronizations."""
    clock = time.perf_counter if device.type == "cuda" else time.process_time
    times = {name: [] for name in steps}
    for i in range(repeat + 1):
        for name, step in steps.items():
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = clock()
            step()
            if device.type == "cuda":
                torch.cuda.synchronize()
            if i:
                times[name].append(1000 * (clock() - start))
    return {name: statistics.median(t) for name, t in times.items()}


def loss_of(logits, ids):
    return F.cross_entropy(logits[0, :-1].float(), ids[0, 1:])


def run_case(family: str, seq_len: int, repeat: int, device, dtype) -> dict:
    torch.manual_seed(0)
    hf = hf_model(family)
    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(tmp)
        native = models.from_pretrained(tmp, dtype=dtype, device=device).train()
    hf = hf.to(device=device, dtype=dtype).train()
    inputs = {k: v.to(device) for k, v in batch(family, seq_len, torch.Generator().manual_seed(1)).items()}
    if "pixel_values" in inputs:
        inputs["pixel_values"] = inputs["pixel_values"].to(dtype)
    ids = inputs["input_ids"]
    hf_inputs = inputs
    if family != "qwen3":
        hf_inputs = dict(inputs, mm_token_type_ids=(ids == BENCHMARK_SPECIAL["image_token_id"]).int())
    cu = torch.arange(0, seq_len + 1, seq_len // SEGMENTS, dtype=torch.int32, device=device)

    def native_step(cu_seqlens=None):
        def step():
            native.zero_grad(set_to_none=True)
            loss_of(native(**inputs, cu_seqlens=cu_seqlens).logits, ids).backward()

        return step

    def hf_step():
        hf.zero_grad(set_to_none=True)
        loss_of(hf(**hf_inputs).logits, ids).backward()

    steps = {"native_ms": native_step(), "native_packed_ms": native_step(cu), "transformers_ms": hf_step}
    row = dict(
        family=family,
        tokens=seq_len,
        params=sum(p.numel() for p in native.parameters()),
        images=0 if family == "qwen3" else SEGMENTS,
        **time_interleaved(steps, repeat, device),
    )
    row["speedup"] = row["transformers_ms"] / row["native_ms"]
    # Training FLOPs of the unpacked row by vlmcore.models.flops, LLM and vision tower together.
    grid = inputs.get("image_grid_thw")
    gflop = (flops.llm_flops(native.config, [seq_len]) + flops.vision_flops(native.config, grid)) / 1e9
    row["gflop"] = gflop
    row["native_gflops"] = gflop / (row["native_ms"] / 1000)
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "models.json"))
    args = parser.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)

    rows = [run_case(family, args.seq_len, args.repeat, device, dtype) for family in FAMILIES]
    print(
        f"{'family':<9} {'params':>10} {'tokens':>7} {'images':>7} {'GFLOP':>7} {'native ms':>10} "
        f"{'packed x' + str(SEGMENTS) + ' ms':>13} {'transformers ms':>16} {'speedup':>8} {'native GFLOP/s':>15}"
    )
    for r in rows:
        print(
            f"{r['family']:<9} {r['params']:>10,} {r['tokens']:>7} {r['images']:>7} {r['gflop']:>7.1f} "
            f"{r['native_ms']:>10.1f} {r['native_packed_ms']:>13.1f} {r['transformers_ms']:>16.1f} "
            f"{r['speedup']:>8.2f} {r['native_gflops']:>15.1f}"
        )
    out = Path(args.out)
    meta = dict(
        device=args.device,
        dtype=args.dtype,
        threads=torch.get_num_threads(),
        torch=torch.__version__,
        transformers=transformers.__version__,
        repeat=args.repeat,
        what="forward + backward, median ms",
        clock="wall" if device.type == "cuda" else "process CPU time",
    )
    write_results(out, dict(meta, results=rows))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
