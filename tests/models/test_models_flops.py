"""FLOPs formulas of vlmcore.models.flops against the weights of the built models and a count of
the matmuls that a forward really runs (torch.utils.flop_counter)."""

import math
import re

import pytest
import torch
from helpers import vl_sample
from torch import nn
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count
from transformers import Qwen3_5TextConfig

import vlmcore.models as models
from vlmcore.models import flops
from vlmcore.tiny import qwen3_5_parity_config, qwen3_5_parity_text_dict, qwen3_config, qwen3_vl_config


def count_forward_flops(fn) -> int:
    """FLOPs of one call as torch counts them; the CPU SDPA kernel is not in torch's table, so it is
    given the standard formula (2 matmuls of 2 * S_q * S_k * head_dim per head), and neither is the
    triangular solve of the gated delta rule: (C, C) by (C, d) costs C * C * d (half a matmul)."""

    def sdpa_cpu(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs):
        return sdpa_flop_count(query_shape, key_shape, value_shape)

    def solve_triangular(a_shape, b_shape, *args, out_shape=None, **kwargs):
        return math.prod(b_shape) * a_shape[-1]

    mapping = {
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: sdpa_cpu,
        torch.ops.aten.linalg_solve_triangular: solve_triangular,
    }
    with torch.no_grad(), FlopCounterMode(display=False, custom_mapping=mapping) as counter:
        fn()
    return counter.get_total_flops()


def matmul_weights(module: nn.Module) -> int:
    return sum(m.weight.numel() for m in module.modules() if isinstance(m, (nn.Linear, nn.Conv3d)))


@pytest.mark.parametrize("tied", [True, False])
def test_qwen3_matmul_params_are_the_models_linear_weights(tied):
    model = models.build_model(qwen3_config(tied=tied, heads=8, kv_heads=2, head_dim=24))
    assert flops.llm_matmul_params(model.config) == matmul_weights(model)


def test_qwen3_vl_matmul_params_are_the_models_weights():
    model = models.build_model(qwen3_vl_config(deepstack=(0, 1), heads=8, kv_heads=2, head_dim=24))
    visual = model.model.visual
    assert flops.llm_matmul_params(model.config) == matmul_weights(model) - matmul_weights(visual)
    per_patch, per_merged = flops.vision_matmul_params(model.config)
    mergers = matmul_weights(visual.merger) + matmul_weights(visual.deepstack_merger_list)
    assert per_merged == mergers
    assert per_patch == matmul_weights(visual) - mergers


def test_qwen3_flops_equal_a_count_of_the_forward():
    torch.manual_seed(0)
    model = models.build_model(qwen3_config(tied=False, heads=8, kv_heads=2, head_dim=24), device="cpu")
    model.init_weights()
    ids = torch.randint(0, 256, (3, 40))
    counted = count_forward_flops(lambda: model(ids))
    # Forward = a third of the training FLOPs.
    assert flops.llm_flops(model.config, [40, 40, 40]) == 3 * counted
    assert flops.llm_flops_per_token(model.config, 40) * 120 == 3 * counted


def test_qwen3_vl_flops_equal_a_count_of_the_forward_llm_and_vision_apart():
    torch.manual_seed(0)
    model = models.build_model(qwen3_vl_config(deepstack=(0, 1)), device="cpu")
    model.init_weights()
    ids, pixels, grid = vl_sample([(1, 6, 4)], [5, 7], torch.Generator().manual_seed(1))
    ids = ids[None]
    vision = count_forward_flops(lambda: model.model.visual(pixels, grid))
    total = count_forward_flops(lambda: model(ids, pixels, grid))
    assert flops.vision_flops(model.config, grid) == 3 * vision
    assert flops.llm_flops(model.config, [ids.shape[1]]) == 3 * (total - vision)
    assert flops.vision_flops_per_token(model.config, grid) == 3 * vision / 6  # 24 patches -> 6 tokens


def test_vision_attention_is_per_frame_and_text_only_batches_cost_nothing():
    config = qwen3_vl_config()
    one = flops.vision_flops(config, torch.tensor([[1, 4, 4]]))
    assert flops.vision_flops(config, torch.tensor([[2, 4, 4]])) == 2 * one
    assert flops.vision_flops(config, torch.tensor([[1, 4, 4], [1, 4, 4]])) == 2 * one
    assert flops.vision_flops(config, None) == 0.0


