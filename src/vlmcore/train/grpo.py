"""Group relative policy optimisation (GRPO) and its variants: the policy-gradient loss of a
rollout's completions, from the policy's token log-probabilities, the rollout's and a reference's.

A rollout (the sampling policy on a step's prompts, `grpo.group_size` completions each) hands the
train step batches whose segments are the completions, each its prompt then its completion with
labels on the completion tokens only, and `Batch.rollout`: each completion token's log-probability
under the sampling policy (`old_logps`) and its completion's advantage A (its reward against its
group's). Per completion token t, with logp_t the policy's log-probability at the sampling
temperature and ref_t the reference's:

    ratio_t = exp(logp_t - old_logp_t)     (gspo: exp of the completion's mean log-ratio, one per completion)
    loss_t  = -min(ratio_t * A, clip(ratio_t, 1 - epsilon_low, 1 + epsilon_high) * A)
              + beta * (exp(ref_t - logp_t) - (ref_t - logp_t) - 1)

the KL term being the k3 estimator of KL(policy || reference), weighed by ratio_t with
`kl_ratio_weighted` (the tokens are the sampling policy's samples; TRL's use_bias_correction_kl,
on by default there as here). The loss averages the loss_t by
`grpo.loss`:

- grpo: each completion's mean over its tokens, then the mean over the completions;
- dapo: the sum over the completion tokens / the completion tokens of the global batch (every
  token weighs the same; TRL's bnpo, normalised by its batch's tokens, is this once the normaliser
  is global); DAPO's clip-higher is `epsilon_high` > `epsilon_low`, which every variant takes;
- dr_grpo: the sum / (completions x max_new_tokens): no normalisation by a completion's length;
- gspo: the sequence-level ratio (GSPO; TRL's importance_sampling_level "sequence"), averaged as grpo.

Options: `delta`, the dual clip (the unclipped ratio capped at delta: a bound on a negative
advantage's term); `tis_cap`, truncated importance sampling for the gap between the sampler's and
the trainer's log-probabilities of the same weights: the ratio is then taken against the trainer's
own (the policy's, detached: with one update per rollout, the only one allowed with it, they are
the sampling weights) and each token's loss is weighed by min(exp(trainer - sampler), tis_cap),
detached (TRL's vllm_importance_sampling_correction, token_truncate).

The normalisers are global counts (`count`: `completions` or `label_tokens` of
`vlmcore.train.metrics_log.global_counts`), so any split of a global batch over ranks and
micro-batches gives the same gradients. With several updates per rollout batch the old
log-probabilities stay the rollout's: the ratio is 1 (up to the sampler/trainer gap) on the first
update only.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as differentiable

from vlmcore.data import IGNORE_INDEX
from vlmcore.data.load.batch import Batch
from vlmcore.models.qwen3_vl import VisionEmbeds
from vlmcore.train.dpo import Context, Reference, token_segments
from vlmcore.train.loss import chunked_token_logps

LOSSES = ("grpo", "dapo", "dr_grpo", "gspo")

# The sums over a step's completion tokens that the step reduces over the ranks and `metrics`
# reads: the loss sum, then the KL estimate, the ratio, the tokens clipped below and above and
# |old_logp - logp|, each summed over the completion tokens.
GRPO_SUMS = ("loss", "kl", "ratio", "clipped_low", "clipped_high", "logp_gap", "rollout_kl")


def segment_sums(values: torch.Tensor, segment: torch.Tensor, segments: int) -> torch.Tensor:
    """(segments,) sums of the per-token `values` by each token's segment (differentiable)."""
    sums = torch.zeros(segments, dtype=values.dtype, device=values.device)
    return sums.index_add(0, segment, values)


