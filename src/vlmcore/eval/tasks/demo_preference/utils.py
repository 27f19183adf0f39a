"""Loading the demo's held-out preference pairs for lm-eval: each pair a two-way choice, the chosen
side first, so `acc` counts the pairs whose chosen answer the model finds the more likely."""

from pathlib import Path

import datasets
from PIL import Image

from vlmcore.eval.results import jsonl_records

PREFERENCE_FILE = "preference_eval.jsonl"
FIELDS = ("id", "images", "prompt", "chosen", "rejected")


def load_preference_jsonl(vqa_data: str | None = None, **_metadata: object) -> datasets.DatasetDict:
    """The pairs of `preference_eval.jsonl` in the directory of `vqa_data` (the demo's eval.jsonl):
    `{"id", "images" (one, relative to the file's directory), "prompt", "chosen", "rejected"}` per line."""
    if not vqa_data:
        raise ValueError("demo_preference needs the held-out file: pass `vlmcore eval --vqa-data raw/eval.jsonl`")
    path = Path(vqa_data).parent / PREFERENCE_FILE
    if not path.is_file():
        raise ValueError(f"{path}: no such file (`vlmcore synth --kind image` writes it beside {Path(vqa_data).name})")
    rows = []
    for line_no, row in jsonl_records(path):
        missing = [key for key in FIELDS if key not in row]
        if missing:
            raise ValueError(f"{path}:{line_no}: missing {missing}")
        if len(row["images"]) != 1:
            raise ValueError(f"{path}:{line_no}: a demo pair has one image, got {len(row['images'])}")
        image_path = path.parent / row["images"][0]
        if not image_path.is_file():
            raise ValueError(f"{path}:{line_no}: image {image_path} not found")
        rows.append(
            {
                "id": row["id"],
                "kind": row.get("kind", ""),
                "prompt": row["prompt"],
                "choices": [row["chosen"], row["rejected"]],
                "answer": 0,
                "image_path": str(image_path.resolve()),
            }
        )
    if not rows:
        raise ValueError(f"{path}: no pairs")
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def doc_to_image(doc: dict) -> list:
    return [Image.open(doc["image_path"]).convert("RGB")]
