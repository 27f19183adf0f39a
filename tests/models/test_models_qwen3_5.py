"""Native Qwen3.5 against transformers' Qwen3_5ForConditionalGeneration / Qwen3_5ForCausalLM.

Tiny random configs mixing Gated DeltaNet and gated full-attention layers; sequences longer than
one 64-token chunk of the linear-attention kernel.
"""

import pytest
import torch
import torch.nn.functional as F
from helpers import (
    hf_vl_logits,
    logits_loss_then_grad_diffs,
    max_rel,
    meta_parameter_count,
    pack,
    packed_and_alone,
    vl_sample,
)
from transformers import Qwen3_5Config, Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration, Qwen3_5TextConfig

import vlmcore.models as models
from vlmcore.models.qwen3_5 import Qwen3_5ForCausalLM as NativeCausalLM
from vlmcore.tiny import IMAGE, qwen3_5_moe_config, qwen3_5_parity_config, qwen3_5_parity_text_dict

SHAPES = {
    "gva2": dict(),
    "kv-equal-headdim32-tied-pad": dict(head_dim=32, k_heads=2, v_heads=2, tied=True, pad=0),
}
BATCHES = {
    "one-image-long": dict(grids=[(1, 4, 6)], text_lens=[50, 30]),
    "two-images": dict(grids=[(1, 6, 2), (1, 10, 4)], text_lens=[4, 3, 2]),
    "text-only": dict(grids=[], text_lens=[70]),
}


def vl_pair(tmp_path, **shape):
    """An HF reference model and the native model loaded from its saved snapshot."""
    torch.manual_seed(0)
    hf = Qwen3_5ForConditionalGeneration(qwen3_5_parity_config(**shape)).eval()
    hf.save_pretrained(tmp_path / "hf")
    return hf, models.from_pretrained(tmp_path / "hf").eval()


def text_pair(tmp_path, **shape):
    torch.manual_seed(0)
    hf = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**qwen3_5_parity_text_dict(**shape))).eval()
    hf.save_pretrained(tmp_path / "hf")
    return hf, models.from_pretrained(tmp_path / "hf").eval()


def check_logits_loss_grads(native, hf, ids, out, ref):
    diffs = logits_loss_then_grad_diffs(native, hf, ids, out, ref)
    assert set(diffs) == {n for n, _ in hf.named_parameters()}
    assert max(diffs.values()) < 1e-4, sorted(diffs.items(), key=lambda kv: -kv[1])[:5]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("batch", BATCHES)
def test_vl_logits_loss_and_grads_match_transformers(tmp_path, shape, batch):
    hf, native = vl_pair(tmp_path, **SHAPES[shape])
    ids, pixels, grid = vl_sample(generator=torch.Generator().manual_seed(1), **BATCHES[batch])
    ids = ids[None]
    ref = hf_vl_logits(hf, ids, pixels, grid)
    check_logits_loss_grads(native, hf, ids, native(ids, pixels, grid).logits, ref)
    assert native.config.tie_word_embeddings == (
        native.lm_head.weight is native.model.language_model.embed_tokens.weight
    )


@pytest.mark.parametrize("shape", SHAPES)
def test_text_model_logits_loss_and_grads_match_transformers(tmp_path, shape):
    hf, native = text_pair(tmp_path, **SHAPES[shape])
    assert isinstance(native, NativeCausalLM) and native.config.model_type == "qwen3_5_text"
    ids = torch.randint(0, 256, (2, 75), generator=torch.Generator().manual_seed(1))
    check_logits_loss_grads(native, hf, ids, native(ids).logits, hf(input_ids=ids).logits)


def test_batch_of_two_rows_and_hidden_states(tmp_path):
    hf, native = vl_pair(tmp_path)
    g = torch.Generator().manual_seed(2)
    ids_a, pix_a, grid_a = vl_sample([(1, 4, 4)], [3, 4], g)
    ids_b, pix_b, grid_b = vl_sample([(1, 2, 6)], [4, 4], g)
    ids, pixels, grid = torch.stack([ids_a, ids_b]), torch.cat([pix_a, pix_b]), torch.cat([grid_a, grid_b])
    ref = hf_vl_logits(hf, ids, pixels, grid)
    assert max_rel(native(ids, pixels, grid).logits, ref) < 1e-4
    hidden = native(ids, pixels, grid, return_hidden=True).hidden_states
    assert hidden.shape == (2, ids.shape[1], 64)
    assert max_rel(native.lm_head(hidden), ref) < 1e-4


def test_position_ids_match_transformers_rope_index(tmp_path):
    hf, native = vl_pair(tmp_path)
    ids, _, grid = vl_sample([(1, 6, 2), (1, 4, 8)], [2, 3, 1], torch.Generator().manual_seed(3))
    ids = ids[None]
    ref, _ = hf.model.get_rope_index(ids, (ids == IMAGE).int(), grid)
    assert torch.equal(models.position_ids(native.config, ids, grid, None), ref)
    assert torch.equal(native.position_ids(ids, grid), ref)


def test_packed_row_equals_samples_run_alone(tmp_path):
    """Logits and every gradient: neither the conv window, the recurrent state nor attention leaks."""
    _, native = vl_pair(tmp_path)
    g = torch.Generator().manual_seed(4)
    samples = [
        vl_sample([(1, 4, 6)], [3, 70], g),
        vl_sample([], [9], g),
        vl_sample([(1, 6, 2), (1, 2, 4)], [2, 3, 1], g),
    ]
    ids, pixels, grid, cu = pack(samples)
    positions = models.position_ids(native.config, ids, grid, cu)
    assert torch.equal(positions, torch.cat([native.position_ids(s[0][None], s[2]) for s in samples], dim=2))

    packed, alone, packed_grads = packed_and_alone(native, samples)
    assert max_rel(packed, alone) < 1e-5
    # Relative to each gradient's scale, with a floor at 1e-4 of the largest one: a few heads'
    # dt_bias gradients are ~1e-5 and differ by fp32 rounding of the different chunk layouts.
    floor = 1e-4 * max(p.grad.abs().max().item() for p in native.parameters())
    for name, p in native.named_parameters():
        diff = (packed_grads[name] - p.grad).abs().max().item()
        assert diff < 1e-4 * max(p.grad.abs().max().item(), floor), (name, diff)


