"""`vlmcore report`: scaling table arithmetic, imports from runs done elsewhere, plots and
SCALABILITY.md. Metrics files are written with known figures so every number can be checked."""

import json
from pathlib import Path

import pandas as pd
import pytest
from PIL import Image

from vlmcore import cli
from vlmcore.report.tables import import_points, read_metrics, scaling_table, summarize_point
from vlmcore.train.metrics_log import format_line


def write_metrics(path: Path, world_size: int, per_device: list[float], mem: list[float], mfu=None, moe=None) -> Path:
    """One line per step with the keys training writes; step 1 is the warm-up. `moe`: per-step
    (aux loss, load imbalance) of a mixture-of-experts model."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = []
    for step, (tps, gb) in enumerate(zip(per_device, mem), 1):
        lines.append(
            json.dumps(
                {
                    "step": step,
                    "loss": 5.0 / step,
                    "grad_norm": 1.0 + step / 10,
                    "lr": 1e-3 * min(1.0, step / 3),
                    "tokens": 1000 * step * world_size,
                    "tokens_per_s": tps * world_size,
                    "tokens_per_s_per_device": tps,
                    "tflops_per_device": tps * 1e-3,
                    "mfu": mfu,
                    "llm_tflops_per_device": tps * 0.8e-3,
                    "vision_tflops_per_device": tps * 0.2e-3,
                    "peak_mem_gb": gb,
                    "data_wait_s": 0.01,
                    "step_time_s": 1000 / tps,
                    "world_size": world_size,
                    "skipped_steps": 0,
                    **({"moe_aux_loss": moe[step - 1][0], "moe_load_imbalance": moe[step - 1][1]} if moe else {}),
                }
            )
        )
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture
def runs(tmp_path):
    write_metrics(tmp_path / "scaling/ws1/metrics.jsonl", 1, [10, 1000, 1000, 1000], [1.0, 2.0, 2.5, 2.0])
    write_metrics(tmp_path / "scaling/ws2/metrics.jsonl", 2, [10, 900, 800, 700], [1.0, 2.2, 2.6, 2.1])
    (tmp_path / "scaling/ws2/config.yaml").write_text(
        "parallel: {dp_shard: -1, tp: 1}\nmicro_batch_size: 2\nseq_len: 1024\n"
    )
    return tmp_path


def test_points_skip_warmup_and_efficiency_is_per_device(runs):
    points = [summarize_point(read_metrics(runs / f"scaling/ws{n}"), f"ws{n}", "x", warmup_steps=1) for n in (2, 1)]
    table = scaling_table(points)
    assert table["world_size"].tolist() == [1, 2]
    assert table["tokens_per_s_per_device"].tolist() == [1000, 800]
    assert table["peak_mem_gb"].tolist() == [2.5, 2.6]
    assert table["efficiency"].tolist() == pytest.approx([1.0, 0.8])
    assert table["speedup"].tolist() == pytest.approx([1.0, 1.6])
    assert table["tokens_per_s"].tolist() == pytest.approx([1000, 1600])
    assert table["mfu"].isna().all()  # CPU runs: no peak FLOPS known
    with_warmup = summarize_point(read_metrics(runs / "scaling/ws1"), "ws1", "x", warmup_steps=0)
    assert with_warmup["tokens_per_s_per_device"] == pytest.approx(752.5)


def test_imports_from_runs_done_elsewhere(runs, tmp_path):
    for n, per_device in [(16, 15000), (64, 14000), (256, 12000)]:
        write_metrics(tmp_path / f"cluster/job-{n}gpus/metrics.jsonl", n, [100] + [per_device] * 5, [60] * 6, mfu=40.0)
    points = import_points(tmp_path / "cluster", warmup_steps=1)
    assert sorted(p["world_size"] for p in points) == [16, 64, 256]
    assert {p["label"] for p in points} == {"job-16gpus", "job-64gpus", "job-256gpus"}
    table = scaling_table(points)
    assert table["efficiency"].tolist() == pytest.approx([1.0, 14 / 15, 12 / 15])
    # A scaling.csv written by another report imports back unchanged (efficiency recomputed on the merged set).
    table.to_csv(tmp_path / "other.csv", index=False)
    again = scaling_table(import_points(tmp_path / "other.csv", warmup_steps=1))
    pd.testing.assert_frame_equal(again, table)
    with pytest.raises(ValueError, match=r"same label \['job-16gpus'\]"):
        scaling_table(points + import_points(tmp_path / "cluster/job-16gpus", warmup_steps=1))
    (tmp_path / "bad.csv").write_text("devices,throughput\n4,100\n")
    with pytest.raises(ValueError, match=r"bad.csv: missing columns \['world_size', 'tokens_per_s_per_device'\]"):
        import_points(tmp_path / "bad.csv", warmup_steps=1)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no metrics.jsonl below"):
        import_points(tmp_path / "empty", warmup_steps=1)


def test_bad_metrics_name_the_file_and_line(tmp_path):
    path = write_metrics(tmp_path / "m/metrics.jsonl", 1, [1, 2], [1, 1])
    path.write_text(path.read_text() + "{not json\n")
    with pytest.raises(ValueError, match=r"metrics.jsonl:3: not JSON"):
        read_metrics(path)
    short = write_metrics(tmp_path / "s/metrics.jsonl", 1, [1], [1])
    with pytest.raises(ValueError, match="all within the 1 warm-up steps"):
        summarize_point(read_metrics(short), "s", str(short), warmup_steps=1)


def test_full_report_through_the_cli(runs, tmp_path):
    train = {}
    for stage, steps in [("stage1", 30), ("stage2", 60)]:
        train[stage] = write_metrics(tmp_path / f"train/{stage}/metrics.jsonl", 2, [500] * steps, [1.5] * steps)
    (tmp_path / "train/stage1/config.yaml").write_text("steps: 30\noptimizer: {lr: 0.002}\n")
    eval_dir = tmp_path / "results/demo/eval"
    eval_dir.mkdir(parents=True)
    (eval_dir / "results.json").write_text(
        json.dumps(
            {
                "results": {
                    "demo_vqa": {"alias": "demo_vqa", "acc,none": 0.8, "acc_stderr,none": 0.02, "acc_norm,none": 0.75}
                },
                "n-samples": {"demo_vqa": {"original": 300, "effective": 300}},
                "chance": {"demo_vqa": 0.333},
                "breakdown": {"demo_vqa": {"color": {"metric": "acc", "value": 0.7, "chance": 1 / 6, "n": 100}}},
            }
        )
    )
    out = tmp_path / "report"
    args = [
        "report",
        "--scaling",
        f"ws1={runs / 'scaling/ws1/metrics.jsonl'}",
        "--scaling",
        f"ws2={runs / 'scaling/ws2'}",
        "--train",
        f"stage1={train['stage1']}",
        "--train",
        f"stage2={train['stage2']}",
        "--eval",
        str(eval_dir / "results.json"),
        "--hardware",
        "2-core CPU (gloo), no GPU",
        "--out",
        str(out),
    ]
    assert cli.main(args) == 0

    table = pd.read_csv(out / "scaling.csv")
    assert table["world_size"].tolist() == [1, 2] and table["efficiency"].tolist() == pytest.approx([1.0, 0.8])
    assert pd.read_csv(out / "eval.csv")["run"].unique().tolist() == ["demo"]
    assert pd.read_csv(out / "training.csv")["steps"].tolist() == [30, 60]
    pngs = {p.name for p in (out / "plots").glob("*.png")}
    assert pngs == {
        "scaling_throughput.png",
        "scaling_efficiency.png",
        "scaling_flops.png",
        "scaling_memory.png",
        "training_curves.png",
        "eval_summary.png",
    }
    for name in pngs:
        with Image.open(out / "plots" / name) as image:
            assert image.format == "PNG" and image.width >= 800 and image.height >= 500
    md = (out / "SCALABILITY.md").read_text()
    assert "2-core CPU (gloo), no GPU" in md
    assert all(f"(plots/{name})" in md for name in pngs)
    assert "| 2 | ws2 | 1×2×1, micro-batch 2 | 1,600 | 800 |" in md and "80%" in md
    assert "seq_len: 1024" in md and "lr: 0.002" in md  # exact settings of the runs


def test_moe_stages_report_aux_loss_and_load_imbalance(tmp_path):
    """Only MoE stages have the two fields; the means are over the last 10 steps."""
    moe = [(0.02, 3.0)] * 5 + [(0.01 + i * 0.001, 1.5 + i * 0.1) for i in range(10)]
    train = {
        "dense": write_metrics(tmp_path / "dense/metrics.jsonl", 2, [500] * 15, [1.0] * 15),
        "moe": write_metrics(tmp_path / "moe/metrics.jsonl", 2, [500] * 15, [1.0] * 15, moe=moe),
    }
    out = tmp_path / "report"
    assert cli.main(["report", *[f"--train={k}={v}" for k, v in train.items()], "--out", str(out)]) == 0
    table = pd.read_csv(out / "training.csv").set_index("stage")
    assert table.loc["moe", "moe_aux_loss"] == pytest.approx(0.0145)
    assert table.loc["moe", "moe_load_imbalance"] == pytest.approx(1.95)
    assert table.loc["dense"].isna()[["moe_aux_loss", "moe_load_imbalance"]].all()
    md = (out / "SCALABILITY.md").read_text()
    assert "MoE aux loss (mean of last 10) | expert load imbalance, max/mean (mean of last 10) |" in md
    assert "| 0.0145 | 1.95 |" in md and "| n/a | n/a |" in md

    # A dense-only report has no MoE columns.
    assert cli.main(["report", f"--train=dense={train['dense']}", "--out", str(tmp_path / "dense_report")]) == 0
    assert "moe_aux_loss" not in pd.read_csv(tmp_path / "dense_report/training.csv")
    assert "MoE" not in (tmp_path / "dense_report/SCALABILITY.md").read_text()


def test_console_line_shows_moe_fields_only_for_moe_models(tmp_path):
    records = [
        json.loads(line)
        for line in write_metrics(tmp_path / "m.jsonl", 1, [500], [1.0], moe=[(0.0123, 1.87)]).read_text().splitlines()
    ]
    assert format_line(records[0]).endswith(" aux 0.0123 imbalance 1.87")
    dense = json.loads(write_metrics(tmp_path / "d.jsonl", 1, [500], [1.0]).read_text())
    assert "aux" not in format_line(dense) and "imbalance" not in format_line(dense)


def test_report_recommends_a_per_module_layout(tmp_path):
    """A stage whose metrics carry module times gets a table of candidate layouts at its world
    size, built from the measured means after the warm-up and the cost model; one without
    (or whose model is gone) gets none, or a line saying why."""
    from vlmcore.report.layouts import Cluster, compare, workload_of
    from vlmcore.tiny import hf_config

    model = tmp_path / "model"
    hf_config("qwen3_vl").save_pretrained(model)
    train = {}
    for stage, model_path in [("stage1", model), ("stage2", tmp_path / "gone")]:
        path = write_metrics(tmp_path / f"train/{stage}/metrics.jsonl", 4, [500] * 4, [1.5] * 4)
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        for row, (vision, llm, patches) in zip(
            rows, [(9.0, 9.0, 1), (0.1, 0.3, 100), (0.3, 0.5, 300), (0.2, 0.4, 200)]
        ):
            row.update(vision_time_s=vision, llm_time_s=llm, vision_patches=patches)
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        (path.parent / "config.yaml").write_text(
            f"model_path: {model_path}\ngrad_accum_steps: 2\nparallel: {{tp: 1}}\n"
        )
        train[stage] = path
    text_only = write_metrics(tmp_path / "train/stage3/metrics.jsonl", 4, [500] * 4, [1.5] * 4)
    out = tmp_path / "report"
    assert (
        cli.main(
            [
                "report",
                *(a for s, p in [*train.items(), ("stage3", text_only)] for a in ("--train", f"{s}={p}")),
                "--out",
                str(out),
            ]
        )
        == 0
    )

    # Means after the warm-up step: 0.2 s vision, 0.4 s LLM, 200 patches per rank; 4 ranks.
    expected = compare(
        workload_of(hf_config("qwen3_vl"), vision_s=0.8, llm_s=1.6, patches=800, micro_batches=2), Cluster(), world=4
    )
    table = pd.read_csv(out / "layouts.csv")
    assert set(table["stage"]) == {"stage1"} and (table["world_size"] == 4).all()
    assert table["layout"].tolist() == [p.layout for p in expected]
    assert table["step_s"].tolist() == pytest.approx([p.step_s for p in expected])
    assert (
        "colocated, vision TP 1" in table["layout"].tolist()
        and "disjoint, 2 vision + 2 LLM ranks" in table["layout"].tolist()
    )
    md = (out / "SCALABILITY.md").read_text()
    assert "## Per-module layouts" in md and "### Stage `stage1` at 4 devices" in md
    assert "vision tower 0.200 s, LLM 0.400 s (33% vision), 800 patches per step" in md
    assert f"Recommended: **{expected[0].layout}**, predicted {expected[0].step_s:.3f} s per step" in md
    assert f"Stage `stage2`: no prediction, no model config ({tmp_path / 'gone'}: no config.json)." in md
    assert "stage3" not in md.split("## Per-module layouts")[1].split("## Exact settings")[0]
