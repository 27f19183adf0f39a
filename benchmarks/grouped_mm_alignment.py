"""Do the MoE experts' grouped GEMMs still need each expert's rows padded to 8? (issue 43, item 5)

    python benchmarks/grouped_mm_alignment.py                  # Qwen3-VL-30B-A3B's expert layer, one GPU
    python benchmarks/grouped_mm_alignment.py --shape tiny     # CPU: the calling convention (a test runs it)

vlmcore's experts (`vlmcore.models.moe._grouped_forward`) copy each expert's rows into a group
padded to GROUP_ALIGN (8) rows before the two `torch._grouped_mm` calls, and take them back out
after: a zeroed buffer, an index_copy and an index_select a layer. The reason is the backward: its
weight gradient contracts over the rows, and the CUDA kernel's TMA loads need 16-byte aligned
addresses, which a group starting at a row that is not a multiple of 8 breaks (bf16). Whether the
kernel of the installed torch handles such groups itself (or refuses them, or gives wrong results)
is what this measures, on the same rows, routing and weights:

- `padded`: vlmcore's path, as the model runs it.
- `unpadded`: the same two grouped GEMMs and SwiGLU with the offsets at the raw counts: no buffer,
  no index_copy, no index_select.
- the reference: vlmcore's per-expert loop (`_loop_forward`, the CPU path) in fp32.

The routing is random top-k over the experts with one expert left empty, so most groups are not
multiples of 8. Each path runs forward and backward (an upstream gradient drawn once), eager and,
with --compile (default on a GPU), as one compiled function (inductor lowers the grouped GEMM
itself). Each output (the layer's output, the gradients of the rows and of both weights) is
compared with the per-expert loop in fp32: the error is the largest absolute difference over the
reference's largest absolute value. `unpadded` is reported as usable when it runs and its largest
error is within twice `padded`'s (plus 1e-3): bf16 rounding differs between the two, a misaligned
load does not stay within it. Timed with the device's events, the median of --steps forward and
backward passes after one warm-up. Prints a table and writes
grouped_mm_alignment_<device>_<shape>.json ($OUT or --out).
"""

import argparse
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
from common import REPO, write_results

from vlmcore.models.moe import GROUP_ALIGN, _grouped_forward, _loop_forward, _swiglu

# (experts, hidden, expert MLP width, tokens, experts a token): Qwen3-VL-30B-A3B's text MoE layer
# at the 2B preset's 8,192 tokens a step; tiny: the CPU's calling-convention run.
SHAPES = {
    "30b-a3b": dict(experts=128, dim=2048, hidden=768, tokens=8192, top_k=8),
    "tiny": dict(experts=8, dim=32, hidden=16, tokens=64, top_k=2),
}