def test_unknown_family_is_named():
    config = qwen3_config()
    config.model_type = "llama"
    with pytest.raises(ValueError, match="llama"):
        flops.llm_flops_per_token(config, 16)


def test_qwen3_5_matmul_params_are_the_models_weights():
    """Gated q_proj (2x wide) in full-attention layers, the five projections of Gated DeltaNet."""
    model = models.build_model(qwen3_5_parity_config())
    visual = model.model.visual
    assert flops.llm_matmul_params(model.config) == matmul_weights(model) - matmul_weights(visual)
    per_patch, per_merged = flops.vision_matmul_params(model.config)
    assert per_merged == matmul_weights(visual.merger)
    assert per_patch == matmul_weights(visual) - matmul_weights(visual.merger)
    text = models.build_model(Qwen3_5TextConfig(**qwen3_5_parity_text_dict(tied=True)))
    assert flops.llm_matmul_params(text.config) == matmul_weights(text)  # tied LM head counted once


def test_qwen3_5_flops_equal_a_count_of_the_forward_llm_and_vision_apart():
    """Segments of whole 64-token chunks, so the chunked gated delta rule pads nothing."""
    torch.manual_seed(0)
    model = models.build_model(qwen3_5_parity_config(), device="cpu")
    model.init_weights()
    ids, pixels, grid = vl_sample([(1, 6, 4)], [5, 51], torch.Generator().manual_seed(1))
    ids = ids[None]
    assert ids.shape[1] == 64
    vision = count_forward_flops(lambda: model.model.visual(pixels, grid))
    total = count_forward_flops(lambda: model(ids, pixels, grid))
    assert flops.linear_attention_flops_per_token(model.config) > 0
    assert flops.vision_flops(model.config, grid) == 3 * vision
    assert flops.llm_flops(model.config, [64]) == 3 * (total - vision)

    text = models.build_model(
        Qwen3_5TextConfig(**qwen3_5_parity_text_dict(head_dim=32, k_heads=2, v_heads=2)), device="cpu"
    )
    text.init_weights()
    counted = count_forward_flops(lambda: text(torch.randint(0, 256, (2, 128))))
    assert flops.llm_flops(text.config, [128, 128]) == 3 * counted
    assert flops.llm_flops_per_token(text.config, 128) * 256 == 3 * counted


# Mixture-of-experts: FLOPs from the parameters a token is routed through. The configs are
# transformers' own; the counts are checked against a hand count and against the FLOPs that
# transformers' reference MoE blocks run.
MOE_TEXT = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
)
TOKEN_IDS = dict(image_token_id=63, video_token_id=62, vision_start_token_id=61, vision_end_token_id=60)


def qwen3_moe_config():
    """4 layers, MoE where (i + 1) % 2 == 0: layers 1 and 3."""
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(num_hidden_layers=4, decoder_sparse_step=2, **MOE_TEXT)


def qwen3_vl_moe_config():
    """3 layers, layer 1 dense by mlp_only_layers."""
    from transformers import Qwen3VLMoeConfig

    text = dict(
        MOE_TEXT,
        num_hidden_layers=3,
        mlp_only_layers=[1],
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 5e6,
            "mrope_section": [2, 1, 1],
            "mrope_interleaved": True,
        },
    )
    return Qwen3VLMoeConfig(text_config=text, vision_config=qwen3_vl_config().vision_config.to_dict(), **TOKEN_IDS)


def qwen3_5_moe_config():
    """A linear-attention and a full-attention layer, both MoE with a shared expert."""
    from transformers import Qwen3_5MoeConfig

    text = {k: v for k, v in MOE_TEXT.items() if k != "intermediate_size"}
    text.update(
        layer_types=["linear_attention", "full_attention"],
        num_hidden_layers=2,
        shared_expert_intermediate_size=24,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 1e7,
            "partial_rotary_factor": 0.25,
            "mrope_section": [1, 0, 0],
            "mrope_interleaved": True,
        },
    )
    return Qwen3_5MoeConfig(
        text_config=text, vision_config=qwen3_5_parity_config().vision_config.to_dict(), **TOKEN_IDS
    )


