"""One way to build a training run, for `vlmcore train`, `vlmcore memory` and the benchmarks:

    layout = check_run(cfg, world_size, model_config)    # vlmcore.parallel.checks, before any work
    run = build_meta_run(cfg, layout, device, rank)      # meshes, the model on meta, frozen, parallelized
    run.materialize(load=True)                           # this rank's shards, random init, then the weights
    run.make_step()                                      # AdamW and the train step
    data = run.data()                                    # this rank's batches

`build_run` does the three for a real run. The memory estimate builds the meta run for real and
the rest on fake tensors, with the optimizer and the gradient norm one tensor at a time (see
vlmcore.train.memory).
"""

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import unset_fake_temporarily
from transformers import PretrainedConfig

from vlmcore.config import ConfigError, TrainConfig
from vlmcore.families import family
from vlmcore.models import build_model, load_hf_weights, use_backends
from vlmcore.models.lora import adapters_disabled, add_adapters, init_adapters
from vlmcore.parallel.disjoint import DisjointBridge
from vlmcore.parallel.layout import RunLayout
from vlmcore.parallel.mesh import Meshes
from vlmcore.parallel.parallelize import parallelize
from vlmcore.train.checkpoint import ResumableData, load_model_weights
from vlmcore.train.dpo import AdaptersOffReference, Context, DPOObjective, FrozenReference, Reference
from vlmcore.train.grpo import GRPOObjective
from vlmcore.train.objective import CrossEntropy
from vlmcore.train.optim import build_optimizer, freeze
from vlmcore.train.step import Step, VisionDummy, build_step

if TYPE_CHECKING:
    from vlmcore.train.rollout_data import Scorer


def check_kernels(cfg: TrainConfig, device: torch.device) -> dict:
    """The attention, Gated DeltaNet and MoE experts backends of this run (vlmcore.kernels), set for
    the model code; a version known to compute wrongly on this GPU stops the run here, before any work."""
    from vlmcore import kernels

    model = family(cfg.model_path)
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    try:
        backends = kernels.check(
            cfg.parallel.linear_attention, capability, model.linear_attention, has_experts=model.experts
        )
    except kernels.KernelError as e:
        key = "parallel.linear_attention" if str(e).startswith("linear_attention") else "model_path"
        raise ConfigError(f"{key}: {e}") from None
    use_backends(backends)
    return backends


@dataclass
class Run:
    """What one rank trains with, built step by step (module docstring)."""

    cfg: TrainConfig
    layout: RunLayout
    meshes: Meshes
    rank: int
    device: torch.device
    model: nn.Module
    partial: list  # (module, attribute name) of the parameters with TP-partial gradients (`apply_tp`)
    bridge: DisjointBridge | None = None  # disjoint layouts
    optimizer: torch.optim.Optimizer | None = None
    step: Step | None = None

    @property
    def role(self) -> str:
        """ "both" modules, or the "vision" tower or the "language" model alone (disjoint layouts)."""
        return self.layout.role(self.rank)

    def materialize(self, load: bool = True) -> None:
        """This rank's shards on the device, random init; with `load`, the LoRA adapters' initial
        values and the previous stage's final/ or else the snapshot's safetensors."""
        materialize(self.model, self.device, self.cfg.parallel.offload)
        if not load:
            return
        init_adapters(self.model, self.cfg.seed)
        load_start_weights(self.model, self.cfg, self.rank)

    def make_step(self) -> None:
        """AdamW over the trainable parameters and the train step."""
        self.optimizer = build_optimizer(self.model, self.cfg.optimizer)
        dims = self.layout.language.dims
        tp_group = self.meshes.tp().get_group() if dims.tp > 1 and self.role == "both" else None
        cp_group = self.meshes.cp().get_group() if dims.cp > 1 and self.role != "vision" else None
        self.step = build_step(
            self.model,
            self.optimizer,
            self.partial,
            tp_group,
            self.cfg.loss_chunk_tokens,
            self.cfg.max_grad_norm,
            bridge=self.bridge,
            cp_group=cp_group,
            # The ranks of a data-parallel rank's rows, whose loss sums are the same (tp) or its parts (cp).
            objective=CrossEntropy(self.cfg.loss_chunk_tokens, self.cfg.parallel.compile, self.layout.data.dims.tp),
        )

    @property
    def context(self) -> dict | None:
        """What cuts this rank's chunk from the rows under context parallelism (`to_device`: the
        arguments of `Batch.context_chunk`); None on an encoder rank of disjoint layouts (its images
        are whole). A language rank of disjoint layouts receives the whole rows' image embeddings."""
        cp = self.layout.language.dims.cp
        config = self.model.config
        if cp == 1 or self.role == "vision":
            return None
        context = {"cp_rank": self.layout.language.cp_rank(self.rank), "cp": cp}
        if self.model.vision_tower() is not None:
            context |= {
                "visual_tokens": {"image": config.image_token_id, "video": getattr(config, "video_token_id", None)},
                "merge": config.vision_config.spatial_merge_size,
                "keep_all": self.role == "language",
            }
        return context

    def data(
        self, source: Callable[[int, int], ResumableData] | None = None, scorer: "Scorer | None" = None
    ) -> ResumableData:
        """This rank's batches: its language data-parallel rank's, or on an encoder rank those of
        the language ranks whose rows it encodes. `source(data_rank, data_world)` makes one
        data-parallel rank's (default: the stage's data, `build_data`; a GRPO stage's prompt data
        is rolled out by the policy and scored by `scorer`, `build_rollout_data`)."""
        if source is None and self.cfg.objective == "grpo" and self.cfg.data.kind != "random":
            source = lambda rank, world: build_rollout_data(self, scorer, rank, world)  # noqa: E731
        source = source or (
            lambda rank, world: build_data(self.cfg, self.model.config, rank, world, self.layout.grad_accum_steps)
        )
        if self.role == "vision":
            return self.bridge.encoder_data(source)
        return source(self.layout.data.data_rank(self.rank), self.layout.data.dims.dp)


