"""Direct preference optimisation (DPO): per-pair log-probabilities, the loss, its statistics.

A preference pair is two segments of a batch, the chosen and the rejected conversation (the same
prompt and media, a different answer), listed in `Batch.pairs` as (chosen, rejected) segment
indices. A side's log-probability is the sum of the policy's token log-probabilities over its
response tokens (its labels != IGNORE_INDEX). Packed rows give each segment its own attention
block and positions, so a side's log-probability is the same packed as alone.

The loss is the sigmoid DPO loss with conservative label smoothing (the DPO paper's cDPO, TRL's
`sigmoid` loss, and its `aot` loss for one pair when smoothed):
    d = (policy_chosen - reference_chosen) - (policy_rejected - reference_rejected)
    loss = -(1 - label_smoothing) * log sigmoid(beta * d) - label_smoothing * log sigmoid(-beta * d)
with the implicit rewards beta * (policy - reference) of each side, their margin and whether the
chosen side's reward is the larger (the accuracy).

The reference is an object with one method, `logps(batch)`, the per-segment log-probabilities of
a batch without gradients: here a frozen copy of the policy at the stage's start; with LoRA, the
same model with its adapters switched off fits the same slot.
"""

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import FunctionCtx
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Replicate

from vlmcore.data import IGNORE_INDEX
from vlmcore.data.load.batch import Batch
from vlmcore.models.lora import adapters_disabled
from vlmcore.train.step import VisionDummy, forward_hidden


def _chunk_logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """A chunk's logits through the LM head, fp32 at least."""
    logits = hidden @ weight.t()
    return logits.to(torch.promote_types(logits.dtype, torch.float32))


def _label_logps(logits: torch.Tensor, logsumexp: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The log-probability of each token's label, label logit - log-sum-exp (no log-softmax of the
    whole vocabulary), 0 where no label."""
    target = labels.clamp(min=0)[:, None]
    return (logits.gather(1, target)[:, 0] - logsumexp) * (labels != IGNORE_INDEX)


def _chunk_token_logps(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The log-probability of each token's label (fp32 at least), 0 where no label."""
    logits = _chunk_logits(hidden, weight)
    return _label_logps(logits, logits.logsumexp(dim=-1), labels)


