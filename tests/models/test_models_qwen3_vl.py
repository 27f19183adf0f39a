"""Native Qwen3-VL against transformers' Qwen3VLForConditionalGeneration on tiny random configs."""

import pytest
import torch
from helpers import (
    assert_packed_row_equals_samples_alone,
    hf_vl_logits,
    logits_loss_then_grad_diffs,
    max_rel,
    pack,
    vl_sample,
)
from transformers import Qwen3VLForConditionalGeneration

import vlmcore.models as models
from vlmcore.tiny import IMAGE, qwen3_vl_config

SHAPES = {
    "gqa2-deepstack2": dict(deepstack=(0, 1)),
    "mha-deepstack1-tied": dict(deepstack=(1,), heads=4, kv_heads=4, tied=True),
    "gqa4-headdim24": dict(deepstack=(0,), heads=8, kv_heads=2, head_dim=24),
}


def pair(tmp_path, **shape):
    """An HF reference model and the native model loaded from its saved snapshot."""
    torch.manual_seed(0)
    hf = Qwen3VLForConditionalGeneration(qwen3_vl_config(**shape)).eval()
    hf.save_pretrained(tmp_path / "hf")
    return hf, models.from_pretrained(tmp_path / "hf").eval()


BATCHES = {
    "one-image": dict(grids=[(1, 4, 6)], text_lens=[3, 5]),
    "two-odd-images": dict(grids=[(1, 6, 2), (1, 10, 4)], text_lens=[4, 3, 2]),
    "text-only": dict(grids=[], text_lens=[12]),
}


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("batch", BATCHES)
def test_logits_loss_and_grads_match_transformers(tmp_path, shape, batch):
    hf, native = pair(tmp_path, **SHAPES[shape])
    ids, pixels, grid = vl_sample(generator=torch.Generator().manual_seed(1), **BATCHES[batch])
    ids = ids[None]
    ref = hf_vl_logits(hf, ids, pixels, grid)
    out = native(ids, pixels, grid).logits
    diffs = logits_loss_then_grad_diffs(native, hf, ids, out, ref)
    assert max(diffs.values()) < 1e-4, sorted(diffs.items(), key=lambda kv: -kv[1])[:5]


def test_batch_of_two_rows_and_hidden_states(tmp_path):
    hf, native = pair(tmp_path, **SHAPES["gqa2-deepstack2"])
    g = torch.Generator().manual_seed(2)
    ids_a, pix_a, grid_a = vl_sample([(1, 4, 4)], [3, 4], g)
    ids_b, pix_b, grid_b = vl_sample([(1, 2, 6)], [4, 4], g)
    ids = torch.stack([ids_a, ids_b])
    pixels, grid = torch.cat([pix_a, pix_b]), torch.cat([grid_a, grid_b])
    ref = hf_vl_logits(hf, ids, pixels, grid)
    assert max_rel(native(ids, pixels, grid).logits, ref) < 1e-4
    hidden = native(ids, pixels, grid, return_hidden=True).hidden_states
    assert hidden.shape == (2, ids.shape[1], 64)
    assert max_rel(native.lm_head(hidden), ref) < 1e-4


def test_position_ids_match_transformers_rope_index(tmp_path):
    hf, native = pair(tmp_path, **SHAPES["gqa2-deepstack2"])
    ids, _, grid = vl_sample([(1, 6, 2), (1, 4, 8)], [2, 3, 1], torch.Generator().manual_seed(3))
    ids = ids[None]
    ref, _ = hf.model.get_rope_index(ids, (ids == IMAGE).int(), grid)
    assert torch.equal(models.position_ids(native.config, ids, grid, None), ref)
    assert torch.equal(native.position_ids(ids, grid), ref)


def test_packed_row_equals_samples_run_alone(tmp_path):
    _, native = pair(tmp_path, **SHAPES["gqa2-deepstack2"])
    g = torch.Generator().manual_seed(4)
    samples = [
        vl_sample([(1, 4, 6)], [3, 5], g),
        vl_sample([], [9], g),
        vl_sample([(1, 6, 2), (1, 2, 4)], [2, 3, 1], g),
    ]
    ids, pixels, grid, cu = pack(samples)

    positions = models.position_ids(native.config, ids, grid, cu)
    alone_positions = [native.position_ids(s[0][None], s[2]) for s in samples]
    assert torch.equal(positions, torch.cat(alone_positions, dim=2))

    assert_packed_row_equals_samples_alone(native, samples)


def test_packed_rows_with_explicit_positions(tmp_path):
    """Two rows of the same length, each holding two samples; cu_seqlens spans the flattened batch."""
    _, native = pair(tmp_path, **SHAPES["gqa2-deepstack2"])
    g = torch.Generator().manual_seed(5)
    samples = [
        vl_sample([(1, 4, 4)], [2, 3], g),
        vl_sample([], [6], g),
        vl_sample([], [5], g),
        vl_sample([(1, 2, 4)], [3, 5], g),
    ]
    ids, pixels, grid, cu = pack(samples)
    ids = ids.view(2, -1)
    assert int(cu[2]) == ids.shape[1]  # rows end at a segment boundary
    positions = models.position_ids(native.config, ids, grid, cu)
    assert positions.shape == (3, 2, ids.shape[1])
    packed = native(ids, pixels, grid, position_ids=positions, cu_seqlens=cu).logits.flatten(0, 1)
    alone = torch.cat([native(s[0][None], s[1], s[2]).logits[0] for s in samples])
    assert max_rel(packed, alone) < 1e-5


def test_bf16_top1_agrees_with_transformers(tmp_path):
    """bf16 top-1 agrees with transformers' bf16 on >= 99 % of 1.5k tokens, and is as close to fp32 as it."""
    hf, _ = pair(tmp_path, **SHAPES["gqa2-deepstack2"])
    native = models.from_pretrained(tmp_path / "hf", dtype=torch.bfloat16).eval()
    hf16 = Qwen3VLForConditionalGeneration.from_pretrained(tmp_path / "hf", dtype=torch.bfloat16).eval()
    g = torch.Generator().manual_seed(6)
    top1 = {"native": [], "hf16": [], "hf32": []}
    with torch.no_grad():
        for _ in range(3):
            ids, pixels, grid = vl_sample([(1, 8, 8), (1, 4, 6)], [200, 100, 200], g)
            ids = ids[None]
            top1["hf32"].append(hf_vl_logits(hf, ids, pixels, grid).argmax(-1))
            top1["hf16"].append(hf_vl_logits(hf16, ids, pixels.bfloat16(), grid).argmax(-1))
            top1["native"].append(native(ids, pixels.bfloat16(), grid).logits.argmax(-1))
    top1 = {k: torch.cat(v, dim=1) for k, v in top1.items()}
    agree = lambda a, b: (top1[a] == top1[b]).float().mean().item()
    assert agree("native", "hf16") >= 0.99
    assert agree("native", "hf32") >= agree("hf16", "hf32") - 0.01


def test_mismatched_image_tokens_fail_clearly(tmp_path):
    _, native = pair(tmp_path, **SHAPES["gqa2-deepstack2"])
    ids, pixels, grid = vl_sample([(1, 4, 6)], [3, 5], torch.Generator().manual_seed(7))
    ids = ids[None].clone()
    ids[ids == IMAGE] = 7
    with pytest.raises(ValueError, match="image tokens"):
        native(ids, pixels, grid)
