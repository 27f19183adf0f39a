"""Reading a choice letter or an answer out of a model's free text, as each benchmark's official
rule does.

Each benchmark has its own rule, and a score is only comparable with published ones when the
rule is the same, quirks included: MMMU's (its parse_multi_choice_response and
parse_open_response, which pick a random letter when the text names no option), MMBench's
"can infer" checks, the ranked letter extraction that lmms-eval uses for Video-MME and MMBench
(answer formats ranked: a leading letter, a trailing letter, "the answer is X", "(X)", "X.", ...)
and MVBench's punctuation-stripping comparison. tests/eval/test_eval_benchmarks_scoring.py checks
every function here against lmms-eval 0.7.3's on the same texts.
"""

import random
import re

# The characters MMMU strips off both ends of a response, one after the other, before looking for a letter.
MMMU_STRIPPED = (",", ".", "!", "?", ";", ":", "'")
# Words after which MMMU looks for the answer of an open question (the tail of the sentence).
MMMU_ANSWER_INDICATORS = ("could be ", "so ", "is ", "thus ", "therefore ", "final ", "answer ", "result ")
MMMU_TRIVIAL_TAILS = (":", ",", ".", "!", "?", ";", "'")
NUMBER_WITH_COMMAS = re.compile(r"-?\b\d{1,3}(?:,\d{3})+\b")
NUMBER_SCIENTIFIC = re.compile(r"-?\d+(?:\.\d+)?[eE][+-]?\d+")
NUMBER_SIMPLE = re.compile(r"-?(?:\d+\.\d+|\.\d+|\d+\b)(?![eE][+-]?\d+)(?![,\d])")


def option_letters(count: int) -> list[str]:
    return [chr(ord("A") + i) for i in range(count)]


def mmmu_choice(response: str, options: list[str]) -> str:
    """The option letter a response to an MMMU multiple-choice question names.

    In order: a letter in parentheses, a letter followed by a space, a letter followed by a
    period, and (responses over five words) an option's text; several found: the one that
    appears last. None found: a random letter (`random.choice`, as MMMU's own rule does: lm-eval
    seeds `random` per run, so a run is reproducible).
    """
    letters = option_letters(len(options))
    for char in MMMU_STRIPPED:
        response = response.strip(char)
    padded = f" {response} "
    for pattern in ("({})", "{} ", "{}."):
        found = [letter for letter in letters if pattern.format(letter) in padded]
        if found:
            break
    if found:
        # The last one wins; MMMU looks for a bracketed letter as "(X)" and any other as " X ".
        marker = "({})" if pattern == "({})" else " {} "
        positions = [padded.rfind(marker.format(letter)) for letter in found]
        return found[positions.index(max(positions))]
    if len(padded.split()) > 5:
        lowered = padded.lower()
        found = [letter for letter, option in zip(letters, options) if option.lower() in lowered]
        if found:
            positions = [lowered.rfind(options[letters.index(letter)].lower()) for letter in found]
            return found[positions.index(max(positions))]
    return random.choice(letters)


def mmmu_number_or_text(text: str) -> list:
    """MMMU's normal form of an answer: a number rounded to 2 decimals, else the lowercase text
    (a single character padded with a space on one side, so that it is not found inside words)."""
    text = text.strip()
    try:
        return [round(float(text.replace(",", "")), 2)]
    except ValueError:
        pass
    text = text.lower()
    if len(text) == 1:
        return [" " + text, text + " "]
    return [text]


def numbers_in(text: str) -> list[str]:
    """Every number in the text, as MMMU finds them: with thousands commas, in scientific
    notation, and plain."""
    return NUMBER_WITH_COMMAS.findall(text) + NUMBER_SCIENTIFIC.findall(text) + NUMBER_SIMPLE.findall(text)


def sentence_tail(sentence: str, indicators: tuple[str, ...]) -> str | None:
    """The shortest text after the last occurrence of any indicator in the sentence."""
    shortest = None
    for indicator in indicators:
        if indicator not in sentence:
            continue
        tail = sentence.split(indicator)[-1].strip()
        # An empty tail found first is replaced by the next one, whatever its length (MMMU's rule).
        if not shortest or len(tail) < len(shortest):
            shortest = tail
    return shortest


