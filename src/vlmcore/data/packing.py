"""Bin packing of samples into fixed-size sequences under a token and an image-patch budget."""

from bisect import bisect_left, insort


def best_fit_decreasing(tokens: list[int], patches: list[int], seq_len: int, max_patches: int) -> list[list[int]]:
    """Group sample indices into bins of at most `seq_len` tokens and `max_patches` patches.

    Longest first, each sample goes into the bin it leaves with the least free token space among
    the bins that also have room for its patches (best fit decreasing). Bins are kept sorted by free
    tokens, so finding the best fit is a binary search. Every sample must fit an empty bin.
    """
    for i, (t, p) in enumerate(zip(tokens, patches)):
        if t > seq_len or p > max_patches or t < 1:
            raise ValueError(f"sample {i} ({t} tokens, {p} patches) does not fit a bin of {seq_len} tokens, {max_patches} patches")
    order = sorted(range(len(tokens)), key=lambda i: (-tokens[i], -patches[i], i))
    bins: list[list[int]] = []
    bin_patches: list[int] = []
    free: list[tuple[int, int]] = []  # (free tokens, bin index) of bins that are not full, sorted
    for i in order:
        t, p = tokens[i], patches[i]
        j = bisect_left(free, (t, -1))
        while j < len(free) and bin_patches[free[j][1]] + p > max_patches:
            j += 1
        if j == len(free):
            b, room = len(bins), seq_len
            bins.append([])
            bin_patches.append(0)
        else:
            room, b = free.pop(j)
        bins[b].append(i)
        bin_patches[b] += p
        if room - t > 0:
            insort(free, (room - t, b))
    return bins


def packing_stats(bins: list[list[int]], tokens: list[int], patches: list[int], seq_len: int, max_patches: int) -> dict:
    """Efficiency = real tokens over capacity (bins x seq_len)."""
    used_tokens = sum(tokens[i] for b in bins for i in b)
    used_patches = sum(patches[i] for b in bins for i in b)
    capacity = max(len(bins), 1)
    return {
        "packs": len(bins),
        "samples": sum(len(b) for b in bins),
        "tokens": used_tokens,
        "efficiency": used_tokens / (capacity * seq_len),
        "patch_utilization": used_patches / (capacity * max_patches) if max_patches else 0.0,
        "samples_per_pack": sum(len(b) for b in bins) / capacity,
        "max_patches_in_a_pack": max((sum(patches[i] for i in b) for b in bins), default=0),
    }
