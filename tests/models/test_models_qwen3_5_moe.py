"""Native Qwen3.5-MoE against transformers' Qwen3_5MoeForConditionalGeneration / Qwen3_5MoeForCausalLM:
logits, the loss with the load-balancing term, every gradient; packed rows with images; the two
expert storage formats of its snapshots (transformers' per-expert tensors, the released fused ones), each
loaded and written back bit-exact by save_pretrained and `vlmcore export`.
"""

import pytest
import torch
import torch.nn.functional as F
from helpers import grad_diffs, max_rel, meta_parameter_count, pack, token_loss, vl_sample, write_final_checkpoint
from safetensors.torch import load_file, save_file
from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForCausalLM, Qwen3_5MoeForConditionalGeneration

import vlmcore.models as models
from vlmcore.export import export_hf
from vlmcore.models.moe import RoutingStats, SparseMoeBlock, moe_blocks
from vlmcore.tiny import IMAGE, qwen3_5_moe_config, qwen3_5_moe_text_config

SHAPES = {
    "top2": dict(),
    "top3-tied-headdim32-kv-equal": dict(head_dim=32, k_heads=2, v_heads=2, tied=True, moe=dict(num_experts_per_tok=3)),
}
BATCHES = {
    "one-image-long": dict(grids=[(1, 4, 6)], text_lens=[50, 30]),
    "two-images": dict(grids=[(1, 6, 2), (1, 10, 4)], text_lens=[4, 3, 2]),
    "text-only": dict(grids=[], text_lens=[70]),
}
EXPERTS = "model.language_model.layers.0.mlp.experts"


def vl_pair(path, **shape):
    """A transformers model, saved by transformers to `path`, and the native model loaded from it."""
    torch.manual_seed(0)
    hf = Qwen3_5MoeForConditionalGeneration(qwen3_5_moe_config(**shape)).eval()
    hf.save_pretrained(path)
    return hf, models.from_pretrained(path).eval()


def text_pair(path, **shape):
    torch.manual_seed(0)
    hf = Qwen3_5MoeForCausalLM(qwen3_5_moe_text_config(**shape)).eval()
    hf.save_pretrained(path)
    return hf, models.from_pretrained(path).eval()


def hf_forward(hf, ids, pixels=None, grid=None):
    """transformers' output with its loss = CE + router_aux_loss_coef * aux (labels = ids)."""
    extra = (
        dict(pixel_values=pixels, image_grid_thw=grid, mm_token_type_ids=(ids == IMAGE).int())
        if pixels is not None
        else {}
    )
    return hf(input_ids=ids, labels=ids, output_router_logits=True, **extra)


def check_parity(native, hf, ids, forward, ref):
    """Logits, aux loss, total loss, then every gradient of the total loss (`forward()`: the native logits)."""
    text_config = native.config.get_text_config()
    blocks = moe_blocks(native)
    routing = RoutingStats(blocks)
    logits = forward()
    assert max_rel(logits, ref.logits) < 1e-4
    ce = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    assert len(blocks) == text_config.num_hidden_layers  # every layer is sparse
    aux, counts = routing.loss()
    torch.testing.assert_close(aux, ref.aux_loss, rtol=1e-5, atol=1e-6)
    loss = ce + text_config.router_aux_loss_coef * aux
    torch.testing.assert_close(loss, ref.loss, rtol=1e-5, atol=1e-6)
    assert counts.sum().item() == len(blocks) * ids.numel() * text_config.num_experts_per_tok
    ref.loss.backward()
    loss.backward()
    diffs = grad_diffs(native, hf)
    assert set(diffs) == {n for n, _ in hf.named_parameters()}
    assert max(diffs.values()) < 1e-4, sorted(diffs.items(), key=lambda kv: -kv[1])[:5]
    assert any(n.endswith("shared_expert_gate.weight") for n in diffs)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("batch", BATCHES)
def test_vl_logits_loss_with_aux_and_grads_match_transformers(tmp_path, shape, batch):
    hf, native = vl_pair(tmp_path / "hf", **SHAPES[shape])
    ids, pixels, grid = vl_sample(generator=torch.Generator().manual_seed(1), **BATCHES[batch])
    ids = ids[None]
    check_parity(native, hf, ids, lambda: native(ids, pixels, grid).logits, hf_forward(hf, ids, pixels, grid))
    assert native.config.tie_word_embeddings == (
        native.lm_head.weight is native.model.language_model.embed_tokens.weight
    )


@pytest.mark.parametrize("shape", SHAPES)
def test_text_model_logits_loss_with_aux_and_grads_match_transformers(tmp_path, shape):
    hf, native = text_pair(tmp_path / "hf", **SHAPES[shape])
    assert native.config.model_type == "qwen3_5_moe_text"
    ids = torch.randint(0, 256, (2, 75), generator=torch.Generator().manual_seed(1))
    check_parity(native, hf, ids, lambda: native(ids).logits, hf_forward(hf, ids))


def test_blocks_route_like_transformers(tmp_path):
    """Every layer is sparse with a gated shared expert; the top-k is renormalised (transformers'
    Qwen3.5-MoE router always does) although the config has no `norm_topk_prob`."""
    _, native = vl_pair(tmp_path / "hf")
    assert not hasattr(native.config.text_config, "norm_topk_prob")
    blocks = [layer.mlp for layer in native.decoder_layers()]
    assert all(isinstance(b, SparseMoeBlock) and b.gate.norm_topk_prob for b in blocks)
    assert blocks[0].shared_expert.gate_proj.weight.shape == (48, 64)
    assert blocks[0].experts.gate_up_proj.shape == (8, 64, 64)


