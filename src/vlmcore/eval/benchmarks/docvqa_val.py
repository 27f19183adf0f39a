"""DocVQA validation, as lmms-eval 0.7.3's docvqa_val: the ANLS of each answer (Average Normalized
Levenshtein Similarity to the closest accepted answer), averaged."""

from PIL import Image

from vlmcore.eval.benchmarks.benchmark import Benchmark
from vlmcore.eval.benchmarks.scoring import mean


def doc_to_text(doc: dict) -> str:
    return f"{doc['question']}\nAnswer the question using a single word or phrase."


def doc_to_visual(doc: dict) -> list[Image.Image]:
    return [doc["image"].convert("RGB")]


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


def record(doc: dict, response: str) -> dict:
    return {"anls": anls(doc["answers"], response.strip())}


def scores(records: list[dict]) -> dict:
    return {"score": mean([one["anls"] for one in records]), "breakdown": {}}


BENCHMARK = Benchmark(
    name="docvqa_val",
    hf_repo="lmms-lab-encoder/DocVQA",
    split="validation",
    configs=("DocVQA",),
    fields=("questionId", "question", "answers", "image"),
    doc_to_text=doc_to_text,
    doc_to_visual=doc_to_visual,
    record=record,
    scores=scores,
    metric="anls",
    answer_metrics=("anls",),
)
