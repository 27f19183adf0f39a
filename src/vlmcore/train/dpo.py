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

The reference is an object with two methods, `logps(batch)`, the per-segment log-probabilities
of a batch without gradients, and `token_logps(batch)`, each label token's (GRPO's KL penalty,
vlmcore.train.grpo): here a frozen copy of the policy at the stage's start; with LoRA, the same
model with its adapters switched off fits the same slot.
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from vlmcore.data.load.batch import Batch
from vlmcore.models.lora import adapters_disabled
from vlmcore.models.qwen3_vl import VisionEmbeds
from vlmcore.train.loss import chunked_token_logps
from vlmcore.train.step import VisionDummy, forward_hidden


@dataclass
class Context:
    """Under context parallelism: this rank's chunk of every row (`Batch.context_chunk`) and the
    ranks that hold the other chunks, over which a sequence's log-probability is summed."""

    cp_rank: int
    cp: int
    group: dist.ProcessGroup


def segment_logps(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    cu_seqlens: torch.Tensor,
    chunk_tokens: int = 1024,
    context: Context | None = None,
    compiled: bool = False,
) -> torch.Tensor:
    """(segments,) sums of token log-probabilities over each segment's label tokens, for `hidden`
    (..., H) through the LM head `weight` (V, H) (`vlmcore.train.loss.chunked_token_logps`:
    chunked, vocabulary-parallel under TP); labels (B, S) are already shifted. Under context
    parallelism (`context`) the tokens are this rank's chunk of each row, `cu_seqlens` the whole
    rows', and the sums this chunk's part of each segment's."""
    token_logps = chunked_token_logps(hidden, weight, labels, chunk_tokens, compiled)
    segment = token_segments(labels, cu_seqlens, context)
    sums = torch.zeros(len(cu_seqlens) - 1, dtype=token_logps.dtype, device=token_logps.device)
    return sums.index_add(0, segment, token_logps)


def token_segments(labels: torch.Tensor, cu_seqlens: torch.Tensor, context: Context | None = None) -> torch.Tensor:
    """(tokens,) the segment of each token of `labels` (B, S), flattened, by the whole rows'
    `cu_seqlens`; under context parallelism the tokens are this rank's chunk of each row."""
    length = labels.shape[-1]
    rows = labels.numel() // length
    device = labels.device
    cu_seqlens = cu_seqlens.to(device)
    # Each token's place in the flattened whole rows (its chunk's offset under context parallelism).
    positions = torch.arange(length, device=device, dtype=cu_seqlens.dtype)
    if context is not None:
        positions = positions + context.cp_rank * length
        length *= context.cp
    tokens = (torch.arange(rows, device=device, dtype=cu_seqlens.dtype)[:, None] * length + positions).reshape(-1)
    return torch.searchsorted(cu_seqlens[1:], tokens, right=True)


def model_segment_logps(
    model: nn.Module,
    batch: Batch,
    chunk_tokens: int = 1024,
    context: Context | None = None,
    received: VisionEmbeds | None = None,
) -> torch.Tensor:
    """The model's per-segment log-probabilities of a device batch (`segment_logps`; under context
    parallelism this rank's chunk's part). `received`: a language rank's image embeddings under
    disjoint layouts."""
    hidden = forward_hidden(model, batch, received)
    return segment_logps(hidden, model.lm_head.weight, batch.labels, batch.cu_seqlens, chunk_tokens, context)


class Reference(Protocol):
    """What DPO and GRPO need of their reference policy."""

    def logps(self, batch: Batch, embeds: Callable[[], VisionEmbeds] | None = None) -> torch.Tensor:
        """(segments,) log-probabilities of the device batch's segments, without gradients.
        `embeds`: under disjoint layouts, receives the reference tower's image embeddings."""
        ...

    def token_logps(
        self, batch: Batch, embeds: Callable[[], VisionEmbeds] | None = None, temperature: float = 1.0
    ) -> torch.Tensor:
        """(tokens,) log-probability of each label token of the device batch (0 where no label) at
        the sampling `temperature`, without gradients; under context parallelism this rank's chunk's."""
        ...


