"""Scores of the public benchmarks from the model's answers, by each benchmark's official rule as
lmms-eval 0.7.3 implements it (tests/eval/test_eval_benchmarks_scoring.py feeds the same answers to
both and checks that the scores are identical).

Per benchmark, `<name>_record(doc, response)` reads one answer (the response stripped, as
lmms-eval strips it) into a record, and `<name>_scores(records)` gives the headline score and
its breakdowns: `{"score": float, "breakdown": {"<kind>/<value>": (score, n)}}`. Scores keep
lmms-eval's scale: fractions for MMMU, ChartQA and DocVQA, percentages for MMBench, Video-MME
and MVBench.
"""

import ast
import math
from collections import defaultdict
from collections.abc import Callable

from vlmcore.eval.benchmarks.answers import (
    mmbench_letter,
    mmmu_choice,
    mmmu_open_candidates,
    mmmu_open_is_correct,
    mvbench_normal_form,
    option_letters,
    ranked_letter,
)

# MMMU's 30 subjects in its 6 disciplines (the subject is the middle of a question id,
# "validation_Art_Theory_12").
MMMU_DISCIPLINES = {
    "Art and Design": ("Art", "Art_Theory", "Design", "Music"),
    "Business": ("Accounting", "Economics", "Finance", "Manage", "Marketing"),
    "Science": ("Biology", "Chemistry", "Geography", "Math", "Physics"),
    "Health and Medicine": (
        "Basic_Medical_Science",
        "Clinical_Medicine",
        "Diagnostics_and_Laboratory_Medicine",
        "Pharmacy",
        "Public_Health",
    ),
    "Humanities and Social Science": ("History", "Literature", "Sociology", "Psychology"),
    "Tech and Engineering": (
        "Agriculture",
        "Architecture_and_Engineering",
        "Computer_Science",
        "Electronics",
        "Energy_and_Power",
        "Materials",
        "Mechanical_Engineering",
    ),
}
VIDEOMME_DURATIONS = ("short", "medium", "long")
MMBENCH_CIRCULAR = 1_000_000  # MMBench's circular copies of question i have the indices i + k * 1e6


def mmmu_options(doc: dict) -> list[str]:
    """MMMU stores a question's options as the text of a Python list."""
    return ast.literal_eval(doc["options"])


def mmmu_subject(question_id: str) -> str:
    split = question_id.split("_")[0]
    prefix = split + "_"
    subject, _, number = question_id[len(prefix) :].rpartition("_")
    if not question_id.startswith(prefix) or not subject or not number.isdigit():
        raise ValueError(f"MMMU question id {question_id!r} is not <split>_<subject>_<number>")
    return subject


def mmmu_record(doc: dict, response: str) -> dict:
    response = response.strip()
    if doc["question_type"] == "multiple-choice":
        parsed = mmmu_choice(response, mmmu_options(doc))
        correct = parsed in doc["answer"] if isinstance(doc["answer"], list) else parsed == doc["answer"]
    else:
        parsed = mmmu_open_candidates(response)
        correct = mmmu_open_is_correct(doc["answer"], parsed)
    return {"id": doc["id"], "subject": mmmu_subject(doc["id"]), "parsed": parsed, "correct": bool(correct)}


def weighted_accuracy(per_group: dict[str, tuple[float, int]]) -> float:
    """The accuracy over all questions of some groups from each group's accuracy and size (as
    MMMU sums it: accuracy x count per group, over the total count)."""
    total = sum(n for _, n in per_group.values())
    if total == 0:
        return 0
    return sum(accuracy * n for accuracy, n in per_group.values()) / total


def mmmu_scores(records: list[dict]) -> dict:
    """Accuracy over all questions, per discipline and per subject, rounded to 5 digits as MMMU does."""
    by_subject = defaultdict(list)
    for record in records:
        by_subject[record["subject"]].append(record["correct"])
    per_subject = {subject: (sum(hits) / len(hits), len(hits)) for subject, hits in by_subject.items()}
    breakdown = {}
    for discipline, subjects in MMMU_DISCIPLINES.items():
        present = {subject: per_subject[subject] for subject in subjects if subject in per_subject}
        if present:
            count = sum(n for _, n in present.values())
            breakdown[f"discipline/{discipline}"] = (round(weighted_accuracy(present), 5), count)
    for subject, (accuracy, n) in per_subject.items():
        breakdown[f"subject/{subject}"] = (round(accuracy, 5), n)
    return {"score": round(weighted_accuracy(per_subject), 5), "breakdown": breakdown}


