"""Bin packing of samples into fixed-size sequences under a token and an image-patch budget."""

from bisect import insort

import numpy as np


def best_fit_decreasing(tokens, patches, seq_len: int, max_patches: int) -> list[list[int]]:
    """Group sample indices into bins of at most `seq_len` tokens and `max_patches` patches.

    Longest first, each sample goes into the bin it leaves with the least free token space among
    the bins that also have room for its patches, the oldest bin on a tie (best fit decreasing).
    Open bins sit in buckets by free tokens; a max-tree over the buckets holds (an upper bound of)
    each bucket's most free patches, so the best bucket is found in O(log seq_len) whatever budget
    binds. Every sample must fit an empty bin.
    """
    tokens = np.asarray(tokens, dtype=np.int64)
    patches = np.asarray(patches, dtype=np.int64)
    bad = np.flatnonzero((tokens > seq_len) | (patches > max_patches) | (tokens < 1))
    if len(bad):
        i = int(bad[0])
        raise ValueError(
            f"sample {i} ({tokens[i]} tokens, {patches[i]} patches) does not fit a bin of {seq_len} tokens, {max_patches} patches"
        )
    order = np.lexsort((-patches, -tokens))  # stable: ties keep index order
    size = 1 << seq_len.bit_length()  # leaves 0..seq_len
    tree = [-1] * (2 * size)  # max free patches per bucket (leaf) and subtree; -1: empty
    buckets: list[list[int]] = [[] for _ in range(seq_len + 1)]  # open bins by free tokens, in bin order
    bins: list[list[int]] = []
    free_patches: list[int] = []

    def raise_leaf(f: int, value: int) -> None:
        i = size + f
        while i and tree[i] < value:
            tree[i] = value
            i >>= 1

    def set_leaf(f: int, value: int) -> None:
        i = size + f
        tree[i] = value
        i >>= 1
        while i:
            tree[i] = max(tree[2 * i], tree[2 * i + 1])
            i >>= 1

    def first_bucket(lo: int, p: int) -> int:
        """Smallest free-token count >= lo whose bucket may have a bin with `p` free patches, or -1."""
        i = size + lo
        while tree[i] < p:
            while i & 1:  # a right child: climb until the next subtree to the right exists
                i >>= 1
            if i == 0:
                return -1
            i += 1
        while i < size:
            i = 2 * i if tree[2 * i] >= p else 2 * i + 1
        return i - size

    for i, t, p in in_order(order, tokens, patches):
        b = -1
        f = first_bucket(t, p)
        while f >= 0:
            bucket = buckets[f]
            k = next((k for k, c in enumerate(bucket) if free_patches[c] >= p), -1)
            if k >= 0:
                b = bucket.pop(k)
                if not bucket:
                    set_leaf(f, -1)
                break
            set_leaf(f, max(free_patches[c] for c in bucket))  # the bound was stale: make it exact
            f = first_bucket(f, p)
        if b < 0:
            b, f = len(bins), seq_len
            bins.append([])
            free_patches.append(max_patches)
        bins[b].append(i)
        free_patches[b] -= p
        if f - t > 0:
            insort(buckets[f - t], b)
            raise_leaf(f - t, free_patches[b])
    return bins


def in_order(order: np.ndarray, tokens: np.ndarray, patches: np.ndarray, chunk: int = 1 << 16):
    """(index, tokens, patches) in `order` as Python ints, converted a chunk at a time."""
    for start in range(0, len(order), chunk):
        part = order[start : start + chunk]
        yield from zip(part.tolist(), tokens[part].tolist(), patches[part].tolist())


def packing_stats(bins: list[list[int]], tokens, patches, seq_len: int, max_patches: int) -> dict:
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
