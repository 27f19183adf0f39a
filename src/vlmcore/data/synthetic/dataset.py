"""The files of a synthetic demo dataset, the same for images and videos: captions.jsonl,
conversations.jsonl, eval.jsonl and meta.json."""

import json
from pathlib import Path


def write_jsonl(path: Path, rows: list[dict]) -> None:
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def write_dataset(
    out_dir: Path, captions: list, conversations: list, eval_rows: list, questions: dict, meta: dict
) -> dict:
    """The jsonl files, and meta.json: `meta` with each question kind's chance level and eval count."""
    write_jsonl(out_dir / "captions.jsonl", captions)
    write_jsonl(out_dir / "conversations.jsonl", conversations)
    write_jsonl(out_dir / "eval.jsonl", eval_rows)
    meta.update(
        chance={kind: 1.0 / len(choices) for kind, (_, choices) in questions.items()},
        eval_count_by_kind={kind: sum(r["kind"] == kind for r in eval_rows) for kind in questions},
    )
    (out_dir / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    return meta
