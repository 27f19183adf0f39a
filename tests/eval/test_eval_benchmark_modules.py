"""One module per public benchmark (docs/evaluation.md, "Adding a benchmark"): every module of
vlmcore/eval/benchmarks/ is either shared by the benchmarks or one benchmark, named as its task,
whose record the registry collects; the lm-eval task files take every function from that record;
and the records are read without torch or `datasets` (the workflow's planning reads them)."""

import importlib
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest
from lm_eval.tasks._yaml_loader import load_yaml  # what lm-eval's TaskManager reads a task file with

from vlmcore.eval import benchmarks as package
from vlmcore.eval.benchmarks import registry
from vlmcore.eval.benchmarks.benchmark import Benchmark
from vlmcore.eval.benchmarks.registry import BENCHMARKS, SHARED_MODULES

TASK_FILES = Path(__file__).resolve().parents[2] / "src/vlmcore/eval/tasks/benchmarks"


def test_every_module_is_shared_or_one_benchmark_named_as_its_task():
    modules = {module.name for module in pkgutil.iter_modules(package.__path__)}
    assert set(SHARED_MODULES) <= modules
    assert sorted(BENCHMARKS) == sorted(modules - set(SHARED_MODULES))
    for name, benchmark in BENCHMARKS.items():
        module = importlib.import_module(f"vlmcore.eval.benchmarks.{name}")
        assert module.BENCHMARK is benchmark and benchmark.name == name
    for name in SHARED_MODULES:
        assert not hasattr(importlib.import_module(f"vlmcore.eval.benchmarks.{name}"), "BENCHMARK"), name


def test_a_module_without_its_record_is_refused_naming_it(monkeypatch):
    monkeypatch.setattr(registry, "benchmark_modules", lambda: ["scoring"])
    with pytest.raises(
        TypeError, match=r"scoring.py: a benchmark module defines BENCHMARK = Benchmark\(name='scoring'"
    ):
        registry.collect()


@pytest.mark.parametrize("task", sorted(BENCHMARKS))
def test_the_lm_eval_task_takes_its_functions_from_the_record(task):
    """lm-eval reads the YAML as it does for a run (its !function loader on utils.py)."""
    benchmark = BENCHMARKS[task]
    config = load_yaml(TASK_FILES / f"{task}.yaml")
    assert config["task"] == task and config["dataset_kwargs"] == {"task": task}
    assert config["doc_to_text"] is benchmark.doc_to_text
    assert config["doc_to_image"] is benchmark.doc_to_visual
    assert config["metric_list"][0]["metric"] == benchmark.metric
    assert config["process_results"].__qualname__.startswith("process_results_of")
    if not benchmark.answer_metrics:  # scored all at once: the record's aggregation
        assert config["metric_list"][0]["aggregation"].__qualname__.startswith("aggregation_of")
    else:  # scored per answer: lm-eval averages the record's metrics
        assert [m["metric"] for m in config["metric_list"]] == list(benchmark.answer_metrics)


def test_an_unknown_function_name_says_what_there_is():
    from vlmcore.eval.benchmarks.tasks import lm_eval_function

    with pytest.raises(AttributeError, match="no benchmark 'mmmu' .*mmmu_val"):
        lm_eval_function("mmmu__doc_to_text")
    with pytest.raises(AttributeError, match="doc_to_text, doc_to_visual, process_results, aggregate"):
        lm_eval_function("mmmu_val__doc_to_image")


def test_the_records_are_read_without_torch_or_datasets():
    code = (
        "import sys\n"
        "from vlmcore.eval.benchmarks.registry import BENCHMARKS\n"
        "print(len(BENCHMARKS), [m for m in ('torch', 'datasets', 'lm_eval', 'pyarrow') if m in sys.modules])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split(" ", 1) == [str(len(BENCHMARKS)), "[]\n"]
    assert all(isinstance(benchmark, Benchmark) for benchmark in BENCHMARKS.values())
