"""One training step, the same for the training loop, the memory estimate and the benchmark.

forward/backward over the micro-batches -> TP-partial gradients summed -> global gradient norm ->
the step's one host read (norm and loss together) -> clipping, learning rate, AdamW -> zero grads.

Mixture-of-experts models add the load-balancing loss of each micro-batch (transformers' formula
over the micro-batch's tokens, models/moe.py) times the config's `router_aux_loss_coef`, weighted
1 / (micro-batches x data-parallel ranks): every micro-batch has the same number of tokens, so this
is the token-weighted mean over the global batch, and any split of it gives the same gradients.
Under context parallelism each cp rank's term is its part of the whole rows' loss (RoutingStats).

The GPU is never waited for inside forward/backward: what the kernels need on the host (the
longest packed segment, the image grids, the label count) is taken from the batch while it is
still on the host (`Batch.to`), and losses and norms stay on the device until the one read.
"""

import functools
import math
from collections import defaultdict
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from vlmcore.data.load.batch import Batch, Images
from vlmcore.models.moe import RoutingStats, moe_blocks
from vlmcore.models.qwen3_vl import VisionEmbeds
from vlmcore.parallel.disjoint import DisjointBridge
from vlmcore.parallel.float8 import precompute_scales
from vlmcore.train.objective import CrossEntropy, Objective
from vlmcore.train.optim import local_tensors


def read_host(*values: torch.Tensor) -> list[float]:
    """The step's one device-to-host read. Fake tensors (the memory estimate) have no values:
    they read as zeros, and the step goes on as a finite one would."""
    from torch._subclasses.fake_tensor import FakeTensor

    if any(isinstance(v, FakeTensor) for v in values):
        return [0.0] * sum(v.numel() for v in values)
    return torch.cat([v.double().reshape(-1) for v in values]).tolist()


