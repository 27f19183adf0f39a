"""Public benchmarks staged for offline evaluation: which repository files a benchmark reads,
the staged directory and its manifest, verification of a copy, and evaluation refusing to start
(before it loads the model) when a benchmark's staged data is missing or damaged.

The hub is not reachable here: a repository snapshot is a local directory laid out as the hub's
(dataset card, parquet files of real rows, a zip of media), which is what snapshot_download hands
to the staging in the real run."""

import dataclasses
import json
import zipfile

import pandas as pd
import pytest

from vlmcore import cli
from vlmcore.eval.benchmarks.registry import BENCHMARKS
from vlmcore.eval.staging import (
    check_staged,
    data_patterns,
    stage_snapshot,
    use_staged_benchmark,
    verify_benchmark,
)

# The dataset card of lmms-lab-encoder/MMMU's layout: one config, a parquet file pattern per split.
MMMU_CARD = """---
dataset_info:
  features:
  - name: id
    dtype: string
configs:
- config_name: default
  data_files:
  - split: dev
    path: data/dev-*
  - split: validation
    path: data/validation-*
  - split: test
    path: data/test-*
---
# MMMU
"""
# lmms-lab-encoder/DocVQA's layout: two configs, each with its own splits.
DOCVQA_CARD = """---
configs:
- config_name: DocVQA
  data_files:
  - split: validation
    path: DocVQA/validation-*
  - split: test
    path: DocVQA/test-*
- config_name: InfographicVQA
  data_files:
  - split: validation
    path: InfographicVQA/validation-*
---
"""
# OpenGVLab/MVBench's layout: a json file per task config, all in the train split, videos zipped.
MVBENCH_CARD = """---
configs:
- config_name: action_sequence
  data_files: json/action_sequence.json
  default: true
- config_name: object_shuffle
  data_files:
  - split: train
    path: json/object_shuffle.json
---
"""


def test_data_patterns_follow_the_dataset_card():
    assert data_patterns(BENCHMARKS["mmmu_val"], MMMU_CARD) == ["data/validation-*"]
    assert data_patterns(BENCHMARKS["docvqa_val"], DOCVQA_CARD) == ["DocVQA/validation-*"]
    # Without configs named, the card's default config.
    no_configs = dataclasses.replace(BENCHMARKS["mvbench"], configs=())
    assert data_patterns(no_configs, MVBENCH_CARD) == ["json/action_sequence.json"]
    # Configs named: each one's files.
    two_configs = dataclasses.replace(BENCHMARKS["mvbench"], configs=("object_shuffle", "action_sequence"))
    assert data_patterns(two_configs, MVBENCH_CARD) == ["json/object_shuffle.json", "json/action_sequence.json"]
    # No configs in the card: the hub's default layout, files named after their split.
    assert data_patterns(BENCHMARKS["chartqa"], "# ChartQA\n") == ["*test*"]


def test_a_config_or_split_the_card_lacks_is_named():
    with pytest.raises(ValueError, match=r"docvqa_val: configs \['DocVQA'\] are not in lmms-lab-encoder/DocVQA"):
        data_patterns(BENCHMARKS["docvqa_val"], MMMU_CARD)
    with pytest.raises(
        ValueError, match=r"config 'action_sequence' of lmms-lab-encoder/ChartQA has no split 'test' \(it has train\)"
    ):
        data_patterns(BENCHMARKS["chartqa"], MVBENCH_CARD)


def hub_snapshot(root):
    """A local stand-in for lmms-lab-encoder/MMMU at one commit: its card, real parquet files of each split,
    and a file the benchmark does not read."""
    root.mkdir(parents=True)
    (root / "README.md").write_text(MMMU_CARD)
    (root / "data").mkdir()
    for split, rows in (("dev", 2), ("validation", 3), ("test", 4)):
        frame = pd.DataFrame({"id": [f"{split}_{i}" for i in range(rows)], "answer": ["A"] * rows})
        frame.to_parquet(root / "data" / f"{split}-00000-of-00001.parquet")
    (root / "notes.txt").write_text("not data")
    return root