class _ChunkTokenLogps(torch.autograd.Function):
    """`_chunk_token_logps` with gradients, keeping no (tokens, vocabulary) tensor between forward and
    backward: the backward computes the chunk's logits again and turns them into their gradient in
    place, grad * (one-hot(label) - softmax), from the log-sum-exp the forward kept (one pass over
    the logits, where recomputing the forward under autograd would run the log-softmax again and
    scatter the label's gradient into a zero tensor of the logits' size)."""

    @staticmethod
    def forward(ctx: FunctionCtx, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = _chunk_logits(hidden, weight)
        logsumexp = logits.logsumexp(dim=-1)
        ctx.save_for_backward(hidden, weight, labels, logsumexp)
        return _label_logps(logits, logsumexp, labels)

    @staticmethod
    def backward(ctx: FunctionCtx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, labels, logsumexp = ctx.saved_tensors
        scale = grad * (labels != IGNORE_INDEX)
        grad_logits = _chunk_logits(hidden, weight).sub_(logsumexp[:, None]).exp_()  # the softmax
        grad_logits.mul_(-scale[:, None])
        grad_logits.scatter_add_(1, labels.clamp(min=0)[:, None], scale[:, None].to(grad_logits.dtype))
        grad_logits = grad_logits.to(hidden.dtype)
        grad_hidden = grad_logits @ weight if ctx.needs_input_grad[0] else None
        grad_weight = grad_logits.t() @ hidden if ctx.needs_input_grad[1] else None
        return grad_hidden, grad_weight, None


def _local_head_weight(weight: torch.Tensor) -> torch.Tensor:
    """The LM head's whole weight on this rank; a vocabulary-sharded (tensor-parallel) head is refused."""
    if not isinstance(weight, DTensor):
        return weight
    if any(p != Replicate() for p in weight.placements):
        raise ValueError(f"DPO: the LM head is sharded ({weight.placements}); DPO needs the whole vocabulary per rank")
    return weight.to_local()


def segment_logps(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, cu_seqlens: torch.Tensor, chunk_tokens: int = 1024
) -> torch.Tensor:
    """(segments,) sums of token log-probabilities over each segment's label tokens, for `hidden`
    (..., H) through the LM head `weight` (V, H); labels (...) are already shifted. The logits
    go chunk by chunk; with gradients each chunk's logits are computed again in backward
    (`_ChunkTokenLogps`), so no chunk's logits outlive it."""
    weight = _local_head_weight(weight)
    hidden = hidden.reshape(-1, hidden.shape[-1])
    labels = labels.reshape(-1).to(hidden.device)
    parts = []
    for start in range(0, hidden.shape[0], chunk_tokens):
        end = min(start + chunk_tokens, hidden.shape[0])
        if torch.is_grad_enabled():
            part = _ChunkTokenLogps.apply(hidden[start:end], weight, labels[start:end])
        else:
            part = _chunk_token_logps(hidden[start:end], weight, labels[start:end])
        parts.append(part)
    token_logps = torch.cat(parts)
    cu_seqlens = cu_seqlens.to(hidden.device)
    tokens = torch.arange(hidden.shape[0], device=hidden.device, dtype=cu_seqlens.dtype)
    segment = torch.searchsorted(cu_seqlens[1:], tokens, right=True)
    sums = torch.zeros(len(cu_seqlens) - 1, dtype=token_logps.dtype, device=hidden.device)
    return sums.index_add(0, segment, token_logps)


def model_segment_logps(model: nn.Module, batch: Batch, chunk_tokens: int = 1024) -> torch.Tensor:
    """The model's per-segment log-probabilities of a device batch (`segment_logps`)."""
    hidden = forward_hidden(model, batch)
    return segment_logps(hidden, model.lm_head.weight, batch.labels, batch.cu_seqlens, chunk_tokens)


class Reference(Protocol):
    """What DPO needs of its reference policy."""

    def logps(self, batch: Batch) -> torch.Tensor:
        """(segments,) log-probabilities of the device batch's segments, without gradients."""
        ...


class FrozenReference:
    """The reference as a model of its own that never trains (a copy of the policy's weights at
    the stage's start, built and sharded as the policy is)."""

    def __init__(self, model: nn.Module, chunk_tokens: int = 1024, vision_dummy: VisionDummy | None = None) -> None:
        """`vision_dummy`: the reference's own (a sharded VL model runs its vision tower on every batch)."""
        for parameter in model.parameters():
            parameter.requires_grad_(False)
        self.model = model.eval()
        self.chunk_tokens = chunk_tokens
        self.vision_dummy = vision_dummy

    @torch.no_grad()
    def logps(self, batch: Batch) -> torch.Tensor:
        if self.vision_dummy is not None:
            self.vision_dummy.active = not batch.has_visual
        return model_segment_logps(self.model, batch, self.chunk_tokens)


class AdaptersOffReference(FrozenReference):
    """The reference of a LoRA stage (`dpo.reference: adapters_off`): the policy's own model with
    its adapters switched off, which is the stage's frozen starting weights. It holds no second
    copy of the model, so a LoRA DPO stage needs the memory of one model, not two."""

    def __init__(self, model: nn.Module, chunk_tokens: int = 1024, vision_dummy: VisionDummy | None = None) -> None:
        """`vision_dummy`: the policy step's own (the reference runs the same model). The model is
        the policy: it is neither frozen nor switched to eval here."""
        self.model = model
        self.chunk_tokens = chunk_tokens
        self.vision_dummy = vision_dummy

    def logps(self, batch: Batch) -> torch.Tensor:
        with adapters_disabled(self.model):
            return super().logps(batch)


@dataclass
class PairLosses:
    """Per pair: the DPO loss and the implicit rewards beta * (policy - reference) of each side."""

    losses: torch.Tensor  # (pairs,)
    chosen_rewards: torch.Tensor  # (pairs,), detached
    rejected_rewards: torch.Tensor  # (pairs,), detached

    @property
    def margins(self) -> torch.Tensor:
        return self.chosen_rewards - self.rejected_rewards

    @property
    def correct(self) -> torch.Tensor:
        """1.0 where the chosen side's reward is the larger (the preference accuracy), else 0.0."""
        return (self.chosen_rewards > self.rejected_rewards).to(self.chosen_rewards.dtype)


def dpo_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    reference_chosen: torch.Tensor,
    reference_rejected: torch.Tensor,
    beta: float,
    label_smoothing: float = 0.0,
) -> PairLosses:
    """The sigmoid DPO loss of each pair from its sides' log-probabilities (module docstring)."""
    chosen_logratios = policy_chosen - reference_chosen
    rejected_logratios = policy_rejected - reference_rejected
    scaled = beta * (chosen_logratios - rejected_logratios)
    losses = -(1 - label_smoothing) * F.logsigmoid(scaled) - label_smoothing * F.logsigmoid(-scaled)
    return PairLosses(losses, beta * chosen_logratios.detach(), beta * rejected_logratios.detach())


def pair_losses(
    policy_logps: torch.Tensor,
    reference_logps: torch.Tensor,
    pairs: torch.Tensor,
    beta: float,
    label_smoothing: float = 0.0,
) -> PairLosses:
    """`dpo_loss` of the batch's pairs from per-segment log-probabilities; `pairs` (pairs, 2) holds
    each pair's (chosen, rejected) segment indices."""
    pairs = pairs.to(policy_logps.device)
    return dpo_loss(
        policy_logps[pairs[:, 0]],
        policy_logps[pairs[:, 1]],
        reference_logps[pairs[:, 0]],
        reference_logps[pairs[:, 1]],
        beta,
        label_smoothing,
    )


# The sums over a step's pairs that the step reduces over the ranks and `pair_metrics` reads:
# the DPO loss, the chosen and rejected rewards, and the pairs whose chosen reward is the larger.
PAIR_SUMS = ("loss", "chosen_reward", "rejected_reward", "correct")


@dataclass
class DPOObjective:
    """What the train step needs to train on preference pairs (`Step.objective`)."""

    reference: Reference
    beta: float
    label_smoothing: float
    chunk_tokens: int = 1024

    def __call__(
        self, model: nn.Module, micro: list[Batch], pairs_total: float, vision_dummy: VisionDummy | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Accumulates the gradients of sum(pair losses) / pairs_total over the device micro-batches;
        returns this rank's sum of pair losses and its `PAIR_SUMS` (on the device)."""
        sums = None
        for i, batch in enumerate(micro):
            if batch.pairs is None:
                raise ValueError(f"objective dpo: a batch without preference pairs (rows {batch.row_keys})")
            if isinstance(model, FSDPModule):
                model.set_requires_gradient_sync(i == len(micro) - 1)  # reduce once, after the last
            reference_logps = self.reference.logps(batch)
            if vision_dummy is not None:
                vision_dummy.active = not batch.has_visual
            policy_logps = model_segment_logps(model, batch, self.chunk_tokens)
            pairs = pair_losses(policy_logps, reference_logps, batch.pairs, self.beta, self.label_smoothing)
            (pairs.losses.sum() / pairs_total).backward()
            batch_sums = torch.stack(
                [
                    pairs.losses.detach().sum(),
                    pairs.chosen_rewards.sum(),
                    pairs.rejected_rewards.sum(),
                    pairs.correct.sum(),
                ]
            ).double()
            sums = batch_sums if sums is None else sums + batch_sums
        return sums[0], sums


def pair_metrics(sums: list[float], pairs: float) -> dict:
    """The step's DPO metrics from its `PAIR_SUMS` over all ranks and its global number of pairs:
    the mean loss, chosen and rejected rewards, margin and accuracy."""
    mean = dict(zip(PAIR_SUMS, (value / max(pairs, 1) for value in sums)))
    return {
        "dpo_loss": mean["loss"],
        "dpo_chosen_reward": mean["chosen_reward"],
        "dpo_rejected_reward": mean["rejected_reward"],
        "dpo_margin": mean["chosen_reward"] - mean["rejected_reward"],
        "dpo_accuracy": mean["correct"],
    }
