"""Data-path benchmarks: packing quality and memory, and loader throughput vs training.

    python benchmarks/data.py                      # both parts, CPU
    python benchmarks/data.py --part packing       # packing only (seconds)

Packing: one long-tailed mix of samples (log-normal text lengths, 0-2 images of 64-4096
patches, 4 patches per image token), seq_len 8192, image-patch budget 3 x 8192, compared:
  offline BFD   `vlmcore pack`: best fit decreasing over the whole dataset, both budgets
  online BFD    `build_online_loader`: the same algorithm over a buffer of 1000 samples
  seed FFD      the seed project: sort a buffer of 1000 encoded samples, fill one sequence at a
                time first-fit by tokens only, repack when the buffer is used up
Memory held is what the packer keeps per buffer: the seed keeps every encoded sample, pixels
included (float32, patches x 1536 x 4 B); vlmcore's online buffer keeps token ids and the
compressed image bytes (assumed 10x smaller than raw RGB); offline keeps two ints per sample.

Loader: the demo model and synthetic conversations, packed at seq_len 1024, read through
`build_loader` with 0, 1 and 2 workers (samples/s, real tokens/s), next to the rate at which a
forward+backward of the demo model consumes the same batches on this machine.
Writes benchmarks/results/data_<part>.json and prints a table.
"""

import argparse
import json
import os
import random
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

from vlmcore.data.packing import best_fit_decreasing  # noqa: E402

RESULTS = Path(__file__).parent / "results"
PATCH_DIM = 3 * 2 * 16 * 16


