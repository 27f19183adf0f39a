"""Our benchmark scoring gives the reference's scores: the same model answers go through
vlmcore.eval.benchmarks and through lmms-eval 0.7.3's task code (its pure scoring functions,
imported as they are: lmms-eval is installed with --no-deps, see .ci/run), and every per-answer
score, headline score and breakdown must be identical.

The answers are the hard cases of free-text output: extra words, lowercase letters, numbers with
% and thousands commas, option letters in parentheses, letters inside words, no option at all.
"""

import random
import re

import pytest
from lmms_eval.api.metrics import anls as reference_anls
from lmms_eval.tasks._task_utils.mcq_extract import extract_mcq_answer
from lmms_eval.tasks.chartqa import utils as chartqa_reference
from lmms_eval.tasks.mmbench.mmbench_evals import MMBench_Evaluator
from lmms_eval.tasks.mmmu import utils as mmmu_reference
from lmms_eval.tasks.mvbench import utils as mvbench_reference
from lmms_eval.tasks.videomme import utils as videomme_reference
from loguru import logger

from vlmcore.eval.benchmarks import answers, chartqa, docvqa_val, mmbench_en_dev, mmmu_val, mvbench, videomme

LETTER_ANSWERS = [
    "B",
    "b",
    "(C)",
    "(c) because the chart shows it",
    "The answer is D.",
    "the correct answer is c",
    "Answer: A",
    "A. red circle",
    "B) blue",
    "I think it is option B, not C.",
    "A man is standing next to the car",
    "C is right; A is wrong",
    "The best option is (B).",
    "none of these",
    "",
    "   D   ",
    "D.",
    "ABC",
    "Dog",
    "E",
    "Options A and B are both plausible, but D fits best",
    "答案是B",
    "42",
    "'C'",
    '"A"',
    "(A) (B)",
    "red circle",
    "The object is a red circle on the left",
]


@pytest.mark.parametrize("letters", [None, ["A", "B", "C", "D"], ["A", "B", "C"]])
def test_ranked_letter_equals_lmms_eval_extraction(letters):
    for text in LETTER_ANSWERS:
        assert answers.ranked_letter(text, letters) == extract_mcq_answer(text, choices=letters), text


def test_mmbench_letter_equals_can_infer():
    evaluator = MMBench_Evaluator()
    choices = {"A": "red circle", "B": "blue square", "C": "green triangle", "D": "nan"}
    for text in LETTER_ANSWERS + ["A B", "it is a blue square", "Failed to obtain answer via API", "(B).", ":C"]:
        expected = evaluator.can_infer(text, dict(choices))
        assert (answers.mmbench_letter(text, dict(choices)) or False) == expected, text


def test_mvbench_normal_form_equals_mcq_acc():
    for text in LETTER_ANSWERS + ["(B) walking.", "b. the man", "a, b", "1,000 people.", "x/y", "A.\nmore"]:
        for letter in "ABCDE":
            expected = mvbench_reference.mcq_acc(letter, text)
            ours = answers.mvbench_normal_form(text) == answers.mvbench_normal_form(letter)
            assert ours == bool(expected), (letter, text)


MMMU_DOCS = [
    # (id, question type, options, answer, responses)
    ("validation_Art_Theory_1", "multiple-choice", ["oil", "tempera", "fresco", "gouache"], "B", None),
    ("validation_Art_Theory_2", "multiple-choice", ["1,000", "2,000", "3,000"], "C", None),
    ("validation_Math_3", "multiple-choice", ["x = 1", "x = 2", "x = 3", "x = 4"], "A", None),
    ("validation_Math_4", "open", [], "3000", None),
    ("validation_Math_5", "open", [], "12.5", None),
    ("validation_Finance_6", "open", [], "Paris", None),
    ("validation_Finance_7", "open", [], "b", None),
    ("validation_Clinical_Medicine_8", "multiple-choice", ["aspirin", "ibuprofen", "placebo"], "C", None),
]
MMMU_RESPONSES = [
    "B",
    "(c)",
    "The answer is x = 1 because the slope is one and nothing else fits here",
    "So the result is 3,000.",
    "Thus x = 12.5%",
    "the capital is paris",
    "b",
    "I am not sure",
]


def mmmu_doc(doc_id: str, question_type: str, options: list[str], answer: str) -> dict:
    return {"id": doc_id, "question_type": question_type, "options": str(options), "answer": answer}


