"""The rewards by name: the built-in ones, and a user's `module:function`.

A reward is a plain function `(completion: str, answer: str, sample: dict) -> float`: the
sampled completion's text, the prompt row's reference answer, and the row's other fields
(choices, image size, ...). `check_rewards` resolves every name of a stage's reward list before
any work and refuses a bad one by its config key.
"""

import importlib
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from vlmcore.config import ConfigError
from vlmcore.rewards.grounding import iou
from vlmcore.rewards.math_answers import math_answer
from vlmcore.rewards.text import exact_match, format_reward, multiple_choice

Reward = Callable[[str, str, dict], float]

REWARDS: dict[str, Reward] = {
    "exact_match": exact_match,
    "multiple_choice": multiple_choice,
    "math": math_answer,
    "format": format_reward,
    "iou": iou,
}


class RewardNameError(ValueError):
    """A reward name that resolves to no callable; the message says why."""


@dataclass(frozen=True)
class RewardSpec:
    """One reward of a stage: its name (built-in, or `module:function`) and its weight in the sum."""

    name: str
    weight: float = 1.0


def as_spec(spec: "RewardSpec | Mapping") -> RewardSpec:
    """A spec from the config's form of one (a mapping with `name` and an optional `weight`, or
    any object with those attributes)."""
    if isinstance(spec, Mapping):
        return RewardSpec(spec["name"], spec.get("weight", 1.0))
    return RewardSpec(spec.name, getattr(spec, "weight", 1.0))


def user_reward(name: str) -> Reward:
    """The callable `module:function` names (`function` may be dotted: `module:Class.method`)."""
    module_name, _, attribute = name.partition(":")
    if not module_name or not attribute:
        raise RewardNameError(f"{name!r} is not of the form module:function")
    try:
        target = importlib.import_module(module_name)
    except Exception as e:  # any error of the user's module: not found, a syntax error, its own imports
        raise RewardNameError(f"cannot import module {module_name!r}: {type(e).__name__}: {e}") from None
    for part in attribute.split("."):
        if not hasattr(target, part):
            raise RewardNameError(f"module {module_name!r} has no attribute {attribute!r}")
        target = getattr(target, part)
    if not callable(target):
        raise RewardNameError(f"{name!r} is not callable (it is a {type(target).__name__})")
    return target


def load_reward(name: str) -> Reward:
    """The reward a name stands for: a built-in name, or a `module:function` imported here (in
    the process that calls it: the check in the trainer, then each worker)."""
    if ":" in name:
        return user_reward(name)
    if name not in REWARDS:
        raise RewardNameError(f"unknown reward {name!r} (built-in: {', '.join(REWARDS)}; or a module:function)")
    return REWARDS[name]


def check_rewards(specs: Sequence, key_prefix: str) -> list[RewardSpec]:
    """The specs of a stage's rewards, each name resolved (imported) and each weight checked;
    raises `ConfigError` naming the key (`<key_prefix>[i].name`, `<key_prefix>[i].weight`) and
    the reason. Run it before any work: a typo in a reward's name then costs no rollout."""
    if not specs:
        raise ConfigError(f"{key_prefix}: at least one reward is needed", key_prefix)
    checked = []
    for index, raw in enumerate(specs):
        spec = as_spec(raw)
        key = f"{key_prefix}[{index}]"
        try:
            load_reward(spec.name)
        except RewardNameError as e:
            raise ConfigError(f"{key}.name: {e}", f"{key}.name") from None
        if any(spec.name == other.name for other in checked):
            raise ConfigError(f"{key}.name: {spec.name!r} is listed twice", f"{key}.name")
        weight = spec.weight
        if isinstance(weight, bool) or not isinstance(weight, int | float) or not math.isfinite(weight):
            raise ConfigError(f"{key}.weight: must be a finite number, got {weight!r}", f"{key}.weight")
        checked.append(spec)
    return checked
