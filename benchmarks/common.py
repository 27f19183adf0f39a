"""What the benchmark scripts share: the model presets and their random snapshots, the run
config of the engine's step, `vlmcore train` in processes of their own, result files and tables.

A script run as `python benchmarks/X.py` has benchmarks/ first on sys.path: `from common import ...`
needs nothing more. The tiny model configs of the tests are vlmcore.tiny's; these presets are the
benchmarks' own sizes (CPU-sized up to one GPU's worth of a released model's layers). Torch is
imported where a function needs it, so that a script that only writes a table does not wait for it.
"""

from __future__ import annotations

import gc
import json
import os
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from vlmcore.tiny import BENCHMARK_TEXT

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"

if TYPE_CHECKING:
    import torch

DENSE, MOE = ("qwen3_vl", "qwen3"), ("qwen3_vl_moe", "qwen3_moe")
PRESETS = {
    # CPU-sized: big enough that matmuls, not Python, dominate. The MoE families put 8 experts,
    # top-2, of half the dense MLP in every layer: a token costs what it costs in the dense model.
    "tiny": dict(
        text=BENCHMARK_TEXT,  # benchmarks/models.py's width
        moe=dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=384),
        vision=dict(depth=2, hidden_size=128, intermediate_size=256, num_heads=2, out_hidden_size=256),
        seq_len=1024,
        image_side=2,
        families=DENSE + MOE,
    ),
    # Qwen3-VL-2B / Qwen3-1.7B class.
    "2b": dict(
        text=dict(
            vocab_size=151936,
            hidden_size=2048,
            intermediate_size=6144,
            num_hidden_layers=28,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=128,
        ),
        vision=dict(depth=24, hidden_size=1024, intermediate_size=4096, num_heads=16, out_hidden_size=2048),
        # One 512x512 image per row (32x32 patches, 256 LLM tokens) among 16 packed samples.
        seq_len=8192,
        image_side=16,
        families=DENSE,
    ),
    # Qwen3-VL-30B-A3B / Qwen3-30B-A3B (benchmarks/recipe_models.py) with 4 of the 48 layers, so
    # that weights, gradients and AdamW states (3.7B parameters, 16 bytes each: 59 GB) fit one GPU.
    "30b-a3b": dict(
        text=dict(
            vocab_size=151936,
            hidden_size=2048,
            intermediate_size=6144,
            num_hidden_layers=4,
            num_attention_heads=32,
            num_key_value_heads=4,
            head_dim=128,
        ),
        moe=dict(num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768),
        vision=dict(
            depth=27,
            hidden_size=1152,
            intermediate_size=4304,
            num_heads=16,
            out_hidden_size=2048,
            deepstack_visual_indexes=[8, 16, 24],
        ),
        seq_len=8192,
        image_side=16,
        families=MOE,
    ),
}


# family: (transformers config class, model class)
HF_CLASSES = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "qwen3_vl": ("Qwen3VLConfig", "Qwen3VLForConditionalGeneration"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "qwen3_vl_moe": ("Qwen3VLMoeConfig", "Qwen3VLMoeForConditionalGeneration"),
}


