"""`data.kind: random` batches come as the packed loader's do: from torch's DataLoader, made by
worker processes when `num_workers` is set, in the same order whatever the count, resumable."""

import itertools

import torch

from vlmcore.tiny import hf_config
from vlmcore.train.random_data import RandomBatches


def random_batches(num_workers: int) -> RandomBatches:
    return RandomBatches(
        hf_config("qwen3_vl"),
        seq_len=64,
        segments=2,
        image_fraction=0.5,
        video_fraction=0.5,
        micro_batch_size=2,
        dp_rank=1,
        dp_world=2,
        grad_accum_steps=2,
        seed=3,
        num_workers=num_workers,
    )


def assert_same_batches(got, want):
    assert len(got) == len(want)
    for a, b in zip(got, want):
        for name in ("input_ids", "labels", "cu_seqlens", "position_ids"):
            assert torch.equal(getattr(a, name), getattr(b, name)), name
        for name in ("images", "videos"):
            x, y = getattr(a, name), getattr(b, name)
            assert (x is None) == (y is None), name
            if x is not None:
                assert torch.equal(x.pixel_values, y.pixel_values) and torch.equal(x.grid_thw, y.grid_thw), name


def test_workers_make_the_same_stream_and_resume_it():
    """Two workers give this rank's micro-batches in the order the training process makes them
    (each is micro_batch(m), m counted from the start), without drawing from torch's global
    random stream; a stream resumed from a state saved after 3 micro-batches goes on as the
    uninterrupted one does."""
    want = [random_batches(0).micro_batch(m) for m in range(6)]
    assert any(b.images is not None for b in want) and any(b.videos is not None for b in want)

    rng = torch.get_rng_state()
    data = random_batches(2)
    got = list(itertools.islice(iter(data), 3))
    assert torch.equal(torch.get_rng_state(), rng)
    assert_same_batches(got, want[:3])
    assert data.consumed == 3

    resumed = random_batches(2)
    resumed.load_state_dict(data.state_dict())
    assert_same_batches(list(itertools.islice(iter(resumed), 3)), want[3:])
    assert_same_batches(list(itertools.islice(iter(random_batches(0)), 6)), want)
