"""Verifiable rewards for online RL: the built-in rewards and a user's `module:function` by name
(`registry.py`), and the worker processes that compute them apart from the trainer, each call
time-limited, failures counted by reason (`workers.py`). docs/post-training.md, "Rewards"."""

from vlmcore.rewards.registry import REWARDS, RewardSpec, check_rewards, load_reward
from vlmcore.rewards.workers import RewardScores, RewardWorkers

__all__ = ["REWARDS", "RewardScores", "RewardSpec", "RewardWorkers", "check_rewards", "load_reward"]
