"""A damaged checkpoint is recognised from its .metadata before anything is loaded."""

import torch
import torch.distributed.checkpoint as dcp

from vlmcore.train.checkpoint import checkpoint_problem


def test_missing_and_truncated_files_are_found(tmp_path):
    path = tmp_path / "step_3"
    dcp.save({"model": {"w": torch.arange(1000.0)}, "train": {"step": 3}}, checkpoint_id=str(path), no_dist=True)
    assert checkpoint_problem(path) is None
    (data,) = path.glob("*.distcp")
    size = data.stat().st_size
    with open(data, "r+b") as f:
        f.truncate(size - 1)
    assert checkpoint_problem(path) == f"{data.name} is truncated ({size - 1} of {size} bytes)"
    data.unlink()
    assert checkpoint_problem(path) == f"{data.name} is missing"
    metadata = path / ".metadata"
    metadata.write_bytes(metadata.read_bytes()[:100])
    assert checkpoint_problem(path).startswith(".metadata cannot be read")
    metadata.unlink()
    assert checkpoint_problem(path).startswith(".metadata cannot be read")
