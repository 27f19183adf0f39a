"""The arithmetic the benchmarks' scores share, in the order of operations of their reference
rules (lmms-eval 0.7.3's; the rounding of a score depends on it). Each benchmark's own record of
an answer and its scores are in its module (`mmmu_val.py`, ...); tests/eval/test_eval_benchmarks_scoring.py
feeds the same answers to them and to lmms-eval and checks that the scores are identical."""

from collections import defaultdict


def weighted_accuracy(per_group: dict[str, tuple[float, int]]) -> float:
    """The accuracy over all questions of some groups from each group's accuracy and size (as
    MMMU sums it: accuracy x count per group, over the total count)."""
    total = sum(n for _, n in per_group.values())
    if total == 0:
        return 0
    return sum(accuracy * n for accuracy, n in per_group.values()) / total


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


def percent(hits: list[bool]) -> float:
    """100 x right / all, in that order of operations (the reference's rounding)."""
    return 100 * sum(hits) / len(hits)


def percent_by(records: list[dict], key: str, values: tuple[str, ...] | None = None) -> dict[str, tuple[float, int]]:
    """Percent correct of the records per value of `key` (in `values`' order when given)."""
    groups = defaultdict(list)
    for record in records:
        groups[record[key]].append(record["correct"])
    order = values if values is not None else sorted(groups)
    return {value: (percent(groups[value]), len(groups[value])) for value in order if groups.get(value)}