def unpadded_forward(x: torch.Tensor, counts: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """The two grouped GEMMs over the rows as they are: each group ends at the running count."""
    offsets = counts.cumsum(0).to(torch.int32)
    h = _swiglu(torch._grouped_mm(x, gate_up.transpose(-2, -1), offs=offsets))
    return torch._grouped_mm(h, down.transpose(-2, -1), offs=offsets)


def routed_counts(shape: dict, generator: torch.Generator) -> torch.Tensor:
    """Rows per expert of a random top-k routing; expert 0 gets none (an empty group)."""
    scores = torch.rand(shape["tokens"], shape["experts"], generator=generator)
    scores[:, 0] = -1.0
    chosen = scores.topk(shape["top_k"], dim=-1).indices.flatten()
    return torch.zeros(shape["experts"], dtype=torch.int64).scatter_add_(0, chosen, torch.ones_like(chosen))


def forward_backward(forward, inputs: dict, upstream: torch.Tensor) -> list[torch.Tensor]:
    """The layer's output and the gradients of the rows and both weights."""
    leaves = [inputs[name].detach().requires_grad_() for name in ("x", "gate_up", "down")]
    x, gate_up, down = leaves
    out = forward(x, inputs["counts"], gate_up, down)
    grads = torch.autograd.grad(out, leaves, upstream)
    return [out.detach(), *grads]


def relative_error(result: torch.Tensor, reference: torch.Tensor) -> float:
    scale = reference.abs().max().clamp_min(1e-12)
    return ((result.float() - reference).abs().max() / scale).item()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_ms(forward, inputs: dict, upstream: torch.Tensor, steps: int, device: torch.device) -> float:
    forward_backward(forward, inputs, upstream)  # warm-up (and compilation)
    times = []
    for _ in range(steps):
        synchronize(device)
        start = time.perf_counter()
        forward_backward(forward, inputs, upstream)
        synchronize(device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def measure(shape_name: str, device: torch.device, compile_too: bool, steps: int) -> dict:
    shape = SHAPES[shape_name]
    generator = torch.Generator().manual_seed(0)
    counts = routed_counts(shape, generator)
    rows = int(counts.sum())
    experts, dim, hidden = shape["experts"], shape["dim"], shape["hidden"]
    inputs = {
        "x": torch.randn(rows, dim, generator=generator),
        "gate_up": torch.randn(experts, 2 * hidden, dim, generator=generator) * dim**-0.5,
        "down": torch.randn(experts, dim, hidden, generator=generator) * hidden**-0.5,
    }
    upstream = torch.randn(rows, dim, generator=generator).to(device, torch.bfloat16)
    bf16_inputs = {k: v.to(device, torch.bfloat16) for k, v in inputs.items()}
    # The reference multiplies the same bf16 values in fp32: the errors are the paths' own.
    reference = forward_backward(
        _loop_forward, {**{k: v.float() for k, v in bf16_inputs.items()}, "counts": counts}, upstream.float()
    )
    bf16_inputs["counts"] = counts.to(device)

    paths = {"padded": _grouped_forward, "unpadded": unpadded_forward}
    variants = [(name, False) for name in paths] + ([(name, True) for name in paths] if compile_too else [])
    cases = []
    padded_results = {}  # compiled -> the padded path's results, which the unpadded one's are compared with
    for name, compiled in variants:
        forward = torch.compile(paths[name], fullgraph=True) if compiled else paths[name]
        case = {"path": name, "compiled": compiled}
        try:
            results = forward_backward(forward, bf16_inputs, upstream)
            errors = [relative_error(r, ref) for r, ref in zip(results, reference)]
            case.update(
                runs=True,
                errors=dict(zip(("output", "grad_rows", "grad_gate_up", "grad_down"), errors)),
                max_error=max(errors),
                ms=time_ms(forward, bf16_inputs, upstream, steps, device),
            )
            case["bit_equal_to_padded"] = None
            if name == "padded":
                padded_results[compiled] = results
            elif compiled in padded_results:
                case["bit_equal_to_padded"] = all(torch.equal(a, b) for a, b in zip(results, padded_results[compiled]))
        except Exception as error:  # refused by the kernel: a finding, not a failure of the command
            case.update(
                runs=False, error=f"{type(error).__name__}: {error}"[:2000], traceback=traceback.format_exc()[-3000:]
            )
        cases.append(case)
        torch._dynamo.reset()

    for compiled in (False, True):
        padded = next((c for c in cases if c["path"] == "padded" and c["compiled"] == compiled), None)
        unpadded = next((c for c in cases if c["path"] == "unpadded" and c["compiled"] == compiled), None)
        if padded and unpadded:
            unpadded["usable"] = bool(
                unpadded["runs"] and padded["runs"] and unpadded["max_error"] <= 2 * padded["max_error"] + 1e-3
            )
    return {
        "shape": shape_name,
        **shape,
        "rows": rows,
        "counts_not_multiple_of_align": int((counts % GROUP_ALIGN != 0).sum()),
        "empty_experts": int((counts == 0).sum()),
        "group_align": GROUP_ALIGN,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else f"CPU ({os.cpu_count()} cores)",
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "steps": steps,
        "cases": cases,
    }


def print_table(result: dict) -> None:
    print(
        f"{result['shape']}: {result['experts']} experts, hidden {result['dim']}, expert MLP {result['hidden']}, "
        f"{result['rows']:,} rows ({result['counts_not_multiple_of_align']} groups not a multiple of "
        f"{result['group_align']}, {result['empty_experts']} empty), bf16, {result['device']}, torch {result['torch']}"
    )
    print("| path | compiled | runs | max error vs fp32 loop | bit-equal to padded | usable | fwd+bwd ms |")
    print("|---|---|---|---|---|---|---|")
    for case in result["cases"]:
        if not case["runs"]:
            print(f"| {case['path']} | {case['compiled']} | no: {case['error'][:80]} | | | no | |")
            continue
        equal = "" if case.get("bit_equal_to_padded") is None else case["bit_equal_to_padded"]
        print(
            f"| {case['path']} | {case['compiled']} | yes | {case['max_error']:.2e} | {equal} "
            f"| {case.get('usable', '')} | {case['ms']:.2f} |"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="30b-a3b", choices=sorted(SHAPES))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None, help="default: on a GPU")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", REPO / "benchmarks" / "results")))
    args = parser.parse_args()
    device = torch.device(args.device)
    compile_too = args.compile if args.compile is not None else device.type == "cuda"

    result = measure(args.shape, device, compile_too, args.steps)
    print_table(result)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"grouped_mm_alignment_{device.type}_{args.shape}.json"
    write_results(path, result)
    print(f"wrote {path}")
    padded_ok = all(c["runs"] and c["max_error"] < 0.05 for c in result["cases"] if c["path"] == "padded")
    return 0 if padded_ok else 1


if __name__ == "__main__":
    sys.exit(main())
