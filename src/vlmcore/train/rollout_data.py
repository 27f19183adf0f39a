"""An online-RL stage's data: each rollout's micro-batches, sampled by the policy as it trains.

The train loop takes `grad_accum_steps` micro-batches a step from its data stream, whatever the
objective; for GRPO that stream is `RolloutData`. Every `updates_per_rollout` steps it makes a
new rollout on this data-parallel rank:

1. its share of the step's prompts (vlmcore.train.prompts: a world-size-free stream);
2. `group_size` completions of each, by the policy itself (vlmcore.train.rollout), each drawn
   from a stream seeded by the stage's seed, the prompt's place in the stream and the sample's
   index alone: a prompt's completions are the same on whichever rank, at whatever world size;
3. their rewards, from the scorer the stage was given (vlmcore.rewards: worker processes, a time
   limit per call, failures scored 0 and counted), plus DAPO's overlong penalty if set;
4. the group advantages ("batch" scaling: the std of every rank's rewards), with DAPO's dynamic
   sampling dropping the groups whose rewards are all equal;
5. the groups split into `grad_accum_steps` parts, each packed into one micro-batch
   (`rollout_batch`). A part left without a group (fewer groups than parts on this rank) is a
   group with no label, which adds nothing to the loss and the counts: the ranks' collectives need
   its forward. So a step is one process's at any world size.

The same micro-batches serve each of the rollout's updates: the recorded log-probabilities stay
the rollout's, so the ratio is 1 on the first update only. A checkpoint holds the position (the
rollouts made, the micro-batches taken) and, between two updates of one rollout, the rollout
itself (safetensors bytes), so a resumed stage continues exactly; at a rollout's end, also under
another layout (`seek`).

`metrics()` gives the last rollout's figures over all ranks (one all-reduce): mean reward and
per reward name, the failures by reason, completion lengths, truncated and dropped shares.
"""

import io
import json
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.distributed as dist
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors
from torch import nn

from vlmcore.data import IGNORE_INDEX
from vlmcore.data.load.batch import Batch, Images, Rollout
from vlmcore.generate import SamplingSettings
from vlmcore.train.checkpoint import CheckpointError
from vlmcore.train.rollout import Completion, group_advantages, overlong_penalty, rollout, rollout_batch, uniform_groups

if TYPE_CHECKING:  # the prompts' encoder needs the image processor, which a trainer of packed rows never imports
    from vlmcore.train.prompts import PromptSource, RLPrompt


@dataclass
class RewardScores:
    """A scorer's answer for a rollout's completions, in their order."""

    values: list[float]  # each completion's total reward (the rewards' weighted sum)
    by_name: dict[str, list[float]] = field(default_factory=dict)  # each reward's own values, for metrics
    failures: Counter = field(default_factory=Counter)  # calls scored 0, by reason ("timeout", "raised:KeyError", ...)


# (the rollout's prompts, its completions, prompt-major) -> their rewards
Scorer = Callable[[list["RLPrompt"], list[Completion]], RewardScores]


@dataclass
class RolloutPlan:
    """What a rollout is made of (the stage's `grpo:` settings)."""

    prompts_per_step: int  # global: every rank takes its share
    group_size: int
    sampling: SamplingSettings  # temperature, top_p, top_k, max_new_tokens, stops
    scale_rewards: str = "group"  # `group_advantages`' scale
    updates_per_rollout: int = 1
    seq_len: int = 4096  # a micro-batch row's tokens (a prompt and its completion must fit one)
    dynamic_sampling: bool = False
    shuffle_rewards: bool = False  # a control: each group's rewards permuted before the advantages
    overlong_buffer: int = 0  # DAPO's soft overlong zone (tokens before max_new_tokens); 0: off
    overlong_factor: float = 1.0