def long_tailed_mix(n: int, seed: int = 0) -> tuple[list[int], list[int]]:
    rng = random.Random(seed)
    tokens, patches = [], []
    for _ in range(n):
        image_patches = sum(rng.choice([64, 256, 1024, 4096]) for _ in range(rng.choice([0, 0, 1, 1, 1, 2])))
        tokens.append(min(8192, max(8, int(rng.lognormvariate(5.0, 1.2))) + image_patches // 4))
        patches.append(image_patches)
    return tokens, patches


def seed_first_fit(tokens: list[int], seq_len: int) -> list[list[int]]:
    """The seed's packer on one buffer: sort descending, fill one sequence at a time first-fit."""
    remaining = sorted(range(len(tokens)), key=lambda i: -tokens[i])
    bins = []
    while remaining:
        current, used, rest = [remaining[0]], tokens[remaining[0]], []
        for i in remaining[1:]:
            if used + tokens[i] <= seq_len:
                current.append(i)
                used += tokens[i]
            else:
                rest.append(i)
        bins.append(current)
        remaining = rest
    return bins


def buffered(pack_buffer, n: int, buffer_size: int) -> list[list[int]]:
    bins = []
    for start in range(0, n, buffer_size):
        ids = list(range(start, min(n, start + buffer_size)))
        bins += [[ids[i] for i in b] for b in pack_buffer(ids)]
    return bins


def bench_packing(n: int, seq_len: int, max_patches: int, buffer_size: int) -> list[dict]:
    tokens, patches = long_tailed_mix(n)
    mean_pixels = sum(patches) / n * PATCH_DIM * 4
    mean_tokens = sum(tokens) / n
    methods = {
        "offline BFD (vlmcore pack)": (
            lambda: best_fit_decreasing(tokens, patches, seq_len, max_patches), n * 16),
        f"online BFD, buffer {buffer_size} (vlmcore)": (
            lambda: buffered(lambda ids: best_fit_decreasing([tokens[i] for i in ids], [patches[i] for i in ids],
                                                             seq_len, max_patches), n, buffer_size),
            buffer_size * (mean_tokens * 8 + mean_pixels / 8 / 10)),
        f"seed FFD, buffer {buffer_size} (tokens only)": (
            lambda: buffered(lambda ids: seed_first_fit([tokens[i] for i in ids], seq_len), n, buffer_size),
            buffer_size * (mean_tokens * 8 + mean_pixels)),
    }
    rows = []
    for name, (run, held_bytes) in methods.items():
        t0 = time.perf_counter()
        bins = run()
        seconds = time.perf_counter() - t0
        rows.append({
            "method": name,
            "samples": n,
            "packs": len(bins),
            "efficiency": sum(tokens) / (len(bins) * seq_len),
            "packs_over_patch_budget": sum(sum(patches[i] for i in b) > max_patches for b in bins),
            "memory_held_mb": held_bytes / 2**20,
            "seconds": seconds,
        })
    return rows


def bench_loader(num_train: int, seq_len: int, max_patches: int, batches: int, worker_counts: list[int]) -> list[dict]:
    from vlmcore.data.loader import build_loader
    from vlmcore.data.pack import pack
    from vlmcore.data.prepare import prepare
    from vlmcore.data.synthetic import generate
    from vlmcore.download import build_tiny_model
    from vlmcore.models import from_pretrained

    root = Path(tempfile.mkdtemp(prefix="vlmcore-bench-data-"))
    build_tiny_model(root / "model")
    generate(root / "raw", num_train=num_train, num_eval=1)
    prepare([root / "raw" / "conversations.jsonl"], root / "data", shard_size=64)
    pack(root / "data", root / "model", root / "packed", seq_len=seq_len, max_patches=max_patches, shard_size=16)

    rows, sample_batches = [], []
    for workers in worker_counts:
        loader = build_loader(root / "packed", dp_rank=0, dp_world=1, micro_batch_size=1, seed=0, num_workers=workers)
        it = iter(loader)
        next(it)  # worker start-up and first fill
        samples = tokens = 0
        t0 = time.perf_counter()
        for _ in range(batches):
            batch = next(it)
            samples += batch["num_samples"]
            tokens += int(batch["cu_seqlens"][-1]) - padding(batch)
            if len(sample_batches) < 4:
                sample_batches.append(batch)
        seconds = time.perf_counter() - t0
        rows.append({"reader": f"build_loader, {workers} workers", "samples_per_s": samples / seconds,
                     "tokens_per_s": tokens / seconds, "batches": batches})
        del it, loader

    model = from_pretrained(root / "model")
    model.train()
    samples = tokens = 0
    t0 = time.perf_counter()
    for batch in sample_batches * 2:
        inputs = {k: batch[k] for k in ("input_ids", "pixel_values", "image_grid_thw", "position_ids", "cu_seqlens") if k in batch}
        logits = model(**inputs).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten(), reduction="sum")
        loss.backward()
        samples += batch["num_samples"]
        tokens += int(batch["cu_seqlens"][-1]) - padding(batch)
    seconds = time.perf_counter() - t0
    rows.append({"reader": "training fwd+bwd of the demo model (consumer)", "samples_per_s": samples / seconds,
                 "tokens_per_s": tokens / seconds, "batches": len(sample_batches) * 2})
    return rows


def padding(batch: dict) -> int:
    """Tokens in the row-padding segments (segments without any label)."""
    labels = batch["labels"].flatten()
    cu = batch["cu_seqlens"].tolist()
    return sum(b - a for a, b in zip(cu[:-1], cu[1:]) if (labels[a:b] == -100).all())


def print_table(rows: list[dict]) -> None:
    keys = list(rows[0])
    print(" | ".join(keys))
    for row in rows:
        print(" | ".join(f"{row[k]:.4g}" if isinstance(row[k], float) else str(row[k]) for k in keys))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=["packing", "loader", "all"], default="all")
    parser.add_argument("--samples", type=int, default=20000, help="samples in the packing mix")
    parser.add_argument("--num-train", type=int, default=512, help="synthetic conversations for the loader part")
    parser.add_argument("--batches", type=int, default=30, help="batches timed per worker count")
    args = parser.parse_args()
    RESULTS.mkdir(exist_ok=True)
    if args.part in ("packing", "all"):
        rows = bench_packing(args.samples, seq_len=8192, max_patches=3 * 8192, buffer_size=1000)
        print_table(rows)
        (RESULTS / "data_packing.json").write_text(json.dumps(rows, indent=2) + "\n")
    if args.part in ("loader", "all"):
        rows = bench_loader(args.num_train, seq_len=1024, max_patches=4096, batches=args.batches, worker_counts=[0, 1, 2])
        print_table(rows)
        (RESULTS / "data_loader.json").write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
