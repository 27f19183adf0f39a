"""The built-in rewards on hand-written completions (tricky ones included), and the check of a
stage's reward names by config key."""

import pytest

from vlmcore.config import ConfigError
from vlmcore.rewards import REWARDS, RewardSpec, check_rewards, load_reward
from vlmcore.rewards.grounding import parse_box
from vlmcore.rewards.math_answers import last_boxed
from vlmcore.rewards.text import answer_span

KEY = "train.stages.rl.grpo.rewards"


def score(name, completion, answer, sample=None):
    return REWARDS[name](completion, answer, sample or {})


def test_the_answer_span_is_inside_the_answer_tags_else_after_the_reasoning():
    assert answer_span("<think>maybe 3</think><answer> 4 </answer>") == "4"
    assert answer_span("<answer>1</answer> then <answer>2</answer>") == "2"  # the last complete one
    assert answer_span("<think>maybe 3</think> so 5") == "so 5"
    assert answer_span("<answer>unclosed 6") == "<answer>unclosed 6"


@pytest.mark.parametrize(
    "completion, passes",
    [
        ("<think>look at the chart</think><answer>B</answer>", True),
        ("  <think>\nstep 1\n</think>\n\n<answer>\n42\n</answer>\n", True),
        ("<think></think><answer>B</answer>", True),  # an empty reasoning passes, an empty answer does not
        ("<think>x</think><answer> </answer>", False),
        ("<answer>B</answer>", False),  # no reasoning block
        ("<think>x</think>B", False),  # no answer block
        ("<think>x<answer>B</answer>", False),  # the reasoning not closed
        ("<think>x</think><answer>B", False),  # the answer not closed
        ("<answer>B</answer><think>x</think>", False),  # swapped
        ("<think>a</think><think>b</think><answer>B</answer>", False),  # two reasoning blocks
        ("<think>a</think><answer>B</answer><answer>C</answer>", False),  # two answers
        ("Sure! <think>a</think><answer>B</answer>", False),  # text outside the blocks
        ("<think>a <think> b</think><answer>B</answer>", False),  # a tag inside a block
    ],
)
def test_format_accepts_one_think_block_then_one_answer_block_only(completion, passes):
    assert score("format", completion, "") == (1.0 if passes else 0.0)


def test_exact_match_ignores_case_whitespace_punctuation_and_articles():
    assert score("exact_match", "<answer>The  Eiffel Tower!</answer>", "eiffel tower") == 1.0
    assert score("exact_match", "an apple.", "Apple") == 1.0
    assert score("exact_match", "<think>Paris</think><answer>Lyon</answer>", "Paris") == 0.0
    assert score("exact_match", "<answer>...</answer>", "...") == 0.0  # extracts to nothing
    # An answer that is all articles keeps them: the letter "A" is not an empty answer.
    assert score("exact_match", "<answer>a.</answer>", "A") == 1.0
    assert score("exact_match", "<answer>the</answer>", "A") == 0.0
    assert score("exact_match", "<answer>a cat</answer>", "A") == 0.0


@pytest.mark.parametrize(
    "completion, answer, sample, expected",
    [
        ("The answer is (B).", "B", {"choices": ["cat", "dog", "bird", "fish"]}, 1.0),
        ("<think>A or C?</think><answer>C</answer>", "C", {"choices": ["a", "b", "c", "d"]}, 1.0),
        ("<think>C, surely</think><answer>A</answer>", "C", {"choices": ["a", "b", "c", "d"]}, 0.0),
        ("B. dog", "(B)", {}, 1.0),  # the answer as "(B)", no choices given: A to H
        ("(D)", "D", {"choices": {"A": "x", "B": "y", "C": "z"}}, 0.0),  # D is not offered
        ("I pick B", "dog", {"choices": ["cat", "dog"]}, 1.0),  # the answer as the choice's text
        ("no idea", "B", {"choices": ["cat", "dog"]}, 0.0),  # no letter
    ],
)
def test_multiple_choice_reads_the_letter_as_the_benchmarks_do(completion, answer, sample, expected):
    assert score("multiple_choice", completion, answer, sample) == expected


def test_last_boxed_reads_nested_braces_and_the_last_box():
    assert last_boxed(r"so \boxed{\frac{1}{2}}") == r"\frac{1}{2}"
    assert last_boxed(r"first \boxed{1}, then \boxed{\sqrt{\frac{3}{4}}}.") == r"\sqrt{\frac{3}{4}}"
    assert last_boxed(r"\boxed{\boxed{3}}") == "3"
    assert last_boxed(r"\boxed{2 + \boxed{3}}") == r"2 + \boxed{3}"  # a box inside another belongs to it
    assert last_boxed(r"\boxed 7 apples") == "7"
    assert last_boxed(r"\fbox{8}") == "8"
    assert last_boxed(r"\boxed{1} and \boxed{2") is None  # the last one is not closed
    assert last_boxed("no box") is None


