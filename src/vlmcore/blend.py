"""A blend: one training stage's data as several packed datasets, each row drawn from one of them
by weight (or, epochized, every dataset a whole number of times an epoch).

The file is an Energon metadataset YAML (`MetadatasetV2`, `splits.train.blend` of
`{weight, path}` entries or `splits.train.blend_epochized` of `{repetitions, path}`); relative
paths are relative to the file's directory. vlmcore reads it itself: the row order is
vlmcore.data.load.order's. Torch-free, so that the workflow writes and checks blends while it
plans, and `vlmcore train` refuses a bad one (vlmcore.config.check_paths) before any work.
"""

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import yaml

# A run directory's record of the blend it trains on, as it read it (vlmcore.train.run_dir): a
# resume on other weights is another run, and the report reads the weights from it.
RUN_RECORD = "blend.yaml"


class BlendError(ValueError):
    """A blend file that cannot be read; the message names the file."""


@dataclass(frozen=True)
class Blend:
    """The packed datasets of a blend file (resolved) and their weights or repetitions (one of the two,
    or neither for a file naming one dataset)."""

    paths: list[Path]
    weights: list[float] | None = None  # as written; the row order normalises them
    repetitions: list[int] | None = None

    @property
    def names(self) -> list[str]:
        return dataset_names(self.paths)

    def record(self) -> dict:
        """The blend as a run directory records it (RUN_RECORD): its datasets by name (the results
        directory may move) and their weights or repetitions."""
        return {"datasets": self.names, "weights": self.weights, "repetitions": self.repetitions}


def dataset_names(paths: Sequence[Path]) -> list[str]:
    """What the metrics call each dataset of a blend: its directory's name (the workflow's
    packed/<dataset>), with its position in the blend where two share a name (a dataset blended
    with itself)."""
    counts = Counter(Path(p).name for p in paths)
    return [Path(p).name if counts[Path(p).name] == 1 else f"{Path(p).name}[{i}]" for i, p in enumerate(paths)]


def weight_problem(weights: Sequence[float]) -> str | None:
    """Why `weights` cannot weigh a mix (None: they can): each row's dataset is drawn with
    probability weight / sum of the weights, so none may be negative and their sum must be positive."""
    if not weights:
        return "an empty mix: name at least one dataset and its weight"
    negative = [w for w in weights if w < 0]
    if negative:
        return f"weight {negative[0]} is negative (weights are sampling probabilities, normalised by their sum)"
    if sum(weights) <= 0:
        return f"the weights sum to {sum(weights)}: they must sum to a positive number"
    return None


def blend_document(datasets: Sequence[tuple[str | Path, float]], epochized: bool = False) -> dict:
    """The metadataset over packed `datasets` [(dir, weight), ...], their paths as given."""
    if epochized:
        node = {"blend_epochized": [{"repetitions": int(w), "path": str(d)} for d, w in datasets]}
    else:
        node = {"blend": [{"weight": w, "path": str(d)} for d, w in datasets]}
    return {"__module__": "megatron.energon", "__class__": "MetadatasetV2", "splits": {"train": node}}


def write_blend(path: str | Path, datasets: Sequence[tuple[str | Path, float]], epochized: bool = False) -> None:
    """A blend file over packed `datasets` [(dir, weight), ...], with their absolute paths.

    Weighted: each row's dataset is drawn with probability proportional to its weight.
    Epochized: each "epoch" of the blend holds every dataset exactly `weight` (an integer) times.
    """
    resolved = [(Path(d).resolve(), w) for d, w in datasets]
    Path(path).write_text(yaml.safe_dump(blend_document(resolved, epochized), sort_keys=False))


def read_blend(path: str | Path) -> Blend:
    """The datasets and weights of the blend file at `path`; raises BlendError naming the file and
    what is wrong (not YAML, no `splits.train`, an entry without its path or weight, a bad weight)."""
    path = Path(path)
    try:
        document = yaml.safe_load(path.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise BlendError(f"{path}: not a readable blend YAML: {e}") from None
    node = document.get("splits", {}).get("train") if isinstance(document, dict) else None
    if not isinstance(node, dict):
        raise BlendError(f"{path}: not a blend: expected an Energon metadataset with splits.train")
    kind = next((k for k in ("blend", "blend_epochized") if k in node), None)
    entries = node[kind] if kind else [node]
    if not isinstance(entries, list) or not entries:
        raise BlendError(f"{path}: splits.train.{kind} must be a non-empty list of datasets")
    amount = {"blend": "weight", "blend_epochized": "repetitions", None: None}[kind]
    paths = []
    amounts = []
    for i, entry in enumerate(entries):
        where = f"splits.train.{kind}[{i}]" if kind else "splits.train"
        if not isinstance(entry, dict) or not isinstance(entry.get("path"), str):
            raise BlendError(f"{path}: {where} has no path")
        paths.append((path.parent / entry["path"]).resolve())
        if amount is None:
            continue
        value = entry.get(amount)
        wrong_type = not isinstance(value, (int, float)) or isinstance(value, bool)
        if wrong_type or (amount == "repetitions" and value != int(value)):
            raise BlendError(f"{path}: {where}.{amount} is {value!r}, not a number of the right kind")
        amounts.append(value)
    if amount is not None and (problem := weight_problem(amounts)):
        raise BlendError(f"{path}: splits.train.{kind}: {problem}")
    if kind == "blend":
        return Blend(paths, weights=[float(w) for w in amounts])
    if kind == "blend_epochized":
        return Blend(paths, repetitions=[int(r) for r in amounts])
    return Blend(paths)