def test_mmmu_scores_equal_reference(capsys):
    docs = [mmmu_doc(*row[:4]) for row in MMMU_DOCS]
    for shift in range(len(MMMU_RESPONSES)):
        responses = MMMU_RESPONSES[shift:] + MMMU_RESPONSES[:shift]
        ours = []
        theirs = []
        for seed, (doc, response) in enumerate(zip(docs, responses)):
            # A response naming no option gets a random letter in both: the same seed, the same draw.
            random.seed(seed)
            theirs.append(mmmu_reference.mmmu_process_results(doc, [response.strip()])["mmmu_acc"])
            random.seed(seed)
            ours.append(mmmu_val.record(doc, response))
        for mine, reference in zip(ours, theirs):
            assert mine["parsed"] == reference["parsed_pred"][0] or set(mine["parsed"]) == set(
                reference["parsed_pred"][0]
            )
        capsys.readouterr()
        overall = mmmu_reference.mmmu_aggregate_results(theirs)
        printed = eval(capsys.readouterr().out.strip().splitlines()[-1])  # noqa: S307 (the reference prints a dict literal)
        result = mmmu_val.scores(ours)
        assert result["score"] == overall
        for discipline, subjects in mmmu_val.DISCIPLINES.items():
            if any(f"subject/{s}" in result["breakdown"] for s in subjects):
                reference = printed[f"Overall-{discipline}"]
                assert result["breakdown"][f"discipline/{discipline}"] == (reference["acc"], reference["num"])
        for key, (accuracy, n) in result["breakdown"].items():
            if key.startswith("subject/"):
                assert (accuracy, n) == (printed[key.split("/")[1]]["acc"], printed[key.split("/")[1]]["num"])


CHART_CASES = [
    ("12", "12"),
    ("12.5", "12"),
    ("12.7", "12"),
    ("40%", "0.4"),
    ("0.41", "41%"),
    ("1,000", "1000"),
    ("Yes", "yes"),
    ("The answer is 12", "12"),
    ("0", "0"),
    ("0.0", "0"),
    ("-5", "-5.2"),
    ("  17  ", "17"),
    ("Blue", "blue "),
]


def test_chartqa_scores_equal_reference():
    docs = [
        {"answer": target, "type": "human_test" if i % 2 else "augmented_test"}
        for i, (_, target) in enumerate(CHART_CASES)
    ]
    ours = []
    theirs = []
    for doc, (response, _) in zip(docs, CHART_CASES):
        ours.append(chartqa.record(doc, response))
        theirs.append(chartqa_reference.chartqa_process_results(doc, [response.strip()]))
    assert ours == theirs
    result = chartqa.scores(ours)
    assert result["score"] == sum(r["relaxed_overall"] for r in theirs) / len(theirs)
    human = [r["relaxed_human_split"] for r in theirs if "relaxed_human_split" in r]
    augmented = [r["relaxed_augmented_split"] for r in theirs if "relaxed_augmented_split" in r]
    assert result["breakdown"]["split/human"] == (sum(human) / len(human), len(human))
    assert result["breakdown"]["split/augmented"] == (sum(augmented) / len(augmented), len(augmented))
    assert 0 < result["score"] < 1


DOC_CASES = [
    (["$1,250.00", "1250"], "$1,250.00"),
    (["$1,250.00"], "1250"),
    (["Acme Corp."], "acme corp"),
    (["Acme Corp."], "ACME   Corporation"),
    (["march 3, 1998", "3/3/98"], "March 3 1998"),
    (["Dr. Smith"], "The author is Dr. Smith"),
    (["  spaced  answer "], "spaced answer"),
    (["x"], ""),
    (["Straße"], "strasse"),
    (["42"], "forty-two"),
]


def test_docvqa_anls_equals_reference():
    values = []
    for answers_, response in DOC_CASES:
        ours = docvqa_val.record({"answers": answers_}, response)["anls"]
        assert ours == reference_anls(references=answers_, predictions=[response.strip()])["anls"], (answers_, response)
        values.append(ours)
    assert 0 < docvqa_val.scores([{"anls": v} for v in values])["score"] < 1


def mmbench_docs() -> list[dict]:
    """Two questions with their circular copies (index + k * 1e6), one with three options."""
    rows = []
    questions = [
        (0, ["red circle", "blue square", "green triangle", "yellow star"], "A", "color", "perception"),
        (1, ["cat", "dog", "bird", None], "B", "animal", "reasoning"),
        (2, ["one", "two", "three", "four"], "D", "count", "perception"),
    ]
    for index, options, answer, category, l2 in questions:
        count = sum(o is not None for o in options)
        for shift in range(count):
            rotated = options[shift:count] + options[:shift]
            letter = "ABCD"[rotated.index(options["ABCD".index(answer)])]
            rows.append(
                {
                    "index": index + shift * mmbench_en_dev.CIRCULAR,
                    "question": f"question {index}?",
                    "hint": None,
                    "answer": letter,
                    "A": rotated[0],
                    "B": rotated[1],
                    "C": rotated[2],
                    "D": rotated[3] if count == 4 else None,
                    "category": category,
                    "L2-category": l2,
                    "source": "test",
                    "split": "dev",
                }
            )
    return rows


