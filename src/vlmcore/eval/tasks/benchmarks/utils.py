"""The public benchmarks' lm-eval functions, named in the YAML files beside this one as
`utils.<task>__<function>` (`utils.mmmu_val__doc_to_text`): each is the one of the benchmark's
record (vlmcore/eval/benchmarks/<task>.py), found through the registry."""

from vlmcore.eval.benchmarks.tasks import lm_eval_function, load  # noqa: F401 (load: the YAMLs' custom_dataset)


def __getattr__(name: str):
    return lm_eval_function(name)
