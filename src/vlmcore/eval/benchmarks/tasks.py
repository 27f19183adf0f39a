"""The public benchmarks as lm-eval tasks (their YAML files are in vlmcore/eval/tasks/benchmarks/):
each task's questions read from its staged data, and its functions (prompt, media, per-sample
metrics, aggregation) taken from its benchmark's record in the registry.

Prompts (lmms-eval 0.7.3's task YAMLs; the `qwen3_vl` variant where the task has one, as
lmms-eval's Qwen3-VL model uses it): docs/evaluation.md lists them with the generation length,
the frame sampling and the image resolution.
"""

from collections.abc import Callable

import datasets

from vlmcore.eval.benchmarks.benchmark import Benchmark
from vlmcore.eval.benchmarks.data import BadBenchmarkData, read_split, staged_dir
from vlmcore.eval.benchmarks.registry import BENCHMARKS


def load(benchmark_data: str | None = None, task: str = "", **_metadata: object) -> datasets.DatasetDict:
    """The questions of `task` from `<benchmark_data>/<task>/` (lm-eval's custom_dataset)."""
    benchmark = BENCHMARKS[task]
    directory = staged_dir(benchmark_data, benchmark)
    rows = benchmark.questions(directory) if benchmark.questions else read_split(directory, benchmark)
    if len(rows) == 0:
        raise BadBenchmarkData(f"{task}: no questions under {directory}")
    return datasets.DatasetDict({"test": rows})


def process_results_of(benchmark: Benchmark) -> Callable[[dict, list[str]], dict]:
    """lm-eval's process_results of a task: the metrics of its (first) answer."""

    def process_results(doc: dict, results: list[str]) -> dict:
        return benchmark.process_results(doc, results[0])

    return process_results


def aggregation_of(benchmark: Benchmark) -> Callable[[list[dict]], float]:
    """lm-eval's aggregation of a task's headline metric: the benchmark's score of all records."""

    def aggregate(records: list[dict]) -> float:
        return benchmark.scores(records)["score"]

    return aggregate


def lm_eval_function(name: str) -> Callable:
    """The function a task's YAML names `utils.<task>__<function>`: the benchmark's doc_to_text,
    doc_to_visual, process_results or aggregate (lm-eval finds it as an attribute of utils.py)."""
    task, _, function = name.partition("__")
    if task not in BENCHMARKS:
        raise AttributeError(f"{name}: no benchmark {task!r} (the benchmarks are {', '.join(BENCHMARKS)})")
    benchmark = BENCHMARKS[task]
    functions = {
        "doc_to_text": benchmark.doc_to_text,
        "doc_to_visual": benchmark.doc_to_visual,
        "process_results": process_results_of(benchmark),
        "aggregate": aggregation_of(benchmark),
    }
    if function not in functions:
        raise AttributeError(f"{name}: a benchmark's lm-eval functions are {', '.join(functions)}")
    return functions[function]