def materialize(model: nn.Module, device: torch.device, offload: bool) -> None:
    """The meta model's shards made on `device`, random init. With `offload` (`parallel.offload`) the
    weights are made in host memory, where FSDP2's CPUOffloadPolicy keeps them, and the buffers
    (rotary frequencies) go to `device`, where the forward runs."""
    model.to_empty(device="cpu" if offload else device)
    with torch.no_grad():
        model.init_weights()
        if offload:
            for module in model.modules():
                for name, buffer in module._buffers.items():
                    if buffer is not None:
                        module._buffers[name] = buffer.to(device)


def load_start_weights(model: nn.Module, cfg: TrainConfig, rank: int) -> None:
    """The weights the stage starts from: the previous stage's final/, or else the snapshot's safetensors."""
    if cfg.init_from:
        load_model_weights(model, cfg.init_from)
    elif any(Path(cfg.model_path).glob("*.safetensors")):
        load_hf_weights(model, cfg.model_path)
    elif rank == 0:
        print(f"{cfg.model_path}: no safetensors, training from random init")


def build_reference(run: Run, load: bool = True, context: Context | None = None) -> FrozenReference:
    """The reference of DPO (`dpo.reference: copy`) and GRPO (`grpo.reference: frozen`): the model
    built again, parallelized as the policy, with the weights the stage starts from (on a resume
    too: the reference never trains), frozen. Without `load`, random init (the memory estimate's
    fake run)."""
    cfg = run.cfg
    # Built on the meta device outside any fake mode, as the policy is (`build_meta_run`): the memory
    # estimate calls this under its fake mode, where a meta weight would be a fake tensor that the
    # fake mode holds a weak reference to, and `to_empty` could not swap it for its replacement.
    with unset_fake_temporarily():
        model = build_model(cfg.model_path, device="meta")
        parallelize(model, cfg, run.layout, run.meshes, run.rank)
        # Frozen once parallelized: under disjoint layouts a rank's module must have weights that train.
        for parameter in model.parameters():
            parameter.requires_grad_(False)
    materialize(model, run.device, cfg.parallel.offload)
    if load:
        load_start_weights(model, cfg, run.rank)
    # Under disjoint layouts the encoder ranks run the tower (`reference_tower`), no rank needs a dummy.
    vision_dummy = VisionDummy(model) if model.vision_tower() is not None and run.bridge is None else None
    return FrozenReference(model, cfg.loss_chunk_tokens, vision_dummy, context)


