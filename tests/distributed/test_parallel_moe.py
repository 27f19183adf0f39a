"""Mixture-of-experts under the parallelisms: the same global batch trained with expert
parallelism (experts split over EP ranks, tokens exchanged by all-to-all), EP x FSDP, and
tensor parallelism gives the one-process run; a checkpoint written under EP resumes without it.

Reference per model: one process (no torchrun) x 4 micro-batches. Compared over STEPS optimizer
steps: loss, gradient norm (clipped to 1, so clipping takes part) and the MoE metrics (aux loss,
load imbalance), then the final weights, within fp32 tolerance. The config checks of `parallel.ep`
are pure-python cases.
"""

import shutil

import pytest
import torch
from helpers import estimates, load_dcp, read_metrics, train, train_cases, write_config

from vlmcore.config import ConfigError, ParallelConfig
from vlmcore.parallel.checks import check_ep, check_tp
from vlmcore.parallel.layout import resolve_layout
from vlmcore.tiny import hf_config, tiny_snapshot

STEPS = 6
GLOBAL_MICRO_BATCHES = 4
RESUME_AT = 3  # the EP x FSDP run writes a checkpoint here; an EP=1 run resumes from it

LAYOUTS = {
    # Activation checkpointing recomputes the all-to-alls in backward, on every rank alike.
    "ep2_accum2": (2, {"grad_accum_steps": 2, "parallel": {"ep": 2, "activation_checkpointing": "full"}}),
    "ep2_fsdp2": (
        4,
        {
            "grad_accum_steps": 1,
            "parallel": {"ep": 2},
            "checkpoint": {"enabled": True, "interval": RESUME_AT, "keep": 2},
        },
    ),
    "tp2_accum4": (2, {"grad_accum_steps": 4, "parallel": {"tp": 2}}),
    "ep2_tp2_accum2": (
        4,
        {"grad_accum_steps": 2, "parallel": {"ep": 2, "tp": 2, "activation_checkpointing": "selective"}},
    ),
}
# The VL families (vision tower, DeepStack; Qwen3.5-MoE's linear attention and shared expert) under the two
# 4-process layouts, which hold EP, FSDP over the ranks orthogonal to it, and TP between them.
CASES = [("qwen3_moe", name) for name in ("ep2_accum2", "ep2_fsdp2", "tp2_accum4")]
CASES += [(kind, name) for kind in ("qwen3_vl_moe", "qwen3_5_moe") for name in ("ep2_fsdp2", "ep2_tp2_accum2")]


def run_layout(tmp_path, snapshot, name, nproc, overrides):
    out = tmp_path / name
    overrides = {"checkpoint": {"enabled": False}, **overrides}
    cfg = write_config(
        tmp_path / f"{name}.yaml",
        snapshot,
        out,
        steps=STEPS,
        optimizer={"lr": 3.0e-3, "weight_decay": 0.01},
        **overrides,
    )
    if nproc:
        train(nproc, cfg)
    return out, cfg


def trajectory(out):
    return [(m["loss"], m["grad_norm"], m["moe_aux_loss"], m["moe_load_imbalance"]) for m in read_metrics(out)]


def assert_same_weights(weights, ref_weights):
    assert weights.keys() == ref_weights.keys()
    for key in ref_weights:
        torch.testing.assert_close(weights[key], ref_weights[key], rtol=1e-4, atol=1e-4, msg=key)


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """kind -> (directory, snapshot, trajectory, final weights) of the one-process run, run once."""
    cache = {}

    def get(kind):
        if kind not in cache:
            tmp_path = tmp_path_factory.mktemp(kind)
            snapshot = tiny_snapshot(kind, tmp_path / "model")
            out, _ = run_layout(tmp_path, snapshot, "reference", 1, {"grad_accum_steps": GLOBAL_MICRO_BATCHES})
            cache[kind] = tmp_path, snapshot, trajectory(out), load_dcp(out / "final")
        return cache[kind]

    return get


