"""Post-training step costs (issue 41, item 7): LoRA against peft, LoRA's optimizer and checkpoint
cost against the adapters' size, and the DPO step against what its FLOPs predict.

    OMP_NUM_THREADS=1 python benchmarks/post_training.py                      # CPU, tiny, all parts
    OMP_NUM_THREADS=1 python benchmarks/post_training.py --part dpo           # one part
    python benchmarks/post_training.py --preset 2b --compile                  # one GPU, bf16

Parts (benchmarks/train_step.py's models, the presets of benchmarks/common.py: random weights):

lora  vlmcore's LoRA step (`vlmcore.train.step` as the run builds it: chunked cross-entropy,
      clipping at norm 1, fused AdamW on the adapters) against peft on the transformers model with
      the same targets (peft's `target_parameters` for the MoE family's routed experts), the same
      adapter weights (copied through the export's `peft_state_dict`), the same packed row (one
      image per row on the VL families) and the same compile setting (`--compile`: torch.compile
      for both), AdamW on the adapters only in both. The two steps alternate, so that drift of a
      shared machine falls on both; median of --steps after --warmup. The step-0 losses must agree.
cost  the LoRA step at --ranks and full fine-tuning of the same model: the optimizer step alone,
      and the project's DCP checkpoint save (vlmcore.train.checkpoint.Checkpointer) in time and
      bytes, against the trained parameter count; the checkpoint's tensors are listed by kind
      (adapters, their optimizer state, base weights), and a LoRA checkpoint holds no base weights.
dpo   the SFT step and the DPO step (vlmcore.train.dpo) on the same rows (consecutive segments
      are the pairs), alternating: full fine-tuning with a frozen copy as the reference
      (`dpo.reference: copy`), and LoRA with the adapters switched off (`adapters_off`). The DPO
      step's predicted time is its FLOPs (policy forward and backward over both sides, reference
      forward over both sides) at the SFT step's measured FLOPs rate; the target is within 10%.
      FLOPs follow vlmcore.models.flops (6 per weight and token); a LoRA step does not compute the
      frozen weights' gradients, so its count leaves those out (4 per frozen weight and token), and
      a forward is a third of the full fine-tuning count.

On CPU the clock is the process's CPU time (benchmarks/train_step.py `time_steps`), the checkpoint
save's is wall time (it writes files). Prints a table per part and writes
benchmarks/results/post_training_<device>_<preset>[_compile][_<part>].json (--out, or $OUT).
"""

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from common import (
    HF_CLASSES,
    MOE,
    PRESETS,
    REPO,
    hf_config,
    print_table,
    release_device_memory,
    train_config,
    write_results,
    write_snapshot,
)

# LoRA targets per family: the language model's linear layers (attention only on MoE, whose MLPs
# are the routed experts, adapted through lora.experts), the vision tower's qkv and the projector.
VISION_TARGETS = ["model.visual.blocks.*.attn.qkv", "model.visual.merger.linear_fc1"]
LORA_TARGETS = {
    "qwen3_vl": [
        "model.language_model.layers.*.self_attn.[qkvo]_proj",
        "model.language_model.layers.*.mlp.*_proj",
        *VISION_TARGETS,
    ],
    "qwen3_vl_moe": ["model.language_model.layers.*.self_attn.[qkvo]_proj", *VISION_TARGETS],
}
EXPERT_PARAMETERS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]  # peft's target_parameters
# Packed segments per row: two preference pairs in the DPO part; one in the LoRA part, since
# transformers attends over the whole row (no per-segment attention without flash-attention), so
# only a one-document row gives peft the same attention work and the same loss.
DPO_SEGMENTS = 4


