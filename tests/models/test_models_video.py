"""Video input of the native vision-language models against transformers: `pixel_values_videos`
and `video_grid_thw` (transformers' names), alone, several videos, images and videos in one
sample, in packed rows; for Qwen3-VL, Qwen3-VL-MoE, Qwen3.5 and Qwen3.5-MoE."""

import pytest
import torch
from helpers import grad_diffs, hf_and_native, hf_mm_inputs, max_rel, mm_sample, mm_token_types, token_loss
from transformers import (
    Qwen3_5ForConditionalGeneration,
    Qwen3_5MoeForConditionalGeneration,
    Qwen3VLForConditionalGeneration,
    Qwen3VLMoeForConditionalGeneration,
)

import vlmcore.models as models
from vlmcore.tiny import VIDEO, qwen3_5_config, qwen3_5_moe_config, qwen3_vl_config, qwen3_vl_moe_config

FAMILIES = {
    "qwen3_vl": (Qwen3VLForConditionalGeneration, lambda: qwen3_vl_config(deepstack=(0, 1))),
    "qwen3_vl_moe": (Qwen3VLMoeForConditionalGeneration, lambda: qwen3_vl_moe_config(deepstack=(0, 1))),
    "qwen3_5": (Qwen3_5ForConditionalGeneration, qwen3_5_config),
    "qwen3_5_moe": (Qwen3_5MoeForConditionalGeneration, qwen3_5_moe_config),
}
SAMPLES = {
    "one-video": [("text", 4), ("video", (4, 4, 6)), ("text", 5)],
    "two-videos-odd-grids": [("text", 2), ("video", (2, 6, 2)), ("text", 3), ("video", (3, 2, 4)), ("text", 2)],
    # Images before and after a video: the DeepStack features of both kinds go to their own tokens.
    "images-and-a-video": [
        ("text", 3),
        ("image", (1, 4, 4)),
        ("text", 2),
        ("video", (2, 4, 2)),
        ("text", 1),
        ("image", (1, 2, 6)),
        ("text", 4),
    ],
}


def pair(tmp_path, family):
    hf_class, config = FAMILIES[family]
    return hf_and_native(hf_class, config(), tmp_path / "hf")


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("sample", SAMPLES)
def test_logits_loss_and_grads_match_transformers(tmp_path, family, sample):
    hf, native = pair(tmp_path, family)
    ids, pixels, grid, video_pixels, video_grid = mm_sample(SAMPLES[sample], torch.Generator().manual_seed(1))
    ids = ids[None]
    ref = hf(**hf_mm_inputs(ids, pixels, grid, video_pixels, video_grid)).logits
    out = native(ids, pixels, grid, pixel_values_videos=video_pixels, video_grid_thw=video_grid).logits
    assert max_rel(out, ref) < 1e-4
    loss, ref_loss = token_loss(out, ids) / ids.numel(), token_loss(ref, ids) / ids.numel()
    assert abs(loss.item() - ref_loss.item()) < 1e-5
    loss.backward()
    ref_loss.backward()
    diffs = grad_diffs(native, hf)
    assert set(diffs) == {n for n, _ in hf.named_parameters()}
    assert max(diffs.values()) < 1e-4, sorted(diffs.items(), key=lambda kv: -kv[1])[:5]
    assert native.model.visual.patch_embed.proj.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_5"])
def test_position_ids_match_transformers_rope_index(tmp_path, family):
    hf, native = pair(tmp_path, family)
    ids, _, grid, _, video_grid = mm_sample(SAMPLES["images-and-a-video"], torch.Generator().manual_seed(3))
    ids = ids[None]
    ref, _ = hf.model.get_rope_index(ids, mm_token_types(ids), grid, video_grid)
    assert torch.equal(native.position_ids(ids, grid, None, video_grid), ref)
    assert torch.equal(models.position_ids(native.config, ids, grid, None, video_grid), ref)


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_5"])
def test_packed_row_with_videos_equals_samples_run_alone(tmp_path, family):
    """Logits and every gradient of one packed row (cu_seqlens) against each sample alone: a video,
    a text sample, images and a video."""
    _, native = pair(tmp_path, family)
    g = torch.Generator().manual_seed(4)
    samples = [
        mm_sample(SAMPLES["one-video"], g),
        mm_sample([("text", 9)], g),
        mm_sample(SAMPLES["images-and-a-video"], g),
    ]
    ids = torch.cat([s[0] for s in samples])[None]
    cat = lambda k: torch.cat([s[k] for s in samples if s[k] is not None])  # noqa: E731
    pixels, grid, video_pixels, video_grid = cat(1), cat(2), cat(3), cat(4)
    cu = torch.nn.functional.pad(torch.tensor([len(s[0]) for s in samples]).cumsum(0), (1, 0)).to(torch.int32)

    positions = models.position_ids(native.config, ids, grid, cu, video_grid)
    alone_positions = [native.position_ids(s[0][None], s[2], None, s[4]) for s in samples]
    assert torch.equal(positions, torch.cat(alone_positions, dim=2))

    packed = native(
        ids, pixels, grid, cu_seqlens=cu, pixel_values_videos=video_pixels, video_grid_thw=video_grid
    ).logits
    sum(token_loss(packed[:, a:b], ids[:, a:b]) for a, b in zip(cu[:-1], cu[1:])).backward()
    packed_grads = {n: p.grad.clone() for n, p in native.named_parameters()}
    native.zero_grad()
    alone, loss = [], 0
    for s_ids, s_pix, s_grid, s_vpix, s_vgrid in samples:
        logits = native(s_ids[None], s_pix, s_grid, pixel_values_videos=s_vpix, video_grid_thw=s_vgrid).logits
        alone.append(logits)
        loss = loss + token_loss(logits, s_ids[None])
    loss.backward()
    assert max_rel(packed, torch.cat(alone, dim=1)) < 1e-5
    floor = 1e-4 * max(p.grad.abs().max().item() for p in native.parameters())
    for name, p in native.named_parameters():
        diff = (packed_grads[name] - p.grad).abs().max().item()
        assert diff < 1e-4 * max(p.grad.abs().max().item(), floor), (name, diff)


def test_video_tokens_and_grids_that_disagree_fail_clearly(tmp_path):
    _, native = pair(tmp_path, "qwen3_vl")
    ids, _, _, video_pixels, video_grid = mm_sample(SAMPLES["one-video"], torch.Generator().manual_seed(5))
    ids = ids[None].clone()
    ids[0, (ids[0] == VIDEO).nonzero()[0]] = 7  # one video token fewer than the grid describes
    with pytest.raises(ValueError, match="video tokens"):
        native(ids, None, None, pixel_values_videos=video_pixels, video_grid_thw=video_grid)
    ids, *_ = mm_sample([("text", 3), ("video", (2, 4, 4)), ("text", 1)], torch.Generator().manual_seed(6))
    with pytest.raises(ValueError, match="more video tokens than video_grid_thw describes"):
        native.position_ids(ids[None], None, None, torch.tensor([[1, 4, 4]]))


def test_text_models_refuse_video(tmp_path):
    from transformers import Qwen3ForCausalLM

    from vlmcore.tiny import qwen3_config

    _, native = hf_and_native(Qwen3ForCausalLM, qwen3_config(), tmp_path / "hf")
    with pytest.raises(ValueError, match="pixel_values_videos must be None"):
        native(torch.tensor([[1, 2, 3]]), pixel_values_videos=torch.zeros(16, 1536), video_grid_thw=[[1, 4, 4]])