@pytest.fixture(scope="module")
def layouts(references):
    """Every case of CASES trained, those of one world size in one launch (train_cases), whatever
    their model: (kind, name) -> the error of its launch, for the cases that launch stopped before
    they finished."""
    by_size = {}
    for kind, name in CASES:
        tmp_path, snapshot, _, _ = references(kind)
        nproc, overrides = LAYOUTS[name]
        out, cfg = run_layout(tmp_path, snapshot, name, 0, overrides)  # the config, not run yet
        by_size.setdefault(nproc, []).append(((kind, name), out, cfg))
    errors = {}
    for nproc, cases in sorted(by_size.items()):
        try:
            train_cases(nproc, [cfg for _, _, cfg in cases], timeout=len(cases) * 300)
        except AssertionError as error:
            for case, out, _ in cases:
                if not (out / "done").exists():
                    errors[case] = str(error)
    return errors


@pytest.mark.slow
@pytest.mark.parametrize("kind, name", CASES)
def test_layout_matches_one_process(references, layouts, kind, name):
    tmp_path, _, ref_trajectory, ref_weights = references(kind)
    assert len(ref_trajectory) == STEPS and max(norm for _, norm, _, _ in ref_trajectory) > 1.0
    assert (kind, name) not in layouts, layouts.get((kind, name))
    out = tmp_path / name
    torch.testing.assert_close(torch.tensor(trajectory(out)), torch.tensor(ref_trajectory), rtol=1e-5, atol=1e-5)
    assert_same_weights(load_dcp(out / "final"), ref_weights)


@pytest.mark.slow
def test_checkpoint_written_under_ep_resumes_without_it(references):
    """The EP=2 x FSDP=2 run's step-3 checkpoint, loaded by FSDP=4 without EP (the experts
    resharded by DCP): the remaining steps and the final weights are the uninterrupted run's."""
    tmp_path, snapshot, ref_trajectory, ref_weights = references("qwen3_moe")
    writer = tmp_path / "ep2_fsdp2"
    if not (writer / "final").exists():
        run_layout(tmp_path, snapshot, "ep2_fsdp2", *LAYOUTS["ep2_fsdp2"])
    out, cfg = run_layout(
        tmp_path, snapshot, "resumed_ep1", 0, {"grad_accum_steps": 1, "checkpoint": {"interval": RESUME_AT, "keep": 2}}
    )
    shutil.copytree(writer / "checkpoints" / f"step_{RESUME_AT}", out / "checkpoints" / f"step_{RESUME_AT}")
    (out / "checkpoints" / "latest").write_text(f"step_{RESUME_AT}")
    proc = train(4, cfg)
    assert f"resumed from {out / 'checkpoints' / f'step_{RESUME_AT}'} at step {RESUME_AT}" in proc.stdout
    resumed = trajectory(out)
    assert [m["step"] for m in read_metrics(out)] == list(range(RESUME_AT + 1, STEPS + 1))
    torch.testing.assert_close(torch.tensor(resumed), torch.tensor(ref_trajectory[RESUME_AT:]), rtol=1e-5, atol=1e-5)
    assert_same_weights(load_dcp(out / "final"), ref_weights)


@pytest.mark.slow
def test_compiled_blocks_under_ep_follow_the_eager_run(tmp_path):
    """Per-block torch.compile with the experts split over EP ranks (DTensors), 2 ranks (EP 2),
    without and with full activation checkpointing (the Qwen3-VL-30B-A3B recipes'), against the
    eager run. Compiled without checkpointing, the first step used to fail in dynamo: the
    expert-sharded weights reached the expert matmuls as DTensors. (Checkpointed, the layers
    compile inside the checkpoint, in pieces around the dispatch's host reads of the split sizes,
    see parallel/compile.py.) Inductor rounds differently in fp32: the trajectories agree to 1e-4."""
    snapshot = tiny_snapshot("qwen3_moe", tmp_path / "model")
    cases = [
        ("eager", "none", False),
        ("compiled", "none", True),
        ("compiled_full", "full", True),
    ]
    configs = [
        write_config(
            tmp_path / f"{name}.yaml",
            snapshot,
            tmp_path / name,
            steps=3,
            checkpoint={"enabled": False},
            parallel={"ep": 2, "activation_checkpointing": checkpointing, "compile": compiled},
        )
        for name, checkpointing, compiled in cases
    ]
    train_cases(2, configs, timeout=3 * 600)  # the three runs in one launch, 600 s each
    runs = {name: torch.tensor(trajectory(tmp_path / name)) for name, _, _ in cases}
    assert len(runs["eager"]) == 3
    for name in ("compiled", "compiled_full"):
        torch.testing.assert_close(runs[name], runs["eager"], rtol=1e-4, atol=0, msg=name)


