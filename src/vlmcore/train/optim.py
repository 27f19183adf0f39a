"""Stage freezing, AdamW parameter groups and learning-rate schedules."""

import dataclasses
import fnmatch
import math

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim.adam import adam

from vlmcore.config import ConfigError, OptimizerConfig, ScheduleConfig, TrainConfig
from vlmcore.parallel.fsdp import split_by_size

# Wrappers that AC and compile put into parameter names.
_WRAPPER_PARTS = ("_checkpoint_wrapped_module.", "_orig_mod.")


def clean_name(name: str) -> str:
    for part in _WRAPPER_PARTS:
        name = name.replace(part, "")
    return name


def freeze(model: nn.Module, patterns: list[str]) -> int:
    """Leaves trainable only the parameters whose name matches one of the fnmatch patterns
    (all of them when `patterns` is empty); returns the number of trainable tensors."""
    if not patterns:
        model.requires_grad_(True)
        return sum(1 for _ in model.parameters())
    used = set()
    trainable = 0
    for name, param in model.named_parameters():
        hits = [p for p in patterns if fnmatch.fnmatchcase(clean_name(name), p)]
        used.update(hits)
        param.requires_grad_(bool(hits))
        trainable += bool(hits)
    unused = [p for p in patterns if p not in used]
    if unused:
        raise ConfigError(f"trainable: pattern(s) {unused} match no parameter of the model")
    return trainable


