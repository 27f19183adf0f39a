"""Native generation (vlmcore.generate) against transformers' `generate` and the training forward,
on tiny random models of all six families: greedy tokens equal to transformers' for a batch of
prompts of different lengths (left-padded there, packed here) with images and a video for the VL
families; each sampled token's log-probability equal to the training forward's (fp32, CPU)."""

import pytest
import torch
from helpers import hf_mm_inputs, mm_sample, random_weights
from transformers import (
    Qwen3_5ForConditionalGeneration,
    Qwen3_5MoeForConditionalGeneration,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
    Qwen3VLForConditionalGeneration,
    Qwen3VLMoeForConditionalGeneration,
)

import vlmcore.models as models
from vlmcore.generate import Prompt, SamplingSettings, generate
from vlmcore.generate.sampling import sample_seeds
from vlmcore.tiny import (
    IMAGE,
    VIDEO,
    qwen3_5_config,
    qwen3_5_moe_config,
    qwen3_config,
    qwen3_vl_config,
    qwen3_vl_moe_config,
)


def qwen3_moe_config():
    return Qwen3MoeConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
    )


FAMILIES = {
    "qwen3": (Qwen3ForCausalLM, lambda: qwen3_config(tied=False)),
    "qwen3_moe": (Qwen3MoeForCausalLM, qwen3_moe_config),
    "qwen3_vl": (Qwen3VLForConditionalGeneration, qwen3_vl_config),
    "qwen3_vl_moe": (Qwen3VLMoeForConditionalGeneration, qwen3_vl_moe_config),
    "qwen3_5": (Qwen3_5ForConditionalGeneration, qwen3_5_config),
    "qwen3_5_moe": (Qwen3_5MoeForConditionalGeneration, qwen3_5_moe_config),
}
TEXT_PROMPTS = [[("text", 5)], [("text", 11)], [("text", 2)]]
# An image, text alone, a video, images and a video: four lengths.
VL_PROMPTS = [
    [("text", 3), ("image", (1, 4, 4)), ("text", 2)],
    [("text", 6)],
    [("text", 2), ("video", (2, 4, 2)), ("text", 3)],
    [("text", 1), ("image", (1, 2, 6)), ("text", 2), ("video", (2, 2, 4)), ("text", 1)],
]
NEW_TOKENS = 8


@pytest.fixture(scope="module", params=list(FAMILIES))
def pair(request, tmp_path_factory):
    """(family, transformers model, native model loaded from its snapshot, prompts)."""
    hf_class, config = FAMILIES[request.param]
    torch.manual_seed(0)
    hf = hf_class(config()).eval()
    random_weights(hf)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    native = models.from_pretrained(path).eval()
    generator = torch.Generator().manual_seed(1)
    specs = VL_PROMPTS if hasattr(hf.config, "vision_config") else TEXT_PROMPTS
    prompts = [Prompt(*mm_sample(items, generator)) for items in specs]
    return request.param, hf, native, prompts


