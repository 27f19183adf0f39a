"""`vlmcore prepare` of preference pairs whose chosen answer is the rejected one (up to surrounding
whitespace, in any layout of a pair): dropped, since the pair can teach nothing, and counted under
`preference_identical_answers` in stats.json; the pairs beside them are kept."""

import json

from helpers import write_jsonl

from vlmcore import cli
from vlmcore.data.shards import iter_shard_samples, shard_paths


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict:
    return {"role": "assistant", "content": text}


def test_a_pair_with_identical_answers_is_dropped_and_counted(tmp_path, capsys):
    prompt = [user("What shape is it?"), assistant("Let me look."), user("And?")]
    rows = [
        {"prompt": "What color is it?", "chosen": "red", "rejected": "blue"},
        {"prompt": "What color is it?", "chosen": "red", "rejected": "red"},
        {"prompt": [user("Describe it.")], "chosen": [assistant("A circle.")], "rejected": [assistant("A circle. ")]},
        {"chosen": prompt + [assistant("A circle.")], "rejected": prompt + [assistant("A circle.")]},
        {"chosen": prompt + [assistant("A circle.")], "rejected": prompt + [assistant("A square.")]},
    ]
    source = write_jsonl(tmp_path / "pairs.jsonl", rows)
    out = tmp_path / "data"
    argv = ["prepare", "--source", f"preference:{source}", "--out", str(out), "--max-bad-fraction", "0.8"]
    assert cli.main(argv) == 0
    assert json.loads(capsys.readouterr().out)["skipped"] == 3
    stats = json.loads((out / "stats.json").read_text())
    assert stats["samples"] == 2 and stats["bad"]["skipped_by_reason"] == {"preference_identical_answers": 3}
    kept = [json.loads(s.data["json"]) for shard in shard_paths(out) for s in iter_shard_samples(shard)]
    assert [(sample["messages"][-1]["content"], sample["rejected"][-1]["content"]) for sample in kept] == [
        ("red", "blue"),
        ("A circle.", "A square."),
    ]
