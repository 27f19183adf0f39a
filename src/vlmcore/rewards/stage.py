"""A GRPO stage's rewards: its `grpo.rewards` checked before any work, then the worker pool that
scores each rollout's completions against their prompts' reference answers (the `Scorer` that
vlmcore.train.rollout_data calls)."""

from collections import Counter
from typing import TYPE_CHECKING

from vlmcore.config import TrainConfig
from vlmcore.train.rollout import Completion
from vlmcore.train.rollout_data import RewardScores

if TYPE_CHECKING:
    from vlmcore.train.prompts import RLPrompt

from .registry import check_rewards
from .workers import RewardWorkers


class StageRewards:
    """The stage's reward workers as a `Scorer`; close it (or use it as a context manager) at the end."""

    def __init__(self, cfg: TrainConfig) -> None:
        specs = check_rewards(cfg.grpo.rewards, "grpo.rewards")
        self.workers = RewardWorkers(specs, workers=cfg.grpo.reward_workers, timeout_s=cfg.grpo.reward_timeout_s)

    def __call__(self, rl_prompts: list["RLPrompt"], completions: list[Completion]) -> RewardScores:
        texts = [c.text if c.text is not None else "" for c in completions]
        prompts = [rl_prompts[c.prompt_index] for c in completions]
        scores = self.workers.score(texts, [p.answer for p in prompts], [p.reward_fields for p in prompts])
        failures = Counter()
        for name, reasons in scores.failures.items():
            for reason, count in reasons.items():
                failures[f"{name}/{reason}"] += count
        return RewardScores(scores.totals, scores.per_reward, failures)

    def close(self) -> None:
        self.workers.close()

    def __enter__(self) -> "StageRewards":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_rewards(cfg: TrainConfig) -> StageRewards | None:
    """The stage's rewards, or None for a stage without (any objective but grpo). A reward that
    does not resolve raises `ConfigError` naming its key, before the model is built. On random data
    (engine tests, benchmarks: the rollouts are random rows, vlmcore.train.random_data) nothing is
    scored, so the names are checked and no worker starts."""
    if cfg.objective != "grpo":
        return None
    if cfg.data.kind == "random":
        check_rewards(cfg.grpo.rewards, "grpo.rewards")
        return None
    return StageRewards(cfg)