def as_number(text: str) -> float | None:
    """ChartQA's reading of a number: "12.5", "-3", "40%" (= 0.4); None for anything else."""
    try:
        if text.endswith("%"):
            return float(text.rstrip("%")) / 100.0
        return float(text)
    except ValueError:
        return None


def relaxed_correct(prediction: str, target: str, tolerance: float = 0.05) -> bool:
    """ChartQA's relaxed accuracy: a number within 5% of a (non-zero) numeric target, else the
    same text ignoring case."""
    predicted = as_number(prediction)
    expected = as_number(target)
    if predicted is not None and expected:
        return abs(predicted - expected) / abs(expected) <= tolerance
    return prediction.lower() == target.lower()


def chartqa_record(doc: dict, response: str) -> dict:
    """The relaxed score, and which split it counts in: human-written or augmented questions."""
    score = 1.0 if relaxed_correct(response.strip(), doc["answer"]) else 0.0
    split = "relaxed_human_split" if doc["type"] == "human_test" else "relaxed_augmented_split"
    return {"relaxed_overall": score, split: score}


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


def percent(hits: list[bool]) -> float:
    """100 x right / all, in that order of operations (the reference's rounding)."""
    return 100 * sum(hits) / len(hits)


def chartqa_scores(records: list[dict]) -> dict:
    breakdown = {}
    for split in ("relaxed_human_split", "relaxed_augmented_split"):
        values = [record[split] for record in records if split in record]
        if values:
            breakdown[f"split/{split.split('_')[1]}"] = (mean(values), len(values))
    return {"score": mean([record["relaxed_overall"] for record in records]), "breakdown": breakdown}


def edit_distance(a: str, b: str) -> int:
    """Levenshtein distance: insertions, deletions and substitutions of one character each."""
    previous = list(range(len(b) + 1))
    for i, char_a in enumerate(a, 1):
        current = [i]
        for j, char_b in enumerate(b, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (char_a != char_b)))
        previous = current
    return previous[-1]


def anls(answers: list[str], prediction: str, threshold: float = 0.5) -> float:
    """DocVQA's Average Normalized Levenshtein Similarity of one question: 1 - the smallest
    normalized edit distance to any accepted answer, 0 below `threshold`. The texts are compared
    lowercased with whitespace collapsed; the distance is normalized by the longer of the texts
    as given (DocVQA's reference rule, whitespace included)."""
    prediction_normal = " ".join(prediction.strip().lower().split())
    distances = []
    for answer in answers:
        answer_normal = " ".join(answer.strip().lower().split())
        length = max(len(answer.upper()), len(prediction.upper()))
        distances.append(0.0 if length == 0 else edit_distance(answer_normal, prediction_normal) / length)
    similarity = 1 - min(distances)
    return similarity if similarity >= threshold else 0


def docvqa_record(doc: dict, response: str) -> dict:
    return {"anls": anls(doc["answers"], response.strip())}


def docvqa_scores(records: list[dict]) -> dict:
    return {"score": mean([record["anls"] for record in records]), "breakdown": {}}


MMBENCH_OPTION_KEYS = ("A", "B", "C", "D", "E")


def is_missing(value: object) -> bool:
    """A missing MMBench field: None or NaN (pandas' isna of one value)."""
    return value is None or (isinstance(value, float) and math.isnan(value))


def mmbench_options(doc: dict) -> dict[str, str]:
    """The options a question shows (A-E, those present and not empty), in letter order."""
    return {key: doc[key] for key in MMBENCH_OPTION_KEYS if doc.get(key) and not is_missing(doc[key])}


def mmbench_record(doc: dict, response: str) -> dict:
    """What MMBench's scoring needs of one question: its index (circular copies share index mod
    1e6), answer, categories, the options A-D it can infer from, and the answer given."""
    return {
        "index": int(doc["index"]),
        "answer": doc["answer"],
        "category": doc["category"],
        "l2_category": doc["L2-category"],
        # An absent option field reads as the text "nan", a present but empty one as missing (MMBench's rule).
        "choices": {key: doc.get(key, "nan") for key in "ABCD" if not is_missing(doc.get(key, "nan"))},
        "prediction": response.strip(),
    }