class Clock:
    """Seconds of one call: CPU time of this process on CPU (other jobs on a shared machine do not
    inflate it), wall time between synchronizations on CUDA."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def time(self, fn) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            start = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            return time.perf_counter() - start
        start = time.process_time()
        fn()
        return time.process_time() - start


def alternate(steps: dict, warmup: int, n: int, clock: Clock) -> dict:
    """Median seconds of each named step, run in turn (a, b, a, b, ...) after `warmup` rounds."""
    times = {name: [] for name in steps}
    for i in range(warmup + n):
        for name, fn in steps.items():
            seconds = clock.time(fn)
            if i >= warmup:
                times[name].append(seconds)
    return {name: statistics.median(values) for name, values in times.items()}


def lora_config(args: argparse.Namespace, path: Path, rank: int, family: str, device: torch.device):
    """A run config of the snapshot: LoRA at `rank` (0: full fine-tuning), eager or compiled."""
    cfg = train_config(path, path.parent / "run", device, args.compile)
    cfg.lora.rank = rank
    cfg.lora.alpha = 2.0 * rank if rank else cfg.lora.alpha
    cfg.lora.targets = LORA_TARGETS[family]
    cfg.lora.experts = family in MOE
    return cfg


def build(cfg, device: torch.device):
    """The run as `vlmcore train` builds it (one rank), its weights loaded from the snapshot."""
    import torch.distributed as dist

    from vlmcore.models import load_hf_config
    from vlmcore.parallel.checks import check_run
    from vlmcore.train.build import build_run, check_kernels

    check_kernels(cfg, device)
    return build_run(cfg, check_run(cfg, dist.get_world_size(), load_hf_config(cfg.model_path)), device)


def random_batch(path: Path, args: argparse.Namespace, segments: int = 1, pairs: bool = False):
    import transformers

    from vlmcore.train.random_data import RandomBatches

    preset = PRESETS[args.preset]
    return RandomBatches(
        transformers.AutoConfig.from_pretrained(path),
        seq_len=args.seq_len or preset["seq_len"],
        segments=segments,
        image_fraction=1.0,
        micro_batch_size=1,
        dp_rank=0,
        dp_world=1,
        grad_accum_steps=1,
        seed=0,
        image_side=preset["image_side"],
        pairs=pairs,
    ).batch(0)


def vlmcore_step(run, host_batch, losses: list):
    """One optimizer step of the run on the batch; each step's mean token loss goes to `losses`."""
    from vlmcore.train.step import to_device

    batch = to_device(host_batch, run.device, run.context)
    labels = host_batch.label_tokens

    def step() -> None:
        result = run.step([batch], labels, set_lr=lambda optimizer: None)
        losses.append(result.loss_sum / labels)

    return step


def peft_model_of(path: Path, family: str, run, device: torch.device):
    """The transformers model under peft with the run's adapters (targets, rank, alpha, weights)."""
    import transformers
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
    from torch.distributed.tensor import DTensor

    from vlmcore.models.lora import LoraGroupedExperts, LoraLinear, adapted_modules, adapter_state_dict, peft_state_dict

    lora = run.cfg.lora
    adapted = dict(adapted_modules(run.model))
    linears = [name for name, module in adapted.items() if isinstance(module, LoraLinear)]
    has_experts = any(isinstance(module, LoraGroupedExperts) for module in adapted.values())
    model = getattr(transformers, HF_CLASSES[family][1]).from_pretrained(path, dtype=torch.float32)
    config = LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=0.0,
        target_modules=linears,
        target_parameters=EXPERT_PARAMETERS if has_experts else None,
    )
    peft_model = get_peft_model(model, config)
    # Whole tensors: on a GPU the run's model is FSDP-sharded (over one rank, DTensors).
    state = {}
    for name, value in run.model.state_dict().items():
        state[name] = value.full_tensor() if isinstance(value, DTensor) else value
    adapters = peft_state_dict(adapter_state_dict(state))
    loaded = set_peft_model_state_dict(peft_model, adapters)
    if loaded.unexpected_keys:
        raise RuntimeError(f"peft does not know the adapters {loaded.unexpected_keys[:5]}")
    peft_model.to(device).train()
    return peft_model


def peft_inputs(batch, model_config, family: str) -> dict:
    """The packed row as transformers takes it: unshifted labels, the images, the MoE router loss."""
    labels = torch.full_like(batch.labels, -100)
    labels[:, 1:] = batch.labels[:, :-1]  # transformers shifts the labels itself
    inputs = {"input_ids": batch.input_ids, "labels": labels}
    if family in MOE:  # the load-balancing loss in the loss, as vlmcore's step has it
        inputs["output_router_logits"] = True
    if batch.images is not None:
        inputs.update(
            pixel_values=batch.images.pixel_values,
            image_grid_thw=batch.images.grid_thw,
            mm_token_type_ids=(batch.input_ids == model_config.image_token_id).int(),
        )
    return inputs


def peft_step(peft_model, inputs: dict, device: torch.device, compile_model: bool):
    """peft's step: the model's loss, backward, clipping at norm 1, fused AdamW on the adapters."""
    trainable = [p for p in peft_model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.01, fused=True)
    forward = torch.compile(peft_model) if compile_model else peft_model
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")

    def step() -> None:
        with autocast:
            loss = forward(**inputs).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def peft_first_loss(peft_model, inputs: dict, device: torch.device) -> float:
    """peft's mean token cross-entropy before any step (no router loss), to check the pair agrees."""
    plain = {k: v for k, v in inputs.items() if k != "output_router_logits"}
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")
    with torch.no_grad(), autocast:
        return peft_model(**plain).loss.item()


