"""A damaged checkpoint is recognised before anything is loaded: from its .metadata, and from the
sizes and sha256 that manifest.json records."""

import pytest
import torch
import torch.distributed.checkpoint as dcp

from vlmcore.train.checkpoint import MANIFEST, Checkpointer, checkpoint_problem


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


def flip_byte(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0xFF]))


@pytest.mark.parametrize(("async_save", "async_mode"), [(False, "process"), (True, "thread"), (True, "process")])
def test_changed_bytes_are_found_by_the_manifest_and_skipped(tmp_path, one_process_group, async_save, async_mode):
    model = torch.nn.Linear(32, 32)
    optimizer = torch.optim.AdamW(model.parameters())
    checkpointer = Checkpointer(tmp_path, keep=2, async_save=async_save, async_mode=async_mode)
    for step in (1, 2):
        model(torch.randn(2, 32)).sum().backward()
        optimizer.step()
        checkpointer.save(step, model, optimizer, {"step": step}, {"seen": torch.tensor(step)})
    checkpointer.close()
    # Each save's times: training held up, and written in the background (async only).
    assert [t["step"] for t in checkpointer.timings] == [1, 2]
    assert all(t["blocking_s"] > 0 and (t["background_s"] > 0) == async_save for t in checkpointer.timings)
    latest = tmp_path / "checkpoints" / "step_2"
    assert sorted(p.name for p in latest.iterdir()) == [".metadata", "__0_0.distcp", MANIFEST]
    assert checkpoint_problem(latest, (0, 1)) is None and checkpointer.latest() == latest

    (data,) = latest.glob("*.distcp")
    flip_byte(data, data.stat().st_size // 2)
    assert checkpoint_problem(latest) is None  # sizes alone cannot see it
    changed = f"{data.name} does not match its sha256 in {MANIFEST}: its bytes changed after the save"
    assert checkpoint_problem(latest, (0, 1)) == changed
    # n ranks share the hashing: file i is read by rank i mod n ([.metadata, __0_0.distcp] here)
    assert checkpoint_problem(latest, (0, 2)) is None and checkpoint_problem(latest, (1, 2)) == changed
    assert checkpointer.latest() == tmp_path / "checkpoints" / "step_1"

    metadata = tmp_path / "checkpoints" / "step_1" / ".metadata"
    size = metadata.stat().st_size
    metadata.write_bytes(metadata.read_bytes() + b"\0")
    assert checkpoint_problem(metadata.parent) == f".metadata has {size + 1} bytes, {MANIFEST} records {size}"
    assert checkpointer.latest() is None