def mmmu_open_candidates(response: str) -> list:
    """The candidate answers of a response to an MMMU open question, normalized: the tail of each
    sentence after "so", "is", "therefore", ... ("=" too in the last sentence), and every number
    in them; the whole response when no sentence has an indicator."""
    response = response.strip().strip(".").lower()
    sentences = re.split(r"\.\s(?=[A-Z])|\n", response)
    key_texts = []
    for index, sentence in enumerate(sentences):
        is_last = index == len(sentences) - 1
        indicators = MMMU_ANSWER_INDICATORS + ("=",) if is_last else MMMU_ANSWER_INDICATORS
        tail = sentence_tail(sentence, indicators)
        # An empty tail counts as none found; a lone punctuation mark is no answer either.
        if tail and tail.strip() not in MMMU_TRIVIAL_TAILS:
            key_texts.append(tail)
    if not key_texts:
        key_texts = [response]
    texts = list(key_texts)
    for text in key_texts:
        texts.extend(numbers_in(text))
    candidates = []
    for text in texts:
        candidates.extend(mmmu_number_or_text(text))
    return list(set(candidates))


def mmmu_open_is_correct(answer: str | list[str], candidates: list) -> bool:
    """A text candidate is right when it contains a normalized answer, a number when it equals one."""
    answers = answer if isinstance(answer, list) else [answer]
    normalized = [form for text in answers for form in mmmu_number_or_text(text)]
    for candidate in candidates:
        if isinstance(candidate, str):
            if any(isinstance(form, str) and form in candidate for form in normalized):
                return True
        elif candidate in normalized:
            return True
    return False


# lmms-eval's ranked letter extraction (Video-MME, MMBench's fallback): the formats a letter is
# found in, best first; among candidates of the best format, the one that appears last wins.
LETTER_FORMAT_RANK = {
    "start": 10,
    "end": 9,
    "phrase": 7,
    "parentheses": 6,
    "period": 5,
    "colon": 4,
    "right_paren": 3,
    "space": 2,
    "fallback": 0,
}
LETTER_MARKERS = (
    ("parentheses", "({})"),
    ("period", "{}."),
    ("colon", "{}:"),
    ("right_paren", "{})"),
    ("space", "{} "),
)
ANSWER_PHRASES = (
    "the answer is",
    "answer is",
    "the correct answer is",
    "correct answer is",
    "the best answer is",
    "best answer is",
    "the correct option is",
    "correct option is",
    "the best option is",
    "best option is",
    "the choice is",
    "choice is",
    "the correct choice is",
    "correct choice is",
    "i choose",
    "i select",
    "i pick",
    "my answer is",
    "my choice is",
    "옵션",
    "정답은",
    "답은",
    "답:",
    "答案是",
    "答案为",
    "选",
    "答えは",
)
DEFAULT_LETTERS = tuple("ABCDEFGH")


def letter_candidates(text: str, letters: tuple[str, ...] | list[str]) -> list[tuple[str, int, str]]:
    """(letter, position, format) of every way a letter appears in the padded, stripped text."""
    candidates = []
    for format_name, marker in LETTER_MARKERS:
        for letter in letters:
            if marker.format(letter) in text:
                candidates.append((letter, text.rfind(marker.format(letter)), format_name))
    lowered = text.lower()
    for phrase in ANSWER_PHRASES:
        start = lowered.find(phrase)
        if start == -1:
            continue
        for letter in letters:
            # The first occurrence of the letter anywhere after the phrase.
            position = text.find(letter, start + len(phrase))
            if position != -1:
                candidates.append((letter, position, "phrase"))
    bare = text.strip()
    for letter in letters:
        if bare.startswith(letter) and (len(bare) == 1 or not bare[1].isalpha()):
            candidates.append((letter, 0, "start"))
    for letter in letters:
        if bare.endswith(letter) and (len(bare) == 1 or not bare[-2].isalpha()):
            candidates.append((letter, len(text) - 1, "end"))
    return candidates


def ranked_letter(response: str, letters: tuple[str, ...] | list[str] | None = None) -> str:
    """The choice letter of a free-text answer by lmms-eval's ranked extraction; "" when none."""
    if not response or not response.strip():
        return ""
    letters = letters or DEFAULT_LETTERS
    text = response.strip()
    for char in (",", ".", "!", "?", ";", ":", "'", '"'):
        text = text.strip(char)
    text = f" {text} "
    candidates = letter_candidates(text, letters)
    if not candidates:
        candidates = [(letter, text.rfind(letter), "fallback") for letter in letters if letter in text]
    if not candidates:
        return ""
    # A stable sort, best format and latest position first: ties keep the order found.
    candidates.sort(key=lambda c: (LETTER_FORMAT_RANK[c[2]], c[1]), reverse=True)
    return candidates[0][0]


