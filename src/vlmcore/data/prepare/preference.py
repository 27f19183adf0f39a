"""Preference rows (DPO) -> the sample a shard stores: one prompt, a chosen and a rejected answer.

A row holds `chosen` and `rejected`, each a conversation (a list of turns) or an answer string,
and optionally `prompt` (turns, or a user message string) and the row's `image(s)` and
`video(s)` as any conversation row does. Without `prompt` the sides are whole conversations
(TRL's implicit prompt); either way a side's answer is its trailing assistant turns and its
prompt is everything before them, so the two sides must share that prompt exactly.

The stored sample is `{"messages": prompt + chosen answer, "rejected": rejected answer turns,
"answer_from": number of prompt turns}` and the row's images and videos once: both sides see the
same media. `vlmcore pack` makes it two segments of one pack, never apart.

Bad pairs are counted by reason: `preference_missing_side` (a side absent, empty or without an
answer), `preference_different_prompts`, `preference_different_media` (per-side media that
differ, or media tags in one side's answer), `preference_identical_answers` (the chosen answer
is the rejected one: the pair can teach nothing).
"""

from vlmcore.data.prepare.samples import (
    normalise_messages,
    normalise_turn,
)
from vlmcore.data.quality import BadSample

SIDES = ("chosen", "rejected")
PREFERENCE_FIELDS = SIDES


def is_preference_row(row: object) -> bool:
    return isinstance(row, dict) and any(side in row for side in SIDES)


def as_turns(value: object, role: str) -> list:
    """A side or prompt given as a string -> one turn of `role`; turns stay as they are."""
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    return value


def split_answer(turns: list[dict]) -> tuple[list[dict], list[dict]]:
    """(prompt, answer): the answer is the trailing assistant turns."""
    start = len(turns)
    while start > 0 and turns[start - 1]["role"] == "assistant":
        start -= 1
    return turns[:start], turns[start:]


def side_turns(row: dict, side: str) -> list[dict]:
    """The side's whole conversation, `prompt` included, normalised turn by turn."""
    value = row.get(side)
    if not value:
        raise BadSample("preference_missing_side", f"no {side}")
    turns = as_turns(row.get("prompt") or [], "user") + as_turns(value, "assistant")
    if not isinstance(turns, list):
        raise BadSample("malformed_conversation", f"{side} is {type(value).__name__}")
    return [normalise_turn(turn) for turn in turns]


def check_side_media(row: dict) -> None:
    """Per-side media (`chosen_images`, `rejected_videos`, ...) must be the same on both sides."""
    for kind in ("image", "images", "video", "videos"):
        chosen = row.get(f"chosen_{kind}")
        rejected = row.get(f"rejected_{kind}")
        if chosen != rejected:
            raise BadSample("preference_different_media", f"chosen_{kind} != rejected_{kind}")


def answer_texts(answer: list[dict]) -> list[str]:
    """An answer's turns as the text trained on, for comparing the two sides (surrounding whitespace
    aside)."""
    return [turn["content"].strip() for turn in answer]


def preference_messages(row: dict, num_images: int, num_videos: int) -> tuple[dict, list[str]]:
    """The stored preference sample (module docstring) and the repairs made; raises BadSample."""
    check_side_media(row)
    prompts = {}
    answers = {}
    for side in SIDES:
        prompt, answer = split_answer(side_turns(row, side))
        if not answer or not any(turn["content"].strip() for turn in answer):
            raise BadSample("preference_missing_side", f"{side} has no answer")
        prompts[side] = prompt
        answers[side] = answer
    if prompts["chosen"] != prompts["rejected"]:
        raise BadSample("preference_different_prompts", "the chosen and rejected sides' prompts differ")
    if answer_texts(answers["chosen"]) == answer_texts(answers["rejected"]):
        # Both sides' log-probabilities would be the same: the pair's loss is log 2 and its gradient 0.
        raise BadSample("preference_identical_answers", "the chosen and rejected answers are the same")
    for side in SIDES:
        if any("<image>" in turn["content"] or "<video>" in turn["content"] for turn in answers[side]):
            raise BadSample("preference_different_media", f"a media tag in the {side} answer")
    prompt = prompts["chosen"]
    if not prompt:
        raise BadSample("preference_missing_side", "no prompt")
    messages, repairs = normalise_messages(prompt + answers["chosen"], num_images, num_videos)
    answer_from = len(prompt)
    sample = {"messages": messages, "rejected": answers["rejected"], "answer_from": answer_from}
    return sample, repairs


def preference_sides(sample: dict) -> list[dict]:
    """The two conversations of a stored preference sample, chosen then rejected, each a sample
    the encoder takes (`answer_from`: only the answer is trained on)."""
    answer_from = sample["answer_from"]
    prompt = sample["messages"][:answer_from]
    return [
        {"messages": sample["messages"], "answer_from": answer_from},
        {"messages": prompt + sample["rejected"], "answer_from": answer_from},
    ]
