"""ChartQA test (human-written and augmented questions), as lmms-eval 0.7.3's chartqa: relaxed
accuracy of each answer, overall and per split."""

from PIL import Image

from vlmcore.eval.benchmarks.benchmark import Benchmark
from vlmcore.eval.benchmarks.scoring import mean

SPLITS = ("relaxed_human_split", "relaxed_augmented_split")


def doc_to_text(doc: dict) -> str:
    return f"{doc['question']}\nAnswer the question with a single word."


def doc_to_visual(doc: dict) -> list[Image.Image]:
    return [doc["image"].convert("RGB")]


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


def record(doc: dict, response: str) -> dict:
    """The relaxed score, and which split it counts in: human-written or augmented questions."""
    score = 1.0 if relaxed_correct(response.strip(), doc["answer"]) else 0.0
    split = "relaxed_human_split" if doc["type"] == "human_test" else "relaxed_augmented_split"
    return {"relaxed_overall": score, split: score}


def scores(records: list[dict]) -> dict:
    breakdown = {}
    for split in SPLITS:
        values = [one[split] for one in records if split in one]
        if values:
            breakdown[f"split/{split.split('_')[1]}"] = (mean(values), len(values))
    return {"score": mean([one["relaxed_overall"] for one in records]), "breakdown": breakdown}


BENCHMARK = Benchmark(
    name="chartqa",
    hf_repo="lmms-lab-encoder/ChartQA",
    split="test",
    fields=("question", "answer", "type", "image"),
    doc_to_text=doc_to_text,
    doc_to_visual=doc_to_visual,
    record=record,
    scores=scores,
    metric="relaxed_overall",
    answer_metrics=("relaxed_overall", *SPLITS),
)
