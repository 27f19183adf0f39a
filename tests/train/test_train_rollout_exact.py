"""The exactness contract of GRPO's rollouts (vlmcore.train.rollout): what a rollout records of
each token is what the training forward computes for it, so the first update's ratio is 1.

For tiny random Qwen3-VL (images; a video), Qwen3.5 (Gated DeltaNet layers) and Qwen3-VL-MoE:
prompts of different lengths, sampled in groups at temperature 0.7 (top-k / top-p cut; each
prompt's media through the vision tower once for its group) ->
`rollout_batch` (packed rows of a token budget) -> the training forward as the train step runs it
(`forward_hidden` on the device batch, then `chunked_token_logps(hidden / T, lm_head, labels)`)
equals the recorded `old_logps` at every label position to 1e-5 (fp32, CPU)."""

import pytest
import torch
from helpers import mm_sample, random_weights
from transformers import (
    Qwen3_5ForConditionalGeneration,
    Qwen3VLForConditionalGeneration,
    Qwen3VLMoeForConditionalGeneration,
)

import vlmcore.models as models
from vlmcore.data import IGNORE_INDEX
from vlmcore.generate import Prompt, SamplingSettings
from vlmcore.tiny import hf_config
from vlmcore.train.loss import chunked_token_logps
from vlmcore.train.rollout import rollout, rollout_batch
from vlmcore.train.step import forward_hidden

TEMPERATURE = 0.7
NEW_TOKENS = 6
IMAGES = [
    [("text", 3), ("image", (1, 4, 4)), ("text", 2)],
    [("text", 9)],
    [("text", 1), ("image", (1, 2, 6)), ("text", 4), ("image", (1, 2, 2)), ("text", 1)],
]
VIDEO = [
    [("text", 2), ("video", (2, 4, 2)), ("text", 3)],
    [("text", 5)],
]
# (model class, hf_config kind, prompts, group size)
CASES = {
    "qwen3_vl-images": (Qwen3VLForConditionalGeneration, "qwen3_vl", IMAGES, 3),
    "qwen3_vl-video": (Qwen3VLForConditionalGeneration, "qwen3_vl", VIDEO, 2),
    "qwen3_5": (Qwen3_5ForConditionalGeneration, "qwen3_5", IMAGES[:1] + VIDEO, 2),
    "qwen3_vl_moe": (Qwen3VLMoeForConditionalGeneration, "qwen3_vl_moe", IMAGES, 2),
}


@pytest.fixture(scope="module")
def snapshots(tmp_path_factory):
    """One tiny random snapshot per model kind, weights of N(0, 0.1) (varied tokens)."""
    out = {}
    for hf_class, kind, _, _ in CASES.values():
        if kind in out:
            continue
        torch.manual_seed(0)
        hf = hf_class(hf_config(kind))
        random_weights(hf)
        out[kind] = tmp_path_factory.mktemp(kind)
        hf.save_pretrained(out[kind])
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_training_forward_recomputes_the_rollouts_log_probs(snapshots, case):
    _, kind, specs, group_size = CASES[case]
    model = models.from_pretrained(snapshots[kind], dtype=torch.float32, device="cpu")
    media = torch.Generator().manual_seed(1)
    prompts = [Prompt(*mm_sample(items, media)) for items in specs]
    assert len({len(p.input_ids) for p in prompts}) == len(prompts), "prompts of different lengths"
    settings = SamplingSettings(max_new_tokens=NEW_TOKENS, temperature=TEMPERATURE, top_k=40, top_p=0.95)
    # A stop token that some completions draw, so that the batch has stopped and truncated ones.
    first = rollout(model, prompts, group_size, settings)
    settings.stop_token_ids = [first[0].tokens[1]]
    encoded = []  # the pixel patches the vision tower is given during the rollout
    hook = model.vision_tower().register_forward_hook(lambda module, args, out: encoded.append(len(args[0])))
    completions = rollout(model, prompts, group_size, settings)
    hook.remove()
    patches = sum(len(px) for p in prompts for px in (p.pixel_values, p.pixel_values_videos) if px is not None)
    assert encoded == [patches], "a group's samples share their prompt's media, encoded once"
    assert [c.prompt_index for c in completions] == [i for i in range(len(prompts)) for _ in range(group_size)]
    reasons = {c.finish_reason for c in completions}
    assert reasons == {"stop_token", "length"}, reasons
    assert all(c.length == NEW_TOKENS for c in completions if c.truncated)

    advantages = torch.linspace(-1, 1, len(completions))
    longest = max(len(prompts[c.prompt_index].input_ids) + c.length for c in completions)
    batch = rollout_batch(prompts, completions, advantages, model.config, seq_len=2 * longest)
    assert 1 < batch.input_ids.shape[0] < len(completions), "several rows, of several completions each"
    check_layout(batch, prompts, completions, advantages)

    # The training forward, as the train step runs it.
    device_batch = batch.to(torch.device("cpu"))
    with torch.no_grad():
        hidden = forward_hidden(model, device_batch)
        logps = chunked_token_logps(hidden / TEMPERATURE, model.lm_head.weight, device_batch.labels)
    labelled = batch.labels.flatten() != IGNORE_INDEX
    old_logps = batch.rollout.old_logps.flatten()
    torch.testing.assert_close(logps[labelled], old_logps[labelled], atol=1e-5, rtol=0)
    ratio = (logps[labelled] - old_logps[labelled]).exp()
    torch.testing.assert_close(ratio, torch.ones_like(ratio), atol=1e-5, rtol=0)

    # The recorded log-probabilities are the policy's, not those of the cut distribution sampled from.
    cut_gap = max(abs(a - b) for c in completions for a, b in zip(c.logps, c.sampling_logps))
    assert cut_gap > 1e-3, "top-k / top-p cut nothing: the test would not tell the two conventions apart"


def check_layout(batch, prompts, completions, advantages):
    """Each segment is prompt + completion, its labels the completion's tokens shifted by one, its
    old log-probabilities and advantage on those positions only, 0 elsewhere."""
    lengths = batch.segment_lengths().tolist()
    ids = batch.input_ids.flatten()
    labels = batch.labels.flatten()
    old_logps = batch.rollout.old_logps.flatten()
    adv = batch.rollout.advantages.flatten()
    start = 0
    segments = iter(range(len(lengths)))
    for completion, advantage in zip(completions, advantages.tolist()):
        prompt = prompts[completion.prompt_index]
        index = next(segments)
        while (labels[start : start + lengths[index]] == IGNORE_INDEX).all():  # a row's padding: no label
            assert (ids[start : start + lengths[index]] == 0).all()
            start += lengths[index]
            index = next(segments)
        assert lengths[index] == len(prompt.input_ids) + completion.length
        end = start + lengths[index]
        expected_ids = torch.cat([prompt.input_ids, torch.tensor(completion.tokens)])
        assert torch.equal(ids[start:end], expected_ids)
        first_label = start + len(prompt.input_ids) - 1
        assert torch.equal(labels[first_label : end - 1], torch.tensor(completion.tokens))
        assert (labels[start:first_label] == IGNORE_INDEX).all() and labels[end - 1] == IGNORE_INDEX
        torch.testing.assert_close(old_logps[first_label : end - 1], torch.tensor(completion.logps))
        assert (adv[first_label : end - 1] == advantage).all()
        start = end
    off_labels = labels == IGNORE_INDEX
    assert (old_logps[off_labels] == 0).all() and (adv[off_labels] == 0).all()
    assert batch.label_tokens == sum(c.length for c in completions)
    assert batch.num_samples == len(completions)
