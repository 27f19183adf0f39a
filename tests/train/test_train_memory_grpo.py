"""`vlmcore memory` of a GRPO stage on random data (each segment a rollout's completion): the
fake run counts what a real CPU run of the same GRPO steps holds, to the byte; with a KL term
(`grpo.beta` > 0) the frozen reference's weights are added, sharded as the policy's, without
gradients or optimizer state; without one, no reference is built. The rollout's own memory
(generation's caches) is not in it: this is the train step's."""

import pytest
from helpers import estimates, write_config

from vlmcore.tiny import tiny_snapshot

pytestmark = pytest.mark.slow


def test_a_grpo_stage_with_a_kl_term_adds_the_references_weights(tmp_path):
    from vlmcore.models import build_model

    snapshot = tiny_snapshot("qwen3_vl", tmp_path / "qwen3_vl")
    config = write_config(
        tmp_path / "stage.yaml",
        snapshot,
        tmp_path / "out",
        data={"kind": "random", "seq_len": 96, "segments": 2},
        objective="grpo",
        grpo={"rewards": [{"name": "exact_match", "weight": 1.0}]},
    )
    model = build_model(str(snapshot), device="meta")
    reference_weights = 4 * sum(p.numel() for p in model.parameters())  # fp32, as the policy's
    with_kl = ["grpo.beta=0.04"]
    without_kl, fake, real = estimates(
        config, [[], 1, 96, 2, True], [with_kl, 1, 96, 2, True], [with_kl, 1, 96, 2, False]
    )
    assert fake["peak_bytes_by_kind"] == real["peak_bytes_by_kind"]
    assert fake["peak_bytes"] == real["peak_bytes"] > 0

    def kind(result: dict, name: str) -> int:
        return result["peak_bytes_by_kind"].get(name, 0)

    assert kind(fake, "Sharded Param") == kind(without_kl, "Sharded Param") + reference_weights
    assert kind(fake, "OptState") == kind(without_kl, "OptState")
    assert kind(fake, "Sharded Grad") == kind(without_kl, "Sharded Grad")
    assert without_kl["peak_bytes"] < fake["peak_bytes"] <= without_kl["peak_bytes"] + 2 * reference_weights