def staged_mmmu(tmp_path):
    snapshot = hub_snapshot(tmp_path / "hub")
    patterns = ["README.md", *data_patterns(BENCHMARKS["mmmu_val"], MMMU_CARD)]
    out = tmp_path / "benchmarks" / "mmmu_val"
    manifest = stage_snapshot(snapshot, out, BENCHMARKS["mmmu_val"], "c0ffee", patterns)
    return snapshot, out, manifest


def test_staged_benchmark_links_the_files_it_reads_with_their_checksums(tmp_path):
    snapshot, out, manifest = staged_mmmu(tmp_path)
    assert set(manifest["files"]) == {"README.md", "data/validation-00000-of-00001.parquet"}
    assert (manifest["repo_id"], manifest["revision"], manifest["benchmark"]) == (
        "lmms-lab-encoder/MMMU",
        "c0ffee",
        "mmmu_val",
    )
    assert manifest["split"] == "validation" and manifest["patterns"] == ["README.md", "data/validation-*"]
    assert json.loads((out / "manifest.json").read_text()) == manifest
    rows = pd.read_parquet(out / "data/validation-00000-of-00001.parquet")
    assert rows["id"].tolist() == ["validation_0", "validation_1", "validation_2"]
    # Links to the downloaded files (a cache shared by benchmarks), never copies.
    assert (out / "README.md").is_symlink() and (out / "README.md").resolve() == (snapshot / "README.md").resolve()
    assert verify_benchmark(out, "mmmu_val") == manifest
    # Staging again replaces the directory; the downloaded files stay.
    stage_snapshot(snapshot, out, BENCHMARKS["mmmu_val"], "c0ffee", manifest["patterns"])
    assert (snapshot / "README.md").is_file() and verify_benchmark(out, "mmmu_val")["revision"] == "c0ffee"


def test_a_pattern_that_selects_nothing_names_it(tmp_path):
    snapshot = hub_snapshot(tmp_path / "hub")
    with pytest.raises(ValueError, match=r"mvbench: no file of OpenGVLab/MVBench@c0ffee matches \['video/\*.zip'\]"):
        stage_snapshot(snapshot, tmp_path / "out", BENCHMARKS["mvbench"], "c0ffee", ["README.md", "video/*.zip"])
    assert not (tmp_path / "out").exists()


def test_both_video_mme_tasks_link_the_same_downloaded_videos(tmp_path):
    """videomme and videomme_w_subtitle read one repository: its videos are downloaded once (one
    hub cache) and linked into both; only the subtitle task has the subtitles."""
    snapshot = tmp_path / "hub"
    (snapshot / "videomme").mkdir(parents=True)
    pd.DataFrame({"videoID": ["a", "b"], "duration": ["short", "long"]}).to_parquet(
        snapshot / "videomme/test-00000-of-00001.parquet"
    )
    for name in ("videos_chunked_01.zip", "videos_chunked_02.zip", "subtitle.zip"):
        with zipfile.ZipFile(snapshot / name, "w") as archive:
            archive.writestr(f"{name}.txt", name)
    staged = {}
    for task in ("videomme", "videomme_w_subtitle"):
        benchmark = BENCHMARKS[task]
        patterns = ["videomme/test-*", *benchmark.media_files]
        staged[task] = stage_snapshot(snapshot, tmp_path / task, benchmark, "c0ffee", patterns)["files"]
    assert set(staged["videomme"]) == {
        "videomme/test-00000-of-00001.parquet",
        "videos_chunked_01.zip",
        "videos_chunked_02.zip",
    }
    assert set(staged["videomme_w_subtitle"]) == set(staged["videomme"]) | {"subtitle.zip"}
    for name in staged["videomme"]:
        assert (tmp_path / "videomme" / name).resolve() == (tmp_path / "videomme_w_subtitle" / name).resolve()
    with zipfile.ZipFile(tmp_path / "videomme_w_subtitle/subtitle.zip") as archive:
        assert archive.read("subtitle.zip.txt") == b"subtitle.zip"


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda d: (d / "data/validation-00000-of-00001.parquet").resolve().unlink(), "missing file data/validation"),
        (lambda d: (d / "README.md").resolve().write_text(MMMU_CARD + "x"), "README.md: size"),
        (
            lambda d: (d / "README.md").resolve().write_text(MMMU_CARD.replace("MMMU", "MMMV")),
            "README.md: sha256 differs",
        ),
        (lambda d: (d / "manifest.json").unlink(), "no staged data at .*mmmu_val \\(no manifest.json\\)"),
    ],
)
def test_damaged_staged_data_fails_naming_the_benchmark_and_the_rule(tmp_path, damage, message):
    _, out, _ = staged_mmmu(tmp_path)
    damage(out)
    with pytest.raises(ValueError, match=message) as err:
        check_staged(["demo_vqa", "mmmu_val"], tmp_path / "benchmarks")
    assert "benchmark mmmu_val" in str(err.value) and "`download_benchmark` rule" in str(err.value)