def hf_config(family: str, preset: dict):
    import transformers

    text = dict(preset["text"], max_position_embeddings=32768, tie_word_embeddings=family in DENSE)
    if family in MOE:
        text.update(preset["moe"], norm_topk_prob=True, router_aux_loss_coef=0.001)
    config_class = getattr(transformers, HF_CLASSES[family][0])
    if family in ("qwen3", "qwen3_moe"):
        return config_class(**text)
    half = text["head_dim"] // 2
    rope = {
        "rope_type": "default",
        "rope_theta": 5e6,
        "mrope_interleaved": True,
        "mrope_section": [half - 2 * (half * 5 // 16), half * 5 // 16, half * 5 // 16],
    }
    vision = dict(
        dict(deepstack_visual_indexes=[0]),
        **preset["vision"],
        patch_size=16,
        spatial_merge_size=2,
        temporal_patch_size=2,
        num_position_embeddings=2304,
    )
    vocab = text["vocab_size"]
    return config_class(
        vision_config=vision,
        text_config=dict(text, rope_parameters=rope),
        image_token_id=vocab - 6,
        vision_start_token_id=vocab - 5,
        vision_end_token_id=vocab - 4,
        video_token_id=vocab - 3,
        tie_word_embeddings=text["tie_word_embeddings"],
    )


def write_snapshot(family: str, config, path: Path, on_meta: bool = False, dtype: torch.dtype | None = None) -> None:
    """A snapshot of random weights of `config` (seed 0): transformers' own initialisation, or
    (`on_meta`: a model too big to initialise on the CPU in reasonable time) made on the meta
    device with its weights drawn from N(0, 0.02) in place. Written next to `path` and renamed
    when whole, so that a snapshot cut short is never read."""
    import torch
    import transformers

    cls = getattr(transformers, HF_CLASSES[family][1])
    torch.manual_seed(0)
    with torch.device("meta" if on_meta else "cpu"):
        model = cls(config)
    if dtype is not None:
        model = model.to(dtype)
    if on_meta:
        model = model.to_empty(device="cpu")
        with torch.no_grad():
            for param in model.parameters():
                param.normal_(0.0, 0.02)
    partial = path.with_name(path.name + ".partial")
    model.save_pretrained(partial, max_shard_size="5GB")
    partial.rename(path)


def train_config(path: Path, output_dir: Path, device: torch.device, compile: bool):
    """The engine's run config of a benchmark's step: bf16 compute on a GPU (fp32 on the CPU),
    AdamW at lr 1e-4, the loss in chunks of 2048 tokens; the script sets what it measures."""
    from vlmcore.config import TrainConfig

    cfg = TrainConfig(model_path=str(path), output_dir=str(output_dir))
    cfg.parallel.compile = compile
    cfg.precision.param_dtype = "bfloat16" if device.type == "cuda" else "float32"
    cfg.optimizer.lr = 1e-4
    cfg.loss_chunk_tokens = 2048
    return cfg


def release_device_memory(device: torch.device) -> None:
    """Hands the GPU memory of a finished engine back to the driver: the real loop runs in a
    process of its own, which on an 80 GB GPU does not fit beside this one's cached blocks."""
    import torch

    if device.type == "cuda":
        gc.collect()
        torch._dynamo.reset()  # compiled code holds the model's modules
        torch.cuda.empty_cache()


def src_env(src: Path = REPO / "src", cpu: bool = True) -> dict:
    """This process's environment with `src` first on PYTHONPATH (the checkout's code, installed
    or not); on the CPU one thread per process unless OMP_NUM_THREADS says otherwise."""
    env = dict(os.environ, PYTHONPATH=f"{src}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    if cpu:
        env.setdefault("OMP_NUM_THREADS", "1")
    return env


def torchrun(nproc: int, *args: str) -> list[str]:
    """The command line of `torchrun --standalone --nproc_per_node=nproc ARGS` (ARGS: a script
    and its arguments, or `-m MODULE ...`) under this interpreter."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *args]


def train_command(nproc: int, config: Path, *args: str) -> list[str]:
    """`vlmcore train CONFIG ARGS` as a command line: under this interpreter for one process,
    under torchrun for more."""
    train = ["-m", "vlmcore.cli", "train", str(config), *args]
    return [sys.executable, *train] if nproc == 1 else torchrun(nproc, *train)


def write_run_config(path: Path, model_path: Path, output_dir: Path, **overrides) -> Path:
    """vlmcore.tiny.run_config (a short run on random data) written to `path`."""
    import yaml

    from vlmcore.tiny import run_config

    path.write_text(yaml.safe_dump(run_config(model_path, output_dir, **overrides)))
    return path


def read_metrics(run_dir: Path) -> list[dict]:
    """The records of a run's metrics.jsonl, one per step ([] before the first)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def write_results(path: Path, result) -> None:
    """A results file: `result` as indented JSON."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")


def print_table(columns: list[tuple[str, str]], rows: list[list]) -> None:
    """A table of fixed-width columns, each (header, format spec of its cells, e.g. ">9.3f"). The
    header, a string cell and a cell None (printed "-") take the spec's alignment and width; a
    row may stop early (a note in place of its last figures)."""

    def width(spec: str) -> str:
        return re.match(r"[<>^]?\d*", spec).group()

    def cell(value, spec: str) -> str:
        if value is None or isinstance(value, str):
            return format("-" if value is None else value, width(spec))
        return format(value, spec)

    print("".join(format(header, width(spec)) for header, spec in columns))
    for row in rows:
        print("".join(cell(value, spec) for value, (_, spec) in zip(row, columns)), flush=True)
