"""Context parallelism by numbers (issue 30): per cp size, how evenly the attention work of packed
rows falls on the ranks, and the bytes each rank sends per step, for vlmcore's all-to-all over
heads (Ulysses) against a ring that passes K/V chunks around (contiguous or head/tail chunks).

    python benchmarks/cp.py                     # Qwen3-VL-8B's language model, rows of 32k/64k/128k
    python benchmarks/cp.py --layers 28 --heads 16 --kv-heads 8 --head-dim 128   # the 2B

Attention work is counted as causal (query, key) pairs within each document of the row. Under the
all-to-all every rank attends whole rows for 1/cp of the heads, so its share is exactly 1/cp;
under a ring each rank attends its own chunk's queries to every earlier key. Bytes are bf16, per
rank, forward + backward + the forward recomputed under full activation checkpointing. Writes
benchmarks/results/cp.json.
"""

import argparse
import random

from common import RESULTS, write_results


def packed_row(length: int, seed: int, mean_doc: int) -> list[int]:
    """Document lengths filling one row: exponential around `mean_doc`, the last one cut to fit."""
    rng, docs = random.Random(seed), []
    while sum(docs) < length:
        docs.append(max(16, int(rng.expovariate(1 / mean_doc))))
    docs[-1] -= sum(docs) - length
    return docs


def pairs_per_rank(docs: list[int], cp: int, chunking: str) -> list[float]:
    """Causal (query, key) pairs each rank computes when the row's queries are split into chunks."""
    length = sum(docs)
    starts, pos = [], 0
    for d in docs:
        starts.append(pos)
        pos += d
    if chunking == "contiguous":
        owners = [[(r * length // cp, (r + 1) * length // cp)] for r in range(cp)]
    else:  # head/tail: 2cp chunks, rank r takes chunk r and chunk 2cp-1-r
        size = length // (2 * cp)
        owners = [[(r * size, (r + 1) * size), ((2 * cp - 1 - r) * size, (2 * cp - r) * size)] for r in range(cp)]
    work = []
    for spans in owners:
        total = 0.0
        for lo, hi in spans:
            for start, d in zip(starts, docs):
                a, b = max(lo, start), min(hi, start + d)
                if a < b:  # queries a..b-1 of this document, each attending to its earlier keys in the document
                    total += (
                        sum(q - start + 1 for q in range(a, b))
                        if b - a < 64
                        else (b - a) * ((a - start + 1) + (b - start)) / 2
                    )
        work.append(total)
    return work


def bytes_per_rank(tokens: int, cp: int, layers: int, heads: int, kv_heads: int, head_dim: int) -> dict:
    """Bytes one rank sends in a step (forward, recomputed forward, backward), bf16."""
    chunk, passes = tokens // cp, 3
    ulysses = passes * layers * chunk * head_dim * 2 * (2 * heads + 2 * kv_heads) * (cp - 1) / cp
    ring = passes * layers * (cp - 1) * chunk * 2 * kv_heads * head_dim * 2  # K and V chunks around the ring
    return {"ulysses_gb": ulysses / 1e9, "ring_gb": ring / 1e9}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[32768, 65536, 131072])
    parser.add_argument("--cps", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--layers", type=int, default=36)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--mean-doc", type=int, default=8192, help="mean document length in a packed row")
    args = parser.parse_args()
    rows = []
    print(
        "row tokens | cp | max/mean attention work: all-to-all, ring contiguous, ring head/tail | "
        "GB sent per rank a step: all-to-all, ring"
    )
    for length in args.lengths:
        docs = packed_row(length, seed=length, mean_doc=args.mean_doc)
        for cp in args.cps:
            if args.kv_heads % cp and args.heads % cp:
                continue
            imbalance = {}
            for chunking in ("contiguous", "head_tail"):
                work = pairs_per_rank(docs, cp, chunking)
                imbalance[chunking] = max(work) / (sum(work) / cp)
            sent = bytes_per_rank(length, cp, args.layers, args.heads, args.kv_heads, args.head_dim)
            row = {
                "tokens": length,
                "cp": cp,
                "documents": len(docs),
                "all_to_all_imbalance": 1.0,
                "ring_contiguous_imbalance": imbalance["contiguous"],
                "ring_head_tail_imbalance": imbalance["head_tail"],
                **sent,
                "all_to_all_fits_heads": args.kv_heads % cp == 0,
            }
            rows.append(row)
            print(
                f"{length:>10} | {cp:>2} | 1.00, {imbalance['contiguous']:.2f}, {imbalance['head_tail']:.2f} | "
                f"{sent['ulysses_gb']:.1f}, {sent['ring_gb']:.1f}"
            )
    out = RESULTS / "cp.json"
    write_results(out, {"model": vars(args), "rows": rows})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