def lora_vs_peft(args: argparse.Namespace, family: str, path: Path, device: torch.device, clock: Clock) -> dict:
    host_batch = random_batch(path, args)
    run = build(lora_config(args, path, args.ranks[0], family, device), device)
    peft_model = peft_model_of(path, family, run, device)
    batch = host_batch.map_tensors(lambda t: t.to(device))
    inputs = peft_inputs(batch, run.model.config, family)
    peft_loss = peft_first_loss(peft_model, inputs, device)
    losses = []
    steps = {
        "vlmcore": vlmcore_step(run, host_batch, losses),
        "peft": peft_step(peft_model, inputs, device, args.compile),
    }
    seconds = alternate(steps, args.warmup, args.steps, clock)
    adapters = sum(p.numel() for p in run.model.parameters() if p.requires_grad)
    peft_adapters = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    return {
        "family": family,
        "rank": args.ranks[0],
        "tokens": host_batch.tokens,
        "adapter_params": adapters,
        "peft_adapter_params": peft_adapters,
        "first_loss": {"vlmcore": losses[0], "peft": peft_loss},
        "results": {
            name: {"step_s": s, "tokens_per_s": host_batch.tokens / s, "vs_peft": seconds["peft"] / s}
            for name, s in seconds.items()
        },
    }


def checkpoint_tensors(path: Path, adapter_names: set) -> dict:
    """Bytes and elements of the tensors a DCP checkpoint holds, by kind: the trained parameters
    (adapters under LoRA), their optimizer state, and base weights (frozen parameters written)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    kinds = {"trained": 0, "optimizer_state": 0, "base_weights": 0, "other": 0}
    elements = dict(kinds)
    base_names = []
    metadata = FileSystemReader(str(path)).read_metadata()
    for key, entry in metadata.state_dict_metadata.items():
        if not isinstance(entry, TensorStorageMetadata):
            continue
        if key.startswith("model."):
            kind = "trained" if key.removeprefix("model.") in adapter_names else "base_weights"
            if kind == "base_weights":
                base_names.append(key.removeprefix("model."))
        elif key.startswith("optim.state."):
            kind = "optimizer_state"
        else:
            kind = "other"
        numel = entry.size.numel()
        elements[kind] += numel
        kinds[kind] += numel * entry.properties.dtype.itemsize
    return {"bytes": kinds, "elements": elements, "base_weight_names": base_names}


def optimizer_and_checkpoint(args, family: str, path: Path, rank: int, device: torch.device, clock: Clock) -> dict:
    """The optimizer step alone and one checkpoint save of the run at LoRA `rank` (0: full)."""
    from vlmcore.train.checkpoint import Checkpointer

    host_batch = random_batch(path, args)
    run = build(lora_config(args, path, rank, family, device), device)
    step = vlmcore_step(run, host_batch, [])
    step()  # the optimizer's state exists from here
    trainable = [p for p in run.model.parameters() if p.requires_grad]
    # Every name of a trained parameter: a tied LM head's weight is the embedding's under a second name.
    trained_names = {name for name, p in run.model.named_parameters(remove_duplicate=False) if p.requires_grad}
    for p in trainable:  # the step clears the gradients: give the optimizer some to apply
        p.grad = torch.full_like(p, 1e-6)
    optimizer_s = alternate({"optimizer": run.optimizer.step}, 1, args.steps, clock)["optimizer"]
    step_s = alternate({"step": step}, 0, args.steps, clock)["step"]
    checkpointer = Checkpointer(path.parent / f"checkpoints_r{rank}", keep=1)
    started = time.perf_counter()
    checkpointer.save(1, run.model, run.optimizer, {"step": 1}, {"loader": 0})
    save_s = time.perf_counter() - started
    saved = checkpointer.dir / "step_1"
    files = sum(f.stat().st_size for f in saved.rglob("*") if f.is_file())
    params = sum(p.numel() for p in trainable)
    return {
        "rank": rank,
        "trained_params": params,
        "model_params": sum(p.numel() for p in run.model.parameters()),
        "step_s": step_s,
        "optimizer_s": optimizer_s,
        "save_s": save_s,
        "checkpoint_bytes": files,
        "checkpoint_tensors": checkpoint_tensors(saved, trained_names),
        # The trained parameters and AdamW's two moments, fp32 each.
        "expected_bytes": 3 * 4 * params,
    }


def attention_flops(config, batch) -> float:
    """Training FLOPs of the attention scores and values (no weights): the LLM's over its segments
    and the vision tower's over each frame (vlmcore.models.flops)."""
    from vlmcore.models.flops import attention_flops_per_pair

    lengths = batch.segment_lengths().double()
    total = attention_flops_per_pair(config) * float(lengths.pow(2).sum())
    if batch.images is not None:
        vision = config.vision_config
        grid = torch.tensor(batch.images.grids(), dtype=torch.float64)
        frame_len = grid[:, 1] * grid[:, 2]
        total += 12.0 * vision.depth * vision.hidden_size * float((grid[:, 0] * frame_len**2).sum())
    return total


