"""`vlmcore memory` of a LoRA stage: the frozen base holds its weights but no gradients and no
optimizer state; the adapters (linear layers and routed experts) hold all three."""

import pytest
from helpers import estimates, write_config

from vlmcore.tiny import tiny_snapshot

pytestmark = pytest.mark.slow


def test_lora_stage_holds_optimizer_state_and_gradients_for_the_adapters_only(tmp_path):
    from vlmcore.models import build_model
    from vlmcore.models.lora import add_adapters, is_adapter

    snapshot = tiny_snapshot("qwen3_moe", tmp_path / "qwen3_moe")
    config = write_config(
        tmp_path / "stage.yaml", snapshot, tmp_path / "out", data={"kind": "random", "seq_len": 96, "segments": 2}
    )
    model = build_model(str(snapshot), device="meta")
    n_base = sum(p.numel() for p in model.parameters())
    add_adapters(model, 4, 8.0, 0.0, ["*.self_attn.[qkvo]_proj"], experts=True)
    n_adapters = sum(p.numel() for n, p in model.named_parameters() if is_adapter(n))
    assert any("experts.down_proj_lora_B" in n for n, _ in model.named_parameters())
    bf16 = "precision.param_dtype=bfloat16"  # an MoE estimate follows the GPU's bf16 grouped GEMM
    full_run, lora_run = estimates(
        config, [[bf16], 1, 96, 2, True], [[bf16, "lora.rank=4", "lora.alpha=8"], 1, 96, 2, True]
    )
    full = full_run["peak_bytes_by_kind"]
    lora = lora_run["peak_bytes_by_kind"]
    # fp32 weights: the base and the adapters; AdamW's two fp32 moments for the adapters only.
    assert lora["Sharded Param"] == 4 * (n_base + n_adapters)
    assert 8 * n_adapters <= lora["OptState"] < 8 * n_adapters + 4096
    assert 8 * n_base <= full["OptState"]
    # Gradients, at most the adapters'; and the stage's peak below full fine-tuning's.
    assert lora.get("Sharded Grad", 0) <= 4 * n_adapters + 4096
    assert lora_run["peak_bytes"] < full_run["peak_bytes"]


def test_lora_stage_under_tp_and_ep_holds_each_ranks_share_of_the_adapters_state(tmp_path):
    """Under tp 2 (dp 1) a column-parallel layer's B and a row-parallel one's A are split over the
    TP ranks, the rest of the adapters whole; under ep 2 (FSDP over the same 2 ranks) every adapter
    is halved: the expert adapters along the experts, the others by FSDP. AdamW's two fp32 moments
    follow."""
    from vlmcore.models import build_model
    from vlmcore.models.lora import add_adapters, is_adapter

    snapshot = tiny_snapshot("qwen3_moe", tmp_path / "qwen3_moe")
    config = write_config(
        tmp_path / "stage.yaml", snapshot, tmp_path / "out", data={"kind": "random", "seq_len": 96, "segments": 2}
    )
    model = build_model(str(snapshot), device="meta")
    add_adapters(model, 4, 8.0, 0.0, ["*.self_attn.[qkvo]_proj"], experts=True)
    adapters = {n: p.numel() for n, p in model.named_parameters() if is_adapter(n)}
    split_by_tp = [
        n for n in adapters if n.endswith(("q_proj.lora_B", "k_proj.lora_B", "v_proj.lora_B", "o_proj.lora_A"))
    ]
    assert split_by_tp
    tp_local = sum(adapters.values()) - sum(adapters[n] for n in split_by_tp) // 2
    lora = ["precision.param_dtype=bfloat16", "lora.rank=4", "lora.alpha=8"]
    tp_run, ep_run = estimates(
        config, [[*lora, "parallel.tp=2"], 2, 96, 2, True], [[*lora, "parallel.ep=2"], 2, 96, 2, True]
    )
    tp_state = tp_run["peak_bytes_by_kind"]["OptState"]
    ep_state = ep_run["peak_bytes_by_kind"]["OptState"]
    assert 8 * tp_local <= tp_state < 8 * tp_local + 4096
    assert 4 * sum(adapters.values()) <= ep_state < 4 * sum(adapters.values()) + 4096