def test_packed_row_with_images_equals_samples_run_alone(tmp_path, one_thread):
    """Logits, routing (tokens per expert of every layer) and every gradient of the token loss.
    On one thread: a linear-attention A_log gradient is a sum of many signed terms over the row,
    and with 2 threads the order of that sum alone moved it by 1.25e-4 of its size (bound 1e-4)."""
    _, native = vl_pair(tmp_path / "hf")
    g = torch.Generator().manual_seed(4)
    samples = [
        vl_sample([(1, 4, 6)], [3, 70], g),
        vl_sample([], [9], g),
        vl_sample([(1, 6, 2), (1, 2, 4)], [2, 3, 1], g),
    ]
    ids, pixels, grid, cu = pack(samples)
    routing = RoutingStats(moe_blocks(native))
    packed = native(ids, pixels, grid, cu_seqlens=cu).logits
    packed_counts = routing.loss()[1]
    sum(token_loss(packed[:, a:b], ids[:, a:b]) for a, b in zip(cu[:-1], cu[1:])).backward()
    packed_grads = {n: p.grad.clone() for n, p in native.named_parameters()}
    native.zero_grad()
    alone, loss, alone_counts = [], 0, 0
    for s_ids, s_pix, s_grid in samples:
        logits = native(s_ids[None], s_pix, s_grid).logits
        alone.append(logits)
        alone_counts = alone_counts + routing.loss()[1]
        loss = loss + token_loss(logits, s_ids[None])
    loss.backward()
    assert max_rel(packed, torch.cat(alone, dim=1)) < 1e-5
    assert torch.equal(packed_counts, alone_counts)
    # As in the dense Qwen3.5 test: relative to each gradient, floored at 1e-4 of the largest one.
    floor = 1e-4 * max(p.grad.abs().max().item() for p in native.parameters())
    for name, p in native.named_parameters():
        diff = (packed_grads[name] - p.grad).abs().max().item()
        assert diff < 1e-4 * max(p.grad.abs().max().item(), floor), (name, diff)


def same_tensors(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("variant", ["vl", "text"])
def test_transformers_per_expert_snapshot_is_written_back_bit_exact(tmp_path, variant):
    """transformers' save_pretrained writes Qwen3.5-MoE experts per expert; the native model loads
    that, and save_pretrained / `vlmcore export` write the same tensors, which transformers loads."""
    hf, native = (vl_pair if variant == "vl" else text_pair)(tmp_path / "hf")
    original = load_file(tmp_path / "hf/model.safetensors")
    prefix = EXPERTS if variant == "vl" else EXPERTS.replace("language_model.", "")
    assert f"{prefix}.7.gate_proj.weight" in original and f"{prefix}.gate_up_proj" not in original

    models.save_pretrained(native, tmp_path / "saved", source_dir=tmp_path / "hf")
    assert same_tensors(load_file(tmp_path / "saved/model.safetensors"), original)
    final = write_final_checkpoint(native, tmp_path / "train/stage1")
    export_hf(final, tmp_path / "hf", tmp_path / "exported")
    assert same_tensors(load_file(tmp_path / "exported/model.safetensors"), original)

    reloaded = type(hf).from_pretrained(tmp_path / "exported").eval()
    ids = torch.randint(0, 200, (1, 24), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids).logits, hf(input_ids=ids).logits, rtol=0, atol=0)


def test_released_fused_snapshot_loads_and_is_written_back_bit_exact(tmp_path):
    """The released Qwen3.5-MoE format: fused experts as in memory, plus an MTP head with
    per-expert tensors the native model skips. It loads, exports bit-exact (the MTP head carried
    over) and transformers reads the export with the same logits."""
    hf, native = vl_pair(tmp_path / "hf")
    models.save_pretrained(native, tmp_path / "released")  # no source: the released format
    released = load_file(tmp_path / "released/model.safetensors")
    assert released[f"{EXPERTS}.gate_up_proj"].shape == (8, 64, 64)  # (E, 2I, H)
    assert released[f"{EXPERTS}.down_proj"].shape == (8, 64, 32)  # (E, H, I)
    assert not any(".experts.0." in k for k in released)
    released.update(
        {
            f"mtp.layers.0.mlp.experts.{e}.{proj}.weight": torch.randn(32, 64)
            for e in range(8)
            for proj in ("gate_proj", "up_proj")
        }
    )
    save_file(released, tmp_path / "released/model.safetensors", metadata={"format": "pt"})

    loaded = models.from_pretrained(tmp_path / "released").eval()
    assert same_tensors(loaded.state_dict(), native.state_dict())
    final = write_final_checkpoint(loaded, tmp_path / "train/stage1")
    export_hf(final, tmp_path / "released", tmp_path / "exported")
    assert same_tensors(load_file(tmp_path / "exported/model.safetensors"), released)

    reloaded = Qwen3_5MoeForConditionalGeneration.from_pretrained(tmp_path / "exported").eval()
    ids = torch.randint(0, 200, (1, 24), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids).logits, hf(input_ids=ids).logits, rtol=0, atol=0)


def test_35b_a3b_config_builds_on_meta_with_transformers_parameters():
    """Qwen/Qwen3.5-35B-A3B's published shape: the same parameter names, shapes and count."""
    text = dict(
        vocab_size=248320,
        hidden_size=2048,
        num_hidden_layers=40,
        num_attention_heads=16,
        num_key_value_heads=2,
        head_dim=256,
        linear_num_key_heads=16,
        linear_num_value_heads=32,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        num_experts=256,
        num_experts_per_tok=8,
        moe_intermediate_size=512,
        shared_expert_intermediate_size=512,
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
        out_hidden_size=2048,
        num_position_embeddings=2304,
    )
    config = Qwen3_5MoeConfig(text_config=text, vision_config=vision)
    assert 34e9 < meta_parameter_count(config, Qwen3_5MoeForConditionalGeneration) < 37e9
