"""Shared pieces of the training-engine tests: tiny HF snapshots written by transformers, run
configs, launching `vlmcore train` (one process or torchrun on gloo), reading its outputs.

Also a script (under torchrun or not):
- `python tests/_train_helpers.py dump-state CONFIG OUT.safetensors` builds the stage's parallel
  model and optimizer, loads the latest checkpoint and writes the full model and optimizer state
  from rank 0: what the reshard tests compare.
- `python tests/_train_helpers.py train-cases CONFIG ...` trains each config in turn, as
  `vlmcore train CONFIG` does (train_cases).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
import yaml

REPO = Path(__file__).resolve().parents[1]

TEXT = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
)
VISION = dict(
    depth=2,
    hidden_size=32,
    intermediate_size=64,
    num_heads=2,
    patch_size=16,
    spatial_merge_size=2,
    temporal_patch_size=2,
    out_hidden_size=64,
    num_position_embeddings=64,
)
# Mixture-of-experts text settings: 4 experts, 2 per token, a strong load-balancing coefficient
# so that its gradients show in the exactness comparisons.
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, router_aux_loss_coef=0.05)
SPECIAL = dict(image_token_id=250, video_token_id=253, vision_start_token_id=251, vision_end_token_id=252)


def hf_config(kind: str):
    import transformers

    if kind == "qwen3":
        return transformers.Qwen3Config(**TEXT, tie_word_embeddings=True)
    if kind == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**TEXT, **MOE, norm_topk_prob=True, tie_word_embeddings=False)
    if kind == "qwen3_vl":
        rope = {"rope_type": "default", "rope_theta": 5e6, "mrope_section": [4, 2, 2], "mrope_interleaved": True}
        return transformers.Qwen3VLConfig(
            vision_config=dict(VISION, deepstack_visual_indexes=[0]),
            text_config=dict(TEXT, rope_parameters=rope),
            **SPECIAL,
        )
    if kind == "qwen3_vl_moe":
        rope = {"rope_type": "default", "rope_theta": 5e6, "mrope_section": [4, 2, 2], "mrope_interleaved": True}
        return transformers.Qwen3VLMoeConfig(
            vision_config=dict(VISION, deepstack_visual_indexes=[0]),
            text_config=dict(TEXT, **MOE, rope_parameters=rope),
            **SPECIAL,
        )
    if kind in ("qwen3_5", "qwen3_5_moe"):
        rope = {
            "rope_type": "default",
            "rope_theta": 1e7,
            "partial_rotary_factor": 0.25,
            "mrope_section": [1, 1, 0],
            "mrope_interleaved": True,
        }
        text = dict(
            TEXT,
            num_hidden_layers=4,
            linear_conv_kernel_dim=4,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            rope_parameters=rope,
        )
        if kind == "qwen3_5":
            return transformers.Qwen3_5Config(vision_config=VISION, text_config=text, **SPECIAL)
        text = {k: v for k, v in text.items() if k != "intermediate_size"}  # every layer is sparse
        return transformers.Qwen3_5MoeConfig(
            vision_config=VISION, **SPECIAL, text_config=dict(text, **MOE, shared_expert_intermediate_size=32)
        )
    raise ValueError(kind)


def tiny_snapshot(kind: str, path: Path, seed: int = 0, **text) -> Path:
    """An HF snapshot directory (config.json + model.safetensors) of a tiny random model; `text`:
    settings of its language model that differ from hf_config's."""
    import transformers

    if (path / "config.json").exists():
        return path
    torch.manual_seed(seed)
    config = hf_config(kind)
    for key, value in text.items():
        setattr(config.get_text_config(), key, value)
    cls = {
        "qwen3": transformers.Qwen3ForCausalLM,
        "qwen3_moe": transformers.Qwen3MoeForCausalLM,
        "qwen3_vl": transformers.Qwen3VLForConditionalGeneration,
        "qwen3_vl_moe": transformers.Qwen3VLMoeForConditionalGeneration,
        "qwen3_5": transformers.Qwen3_5ForConditionalGeneration,
        "qwen3_5_moe": transformers.Qwen3_5MoeForConditionalGeneration,
    }[kind]
    cls(config).save_pretrained(path)
    return path


def write_config(path: Path, model_path: Path, output_dir: Path, **overrides) -> Path:
    """A run config on random data; `overrides` are top-level keys (sections as dicts)."""
    cfg = {
        "model_path": str(model_path),
        "output_dir": str(output_dir),
        "steps": 4,
        "micro_batch_size": 1,
        "grad_accum_steps": 1,
        "seed": 0,
        "trainable": [],
        "optimizer": {"lr": 1.0e-3, "weight_decay": 0.01},
        "schedule": {"name": "cosine", "warmup_steps": min(2, overrides.get("steps", 4)), "min_lr_ratio": 0.1},
        "checkpoint": {"interval": 0, "keep": 2},
        "metrics": {"tensorboard": False},
        "data": {"kind": "random", "seq_len": 32, "segments": 3, "image_fraction": 0.5},
    }
    for key, value in overrides.items():
        if isinstance(value, dict):
            cfg.setdefault(key, {}).update(value)
        else:
            cfg[key] = value
    path.write_text(yaml.safe_dump(cfg))
    return path