def test_memory_estimate_runs_expert_parallel(tmp_path):
    """`vlmcore memory`'s fake run goes through the all-to-all dispatch (balanced routing taken
    for the split sizes it cannot read). On 2 ranks the experts are split in two either way (FSDP
    or EP): the same sharded parameters and optimizer state; under EP no expert is all-gathered."""
    snapshot = tiny_snapshot("qwen3_moe", tmp_path / "model")
    cfg = write_config(tmp_path / "memory.yaml", snapshot, tmp_path / "out", precision={"param_dtype": "bfloat16"})
    runs = estimates(cfg, [["parallel.ep=1"], 2, 32, 2, True], [["parallel.ep=2"], 2, 32, 2, True])
    fsdp, ep = (run["peak_bytes_by_kind"] for run in runs)
    assert ep["Sharded Param"] == fsdp["Sharded Param"] and ep["OptState"] == fsdp["OptState"] > 0
    assert ep["Unsharded Param"] < fsdp["Unsharded Param"] and ep["All Gather"] < fsdp["All Gather"]


@pytest.mark.parametrize(
    "settings, world_size, message",
    [
        ({"ep": 3}, 4, "parallel.ep: 3 does not divide the data-parallel shard ranks (dp_shard 4 on 4 ranks)"),
        ({"ep": 2, "tp": 2}, 2, "parallel.ep: 2 does not divide the data-parallel shard ranks (dp_shard 1 on 2 ranks)"),
        (
            {"ep": 2, "dp_replicate": 2},
            2,
            "parallel.ep: 2 does not divide the data-parallel shard ranks (dp_shard 1 on 2 ranks)",
        ),
        (
            {"ep": 2, "mode": "ddp"},
            4,
            "parallel.ep: 2 does not divide the data-parallel shard ranks (dp_shard 1 on 4 ranks)",
        ),
    ],
)
def test_ep_must_divide_the_shard_ranks(settings, world_size, message):
    with pytest.raises(ConfigError) as e:
        resolve_layout(ParallelConfig(**settings), world_size)
    assert str(e.value) == message and e.value.key == "parallel.ep"


def test_ep_carves_the_shard_ranks():
    dims = resolve_layout(ParallelConfig(ep=2, tp=2, dp_replicate=2), 16).language.dims
    assert (dims.dp_replicate, dims.dp_shard, dims.dp_shard_mod_ep, dims.ep, dims.tp) == (2, 4, 2, 2, 2)
    assert dims.world_size == 16


@pytest.mark.parametrize(
    "kind, ep, message",
    [
        ("qwen3", 2, "parallel.ep: 2 needs a mixture-of-experts model (qwen3 is dense)"),
        ("qwen3_moe", 3, "parallel.ep: 3 does not divide the model's num_experts (4)"),
    ],
)
def test_ep_must_fit_the_model(kind, ep, message):
    with pytest.raises(ConfigError) as e:
        check_ep(hf_config(kind), ep)
    assert str(e.value) == message and e.value.key == "parallel.ep"
    check_ep(hf_config(kind), 1)


def test_tp_checks_moe_configs_without_asking_for_absent_keys():
    """Qwen3.5-MoE's config has no intermediate_size (every layer is sparse)."""
    import transformers

    config = transformers.Qwen3_5MoeConfig()  # the released defaults: 16 heads, 2 key-value heads
    assert not hasattr(config.text_config, "intermediate_size")
    check_tp(config, 2)
    with pytest.raises(ConfigError, match="parallel.tp: 4 does not divide the model's num_key_value_heads"):
        check_tp(config, 4)
    check_tp(hf_config("qwen3_moe"), 2)
