"""The same global batch trained under different layouts gives the same run.

Tiny Qwen3-VL on deterministic random packed batches (uneven label counts per micro-batch, and
images on some micro-batches only, so ranks mix text-only and image batches within a step).
Reference: one process (no torchrun) x 4 micro-batches. Compared over 10 optimizer steps: the
loss and gradient-norm trajectories (the norm is clipped to 1, so clipping is exercised) and
the final weights, within fp32 tolerance.
"""

import shutil

import pytest
import torch
from helpers import load_dcp, read_metrics, train, train_cases, write_config

from vlmcore.tiny import tiny_snapshot

pytestmark = pytest.mark.slow
STEPS = 10
GLOBAL_MICRO_BATCHES = 4

LAYOUTS = {
    "fsdp2_accum2": (2, {"grad_accum_steps": 2}),
    "fsdp4": (4, {"grad_accum_steps": 1}),
    "tp2_accum4": (2, {"grad_accum_steps": 4, "parallel": {"tp": 2}}),
    "dp2_tp2_accum2": (4, {"grad_accum_steps": 2, "parallel": {"tp": 2}}),
    # Colocated module layouts: the vision tower with its own TP and DP degrees on the same ranks.
    "vision_tp2_fsdp2_accum2": (2, {"grad_accum_steps": 2, "parallel": {"modules": {"vision": {"tp": 2}}}}),
    "vision_tp2_dp2_fsdp4": (4, {"grad_accum_steps": 1, "parallel": {"modules": {"vision": {"tp": 2}}}}),
}


def layout_config(tmp_path, snapshot, name, overrides, checkpoint=None):
    return write_config(
        tmp_path / f"{name}.yaml",
        snapshot,
        tmp_path / name,
        steps=STEPS,
        optimizer={"lr": 3.0e-3, "weight_decay": 0.01},
        checkpoint=checkpoint or {"enabled": False},
        **overrides,
    )


def read_layout(tmp_path, name):
    """The run's loss and gradient-norm trajectory and its final weights."""
    out = tmp_path / name
    return [(m["loss"], m["grad_norm"]) for m in read_metrics(out)], load_dcp(out / "final")


def run_layout(tmp_path, snapshot, name, nproc, overrides, checkpoint=None):
    train(nproc, layout_config(tmp_path, snapshot, name, overrides, checkpoint))
    return read_layout(tmp_path, name)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("exactness")
    snapshot = tiny_snapshot("qwen3_vl", tmp_path / "model")
    losses, weights = run_layout(tmp_path, snapshot, "reference", 1, {"grad_accum_steps": GLOBAL_MICRO_BATCHES})
    return tmp_path, snapshot, losses, weights


def test_reference_learns_and_ranks_mix_image_and_text_batches(reference):
    from safetensors.torch import load_file

    from vlmcore.tiny import hf_config
    from vlmcore.train.random_data import RandomBatches

    _, snapshot, trajectory, weights = reference
    assert len(trajectory) == STEPS
    assert max(norm for _, norm in trajectory) > 1.0  # max_grad_norm 1: clipping takes part
    initial = load_file(snapshot / "model.safetensors")
    changed = [k for k, v in initial.items() if not torch.equal(weights[f"model.{k}"], v)]
    assert len(changed) > 0.9 * len(initial)
    # With 4 data-parallel ranks, some steps give images to some ranks only.
    data = RandomBatches(
        hf_config("qwen3_vl"),
        seq_len=32,
        segments=3,
        image_fraction=0.5,
        micro_batch_size=1,
        dp_rank=0,
        dp_world=1,
        grad_accum_steps=1,
        seed=0,
    )
    has_image = [{data.batch(GLOBAL_MICRO_BATCHES * s + r).images is not None for r in range(4)} for s in range(STEPS)]
    assert {True, False} in has_image


@pytest.fixture(scope="module")
def layouts(reference):
    """Every layout of LAYOUTS trained, those of one world size in one launch (train_cases): name ->
    the error of its launch, for the layouts that launch stopped before they finished."""
    tmp_path, snapshot, _, _ = reference
    errors = {}
    for nproc in sorted({nproc for nproc, _ in LAYOUTS.values()}):
        names = [name for name, (size, _) in LAYOUTS.items() if size == nproc]
        configs = [layout_config(tmp_path, snapshot, name, LAYOUTS[name][1]) for name in names]
        try:
            train_cases(nproc, configs, timeout=len(configs) * 300)
        except AssertionError as error:
            for name in names:
                if not (tmp_path / name / "done").exists():
                    errors[name] = str(error)
    return errors


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_one_process(reference, layouts, name):
    tmp_path, _, ref_trajectory, ref_weights = reference
    assert name not in layouts, layouts.get(name)
    trajectory, weights = read_layout(tmp_path, name)
    torch.testing.assert_close(torch.tensor(trajectory), torch.tensor(ref_trajectory), rtol=1e-5, atol=1e-5)
    assert weights.keys() == ref_weights.keys()
    for key in ref_weights:
        torch.testing.assert_close(weights[key], ref_weights[key], rtol=1e-4, atol=1e-4, msg=key)


