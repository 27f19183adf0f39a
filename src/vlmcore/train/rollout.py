"""GRPO's rollouts, sampled by the policy itself, and what they hand to the objective.

- `rollout`: each prompt sampled `group_size` times by `vlmcore.generate` on the model as it
  trains (plain, or as `parallelize` left it: under FSDP2 its weights are gathered once for the
  rollout, generate/parallel.py). The group shares the prompt's prefill, so its images and video
  go through the vision tower once. Each token's recorded log-probability is the one the training
  forward computes for it, log_softmax(logits / temperature) over the whole vocabulary (TRL's
  convention), not the top-k / top-p cut distribution it was drawn from (`Completion`).
- `rollout_batch`: prompt + completion of every sample as one packed segment, in rows of a token
  budget: the training batches' layout (`cu_seqlens`, `vlmcore.models.position_ids`), labels on
  the completion tokens only, and `Batch.rollout` holding each label's recorded log-probability
  and its completion's advantage. Same model, same code, same positions: the first update's
  ratio is 1 (tests/train/test_train_rollout_exact.py).
- `group_advantages` (GRPO, "batch" scaling, Dr. GRPO), `uniform_groups` (DAPO's dynamic
  sampling: groups whose rewards are all equal carry no signal) and `overlong_penalty` (DAPO's
  soft penalty on completions near or past the length limit).
"""

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from vlmcore.data import IGNORE_INDEX
from vlmcore.data.load.batch import Batch, Images, Rollout
from vlmcore.generate import GenerationError, Prompt, SamplingSettings, generate
from vlmcore.generate.parallel import gathered_weights
from vlmcore.models import position_ids


@dataclass
class Completion:
    """One sample of a prompt: its tokens (a stop token included), each token's log-probability
    and why it ended. `logps`: under log_softmax(logits / temperature) of the whole vocabulary, the
    policy's distribution as the training forward computes it (the objective's old log-probability);
    `sampling_logps`: under the distribution it was drawn from (after the top-k / top-p cut,
    renormalised, with the media placeholders blocked). They differ with top_p < 1 or top_k > 0,
    and by the placeholders' mass; the objective uses `logps`."""

    prompt_index: int
    tokens: list[int]
    logps: list[float]
    sampling_logps: list[float]
    finish_reason: str  # "stop_token", "stop_string" or "length" (cut at max_new_tokens)
    text: str | None = None

    @property
    def length(self) -> int:
        return len(self.tokens)

    @property
    def truncated(self) -> bool:
        """Cut at max_new_tokens, without a stop: what DAPO's overlong penalty looks at."""
        return self.finish_reason == "length"


def rollout(
    model: nn.Module,
    prompts: list[Prompt],
    group_size: int,
    settings: SamplingSettings,
    seeds: Sequence[int] | None = None,
    tokenizer: object | None = None,
    memory_limit: int | None = None,
) -> list[Completion]:
    """`group_size` completions of each prompt, prompt-major (prompt i's are i*group_size ..
    (i+1)*group_size - 1), sampled at settings.temperature (> 0) with its top-k / top-p cut and
    stops (its `n` is replaced by `group_size`). `seeds`: one per completion, the stream its tokens
    are drawn from (`generate`'s; default: from settings.seed and the prompt's index in the call).
    `tokenizer`: for stop strings and each completion's `text`; `memory_limit`: generate's."""
    if not isinstance(group_size, int) or group_size < 1:
        raise GenerationError(f"rollout group_size={group_size!r} must be an int >= 1")
    if settings.greedy:
        raise GenerationError("rollout needs sampling: temperature 0 (greedy) would make a group's samples equal")
    settings = replace(settings, n=group_size)
    with gathered_weights(model):
        samples = generate(model, prompts, settings, tokenizer, memory_limit, seeds=seeds)
    return [
        Completion(s.prompt_index, s.tokens, s.policy_log_probs, s.log_probs, s.finish_reason, s.text) for s in samples
    ]


