"""Bin packing of samples into fixed-size sequences under a token and an image-patch budget."""

from bisect import insort
from collections.abc import Iterator, Sequence

import numpy as np


def best_fit_decreasing(
    tokens: Sequence[int] | np.ndarray, patches: Sequence[int] | np.ndarray, seq_len: int, max_patches: int
) -> list[list[int]]:
    """Group sample indices into bins of at most `seq_len` tokens and `max_patches` patches.

    Longest first, each sample goes into the bin it leaves with the least free token space among
    the bins that also have room for its patches, the oldest bin on a tie (best fit decreasing).
    Open bins sit in buckets by free tokens; a max-tree over the buckets holds (an upper bound of)
    each bucket's most free patches, so the best bucket is found in O(log seq_len) whatever budget
    binds. Every sample must fit an empty bin.
    """
    tokens = np.asarray(tokens, dtype=np.int64)
    patches = np.asarray(patches, dtype=np.int64)
    check_fit(tokens, patches, seq_len, max_patches)
    order = np.lexsort((-patches, -tokens))  # stable: ties keep index order
    open_bins = OpenBins(seq_len)
    bins: list[list[int]] = []
    free_patches: list[int] = []
    for i, t, p in in_order(order, tokens, patches):
        b, f = open_bins.take_best(t, p, free_patches)
        if b < 0:
            b = len(bins)
            f = seq_len
            bins.append([])
            free_patches.append(max_patches)
        bins[b].append(i)
        free_patches[b] -= p
        if f - t > 0:
            open_bins.put(b, f - t, free_patches[b])
    return bins


def check_fit(tokens: np.ndarray, patches: np.ndarray, seq_len: int, max_patches: int) -> None:
    """ValueError naming the first sample that does not fit an empty bin."""
    bad = np.flatnonzero((tokens > seq_len) | (patches > max_patches) | (tokens < 1))
    if len(bad):
        i = int(bad[0])
        raise ValueError(
            f"sample {i} ({tokens[i]} tokens, {patches[i]} patches) does not fit a bin of {seq_len} tokens, {max_patches} patches"
        )


class OpenBins:
    """The open bins of a best fit, in buckets by their free tokens (0..seq_len), each bucket in
    bin order; a max-tree over the buckets holds an upper bound of each bucket's most free patches
    (-1: empty), made exact where a search finds it stale."""

    def __init__(self, seq_len: int) -> None:
        self.size = 1 << seq_len.bit_length()  # leaves 0..seq_len
        self.tree = [-1] * (2 * self.size)
        self.buckets: list[list[int]] = [[] for _ in range(seq_len + 1)]

    def take_best(self, tokens: int, patches: int, free_patches: list[int]) -> tuple[int, int]:
        """(bin, its free tokens) of the best open bin for a sample, taken out of its bucket; (-1, -1) if none fits."""
        f = self.first_bucket(tokens, patches)
        while f >= 0:
            bucket = self.buckets[f]
            k = next((k for k, b in enumerate(bucket) if free_patches[b] >= patches), -1)
            if k >= 0:
                b = bucket.pop(k)
                if not bucket:
                    self.set_leaf(f, -1)
                return b, f
            self.set_leaf(f, max(free_patches[b] for b in bucket))  # the bound was stale: make it exact
            f = self.first_bucket(f, patches)
        return -1, -1

    def put(self, b: int, free_tokens: int, free_patches: int) -> None:
        insort(self.buckets[free_tokens], b)
        self.raise_leaf(free_tokens, free_patches)

    def raise_leaf(self, f: int, value: int) -> None:
        i = self.size + f
        while i and self.tree[i] < value:
            self.tree[i] = value
            i >>= 1

    def set_leaf(self, f: int, value: int) -> None:
        i = self.size + f
        self.tree[i] = value
        i >>= 1
        while i:
            self.tree[i] = max(self.tree[2 * i], self.tree[2 * i + 1])
            i >>= 1

    def first_bucket(self, lo: int, p: int) -> int:
        """Smallest free-token count >= lo whose bucket may have a bin with `p` free patches, or -1."""
        tree = self.tree
        i = self.size + lo
        while tree[i] < p:
            while i & 1:  # a right child: climb until the next subtree to the right exists
                i >>= 1
            if i == 0:
                return -1
            i += 1
        while i < self.size:
            i = 2 * i if tree[2 * i] >= p else 2 * i + 1
        return i - self.size


def in_order(
    order: np.ndarray, tokens: np.ndarray, patches: np.ndarray, chunk: int = 1 << 16
) -> Iterator[tuple[int, int, int]]:
    """(index, tokens, patches) in `order` as Python ints, converted a chunk at a time."""
    for start in range(0, len(order), chunk):
        part = order[start : start + chunk]
        yield from zip(part.tolist(), tokens[part].tolist(), patches[part].tolist())


def packing_stats(
    bins: list[list[int]],
    tokens: Sequence[int] | np.ndarray,
    patches: Sequence[int] | np.ndarray,
    seq_len: int,
    max_patches: int,
) -> dict:
    """Efficiency = real tokens over capacity (bins x seq_len)."""
    members = np.fromiter((i for b in bins for i in b), dtype=np.int64)
    bin_of = np.repeat(np.arange(len(bins)), [len(b) for b in bins])
    member_patches = np.asarray(patches, dtype=np.int64)[members]
    used_tokens = int(np.asarray(tokens, dtype=np.int64)[members].sum())
    capacity = max(len(bins), 1)
    return {
        "packs": len(bins),
        "samples": len(members),
        "tokens": used_tokens,
        "efficiency": used_tokens / (capacity * seq_len),
        "patch_utilization": int(member_patches.sum()) / (capacity * max_patches) if max_patches else 0.0,
        "samples_per_pack": len(members) / capacity,
        "max_patches_in_a_pack": int(np.bincount(bin_of, member_patches, minlength=1).max()) if len(bins) else 0,
    }
