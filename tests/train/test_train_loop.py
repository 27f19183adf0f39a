"""`vlmcore train` end to end in one process (no torchrun): outputs, stage freezing, chaining
stages, activation checkpointing, non-finite steps, config errors."""

import json
import subprocess

import pytest
import torch
from helpers import command, env, load_dcp, read_metrics, train, write_config
from safetensors.torch import load_file, save_file

from vlmcore.tiny import tiny_snapshot

METRIC_KEYS = {
    "step",
    "loss",
    "grad_norm",
    "lr",
    "tokens",
    "tokens_per_s",
    "tokens_per_s_per_device",
    "tflops_per_device",
    "mfu",
    "llm_tflops_per_device",
    "vision_tflops_per_device",
    "peak_mem_gb",
    "data_wait_s",
    "step_time_s",
    "world_size",
    "skipped_steps",
}
PROJECTOR = ["model.visual.merger.*", "model.visual.deepstack_merger_list.*"]


@pytest.fixture(scope="module")
def snapshots(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {kind: tiny_snapshot(kind, root / kind) for kind in ("qwen3", "qwen3_vl", "qwen3_5")}


@pytest.fixture(scope="module")
def stage1(snapshots, tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("stage1")
    out = tmp_path / "out"
    cfg = write_config(
        tmp_path / "stage1.yaml",
        snapshots["qwen3_vl"],
        out,
        steps=3,
        trainable=PROJECTOR,
        metrics={"tensorboard": True},
        checkpoint={"interval": 2, "keep": 1},
    )
    proc = train(1, cfg)
    return cfg, out, proc


def test_stage_outputs(stage1, snapshots):
    cfg, out, proc = stage1
    assert (out / "done").exists() and (out / "config.yaml").exists()
    assert any((out / "tensorboard").iterdir())
    metrics = read_metrics(out)
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert all(m.keys() >= METRIC_KEYS for m in metrics)
    assert all(m["world_size"] == 1 and m["skipped_steps"] == 0 and m["tokens_per_s"] > 0 for m in metrics)
    assert metrics[-1]["tokens"] == 3 * 32 and metrics[0]["llm_tflops_per_device"] > 0
    assert metrics[0]["mfu"] is None  # no peak FLOPS known for a CPU
    # per-module times (metrics.module_times, on by default), also on the console line
    assert all(m["vision_time_s"] > 0 and m["llm_time_s"] > 0 and m["vision_patches"] > 0 for m in metrics)
    assert all(m["vision_time_s"] + m["llm_time_s"] < m["step_time_s"] for m in metrics)
    assert "step 3 loss" in proc.stdout and "s llm " in proc.stdout
    meta = json.loads((out / "final" / "meta.json").read_text())
    assert meta["step"] == 3 and meta["tokens"] == 96 and meta["model_path"] == str(snapshots["qwen3_vl"])
    assert meta["stage_config"]["trainable"] == PROJECTOR
    assert (out / "checkpoints" / "latest").read_text() == "step_3"
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["latest", "step_3"]


def test_only_the_trainable_patterns_change(stage1, snapshots):
    _, out, _ = stage1
    initial = load_file(snapshots["qwen3_vl"] / "model.safetensors")
    final = load_dcp(out / "final")
    assert set(final) >= {f"model.{k}" for k in initial}
    changed = {k for k, v in initial.items() if not torch.equal(final[f"model.{k}"], v)}
    assert changed and all(
        k.startswith(("model.visual.merger.", "model.visual.deepstack_merger_list.")) for k in changed
    )
    assert any(k.startswith("model.visual.deepstack_merger_list.") for k in changed)


def test_next_stage_starts_from_final(stage1, snapshots, tmp_path):
    _, out1, _ = stage1
    out2 = tmp_path / "stage2"
    cfg = write_config(
        tmp_path / "stage2.yaml",
        snapshots["qwen3_vl"],
        out2,
        steps=1,
        init_from=str(out1 / "final"),
        optimizer={"lr": 0.0},
    )
    train(1, cfg)
    before, after = load_dcp(out1 / "final"), load_dcp(out2 / "final")
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_5"])
def test_text_and_hybrid_families_train(snapshots, tmp_path, kind):
    out = tmp_path / kind
    train(
        1,
        write_config(
            tmp_path / "c.yaml", snapshots[kind], out, steps=2, save_final=False, checkpoint={"enabled": False}
        ),
    )
    metrics = read_metrics(out)
    assert len(metrics) == 2 and all(torch.isfinite(torch.tensor(m["loss"])) for m in metrics)
    # a text model has no vision tower to time; Qwen3.5's is timed like Qwen3-VL's
    assert all(
        m["llm_time_s"] > 0 and (m["vision_time_s"] > 0 if kind == "qwen3_5" else "vision_time_s" not in m)
        for m in metrics
    )
    assert (out / "done").exists() and not (out / "final").exists() and not (out / "checkpoints").exists()


@pytest.mark.slow
def test_activation_checkpointing_gives_the_same_run(snapshots, tmp_path):
    losses = {}
    for mode in ("none", "full", "selective"):
        out = tmp_path / mode
        train(
            1,
            write_config(
                tmp_path / f"{mode}.yaml",
                snapshots["qwen3"],
                out,
                steps=2,
                save_final=False,
                checkpoint={"enabled": False},
                parallel={"activation_checkpointing": mode},
            ),
        )
        losses[mode] = [(m["loss"], m["grad_norm"]) for m in read_metrics(out)]
    assert losses["full"] == losses["none"] and losses["selective"] == losses["none"]


def test_non_finite_steps_are_skipped_then_the_run_stops(snapshots, tmp_path):
    model = tmp_path / "nan_model"
    model.mkdir()
    for f in snapshots["qwen3"].iterdir():
        (model / f.name).write_bytes(f.read_bytes())
    weights = load_file(model / "model.safetensors")
    weights["model.norm.weight"][0] = float("nan")
    save_file(weights, model / "model.safetensors")
    out = tmp_path / "out"
    proc = train(1, write_config(tmp_path / "c.yaml", model, out, steps=10, max_nonfinite_steps=3), check=False)
    assert proc.returncode == 1
    assert "3 steps in a row with a non-finite loss" in proc.stderr
    assert [m["skipped_steps"] for m in read_metrics(out)] == [1, 2, 3]
    assert (out / "checkpoints" / "latest").read_text() == "step_3" and not (out / "done").exists()


@pytest.mark.parametrize(
    "override, message",
    [
        ("parallel.tp=3", "parallel: dp_replicate (1) x dp_shard (-1) x tp (3) does not fit the world size 1"),
        ("trainable=[model.vision.*]", "trainable: pattern(s) ['model.vision.*'] match no parameter"),
        ("optimizer.lr=fast", "optimizer.lr: expected a number"),
    ],
)
def test_bad_config_is_a_clear_error(snapshots, tmp_path, capsys, override, message):
    from vlmcore.cli import main

    cfg = write_config(tmp_path / "c.yaml", snapshots["qwen3"], tmp_path / "out", steps=1)
    assert main(["train", str(cfg), "--set", override]) == 2
    err = capsys.readouterr().err
    assert f"error: {cfg}: {message}" in err
    assert not (tmp_path / "out").exists()  # refused before anything is written


def wandb_history(run_file):
    """{step: {key: value}} from an offline run's `.wandb` file: a 7-byte W&B header, then
    LevelDB-log records (32 KiB blocks; 7-byte record headers: crc, length, type 1 full /
    2 first / 3 middle / 4 last) of `wandb_internal_pb2.Record` protobufs."""
    from wandb.proto import wandb_internal_pb2

    data = run_file.read_bytes()
    assert data[:4] == b":W&B", run_file
    pos, chunks, history = 7, b"", {}
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        chunks += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunks)
            chunks = b""
            if record.WhichOneof("record_type") == "history":
                items = {
                    item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item
                }
                history[items.pop("_step")] = items
    return history


def test_wandb_offline_run_holds_the_metrics_and_no_secrets(snapshots, tmp_path):
    """metrics.wandb: an offline W&B run next to metrics.jsonl (nodes have no internet) with
    every step's metrics; tokens from the environment never reach the output directory."""
    out = tmp_path / "out"
    cfg = write_config(tmp_path / "wandb.yaml", snapshots["qwen3"], out, steps=3, metrics={"wandb": True})
    secrets = {"HF_TOKEN": "hf_vlmcoreSecretToken123", "WANDB_API_KEY": "0123456789abcdef0123456789abcdef01234567"}
    environment = {k: v for k, v in env().items() if not k.startswith("WANDB_")} | secrets
    proc = subprocess.run(command(1, "train", str(cfg)), capture_output=True, text=True, timeout=300, env=environment)
    assert proc.returncode == 0, proc.stderr[-5000:]

    [run_dir] = (out / "wandb").glob("offline-run-*")
    run_id = (out / "wandb_run_id").read_text()
    history = wandb_history(run_dir / f"run-{run_id}.wandb")
    metrics = read_metrics(out)
    assert sorted(history) == [m["step"] for m in metrics] == [1, 2, 3]
    for m in metrics:
        assert history[m["step"]]["train/loss"] == pytest.approx(m["loss"])
        assert history[m["step"]]["train/lr"] == pytest.approx(m["lr"])
    for path in [p for p in out.rglob("*") if p.is_file()]:
        data = path.read_bytes()
        assert not any(secret.encode() in data for secret in secrets.values()), path
    assert not any(secret in proc.stdout + proc.stderr for secret in secrets.values())