def test_text_model_packed_rows_equal_samples_run_alone(tmp_path):
    """Two rows of 40 tokens, segments ending at the row boundary; positions restart per segment."""
    _, native = text_pair(tmp_path)
    g = torch.Generator().manual_seed(5)
    lengths = [7, 30, 3, 21, 19]
    samples = [torch.randint(0, 256, (n,), generator=g) for n in lengths]
    ids = torch.cat(samples).view(2, 40)
    cu = F.pad(torch.tensor(lengths).cumsum(0), (1, 0)).to(torch.int32)
    packed = native(ids, cu_seqlens=cu).logits.flatten(0, 1)
    alone = torch.cat([native(s[None]).logits[0] for s in samples])
    assert max_rel(packed, alone) < 1e-5
    positions = models.position_ids(native.config, ids, None, cu)
    assert torch.equal(positions.flatten(), torch.cat([torch.arange(n) for n in lengths]))


def test_bf16_top1_agrees_with_transformers(tmp_path):
    """bf16 top-1 agrees with transformers' bf16 on >= 99 % of 1.5k tokens, and is as close to fp32 as it."""
    hf, _ = vl_pair(tmp_path)
    native = models.from_pretrained(tmp_path / "hf", dtype=torch.bfloat16).eval()
    hf16 = Qwen3_5ForConditionalGeneration.from_pretrained(tmp_path / "hf", dtype=torch.bfloat16).eval()
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


def test_save_load_roundtrip_and_transformers_reads_it(tmp_path):
    hf, native = vl_pair(tmp_path)
    models.save_pretrained(native, tmp_path / "out")
    again = models.from_pretrained(tmp_path / "out").eval()
    state, state_again = native.state_dict(), again.state_dict()
    assert state.keys() == state_again.keys()
    assert all(torch.equal(state[n], state_again[n]) for n in state)
    reread = Qwen3_5ForConditionalGeneration.from_pretrained(tmp_path / "out").eval()
    ids, pixels, grid = vl_sample([(1, 4, 6)], [5, 7], torch.Generator().manual_seed(7))
    ids = ids[None]
    with torch.no_grad():
        assert torch.equal(hf_vl_logits(reread, ids, pixels, grid), hf_vl_logits(hf, ids, pixels, grid))
        assert max_rel(again(ids, pixels, grid).logits, hf_vl_logits(hf, ids, pixels, grid)) < 1e-4


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_init_weights_matches_transformers_initialisation(family):
    """Same distribution per parameter as transformers' own init: exact for constants, moments for random."""
    from transformers import Qwen3_5MoeForConditionalGeneration

    config, hf_class = {
        "qwen3_5": (qwen3_5_parity_config(), Qwen3_5ForConditionalGeneration),
        "qwen3_5_moe": (qwen3_5_moe_config(), Qwen3_5MoeForConditionalGeneration),
    }[family]
    native = models.build_model(config)
    native.to_empty(device="cpu")
    torch.manual_seed(0)
    native.init_weights()
    torch.manual_seed(0)
    hf = hf_class(config)
    hf_params = dict(hf.named_parameters())
    for name, p in native.named_parameters():
        ref = hf_params[name]
        assert p.shape == ref.shape, name
        if name.endswith("A_log"):
            assert p.exp().min() >= 0.01 and p.exp().max() <= 16, name
        elif ref.numel() < 64 or ref.std() == 0:
            assert torch.equal(p, ref), name
        else:
            assert abs(p.std().item() - ref.std().item()) < 0.25 * ref.std().item(), name
            assert abs(p.mean().item()) < 0.01, name


def test_9b_like_config_builds_on_meta_with_transformers_parameter_count():
    text = dict(
        vocab_size=248320,
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=32,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=256,
        linear_num_key_heads=16,
        linear_num_value_heads=32,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 1e7,
            "partial_rotary_factor": 0.25,
            "mrope_section": [11, 11, 10],
            "mrope_interleaved": True,
        },
    )
    vision = dict(
        depth=27,
        hidden_size=1152,
        intermediate_size=4304,
        num_heads=16,
        out_hidden_size=4096,
        num_position_embeddings=2304,
    )
    config = Qwen3_5Config(text_config=text, vision_config=vision)
    assert meta_parameter_count(config, Qwen3_5ForConditionalGeneration) > 9e9


def test_multi_token_prediction_weights_of_a_snapshot_are_skipped(tmp_path):
    """Released Qwen3.5 snapshots carry `mtp.*` tensors that neither model uses."""
    from safetensors.torch import load_file, save_file

    hf, _ = vl_pair(tmp_path)
    file = tmp_path / "hf" / "model.safetensors"
    tensors = load_file(file)
    tensors["mtp.fc.weight"] = torch.zeros(64, 128)
    save_file(tensors, file, metadata={"format": "pt"})
    native = models.from_pretrained(tmp_path / "hf")
    assert not any(name.startswith("mtp.") for name in native.state_dict())
    ids = torch.randint(0, 200, (1, 20), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        assert max_rel(native(ids).logits, hf(input_ids=ids).logits) < 1e-4
