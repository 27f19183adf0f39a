"""Native Qwen3-VL-MoE against transformers' Qwen3VLMoeForConditionalGeneration on tiny random
configs: logits, CE + router_aux_loss_coef * load-balancing loss (transformers' `loss` with
labels and output_router_logits), every gradient; packed rows with images; snapshot IO in both
expert storage formats a qwen3_vl_moe snapshot can have (the released checkpoints' transposed
(E, H, 2I) / (E, I, H), and the in-memory one transformers 5's save_pretrained writes), with
moe_intermediate_size 48 and hidden 64 so that no expert tensor is square."""

import json
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import (
    assert_packed_row_equals_samples_alone,
    grad_diffs,
    hf_and_native,
    hf_vl_logits,
    max_rel,
    meta_parameter_count,
    token_loss,
    vl_sample,
)
from safetensors.torch import load_file, save_file
from transformers import Qwen3VLMoeForConditionalGeneration

import vlmcore.models as models
from vlmcore.export import load_final_state_dict
from vlmcore.models.expert_storage import disk_tensors, format_of, is_expert_tensor, stored_format
from vlmcore.models.moe import RoutingStats, moe_blocks
from vlmcore.tiny import IMAGE, qwen3_vl_moe_config

SHAPES = {
    "top2-deepstack2": dict(deepstack=(0, 1)),
    "top3-sparse-step2-tied": dict(deepstack=(1,), top_k=3, decoder_sparse_step=2, tied=True),
    "top2-dense-layer0-gqa4": dict(deepstack=(0,), heads=8, kv_heads=2, head_dim=24, mlp_only_layers=[0]),
}
BATCHES = {
    "two-odd-images": dict(grids=[(1, 6, 2), (1, 10, 4)], text_lens=[4, 3, 2]),
    "text-only": dict(grids=[], text_lens=[12]),
}


def pair(tmp_path, **shape):
    return hf_and_native(Qwen3VLMoeForConditionalGeneration, qwen3_vl_moe_config(**shape), tmp_path / "hf")


@pytest.mark.parametrize("shape,batch", [(s, "two-odd-images") for s in SHAPES] + [("top2-deepstack2", "text-only")])
def test_logits_loss_with_aux_and_grads_match_transformers(tmp_path, shape, batch):
    hf, native = pair(tmp_path, **SHAPES[shape])
    ids, pixels, grid = vl_sample(generator=torch.Generator().manual_seed(1), **BATCHES[batch])
    ids = ids[None]
    ref = hf(
        input_ids=ids,
        pixel_values=pixels,
        image_grid_thw=grid,
        mm_token_type_ids=(ids == IMAGE).int(),
        labels=ids,
        output_router_logits=True,
    )
    routing = RoutingStats(moe_blocks(native))
    out = native(ids, pixels, grid).logits
    assert max_rel(out, ref.logits) < 1e-4
    aux, counts = routing.loss()
    torch.testing.assert_close(aux, ref.aux_loss, rtol=1e-5, atol=1e-6)
    text = native.config.text_config
    loss = token_loss(out, ids) / (ids.numel() - 1) + text.router_aux_loss_coef * aux
    torch.testing.assert_close(loss, ref.loss, rtol=1e-5, atol=1e-6)
    assert counts.sum().item() == len(moe_blocks(native)) * ids.numel() * text.num_experts_per_tok
    ref.loss.backward()
    loss.backward()
    diffs = grad_diffs(native, hf)
    assert max(diffs.values()) < 1e-4, sorted(diffs.items(), key=lambda kv: -kv[1])[:5]
    assert any("gate.weight" in n and d < 1e-4 for n, d in diffs.items())  # the aux loss reaches the router
    if pixels is not None:
        assert all(d < 1e-4 for n, d in diffs.items() if n.startswith("model.visual.deepstack_merger_list"))


def test_dense_and_sparse_layers_follow_the_config(tmp_path):
    _, step2 = pair(tmp_path / "a", **SHAPES["top3-sparse-step2-tied"])
    _, dense0 = pair(tmp_path / "b", **SHAPES["top2-dense-layer0-gqa4"])
    kinds = lambda m: [type(layer.mlp).__name__ for layer in m.model.language_model.layers]
    assert kinds(step2) == ["SwiGLU", "SparseMoeBlock", "SwiGLU"]
    assert kinds(dense0) == ["SwiGLU", "SparseMoeBlock", "SparseMoeBlock"]
    assert all(b.top_k == 3 and b.gate.norm_topk_prob for b in moe_blocks(step2))  # qwen3_vl_moe always renormalises


def test_packed_row_with_images_equals_samples_run_alone(tmp_path):
    _, native = pair(tmp_path, **SHAPES["top2-deepstack2"])
    g = torch.Generator().manual_seed(4)
    samples = [
        vl_sample([(1, 4, 6)], [3, 5], g),
        vl_sample([], [9], g),
        vl_sample([(1, 6, 2), (1, 2, 4)], [2, 3, 1], g),
    ]
    assert_packed_row_equals_samples_alone(native, samples)


