"""FLOPs formulas of vlmcore.models.flops against the weights of the built models and a count of
the matmuls that a forward really runs (torch.utils.flop_counter)."""

import math

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count
from transformers import Qwen3_5TextConfig

import vlmcore.models as models
from _models_helpers import qwen3_config, qwen3_vl_config, vl_sample
from test_models_qwen3_5 import text_config as qwen3_5_text_config, vl_config as qwen3_5_config
from vlmcore.models import flops


def count_forward_flops(fn) -> int:
    """FLOPs of one call as torch counts them; the CPU SDPA kernel is not in torch's table, so it is
    given the standard formula (2 matmuls of 2 * S_q * S_k * head_dim per head), and neither is the
    triangular solve of the gated delta rule: (C, C) by (C, d) costs C * C * d (half a matmul)."""
    def sdpa_cpu(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs):
        return sdpa_flop_count(query_shape, key_shape, value_shape)

    def solve_triangular(a_shape, b_shape, *args, out_shape=None, **kwargs):
        return math.prod(b_shape) * a_shape[-1]

    mapping = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: sdpa_cpu,
               torch.ops.aten.linalg_solve_triangular: solve_triangular}
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
    model = models.build_model(qwen3_5_config())
    visual = model.model.visual
    assert flops.llm_matmul_params(model.config) == matmul_weights(model) - matmul_weights(visual)
    per_patch, per_merged = flops.vision_matmul_params(model.config)
    assert per_merged == matmul_weights(visual.merger)
    assert per_patch == matmul_weights(visual) - matmul_weights(visual.merger)
    text = models.build_model(Qwen3_5TextConfig(**qwen3_5_text_config(tied=True)))
    assert flops.llm_matmul_params(text.config) == matmul_weights(text)  # tied LM head counted once


def test_qwen3_5_flops_equal_a_count_of_the_forward_llm_and_vision_apart():
    """Segments of whole 64-token chunks, so the chunked gated delta rule pads nothing."""
    torch.manual_seed(0)
    model = models.build_model(qwen3_5_config(), device="cpu")
    model.init_weights()
    ids, pixels, grid = vl_sample([(1, 6, 4)], [5, 51], torch.Generator().manual_seed(1))
    ids = ids[None]
    assert ids.shape[1] == 64
    vision = count_forward_flops(lambda: model.model.visual(pixels, grid))
    total = count_forward_flops(lambda: model(ids, pixels, grid))
    assert flops.linear_attention_flops_per_token(model.config) > 0
    assert flops.vision_flops(model.config, grid) == 3 * vision
    assert flops.llm_flops(model.config, [64]) == 3 * (total - vision)

    text = models.build_model(Qwen3_5TextConfig(**qwen3_5_text_config(head_dim=32, k_heads=2, v_heads=2)), device="cpu")
    text.init_weights()
    counted = count_forward_flops(lambda: text(torch.randint(0, 256, (2, 128))))
    assert flops.llm_flops(text.config, [128, 128]) == 3 * counted
    assert flops.llm_flops_per_token(text.config, 128) * 256 == 3 * counted
