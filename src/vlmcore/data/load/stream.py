"""A rank's micro-batches through torch's DataLoader, for the packed loader and random data alike.

Micro-batch m is `make(m)`, a function of m alone, so loader workers can take them in turn:
worker w of W makes the micro-batches congruent to w, and the DataLoader hands them out in order,
so the worker count does not change the stream. On a GPU machine the batches come pinned (the
pin-memory thread copies them while the step runs), for the step's non-blocking copies.
"""

from collections.abc import Callable, Iterator

import torch


def micro_batch_loader(
    make: Callable[[int], object], start: int, num_workers: int, seed: int
) -> torch.utils.data.DataLoader:
    """Micro-batches `make(start)`, `make(start + 1)`, ... made by `num_workers` processes (0: this one)."""
    return torch.utils.data.DataLoader(
        _MicroBatches(make, start),
        batch_size=None,
        num_workers=num_workers,
        collate_fn=_as_is,
        pin_memory=torch.cuda.is_available(),
        # Its own generator: the workers' base seed is not drawn from torch's global one.
        generator=torch.Generator().manual_seed(seed),
    )


class _MicroBatches(torch.utils.data.IterableDataset):
    """Micro-batches `start`, `start + 1`, ...; loader worker w of W makes every Wth."""

    def __init__(self, make: Callable[[int], object], start: int) -> None:
        self.make = make
        self.start = start

    def __iter__(self) -> Iterator[object]:
        info = torch.utils.data.get_worker_info()
        m = self.start
        stride = 1
        if info is not None:
            m += info.id
            stride = info.num_workers
        while True:
            yield self.make(m)
            m += stride


def _as_is(batch: object) -> object:
    return batch