def step_flops(config, batch, lora: bool) -> dict:
    """FLOPs of the training step (forward and backward) and of a forward alone. Under LoRA the
    frozen weights get no gradient: their backward is the input gradient alone, 4 FLOPs per weight
    and token instead of 6 (the adapters' own are left out, rank / width of the rest)."""
    from vlmcore.train.metrics_log import batch_flops

    full = sum(batch_flops(config, batch))
    forward = full / 3
    if not lora:
        return {"step": full, "forward": forward}
    weight_grads = (full - attention_flops(config, batch)) / 3
    return {"step": full - weight_grads, "forward": forward}


def dpo_vs_flops(args, family: str, path: Path, reference: str, device: torch.device, clock: Clock) -> dict:
    """The SFT and DPO steps of one setting on the same rows, and the DPO step's FLOPs prediction."""
    rank = args.ranks[0] if reference == "adapters_off" else 0
    host_batch = random_batch(path, args, DPO_SEGMENTS, pairs=True)
    runs = {}
    for objective in ("sft", "dpo"):
        cfg = lora_config(args, path, rank, family, device)
        cfg.objective = objective
        cfg.dpo.reference = reference
        runs[objective] = build(cfg, device)
    steps = {objective: vlmcore_step(run, host_batch, []) for objective, run in runs.items()}
    seconds = alternate(steps, args.warmup, args.steps, clock)
    flops = step_flops(runs["sft"].model.config, host_batch, lora=rank > 0)
    sft_rate = flops["step"] / seconds["sft"]
    dpo_flops = flops["step"] + flops["forward"]  # policy forward and backward, reference forward
    predicted = dpo_flops / sft_rate
    return {
        "family": family,
        "reference": reference,
        "rank": rank,
        "tokens": host_batch.tokens,
        "pairs": len(host_batch.pairs),
        "sft_step_s": seconds["sft"],
        "sft_flops": flops["step"],
        "sft_tflops": sft_rate / 1e12,
        "dpo_step_s": seconds["dpo"],
        "dpo_flops": dpo_flops,
        "dpo_predicted_s": predicted,
        "measured_over_predicted": seconds["dpo"] / predicted,
    }


def print_lora(cases: list[dict], name: str) -> None:
    print(f"\nLoRA step, vlmcore vs peft ({name}; machine shared with other jobs: medians, alternating)")
    print(f"{'family':<14}{'rank':>5}{'adapters':>10}  {'engine':<9}{'ms/step':>9}{'tokens/s':>10}{'vs peft':>9}")
    for case in cases:
        for engine, r in case["results"].items():
            print(
                f"{case['family']:<14}{case['rank']:>5}{case['adapter_params']:>10}  {engine:<9}"
                f"{1000 * r['step_s']:>9.1f}{r['tokens_per_s']:>10.0f}{r['vs_peft']:>8.2f}x"
            )
        loss = case["first_loss"]
        print(f"{'':<14}step-0 loss: vlmcore {loss['vlmcore']:.5f}, peft {loss['peft']:.5f}")


def print_cost(rows: list[dict], name: str) -> None:
    print(f"\nOptimizer step and checkpoint vs trained parameters ({name}; rank 0 = full fine-tuning)")
    columns = [
        ("rank", ">5"),
        ("trained", ">11"),
        ("step ms", ">9.1f"),
        ("optim ms", ">10.2f"),
        ("save ms", ">9.1f"),
        ("ckpt bytes", ">12"),
        ("12 B/param", ">12"),
        ("base bytes", ">11"),
    ]
    cells = [
        [
            r["rank"],
            r["trained_params"],
            1000 * r["step_s"],
            1000 * r["optimizer_s"],
            1000 * r["save_s"],
            r["checkpoint_bytes"],
            r["expected_bytes"],
            r["checkpoint_tensors"]["bytes"]["base_weights"],
        ]
        for r in rows
    ]
    print_table(columns, cells)


