"""MMBench English dev with CircularEval, scored offline as lmms-eval 0.7.3's mmbench_en_dev_static
(lmms-eval's mmbench_en_dev asks GPT to match answers it cannot read; compute nodes are offline):
a question counts when every circular copy of it is answered right, overall, per category and
per L2 category."""

import math
from collections import defaultdict

from PIL import Image

from vlmcore.eval.benchmarks.answers import mmbench_letter, ranked_letter
from vlmcore.eval.benchmarks.benchmark import Benchmark
from vlmcore.eval.benchmarks.scoring import mean

CIRCULAR = 1_000_000  # MMBench's circular copies of question i have the indices i + k * 1e6
OPTION_KEYS = ("A", "B", "C", "D", "E")


def is_missing(value: object) -> bool:
    """A missing MMBench field: None or NaN (pandas' isna of one value)."""
    return value is None or (isinstance(value, float) and math.isnan(value))


def options(doc: dict) -> dict[str, str]:
    """The options a question shows (A-E, those present and not empty), in letter order."""
    return {key: doc[key] for key in OPTION_KEYS if doc.get(key) and not is_missing(doc[key])}


def is_shown(value: object) -> bool:
    """MMBench shows a hint or an option unless it is missing or the text "nan"."""
    return value is not None and value == value and value != "nan"


def doc_to_text(doc: dict) -> str:
    """The hint (if any), the question, "There are several options:" with the options lettered,
    and the instruction to answer with the letter."""
    lettered = "\n".join(f"{key}. {text}" for key, text in options(doc).items() if is_shown(text))
    query = f"{doc['question']} There are several options:\n{lettered}"
    if is_shown(doc["hint"]):
        query = f"{doc['hint']} {query}"
    return f"{query}\nAnswer with the option's letter from the given choices directly."


def doc_to_visual(doc: dict) -> list[Image.Image]:
    return [doc["image"].convert("RGB")]


def record(doc: dict, response: str) -> dict:
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


def question_correct(copies: list[dict]) -> int:
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


def scores(records: list[dict]) -> dict:
    """Percent of questions (index < 1e6) right in all their circular copies; per category and L2 category."""
    records = sorted(records, key=lambda one: one["index"])
    copies = defaultdict(list)
    for one in records:
        copies[one["index"] % CIRCULAR].append(one)
    main = [one for one in records if one["index"] < CIRCULAR]
    hits = [question_correct(copies[one["index"]]) for one in main]
    breakdown = {}
    for kind in ("category", "l2_category"):
        groups = defaultdict(list)
        for one, hit in zip(main, hits):
            groups[one[kind]].append(hit)
        for value, group_hits in sorted(groups.items()):
            breakdown[f"{kind}/{value}"] = (100 * mean(group_hits), len(group_hits))
    return {"score": 100 * mean(hits), "breakdown": breakdown}


BENCHMARK = Benchmark(
    name="mmbench_en_dev",
    hf_repo="lmms-lab-encoder/MMBench",
    split="dev",
    configs=("en",),
    fields=("index", "question", "hint", "answer", "A", "B", "C", "D", "category", "L2-category", "image"),
    doc_to_text=doc_to_text,
    doc_to_visual=doc_to_visual,
    record=record,
    scores=scores,
    metric="mmbench_acc",
    scale=100.0,
)
