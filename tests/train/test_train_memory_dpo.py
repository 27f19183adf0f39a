"""`vlmcore memory` of a DPO stage: with `dpo.reference: copy` the reference model's weights,
sharded as the policy's but without gradients or optimizer state, and its no-grad forward; with
`adapters_off` (LoRA) no second model, only a second forward of the policy's."""

import pytest
from helpers import estimates, write_config

from vlmcore.tiny import tiny_snapshot

pytestmark = pytest.mark.slow


def test_the_copy_reference_adds_its_weights_and_adapters_off_adds_none(tmp_path):
    from vlmcore.models import build_model

    snapshot = tiny_snapshot("qwen3_vl", tmp_path / "qwen3_vl")
    config = write_config(
        tmp_path / "stage.yaml", snapshot, tmp_path / "out", data={"kind": "random", "seq_len": 96, "segments": 2}
    )
    model = build_model(str(snapshot), device="meta")
    reference_weights = 4 * sum(p.numel() for p in model.parameters())  # fp32, as the policy's
    dpo = ["objective=dpo"]
    lora = ["lora.rank=4", "lora.alpha=8"]
    sft, copy, copy_real, lora_sft, lora_copy, adapters_off = estimates(
        config,
        [[], 1, 96, 2, True],
        [dpo, 1, 96, 2, True],
        [dpo, 1, 96, 2, False],
        [lora, 1, 96, 2, True],
        [[*dpo, *lora, "dpo.reference=copy"], 1, 96, 2, True],
        [[*dpo, *lora, "dpo.reference=adapters_off"], 1, 96, 2, True],
    )
    # The fake run counts what a real CPU run of the same DPO steps (reference included) holds, to the byte.
    assert copy["peak_bytes_by_kind"] == copy_real["peak_bytes_by_kind"]
    assert copy["peak_bytes"] == copy_real["peak_bytes"] > 0

    def kind(result: dict, name: str) -> int:
        return result["peak_bytes_by_kind"].get(name, 0)

    # The copy: its weights, sharded as the policy's, and neither gradients nor optimizer state.
    assert kind(copy, "Sharded Param") == kind(sft, "Sharded Param") + reference_weights
    assert kind(copy, "OptState") == kind(sft, "OptState")
    assert kind(copy, "Sharded Grad") == kind(sft, "Sharded Grad")
    # Above the SFT stage, by at most its weights and as much again: its compute copies or gathered
    # weights (below) and the DPO step's own activations. (Not by all its weights: the DPO step's
    # activations differ from the SFT step's, here by 1.5% less at their peaks.)
    assert sft["peak_bytes"] < copy["peak_bytes"] <= sft["peak_bytes"] + 2 * reference_weights
    # Same policy (LoRA), one reference against the other: the copy adds its weights and, at most,
    # as much again (on one rank in fp32 its plain module adds nothing else; over FSDP units, the
    # root unit's gathered weights after a forward with no backward to follow).
    # The no-grad forward saves nothing, and its logits chunks are freed before the policy's forward.
    added = lora_copy["peak_bytes"] - adapters_off["peak_bytes"]
    assert kind(lora_copy, "Sharded Param") == kind(adapters_off, "Sharded Param") + reference_weights
    assert reference_weights <= added <= 2 * reference_weights
    # adapters_off: no second model. The base weights and the adapters' states are the LoRA SFT
    # stage's; the DPO step's own difference (per-segment log-probabilities in place of the token
    # loss, a no-grad forward before the policy's) is a few activations of a 96-token row, far
    # below a tenth of the weights of this model (whose weights are a third of its peak).
    assert kind(adapters_off, "Sharded Param") == kind(lora_sft, "Sharded Param")
    assert kind(adapters_off, "OptState") == kind(lora_sft, "OptState")
    assert abs(adapters_off["peak_bytes"] - lora_sft["peak_bytes"]) < reference_weights / 10


def test_dpo_is_estimated_under_tensor_context_and_expert_parallelism(tmp_path):
    """DPO's layouts in the estimate: under tp 2, cp 2 (dense Qwen3-VL) and ep 2 (Qwen3-VL-MoE) on
    2 ranks the copy reference adds its weights, sharded over the 2 ranks as the policy's are,
    neither gradients nor optimizer state, and its forward's activations."""
    from vlmcore.models import build_model

    kinds = {}
    for kind in ("qwen3_vl", "qwen3_vl_moe"):
        snapshot = tiny_snapshot(kind, tmp_path / kind)
        config = write_config(
            tmp_path / f"{kind}.yaml", snapshot, tmp_path / "out", data={"kind": "random", "seq_len": 96, "segments": 2}
        )
        model = build_model(str(snapshot), device="meta")
        kinds[kind] = config, 4 * sum(p.numel() for p in model.parameters())  # fp32
    # The MoE estimate follows the GPU's grouped GEMM, in bf16.
    bf16 = "precision.param_dtype=bfloat16"
    cases = [
        ("qwen3_vl", ["parallel.tp=2"]),
        ("qwen3_vl", ["parallel.cp=2"]),
        ("qwen3_vl_moe", ["parallel.ep=2", bf16]),
    ]
    for kind, parallel in cases:
        config, reference_weights = kinds[kind]
        sft, dpo = estimates(config, [parallel, 2, 96, 2, True], [[*parallel, "objective=dpo"], 2, 96, 2, True])

        def kind_of(result: dict, name: str) -> int:
            return result["peak_bytes_by_kind"].get(name, 0)

        # The reference's shards are the policy's: its weights on a rank are the policy's, about half of all.
        added = kind_of(dpo, "Sharded Param") - kind_of(sft, "Sharded Param")
        assert added == kind_of(sft, "Sharded Param"), parallel
        assert reference_weights / 2 <= added < reference_weights, parallel
        assert kind_of(dpo, "OptState") == kind_of(sft, "OptState"), parallel
        assert kind_of(dpo, "Sharded Grad") == kind_of(sft, "Sharded Grad"), parallel
        assert sft["peak_bytes"] < dpo["peak_bytes"] <= sft["peak_bytes"] + 2 * reference_weights, parallel
