"""A GRPO stage's data stream (vlmcore.train.rollout_data): a rollout every `updates_per_rollout`
steps, its micro-batches served to each of its updates, rewards through the scorer and the
advantages they give, and a resume that continues exactly, between two updates of one rollout
as at a rollout's end."""

from collections import Counter

import pytest
import torch
from helpers import packed_prompt_dataset

from vlmcore.generate import SamplingSettings
from vlmcore.models import from_pretrained
from vlmcore.train.checkpoint import CheckpointError
from vlmcore.train.prompts import PromptSource
from vlmcore.train.rollout_data import RewardScores, RolloutData, RolloutPlan, batches_from_bytes, batches_to_bytes

GROUP = 3


def first_token_is_even(rl_prompts, completions) -> RewardScores:
    """A verifiable reward of the sampled tokens themselves: 1 when a completion's first token id
    is even. Any group whose first tokens differ in parity has a learning signal."""
    values = [float(c.tokens[0] % 2 == 0) for c in completions]
    return RewardScores(values, {"even": values}, Counter({"timeout": 1}))


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    packed, model_dir = packed_prompt_dataset(tmp_path_factory.mktemp("rollout_data"), long_question=False)
    model = from_pretrained(model_dir)
    return PromptSource(packed, seed=0), model


def make_data(setup, updates_per_rollout=2, dynamic_sampling=False, shuffle_rewards=False) -> RolloutData:
    prompts, model = setup
    plan = RolloutPlan(
        prompts_per_step=4,
        group_size=GROUP,
        sampling=SamplingSettings(max_new_tokens=5, temperature=1.0),
        updates_per_rollout=updates_per_rollout,
        seq_len=256,
        dynamic_sampling=dynamic_sampling,
        shuffle_rewards=shuffle_rewards,
    )
    return RolloutData(
        model,
        prompts,
        plan,
        first_token_is_even,
        dp_rank=0,
        dp_world=1,
        grad_accum_steps=2,
        seed=0,
        device=torch.device("cpu"),
    )


def same_batch(a, b) -> bool:
    fields = [(a.input_ids, b.input_ids), (a.labels, b.labels), (a.cu_seqlens, b.cu_seqlens)]
    fields += [(a.rollout.old_logps, b.rollout.old_logps), (a.rollout.advantages, b.rollout.advantages)]
    fields += [(a.images.pixel_values, b.images.pixel_values)] if a.images is not None else []
    return all(x.shape == y.shape and torch.equal(x, y) for x, y in fields) and (a.images is None) == (b.images is None)


def test_a_rollout_serves_each_of_its_updates_then_the_next_is_sampled(setup):
    data = make_data(setup)
    first = [next(data) for _ in range(4)]  # two steps of two micro-batches: the rollout's two updates
    assert data.rollouts == 1 and first[2] is first[0] and first[3] is first[1]
    # The four prompts' completions, two prompts a micro-batch, each labelled on its completion only.
    assert sum(b.num_samples for b in first[:2]) == 4 * GROUP
    for batch in first[:2]:
        labelled = batch.labels != -100
        assert labelled.any() and (batch.rollout.old_logps[~labelled] == 0).all()
        assert (batch.rollout.old_logps[labelled] < 0).all()
    metrics = data.metrics()
    assert 0 <= metrics["reward_mean"] <= 1 and metrics["reward_mean/even"] == metrics["reward_mean"]
    assert metrics["reward_failures/timeout"] == 1 and 1 <= metrics["completion_length_mean"] <= 5
    nxt = next(data)  # the third step: a new rollout of the next four prompts
    assert data.rollouts == 2 and not same_batch(nxt, first[0])


def test_advantages_are_the_groups_centred_rewards_and_dynamic_sampling_drops_uniform_groups(setup):
    data = make_data(setup, updates_per_rollout=1, dynamic_sampling=True)
    batches = [next(data), next(data)]
    # The completions trained on (a part left without a group is a filler with no label).
    kept = len(completion_advantages(batches))
    dropped = data.metrics()["dropped_group_fraction"]
    assert kept == round(4 * (1 - dropped)) * GROUP
    for batch in batches:
        per_token = batch.rollout.advantages[batch.labels != -100]
        assert per_token.abs().max() < 2  # (r - mean) / (std + eps) of a group of three 0/1 rewards


def completion_advantages(batches) -> list[float]:
    """Each completion's advantage, in order: its first label's (a completion's labels share it)."""
    out = []
    for batch in batches:
        labels, advantages = batch.labels.flatten(), batch.rollout.advantages.flatten()
        starts = batch.cu_seqlens[:-1].long()
        for start, end in zip(starts.tolist(), batch.cu_seqlens[1:].long().tolist()):
            labelled = (labels[start:end] != -100).nonzero()
            if len(labelled):
                out.append(float(advantages[start + labelled[0, 0]]))
    return out


