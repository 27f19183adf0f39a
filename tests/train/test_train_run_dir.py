"""Checkpoints are resumed only by the run they belong to; other runs are moved aside, not lost."""

import yaml

from vlmcore.config import load_config, save_config
from vlmcore.train.run_dir import archive_stale_run, mark_done, mark_unfinished, stale_run_reason


def cfg_with(overrides):
    return load_config(None, ["model_path=m", "output_dir=o", "data_path=d", *overrides])


def write_run(out, cfg, step):
    (out / "checkpoints" / f"step_{step}").mkdir(parents=True)
    (out / "checkpoints" / "latest").write_text(f"step_{step}\n")
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    (out / "wandb").mkdir()
    (out / "wandb_run_id").write_text("abc12345")
    (out / "train.log").write_text("== vlmcore train_stage attempt ...\n")
    save_config(cfg, out / "config.yaml")


def test_interrupted_run_with_the_same_settings_resumes(tmp_path):
    cfg = cfg_with(["steps=100"])
    write_run(tmp_path, cfg, 50)
    assert stale_run_reason(tmp_path, cfg) is None
    longer = cfg_with(["steps=200", "checkpoint.interval=10"])
    assert stale_run_reason(tmp_path, longer) is None
    assert archive_stale_run(tmp_path, longer) is None and (tmp_path / "checkpoints/step_50").is_dir()


def test_another_layout_of_the_same_run_resumes(tmp_path):
    """The next job of a stage may get another number of GPUs: layout settings are not a new run
    (the data stream follows the global batch, tests/distributed/test_train_elastic.py)."""
    write_run(tmp_path, cfg_with(["steps=100"]), 50)
    other = cfg_with(
        [
            "steps=100",
            "parallel.tp=2",
            "micro_batch_size=2",
            "grad_accum_steps=4",
            "allow_global_batch_change=true",
            "parallel.compile=true",
        ]
    )
    assert stale_run_reason(tmp_path, other) is None


def test_finished_run_is_not_resumed_by_a_forced_rerun(tmp_path):
    cfg = cfg_with(["steps=60"])
    write_run(tmp_path, cfg, 60)
    reason = archive_stale_run(tmp_path, cfg)
    assert "already reached step 60" in reason
    assert not (tmp_path / "checkpoints").exists()
    assert (tmp_path / "previous/checkpoints/step_60").is_dir() and (tmp_path / "previous/metrics.jsonl").is_file()
    # the next run gets a W&B run of its own; the workflow's log of all attempts stays in place
    assert not (tmp_path / "wandb_run_id").exists() and (tmp_path / "previous/wandb_run_id").is_file()
    assert (tmp_path / "previous/wandb").is_dir() and (tmp_path / "train.log").is_file()


def test_changed_settings_start_a_new_run_and_name_what_changed(tmp_path):
    write_run(tmp_path, cfg_with(["steps=100"]), 50)
    changed = cfg_with(["steps=100", "optimizer.lr=0.5", "seed=3"])
    reason = stale_run_reason(tmp_path, changed)
    assert "optimizer" in reason and "seed" in reason
    archive_stale_run(tmp_path, changed)
    # a second archive replaces the first: only the latest earlier run is kept
    write_run(tmp_path, changed, 70)
    archive_stale_run(tmp_path, cfg_with(["steps=100", "seed=4"]))
    assert (tmp_path / "previous/checkpoints/step_70").is_dir()
    assert not (tmp_path / "previous/checkpoints/step_50").exists()


def test_run_that_crashed_after_its_last_checkpoint_is_finished_not_redone(tmp_path):
    cfg = cfg_with(["steps=60"])
    write_run(tmp_path, cfg, 60)
    mark_unfinished(tmp_path)  # the run never got to write done
    assert stale_run_reason(tmp_path, cfg) is None
    # ... unless it is asked to stop before the step it reached
    assert "already reached step 60 of 50" in stale_run_reason(tmp_path, cfg_with(["steps=50"]))
    mark_done(tmp_path)
    assert (tmp_path / "done").is_file() and "already reached step 60" in stale_run_reason(tmp_path, cfg)


def test_new_weights_in_the_same_blend_file_start_a_new_run(tmp_path):
    """A stage on a blend file (the workflow's train/<stage>/data_mix.yaml) keeps its data_path when
    its weights change, but its rows are others: the blend as the run read it (blend.yaml) tells,
    and the checkpoints are moved aside; the same weights resume."""
    from vlmcore.blend import RUN_RECORD, write_blend
    from vlmcore.train.run_dir import blend_record

    blend = tmp_path / "data_mix.yaml"
    write_blend(blend, [(tmp_path / "captions", 0.7), (tmp_path / "conversations", 0.3)])
    out = tmp_path / "run"
    cfg = cfg_with(["steps=100", f"data_path={blend}"])
    write_run(out, cfg, 50)
    (out / RUN_RECORD).write_text(yaml.safe_dump(blend_record(cfg)))
    assert stale_run_reason(out, cfg) is None
    write_blend(blend, [(tmp_path / "captions", 0.5), (tmp_path / "conversations", 0.5)])
    reason = archive_stale_run(out, cfg)
    assert reason == f"the blend of data_path changed since the checkpoints in {out} were written: starting a new run"
    assert (out / "previous/checkpoints/step_50").is_dir() and (out / "previous" / RUN_RECORD).is_file()