def test_disjoint_layout_matches_one_process_and_resumes(reference):
    """Disjoint layouts: ranks 0-1 hold and run the vision tower only, ranks 2-3 the language
    model only, the image embeddings (and DeepStack features) sent between them: the same run as
    one process. Its checkpoints hold both modules' weights and optimizer states (each rank
    writes its module's), and a run killed after the step-5 checkpoint resumes to the same run."""
    tmp_path, snapshot, ref_trajectory, ref_weights = reference
    disjoint = {
        "grad_accum_steps": 2,
        "parallel": {"modules": {"vision": {"ranks": [0, 2]}, "language": {"ranks": [2, 4]}}},
    }
    trajectory, weights = run_layout(tmp_path, snapshot, "disjoint", 4, disjoint, {"interval": 5, "keep": 2})
    torch.testing.assert_close(torch.tensor(trajectory), torch.tensor(ref_trajectory), rtol=1e-5, atol=1e-5)
    assert weights.keys() == ref_weights.keys()
    for key in ref_weights:
        torch.testing.assert_close(weights[key], ref_weights[key], rtol=1e-4, atol=1e-4, msg=key)

    out = tmp_path / "disjoint"
    saved = load_dcp(out / "checkpoints" / "step_5")
    assert {k for k in saved if k.startswith("model.")} == ref_weights.keys()
    for key in ref_weights:
        assert f"optim.state.{key.removeprefix('model.')}.exp_avg" in saved, key
    # As if killed right after the checkpoint of step 5.
    shutil.rmtree(out / "final")
    shutil.rmtree(out / "checkpoints" / f"step_{STEPS}")
    (out / "done").unlink()
    (out / "checkpoints" / "latest").write_text("step_5")
    proc = train(4, tmp_path / "disjoint.yaml")
    assert "resumed from" in proc.stdout and "at step 5" in proc.stdout
    assert [(m["loss"], m["grad_norm"]) for m in read_metrics(out)] == trajectory
    resumed = load_dcp(out / "final")
    assert all(torch.equal(resumed[k], weights[k]) for k in weights)


def test_projector_only_stage_with_mixed_batches_under_ddp(reference):
    """Stage 1 (only the projector trains), plain data parallelism (parallel.mode ddp): a rank
    whose micro-batch has no image still runs the vision tower's collectives (no hang), and the
    result equals one process."""
    tmp_path, snapshot, _, _ = reference
    trainable = ["model.visual.merger.*", "model.visual.deepstack_merger_list.*"]
    one, one_weights = run_layout(tmp_path, snapshot, "stage1_one", 1, {"grad_accum_steps": 2, "trainable": trainable})
    two, two_weights = run_layout(
        tmp_path,
        snapshot,
        "stage1_ddp",
        2,
        {"grad_accum_steps": 1, "trainable": trainable, "parallel": {"mode": "ddp"}},
    )
    torch.testing.assert_close(torch.tensor(two), torch.tensor(one), rtol=1e-5, atol=1e-5)
    for key in one_weights:
        torch.testing.assert_close(two_weights[key], one_weights[key], rtol=1e-4, atol=1e-4, msg=key)


def test_hybrid_qwen3_5_under_fsdp_and_tp_matches_one_process(tmp_path):
    """Qwen3.5's Gated DeltaNet mixers split over heads (whole qkv and conv weights, partial
    gradients summed over the TP ranks) under FSDP x TP give the one-process run; so does the
    vision tower with its own layout on the same ranks (tp 2 over the language TP pairs, HSDP
    over the pairs: each pair computes its micro-batch's images once), and on ranks of its own
    (disjoint: ranks 0-1 the vision tower, 2-3 the language model)."""
    snapshot = tiny_snapshot("qwen3_5", tmp_path / "model")
    one, one_weights = run_layout(tmp_path, snapshot, "qwen3_5_one", 1, {"grad_accum_steps": 2})
    vision = {"tp": 2, "dp_replicate": 2}
    cases = [
        ("qwen3_5_dp2_tp2", {"tp": 2}),
        ("qwen3_5_dp2_tp2_vision_tp2_hsdp", {"tp": 2, "modules": {"vision": vision}}),
        ("qwen3_5_disjoint", {"modules": {"vision": {"ranks": [0, 2]}, "language": {"ranks": [2, 4]}}}),
    ]
    configs = [
        layout_config(tmp_path, snapshot, name, {"grad_accum_steps": 1, "parallel": parallel})
        for name, parallel in cases
    ]
    train_cases(4, configs, timeout=len(configs) * 300)  # the three runs in one launch
    for name, _ in cases:
        four, four_weights = read_layout(tmp_path, name)
        torch.testing.assert_close(torch.tensor(four), torch.tensor(one), rtol=1e-5, atol=1e-5, msg=name)
        linear = [key for key in one_weights if ".linear_attn." in key]
        assert len(linear) >= 9 * 3  # 9 tensors per mixer, 3 linear-attention layers
        for key in one_weights:
            torch.testing.assert_close(four_weights[key], one_weights[key], rtol=1e-4, atol=1e-4, msg=f"{name} {key}")