@dataclass
class GRPOObjective:
    """GRPO as the train step's objective (`vlmcore.train.objective.Objective`; module docstring):
    per micro-batch the reference's token log-probabilities (`prepare`, when beta > 0), then the
    policy's from its hidden states and the clipped policy-gradient loss."""

    loss_type: str  # one of LOSSES (`grpo.loss`)
    epsilon_low: float
    epsilon_high: float
    temperature: float = 1.0  # the sampling temperature: the policy's and the reference's logits are divided by it
    max_new_tokens: int = 1  # dr_grpo's normaliser per completion
    beta: float = 0.0  # the KL penalty's weight; 0: no reference
    reference: Reference | None = None
    kl_ratio_weighted: bool = True  # the KL estimate weighed by the ratio (module docstring)
    delta: float = 0.0  # the dual clip's cap on the unclipped ratio; 0: none
    tis_cap: float = 0.0  # truncated importance sampling's cap; 0: none
    chunk_tokens: int = 1024
    compiled: bool = False  # the chunks' softmax gradient as one compiled kernel (whole-vocabulary heads)
    tp: int = 1  # tensor-parallel ranks: each holds the same rows, their sums count once
    context: Context | None = None  # context parallelism: this rank's chunk of the rows

    sums = GRPO_SUMS

    def __post_init__(self) -> None:
        if self.loss_type not in LOSSES:
            raise ValueError(f"grpo.loss: must be one of {', '.join(LOSSES)}, got {self.loss_type!r}")
        if self.beta > 0 and self.reference is None:
            raise ValueError("grpo.beta > 0 needs a reference policy")
        # The global count the step divides the loss sum by: dapo weighs every token the same, the
        # others every completion (dr_grpo's max_new_tokens is in its sum).
        self.count = "label_tokens" if self.loss_type == "dapo" else "completions"

    def prepare(self, batch: Batch, reference_embeds: Callable[[], VisionEmbeds] | None) -> torch.Tensor | None:
        if batch.rollout is None:
            raise ValueError(f"objective grpo: a batch without a rollout (rows {batch.row_keys})")
        if self.reference is None:
            return None
        return self.reference.token_logps(batch, reference_embeds, self.temperature)

    def loss(
        self, hidden: torch.Tensor, head: torch.Tensor, batch: Batch, reference_logps: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # logits / T = (hidden / T) @ W^T: the policy at the sampling temperature through the one
        # chunked, vocabulary-parallel path of vlmcore.train.loss, unchanged. Exact in real
        # arithmetic; in fp32 the scaled hidden states only round differently (about 1e-7
        # relative), and the log-probabilities equal TRL's of logits / T to 1e-5
        # (tests/train/test_train_grpo_trl.py).
        logps = chunked_token_logps(hidden / self.temperature, head, batch.labels, self.chunk_tokens, self.compiled)
        device, dtype = logps.device, logps.dtype
        mask = (batch.labels.reshape(-1).to(device) != IGNORE_INDEX).to(dtype)
        old_logps = batch.rollout.old_logps.reshape(-1).to(device, dtype)
        advantages = batch.rollout.advantages.reshape(-1).to(device, dtype)
        segment = token_segments(batch.labels, batch.cu_seqlens, self.context).to(device)
        segments = len(batch.cu_seqlens) - 1
        completion_tokens = self.whole(segment_sums(mask, segment, segments))  # each whole completion's tokens

        if self.tis_cap > 0:
            # The ratio against the trainer's own log-probabilities of the sampling weights, and
            # the sampler/trainer gap corrected by a capped, detached weight per token.
            sampling_logps = logps.detach()
            tis_weights = torch.exp(logps.detach() - old_logps).clamp(max=self.tis_cap)
        else:
            sampling_logps = old_logps
        log_ratio = (logps - sampling_logps) * mask
        if self.loss_type == "gspo":
            log_ratio = self.sequence_log_ratio(log_ratio, segment, segments, completion_tokens)
        ratio = torch.exp(log_ratio)
        clipped = ratio.clamp(1 - self.epsilon_low, 1 + self.epsilon_high)
        unclipped = ratio.clamp(max=self.delta) if self.delta > 0 else ratio
        token_losses = -torch.min(unclipped * advantages, clipped * advantages)
        if self.tis_cap > 0:
            token_losses = token_losses * tis_weights
        kl = torch.zeros_like(logps)
        if self.beta > 0:
            reference_gap = reference_logps.to(dtype) - logps
            kl = torch.exp(reference_gap) - reference_gap - 1
            if self.kl_ratio_weighted:
                # The completions are the sampling policy's: weighed by the ratio, the estimate is
                # the current policy's KL (TRL's use_bias_correction_kl, its default).
                kl = kl * ratio
            token_losses = token_losses + self.beta * kl
        token_losses = token_losses * mask

        if self.loss_type in ("grpo", "gspo"):  # each completion's mean, summed (the step divides by completions)
            loss_sum = (token_losses / completion_tokens.clamp(min=1)[segment]).sum()
        elif self.loss_type == "dr_grpo":
            loss_sum = token_losses.sum() / self.max_new_tokens
        else:  # dapo: the step divides by the completion tokens
            loss_sum = token_losses.sum()

        with torch.no_grad():
            ratio = ratio.detach()
            clipped_low = (ratio < 1 - self.epsilon_low) & (advantages < 0)
            clipped_high = (ratio > 1 + self.epsilon_high) & (advantages > 0)
            sums = torch.stack(
                [
                    loss_sum.detach(),
                    (kl.detach() * mask).sum(),
                    (ratio * mask).sum(),
                    (clipped_low * mask).sum(),
                    (clipped_high * mask).sum(),
                    ((old_logps - logps.detach()).abs() * mask).sum(),
                    # KL(sampler || trainer), k3 estimate on the sampler's tokens: exp(d) - d - 1, d = new - old
                    ((torch.expm1(logps.detach() - old_logps) - (logps.detach() - old_logps)) * mask).sum(),
                ]
            )
        return loss_sum, sums.double()

    def whole(self, per_segment: torch.Tensor) -> torch.Tensor:
        """Per-segment sums of this rank's tokens made the whole segments' (no gradient): under
        context parallelism summed over the chunks' ranks."""
        if self.context is None:
            return per_segment
        whole = per_segment.detach().clone()
        dist.all_reduce(whole, group=self.context.group)
        return whole

    def sequence_log_ratio(
        self, log_ratio: torch.Tensor, segment: torch.Tensor, segments: int, completion_tokens: torch.Tensor
    ) -> torch.Tensor:
        """GSPO: each token's completion's mean log-ratio. Under context parallelism every rank's
        loss is its chunk's part of the completions' terms, all functions of the whole completions'
        means: the chunks' sums are added over the cp group in the forward and the gradients
        reaching them in the backward (a differentiable all-reduce), so each rank's tokens get
        their part of the whole loss's gradient."""
        sums = segment_sums(log_ratio, segment, segments)
        if self.context is not None:
            sums = differentiable.all_reduce(sums, group=self.context.group)
        return (sums / completion_tokens.clamp(min=1))[segment]

    def metrics(self, sums: list[float], counts: dict) -> dict:
        """`loss` (the step's normalised loss), then per completion token: the mean ratio, the
        shares clipped below (ratio < 1 - epsilon_low, A < 0) and above (ratio > 1 + epsilon_high,
        A > 0), the mean |old_logp - logp| (on a rollout batch's first update, the rollout/training
        gap) and the KL from the sampler to the trainer (k3), and with a reference the mean KL
        estimate."""
        loss, kl, ratio, clipped_low, clipped_high, gap, rollout_kl = (value / self.tp for value in sums)
        tokens = max(counts["label_tokens"], 1)
        metrics = {
            "loss": loss / max(counts[self.count], 1),
            "grpo_ratio": ratio / tokens,
            "grpo_clip_low": clipped_low / tokens,
            "grpo_clip_high": clipped_high / tokens,
            "grpo_logp_gap": gap / tokens,
            "grpo_rollout_kl": rollout_kl / tokens,
        }
        if self.beta > 0:
            metrics["grpo_kl"] = kl / tokens
        return metrics
