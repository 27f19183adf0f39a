"""What torch.compile saves of a decoder block's activations (issue 43, item 6), measured on CPU.

    OMP_NUM_THREADS=1 python benchmarks/compiled_activations.py --preset 2b   # Qwen3 2B / Qwen3-VL 2B's text layer
    OMP_NUM_THREADS=1 python benchmarks/compiled_activations.py --preset 8b

A compiled block keeps less for its backward than the eager ops it replaces: AOTAutograd's
min-cut partitioner recomputes the cheap elementwise ops in backward (the norms' scaling, SiLU,
RoPE) instead of saving their outputs. `vlmcore memory` runs on fake tensors, where inductor's
kernels cannot run; with `parallel.compile` it runs the blocks through that partitioner instead
(vlmcore.train.memory._compile_blocks). This measures what the partitioner saves, layer by layer.

This counts, for one decoder layer of the preset's widths (one layer, real tensors, bf16, a short
row), the bytes of the tensors that autograd saves for backward in the layer's forward, eagerly
and compiled (the layer's input and weights left out: they are held either way). Compiled with
`aot_eager_decomp_partition` (default: AOTAutograd's partitioner and decompositions, the graphs run
eagerly, seconds) or `inductor` (what training compiles with; the same saved set, minutes on CPU).
The saved bytes are per token of the row: the ratio of the two does not depend on the row's
length nor on the width at the same proportions (measured: 0.601 at hidden sizes 256, 512 and 1024).

It then predicts the compiled step's peak from the eager one by hand, a check of the estimate's
model: peak_compiled = peak_eager - layers x tokens x (eager - compiled bytes per token), against the
prediction with the H200 peaks that benchmarks/train_step.py measured for the same preset
(benchmarks/results/train_step_cuda_h200_2b_all_*.json), where the results exist.

Prints a table and writes benchmarks/results/compiled_activations_cpu_<preset>.json ($OUT or --out).
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
from common import PRESETS, REPO, write_results

# The text fields of a decoder layer, read from Qwen3-VL-8B's published architecture for "8b".
TEXT_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
)
# The H200 measurements of the bare step (benchmarks/train_step.py --preset 2b --all), by family.
H200_RESULTS = {
    "qwen3": "train_step_cuda_h200_2b_all_qwen3_2026-11-28.json",
    "qwen3_vl": "train_step_cuda_h200_2b_all_qwen3_vl_2026-11-28.json",
}


def decoder_layer(preset: dict, dtype: torch.dtype) -> tuple[torch.nn.Module, torch.nn.Module]:
    """A one-layer Qwen3 text model of the preset's widths (vocabulary cut: it is no part of a
    layer) and its layer, weights random."""
    from transformers import Qwen3Config

    from vlmcore.models import build_model

    text = dict(preset["text"], num_hidden_layers=1, vocab_size=512)
    model = build_model(Qwen3Config(**text), device="cpu")
    for parameter in model.parameters():
        torch.nn.init.normal_(parameter, std=0.02)
    model = model.to(dtype)
    return model, model.model.layers[0]


def saved_bytes(layer: torch.nn.Module, forward, inputs: tuple[torch.Tensor, ...]) -> int:
    """Bytes of the distinct storages that autograd saves in `forward(*inputs)`, less the layer's
    weights and the inputs; a backward then frees them."""
    saved = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = forward(*inputs)
    out.float().sum().backward()
    held = {t.untyped_storage().data_ptr() for t in (*layer.parameters(), *inputs)}
    return sum(n for ptr, n in saved.items() if ptr not in held)


def preset_of(name: str) -> dict:
    """A benchmark preset (common.py), or for "8b" Qwen3-VL-8B's language model (benchmarks/recipe_models.py)."""
    from recipe_models import MODELS

    if name != "8b":
        return PRESETS[name]
    text = MODELS["Qwen/Qwen3-VL-8B-Instruct"]().text_config
    return {"text": {field: getattr(text, field) for field in TEXT_FIELDS}}