MOE_CONFIGS = {"qwen3_moe": qwen3_moe_config, "qwen3_vl_moe": qwen3_vl_moe_config, "qwen3_5_moe": qwen3_5_moe_config}

# Hand counts of the matmul weights a token passes, H = 32, head_dim 8, 4 heads, 2 KV heads,
# E = 8 experts, top-2, I = 16, dense I = 48, vocab 64.
ATTENTION = 32 * 8 * (4 + 2 + 2 + 4)  # q, k, v, o
GATED_ATTENTION = 32 * 8 * (2 * 4 + 2 + 2 + 4)  # q twice as wide for the output gate
DELTANET = 32 * (2 * 16 + 32) + 32 * 32 + 2 * 32 * 4 + 32 * 32  # qkv, z, a, b, out (2 key heads x 8, 4 value heads x 8)
ROUTED = 32 * 8 + 2 * 3 * 32 * 16  # router H x E, 2 experts x (gate, up, down)
SHARED = 3 * 32 * 24 + 32  # shared expert (I_shared 24) and its 1-wide gate
DENSE = 3 * 32 * 48
LM_HEAD = 32 * 64
HAND_COUNTS = {
    "qwen3_moe": 4 * ATTENTION + 2 * ROUTED + 2 * DENSE + LM_HEAD,
    "qwen3_vl_moe": 3 * ATTENTION + 2 * ROUTED + DENSE + LM_HEAD,
    "qwen3_5_moe": GATED_ATTENTION + DELTANET + 2 * (ROUTED + SHARED) + LM_HEAD,
}


@pytest.mark.parametrize("family", MOE_CONFIGS)
def test_moe_matmul_params_are_a_hand_count_of_the_active_weights(family):
    config = MOE_CONFIGS[family]()
    assert config.model_type == family
    assert flops.llm_matmul_params(config) == HAND_COUNTS[family]
    # Per token the formula counts 2 of the 8 experts: far fewer than the weights held.
    assert flops.moe_active_params(flops.text_config_of(config)) < 8 * 3 * 32 * 16


def reference_model(config):
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    torch.manual_seed(0)
    auto = AutoModelForCausalLM if config.model_type == "qwen3_moe" else AutoModelForImageTextToText
    # The eager experts (a loop over the experts hit): torch counts no FLOPs for _grouped_mm.
    return auto.from_config(config, dtype=torch.float32, experts_implementation="eager").eval()


@pytest.mark.parametrize("family", MOE_CONFIGS)
def test_moe_flops_equal_a_count_of_transformers_moe_blocks(family):
    """transformers runs every token through exactly its top-k experts (dropless), so the FLOPs
    its MLP blocks run are the active-parameter count: 2 per weight and token forward."""
    config = MOE_CONFIGS[family]()
    model = reference_model(config)
    ids = torch.randint(0, 60, (2, 24))
    mapping = {
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: lambda q, k, v, *a, out_shape=None, **kw: (
            sdpa_flop_count(q, k, v)
        )
    }
    with torch.no_grad(), FlopCounterMode(display=False, custom_mapping=mapping) as counter:
        model(input_ids=ids)
    per_module = {name: sum(ops.values()) for name, ops in counter.get_flop_counts().items()}
    mlps = sum(n for name, n in per_module.items() if re.search(r"layers\.\d+\.mlp$", name))
    text = flops.text_config_of(config)
    assert mlps == 2 * ids.numel() * flops.mlp_params(text)
    if family == "qwen3_moe":  # all full attention: the whole LLM as in the dense tests
        assert flops.llm_flops(config, [24, 24]) == 3 * per_module["Global"]


def test_native_qwen3_moe_flops_equal_a_count_of_its_forward():
    """The native MoE block runs each token through its top-k experts only (the exact CPU path)."""
    torch.manual_seed(0)
    model = models.build_model(qwen3_moe_config(), device="cpu")
    model.init_weights()
    ids = torch.randint(0, 60, (3, 40))
    counted = count_forward_flops(lambda: model(ids))
    assert flops.llm_flops(model.config, [40, 40, 40]) == 3 * counted
