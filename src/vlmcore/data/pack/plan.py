"""The packing plan: which samples each pack holds, kept on disk between the plan and the write
steps of `vlmcore pack` (in `<out>.partial/plan`, until the pack is done)."""

import json
from pathlib import Path

import numpy as np

PLAN_DIR = "plan"
PLAN_ARRAYS = ("samples", "images", "keys", "members", "starts")


def save_plan(
    plan_dir: Path, identity: dict, samples: np.ndarray, images: np.ndarray, keys: bytes, bins: list[list[int]]
) -> None:
    """The packs as arrays: pack p holds the samples members[starts[p]:starts[p + 1]], each
    described by its row in `samples`. plan.json, written last, says the plan is complete and
    which inputs and settings it was made from."""
    plan_dir.mkdir(parents=True)
    starts = np.zeros(len(bins) + 1, np.int64)
    np.cumsum([len(b) for b in bins], out=starts[1:])
    members = np.fromiter((i for b in bins for i in b), np.int64, len(samples))
    arrays = {
        "samples": samples,
        "images": images,
        "keys": np.frombuffer(keys, np.uint8),
        "members": members,
        "starts": starts,
    }
    for name in PLAN_ARRAYS:
        np.save(plan_dir / f"{name}.npy", arrays[name])
    (plan_dir / "plan.tmp").write_text(json.dumps(identity))
    (plan_dir / "plan.tmp").replace(plan_dir / "plan.json")


def load_plan(plan_dir: Path, identity: dict) -> dict | None:
    """The plan's arrays (memory-mapped: writing processes share them), or None when there is no
    complete plan made from these inputs and settings."""
    stamp = plan_dir / "plan.json"
    if not stamp.is_file() or json.loads(stamp.read_text()) != identity:
        return None
    return {name: np.load(plan_dir / f"{name}.npy", mmap_mode="r") for name in PLAN_ARRAYS}
