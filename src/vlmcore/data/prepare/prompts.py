"""Prompt rows (online RL) -> the sample a shard stores: a question, its media and the reference
answer a verifiable reward compares the policy's completions with.

A row holds `question` (a user message string) or `prompt` (a string, or turns ending with a user
turn), `answer` (a string or a number: the reference answer), optionally the row's `image(s)` and
`video(s)` as any conversation row does, and any other fields (multiple-choice `choices`, a
`solution`, a ground-truth box...), which the rewards receive with the answer.

The stored sample is `{"messages": prompt + [the answer as an assistant turn], "answer_from":
number of prompt turns, "answer": the reference answer, "reward_fields": {the other fields}}`.
The answer as the assistant turn makes a prompt sample an ordinary conversation to `vlmcore
pack` and the loader (its labels on the answer, so the same data can warm a policy up with SFT);
an RL stage takes `messages[:answer_from]` as the prompt and `answer` for the rewards.

Bad rows are counted by reason: `prompt_missing_question` (no question, or a prompt that does not
end with a user turn), `prompt_missing_answer` (no answer, or an empty one), `malformed_row` (a
field of the wrong type); media that does not decode counts as for every row (`missing_image`,
`bad_image`, `bad_video`, ...).
"""

import json
import math

from vlmcore.data.prepare.samples import (
    add_missing_tags,
    normalise_turn,
)
from vlmcore.data.quality import BadSample

QUESTION_FIELDS = ("question", "prompt")
# The row's fields that are not passed on to the rewards: the prompt, the answer and the media.
MEDIA_FIELDS = ("image", "images", "video", "videos", "video_fps")


# A row with any of these is a conversation, a caption, a document or a pair, whatever else it has.
OTHER_KIND_FIELDS = ("messages", "conversations", "texts", "caption", "text", "chosen", "rejected")


def is_prompt_row(row: object) -> bool:
    """A row with a question (or a prompt and an answer) and none of the other kinds' fields."""
    if not isinstance(row, dict) or any(field in row for field in OTHER_KIND_FIELDS):
        return False
    return "question" in row or ("prompt" in row and "answer" in row)


def prompt_turns(row: dict) -> list[dict]:
    """The row's prompt as normalised turns, ending with a user turn; raises BadSample."""
    value = row.get("question", row.get("prompt"))
    if isinstance(value, str):
        if not value.strip():
            raise BadSample("prompt_missing_question", "an empty question")
        return [normalise_turn({"role": "user", "content": value})]
    if not isinstance(value, list) or not value:
        raise BadSample("prompt_missing_question", f"question is {type(value).__name__}")
    turns = [normalise_turn(turn) for turn in value]
    if turns[-1]["role"] != "user":
        raise BadSample("prompt_missing_question", "the prompt's last turn is not a user turn")
    return turns


def reference_answer(row: dict) -> str:
    """The row's answer as text (a number written as given); raises BadSample."""
    answer = row.get("answer")
    if isinstance(answer, bool) or answer is None:
        raise BadSample("prompt_missing_answer", "no answer")
    if isinstance(answer, int | float):
        if isinstance(answer, float) and not math.isfinite(answer):
            raise BadSample("prompt_missing_answer", f"answer {answer}")
        return str(answer)
    if not isinstance(answer, str):
        raise BadSample("malformed_row", f"answer is {type(answer).__name__}")
    if not answer.strip():
        raise BadSample("prompt_missing_answer", "an empty answer")
    return answer


def prompt_sample(row: dict, num_images: int, num_videos: int) -> tuple[dict, list[str]]:
    """The stored prompt sample (module docstring) and the repairs made; raises BadSample."""
    turns = prompt_turns(row)
    answer = reference_answer(row)
    repairs = []
    # Media without tags get them at the start of the first user turn, as for conversations.
    for kind, count in (("video", num_videos), ("image", num_images)):
        if add_missing_tags(turns, kind, count):
            repairs.append(f"added_{kind}_tags")
    reward_fields = {
        name: value for name, value in row.items() if name not in (*QUESTION_FIELDS, "answer", *MEDIA_FIELDS)
    }
    for name, value in reward_fields.items():  # the shard stores them as JSON
        try:
            json.dumps(value)
        except (TypeError, ValueError) as e:
            raise BadSample("malformed_row", f"field {name!r} is not JSON ({e})") from e
    sample = {
        "messages": turns + [{"role": "assistant", "content": answer}],
        "answer_from": len(turns),
        "answer": answer,
        "reward_fields": reward_fields,
    }
    return sample, repairs


def prompt_of(sample: dict) -> tuple[list[dict], str, dict]:
    """A stored prompt sample's (prompt turns, reference answer, reward fields): what an RL stage reads."""
    return sample["messages"][: sample["answer_from"]], sample["answer"], sample.get("reward_fields", {})