def test_demo_tasks_need_no_staged_data_and_benchmarks_need_the_directory(tmp_path):
    check_staged(["demo_vqa", "demo_vqa_gen"], None)
    with pytest.raises(ValueError, match="task chartqa reads staged data: give --benchmark-data DIR"):
        check_staged(["demo_vqa", "chartqa"], None)
    _, out, _ = staged_mmmu(tmp_path)
    (tmp_path / "elsewhere").mkdir()
    (out / "manifest.json").rename(tmp_path / "elsewhere/manifest.json")
    (tmp_path / "benchmarks/chartqa").mkdir()
    (tmp_path / "benchmarks/chartqa/manifest.json").write_text((tmp_path / "elsewhere/manifest.json").read_text())
    with pytest.raises(ValueError, match="manifest.json is of benchmark 'mmmu_val'"):
        check_staged(["chartqa"], tmp_path / "benchmarks")


def test_a_copy_staged_elsewhere_is_verified_and_linked(tmp_path):
    """MareNostrum 5: the copy made with `vlmcore stage-benchmark` on a machine with internet,
    rsynced in as real files, is verified and linked on the login node."""
    _, first, _ = staged_mmmu(tmp_path)
    copy = tmp_path / "rsynced" / "mmmu_val"
    copy.mkdir(parents=True)
    for rel in json.loads((first / "manifest.json").read_text())["files"]:
        (copy / rel).parent.mkdir(parents=True, exist_ok=True)
        (copy / rel).write_bytes((first / rel).read_bytes())
    (copy / "manifest.json").write_text((first / "manifest.json").read_text())

    out = tmp_path / "experiment" / "benchmarks" / "mmmu_val"
    assert cli.main(["stage-benchmark", "mmmu_val", "--staged", str(copy), "--out", str(out)]) == 0
    assert (out / "README.md").resolve() == (copy / "README.md").resolve()
    assert cli.main(["stage-benchmark", "mmmu_val", "--verify", str(out)]) == 0
    (copy / "README.md").write_text("changed")
    with pytest.raises(ValueError, match="README.md: size"):
        use_staged_benchmark(copy, tmp_path / "again", "mmmu_val")
    assert not (tmp_path / "again").exists()
    assert cli.main(["stage-benchmark", "mmmu_val"]) == 2  # --out is required


def test_eval_refuses_a_benchmark_without_staged_data_before_loading_the_model(tmp_path, capsys):
    """`vlmcore eval` with a benchmark task: the staged data is checked first, so a model whose
    weights would not even load is never touched."""
    from vlmcore.eval.runner import evaluate

    model = tmp_path / "hf"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "qwen3_vl", "vision_config": {}}))
    (model / "model.safetensors").write_bytes(b"not weights")
    (tmp_path / "benchmarks").mkdir()
    with pytest.raises(ValueError, match=r"benchmark chartqa: no staged data at .*chartqa .*`download_benchmark` rule"):
        evaluate(model, ["chartqa"], tmp_path / "eval", benchmark_data=tmp_path / "benchmarks")
    with pytest.raises(ValueError, match="task mmmu_val reads staged data"):
        evaluate(model, ["mmmu_val"], tmp_path / "eval")
    assert not (tmp_path / "eval").exists()