def param_groups(model: nn.Module, cfg: OptimizerConfig) -> list[dict]:
    lrs = {
        "llm": cfg.lr,
        "vision": cfg.lr if cfg.vision_lr is None else cfg.vision_lr,
        "projector": cfg.lr if cfg.projector_lr is None else cfg.projector_lr,
    }
    groups = {}
    # 'projector' or 'vision' by parameter id, from the model's own parts; the rest is 'llm'.
    vision = model.vision_tower()
    kinds = {id(p): "vision" for p in vision.parameters()} if vision is not None else {}
    kinds |= {id(p): "projector" for module in model.projectors() for p in module.parameters()}
    # The embedding tables (tokens, vision positions) take no weight decay.
    embeddings = {id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
    for param in model.parameters():
        if not param.requires_grad:
            continue
        kind = kinds.get(id(param), "llm")
        decay = param.ndim >= 2 and id(param) not in embeddings  # not norms, biases
        key = f"{kind}{'' if decay else '_no_decay'}"
        group = groups.setdefault(
            key,
            {
                "name": key,
                "params": [],
                "base_lr": lrs[kind],
                "lr": lrs[kind],
                "weight_decay": cfg.weight_decay if decay else 0.0,
            },
        )
        group["params"].append(param)
    if not groups:
        raise ConfigError("trainable: no trainable parameters")
    return list(groups.values())


def local_tensors(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each DTensor's local shard; plain tensors as they are. The shard the DTensor holds
    (`_local_tensor`, as FSDP2 reads it), not `to_local()`, which dispatches a view per tensor:
    hundreds of host operations a step, the work this step is to save."""
    return [t._local_tensor if isinstance(t, DTensor) else t for t in tensors]


class LocalShardAdamW(torch.optim.AdamW):
    """torch's AdamW, stepped on this rank's local shards.

    Under FSDP2 and TP the parameters, gradients and moments are DTensors, and torch's own step
    sends every fused or foreach call through DTensor dispatch, host work that grows with the
    parameter tensors (20 ms a step for the 2B model on an H200, docs/performance.md). The update is
    elementwise, so each shard can be updated alone: the same functional AdamW over the local
    tensors computes the same values. The state is the one torch makes (moments shaped and placed
    like their parameters), so checkpoints (DCP) save and reshard it as they do torch's.

    `moments_dtype` (`optimizer.moments_dtype`) other than the weights' keeps the two moments in it
    (bfloat16: 4 bytes a weight instead of 8). torch's kernels and torchao's AdamW take moments in
    the weights' dtype only, so each step runs torch's AdamW on float32 copies of the moments, a
    `MOMENT_CHUNKS`th of them at a time, and rounds the updated moments back (to nearest)."""

    def __init__(self, params: list[dict], moments_dtype: torch.dtype | None = None, **defaults: object) -> None:
        super().__init__(params, **defaults)
        self.moments_dtype = moments_dtype

    @torch.no_grad()
    def step(self, closure: None = None) -> None:
        if closure is not None:
            raise ValueError("LocalShardAdamW.step takes no closure")
        for group in self.param_groups:
            self._init_moments(group)
            params = []
            grads = []
            exp_avgs = []
            exp_avg_sqs = []
            max_exp_avg_sqs = []
            state_steps = []
            has_complex = self._init_group(group, params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps)
            lists = (params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps)
            tensors = AdamTensors(*(local_tensors(t) for t in lists))
            if not params or exp_avgs[0].dtype == params[0].dtype:
                self._adam(group, has_complex, tensors)
            else:
                self._adam_in_float32(group, has_complex, tensors)

    def _adam_in_float32(self, group: dict, has_complex: bool, tensors: "AdamTensors") -> None:
        """AdamW on float32 copies of moments held in a lower dtype, in `MOMENT_CHUNKS` runs."""
        sizes = [p.numel() for p in tensors.params]
        for run in split_by_size(list(range(len(sizes))), sizes, MOMENT_CHUNKS):
            low_avgs = [tensors.exp_avgs[i] for i in run]
            low_sqs = [tensors.exp_avg_sqs[i] for i in run]
            dtype = tensors.params[run[0]].dtype
            chunk = AdamTensors(
                params=[tensors.params[i] for i in run],
                grads=[tensors.grads[i] for i in run],
                exp_avgs=[m.to(dtype) for m in low_avgs],
                exp_avg_sqs=[m.to(dtype) for m in low_sqs],
                max_exp_avg_sqs=[],
                steps=[tensors.steps[i] for i in run],
            )
            self._adam(group, has_complex, chunk)
            torch._foreach_copy_(low_avgs, chunk.exp_avgs)
            torch._foreach_copy_(low_sqs, chunk.exp_avg_sqs)

    def _init_moments(self, group: dict) -> None:
        """The state of each parameter stepped for the first time, made as torch's `_init_group` makes
        it, the moments in `moments_dtype` (made here, before torch would make them in the weights'
        dtype: no second copy of them at the first step)."""
        if self.moments_dtype is None or group["amsgrad"]:
            return
        for p in group["params"]:
            if p.grad is None or self.state[p] or p.dtype == self.moments_dtype:
                continue
            on_device = group["capturable"] or group["fused"]
            self.state[p] = {
                # As torch makes it: a host step count unless fused or capturable (`torch.tensor`,
                # whose value a fake tensor keeps: the memory estimate's AdamW reads it).
                "step": (
                    torch.zeros((), dtype=torch.float32, device=p.device)
                    if on_device
                    else torch.tensor(0.0, dtype=torch.float32, device="cpu")
                ),
                "exp_avg": torch.zeros_like(p, dtype=self.moments_dtype),
                "exp_avg_sq": torch.zeros_like(p, dtype=self.moments_dtype),
            }

    def _adam(self, group: dict, has_complex: bool, tensors: "AdamTensors") -> None:
        """torch's functional AdamW with the group's settings over local tensors."""
        beta1, beta2 = group["betas"]
        adam(
            tensors.params,
            tensors.grads,
            tensors.exp_avgs,
            tensors.exp_avg_sqs,
            tensors.max_exp_avg_sqs,
            tensors.steps,
            amsgrad=group["amsgrad"],
            has_complex=has_complex,
            beta1=beta1,
            beta2=beta2,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=group["maximize"],
            foreach=group["foreach"],
            capturable=group["capturable"],
            differentiable=group["differentiable"],
            fused=group["fused"],
            grad_scale=None,
            found_inf=None,
            decoupled_weight_decay=group["decoupled_weight_decay"],
        )


@dataclasses.dataclass
class AdamTensors:
    """The local tensors of one AdamW call, as torch's `adam` takes them."""

    params: list[torch.Tensor]
    grads: list[torch.Tensor]
    exp_avgs: list[torch.Tensor]
    exp_avg_sqs: list[torch.Tensor]
    max_exp_avg_sqs: list[torch.Tensor]
    steps: list[torch.Tensor]


# Moments kept in a lower dtype are updated in this many runs of about equal size: the float32
# copies of a 32nd of them exist at a time (a quarter of a byte a weight more at the optimizer step).
# With parallel.offload that step runs in host memory, next to every weight's shard, gradient and
# moments: an eighth (1 byte a weight) was 14.7 GiB more on each GPU's host share of
# Qwen3-VL-30B-A3B on one JUPITER node, past its 120 GB (benchmarks/memory_recipes.py). The runs
# stay multi-tensor kernels of about 1/32 of the weights each.
MOMENT_CHUNKS = 32


def build_optimizer(model: nn.Module, cfg: OptimizerConfig) -> torch.optim.Optimizer:
    """AdamW in torch's fused kernel on every device (the GPU's fastest; on CPU 3x the multi-tensor
    step, so the tests run the optimizer that the GPU runs), over the local shards."""
    return LocalShardAdamW(
        param_groups(model, cfg),
        moments_dtype=getattr(torch, cfg.moments_dtype),
        lr=cfg.lr,
        betas=tuple(cfg.betas),
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
        fused=True,
    )


def _cooldown(shape: str, progress: float) -> float:
    """1 -> 0 as progress goes 0 -> 1."""
    if shape == "linear":
        return 1.0 - progress
    if shape == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    if shape == "1-sqrt":
        return 1.0 - math.sqrt(progress)
    raise ValueError(f"schedule.cooldown: unknown shape {shape!r}")


def lr_factor(cfg: ScheduleConfig, done: int, total: int) -> float:
    """Learning-rate multiplier for the optimizer step that brings progress to `done` (1-based)
    out of `total`, both in the schedule's unit (steps or samples).

    Warmup rises linearly to 1 at its last step; cosine decays to min_lr_ratio at the last step
    of the run; wsd stays at 1 until the last `decay_fraction` of the run, then cools down.
    """
    warmup = cfg.warmup_steps if cfg.unit == "steps" else cfg.warmup_samples
    if done <= warmup:
        return done / warmup
    low = cfg.min_lr_ratio
    if cfg.name == "constant":
        return 1.0
    if cfg.name == "cosine":
        progress = min(1.0, (done - warmup) / max(1, total - warmup))
        return low + (1 - low) * _cooldown("cosine", progress)
    if cfg.name == "wsd":
        decay = max(1, round(cfg.decay_fraction * total))
        start = total - decay
        if done <= start:
            return 1.0
        return low + (1 - low) * _cooldown(cfg.cooldown, min(1.0, (done - start) / decay))
    raise ValueError(f"schedule.name: unknown schedule {cfg.name!r}")


def schedule_total(cfg: TrainConfig) -> int:
    return cfg.steps if cfg.schedule.unit == "steps" else cfg.schedule.total_samples


def set_lr(optimizer: torch.optim.Optimizer, factor: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = group["base_lr"] * factor
