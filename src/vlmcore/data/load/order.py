"""The order of packed rows: which pack is global row j, as a function of the datasets, the seed and j only.

Global batch k is rows [k * G, (k + 1) * G) of this order (G rows per optimizer step), whatever
the number of data-parallel ranks, the micro-batch size, gradient accumulation or loader
workers: a rank's share is a slice of it (`rows_of`). So a run resumed on another layout with
the same G continues the stream exactly, and the position is one number, the rows consumed.

- One dataset of N packs: epoch e is a uniform permutation of the N packs, seeded by (seed, e).
- A weighted blend: row j's dataset is drawn with the weights (seeded by (seed, j's chunk of
  `CHUNK` rows)); it takes the next pack of that dataset's own stream of epochs. Finding row j
  counts the draws before it: O(j) integer work, done once per chunk and cached, no data read.
- An epochized blend: an epoch holds every dataset `repetitions` times, permuted as one.
"""

import numpy as np

CHUNK = 1 << 16


class RowOrder:
    """Global row j -> (dataset, pack index in it); see the module docstring."""

    def __init__(
        self, sizes: list[int], seed: int, weights: list[float] | None = None, repetitions: list[int] | None = None
    ) -> None:
        if not sizes or min(sizes) < 1:
            raise ValueError(f"every dataset needs at least one pack, got sizes {sizes}")
        self.sizes = list(sizes)
        self.seed = seed
        self.weights = None if weights is None else np.asarray(weights, dtype=np.float64) / sum(weights)
        self.repetitions = repetitions
        self._perms = {}  # (dataset or -1, epoch) -> permutation; the last few only
        self._chunks = {}  # chunk -> (draws, counts of each dataset before the chunk)

    def _perm(self, key: int, epoch: int, n: int) -> np.ndarray:
        if (key, epoch) not in self._perms:
            if len(self._perms) >= 4:
                self._perms.pop(next(iter(self._perms)))
            self._perms[key, epoch] = np.random.default_rng([self.seed, 1, key + 1, epoch]).permutation(n)
        return self._perms[key, epoch]

    def _chunk(self, c: int) -> tuple[np.ndarray, np.ndarray]:
        if c not in self._chunks and (not self._chunks or c < min(self._chunks)):
            self._chunks = {}  # a seek back: count again from the start
        while c not in self._chunks:  # forward from the last cached chunk
            last = max(self._chunks, default=-1)
            before = (
                self._chunks[last][1] + np.bincount(self._chunks[last][0], minlength=len(self.sizes))
                if last >= 0
                else np.zeros(len(self.sizes), dtype=np.int64)
            )
            draws = np.random.default_rng([self.seed, 2, last + 1]).choice(len(self.sizes), CHUNK, p=self.weights)
            self._chunks = {
                k: v for k, v in self._chunks.items() if k == last
            }  # two kept: a micro-batch spans at most that
            self._chunks[last + 1] = (draws, before)
        return self._chunks[c]

    def dataset_counts(self, rows: int) -> np.ndarray:
        """How many of global rows [0, rows) each dataset gives: integer work, as finding row `rows` is."""
        counts = np.zeros(len(self.sizes), dtype=np.int64)
        if len(self.sizes) == 1:
            counts[0] = rows
        elif self.repetitions is not None:
            spans = np.asarray(self.sizes) * np.asarray(self.repetitions)
            epochs, offset = divmod(rows, int(spans.sum()))
            counts += epochs * spans
            if offset:  # the last epoch's first `offset` positions, each in the span of its dataset
                first = self._perm(-1, epochs, int(spans.sum()))[:offset]
                counts += np.bincount(np.searchsorted(np.cumsum(spans), first, side="right"), minlength=len(spans))
        else:
            c, offset = divmod(rows, CHUNK)
            draws, before = self._chunk(c)
            counts += before + np.bincount(draws[:offset], minlength=len(self.sizes))
        return counts

    def __getitem__(self, j: int) -> tuple[int, int]:
        """(dataset, pack index in it) of global row j."""
        if len(self.sizes) == 1:
            n = self.sizes[0]
            return 0, int(self._perm(0, j // n, n)[j % n])
        if self.repetitions is not None:
            spans = [n * r for n, r in zip(self.sizes, self.repetitions)]
            m = sum(spans)
            i = int(self._perm(-1, j // m, m)[j % m])
            d = int(np.searchsorted(np.cumsum(spans), i, side="right"))
            return d, (i - sum(spans[:d])) % self.sizes[d]
        c, offset = divmod(j, CHUNK)
        draws, before = self._chunk(c)
        d = int(draws[offset])
        nth = int(before[d] + np.count_nonzero(draws[:offset] == d))  # this dataset's nth pack
        n = self.sizes[d]
        return d, int(self._perm(d, nth // n, n)[nth % n])


def rows_of(
    step: int, micro: int, dp_rank: int, *, dp_world: int, micro_batch_size: int, grad_accum_steps: int
) -> range:
    """The global rows of micro-batch `micro` (of `grad_accum_steps`) of `step` on data-parallel
    rank `dp_rank`: the rank's share of the step's global batch is one slice, its micro-batches
    consecutive parts of it."""
    per_rank = micro_batch_size * grad_accum_steps
    start = step * per_rank * dp_world + dp_rank * per_rank + micro * micro_batch_size
    return range(start, start + micro_batch_size)
