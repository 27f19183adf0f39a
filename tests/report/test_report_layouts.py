"""The per-module layout cost model (vlmcore.report.layouts) against hand counts: which
candidates exist, each term of the step time, and the recommendation."""

import pytest

from vlmcore.report.layouts import Cluster, Workload, candidates, compare, seconds_from_flops, workload_of
from vlmcore.tiny import hf_config

# Round figures: 4 GPUs per node, 100 GB/s inside a node, 10 GB/s between nodes, half the
# compute efficiency kept per doubling of TP; bf16 parameters and activations, fp32 gradient reduce.
CLUSTER = Cluster(gpus_per_node=4, intra_node_gbs=100.0, inter_node_gbs=10.0, tp_efficiency=0.5)
SHAPES = dict(vision_depth=10, vision_hidden=1000, vision_heads=16, patches=4e5, image_tokens=1e5, bridge_hidden=1000)


def by_layout(predictions):
    return {p.layout: p for p in predictions}


def test_a_small_encoder_stays_colocated():
    # 8 ranks, 1 s of vision and 3 s of LLM per rank, 2 micro-batches: FSDP bytes per parameter
    # 1*2*2 + 4 = 8 for the vision tower (one all-gather per micro-batch), 2*2*2 + 4 = 12 for the LLM.
    w = Workload(vision_s=8.0, llm_s=24.0, vision_params=10**9, llm_params=2 * 10**9, micro_batches=2, **SHAPES)
    p = by_layout(compare(w, CLUSTER, world=8))
    # Rows per step 8 * 2 = 16: only 4 + 4 divides them on both sides. Fastest first.
    assert list(p) == [
        "colocated, vision TP 1",
        "colocated, vision TP 2",
        "disjoint, 4 vision + 4 LLM ranks",
        "colocated, vision TP 4",
    ]
    base = p["colocated, vision TP 1"]
    # vision: max(8/8, FSDP 1e9*8*7/8 / 10 GB/s = 0.7); LLM: max(24/8, 2e9*12*7/8 / 10 GB/s = 2.1)
    assert (base.vision_s, base.llm_s, base.step_s) == pytest.approx((1.0, 3.0, 4.0))
    # TP 2: compute 1 / 0.5 = 2 (FSDP 0.5e9*8*3/4 / 10 GB/s = 0.3); activations 8*10*1*(4e5/8)*1000*2 B / 100 GB/s
    assert p["colocated, vision TP 2"].vision_s == pytest.approx(2.0 + 0.08)
    assert p["colocated, vision TP 4"].vision_s == pytest.approx(4.0 + 0.24)
    # disjoint: V = 8/4 = 2, L = 24/4 = 6 (their FSDP stays in a node); fill 2/2; bridge 2*1e5*1000*2 B / (4 * 10 GB/s)
    split = p["disjoint, 4 vision + 4 LLM ranks"]
    assert (split.vision_s, split.llm_s, split.bridge_s, split.step_s) == pytest.approx((2.0, 6.0, 0.01, 7.01))
    assert split.speedup == pytest.approx(4.0 / 7.01) and base.speedup == 1.0


@pytest.mark.parametrize(
    "micro_batches, best, step, baseline",
    [
        # M = 1, vision 2 + 4 B per parameter: TP 1 vision FSDP 6e9*6*7/8 / 10 GB/s = 3.15 s, LLM max(1, 1e9*8*7/8
        # / 10 GB/s = 0.7); TP 2: max(2, 3e9*6*3/4 / 10 GB/s = 1.35) + 0.08 + 1 = 3.08; disjoint 2 + 2/1 + 0.01 = 4.01.
        (1, "colocated, vision TP 2", 3.08, 4.15),
        # M = 4, vision 12 B, LLM 20 B per parameter: TP 1 6.3 + 1.75; TP 2 max(2, 2.7) + 0.08 + 1.75; TP 4 4.24 + 1.75;
        # disjoint V = max(8/4, 6e9*12*3/4 / 100 GB/s = 0.54), L = max(2, 0.15): 2 + 2/4 + 0.01 = 2.51.
        (4, "disjoint, 4 vision + 4 LLM ranks", 2.51, 8.05),
    ],
)
def test_a_large_encoder_moves_off_the_llm_ranks(micro_batches, best, step, baseline):
    w = Workload(
        vision_s=8.0, llm_s=8.0, vision_params=6 * 10**9, llm_params=10**9, micro_batches=micro_batches, **SHAPES
    )
    ranked = compare(w, CLUSTER, world=8)
    assert ranked[0].layout == best and ranked[0].step_s == pytest.approx(step)
    base = by_layout(ranked)["colocated, vision TP 1"]
    assert base.step_s == pytest.approx(baseline)
    assert ranked[0].speedup == pytest.approx(base.step_s / step)


def test_candidates_respect_the_degrees():
    w = Workload(
        vision_s=1.0,
        llm_s=1.0,
        vision_params=1,
        llm_params=1,
        micro_batches=1,
        llm_tp=2,
        **dict(SHAPES, vision_heads=6),
    )
    layouts = [p.layout for p in candidates(w, CLUSTER, world=16)]
    # heads 6: no vision TP 4; LLM TP 2: 16 - k even; rows 8: k and (16 - k) / 2 divide 8 -> k = 8 (4 LLM DP ranks)
    assert layouts == ["colocated, vision TP 1", "colocated, vision TP 2", "disjoint, 8 vision + 8 LLM ranks"]
    # The LLM's compute was measured at its TP 2: no efficiency loss counted again (1 s / 16 ranks).
    assert [p.llm_s for p in candidates(w, CLUSTER, world=16)[:2]] == pytest.approx([1 / 16, 1 / 16])


def test_workload_of_a_model_config():
    config = hf_config("qwen3_vl")
    w = workload_of(config, vision_s=2.0, llm_s=6.0, patches=400, micro_batches=3)
    from vlmcore.models import build_model

    model = build_model(config)
    assert w.vision_params == sum(p.numel() for p in model.vision_tower().parameters())
    assert w.vision_params + w.llm_params == sum(p.numel() for p in model.parameters())
    assert (w.image_tokens, w.bridge_tensors, w.bridge_hidden, w.vision_depth) == (100, 2, 64, 2)
    assert seconds_from_flops(3e15, achieved_tflops=300) == pytest.approx(10.0)