def left_padded(prompts, vl, pad=0):
    """transformers' batch of the prompts: left padding, the attention mask, media in prompt order."""
    longest = max(len(p.input_ids) for p in prompts)
    ids = torch.full((len(prompts), longest), pad)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, longest - len(p.input_ids) :] = p.input_ids
        mask[row, longest - len(p.input_ids) :] = 1
    if not vl:
        return dict(input_ids=ids, attention_mask=mask), longest

    def cat(name):
        return torch.cat([getattr(p, name) for p in prompts if getattr(p, name) is not None])

    media = [cat(name) for name in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")]
    return dict(hf_mm_inputs(ids, *media), attention_mask=mask), longest


def test_greedy_tokens_equal_transformers_generate(pair):
    family, hf, native, prompts = pair
    vl = hasattr(hf.config, "vision_config")
    inputs, longest = left_padded(prompts, vl)
    ref = hf.generate(
        **inputs,
        max_new_tokens=NEW_TOKENS,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
        suppress_tokens=[IMAGE, VIDEO] if vl else None,
    )[:, longest:]
    out = generate(native, prompts, SamplingSettings(max_new_tokens=NEW_TOKENS))
    assert [g.tokens for g in out] == ref.tolist()
    assert len({t for g in out for t in g.tokens}) >= NEW_TOKENS, "the model repeats itself: a weak comparison"
    assert all(g.finish_reason == "length" for g in out)


def training_log_probs(native, prompt, tokens, temperature, top_k=0, top_p=1.0, blocked=True):
    """Each generated token's log-probability from one training forward of prompt + tokens: the
    logits at the tokens before them, the media placeholders removed (unless not `blocked`), at the
    temperature, cut to the top k, then to the most likely tokens holding top_p of the probability."""
    ids = torch.cat([prompt.input_ids, torch.tensor(tokens)])[None]
    with torch.no_grad():
        logits = native(
            ids,
            prompt.pixel_values,
            prompt.image_grid_thw,
            pixel_values_videos=prompt.pixel_values_videos,
            video_grid_thw=prompt.video_grid_thw,
        ).logits[0, len(prompt.input_ids) - 1 : -1]
    if blocked and hasattr(native.config, "vision_config"):
        logits[:, [IMAGE, VIDEO]] = float("-inf")
    logits = logits / temperature
    if top_k:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits[logits < kth] = float("-inf")
    if top_p < 1:
        for row in logits:
            probs, order = row.softmax(-1).sort(descending=True)
            before = probs.cumsum(0) - probs
            row[order[before >= top_p]] = float("-inf")
    return logits.log_softmax(-1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]


@pytest.mark.parametrize("top_k, top_p", [(0, 1.0), (20, 0.9)])
def test_sampled_log_probs_equal_the_training_forward(pair, top_k, top_p):
    """n = 3 samples per prompt (one prefill each), temperature 0.8, all tokens or the top 20 cut
    to 0.9 of the mass: each token's log-probability as returned equals the training forward's of
    that token under the same distribution to 1e-5, and its policy log-probability equals the
    training forward's log_softmax(logits / 0.8) of the whole vocabulary (no cut, nothing blocked);
    the same seed draws the same tokens again; a sample's tokens depend on its prompt and seed, not
    on the batch (the last prompt alone, or the prompts reversed, with the same seeds)."""
    family, hf, native, prompts = pair
    settings = SamplingSettings(max_new_tokens=NEW_TOKENS, temperature=0.8, top_k=top_k, top_p=top_p, n=3, seed=7)
    out = generate(native, prompts, settings)
    assert [g.prompt_index for g in out] == [i for i in range(len(prompts)) for _ in range(3)]
    assert len({tuple(g.tokens) for g in out[:3]}) > 1, "three samples of one prompt all equal"
    for g in out:
        ref = training_log_probs(native, prompts[g.prompt_index], g.tokens, 0.8, top_k, top_p)
        torch.testing.assert_close(torch.tensor(g.log_probs), ref, atol=1e-5, rtol=0)
        policy = training_log_probs(native, prompts[g.prompt_index], g.tokens, 0.8, blocked=False)
        torch.testing.assert_close(torch.tensor(g.policy_log_probs), policy, atol=1e-5, rtol=0)
    again = generate(native, prompts, settings)
    assert [g.tokens for g in again] == [g.tokens for g in out], "the same seed draws the same tokens"
    seeds = sample_seeds(7, len(prompts), 3)
    alone = generate(native, prompts[-1:], settings, seeds=seeds[-3:])
    assert [g.tokens for g in alone] == [g.tokens for g in out[-3:]], "a prompt's samples alone as in its batch"
    order = list(reversed(range(len(prompts))))
    reordered_seeds = [seeds[p * 3 + j] for p in order for j in range(3)]
    reordered = generate(native, [prompts[p] for p in order], settings, seeds=reordered_seeds)
    tokens_by_sample = {(order[i // 3], i % 3): g.tokens for i, g in enumerate(reordered)}
    assert tokens_by_sample == {(i // 3, i % 3): g.tokens for i, g in enumerate(out)}, "the prompts reversed"


def test_a_stop_token_ends_its_row_and_the_others_go_on(pair):
    """A row that reaches a stop token leaves the batch (its cache rows dropped); the rows still
    generating give the tokens they give without it."""
    family, hf, native, prompts = pair
    free = generate(native, prompts, SamplingSettings(max_new_tokens=NEW_TOKENS))
    stop = free[0].tokens[2]
    out = generate(native, prompts, SamplingSettings(max_new_tokens=NEW_TOKENS, stop_token_ids=[stop]))
    for g, ref in zip(out, free):
        if stop in ref.tokens:
            assert g.tokens == ref.tokens[: ref.tokens.index(stop) + 1]
            assert g.finish_reason == "stop_token"
        else:
            assert g.tokens == ref.tokens and g.finish_reason == "length"
    assert out[0].finish_reason == "stop_token" and len(out[0].tokens) <= 3
