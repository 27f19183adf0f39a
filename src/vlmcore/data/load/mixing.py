"""How far the order of a sample stream is from a uniform shuffle.

`order[t]` is the index (on disk: the pack order) of the item read at position t of one epoch,
every item once. A uniform shuffle puts every item anywhere, independently of its index and of
its neighbours on disk; a loader that reads shards or slices of shards in sequence does not. Three
statistics, each normalised so that a uniform shuffle gives 0 (the first) or 1 (the others):

- `spearman`: rank correlation of position with index (the stream follows the disk order).
- `neighbour_gap`: mean distance in the stream between items i and i + 1 on disk, over its
  uniform expectation (n + 1) / 3 (a slice read in sequence keeps neighbours close: well below 1).
- `block_dispersion`: blocks of `block` consecutive items on disk (a small shard); the squared
  deviation of each block's mean position from the middle, over its variance under a uniform
  shuffle, averaged over the blocks (a shard read at once clusters in time: well above 1).

`uniform_reference` gives the same statistics of uniform shuffles of the same size, to compare
against without trusting the asymptotic formulas; `epoch_order` reads a packed dataset's first
epoch through the training loader.
"""

from collections.abc import Sequence
from pathlib import Path

import numpy as np


def order_statistics(order: Sequence[int] | np.ndarray, block: int = 16) -> dict:
    """The three statistics of a stream's order (see the module docstring)."""
    order = np.asarray(order, dtype=np.int64)
    n = len(order)
    if n < 2 * block or sorted(order.tolist()) != list(range(n)):
        raise ValueError(f"need a permutation of 0..n-1 with n >= {2 * block}, got {n} items")
    position = np.empty(n, dtype=np.float64)
    position[order] = np.arange(n)
    spearman = float(np.corrcoef(position, np.arange(n))[0, 1])  # ranks of a permutation are the values
    gap = float(np.abs(np.diff(position)).mean() / ((n + 1) / 3))
    k = n // block
    means = position[: k * block].reshape(k, block).mean(1)
    variance = (n * n - 1) / 12 / block * (n - block) / (n - 1)
    dispersion = float(((means - (n - 1) / 2) ** 2 / variance).mean())
    return {"items": n, "spearman": spearman, "neighbour_gap": gap, "block_dispersion": dispersion}


def uniform_reference(n: int, block: int = 16, trials: int = 200, seed: int = 0) -> dict:
    """Each statistic's (0.5%, 99.5%) quantiles over `trials` uniform shuffles of n items."""
    rng = np.random.default_rng(seed)
    runs = [order_statistics(rng.permutation(n), block) for _ in range(trials)]
    return {
        key: tuple(float(q) for q in np.quantile([r[key] for r in runs], [0.005, 0.995]))
        for key in ("spearman", "neighbour_gap", "block_dispersion")
    }


def outside_uniform(stats: dict, reference: dict) -> dict:
    """The statistics that fall outside the uniform shuffles' range: {name: (value, (low, high))}."""
    return {key: (stats[key], bounds) for key, bounds in reference.items() if not bounds[0] <= stats[key] <= bounds[1]}


def epoch_order(path: str | Path, dp_world: int, seed: int = 0, num_workers: int = 0) -> list[int]:
    """The packs (their index on disk) of the training loader's first epoch over the packed
    dataset `path`, in the order the global batches hold them: rank 0's row, rank 1's, ..., step
    after step (micro-batches of one row)."""
    from vlmcore.data.load.loader import build_loader, samples_in

    loaders = [
        iter(build_loader(path, dp_rank=r, dp_world=dp_world, micro_batch_size=1, seed=seed, num_workers=num_workers))
        for r in range(dp_world)
    ]
    order = []
    seen = set()
    while len(seen) < samples_in(path):  # ranks may hold one pack more than others: theirs come last
        for loader in loaders:
            key = int(next(loader).row_keys[0])
            if key not in seen:
                seen.add(key)
                order.append(key)
    return order