def mmbench_question_correct(copies: list[dict]) -> int:
    """1 when every circular copy of a question is answered right (MMBench's CircularEval): first
    the letters the prefetch infers (one wrong: 0), then the ranked extraction for the rest."""
    inferred = [mmbench_letter(copy["prediction"], dict(copy["choices"])) for copy in copies]
    for copy, letter in zip(copies, inferred):
        if letter and letter != copy["answer"]:
            return 0
    for copy, letter in zip(copies, inferred):
        if letter:
            continue
        extracted = ranked_letter(copy["prediction"], sorted(copy["choices"]))
        if not extracted or extracted != copy["answer"]:
            return 0
    return 1


def mmbench_scores(records: list[dict]) -> dict:
    """Percent of questions (index < 1e6) right in all their circular copies; per category and L2 category."""
    records = sorted(records, key=lambda record: record["index"])
    copies = defaultdict(list)
    for record in records:
        copies[record["index"] % MMBENCH_CIRCULAR].append(record)
    main = [record for record in records if record["index"] < MMBENCH_CIRCULAR]
    hits = [mmbench_question_correct(copies[record["index"]]) for record in main]
    breakdown = {}
    for kind, key in (("category", "category"), ("l2_category", "l2_category")):
        groups = defaultdict(list)
        for record, hit in zip(main, hits):
            groups[record[key]].append(hit)
        for value, group_hits in sorted(groups.items()):
            breakdown[f"{kind}/{value}"] = (100 * mean(group_hits), len(group_hits))
    return {"score": 100 * mean(hits), "breakdown": breakdown}


def videomme_record(doc: dict, response: str) -> dict:
    """The letter of the answer (ranked extraction among A-D) and the question's duration and categories."""
    letter = ranked_letter(response.strip(), ["A", "B", "C", "D"])
    return {
        "question_id": doc["question_id"],
        "duration": doc["duration"],
        "domain": doc["domain"],
        "sub_category": doc["sub_category"],
        "task_type": doc["task_type"],
        "correct": letter == doc["answer"],
    }


def percent_by(records: list[dict], key: str, values: tuple[str, ...] | None = None) -> dict[str, tuple[float, int]]:
    """Percent correct of the records per value of `key` (in `values`' order when given)."""
    groups = defaultdict(list)
    for record in records:
        groups[record[key]].append(record["correct"])
    order = values if values is not None else sorted(groups)
    return {value: (percent(groups[value]), len(groups[value])) for value in order if groups.get(value)}


def videomme_scores(records: list[dict]) -> dict:
    """Percent correct overall and per duration, domain, sub-category and task type."""
    breakdown = {}
    for key, values in (
        ("duration", VIDEOMME_DURATIONS),
        ("domain", None),
        ("sub_category", None),
        ("task_type", None),
    ):
        for value, figures in percent_by(records, key, values).items():
            breakdown[f"{key}/{value}"] = figures
    return {"score": percent([record["correct"] for record in records]), "breakdown": breakdown}


def mvbench_record(doc: dict, response: str) -> dict:
    """Whether the answer names the right option (MVBench's comparison of normalized answers)."""
    response = response.strip()
    right_letter = option_letters(len(doc["candidates"]))[doc["candidates"].index(doc["answer"])]
    correct = mvbench_normal_form(response) == mvbench_normal_form(right_letter)
    return {"task": doc["task"], "answered": response != "", "correct": correct}


def mvbench_task_score(records: list[dict]) -> float:
    """Percent correct among the answered questions (an empty answer counts in neither)."""
    answered = [record["correct"] for record in records if record["answered"]]
    return 100 * sum(answered) / len(answered) if answered else 0


def mvbench_scores(records: list[dict]) -> dict:
    """Per task (MVBench's 20), and their mean: MVBench's average over tasks."""
    by_task = defaultdict(list)
    for record in records:
        by_task[record["task"]].append(record)
    breakdown = {f"task/{task}": (mvbench_task_score(rows), len(rows)) for task, rows in sorted(by_task.items())}
    return {"score": mean([score for score, _ in breakdown.values()]), "breakdown": breakdown}


# name in eval.tasks -> (its record of one answer, its scores of all records)
SCORERS: dict[str, tuple[Callable[[dict, str], dict], Callable[[list[dict]], dict]]] = {
    "mmmu_val": (mmmu_record, mmmu_scores),
    "chartqa": (chartqa_record, chartqa_scores),
    "docvqa_val": (docvqa_record, docvqa_scores),
    "mmbench_en_dev": (mmbench_record, mmbench_scores),
    "videomme": (videomme_record, videomme_scores),
    "videomme_w_subtitle": (videomme_record, videomme_scores),
    "mvbench": (mvbench_record, mvbench_scores),
}
