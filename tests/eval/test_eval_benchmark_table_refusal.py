"""`vlmcore eval` of a staged benchmark whose question table lacks a field the benchmark reads:
refused as one line naming the task, the directory and the missing fields, exit code 2, before
the model loads (its weights here are not even valid safetensors) and with nothing written."""

import datasets
from PIL import Image

from vlmcore import cli
from vlmcore.eval.benchmarks.registry import BENCHMARKS
from vlmcore.eval.staging import stage_snapshot


def test_a_benchmark_table_without_a_field_is_refused_before_the_model_loads(tmp_path, capsys):
    from helpers import tiny_hf_snapshot as tiny_snapshot

    model = tiny_snapshot("qwen3_vl", tmp_path / "model")
    (model / "model.safetensors").write_text("not weights")
    # DocVQA's table without its questionId and answers, staged as the login-node rule stages it.
    repository = tmp_path / "hub/docvqa_val"
    (repository / "DocVQA").mkdir(parents=True)
    features = datasets.Features({"question": datasets.Value("string"), "image": datasets.Image()})
    rows = {"question": ["what is written?"], "image": [Image.new("RGB", (32, 32))]}
    datasets.Dataset.from_dict(rows, features=features).to_parquet(
        repository / "DocVQA/validation-00000-of-00001.parquet"
    )
    benchmarks = tmp_path / "benchmarks"
    stage_snapshot(repository, benchmarks / "docvqa_val", BENCHMARKS["docvqa_val"], "local", patterns=["*"])

    out = tmp_path / "eval"
    argv = ["eval", "--model", str(model), "--tasks", "docvqa_val", "--benchmark-data", str(benchmarks)]
    capsys.readouterr()
    assert cli.main([*argv, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    assert err.strip().splitlines()[-1] == (
        f"vlmcore eval: error: docvqa_val: the questions under {benchmarks / 'docvqa_val'} have no field "
        "questionId, answers (they have question, image); is this the lmms-lab-encoder/DocVQA data? (see --help)"
    )
    assert not out.exists()