def test_compiled_blocks_under_tp_follow_the_eager_run(tmp_path):
    """Per-block torch.compile (the cluster recipes' setting) on the hybrid model under TP with
    sequence parallelism: graph breaks at the linear-attention kernel with DTensors around it;
    and with full activation checkpointing, where those layers compile inside the checkpoint, and
    selective, where they run eagerly and the attention layers compile as regions
    (parallel/compile.py). Inductor's fused kernels round differently in fp32 and Adam magnifies
    that in near-zero gradients, so the trajectories agree to 1e-3, not bit for bit."""
    snapshot = tiny_snapshot("qwen3_5", tmp_path / "model")
    cases = [
        ("eager", False, "none"),
        ("compiled", True, "none"),
        ("compiled_full", True, "full"),
        ("compiled_selective", True, "selective"),
    ]
    configs = [
        write_config(
            tmp_path / f"{name}.yaml",
            snapshot,
            tmp_path / name,
            steps=3,
            checkpoint={"enabled": False},
            parallel={"tp": 2, "compile": compiled, "activation_checkpointing": checkpointing},
        )
        for name, compiled, checkpointing in cases
    ]
    train_cases(2, configs, timeout=4 * 600)  # the four runs in one launch, 600 s each
    runs = {name: torch.tensor([m["loss"] for m in read_metrics(tmp_path / name)]) for name, _, _ in cases}
    assert len(runs["eager"]) == 3
    for name in ("compiled", "compiled_full", "compiled_selective"):
        torch.testing.assert_close(runs[name], runs["eager"], rtol=1e-3, atol=0, msg=name)


VIDEO_DATA = {
    "kind": "random",
    "seq_len": 96,
    "segments": 3,
    "image_fraction": 0.5,
    "video_fraction": 0.75,
    "video_frames": 2,
}


def test_video_rows_under_fsdp_tp_and_vision_tp_match_one_process(tmp_path):
    """Rows with videos (two frame groups each, DeepStack features at their tokens) and images:
    FSDP x TP 2 with the vision tower's own TP 2 on the same ranks, and a disjoint layout (the
    tower on two ranks of its own), each give the one-process run. Images and videos go through
    the tower in one pass, so its sharding is the images'."""
    from vlmcore.tiny import hf_config
    from vlmcore.train.random_data import RandomBatches

    data = RandomBatches(
        hf_config("qwen3_vl"),
        **{k: v for k, v in VIDEO_DATA.items() if k != "kind"},
        micro_batch_size=1,
        dp_rank=0,
        dp_world=1,
        grad_accum_steps=1,
        seed=0,
    )
    batches = [data.batch(i) for i in range(STEPS * 2)]
    assert any(b.videos is not None and b.images is not None for b in batches)
    assert any(b.videos is None for b in batches) and any(b.videos is not None for b in batches)

    snapshot = tiny_snapshot("qwen3_vl", tmp_path / "model")
    one, one_weights = run_layout(tmp_path, snapshot, "video_one", 1, {"grad_accum_steps": 2, "data": VIDEO_DATA})
    four, four_weights = run_layout(
        tmp_path,
        snapshot,
        "video_dp2_tp2_vision_tp2",
        4,
        {"grad_accum_steps": 1, "data": VIDEO_DATA, "parallel": {"tp": 2, "modules": {"vision": {"tp": 2}}}},
    )
    torch.testing.assert_close(torch.tensor(four), torch.tensor(one), rtol=1e-5, atol=1e-5)
    for key in one_weights:
        torch.testing.assert_close(four_weights[key], one_weights[key], rtol=1e-4, atol=1e-4, msg=key)
    # Disjoint layouts: two encoder ranks each encode one row's images and videos and send them to
    # the one language rank, which puts them in its model's order (all images, then all videos).
    three, three_weights = run_layout(
        tmp_path,
        snapshot,
        "video_disjoint",
        3,
        {
            "grad_accum_steps": 1,
            "micro_batch_size": 2,
            "data": VIDEO_DATA,
            "parallel": {"modules": {"vision": {"ranks": [0, 2]}, "language": {"ranks": [2, 3]}}},
        },
    )
    torch.testing.assert_close(torch.tensor(three), torch.tensor(one), rtol=1e-5, atol=1e-5)
    for key in one_weights:
        torch.testing.assert_close(three_weights[key], one_weights[key], rtol=1e-4, atol=1e-4, msg=key)
