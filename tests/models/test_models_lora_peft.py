"""vlmcore's LoRA equals peft's on the transformers model: the same tiny model, the same targets
(linear layers of the language model, the vision tower and the projector; the MoE families' routed
experts through peft's `target_parameters`) and the same nonzero adapter weights give the same
logits, loss and adapter gradients. The adapters reach peft through `peft_state_dict`, the mapping
that the export writes, so a wrong mapping fails here too."""

import pytest
import torch
from helpers import hf_and_native, max_rel, token_loss, vl_sample
from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
from transformers import (
    Qwen3_5ForConditionalGeneration,
    Qwen3_5MoeForConditionalGeneration,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
    Qwen3VLForConditionalGeneration,
    Qwen3VLMoeForConditionalGeneration,
)

from vlmcore.models.lora import (
    LoraGroupedExperts,
    LoraLinear,
    adapter_state_dict,
    adapters_disabled,
    add_adapters,
    init_adapters,
    peft_state_dict,
)
from vlmcore.models.moe import RoutingStats, moe_blocks
from vlmcore.tiny import IMAGE, qwen3_5_config, qwen3_5_moe_config, qwen3_config, qwen3_vl_config, qwen3_vl_moe_config

RANK, ALPHA = 4, 8
TEXT_TARGETS = ["model.layers.*.self_attn.*_proj", "model.layers.*.mlp.*_proj", "lm_head"]
VL_TARGETS = [
    "model.language_model.layers.*.self_attn.[qv]_proj",
    "model.language_model.layers.*.mlp.*_proj",  # the shared expert's on Qwen3.5-MoE
    "model.visual.blocks.*.attn.qkv",
    "model.visual.blocks.1.mlp.linear_fc2",
    "model.visual.merger.linear_fc1",
    "model.visual.deepstack_merger_list.*.linear_fc2",
]
VL_MOE_TARGETS = [t for t in VL_TARGETS if ".mlp." not in t]  # every layer sparse: no dense MLP
QWEN3_5_TARGETS = [  # no DeepStack mergers; Gated DeltaNet projections
    *[t for t in VL_TARGETS if "deepstack" not in t],
    "model.language_model.layers.*.linear_attn.in_proj_qkv",
    "*.linear_attn.out_proj",
]


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
        tie_word_embeddings=False,
    )


FAMILIES = {
    "qwen3": (Qwen3ForCausalLM, lambda: qwen3_config(tied=False), TEXT_TARGETS),
    "qwen3_moe": (Qwen3MoeForCausalLM, qwen3_moe_config, ["model.layers.*.self_attn.*_proj", "lm_head"]),
    "qwen3_vl": (Qwen3VLForConditionalGeneration, qwen3_vl_config, VL_TARGETS),
    "qwen3_vl_moe": (Qwen3VLMoeForConditionalGeneration, lambda: qwen3_vl_moe_config(layers=2), VL_MOE_TARGETS),
    "qwen3_5": (Qwen3_5ForConditionalGeneration, qwen3_5_config, QWEN3_5_TARGETS),
    "qwen3_5_moe": (Qwen3_5MoeForConditionalGeneration, qwen3_5_moe_config, QWEN3_5_TARGETS),
}


def lora_pair(tmp_path, family):
    """The transformers model under peft and the native model with adapters, the same nonzero ones."""
    hf_class, config, targets = FAMILIES[family]
    hf, native = hf_and_native(hf_class, config(), tmp_path / "hf")
    adapted = add_adapters(native, RANK, ALPHA, dropout=0.0, targets=targets, experts=True)
    init_adapters(native, seed=3)
    generator = torch.Generator().manual_seed(4)
    with torch.no_grad():  # B starts at zero: make it nonzero so that the update shows
        for name, param in native.named_parameters():
            if name.endswith("lora_B"):
                param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
    linears = [n for n in adapted if isinstance(native.get_submodule(n), LoraLinear)]
    has_experts = any(isinstance(native.get_submodule(n), LoraGroupedExperts) for n in adapted)
    config = LoraConfig(
        r=RANK,
        lora_alpha=ALPHA,
        target_modules=linears,
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"] if has_experts else None,
    )
    peft_model = get_peft_model(hf, config)
    adapters = peft_state_dict(adapter_state_dict(native.state_dict()))
    loaded = set_peft_model_state_dict(peft_model, adapters)
    assert not loaded.unexpected_keys
    assert len(adapters) == sum(p.requires_grad for p in peft_model.parameters())
    return peft_model, native