# MMBench's prefetch: the text answers with a letter when exactly one letter of A-E stands alone
# (or in one of these prefix/suffix forms) among its words.
MMBENCH_LETTERS = "ABCDE"
MMBENCH_LETTER_FORMS = (
    ("", "."),
    ("", ","),
    ("", ":"),
    ("", ")"),
    ("", ")."),
    ("(", ")"),
    ("(", ")."),
    (":", ""),
    (":", ","),
    (":", "."),
    (":", ")"),
    (":", ")."),
)


def mmbench_letter_by_form(answer: str) -> str | None:
    """The letter that stands alone among the words of the answer (MMBench's can_infer_option)."""
    if "Failed to obtain answer via API" in answer:
        return None
    words = [word.strip() for word in answer.split()]

    def count(prefix: str, suffix: str) -> int:
        return sum(prefix + letter + suffix in words for letter in MMBENCH_LETTERS)

    # A lone "A" in a longer answer may be the article, not a choice.
    maybe_article = "A" in words and len(words) > 3
    if count("", "") == 1 and not maybe_article:
        for letter in MMBENCH_LETTERS:
            if letter in words:
                return letter
    for prefix, suffix in MMBENCH_LETTER_FORMS:
        if count(prefix, suffix) == 1:
            for letter in MMBENCH_LETTERS:
                if prefix + letter + suffix in words:
                    return letter
    return None


def mmbench_letter_by_text(answer: str, choices: dict[str, str]) -> str | None:
    """The letter of the only option whose text the answer contains (MMBench's can_infer_text)."""
    answer = answer.lower()
    found = [letter for letter, text in choices.items() if str(text).lower() in answer]
    return found[0] if len(found) == 1 else None


def mmbench_letter(answer: str, choices: dict[str, str]) -> str | None:
    """MMBench's prefetched letter of an answer, or None when it cannot infer one."""
    return mmbench_letter_by_form(answer) or mmbench_letter_by_text(answer, choices)


# MVBench's normalization of an answer before comparing letters (VQA-style punctuation rules).
MVBENCH_PUNCTUATION = (
    ";",
    "/",
    "[",
    "]",
    '"',
    "{",
    "}",
    "(",
    ")",
    "=",
    "+",
    "\\",
    "_",
    "-",
    ">",
    "<",
    "@",
    "`",
    ",",
    "?",
    "!",
)
MVBENCH_OPTION_FORM = re.compile(r"^([A-E])\.\s*(.+)$", re.IGNORECASE)
MVBENCH_DIGIT_COMMA = re.compile(r"(\d)(\,)(\d)")
# As MVBench writes it: a period not followed by a digit (the "(?!<=\d)" is a lookahead, so it
# never tests the character before).
MVBENCH_PERIOD = re.compile(r"(?!<=\d)(\.)(?!\d)")
# MVBench passes re.UNICODE (32) where sub() takes its count: at most 32 periods are removed.
MVBENCH_PERIODS_REMOVED = 32


def mvbench_strip_punctuation(text: str) -> str:
    out = text
    for mark in MVBENCH_PUNCTUATION:
        # Marks beside a space (or any text with a digit comma) vanish; others become a space.
        if mark + " " in text or " " + mark in text or MVBENCH_DIGIT_COMMA.search(text) is not None:
            out = out.replace(mark, "")
        else:
            out = out.replace(mark, " ")
    return MVBENCH_PERIOD.sub("", out, count=MVBENCH_PERIODS_REMOVED)


def mvbench_normal_form(answer: str) -> str:
    """The letter an MVBench answer names ("B. text", "(B)", "b"), else its normalized text."""
    option = MVBENCH_OPTION_FORM.match(answer.strip())
    if option:
        return option.group(1).upper()
    answer = answer.replace("\n", " ").replace("\t", " ").strip()
    answer = mvbench_strip_punctuation(answer)
    for char in ("'", '"', ")", "("):
        answer = answer.strip(char)
    answer = answer.strip().lower()
    letter = re.search(r"\b([A-E])\b", answer, re.IGNORECASE)
    if letter:
        return letter.group(1).upper()
    return answer
