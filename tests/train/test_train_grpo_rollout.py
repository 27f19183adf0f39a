"""GRPO's objective on the batch of a real rollout (vlmcore.train.rollout): the recorded
log-probabilities are the policy's at the sampling temperature, so on the first update the ratio
is 1, nothing clips, the rollout/training gap is 0, and with ratio 1 and no KL the loss is
-mean(advantage) over the tokens (dapo) or over the completions (grpo). A tiny random Qwen3-VL,
prompts with images and without, in groups of 2, packed rows; the train step's `forward_backward`."""

import pytest
import torch
from helpers import mm_sample, random_weights
from transformers import Qwen3VLForConditionalGeneration

import vlmcore.models as models
from vlmcore.generate import Prompt, SamplingSettings
from vlmcore.tiny import hf_config
from vlmcore.train.grpo import GRPOObjective
from vlmcore.train.metrics_log import completions
from vlmcore.train.rollout import rollout, rollout_batch
from vlmcore.train.step import forward_backward

TEMPERATURE = 0.7
PROMPTS = [
    [("text", 3), ("image", (1, 4, 4)), ("text", 2)],
    [("text", 9)],
]


@pytest.fixture(scope="module")
def rollout_of_a_policy(tmp_path_factory):
    """(the snapshot, its rollout batch, the completions' advantages, the completions)."""
    torch.manual_seed(0)
    hf = Qwen3VLForConditionalGeneration(hf_config("qwen3_vl"))
    random_weights(hf)
    snapshot = tmp_path_factory.mktemp("qwen3_vl")
    hf.save_pretrained(snapshot)
    model = models.from_pretrained(snapshot, dtype=torch.float32, device="cpu")
    prompts = [Prompt(*mm_sample(items, torch.Generator().manual_seed(1))) for items in PROMPTS]
    settings = SamplingSettings(max_new_tokens=6, temperature=TEMPERATURE, top_k=40, top_p=0.95)
    sampled = rollout(model, prompts, 2, settings)
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.25])
    longest = max(len(prompts[c.prompt_index].input_ids) + c.length for c in sampled)
    batch = rollout_batch(prompts, sampled, advantages, model.config, seq_len=2 * longest)
    return snapshot, batch, advantages, sampled


@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_the_first_update_of_a_rollout_has_ratio_1(rollout_of_a_policy, loss_type):
    snapshot, batch, advantages, sampled = rollout_of_a_policy
    model = models.from_pretrained(snapshot, dtype=torch.float32, device="cpu")
    objective = GRPOObjective(loss_type, 0.2, 0.28, TEMPERATURE, max_new_tokens=6)
    counts = {"label_tokens": batch.label_tokens, "completions": completions(batch)}
    assert counts["completions"] == len(sampled) and batch.input_ids.shape[0] > 1  # padding segments not counted
    sums, _, _ = forward_backward(
        model, [batch.to(torch.device("cpu"))], counts[objective.count], None, objective=objective
    )
    metrics = objective.metrics(sums.tolist(), counts)
    assert metrics["grpo_ratio"] == pytest.approx(1.0, abs=1e-5)
    assert metrics["grpo_logp_gap"] < 1e-5 and abs(metrics["grpo_rollout_kl"]) < 1e-9
    assert metrics["grpo_clip_low"] == 0 and metrics["grpo_clip_high"] == 0
    lengths = torch.tensor([c.length for c in sampled], dtype=torch.float32)
    if loss_type == "dapo":  # each token's loss -A, over all tokens
        expected = -(advantages * lengths).sum() / lengths.sum()
    else:  # each completion's mean -A, over the completions
        expected = -advantages.mean()
    assert metrics["loss"] == pytest.approx(expected.item(), abs=1e-5)
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())
