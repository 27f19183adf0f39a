"""The `math` reward: a completion's final answer read (the last `\\boxed{}`, else the answer
span, else its last number), and compared with the reference as numbers when both read as one
(within a relative tolerance), else as normalized LaTeX text.

What reads as a number: integers and decimals ("-3", ".5", "2.50"), scientific notation ("1e-3"),
thousands separators ("1,234,567", LaTeX's "1{,}234"), percentages ("50%", "50\\%": both 0.5 and
50, since a question may ask for either), fractions ("3/4", "\\frac{3}{4}", "\\dfrac34",
"-\\frac{1}{2}", nested ones), wrapped in "$...$" or "\\(...\\)" or not, with a trailing unit
word or "\\text{cm}", a degree sign, or a leading "x =" (the part after the last "=" is read).
Anything else ("\\sqrt{2}", "x+1") is compared as text: spaces, "$", sizing commands and a final
period removed, "\\dfrac" and "\\tfrac" read as "\\frac".

sympy is installed (through torch) but not used: `sympify` evaluates its input with Python's
eval, and its LaTeX parser needs antlr4, which is not installed.
"""

import math
import re

from vlmcore.eval.benchmarks.answers import numbers_in
from vlmcore.rewards.text import answer_span

# Two numbers are the same answer when they differ by at most this fraction of the larger (or by
# ABSOLUTE_TOLERANCE near zero): room for float noise and a fraction's long decimal (0.3333333333
# for 1/3), not for rounding (0.333).
RELATIVE_TOLERANCE = 1e-6
ABSOLUTE_TOLERANCE = 1e-9