def test_the_shuffled_control_permutes_each_groups_advantages_and_logs_the_true_rewards(setup):
    """grpo.shuffle_rewards (benchmarks' control): the same completions (the sampling is the same),
    each group's advantages a permutation of the true ones, the logged rewards the true ones; a
    resumed stream permutes as the uninterrupted one."""
    true, control = (
        make_data(setup, updates_per_rollout=1),
        make_data(setup, updates_per_rollout=1, shuffle_rewards=True),
    )
    true_batches, control_batches = [next(true), next(true)], [next(control), next(control)]
    assert [b.input_ids.tolist() for b in true_batches] == [b.input_ids.tolist() for b in control_batches]
    assert control.metrics()["reward_mean"] == true.metrics()["reward_mean"]
    expected, shuffled = completion_advantages(true_batches), completion_advantages(control_batches)
    assert len(expected) == len(shuffled) == 4 * GROUP
    for group in range(4):
        part = slice(group * GROUP, (group + 1) * GROUP)
        assert sorted(shuffled[part]) == pytest.approx(sorted(expected[part]))
    assert shuffled != pytest.approx(expected)  # permuted somewhere over the four groups
    resumed = make_data(setup, updates_per_rollout=1, shuffle_rewards=True)
    resumed.load_state_dict(control.state_dict())
    again = make_data(setup, updates_per_rollout=1, shuffle_rewards=True)
    [next(again) for _ in range(2)]
    assert all(same_batch(next(resumed), next(again)) for _ in range(2))


def test_a_resume_between_two_updates_and_at_a_rollouts_end_continues_exactly(setup):
    data = make_data(setup)
    next(data), next(data)
    state = data.state_dict()  # after the first update of the rollout
    assert state["current"]  # the rollout itself travels
    resumed = make_data(setup)
    resumed.load_state_dict(state)
    assert all(same_batch(next(resumed), next(data)) for _ in range(2))  # the second update's batches
    state = data.state_dict()  # at the rollout's end: the position only
    assert state["current"] == b""
    resumed = make_data(setup)
    resumed.load_state_dict(state)
    assert same_batch(next(resumed), next(data)) and resumed.rollouts == data.rollouts == 2


def test_a_resume_on_another_layout_goes_on_at_a_rollouts_end_and_is_refused_inside_one(setup):
    """`seek` (a checkpoint of another layout gives only the global rows consumed): at a rollout's
    end the stream goes on with the next rollout, as the uninterrupted one; between two updates of
    one rollout it is refused, naming the setting that avoids it."""
    data = make_data(setup)
    [next(data) for _ in range(4)]  # two steps of two rows: the first rollout's two updates
    moved = make_data(setup)
    moved.seek(4, steps=2)
    assert same_batch(next(moved), next(data)) and moved.rollouts == data.rollouts == 2
    inside = make_data(setup)
    with pytest.raises(CheckpointError, match="at step 1, inside a rollout.*checkpoint.interval"):
        inside.seek(2, steps=1)  # between the first rollout's two updates


def test_rollout_batches_round_trip_through_safetensors_bytes(setup):
    data = make_data(setup)
    batches = [next(data), next(data)]
    back = batches_from_bytes(batches_to_bytes(batches))
    assert all(same_batch(a, b) and a.num_samples == b.num_samples for a, b in zip(batches, back))
    assert back[0].images.kind == "image" and back[0].images.normalize is None


def test_a_grpo_update_on_a_rollout_moves_the_policy_toward_the_rewarded_completions(setup):
    """One small step down the GRPO loss of a rollout's micro-batch raises the log-probability of
    the tokens of completions with a positive advantage and lowers those with a negative one."""
    from vlmcore.train.grpo import GRPOObjective
    from vlmcore.train.loss import chunked_token_logps
    from vlmcore.train.step import forward_hidden

    _, model = setup
    data = make_data(setup, updates_per_rollout=1)
    batch = next(data)
    head = model.lm_head.weight
    objective = GRPOObjective("dapo", 0.2, 0.28, temperature=1.0, max_new_tokens=5)

    def label_logps():
        with torch.no_grad():
            return chunked_token_logps(forward_hidden(model, batch), head, batch.labels)

    before = label_logps()
    loss, _ = objective.loss(forward_hidden(model, batch), head, batch, None)
    model.zero_grad()
    loss.backward()
    saved = {name: p.detach().clone() for name, p in model.named_parameters()}
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p -= 1e-3 * p.grad / (p.grad.norm() + 1e-12)
    moved = label_logps() - before
    with torch.no_grad():  # the module's model is shared by the other tests: put it back
        for name, p in model.named_parameters():
            p.copy_(saved[name])
        model.zero_grad()
    labelled = (batch.labels != -100).flatten()
    moved = moved.flatten()[labelled]  # the token log-probabilities come flat, over the rows' positions
    advantages = batch.rollout.advantages.flatten()[labelled]
    assert (advantages > 0).any() and (advantages < 0).any()
    assert moved[advantages > 0].mean() > 0 > moved[advantages < 0].mean()