def command(nproc: int, *args: str, module: str = "vlmcore.cli") -> list[str]:
    """`python -m vlmcore.cli ...` for one process (no torchrun), else torchrun on gloo."""
    if nproc == 1:
        return [sys.executable, "-m", module, *args]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        "-m",
        module,
        *args,
    ]


# Quiet trainers, but a deprecation in how they use torch.distributed fails them (as in pyproject.toml).
TRAINER_WARNINGS = "ignore,error:Slicing a flattened dim"


def env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO / "src"), PYTHONWARNINGS=TRAINER_WARNINGS)


def train(nproc: int, config: Path, *sets: str, check: bool = True, timeout: int = 300):
    args = ["train", str(config)] + [a for s in sets for a in ("--set", s)]
    proc = subprocess.run(command(nproc, *args), capture_output=True, text=True, timeout=timeout, env=env())
    if check and proc.returncode != 0:
        raise AssertionError(f"vlmcore train failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc


CASE_START = "train-cases: training "


def train_cases(nproc: int, configs: list[Path], timeout: int = 600) -> subprocess.CompletedProcess:
    """Several runs of one world size in one launch: each config trained in turn, as `vlmcore
    train CONFIG` would in a launch of its own. The start-up of a launch (torchrun, the imports,
    inductor's first compile in a process) is paid once instead of once a run; the compile tests'
    cases differ only in their settings. Fails naming the config that failed."""
    args = [str(REPO / "tests" / "_train_helpers.py"), "train-cases", *map(str, configs)]
    if nproc == 1:
        cmd = [sys.executable, *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env())
    if proc.returncode != 0:
        started = [line for line in proc.stdout.splitlines() if line.startswith(CASE_START)]
        failed = started[-1].removeprefix(CASE_START) if started else "before the first config"
        raise AssertionError(
            f"vlmcore train failed ({proc.returncode}) on {failed}:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
        )
    return proc


def start_train(config: Path) -> subprocess.Popen:
    return subprocess.Popen(
        command(1, "train", str(config)), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env()
    )


def read_metrics(output_dir: Path) -> list[dict]:
    path = output_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def load_dcp(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of a DCP checkpoint, read in this process without a process group (the way
    the export reads final/)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = dcp.FileSystemReader(str(path)).read_metadata()
    state = {
        key: torch.empty(meta.size, dtype=meta.properties.dtype)
        for key, meta in metadata.state_dict_metadata.items()
        if isinstance(meta, TensorStorageMetadata)
    }
    dcp.load(state, checkpoint_id=str(path), no_dist=True)
    return state


def dump_state(config_path: str, out_path: str) -> None:
    """Full model + optimizer state of the latest checkpoint, loaded into this layout."""
    import torch.distributed as dist
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    from vlmcore.config import load_config
    from vlmcore.models import load_hf_config
    from vlmcore.parallel.checks import check_run
    from vlmcore.parallel.mesh import device_for_rank, init_distributed
    from vlmcore.train.build import build_run
    from vlmcore.train.checkpoint import Checkpointer

    cfg = load_config(config_path)
    device = device_for_rank()
    init_distributed(device)
    run = build_run(cfg, check_run(cfg, dist.get_world_size(), load_hf_config(cfg.model_path)), device)
    model, optimizer = run.model, run.optimizer
    checkpointer = Checkpointer(cfg.output_dir, keep=cfg.checkpoint.keep)
    train_state = {"step": 0}
    checkpointer.load(checkpointer.latest(), model, optimizer, train_state, None)
    model_sd, optim_sd = get_state_dict(
        model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    if dist.get_rank() == 0:
        flat = {f"model.{k}": v for k, v in model_sd.items()}
        for name, state in optim_sd["state"].items():
            for key, value in state.items():
                flat[f"optim.{name}.{key}"] = torch.as_tensor(value).clone()
        flat["train.step"] = torch.tensor(train_state["step"])
        save_file({k: v.clone().contiguous() for k, v in flat.items()}, out_path)
    dist.destroy_process_group()


def run_train_cases(configs: list[str]) -> int:
    """`vlmcore train CONFIG` for each config, in this process; the exit code of the first that
    fails. Each config is named on stdout as it starts (what train_cases reports on a failure).
    Between runs dynamo's compiled code is dropped, so that each run compiles its own model as in
    a process of its own (inductor's caches of compiled kernels stay, as they do on disk between
    processes).

    Under torchrun each run's process group is made here, as the trainer would make it, but over
    keys of its own in torchrun's store: the groups a run makes (its device meshes) are named by
    their order, so a second run's would meet the first's keys there and its ranks would not
    connect."""
    import torch.distributed as dist

    from vlmcore.cli import main

    store = None
    if "WORLD_SIZE" in os.environ:
        store, rank, world_size = next(dist.rendezvous("env://"))
    for index, config in enumerate(configs):
        print(f"{CASE_START}{config}", flush=True)
        if store is not None:  # the trainer finds it made, and destroys it at its end
            case_store = dist.PrefixStore(f"train-cases/{index}/", store)
            dist.init_process_group("gloo", store=case_store, rank=rank, world_size=world_size)
        code = main(["train", config])
        if code != 0:
            return code
        torch.compiler.reset()
    return 0


if __name__ == "__main__":
    if sys.argv[1] == "dump-state":
        dump_state(sys.argv[2], sys.argv[3])
    elif sys.argv[1] == "train-cases":
        sys.exit(run_train_cases(sys.argv[2:]))