def forward_both(peft_model, native, family):
    """Both models' logits and mean token losses on one sample (with two images on the VL families)."""
    generator = torch.Generator().manual_seed(1)
    if "vl" in family or family.startswith("qwen3_5"):
        ids, pixels, grid = vl_sample([(1, 6, 2), (1, 4, 4)], [5, 4, 3], generator)
        ids = ids[None]
        ref = peft_model(
            input_ids=ids, pixel_values=pixels, image_grid_thw=grid, mm_token_type_ids=(ids == IMAGE).int()
        )
        out = native(ids, pixels, grid)
    else:
        ids = torch.randint(0, 200, (1, 24), generator=generator)
        ref = peft_model(input_ids=ids)
        out = native(ids)
    n = ids.numel() - 1
    return out.logits, ref.logits, token_loss(out.logits, ids) / n, token_loss(ref.logits, ids) / n


def peft_grads(peft_model):
    """peft's adapter gradients under its state-dict names (without the adapter name `default`)."""
    return {n.replace(".default", ""): p.grad for n, p in peft_model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_loss_and_adapter_grads_match_peft(tmp_path, family):
    peft_model, native = lora_pair(tmp_path, family)
    routing = RoutingStats(moe_blocks(native))
    out, ref, loss, ref_loss = forward_both(peft_model, native, family)
    assert max_rel(out, ref) < 1e-4
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    loss.backward()
    ref_loss.backward()
    ours = peft_state_dict({n: p.grad for n, p in native.named_parameters() if p.requires_grad})
    theirs = peft_grads(peft_model)
    assert ours.keys() == theirs.keys()
    floor = 1e-3 * max(g.abs().max().item() for g in theirs.values())
    diffs = {n: ((ours[n] - theirs[n]).abs().max() / (theirs[n].abs().max() + floor)).item() for n in theirs}
    assert max(diffs.values()) < 1e-4, sorted(diffs.items(), key=lambda kv: -kv[1])[:5]
    assert all(p.grad is None for n, p in native.named_parameters() if not p.requires_grad)
    if routing.blocks:
        assert_every_routed_expert_adapter_has_a_gradient(native, routing)
    with torch.no_grad(), adapters_disabled(native), peft_model.disable_adapter():
        base, base_ref, _, _ = forward_both(peft_model, native, family)
    assert max_rel(base, base_ref) < 1e-4
    assert max_rel(out, base) > 1e-3  # the adapters change the output


def assert_every_routed_expert_adapter_has_a_gradient(native, routing):
    """Each expert that received tokens has nonzero gradients in its four adapter matrices."""
    blocks = moe_blocks(native)
    assert blocks and all(isinstance(b.experts, LoraGroupedExperts) for b in blocks)
    for block in blocks:
        counts = block.last_routing[0]
        assert (counts > 0).sum() >= 2
        for name in ("gate_up_proj_lora_A", "gate_up_proj_lora_B", "down_proj_lora_A", "down_proj_lora_B"):
            grad = getattr(block.experts, name).grad
            assert grad is not None, name
            per_expert = grad.flatten(1).abs().sum(dim=1)
            assert torch.equal(per_expert > 0, counts > 0), (name, per_expert, counts)


def test_an_expert_adapter_without_gradient_fails_the_check(tmp_path):
    """The check above catches the known bug of LoRA that never reaches the experts: with the
    experts' adapters bypassed in the forward, it fails."""
    _, native = lora_pair(tmp_path, "qwen3_vl_moe")
    routing = RoutingStats(moe_blocks(native))
    for block in moe_blocks(native):
        block.experts.expert_weights = super(LoraGroupedExperts, block.experts).expert_weights
    ids, pixels, grid = vl_sample([(1, 6, 2)], [5, 4], torch.Generator().manual_seed(1))
    token_loss(native(ids[None], pixels, grid).logits, ids[None]).backward()
    with pytest.raises(AssertionError):
        assert_every_routed_expert_adapter_has_a_gradient(native, routing)


def test_a_target_that_matches_no_linear_layer_is_refused(tmp_path):
    from vlmcore.config import ConfigError
    from vlmcore.models import build_model

    model = build_model(qwen3_vl_config(), device="meta")
    with pytest.raises(ConfigError, match=r"lora.targets: pattern '\*\.qproj' matches no linear layer"):
        add_adapters(model, RANK, ALPHA, 0.0, ["*.q_proj", "*.qproj"], experts=True)
    model = build_model(qwen3_vl_moe_config(), device="meta")
    with pytest.raises(ConfigError, match="lora.dropout"):
        add_adapters(model, RANK, ALPHA, 0.1, ["*.q_proj"], experts=True)
