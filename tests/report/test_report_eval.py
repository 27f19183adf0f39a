"""The report's evaluation section: each task's score per exported stage (the workflow's
eval/<stage>/<task>/results.json files), with its chance level and the reference model's published
score, as a table, a plot across stages and eval.csv. Results are written with known figures so
every number can be checked."""

import dataclasses
import json
from pathlib import Path

import pandas as pd
import pytest
from PIL import Image

from vlmcore import cli
from vlmcore.eval.benchmarks import registry
from vlmcore.report.evaluation import gather_runs, result_files, scores_by_run


def write_results(path: Path, task: str, metrics: dict, n: int, chance: float | None = None, breakdown=None) -> None:
    """A results.json as `vlmcore eval` writes it (lm-eval's keys "<metric>,<filter>")."""
    path.mkdir(parents=True, exist_ok=True)
    result = {
        "results": {task: {"alias": task, **{f"{m},none": v for m, v in metrics.items()}}},
        "n-samples": {task: {"original": n, "effective": n}},
        "chance": {task: chance} if chance is not None else {},
        "breakdown": {task: breakdown} if breakdown else {},
    }
    (path / "results.json").write_text(json.dumps(result))


@pytest.fixture
def stages(tmp_path):
    """Two exported stages, each evaluated on the demo task, ChartQA and Video-MME."""
    for stage, scale in (("stage1", 0.5), ("stage2", 1.0)):
        eval_dir = tmp_path / "eval" / stage
        kinds = {"color": {"metric": "acc", "value": 0.9 * scale, "chance": 1 / 6, "n": 100}}
        write_results(eval_dir / "demo_vqa", "demo_vqa", {"acc": 0.8 * scale, "acc_stderr": 0.02}, 300, 0.333, kinds)
        write_results(eval_dir / "chartqa", "chartqa", {"relaxed_accuracy": 0.6 * scale}, 2500)
        durations = {
            d: {"metric": "acc", "value": v * scale, "chance": None, "n": 900}
            for d, v in (("short", 0.7), ("long", 0.5))
        }
        write_results(eval_dir / "videomme", "videomme", {"acc": 0.6 * scale}, 2700, breakdown=durations)
    return tmp_path


@pytest.fixture
def published(monkeypatch):
    """Video-MME with a published score (model cards give percentages)."""
    videomme = dataclasses.replace(registry.BENCHMARKS["videomme"], published={"Qwen3-VL-8B-Instruct": 71.4})
    monkeypatch.setitem(registry.BENCHMARKS, "videomme", videomme)


def test_a_stage_directory_holds_one_results_file_per_task(stages):
    files = result_files(stages / "eval/stage1")
    assert [f.parent.name for f in files] == ["chartqa", "demo_vqa", "videomme"]
    assert result_files(stages / "eval/stage1/chartqa") == [stages / "eval/stage1/chartqa"]
    with pytest.raises(ValueError, match="no eval results"):
        result_files(stages / "eval")


def test_eval_csv_has_one_row_per_stage_task_subset_and_metric(stages, published):
    table = gather_runs({"stage1": stages / "eval/stage1", "stage2": stages / "eval/stage2"})
    assert not table.duplicated(["run", "task", "subset", "metric", "filter"]).any()
    assert set(table["run"]) == {"stage1", "stage2"}
    rows = table.set_index(["run", "task", "subset", "metric"])
    assert rows.loc[("stage2", "videomme", "long", "acc"), "value"] == pytest.approx(0.5)
    assert rows.loc[("stage1", "chartqa", "", "relaxed_accuracy"), "value"] == pytest.approx(0.3)
    # The chance level: the results' own (multiple choice), else the registry's; the published
    # score on the task's main score, on the 0..1 scale.
    assert rows.loc[("stage1", "demo_vqa", "", "acc"), "chance"] == pytest.approx(0.333)
    assert rows.loc[("stage1", "videomme", "", "acc"), "chance"] == pytest.approx(0.25)
    assert rows.loc[("stage1", "videomme", "", "acc"), "published"] == pytest.approx(0.714)
    assert pd.isna(rows.loc[("stage1", "videomme", "short", "acc"), "published"])
    assert pd.isna(rows.loc[("stage1", "chartqa", "", "relaxed_accuracy"), "chance"])

    scores = scores_by_run(table).set_index(["task", "subset"])
    assert scores.loc[("videomme", ""), ["stage1", "stage2"]].tolist() == pytest.approx([0.3, 0.6])
    assert scores.loc[("demo_vqa", "color"), "metric"] == "acc" and "acc_stderr" not in set(scores["metric"])


def test_report_shows_each_task_per_stage_with_chance_and_published(stages, published, tmp_path):
    out = tmp_path / "report"
    args = ["report", "--eval", f"stage1={stages / 'eval/stage1'}", "--eval", f"stage2={stages / 'eval/stage2'}"]
    assert cli.main([*args, "--out", str(out)]) == 0
    md = (out / "SCALABILITY.md").read_text()
    assert "| task | subset | metric | stage1 | stage2 | chance | published (reference model) |" in md
    assert "| videomme |  | acc | 0.300 | 0.600 | 0.250 | 0.714 |" in md
    assert "| chartqa |  | relaxed_accuracy | 0.300 | 0.600 | n/a | n/a |" in md
    assert "| demo_vqa | color | acc | 0.450 | 0.900 | 0.167 | n/a |" in md
    assert "(plots/eval_summary.png)" in md
    assert pd.read_csv(out / "eval.csv")["run"].unique().tolist() == ["stage1", "stage2"]
    with Image.open(out / "plots/eval_summary.png") as image:
        assert image.format == "PNG" and image.width >= 800 and image.height >= 500


def test_a_benchmarks_main_score_is_its_records_headline_metric_on_a_0_to_1_scale(tmp_path):
    """Video-MME's results as `vlmcore eval` writes them (lmms-eval's percentages, another score
    beside the headline): the report shows videomme_perception_score, divided by its record's scale."""
    durations = {"duration/short": {"metric": "videomme_perception_score", "value": 70.0, "chance": None, "n": 900}}
    metrics = {"videomme_perception_score": 60.0, "exact_match": 0.1}
    write_results(tmp_path / "eval/stage1/videomme", "videomme", metrics, 2700, breakdown=durations)
    table = gather_runs({"stage1": tmp_path / "eval/stage1"})
    rows = table.set_index(["task", "subset", "metric"])
    assert rows.loc[("videomme", "", "videomme_perception_score"), "value"] == pytest.approx(60.0)  # eval.csv: as given
    assert rows.loc[("videomme", "", "videomme_perception_score"), "chance"] == pytest.approx(0.25)
    scores = scores_by_run(table).set_index(["task", "subset"])
    assert scores.loc[("videomme", ""), "metric"] == "videomme_perception_score"
    assert scores.loc[("videomme", ""), "stage1"] == pytest.approx(0.6)
    assert scores.loc[("videomme", "duration/short"), "stage1"] == pytest.approx(0.7)