@pytest.mark.parametrize(
    "completion, answer, expected",
    [
        (r"\boxed{\frac{1}{2}}", "0.5", 1.0),
        (r"<answer>$\dfrac{1}{2}$</answer>", r"\frac{1}{2}", 1.0),
        ("<answer>1/2</answer>", "0.5", 1.0),
        (r"\boxed{-\frac{3}{4}}", "-0.75", 1.0),
        (r"\boxed{\frac{\frac{1}{2}}{2}}", "0.25", 1.0),  # nested fractions
        (r"\boxed{\dfrac34}", "0.75", 1.0),
        (r"so \boxed{1} first, finally \boxed{2}", "2", 1.0),  # the last box
        (r"\boxed{1} first, finally \boxed{2}", "1", 0.0),
        ("The total is 1,234,567 dollars.", "1234567", 1.0),  # thousands separators, the last number
        (r"\boxed{1{,}000}", "1000", 1.0),
        ("<answer>50%</answer>", "0.5", 1.0),  # a percentage reads as p/100 or p
        (r"\boxed{50\%}", "50", 1.0),
        ("<answer>2.50</answer>", "2.5", 1.0),
        ("<answer>1e-3</answer>", "0.001", 1.0),
        (r"\boxed{x = 4}", "4", 1.0),
        (r"\boxed{12 \text{ cm}}", "12", 1.0),
        (r"\boxed{90^\circ}", "90", 1.0),
        ("<answer>0.3333333333</answer>", r"\frac{1}{3}", 1.0),  # within the relative tolerance
        ("<answer>0.333</answer>", r"\frac{1}{3}", 0.0),  # rounding is not the same number
        ("the answer is 7", "#### 7", 1.0),  # a GSM8K reference
        ("<answer>7</answer>", r"so it is \boxed{7}", 1.0),  # a boxed reference
        (r"\boxed{\sqrt{2}}", r"\sqrt{2}", 1.0),  # not a number: compared as normalized text
        (r"\boxed{ \sqrt{ 2 } }", r"\sqrt{3}", 0.0),
        ("no number here", "5", 0.0),
        (r"\boxed{}", "5", 0.0),  # extracts to nothing
        (r"\boxed{1/0}", "5", 0.0),
    ],
)
def test_math_compares_final_answers_as_numbers_or_normalized_latex(completion, answer, expected):
    assert score("math", completion, answer) == expected


def test_parse_box_reads_qwen3_vl_json_or_a_plain_list():
    json_answer = '```json\n[{"bbox_2d": [139, 768, 315, 954], "label": "cat"}]\n```'
    assert parse_box(json_answer) == (139, 768, 315, 954)
    assert parse_box("it is at [10, 20.5, 30, 40] I think") == (10, 20.5, 30, 40)
    assert parse_box('[1, 2, 3, 4] or rather {"bbox_2d": [5, 6, 7, 8]}') == (5, 6, 7, 8)  # bbox_2d first
    assert parse_box("[30, 20, 10, 40]") is None  # x2 < x1: no area
    assert parse_box("[1, 2, 3]") is None


def test_iou_of_identical_disjoint_and_half_overlapping_boxes():
    box = '{"bbox_2d": [100, 100, 300, 300]}'
    assert score("iou", f"<answer>{box}</answer>", "[100, 100, 300, 300]") == 1.0
    assert score("iou", "<answer>[400, 400, 500, 500]</answer>", "[100, 100, 300, 300]") == 0.0
    # Half of each box over the other: the intersection is 1/3 of the union.
    assert score("iou", "[0, 0, 100, 100]", "[50, 0, 150, 100]") == pytest.approx(1 / 3)
    # One box inside another of four times its area.
    assert score("iou", "[0, 0, 50, 50]", "[0, 0, 100, 100]") == pytest.approx(0.25)
    assert score("iou", "<answer>somewhere left</answer>", "[0, 0, 100, 100]") == 0.0


def test_iou_rescales_a_reference_in_pixels_to_the_0_1000_grid():
    # A 200 x 100 image: the pixel box (50, 25)-(100, 50) is (250, 250)-(500, 500) on Qwen3-VL's grid.
    sample = {"image_size": [200, 100]}
    assert score("iou", "[250, 250, 500, 500]", "[50, 25, 100, 50]", sample) == pytest.approx(1.0)
    assert score("iou", "[50, 25, 100, 50]", "[50, 25, 100, 50]", sample) == 0.0


def test_check_rewards_accepts_built_in_names_and_a_user_module_function():
    specs = check_rewards([{"name": "math", "weight": 1.0}, RewardSpec("format", 0.5), {"name": "os.path:join"}], KEY)
    assert [spec.name for spec in specs] == ["math", "format", "os.path:join"]
    assert [spec.weight for spec in specs] == [1.0, 0.5, 1.0]
    assert load_reward("os.path:join") is __import__("os.path").path.join


@pytest.mark.parametrize(
    "name, reason",
    [
        ("maths", "unknown reward 'maths' (built-in: exact_match, multiple_choice, math, format, iou"),
        ("no_such_module_xyz:score", "cannot import module 'no_such_module_xyz': ModuleNotFoundError"),
        ("os.path:no_such_function", "module 'os.path' has no attribute 'no_such_function'"),
        ("os:sep", "'os:sep' is not callable (it is a str)"),
        (":score", "is not of the form module:function"),
    ],
)
def test_check_rewards_refuses_a_bad_name_by_its_key(name, reason):
    with pytest.raises(ConfigError) as refused:
        check_rewards([{"name": "format"}, {"name": name}], KEY)
    assert refused.value.key == f"{KEY}[1].name"
    assert str(refused.value).startswith(f"{KEY}[1].name: ")
    assert reason in str(refused.value)


def test_check_rewards_refuses_a_bad_weight_a_repeated_name_and_an_empty_list():
    with pytest.raises(ConfigError) as refused:
        check_rewards([{"name": "format", "weight": float("nan")}], KEY)
    assert refused.value.key == f"{KEY}[0].weight"
    with pytest.raises(ConfigError) as refused:
        check_rewards([{"name": "math"}, {"name": "math"}], KEY)
    assert refused.value.key == f"{KEY}[1].name"
    assert "listed twice" in str(refused.value)
    with pytest.raises(ConfigError) as refused:
        check_rewards([], KEY)
    assert refused.value.key == KEY
