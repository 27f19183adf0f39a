"""The public benchmarks that `eval.tasks` can name: the `BENCHMARK` record of every benchmark
module of this package (`<name>.py`, named as its task), collected by name.

Adding a benchmark is adding its module (docs/evaluation.md, "Adding a benchmark"): nothing here
or elsewhere lists the benchmarks. The modules of this package that are not benchmarks hold what
several benchmarks share.
"""

import importlib
import pkgutil

from vlmcore.eval import benchmarks as package
from vlmcore.eval.benchmarks.benchmark import Benchmark

# The package's modules that hold what the benchmarks share; every other module is one benchmark.
SHARED_MODULES = ("answers", "benchmark", "data", "registry", "scoring", "tasks")


def benchmark_modules() -> list[str]:
    """The names of the package's benchmark modules, in name order."""
    names = sorted(module.name for module in pkgutil.iter_modules(package.__path__))
    return [name for name in names if name not in SHARED_MODULES]


def collect() -> dict[str, Benchmark]:
    """{task name: record} of every benchmark module; raises naming a module whose record is
    missing or named otherwise (the module's name is its task's)."""
    found = {}
    for name in benchmark_modules():
        module = importlib.import_module(f"{package.__name__}.{name}")
        record = getattr(module, "BENCHMARK", None)
        if not isinstance(record, Benchmark) or record.name != name:
            raise TypeError(
                f"{module.__file__}: a benchmark module defines BENCHMARK = Benchmark(name={name!r}, ...) "
                f"(modules shared by the benchmarks are named in {__name__}.SHARED_MODULES)"
            )
        found[name] = record
    return found


BENCHMARKS: dict[str, Benchmark] = collect()