def rollout_batch(
    prompts: list[Prompt],
    completions: list[Completion],
    advantages: torch.Tensor | Sequence[float],
    config: object,
    seq_len: int,
    pad_token_id: int = 0,
) -> Batch:
    """The completions as one training Batch: each sample's prompt + completion one packed
    segment, the segments in order in rows of `seq_len` tokens (a segment that does not fit in
    the row's room starts the next row; each row padded to `seq_len` by a segment of its own, of
    `pad_token_id`, with no label). `advantages`: one per completion (`group_advantages`,
    flattened). `config`: the model's (its positions, its media token ids).

    Labels are the completion's tokens, shifted as the loader shifts them (label[t] is the target
    of logits[t]): the prompt's last position predicts the first completion token, and the labels
    end at the completion's last token (its stop token, or its last token when cut at
    max_new_tokens). `rollout.old_logps` holds each label's recorded `Completion.logps`,
    `rollout.advantages` its completion's advantage. The images and videos are the prompts'
    (`Prompt.pixel_values`, normalised floats: `normalize=None`), repeated for each sample, in
    token order."""
    advantages = torch.as_tensor(advantages, dtype=torch.float32).flatten()
    if len(advantages) != len(completions):
        raise ValueError(f"{len(advantages)} advantages for {len(completions)} completions: one each")
    media_tokens = {getattr(config, name, None) for name in ("image_token_id", "video_token_id")}
    if pad_token_id in media_tokens:
        raise ValueError(f"pad_token_id {pad_token_id} is a media placeholder of the model's config")
    rows = [RowBuilder(seq_len)]
    for index, (completion, advantage) in enumerate(zip(completions, advantages.tolist())):
        prompt = prompts[completion.prompt_index]
        segment = len(prompt.input_ids) + completion.length
        if segment > seq_len:
            raise ValueError(
                f"completion {index} (prompt {completion.prompt_index}): {len(prompt.input_ids)} prompt + "
                f"{completion.length} completion tokens do not fit a row of seq_len {seq_len}"
            )
        if rows[-1].room < segment:
            rows.append(RowBuilder(seq_len))
        rows[-1].add(prompt, completion, advantage)
    for row in rows:
        row.pad(pad_token_id)
    input_ids = torch.stack([torch.cat(row.ids) for row in rows])
    segment_lengths = torch.tensor([n for row in rows for n in row.lengths])
    cu_seqlens = F.pad(segment_lengths.cumsum(0), (1, 0)).to(torch.int32)
    images = media([p for row in rows for p in row.prompts], "pixel_values", "image_grid_thw", "image")
    videos = media([p for row in rows for p in row.prompts], "pixel_values_videos", "video_grid_thw", "video")
    positions = position_ids(
        config,
        input_ids,
        None if images is None else images.grid_thw,
        cu_seqlens,
        None if videos is None else videos.grid_thw,
    )
    return Batch(
        input_ids=input_ids,
        labels=torch.stack([torch.cat(row.labels) for row in rows]),
        cu_seqlens=cu_seqlens,
        position_ids=positions,
        images=images,
        videos=videos,
        num_samples=len(completions),
        rollout=Rollout(
            old_logps=torch.stack([torch.cat(row.old_logps) for row in rows]),
            advantages=torch.stack([torch.cat(row.advantages) for row in rows]),
        ),
    )


class RowBuilder:
    """One row of a rollout batch as its segments are added: per-token parts and segment lengths."""

    def __init__(self, seq_len: int) -> None:
        self.room = seq_len
        self.ids: list[torch.Tensor] = []
        self.labels: list[torch.Tensor] = []
        self.old_logps: list[torch.Tensor] = []
        self.advantages: list[torch.Tensor] = []
        self.lengths: list[int] = []
        self.prompts: list[Prompt] = []  # each segment's prompt, for its media

    def add(self, prompt: Prompt, completion: Completion, advantage: float) -> None:
        prompt_length = len(prompt.input_ids)
        tokens = torch.tensor(completion.tokens, dtype=torch.long)
        length = prompt_length + len(tokens)
        # Position t's label is token t + 1: the completion's tokens are the labels of positions
        # prompt_length - 1 .. length - 2; the segment's last position has no target.
        labels = torch.full((length,), IGNORE_INDEX, dtype=torch.long)
        labels[prompt_length - 1 : length - 1] = tokens
        old_logps = torch.zeros(length, dtype=torch.float32)
        old_logps[prompt_length - 1 : length - 1] = torch.tensor(completion.logps, dtype=torch.float32)
        advantages = torch.zeros(length, dtype=torch.float32)
        advantages[prompt_length - 1 : length - 1] = advantage
        self.ids.append(torch.cat([prompt.input_ids.long(), tokens]))
        self.labels.append(labels)
        self.old_logps.append(old_logps)
        self.advantages.append(advantages)
        self.lengths.append(length)
        self.prompts.append(prompt)
        self.room -= length

    def pad(self, pad_token_id: int) -> None:
        """The rest of the row: one segment of padding with no label (attention and the Gated
        DeltaNet layers keep segments apart, so its ids change nothing of the others)."""
        if self.room == 0:
            return
        self.ids.append(torch.full((self.room,), pad_token_id, dtype=torch.long))
        self.labels.append(torch.full((self.room,), IGNORE_INDEX, dtype=torch.long))
        self.old_logps.append(torch.zeros(self.room, dtype=torch.float32))
        self.advantages.append(torch.zeros(self.room, dtype=torch.float32))
        self.lengths.append(self.room)
        self.room = 0