def build_meta_run(cfg: TrainConfig, layout: RunLayout, device: torch.device, rank: int) -> Run:
    """The run's meshes and its model on the meta device (no memory): frozen by `trainable` and
    parallelized for what `rank` holds."""
    meshes = Meshes(layout, device)
    model = build_model(cfg.model_path, device="meta")
    choose_trainable(model, cfg)
    partial = parallelize(model, cfg, layout, meshes, rank)
    bridge = None
    if layout.disjoint:  # each rank holds one module; the bridge carries the image embeddings between them
        bridge = DisjointBridge(
            model.config, layout, cfg.micro_batch_size, getattr(torch, cfg.precision.param_dtype), device, rank
        )
    return Run(cfg, layout, meshes, rank, device, model, partial, bridge)


def choose_trainable(model: nn.Module, cfg: TrainConfig) -> None:
    """With LoRA (`lora.rank` > 0), adapters on `lora.targets` (and the routed experts) and only they
    train (vlmcore.models.lora); else the parameters `trainable` names."""
    if cfg.lora.rank > 0:
        lora = cfg.lora
        add_adapters(model, lora.rank, lora.alpha, lora.dropout, lora.targets, lora.experts)
    else:
        freeze(model, cfg.trainable)


def build_run(cfg: TrainConfig, layout: RunLayout, device: torch.device) -> Run:
    """A run of this process's rank, its weights loaded, ready to step."""
    run = build_meta_run(cfg, layout, device, dist.get_rank())
    run.materialize(load=True)
    run.make_step()
    use_objective(run)
    return run


def pairs_in_rows(cfg: TrainConfig) -> bool:
    """Whether the stage's rows hold preference pairs (random data: consecutive segments)."""
    return cfg.objective == "dpo"


def rollout_in_rows(cfg: TrainConfig) -> bool:
    """Whether the stage's rows are a rollout's completions (random data: each segment one)."""
    return cfg.objective == "grpo"


def use_objective(run: Run, load: bool = True) -> list[nn.Module]:
    """The run's step gets the stage's objective (`objective`; `make_step`'s is SFT's). Returns the
    models it holds beside the policy (the memory estimate counts their weights): DPO's or GRPO's
    reference copy, else none. `load`: the reference's weights (see `build_reference`)."""
    reference = None
    if run.cfg.objective == "dpo":
        reference = use_dpo(run, load)
    elif run.cfg.objective == "grpo":
        reference = use_grpo(run, load)
    return [] if reference is None or reference.model is run.model else [reference.model]


def context_of(run: Run) -> Context | None:
    """Under context parallelism, this rank's chunk of the rows and its cp group: a sequence's
    log-probability over its chunks."""
    if run.context is None:
        return None
    return Context(run.context["cp_rank"], run.context["cp"], run.meshes.cp().get_group())


def use_reference(run: Run, kind: str, load: bool, context: Context | None) -> "Reference":
    """The stage's reference: the policy itself with its LoRA adapters off (`kind` adapters_off),
    or a frozen copy of the starting weights (`load`: see `build_reference`). Under disjoint
    layouts an encoder rank runs its tower, which the bridge sends."""
    if kind == "adapters_off":
        reference: Reference = AdaptersOffReference(
            run.model, run.cfg.loss_chunk_tokens, run.step.vision_dummy, context
        )
    else:
        reference = build_reference(run, load, context)
    if run.role == "vision":
        run.bridge.reference_tower = reference_tower(reference)
    return reference


def use_dpo(run: Run, load: bool = True) -> "Reference":
    """The run's step trains on preference pairs against a frozen reference (vlmcore.train.dpo): a
    copy of the starting weights (`load`: see `build_reference`), or the policy itself with its
    LoRA adapters off. Returns the reference."""
    cfg = run.cfg
    dims = run.layout.data.dims
    context = context_of(run)
    reference = use_reference(run, cfg.dpo.reference, load, context)
    run.step.objective = DPOObjective(
        reference,
        cfg.dpo.beta,
        cfg.dpo.label_smoothing,
        cfg.loss_chunk_tokens,
        cfg.parallel.compile,
        peers=dims.tp * dims.cp,
        context=context,
    )
    return reference