def measure(preset_name: str, seq_len: int, backend: str) -> dict:
    preset = preset_of(preset_name)
    torch.manual_seed(0)
    model, layer = decoder_layer(preset, torch.bfloat16)
    hidden = preset["text"]["hidden_size"]
    x = torch.randn(1, seq_len, hidden, dtype=torch.bfloat16, requires_grad=True)
    cos, sin = model.model.rotary(torch.arange(seq_len)[None], torch.bfloat16)
    inputs = (x, cos, sin)

    def forward(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, run=layer) -> torch.Tensor:
        return run(x, cos, sin, None)

    eager = saved_bytes(layer, forward, inputs)
    compiled_layer = torch.compile(layer, backend=backend)
    started = time.perf_counter()
    compiled = saved_bytes(layer, lambda *a: forward(*a, run=compiled_layer), inputs)
    compile_s = time.perf_counter() - started
    return {
        "preset": preset_name,
        "text": preset["text"],
        "seq_len": seq_len,
        "backend": backend,
        "dtype": "bfloat16",
        "eager_bytes_per_token": eager / seq_len,
        "compiled_bytes_per_token": compiled / seq_len,
        "ratio": compiled / eager,
        "compile_and_step_s": compile_s,
    }


def predictions(result: dict) -> list[dict]:
    """The compiled peak predicted from the eager one, against the H200's, per family measured."""
    if result["preset"] not in PRESETS:
        return []
    preset = PRESETS[result["preset"]]
    layers = preset["text"]["num_hidden_layers"]
    tokens = preset["seq_len"]  # one row a step (train_step.py's batch)
    saved = layers * tokens * (result["eager_bytes_per_token"] - result["compiled_bytes_per_token"])
    rows = []
    for family, name in H200_RESULTS.items():
        path = REPO / "benchmarks" / "results" / name
        if result["preset"] != "2b" or not path.is_file():
            continue
        cases = {case["compile"]: case["results"]["vlmcore"] for case in json.loads(path.read_text())["cases"]}
        eager_peak = cases[False]["peak_mem_gib"]
        compiled_peak = cases[True]["peak_mem_gib"]
        predicted = eager_peak - saved / 2**30
        rows.append(
            {
                "family": family,
                "h200_eager_peak_gib": eager_peak,
                "h200_compiled_peak_gib": compiled_peak,
                "estimate_gib": cases[True]["estimated_peak_gib"],
                "predicted_compiled_peak_gib": predicted,
                "error": predicted / compiled_peak - 1,
            }
        )
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="2b", choices=["tiny", "2b", "8b"])
    parser.add_argument("--seq-len", type=int, default=512, help="tokens of the measured row")
    parser.add_argument(
        "--backend", default="aot_eager_decomp_partition", choices=["aot_eager_decomp_partition", "inductor"]
    )
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", REPO / "benchmarks" / "results")))
    args = parser.parse_args()

    result = measure(args.preset, args.seq_len, args.backend)
    result["predictions"] = predictions(result)
    result["torch"] = torch.__version__
    text = result["text"]
    print(
        f"{args.preset} decoder layer (hidden {text['hidden_size']}, MLP {text['intermediate_size']}, "
        f"{text['num_attention_heads']}/{text['num_key_value_heads']} heads of {text['head_dim']}), bf16, "
        f"{args.seq_len} tokens, {args.backend}:"
    )
    print("| saved for backward, bytes per token | eager | compiled | compiled / eager |")
    print("|---|---|---|---|")
    print(
        f"| one layer | {result['eager_bytes_per_token']:,.0f} | {result['compiled_bytes_per_token']:,.0f} "
        f"| {result['ratio']:.3f} |"
    )
    if result["predictions"]:
        print()
        print("| family | H200 eager peak | H200 compiled peak | estimate today | predicted compiled peak | error |")
        print("|---|---|---|---|---|---|")
        for row in result["predictions"]:
            print(
                f"| {row['family']} | {row['h200_eager_peak_gib']:.2f} GiB | {row['h200_compiled_peak_gib']:.2f} GiB "
                f"| {row['estimate_gib']:.2f} GiB | {row['predicted_compiled_peak_gib']:.2f} GiB | {row['error']:+.1%} |"
            )
    path = args.out / f"compiled_activations_cpu_{args.preset}.json"
    write_results(path, result)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