def media(prompts: list[Prompt], pixels: str, grids: str, kind: str) -> Images | None:
    """The segments' images (or videos) in token order, as float inputs of the model, or None."""
    with_media = [p for p in prompts if getattr(p, pixels) is not None]
    if not with_media:
        return None
    return Images(
        torch.cat([getattr(p, pixels) for p in with_media]),
        torch.cat([torch.as_tensor(getattr(p, grids), dtype=torch.long) for p in with_media]),
        normalize=None,
        kind=kind,
    )


# --- Advantages and DAPO's helpers ---------------------------------------------------------------

ADVANTAGE_SCALES = ("group", "batch", "none")
# Added to the standard deviation before dividing: TRL's GRPOTrainer's value.
STD_EPS = 1e-4


def group_advantages(
    rewards: torch.Tensor, scale: str = "group", batch_std: torch.Tensor | None = None
) -> torch.Tensor:
    """(prompts, group) rewards -> (prompts, group) advantages, (r - the group's mean) / (std + 1e-4):
    `scale` "group": the group's std (GRPO); "batch": the std of all the rewards (`batch_std` when
    given: the whole batch's over several ranks); "none": no division, mean-centred only (Dr.
    GRPO). The std is unbiased (Bessel's correction), 0 for a single value, as TRL's GRPOTrainer
    computes it (trl/trainer/grpo_trainer.py, `nanstd`)."""
    if scale not in ADVANTAGE_SCALES:
        raise ValueError(f"advantage scale {scale!r} must be one of {ADVANTAGE_SCALES}")
    if rewards.dim() != 2:
        raise ValueError(f"rewards of shape {tuple(rewards.shape)} must be (prompts, group)")
    rewards = rewards.float()
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    if scale == "none":
        return centred
    if scale == "group":
        std = rewards.std(dim=1, keepdim=True) if rewards.shape[1] > 1 else torch.zeros_like(rewards[:, :1])
    elif batch_std is not None:
        std = batch_std
    else:
        std = rewards.std() if rewards.numel() > 1 else torch.zeros(())
    return centred / (std + STD_EPS)


def uniform_groups(rewards: torch.Tensor) -> torch.Tensor:
    """(prompts, group) rewards -> (prompts,) bool: the groups whose rewards are all equal. Their
    advantages are all 0 (no gradient but the KL term's), so DAPO's dynamic sampling drops them
    and samples more prompts until the batch is full."""
    return (rewards == rewards[:, :1]).all(dim=1)


def overlong_penalty(
    lengths: torch.Tensor | Sequence[int], max_length: int, buffer: int, factor: float = 1.0
) -> torch.Tensor:
    """DAPO's soft overlong penalty (its eq. 13) of completions of `lengths` tokens, a reward term
    in [-factor, 0]: 0 up to max_length - buffer tokens, then falling linearly to -factor at
    max_length, -factor beyond. `max_length`: the completions' limit (max_new_tokens); `buffer`:
    the length of the soft zone before it (DAPO's L_cache)."""
    if not 0 <= buffer <= max_length:
        raise ValueError(f"overlong buffer {buffer} must be in [0, max_length {max_length}]")
    lengths = torch.as_tensor(lengths, dtype=torch.float32)
    start = max_length - buffer
    if buffer == 0:
        return torch.where(lengths > max_length, -factor, 0.0)
    return -factor * ((lengths - start) / buffer).clamp(0, 1)