class FrozenReference:
    """The reference as a model of its own that never trains (a copy of the policy's weights at
    the stage's start, built and sharded as the policy is)."""

    def __init__(
        self,
        model: nn.Module,
        chunk_tokens: int = 1024,
        vision_dummy: VisionDummy | None = None,
        context: Context | None = None,
    ) -> None:
        """`vision_dummy`: the reference's own (a sharded VL model runs its vision tower on every
        batch); `context`: under context parallelism, this rank's chunk of the rows."""
        for parameter in model.parameters():
            parameter.requires_grad_(False)
        self.model = model.eval()
        self.chunk_tokens = chunk_tokens
        self.vision_dummy = vision_dummy
        self.context = context

    def hidden(self, batch: Batch, embeds: Callable[[], VisionEmbeds] | None) -> torch.Tensor:
        """The reference model's final hidden states of the device batch."""
        if self.vision_dummy is not None:
            self.vision_dummy.active = not batch.has_visual
        received = embeds() if embeds is not None else None
        return forward_hidden(self.model, batch, received)

    @torch.no_grad()
    def logps(self, batch: Batch, embeds: Callable[[], VisionEmbeds] | None = None) -> torch.Tensor:
        hidden = self.hidden(batch, embeds)
        head = self.model.lm_head.weight
        logps = segment_logps(hidden, head, batch.labels, batch.cu_seqlens, self.chunk_tokens, self.context)
        if self.context is not None:  # the whole sequences': their chunks' parts summed
            dist.all_reduce(logps, group=self.context.group)
        return logps

    @torch.no_grad()
    def token_logps(
        self, batch: Batch, embeds: Callable[[], VisionEmbeds] | None = None, temperature: float = 1.0
    ) -> torch.Tensor:
        # logits / T = (hidden / T) @ W^T: the temperature goes into the hidden states (see vlmcore.train.grpo).
        hidden = self.hidden(batch, embeds) / temperature
        return chunked_token_logps(hidden, self.model.lm_head.weight, batch.labels, self.chunk_tokens)


class AdaptersOffReference(FrozenReference):
    """The reference of a LoRA stage (`dpo.reference` or `grpo.reference: adapters_off`): the
    policy's own model with its adapters switched off, which is the stage's frozen starting weights.
    It holds no second copy of the model, so a LoRA stage needs the memory of one model, not two."""

    def __init__(
        self,
        model: nn.Module,
        chunk_tokens: int = 1024,
        vision_dummy: VisionDummy | None = None,
        context: Context | None = None,
    ) -> None:
        """`vision_dummy`: the policy step's own (the reference runs the same model). The model is
        the policy: it is neither frozen nor switched to eval here."""
        self.model = model
        self.chunk_tokens = chunk_tokens
        self.vision_dummy = vision_dummy
        self.context = context

    def hidden(self, batch: Batch, embeds: Callable[[], VisionEmbeds] | None) -> torch.Tensor:
        # The LM head has no adapter (config: lora.targets must not match lm_head), so the hidden
        # states are all that the adapters change.
        with adapters_disabled(self.model):
            return super().hidden(batch, embeds)


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
    """DPO as the train step's objective (`vlmcore.train.objective.Objective`): per micro-batch the
    reference's segment log-probabilities (`prepare`), then the policy's from its hidden states
    and the pairs' losses, divided by the global number of pairs."""

    reference: Reference
    beta: float
    label_smoothing: float
    chunk_tokens: int = 1024
    compiled: bool = False  # the chunks' softmax gradient as one compiled kernel (whole-vocabulary heads)
    peers: int = 1  # ranks that hold the same pairs (tensor- and context-parallel ones): their sums count once
    context: Context | None = None  # context parallelism: this rank's chunk of the rows

    count = "pairs"
    sums = PAIR_SUMS

    def prepare(self, batch: Batch, reference_embeds: Callable[[], VisionEmbeds] | None) -> torch.Tensor:
        if batch.pairs is None:
            raise ValueError(f"objective dpo: a batch without preference pairs (rows {batch.row_keys})")
        return self.reference.logps(batch, reference_embeds)

    def loss(
        self, hidden: torch.Tensor, head: torch.Tensor, batch: Batch, reference_logps: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        policy_logps = segment_logps(
            hidden, head, batch.labels, batch.cu_seqlens, self.chunk_tokens, self.context, self.compiled
        )
        if self.context is not None:
            # The whole sequences' log-probabilities, the gradient flowing into this chunk's part
            # only: each context-parallel rank backpropagates the same pair losses through its own
            # tokens, and the ranks' gradients add up to the whole rows'.
            whole = policy_logps.detach().clone()
            dist.all_reduce(whole, group=self.context.group)
            policy_logps = policy_logps + (whole - policy_logps.detach())
        pairs = pair_losses(policy_logps, reference_logps, batch.pairs, self.beta, self.label_smoothing)
        loss_sum = pairs.losses.sum()
        sums = torch.stack(
            [loss_sum.detach(), pairs.chosen_rewards.sum(), pairs.rejected_rewards.sum(), pairs.correct.sum()]
        )
        return loss_sum, sums.double()

    def metrics(self, sums: list[float], counts: dict) -> dict:
        """`loss` is the mean pair loss, with `pair_metrics` beside it."""
        pairs = pair_metrics([value / self.peers for value in sums], counts["pairs"])
        return {"loss": pairs["dpo_loss"], **pairs}


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