def use_grpo(run: Run, load: bool = True) -> "Reference | None":
    """The run's step trains on a rollout's completions (vlmcore.train.grpo), with a reference
    (`grpo.reference`, see `use_reference`) only when the KL penalty weighs (`grpo.beta` > 0).
    Returns the reference, or None."""
    cfg = run.cfg
    grpo = cfg.grpo
    context = context_of(run)
    reference = use_reference(run, grpo.reference, load, context) if grpo.beta > 0 else None
    run.step.objective = GRPOObjective(
        grpo.loss,
        grpo.epsilon_low,
        grpo.epsilon_high,
        grpo.temperature,
        grpo.max_new_tokens,
        grpo.beta,
        reference,
        kl_ratio_weighted=grpo.kl_ratio_weighted,
        delta=grpo.delta,
        tis_cap=grpo.tis_cap,
        chunk_tokens=cfg.loss_chunk_tokens,
        compiled=cfg.parallel.compile,
        # Every sum is over tokens, each context-parallel rank's over its own chunk's: the
        # tensor-parallel peers alone hold the same ones.
        tp=run.layout.data.dims.tp,
        context=context,
    )
    return reference


def reference_tower(reference: FrozenReference) -> Callable:
    """The reference's vision tower as a call (pixels, grids) -> (embeds, deepstack): its own
    model's, or the policy's with the adapters off."""
    tower = reference.model.vision_tower()
    if not isinstance(reference, AdaptersOffReference):
        return tower

    def adapters_off(pixels: torch.Tensor, grids: list) -> tuple:
        with adapters_disabled(reference.model):
            return tower(pixels, grids)

    return adapters_off


def build_rollout_data(run: Run, scorer: "Scorer | None", rank: int, world: int) -> ResumableData:
    """A GRPO stage's micro-batches on data-parallel rank `rank` of `world` (vlmcore.train.rollout_data):
    its prompts from the packed prompt dataset `data_path`, each prompt with room for
    `grpo.max_new_tokens` in a row of `data.seq_len`."""
    from vlmcore.generate import SamplingSettings
    from vlmcore.train.prompts import PromptSource
    from vlmcore.train.rollout_data import RolloutData, RolloutPlan

    cfg = run.cfg
    grpo = cfg.grpo
    if scorer is None:
        raise ConfigError("objective grpo: the stage's rewards (grpo.rewards) were not given to its data")
    prompts = PromptSource(cfg.data_path, cfg.seed, max_prompt_tokens=cfg.data.seq_len - grpo.max_new_tokens)
    plan = RolloutPlan(
        prompts_per_step=grpo.prompts_per_step,
        group_size=grpo.group_size,
        sampling=SamplingSettings(
            max_new_tokens=grpo.max_new_tokens, temperature=grpo.temperature, top_p=grpo.top_p, top_k=grpo.top_k
        ),
        scale_rewards=grpo.scale_rewards,
        updates_per_rollout=grpo.updates_per_rollout,
        seq_len=cfg.data.seq_len,
        dynamic_sampling=grpo.dynamic_sampling,
        shuffle_rewards=grpo.shuffle_rewards,
        overlong_buffer=grpo.overlong_buffer,
        overlong_factor=grpo.overlong_factor,
    )
    tokenizer = prompts.encoder.tokenizer
    return RolloutData(
        run.model,
        prompts,
        plan,
        scorer,
        dp_rank=rank,
        dp_world=world,
        grad_accum_steps=run.layout.grad_accum_steps,
        seed=cfg.seed,
        device=run.device,
        pad_token_id=tokenizer.pad_token_id or 0,
        tokenizer=tokenizer,
    )


def build_data(
    cfg: TrainConfig, model_config: PretrainedConfig, rank: int, world: int, grad_accum_steps: int
) -> ResumableData:
    """The batches of data-parallel rank `rank` of `world`: the packed dataset's, or random rows."""
    if cfg.data.kind == "random":
        from vlmcore.train.random_data import RandomBatches

        return RandomBatches(
            model_config,
            seq_len=cfg.data.seq_len,
            segments=cfg.data.segments,
            image_fraction=cfg.data.image_fraction,
            micro_batch_size=cfg.micro_batch_size,
            dp_rank=rank,
            dp_world=world,
            grad_accum_steps=grad_accum_steps,
            seed=cfg.seed,
            image_side=cfg.data.image_side,
            video_fraction=cfg.data.video_fraction,
            video_frames=cfg.data.video_frames,
            pairs=pairs_in_rows(cfg),
            num_workers=cfg.num_workers,
            rollout=rollout_in_rows(cfg),
        )
    from vlmcore.data.load.loader import build_loader

    return build_loader(
        cfg.data_path,
        dp_rank=rank,
        dp_world=world,
        micro_batch_size=cfg.micro_batch_size,
        grad_accum_steps=grad_accum_steps,
        seed=cfg.seed,
        num_workers=cfg.num_workers,
    )
