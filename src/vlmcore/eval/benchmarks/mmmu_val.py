"""MMMU validation (900 questions, 30 subjects in 6 disciplines), as lmms-eval 0.7.3's mmmu_val
with its Qwen3-VL prompt (the `qwen3_vl` kwargs), scored by MMMU's rule: its parsing of a chosen
letter or an open answer (vlmcore.eval.benchmarks.answers), accuracy over all questions, per
discipline and per subject."""

import ast
import re
from collections import defaultdict

from PIL import Image

from vlmcore.eval.benchmarks.answers import mmmu_choice, mmmu_open_candidates, mmmu_open_is_correct, option_letters
from vlmcore.eval.benchmarks.benchmark import Benchmark
from vlmcore.eval.benchmarks.scoring import weighted_accuracy

# MMMU's 30 subjects in its 6 disciplines (the subject is the middle of a question id,
# "validation_Art_Theory_12").
DISCIPLINES = {
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


def options(doc: dict) -> list[str]:
    """MMMU stores a question's options as the text of a Python list."""
    return ast.literal_eval(doc["options"])


def subject(question_id: str) -> str:
    split = question_id.split("_")[0]
    prefix = split + "_"
    name, _, number = question_id[len(prefix) :].rpartition("_")
    if not question_id.startswith(prefix) or not name or not number.isdigit():
        raise ValueError(f"MMMU question id {question_id!r} is not <split>_<subject>_<number>")
    return name


def doc_to_text(doc: dict) -> str:
    """The question, its options lettered, an instruction (an open question lists no options)."""
    lettered = "\n".join(f"{letter}. {option}" for letter, option in zip(option_letters(99), options(doc)))
    if doc["question_type"] == "multiple-choice":
        instruction = "Answer with the option letter only."
    else:
        instruction = "Please select the correct answer from the options above."
    return f"Question: {doc['question']}\nOptions:\n{lettered}\n{instruction}"


def doc_to_visual(doc: dict) -> list[Image.Image]:
    """The images the question and its options refer to as `<image N>`, in name order."""
    text = doc["question"] + " " + " ".join(options(doc))
    names = sorted({tag.strip("<>").replace(" ", "_") for tag in re.findall(r"<image \d+>", text)})
    return [doc[name].convert("RGB") for name in names]


def record(doc: dict, response: str) -> dict:
    response = response.strip()
    if doc["question_type"] == "multiple-choice":
        parsed = mmmu_choice(response, options(doc))
        correct = parsed in doc["answer"] if isinstance(doc["answer"], list) else parsed == doc["answer"]
    else:
        parsed = mmmu_open_candidates(response)
        correct = mmmu_open_is_correct(doc["answer"], parsed)
    return {"id": doc["id"], "subject": subject(doc["id"]), "parsed": parsed, "correct": bool(correct)}


def scores(records: list[dict]) -> dict:
    """Accuracy over all questions, per discipline and per subject, rounded to 5 digits as MMMU does."""
    by_subject = defaultdict(list)
    for one in records:
        by_subject[one["subject"]].append(one["correct"])
    per_subject = {name: (sum(hits) / len(hits), len(hits)) for name, hits in by_subject.items()}
    breakdown = {}
    for discipline, subjects in DISCIPLINES.items():
        present = {name: per_subject[name] for name in subjects if name in per_subject}
        if present:
            count = sum(n for _, n in present.values())
            breakdown[f"discipline/{discipline}"] = (round(weighted_accuracy(present), 5), count)
    for name, (accuracy, n) in per_subject.items():
        breakdown[f"subject/{name}"] = (round(accuracy, 5), n)
    return {"score": round(weighted_accuracy(per_subject), 5), "breakdown": breakdown}


BENCHMARK = Benchmark(
    name="mmmu_val",
    hf_repo="lmms-lab-encoder/MMMU",
    split="validation",
    fields=("id", "question", "options", "answer", "question_type", "image_1"),
    doc_to_text=doc_to_text,
    doc_to_visual=doc_to_visual,
    record=record,
    scores=scores,
    metric="mmmu_acc",
)