class RolloutData:
    """This data-parallel rank's GRPO micro-batches (module docstring); a `ResumableData`."""

    # For `resume`: the stream's position is its steps (a step is `prompts_per_step` prompts at any
    # batch split), not the rows counted (`seek`).
    position_is_steps = True

    def __init__(
        self,
        model: nn.Module,
        prompts: "PromptSource",
        plan: RolloutPlan,
        scorer: Scorer,
        *,
        dp_rank: int,
        dp_world: int,
        grad_accum_steps: int,
        seed: int,
        device: torch.device,
        pad_token_id: int = 0,
        tokenizer: object | None = None,
    ) -> None:
        self.model = model
        self.prompts = prompts
        self.plan = plan
        self.scorer = scorer
        self.dp_rank = dp_rank
        self.dp_world = dp_world
        self.grad_accum_steps = grad_accum_steps
        self.device = device
        self.pad_token_id = pad_token_id
        self.tokenizer = tokenizer
        self.seed = seed
        self.rollouts = 0  # rollouts made
        self.taken = 0  # micro-batches taken from the current rollout, over all its updates
        self.current: list[Batch] = []
        self.last_metrics: dict = {}

    @property
    def dataset_names(self) -> list[str]:
        return []

    def __iter__(self) -> Iterator[Batch]:
        return self

    def __next__(self) -> Batch:
        per_rollout = self.grad_accum_steps * self.plan.updates_per_rollout
        if not self.current or self.taken == per_rollout:
            self.current = self.make_rollout()
            self.rollouts += 1
            self.taken = 0
        batch = self.current[self.taken % self.grad_accum_steps]
        self.taken += 1
        return batch

    def make_rollout(self) -> list[Batch]:
        """The next rollout's micro-batches on this rank (module docstring, steps 1-5)."""
        plan = self.plan
        start = self.rollouts * plan.prompts_per_step
        rl_prompts = self.prompts.step_prompts(start, plan.prompts_per_step, self.dp_rank, self.dp_world)
        if not rl_prompts:
            raise ValueError(
                f"rollout {self.rollouts + 1}: none of this rank's prompts [{start}, {start + plan.prompts_per_step}) "
                f"could be used ({dict(self.prompts.skipped)})"
            )
        was_training = self.model.training
        self.model.eval()
        generation_start = time.perf_counter()
        seeds = [self.sample_seed(p.position, j) for p in rl_prompts for j in range(plan.group_size)]
        with torch.no_grad():
            completions = rollout(
                self.model, [p.prompt for p in rl_prompts], plan.group_size, plan.sampling, seeds, self.tokenizer
            )
        self.model.train(was_training)
        reward_start = time.perf_counter()  # generation reads each token on the host: its work is done
        scores = self.scorer(rl_prompts, completions)
        seconds = {"generation": reward_start - generation_start, "rewards": time.perf_counter() - reward_start}
        rewards = torch.tensor(scores.values, dtype=torch.float32)
        if plan.overlong_buffer:
            lengths = [c.length for c in completions]
            rewards = rewards + overlong_penalty(
                lengths, plan.sampling.max_new_tokens, plan.overlong_buffer, plan.overlong_factor
            )
        rewards = rewards.view(len(rl_prompts), plan.group_size)
        scored = self.shuffled(rewards, rl_prompts) if plan.shuffle_rewards else rewards
        advantages = group_advantages(scored, plan.scale_rewards, self.batch_std(scored))
        kept = list(range(len(rl_prompts)))
        if plan.dynamic_sampling:
            kept = [i for i, uniform in enumerate(uniform_groups(rewards).tolist()) if not uniform]
        self.last_metrics = self.rollout_sums(
            rl_prompts, completions, scores, rewards, len(rl_prompts) - len(kept), seconds
        )
        return self.micro_batches(rl_prompts, completions, advantages, kept)

    def sample_seed(self, position: int, sample: int) -> int:
        """The seed of sample `sample` of the stage's prompt `position` (its place in the stream)."""
        return int(np.random.SeedSequence([self.seed, 3, position, sample]).generate_state(1)[0])

    def shuffled(self, rewards: torch.Tensor, rl_prompts: list["RLPrompt"]) -> torch.Tensor:
        """`rewards` (groups, group_size) with each group's permuted, by a generator of the seed and
        the group's prompt alone (a resumed stage, and any layout, permutes as the uninterrupted one)."""
        orders = []
        for prompt in rl_prompts:
            state = np.random.SeedSequence([self.seed, 5, prompt.position]).generate_state(1)[0]
            orders.append(torch.randperm(rewards.shape[1], generator=torch.Generator().manual_seed(int(state))))
        return rewards.gather(1, torch.stack(orders))

    def batch_std(self, rewards: torch.Tensor) -> torch.Tensor | None:
        """For "batch" scaling over several data-parallel ranks: the std of every rank's rewards
        (unbiased, as TRL's over the gathered batch), from one all-reduce of their count, sum and sum
        of squares. None (`group_advantages` takes this rank's) in one process or another scaling."""
        if self.plan.scale_rewards != "batch" or self.dp_world == 1 or not dist.is_initialized():
            return None
        values = rewards.double().flatten()
        moments = torch.stack(
            [torch.tensor(float(len(values)), dtype=torch.float64), values.sum(), values.square().sum()]
        )
        dist.all_reduce(moments)
        count, total, squares = (moments / (dist.get_world_size() // self.dp_world)).tolist()  # peers count it again
        if count < 2:
            return torch.zeros(())
        return torch.tensor(max(squares - total * total / count, 0.0) / (count - 1)).sqrt().float()

    def micro_batches(
        self, rl_prompts: list["RLPrompt"], completions: list[Completion], advantages: torch.Tensor, kept: list[int]
    ) -> list[Batch]:
        """The kept groups split into `grad_accum_steps` parts, each packed as one micro-batch; a
        part without a group gets the first one with no label (module docstring, step 5)."""
        group = self.plan.group_size
        parts = [list(part) for part in np.array_split(np.asarray(kept, dtype=np.int64), self.grad_accum_steps)]
        batches = []
        for part in parts:
            groups = [int(i) for i in part] or [kept[0] if kept else 0]
            prompts = [rl_prompts[i].prompt for i in groups]
            chosen = []
            for new_index, i in enumerate(groups):
                for completion in completions[i * group : (i + 1) * group]:
                    chosen.append(
                        Completion(
                            new_index,
                            completion.tokens,
                            completion.logps,
                            completion.sampling_logps,
                            completion.finish_reason,
                            completion.text,
                        )
                    )
            values = torch.cat([advantages[i] for i in groups])
            batch = rollout_batch(prompts, chosen, values, self.model.config, self.plan.seq_len, self.pad_token_id)
            if not part:
                batch.labels = torch.full_like(batch.labels, IGNORE_INDEX)
            batches.append(batch)
        return batches

    def rollout_sums(
        self,
        rl_prompts: list["RLPrompt"],
        completions: list[Completion],
        scores: RewardScores,
        rewards: torch.Tensor,
        dropped: int,
        seconds: dict[str, float],
    ) -> dict:
        """This rank's sums for `metrics` (added over the ranks there)."""
        sums = {
            "generation_seconds": seconds["generation"],
            "reward_seconds": seconds["rewards"],
            "completions": len(completions),
            "groups": len(rl_prompts),
            "reward": float(rewards.sum()),
            "completion_tokens": sum(c.length for c in completions),
            "truncated": sum(c.truncated for c in completions),
            "dropped_groups": dropped,
        }
        for name, values in scores.by_name.items():
            sums[f"reward/{name}"] = float(sum(values))
        for reason, count in scores.failures.items():
            sums[f"reward_failures/{reason}"] = count
        return sums

    def metrics(self) -> dict:
        """The last rollout's figures over all ranks (every rank calls it, after each step)."""
        names = sorted(self.last_metrics)
        gathered = [None] * dist.get_world_size() if dist.is_initialized() else [names]
        if dist.is_initialized():
            dist.all_gather_object(gathered, names)
        keys = sorted({name for part in gathered for name in part})
        values = torch.tensor([float(self.last_metrics.get(k, 0)) for k in keys], dtype=torch.float64)
        if dist.is_initialized():
            dist.all_reduce(values)
            values /= dist.get_world_size() // self.dp_world  # the peers of a data-parallel rank count it again
        total = dict(zip(keys, values.tolist()))
        completions = max(total.get("completions", 0), 1)
        out = {
            "reward_mean": total.get("reward", 0) / completions,
            "completion_length_mean": total.get("completion_tokens", 0) / completions,
            "truncated_fraction": total.get("truncated", 0) / completions,
            "dropped_group_fraction": total.get("dropped_groups", 0) / max(total.get("groups", 0), 1),
            "rollouts": self.rollouts,
            # The last rollout's wall seconds, the mean over the data-parallel ranks: the policy's
            # sampling, then the rewards' scoring (both inside the step's data_wait_s).
            "rollout_generation_s": total.get("generation_seconds", 0) / self.dp_world,
            "rollout_reward_s": total.get("reward_seconds", 0) / self.dp_world,
        }
        for key, value in total.items():
            if key.startswith("reward/"):
                out[f"reward_mean/{key.removeprefix('reward/')}"] = value / completions
            elif key.startswith("reward_failures/"):
                out[key] = int(value)
        return out

    # --- ResumableData ----------------------------------------------------------------------------

    def state_dict(self) -> dict:
        between_updates = bool(self.current) and self.taken < self.grad_accum_steps * self.plan.updates_per_rollout
        return {
            "rollouts": self.rollouts,
            "taken": self.taken,
            # Between two updates of a rollout, the rollout itself: the weights that sampled it are gone.
            "current": batches_to_bytes(self.current) if between_updates else b"",
            # and its figures, which the steps after the resume log again
            "rollout_metrics": json.dumps(self.last_metrics).encode(),
        }

    def load_state_dict(self, state: dict) -> None:
        self.rollouts = int(state["rollouts"])
        self.taken = int(state["taken"])
        self.current = batches_from_bytes(state["current"]) if state["current"] else []
        self.last_metrics = json.loads(bytes(state["rollout_metrics"]).decode())
        if not self.current:
            self.taken = self.grad_accum_steps * self.plan.updates_per_rollout  # the next take makes a rollout

    def seek(self, rows: int, steps: int) -> None:
        """A resume under another layout than the checkpoint's (the only caller of `seek`), from the
        steps taken (`rows`, the rows' count, says nothing of a rollout): the rollouts are the same at
        any world size (module docstring), so the stage goes on with the next rollout when the
        checkpoint was written at a rollout's end. Between two updates of one rollout it is refused:
        the rollout was sampled by weights that are gone, and it is held per rank, split as the
        layout that wrote it split it."""
        if steps % self.plan.updates_per_rollout:
            raise CheckpointError(
                f"a GRPO stage resumes on another layout only from a checkpoint at a rollout's end; this one "
                f"is at step {steps}, inside a rollout of grpo.updates_per_rollout {self.plan.updates_per_rollout} "
                "steps: resume with the parallel settings that wrote it, or checkpoint at multiples of "
                "updates_per_rollout (checkpoint.interval)"
            )
        self.rollouts = steps // self.plan.updates_per_rollout
        self.current = []
        self.taken = self.grad_accum_steps * self.plan.updates_per_rollout  # the next take makes a rollout


def batches_to_bytes(batches: list[Batch]) -> bytes:
    """Rollout micro-batches as safetensors bytes (no pickle): their tensors, and the rest as metadata."""
    tensors = {}
    meta = []
    for i, batch in enumerate(batches):
        parts = {
            "input_ids": batch.input_ids,
            "labels": batch.labels,
            "cu_seqlens": batch.cu_seqlens,
            "old_logps": batch.rollout.old_logps,
            "advantages": batch.rollout.advantages,
        }
        if batch.position_ids is not None:
            parts["position_ids"] = batch.position_ids
        for kind in ("images", "videos"):
            items = getattr(batch, kind)
            if items is not None:
                parts[f"{kind}.pixel_values"] = items.pixel_values
                parts[f"{kind}.grid_thw"] = torch.tensor(items.grids(), dtype=torch.long)
        tensors |= {f"{i}.{name}": t.detach().cpu().contiguous() for name, t in parts.items()}
        meta.append({"num_samples": batch.num_samples})
    return save_tensors(tensors, metadata={"batches": json.dumps(meta)})


def batches_from_bytes(data: bytes) -> list[Batch]:
    tensors = load_tensors(bytes(data))
    meta = json.loads(_metadata(data)["batches"])
    batches = []
    for i, info in enumerate(meta):
        part = {name.split(".", 1)[1]: t for name, t in tensors.items() if name.split(".", 1)[0] == str(i)}
        media = {}
        for kind in ("images", "videos"):
            if f"{kind}.pixel_values" in part:
                media[kind] = Images(
                    part[f"{kind}.pixel_values"], part[f"{kind}.grid_thw"], None, kind.removesuffix("s")
                )
        batches.append(
            Batch(
                input_ids=part["input_ids"],
                labels=part["labels"],
                cu_seqlens=part["cu_seqlens"],
                position_ids=part.get("position_ids"),
                images=media.get("images"),
                videos=media.get("videos"),
                num_samples=info["num_samples"],
                rollout=Rollout(part["old_logps"], part["advantages"]),
            )
        )
    return batches


def _metadata(data: bytes) -> dict:
    """The `__metadata__` of safetensors bytes (an 8-byte header length, then the JSON header)."""
    stream = io.BytesIO(bytes(data))
    length = int.from_bytes(stream.read(8), "little")
    return json.loads(stream.read(length)).get("__metadata__", {})
