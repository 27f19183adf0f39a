"""GRPO's advantages and DAPO's helpers (vlmcore.train.rollout) against TRL on the same numbers,
and what `rollout` and `rollout_batch` refuse. The rollouts' exactness against the training
forward: tests/train/test_train_rollout_exact.py."""

import pytest
import torch
from trl.rewards import get_soft_overlong_punishment
from trl.trainer.utils import nanstd

from vlmcore.generate import GenerationError, Prompt, SamplingSettings
from vlmcore.tiny import hf_config
from vlmcore.train.rollout import (
    Completion,
    group_advantages,
    overlong_penalty,
    rollout,
    rollout_batch,
    uniform_groups,
)

# 4 prompts x 3 samples; the last group all equal (its std 0).
REWARDS = torch.tensor([[1.0, 0.0, 0.5], [0.2, 0.9, 0.9], [3.0, -1.0, 0.0], [0.5, 0.5, 0.5]])


def trl_advantages(rewards, scale):
    """TRL's GRPOTrainer (trl 1.16.0, trl/trainer/grpo_trainer.py, `_generate_and_score_completions`,
    multi_objective_aggregation "sum_then_normalize"): over the flat rewards of prompt-major
    groups, r - the group's nanmean, divided unless scale_rewards is "none" by nanstd (of the group,
    or of all the rewards for "batch") + 1e-4. Written out here because it is a method's body, not
    a function; `nanstd` is TRL's own."""
    group = rewards.shape[1]
    flat = rewards.flatten()
    mean = torch.nanmean(flat.view(-1, group), dim=1).repeat_interleave(group)
    if scale == "batch":
        std = nanstd(flat).expand_as(flat)
    else:
        std = nanstd(flat.view(-1, group), dim=1).repeat_interleave(group)
    advantages = flat - mean
    if scale != "none":
        advantages = advantages / (std + 1e-4)
    return advantages.view_as(rewards)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_group_advantages_equal_trls(scale):
    ours = group_advantages(REWARDS, scale)
    torch.testing.assert_close(ours, trl_advantages(REWARDS, scale), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(ours.mean(dim=1), torch.zeros(4), atol=1e-6, rtol=0)  # centred per group
    assert (ours[3] == 0).all(), "a group of equal rewards has no advantage"


def test_group_advantages_refuse_an_unknown_scale_and_a_flat_reward_list():
    with pytest.raises(ValueError, match="advantage scale 'prompt'"):
        group_advantages(REWARDS, "prompt")
    with pytest.raises(ValueError, match=r"must be \(prompts, group\)"):
        group_advantages(REWARDS.flatten())


def test_uniform_groups_are_those_to_drop():
    assert uniform_groups(REWARDS).tolist() == [False, False, False, True]
    assert uniform_groups(torch.tensor([[0.0, 0.0], [1.0, 1.0], [0.0, 1.0]])).tolist() == [True, True, False]


def test_overlong_penalty_equals_trls_soft_punishment():
    """DAPO's eq. 13 as TRL's reward function gives it (factor 1), then scaled by the factor."""
    lengths = list(range(0, 25))
    trl = get_soft_overlong_punishment(max_completion_len=20, soft_punish_cache=8)
    expected = torch.tensor(trl([[0] * n for n in lengths]))
    torch.testing.assert_close(overlong_penalty(lengths, max_length=20, buffer=8), expected)
    torch.testing.assert_close(overlong_penalty(lengths, max_length=20, buffer=8, factor=0.5), 0.5 * expected)
    assert overlong_penalty([12, 16, 20, 30], 20, 8).tolist() == [0.0, -0.5, -1.0, -1.0]
    with pytest.raises(ValueError, match="overlong buffer 30"):
        overlong_penalty(lengths, max_length=20, buffer=30)


def test_rollout_refuses_greedy_decoding_and_a_bad_group_size():
    model = torch.nn.Module()  # refused before the model is used
    prompts = [Prompt(torch.tensor([1, 2, 3]))]
    with pytest.raises(GenerationError, match="temperature 0"):
        rollout(model, prompts, 2, SamplingSettings(temperature=0.0))
    with pytest.raises(GenerationError, match="group_size=0"):
        rollout(model, prompts, 0, SamplingSettings(temperature=1.0))


def test_rollout_batch_refuses_a_segment_longer_than_a_row_and_missing_advantages():
    config = hf_config("qwen3")
    prompts = [Prompt(torch.arange(5))]
    completions = [Completion(0, [7, 8, 9], [-1.0, -2.0, -3.0], [-1.0, -2.0, -3.0], "length")]
    with pytest.raises(ValueError, match=r"completion 0 \(prompt 0\): 5 prompt \+ 3 completion tokens"):
        rollout_batch(prompts, completions, [1.0], config, seq_len=6)
    with pytest.raises(ValueError, match="2 advantages for 1 completions"):
        rollout_batch(prompts, completions, [1.0, 2.0], config, seq_len=16)
    batch = rollout_batch(prompts, completions, [1.5], config, seq_len=10)
    assert batch.labels[0].tolist() == [-100] * 4 + [7, 8, 9] + [-100] * 3
    assert batch.rollout.old_logps[0].tolist() == [0.0] * 4 + [-1.0, -2.0, -3.0] + [0.0] * 3
    assert batch.rollout.advantages[0].tolist() == [0.0] * 4 + [1.5] * 3 + [0.0] * 3
    assert batch.cu_seqlens.tolist() == [0, 8, 10] and batch.position_ids[0].tolist() == [*range(8), 0, 1]