BOX_COMMAND = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")
PLAIN_NUMBER = re.compile(r"[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?")
GROUPED_NUMBER = re.compile(r"[+-]?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
FRACTION_COMMANDS = ("\\frac", "\\dfrac", "\\tfrac")
# Text that says nothing about the value: math-mode wrappers, spacing and sizing commands, degrees.
NOISE = ("$", "\\(", "\\)", "\\[", "\\]", "\\left", "\\right", "\\!", "\\,", "\\;", "\\:", "\\ ", "~")
DEGREES = ("^{\\circ}", "^\\circ", "°")
TEXT_COMMAND = re.compile(r"\\(?:text|mathrm|textbf|mbox)\{([^{}]*)\}")
TRAILING_UNIT = re.compile(r"\s+[A-Za-z]+\.?$")


def braced_group(text: str, start: int) -> tuple[str, int] | None:
    """The content of the brace group opening at text[start] ("{...}", nested braces counted)
    and the index after it; a lone character stands for a group of one (`\\frac12`). None when
    the braces do not close."""
    if start >= len(text):
        return None
    if text[start] != "{":
        return text[start], start + 1
    depth = 0
    for index in range(start, len(text)):
        if text[index] == "{":
            depth += 1
        elif text[index] == "}":
            depth -= 1
            if depth == 0:
                return text[start + 1 : index], index + 1
    return None


def boxed_argument(text: str, after: int) -> tuple[str, int] | None:
    """The argument of a box command that ends at text[after], and the index after it: a brace
    group, or without braces the next word (`\\boxed 5`). None when there is none."""
    argument_start = len(text) - len(text[after:].lstrip())
    if text.startswith("{", argument_start):
        return braced_group(text, argument_start)
    words = text[after:].split()
    if argument_start > after and words:
        return words[0].strip("$"), argument_start + len(words[0])
    return None


def last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` (or `\\fbox{...}`) of the text, nested braces
    included; a box inside another belongs to it (`\\boxed{2\\boxed{3}}` reads "2\\boxed{3}").
    None when there is none or the last one's braces do not close."""
    found = None
    end = 0  # where the last box read so far ends: a command before it is inside it
    for command in BOX_COMMAND.finditer(text):
        if command.start() < end:
            continue
        argument = boxed_argument(text, command.end())
        if argument is None:
            found = None
            end = command.end()
            continue
        found, end = argument[0].strip(), argument[1]
    return unwrapped(found)


def unwrapped(content: str | None) -> str | None:
    """A box's content with the boxes that wrap all of it removed (`\\boxed{\\boxed{3}}` reads "3")."""
    while content is not None:
        command = BOX_COMMAND.match(content)
        argument = boxed_argument(content, command.end()) if command else None
        if argument is None or content[argument[1] :].strip():
            return content
        content = argument[0].strip()
    return content


def clean(text: str) -> str:
    """The text with what says nothing about a value removed (wrappers, spacing, degrees, a final
    period), `\\text{...}` unwrapped, `\\%` as `%`, LaTeX's `{,}` thousands separator as `,`."""
    text = text.strip()
    for noise in NOISE + DEGREES:
        text = text.replace(noise, "")
    text = TEXT_COMMAND.sub(r" \1", text)
    text = text.replace("\\%", "%").replace("{,}", ",")
    return text.strip().rstrip(".").strip()


def fraction_value(text: str) -> float | None:
    """The value of `\\frac{a}{b}` (a sign before it allowed), each part read as a number."""
    sign = -1.0 if text.startswith("-") else 1.0
    body = text.lstrip("+-")
    command = next((name for name in FRACTION_COMMANDS if body.startswith(name)), None)
    if command is None:
        return None
    numerator = braced_group(body, len(command))
    denominator = braced_group(body, numerator[1]) if numerator else None
    if denominator is None or denominator[1] != len(body):
        return None
    top, bottom = number_value(numerator[0]), number_value(denominator[0])
    if top is None or not bottom:
        return None
    return sign * top / bottom


def number_value(text: str) -> float | None:
    """The value of a number written alone (no percentage: see `numeric_readings`); None when
    the text is not one."""
    text = text.strip().replace(" ", "")
    if PLAIN_NUMBER.fullmatch(text):
        return float(text)
    if GROUPED_NUMBER.fullmatch(text):
        return float(text.replace(",", ""))
    if text.startswith(("\\", "-\\", "+\\")):
        return fraction_value(text)
    numerator, slash, denominator = text.partition("/")
    if slash and "/" not in denominator:
        top, bottom = number_value(numerator), number_value(denominator)
        if top is not None and bottom:
            return top / bottom
    return None


def numeric_readings(text: str) -> list[float]:
    """The values the text can mean as a number: none when it is not a number, two for a
    percentage (p/100 and p), else one. A leading "x =" and a trailing unit are read past."""
    text = clean(text).rpartition("=")[2].strip()
    if text.endswith("%"):
        value = number_value(text[:-1])
        return [] if value is None else [value / 100, value]
    value = number_value(text)
    if value is None:
        value = number_value(TRAILING_UNIT.sub("", text))
    return [] if value is None else [value]


def last_number(text: str) -> str | None:
    """The number that ends last in free text, found as the benchmarks find numbers
    (`eval.benchmarks.answers.numbers_in`: thousands separators, scientific notation, plain), a
    percent sign right after it kept."""
    best = None
    for number in numbers_in(text):
        end = text.rfind(number) + len(number)
        # Ties (the "234" inside "1,234") go to the longer number.
        if best is None or (end, len(number)) > (best[0], len(best[1])):
            best = (end, number)
    if best is None:
        return None
    end, number = best
    return number + "%" if text.startswith("%", end) else number


def normalize_latex(text: str) -> str:
    """The normal form of an answer compared as text: `clean`ed, spaces removed, `\\dfrac` and
    `\\tfrac` as `\\frac`."""
    text = clean(text).replace(" ", "")
    for command in FRACTION_COMMANDS[1:]:
        text = text.replace(command, "\\frac")
    return text


def reference_answer(answer: str) -> str:
    """The final answer of a reference: its last `\\boxed{}` if it has one (MATH's solutions),
    the part after its last "####" (GSM8K's), else the whole of it."""
    boxed = last_boxed(answer)
    if boxed is not None:
        return boxed
    return answer.rpartition("####")[2].strip()


def same_number(predicted: list[float], expected: list[float]) -> bool:
    return any(
        math.isclose(p, e, rel_tol=RELATIVE_TOLERANCE, abs_tol=ABSOLUTE_TOLERANCE) for p in predicted for e in expected
    )


def math_answer(completion: str, answer: str, sample: dict) -> float:
    """1 when the completion's final answer equals the reference's: as numbers when the reference
    reads as one (the completion's last `\\boxed{}`, else its answer span, else the span's last
    number), else as normalized text (the last `\\boxed{}`, else the whole answer span)."""
    span = answer_span(completion)
    boxed = last_boxed(span)
    predicted = boxed if boxed is not None else span
    if not predicted.strip():
        return 0.0
    expected = reference_answer(answer)
    expected_values = numeric_readings(expected)
    if expected_values:
        predicted_values = numeric_readings(predicted)
        if not predicted_values and boxed is None:
            number = last_number(span)
            predicted_values = numeric_readings(number) if number else []
        return 1.0 if same_number(predicted_values, expected_values) else 0.0
    normal = normalize_latex(predicted)
    return 1.0 if normal and normal == normalize_latex(expected) else 0.0