def test_mmbench_scores_equal_reference():
    from lmms_eval.tasks.mmbench import en_utils

    docs = mmbench_docs()
    rng = random.Random(0)
    evaluator = MMBench_Evaluator(sys_prompt="There are several options:")
    for trial in range(30):
        responses = []
        for doc in docs:
            right = doc["answer"]
            choice = rng.choice([right, right, "A", "B", "C", "D"])
            text = doc.get(choice) or "something"
            responses.append(
                rng.choice(
                    [choice, f"({choice.lower()})", f"The answer is {choice}.", text, f"I pick {choice}", "no idea"]
                )
            )
        theirs = [
            en_utils.mmbench_process_results(doc, [r.strip()])["gpt_eval_score"] for doc, r in zip(docs, responses)
        ]
        overall, category, l2_category = evaluator.eval_result(theirs, eval_method="static")
        ours = mmbench_en_dev.scores([mmbench_en_dev.record(doc, r) for doc, r in zip(docs, responses)])
        assert ours["score"] == overall * 100, trial
        for name, value in category.items():
            assert ours["breakdown"][f"category/{name}"][0] == 100 * value
        for name, value in l2_category.items():
            assert ours["breakdown"][f"l2_category/{name}"][0] == 100 * value


VIDEOMME_DOCS = [
    ("short", "Knowledge", "Humanity & History", "Counting Problem"),
    ("short", "Sports Competition", "Football", "Action Recognition"),
    ("medium", "Knowledge", "Astronomy", "Counting Problem"),
    ("medium", "Life Record", "Food", "OCR Problems"),
    ("long", "Multilingual", "Multilingual", "Information Synopsis"),
    ("long", "Film & Television", "Documentary", "Temporal Reasoning"),
]


def test_videomme_scores_and_breakdowns_equal_reference():
    docs = [
        {
            "question_id": f"{i:03d}-1",
            "videoID": f"v{i}",
            "duration": duration,
            "domain": domain,
            "sub_category": sub_category,
            "task_type": task_type,
            "answer": "ABCD"[i % 4],
        }
        for i, (duration, domain, sub_category, task_type) in enumerate(VIDEOMME_DOCS)
    ]
    lines = []
    sink = logger.add(lines.append, format="{message}")
    try:
        for shift in range(len(LETTER_ANSWERS) - len(docs)):
            responses = LETTER_ANSWERS[shift : shift + len(docs)]
            theirs = [
                videomme_reference.videomme_process_results(d, [r.strip()])["videomme_perception_score"]
                for d, r in zip(docs, responses)
            ]
            ours = [videomme.record(d, r) for d, r in zip(docs, responses)]
            lines.clear()
            overall = videomme_reference.videomme_aggregate_results(theirs)
            result = videomme.scores(ours)
            assert result["score"] == overall
            logged = {}
            for line in lines:
                match = re.match(r"Evaluation on ([^:]+): (.+):\s+([\d.]+)%", line.strip())
                if match:
                    logged[(match.group(1), match.group(2))] = float(match.group(3))
            kinds = {
                "duration": "video Type",
                "domain": "Categories",
                "sub_category": "Video Sub Categories",
                "task_type": "Task Categories",
            }
            for key, (value, _) in result["breakdown"].items():
                kind, name = key.split("/", 1)
                assert round(value, 1) == logged[(kinds[kind], name)], key
    finally:
        logger.remove(sink)


def test_mvbench_scores_equal_reference():
    tasks = ["action_antonym", "object_shuffle"]
    candidates = [["walking", "running", "sitting"], ["left", "right", "middle", "nowhere"]]
    docs = [
        {"task": tasks[i % 2], "candidates": candidates[i % 2], "answer": candidates[i % 2][i % 3], "question": "q"}
        for i in range(10)
    ]
    responses = ["(A) walking", "B", "c", "(B) right.", "", "A.", "Option C", "running", "b. right", "(a)"]
    ours = [mvbench.record(doc, r) for doc, r in zip(docs, responses)]
    result = mvbench.scores(ours)
    reference_scores = []
    for task in tasks:
        rows = [
            mvbench_reference.mvbench_process_results(doc, [r.strip()])["mvbench_accuracy"]
            for doc, r in zip(docs, responses)
            if doc["task"] == task
        ]
        reference = mvbench_reference.mvbench_aggregate_results(rows)
        assert result["breakdown"][f"task/{task}"] == (reference, len(rows))
        reference_scores.append(reference)
    assert result["score"] == sum(reference_scores) / len(reference_scores)