def _by_layout(params: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """The parameters that have gradients, grouped by the gradients' (mesh, placements): DTensor ops
    take one layout at a time (under TP the vision tower and the LLM are sharded over different meshes)."""
    groups = defaultdict(list)
    for p in params:
        if p.grad is not None:
            groups[(p.grad.device_mesh, p.grad.placements) if isinstance(p.grad, DTensor) else None].append(p)
    return list(groups.values())


def grad_norm(params: list[torch.Tensor], foreach: bool | None = None) -> torch.Tensor:
    """Global L2 norm of the gradients (a device tensor), correct for FSDP / TP (sharded DTensor)
    gradients: one reduction per layout, then combined."""
    squares = [_squared_norm([p.grad for p in group], foreach) for group in _by_layout(params)]
    if not squares:
        return torch.zeros((), dtype=torch.float64)
    return torch.stack(squares).sum().sqrt()


def _squared_norm(grads: list[torch.Tensor], foreach: bool | None) -> torch.Tensor:
    """The squared L2 norm of gradients of one layout, in float64. DTensor gradients: the norm of
    the local shards, summed over the mesh dimensions they are sharded on (a replicated dimension
    holds the same values on each rank: counted once). Computed on plain tensors, so without
    DTensor dispatch on each gradient; a layout with other placements (partial sums) takes
    DTensor's own reduction."""
    first = grads[0]
    if not isinstance(first, DTensor):
        return total_norm(grads, foreach).double() ** 2
    placements = first.placements
    if not all(p.is_shard() or p.is_replicate() for p in placements):
        return torch.nn.utils.get_total_norm(grads, foreach=foreach).full_tensor().double() ** 2
    square = total_norm(local_tensors(grads), foreach).double() ** 2
    for dim, placement in enumerate(placements):
        if placement.is_shard():
            square = funcol.all_reduce(square, "sum", (first.device_mesh, dim))
    return square


def total_norm(tensors: list[torch.Tensor], foreach: bool | None) -> torch.Tensor:
    """The L2 norm of plain `tensors`, computed as torch.nn.utils.get_total_norm computes it (the
    norm of each tensor, one multi-tensor norm per device and dtype unless `foreach` is False, then
    the norm of those norms), so with the same result bit for bit. Without get_total_norm's `.to` of
    each tensor's norm to the first device: a dispatch per gradient that does nothing on one device
    (613 a step for Qwen3-VL 2B, benchmarks/host_work.py)."""
    if not tensors:
        return torch.tensor(0.0)
    by_device_and_dtype = defaultdict(list)
    for tensor in tensors:
        by_device_and_dtype[tensor.device, tensor.dtype].append(tensor)
    norms = []
    for group in by_device_and_dtype.values():
        # get_total_norm's default: the multi-tensor norm for plain tensors (not subclasses such as
        # the memory estimate's fake tensors).
        multi_tensor = foreach if foreach is not None else all(type(t) in (torch.Tensor, nn.Parameter) for t in group)
        if multi_tensor:
            norms.extend(torch._foreach_norm(group))
        else:
            norms.extend(torch.linalg.vector_norm(t) for t in group)
    first_device = tensors[0].device
    # Only norms from another device move (a model split over devices, which vlmcore does not make).
    on_first_device = [n if n.device == first_device else n.to(first_device) for n in norms]
    return torch.linalg.vector_norm(torch.stack(on_first_device))


def sum_partial_grads(params: list[torch.Tensor], group: dist.ProcessGroup | None) -> None:
    for p in params:
        if p.grad is not None:
            dist.all_reduce(p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad, group=group)


@dataclass
class MoE:
    """The routing of the model's MoE blocks and how much their load-balancing loss weighs."""

    routing: RoutingStats
    aux_loss_coef: float
    dp_size: int  # data-parallel ranks: the global batch is split over them
    cp: int = 1  # context-parallel ranks: each a chunk of the rows, its loss a part of theirs


def forward_hidden(model: nn.Module, batch: Batch, received: VisionEmbeds | None = None) -> torch.Tensor:
    """The model's final hidden states (B, S, H) for a device batch (`return_hidden`: the loss goes
    through the LM head itself). `received`: a language rank's image embeddings under disjoint layouts."""
    images = batch.images
    videos = batch.videos
    optional = {}  # arguments only some models take
    if batch.visual_selection is not None:
        optional["visual_selection"] = batch.visual_selection
    if received is not None:
        optional["vision_embeds"] = received
    output = model(
        batch.input_ids,
        pixel_values=images.pixel_values if images else None,
        image_grid_thw=images.grid_thw if images else None,
        position_ids=batch.position_ids,
        cu_seqlens=batch.cu_seqlens,
        max_seqlen=batch.max_seqlen,
        return_hidden=True,
        pixel_values_videos=videos.pixel_values if videos else None,
        video_grid_thw=videos.grid_thw if videos else None,
        **optional,
    )
    return output.hidden_states


def forward_backward(
    model: nn.Module,
    micro: list[Batch],
    normaliser: float,
    vision_dummy: "VisionDummy | None",
    chunk_tokens: int = 1024,
    compiled_loss: bool = False,
    moe: MoE | None = None,
    bridge: DisjointBridge | None = None,
    objective: Objective | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Accumulates the gradients of the objective's summed loss / `normaliser` (its global count:
    label tokens for SFT, pairs for DPO) (+ the MoE load-balancing loss) over the device
    micro-batches (`Batch.to`); returns this rank's `objective.sums` added over the micro-batches,
    and for MoE models the sum of the micro-batches' load-balancing losses and the tokens routed
    to each expert per MoE layer (None otherwise), all on the device.
    `objective`: None is SFT's cross-entropy through `chunk_tokens` chunks (`compiled_loss`).
    `bridge`: a language rank of disjoint layouts receives each micro-batch's image embeddings and
    gives them to the model (`vision_embeds`).
    Under context parallelism the micro-batches are this rank's chunks of the rows (`Step.on_device`)."""
    if objective is None:
        objective = CrossEntropy(chunk_tokens, compiled_loss)
    sums, aux_sum, routed = None, None, None
    for i, batch in enumerate(micro):
        if isinstance(model, FSDPModule):
            model.set_requires_gradient_sync(i == len(micro) - 1)  # reduce once, after the last
        # What the objective needs before the policy's forward (DPO: the reference's log-probabilities),
        # kept out of the routing statistics of the policy's MoE blocks; under disjoint layouts a
        # reference's image embeddings come from the encoder ranks before the policy's.
        reference_embeds = functools.partial(bridge.receive, i) if bridge is not None else None
        with moe.routing.not_kept() if moe is not None else nullcontext():
            prepared = objective.prepare(batch, reference_embeds)
        if vision_dummy is not None:
            vision_dummy.active = not batch.has_visual
        received = bridge.receive(i) if bridge is not None else None
        hidden = forward_hidden(model, batch, received)
        local_sum, batch_sums = objective.loss(hidden, model.lm_head.weight, batch, prepared)
        loss = local_sum / normaliser
        if moe is not None:
            aux, counts = moe.routing.loss()
            moe.routing.clear()
            loss = loss + moe.aux_loss_coef / (len(micro) * moe.dp_size) * aux
            aux_sum = aux.detach() if aux_sum is None else aux_sum + aux.detach()
            routed = counts if routed is None else routed + counts
        if received is not None:  # the bridge's backward (a collective) runs even if no image uses it
            loss = loss + 0.0 * received.rows.sum()
        with moe.routing.not_kept() if moe is not None else nullcontext():
            loss.backward()
        sums = batch_sums if sums is None else sums + batch_sums
        del hidden
    return sums, aux_sum, routed


def moe_metrics(aux_sum: float, routed: torch.Tensor, micro_batches: int, ranks: int) -> dict:
    """`moe_aux_loss`: the mean load-balancing loss of the step's micro-batches; `moe_load_imbalance`:
    max / mean tokens per expert, per MoE layer over the global batch, averaged over the layers
    (1 is perfect balance, num_experts / top_k the worst)."""
    per_layer = routed.max(dim=1).values / routed.mean(dim=1).clamp(min=1e-12)
    return {"moe_aux_loss": aux_sum / (micro_batches * ranks), "moe_load_imbalance": float(per_layer.mean())}


@dataclass
class StepResult:
    loss_sum: float  # the objective's loss sum over all ranks and micro-batches (SFT: of token losses)
    grad_norm: float  # before clipping
    applied: bool  # False: non-finite loss or norm, the optimizer step was skipped
    moe: dict | None = None  # moe_aux_loss, moe_load_imbalance (MoE models)
    sums: list[float] | None = None  # the objective's `sums` over all ranks, the loss sum first


@dataclass
class Step:
    """What a training step works on, built once per run (see `build_step`)."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    trainable: list
    partial: list  # parameters whose gradients are partial sums over the TP ranks
    tp_group: dist.ProcessGroup | None
    vision_dummy: "VisionDummy | None"
    objective: Objective  # what the stage trains for (vlmcore.train.objective)
    max_grad_norm: float
    moe: MoE | None = None
    bridge: DisjointBridge | None = None  # disjoint layouts
    norm_foreach: bool | None = None  # the gradient norm's multi-tensor kernel (None: where torch has it)
    # After each optimizer step: the float8 weights' scales for FSDP2's float8 all-gather
    # (vlmcore.parallel.float8.precompute_scales; None without).
    float8_scales: Callable[[], None] | None = None

    def __call__(self, micro: list, normaliser: float, set_lr: Callable[[torch.optim.Optimizer], None]) -> StepResult:
        """One optimizer step over the device micro-batches (an encoder rank of disjoint layouts:
        the image batches of its rows); `normaliser`: the global count the objective's loss sum is
        divided by (`Objective.count`); `set_lr(optimizer)` sets this step's lr."""
        aux_sum, routed = None, None
        if self.bridge is not None and self.bridge.is_vision:
            self.bridge.encoder_step(self.model, micro)
            sums = torch.zeros(len(self.objective.sums), dtype=torch.float64, device=self.bridge.device)
        else:
            sums, aux_sum, routed = forward_backward(
                self.model,
                micro,
                normaliser,
                self.vision_dummy,
                moe=self.moe,
                bridge=self.bridge,
                objective=self.objective,
            )
        if self.partial:
            sum_partial_grads(self.partial, self.tp_group)
        norm = grad_norm(self.trainable, self.norm_foreach).to(sums.device)
        if self.bridge is not None:
            norm = self.bridge.global_norm(norm)
        # One all-reduce for the objective's sums and the MoE statistics, one host read for everything.
        totals = sums
        if routed is not None:
            totals = torch.cat([totals, aux_sum.double().view(1), routed.double().flatten()])
        ranks = dist.get_world_size() if dist.is_initialized() else 1
        if ranks > 1:
            dist.all_reduce(totals)
        norm_value, *values = read_host(norm, totals)
        objective_sums, moe_totals = values[: len(sums)], values[len(sums) :]
        loss_value = objective_sums[0]
        moe = None
        if routed is not None:
            routed_total = torch.tensor(moe_totals[1:], dtype=torch.float64).view(routed.shape)
            moe = moe_metrics(moe_totals[0], routed_total, len(micro), ranks // self.moe.cp)
        finite = math.isfinite(norm_value) and math.isfinite(loss_value)
        if finite:
            clip_grads(self.trainable, norm_value, self.max_grad_norm)
            set_lr(self.optimizer)
            self.optimizer.step()
            if self.float8_scales is not None:
                self.float8_scales()
        self.optimizer.zero_grad(set_to_none=True)
        return StepResult(loss_value, norm_value, finite, moe, objective_sums)


def clip_grads(params: list[torch.Tensor], norm: float, max_norm: float) -> None:
    """Clipping by a known global norm, as torch's `clip_grads_with_norm_` scales: one multi-tensor
    multiply over the gradients' local shards (no DTensor dispatch); decided on the host (`norm` was
    read already), so a step within `max_norm` launches nothing."""
    if max_norm > 0 and max_norm / (norm + 1e-6) < 1.0:
        grads = local_tensors([p.grad for p in params if p.grad is not None])
        coefficient = torch.clamp(max_norm / (torch.tensor(norm, dtype=torch.float64) + 1e-6), max=1.0)
        torch._foreach_mul_(grads, coefficient.to(grads[0].device))


def build_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    partial_params: list,
    tp_group: dist.ProcessGroup | None,
    chunk_tokens: int,
    max_grad_norm: float,
    compiled_loss: bool = False,
    bridge: DisjointBridge | None = None,
    cp_group: dist.ProcessGroup | None = None,
    objective: Objective | None = None,
) -> Step:
    """A step of `objective`, by default SFT's cross-entropy (`vlmcore.train.objective.CrossEntropy`
    through `chunk_tokens` chunks, `compiled_loss`). `partial_params`: (module,
    attribute name) of the TP-partial parameters (`apply_tp`); `cp_group`: this rank's
    context-parallel peers (None without context parallelism)."""
    tp = dist.get_world_size(tp_group) if tp_group is not None else 1
    moe = None
    if blocks := moe_blocks(model):
        cp = dist.get_world_size(cp_group) if cp_group is not None else 1
        ranks = dist.get_world_size() if dist.is_initialized() else 1
        coef = getattr(model.config.get_text_config(), "router_aux_loss_coef", 0.0) or 0.0
        moe = MoE(RoutingStats(blocks, cp_group), coef, ranks // (tp * cp), cp)
    trainable = [p for p in model.parameters() if p.requires_grad]
    partial = [getattr(m, name) for m, name in partial_params if getattr(m, name).requires_grad]
    vision_dummy = VisionDummy(model) if model.vision_tower() is not None and bridge is None else None
    return Step(
        model,
        optimizer,
        trainable,
        partial,
        tp_group,
        vision_dummy,
        objective or CrossEntropy(chunk_tokens, compiled_loss, tp),
        max_grad_norm,
        moe,
        bridge,
        float8_scales=precompute_scales(model),
    )


def to_device(batch: Batch | None, device: torch.device, context: dict | None = None) -> Batch | None:
    """A host micro-batch as this rank trains on it, on the device: under context parallelism
    (`context`, from `vlmcore.train.build.Run.context`) its 1/cp of the rows, cut on the host, where finding the image
    tokens costs no device wait."""
    if batch is not None and context is not None:
        batch = batch.context_chunk(**context)
    return None if batch is None else batch.to(device)


class VisionDummy:
    """Runs the vision tower on a tiny zero image, weighted by 0, for micro-batches without images.

    The vision tower is one FSDP unit, so every rank must take part in its collectives at the
    same point: for a text-only micro-batch this runs it right after the token embedding (a
    forward hook), where an image batch runs it too, and adds `0 * output` to the embeddings, so
    the backward graph has the same shape on every rank and the gradients are unchanged.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.vision = model.vision_tower()
        self.config = model.config.vision_config
        self.active = False
        model.token_embedding().register_forward_hook(self._hook)

    def _hook(self, module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        if not self.active:
            return output
        zero = Images.zero(self.config, output.device)
        leaves = torch.utils._pytree.tree_leaves(self.vision(zero.pixel_values, zero.grid_thw))
        return output + sum(t.float().sum() for t in leaves if torch.is_tensor(t) and t.is_floating_point()) * 0.0