def print_dpo(rows: list[dict], name: str) -> None:
    print(f"\nDPO step vs its FLOPs at the SFT step's rate ({name}; target: within 10%)")
    columns = [
        ("reference", "<14"),
        ("rank", ">5"),
        ("SFT ms", ">9.1f"),
        ("SFT TFLOPS", ">11.4f"),
        ("DPO ms", ">9.1f"),
        ("predicted", ">10.1f"),
        ("measured/pred", ">14.3f"),
    ]
    cells = [
        [
            r["reference"],
            r["rank"],
            1000 * r["sft_step_s"],
            r["sft_tflops"],
            1000 * r["dpo_step_s"],
            1000 * r["dpo_predicted_s"],
            r["measured_over_predicted"],
        ]
        for r in rows
    ]
    print_table(columns, cells)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=("tiny", "2b"), default="tiny")
    parser.add_argument("--part", choices=("lora", "cost", "dpo", "all"), default="all")
    parser.add_argument(
        "--family",
        action="append",
        choices=list(LORA_TARGETS),
        help="the lora part's families (repeatable; default: qwen3_vl, and qwen3_vl_moe on the tiny preset)",
    )
    parser.add_argument(
        "--ranks", type=int, nargs="+", default=[8, 32, 128], help="LoRA ranks; the first for lora, dpo"
    )
    parser.add_argument("--seq-len", type=int, default=None, help="packed tokens per row (default: preset's)")
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", REPO / "benchmarks" / "results")))
    return parser


def main() -> int:
    args = build_parser().parse_args()
    from vlmcore.parallel.mesh import init_distributed

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    name = (
        torch.cuda.get_device_name()
        if device.type == "cuda"
        else f"CPU ({os.cpu_count()} cores, {torch.get_num_threads()} threads)"
    )
    families = args.family or (["qwen3_vl", "qwen3_vl_moe"] if args.preset == "tiny" else ["qwen3_vl"])
    parts = ("lora", "cost", "dpo") if args.part == "all" else (args.part,)
    tag = f"{device.type}_{args.preset}{'_compile' if args.compile else ''}"
    if args.part != "all":  # a part alone (a GPU command of limited time) keeps the others' files
        tag += f"_{args.part}"
    args.out.mkdir(parents=True, exist_ok=True)
    result_file = args.out / f"post_training_{tag}.json"
    result = {
        "device": name,
        "preset": args.preset,
        "seq_len": args.seq_len or PRESETS[args.preset]["seq_len"],
        "compile": args.compile,
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "note": "CPU runs: a machine shared with other jobs; CPU-time medians, the steps compared alternate",
    }
    init_distributed(device)
    clock = Clock(device)
    with tempfile.TemporaryDirectory() as tmp:
        snapshots = {}
        for family in dict.fromkeys([*families, "qwen3_vl"]):
            snapshots[family] = Path(tmp) / family / "model"
            preset = PRESETS[args.preset]
            on_meta = preset is not PRESETS["tiny"]  # the big presets: not initialised on the CPU
            write_snapshot(family, hf_config(family, preset), snapshots[family], on_meta=on_meta)
        # Each case's runs go before the next one's are built (on a GPU: with their compiled code).
        if "lora" in parts:
            result["lora"] = []
            for family in families:
                result["lora"].append(lora_vs_peft(args, family, snapshots[family], device, clock))
                release_device_memory(device)
            print_lora(result["lora"], name)
        if "cost" in parts:
            result["cost"] = []
            for rank in [*args.ranks, 0]:
                row = optimizer_and_checkpoint(args, "qwen3_vl", snapshots["qwen3_vl"], rank, device, clock)
                result["cost"].append(row)
                release_device_memory(device)
            print_cost(result["cost"], name)
        if "dpo" in parts:
            result["dpo"] = []
            for reference in ("copy", "adapters_off"):
                result["dpo"].append(dpo_vs_flops(args, "qwen3_vl", snapshots["qwen3_vl"], reference, device, clock))
                release_device_memory(device)
            print_dpo(result["dpo"], name)
        write_results(result_file, result)
    print(f"\nwritten: {result_file}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
