"""Loading the demo's held-out VQA file for lm-eval: rows checked, image paths made absolute."""

from pathlib import Path

import datasets
from PIL import Image

from vlmcore.eval.results import jsonl_records


def load_vqa_jsonl(vqa_data=None, **_metadata) -> datasets.DatasetDict:
    """`{"id", "image" (relative to the file's directory), "question", "choices", "answer"}` per line."""
    return load_rows(vqa_data, "image", "demo_vqa")


def load_rows(vqa_data, media: str, task: str) -> datasets.DatasetDict:
    """The questions of `vqa_data`, each row's `media` file (image or video) checked and its
    absolute path added as `<media>_path`."""
    if not vqa_data:
        raise ValueError(f"{task} needs the held-out file: pass `vlmcore eval --vqa-data raw/eval.jsonl`")
    path = Path(vqa_data)
    if not path.is_file():
        raise ValueError(f"--vqa-data {path}: no such file")
    rows = []
    for line_no, row in jsonl_records(path):
        missing = [key for key in ("id", media, "question", "choices", "answer") if key not in row]
        if missing:
            raise ValueError(
                f"{path}:{line_no}: missing {missing}"
                + (
                    f" (a {task} question needs a {media}; is this the other demo's eval.jsonl?)"
                    if media in missing
                    else ""
                )
            )
        if not 0 <= row["answer"] < len(row["choices"]):
            raise ValueError(
                f"{path}:{line_no}: answer {row['answer']} is not an index into {len(row['choices'])} choices"
            )
        media_path = path.parent / row[media]
        if not media_path.is_file():
            raise ValueError(f"{path}:{line_no}: {media} {media_path} not found")
        rows.append({**row, "kind": row.get("kind", ""), f"{media}_path": str(media_path.resolve())})
    if not rows:
        raise ValueError(f"{path}: no questions")
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def doc_to_image(doc) -> list:
    return [Image.open(doc["image_path"]).convert("RGB")]
