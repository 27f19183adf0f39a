"""The rewards of text answers: the answer span of a completion, its think/answer shape, exact
match and the multiple-choice letter.

Every reward here is a plain function `(completion, answer, sample) -> float` (`sample`: the
prompt row's other fields) and scores 0 when the completion holds no answer to read.
"""

import re
import string

from vlmcore.eval.benchmarks.answers import option_letters, ranked_letter

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
ANSWER_OPEN, ANSWER_CLOSE = "<answer>", "</answer>"
TAGS = (THINK_OPEN, THINK_CLOSE, ANSWER_OPEN, ANSWER_CLOSE)
# An answer span: the shortest text between an opening and a closing answer tag.
ANSWER_SPAN = re.compile(re.escape(ANSWER_OPEN) + r"(.*?)" + re.escape(ANSWER_CLOSE), re.DOTALL)
# The shape `format` accepts: one think block, then one answer block, whitespace around them only.
THINK_THEN_ANSWER = re.compile(
    r"\s*"
    + re.escape(THINK_OPEN)
    + r"(?P<think>.*?)"
    + re.escape(THINK_CLOSE)
    + r"\s*"
    + re.escape(ANSWER_OPEN)
    + r"(?P<answer>.*?)"
    + re.escape(ANSWER_CLOSE)
    + r"\s*",
    re.DOTALL,
)
ARTICLES = re.compile(r"\b(a|an|the)\b")


def answer_span(completion: str) -> str:
    """The part of a completion that the content rewards read: the inside of its last complete
    `<answer>...</answer>`; without one, the text after its last `</think>` (the reasoning is not
    the answer); without that either, the whole completion."""
    spans = ANSWER_SPAN.findall(completion)
    if spans:
        return spans[-1].strip()
    if THINK_CLOSE in completion:
        return completion.rpartition(THINK_CLOSE)[2].strip()
    return completion.strip()


def format_reward(completion: str, answer: str, sample: dict) -> float:
    """1 when the completion is exactly `<think>T</think><answer>A</answer>`: whitespace may
    stand before, between and after the two blocks, nothing else; T and A hold no think or answer
    tag; A is not empty (T may be). Anything else (a missing or repeated tag, an unclosed block,
    text outside the blocks, the blocks swapped) scores 0. The answer is not read."""
    shape = THINK_THEN_ANSWER.fullmatch(completion)
    if shape is None:
        return 0.0
    inner = shape.group("think") + shape.group("answer")
    if any(tag in inner for tag in TAGS):
        return 0.0
    return 1.0 if shape.group("answer").strip() else 0.0


def normalize_text(text: str, drop_articles: bool = True) -> str:
    """The normal form exact match compares: lower case, punctuation removed, the articles a, an
    and the removed, runs of whitespace made one space."""
    text = text.lower()
    text = "".join(char for char in text if char not in string.punctuation)
    if drop_articles:
        text = ARTICLES.sub(" ", text)
    return " ".join(text.split())


def exact_match(completion: str, answer: str, sample: dict) -> float:
    """1 when the answer span and the answer have the same normal form (`normalize_text`). When
    one of them is all articles (the answer "A"), both keep their articles; an answer span that
    normalizes to nothing even so scores 0."""
    span = answer_span(completion)
    predicted, expected = normalize_text(span), normalize_text(answer)
    if not predicted or not expected:
        predicted, expected = normalize_text(span, drop_articles=False), normalize_text(answer, drop_articles=False)
    if not predicted:
        return 0.0
    return 1.0 if predicted == expected else 0.0


def choice_letters(sample: dict) -> list[str]:
    """The letters a question offers: the keys of its `choices` when they are a mapping (letter ->
    text), A, B, ... for a list of them, A to H without choices (the ranked extraction's default)."""
    choices = sample.get("choices")
    if isinstance(choices, dict):
        return [str(key).strip().upper() for key in choices]
    if isinstance(choices, list | tuple) and choices:
        return option_letters(len(choices))
    return option_letters(8)


def expected_letter(answer: str, sample: dict, letters: list[str]) -> str:
    """The letter of the right choice: the answer itself ("B", "(B)", "b."), or the letter of the
    choice whose text the answer is."""
    bare = answer.strip().strip("().:").strip().upper()
    if bare in letters:
        return bare
    choices = sample.get("choices")
    texts = list(choices.values()) if isinstance(choices, dict) else list(choices or [])
    for letter, text in zip(letters, texts):
        if normalize_text(str(text)) == normalize_text(answer):
            return letter
    return ""


def multiple_choice(completion: str, answer: str, sample: dict) -> float:
    """1 when the letter read from the answer span is the right one. The letter is read by the
    ranked extraction that the benchmarks' scoring uses (`eval.benchmarks.answers.ranked_letter`:
    "B", "(B)", "The answer is B.", ...), among the letters the question offers."""
    letters = choice_letters(sample)
    expected = expected_letter(answer, sample, letters)
    if not expected:
        return 0.0
    predicted = ranked_letter(answer_span(completion), letters)
    return 1.0 if predicted == expected else 0.0
