"""What a stage trains for: the `Objective` the train step (`vlmcore.train.step`) calls for each
micro-batch, and SFT's, next-token cross-entropy.

The step owns everything that is the same for every objective: the loop over the micro-batches,
FSDP's gradient sync on the last one, the vision tower's dummy pass, the image embeddings of
disjoint layouts, the MoE load-balancing loss, backward, the TP-partial gradients, the norm,
clipping, the one all-reduce and host read, the optimizer. An objective owns what differs:

- `count`: the global count its summed loss is divided by (a key of
  `vlmcore.train.metrics_log.global_counts`: `label_tokens` for SFT, `pairs` for DPO), counted
  on the host before the step, so that any split of a global batch gives the same gradients;
- `prepare(batch, reference_embeds)`: what it needs of a micro-batch before the policy's forward, without gradients
  (DPO: the reference's log-probabilities; an RL objective: the sampling policy's and the
  reference's); the step runs it outside the MoE routing statistics;
- `loss(hidden, head, batch, prepared)`: from the policy's final hidden states, through the LM
  head by `vlmcore.train.loss` (the one chunked token-log-probability path, vocabulary-parallel
  under TP), this rank's loss *sum* (with gradients) and its `sums` (detached, float64: the
  step adds them over the micro-batches and all-reduces them over all ranks);
- `metrics(sums, counts)`: the step's record fields from those global sums, `loss` first.

An objective is built once per run (`vlmcore.train.build`) and knows the layout facts its sums
need: how many ranks hold the same rows (tensor-parallel peers, and for a per-sequence quantity
the context-parallel ones) and, under context parallelism, how to add a sequence's parts.
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from vlmcore.data.load.batch import Batch
from vlmcore.models.qwen3_vl import VisionEmbeds
from vlmcore.train.loss import chunked_cross_entropy


class Objective(Protocol):
    """What the train step asks of a stage's objective (module docstring)."""

    count: str  # the global count that divides the loss sum: a `global_counts` key
    sums: tuple[str, ...]  # names of what `loss` returns besides the loss, the loss's sum first

    def prepare(self, batch: Batch, reference_embeds: Callable[[], VisionEmbeds] | None) -> Any:
        """What the loss needs of the device micro-batch before the policy's forward (no gradients).
        `reference_embeds`: on a language rank of disjoint layouts, receives the micro-batch's image
        embeddings of the reference's tower (`DisjointBridge.reference_tower`), for an objective
        that runs a reference; None otherwise."""
        ...

    def loss(
        self, hidden: torch.Tensor, head: torch.Tensor, batch: Batch, prepared: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this rank's loss sum, with gradients; its `sums`, (len(sums),) float64, detached)."""
        ...

    def metrics(self, sums: list[float], counts: dict) -> dict:
        """The step record's fields from the `sums` over all ranks and the global counts: `loss` first."""
        ...


@dataclass
class CrossEntropy:
    """SFT: next-token cross-entropy over the label tokens, divided by the global label tokens."""

    chunk_tokens: int = 1024
    compiled: bool = False  # each chunk's softmax and gradient as one compiled kernel
    tp: int = 1  # tensor-parallel ranks: each holds the same rows' loss

    count = "label_tokens"
    sums = ("loss",)

    def prepare(self, batch: Batch, reference_embeds: Callable[[], VisionEmbeds] | None) -> None:
        return None

    def loss(
        self, hidden: torch.Tensor, head: torch.Tensor, batch: Batch, prepared: None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        loss_sum, _ = chunked_cross_entropy(hidden, head, batch.labels, self.chunk_tokens, compiled=self.compiled)
        return loss_sum, loss_sum.detach().double().view(1)

    def metrics(self, sums: list[float], counts: dict) -> dict:
        return {"loss": sums[0] / self.tp / counts["label_tokens"]}