def released_format_copy(src, dst):
    """The snapshot `src` (as transformers 5 writes it) with its experts stored as the released
    Qwen3-VL-MoE checkpoints store them: gate_up_proj (E, H, 2I), down_proj (E, I, H)."""
    dst.mkdir()
    tensors = load_file(src / "model.safetensors")
    experts = [n for n in tensors if n.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj"))]
    tensors.update({n: tensors[n].transpose(1, 2).contiguous() for n in experts})
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    for name in ("config.json", "generation_config.json"):
        shutil.copy2(src / name, dst / name)
    return dst


def final_checkpoint(model, path):
    """A `final/` DCP checkpoint of the model's weights, as training writes it."""
    state = {f"model.{n}": t.detach().clone() for n, t in model.state_dict().items()}
    dcp.save(state, checkpoint_id=str(path), no_dist=True)
    return path


@pytest.mark.parametrize("source", ["released-transposed", "transformers-5-fused"])
def test_snapshot_round_trip_is_bit_exact_in_the_source_format(tmp_path, source):
    hf, native = pair(tmp_path, **SHAPES["top2-dense-layer0-gqa4"])
    src = tmp_path / "hf"
    gate_up = "model.language_model.layers.1.mlp.experts.gate_up_proj"
    assert load_file(src / "model.safetensors")[gate_up].shape == (8, 96, 64)  # transformers 5 writes (E, 2I, H)
    if source == "released-transposed":
        src = released_format_copy(src, tmp_path / "released")
        reloaded = models.from_pretrained(src)
        assert all(torch.equal(a, b) for a, b in zip(reloaded.state_dict().values(), native.state_dict().values()))
    original = load_file(src / "model.safetensors")
    assert original[gate_up].shape == ((8, 64, 96) if source == "released-transposed" else (8, 96, 64))

    models.save_pretrained(native, tmp_path / "out", source_dir=src)
    exported = load_final_state_dict(final_checkpoint(native, tmp_path / "final"), src)
    for written in (load_file(tmp_path / "out/model.safetensors"), exported):
        assert written.keys() == original.keys()
        assert all(torch.equal(written[k], original[k]) for k in original)

    ids, pixels, grid = vl_sample([(1, 4, 6)], [3, 5], torch.Generator().manual_seed(5))
    ids = ids[None]
    want = hf_vl_logits(hf, ids, pixels, grid)
    for path in (src, tmp_path / "out"):  # transformers reads each format as we do
        theirs = Qwen3VLMoeForConditionalGeneration.from_pretrained(path).eval()
        torch.testing.assert_close(hf_vl_logits(theirs, ids, pixels, grid), want)
    assert json.loads((tmp_path / "out/config.json").read_text())["model_type"] == "qwen3_vl_moe"


@pytest.mark.parametrize("hidden,inter", [(64, 48), (64, 32), (64, 64)])
def test_expert_format_is_read_off_the_shapes_even_when_one_tensor_is_square(hidden, inter):
    """gate_up (E, 2I, H) is square when 2I = H, down (E, H, I) when I = H: never both, so the
    pair always tells the format."""
    memory = {"l.0.mlp.experts.gate_up_proj": (4, 2 * inter, hidden), "l.0.mlp.experts.down_proj": (4, hidden, inter)}
    tensors = {n: torch.empty(shape, device="meta") for n, shape in memory.items()}
    transposed = {n: ((e, c, r),) for n, (e, r, c) in memory.items()}
    assert stored_format("qwen3_vl_moe", tensors, transposed) == "fused_transposed"
    assert stored_format("qwen3_vl_moe", tensors, {n: (shape,) for n, shape in memory.items()}) == "fused"
    assert stored_format("qwen3_vl_moe", tensors, {}) == "fused_transposed"  # nothing matches: the family's


def test_mis_shaped_experts_are_named(tmp_path):
    pair(tmp_path, **SHAPES["top2-deepstack2"])
    model = models.build_model(qwen3_vl_moe_config(moe_intermediate_size=40), device="cpu")
    with pytest.raises(ValueError, match=r"layers\.0\.mlp\.experts\.gate_up_proj: checkpoint \(8, 96, 64\)"):
        models.load_hf_weights(model, tmp_path / "hf")


def test_qwen3_vl_30b_a3b_has_transformers_names_and_the_released_expert_shapes():
    """At the released sizes (on the meta device): every parameter has transformers' name and
    shape, and the experts map to the tensors the released index holds, (128, 2048, 1536) and
    (128, 768, 2048) per layer (models/expert_storage.py gives the sources)."""
    from transformers import Qwen3VLMoeConfig

    config = Qwen3VLMoeConfig(
        vision_config=dict(
            depth=27,
            hidden_size=1152,
            intermediate_size=4304,
            num_heads=16,
            out_hidden_size=2048,
            num_position_embeddings=2304,
            deepstack_visual_indexes=[8, 16, 24],
        ),
        text_config=dict(
            vocab_size=151936,
            hidden_size=2048,
            intermediate_size=6144,
            moe_intermediate_size=768,
            num_experts=128,
            num_experts_per_tok=8,
            num_hidden_layers=48,
            num_attention_heads=32,
            num_key_value_heads=4,
            head_dim=128,
            tie_word_embeddings=False,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 5e6,
                "mrope_section": [24, 20, 20],
                "mrope_interleaved": True,
            },
        ),
        tie_word_embeddings=False,
    )
    assert meta_parameter_count(config, Qwen3VLMoeForConditionalGeneration) == 31_070_754_032  # "30B-A3B"
    experts = {n: t for n, t in models.build_model(config).state_dict().items() if is_expert_tensor(n)}
    assert len(experts) == 2 * 48
    disk = {}
    for name, tensor in experts.items():
        disk.update({n: (shape,) for n, shape in disk_tensors(name, tensor.shape, format_of("qwen3_vl_moe")).items()})
    assert disk["model.language_model.layers.47.mlp.experts.gate_up_proj"] == ((128, 2048, 1536),)
    assert disk["model.language_model.layers.0.mlp.experts.down_proj"] == ((128, 768, 2048),)
    assert stored_format("qwen3_vl_moe", experts, disk) == "fused_transposed"
