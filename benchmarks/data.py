"""Data-path benchmarks: packing quality and memory, and loader throughput vs training.

    python benchmarks/data.py                      # both parts, CPU
    python benchmarks/data.py --part packing       # packing only (seconds)
    python benchmarks/data.py --part bfd-scaling   # best fit decreasing at 100k..1.6M samples
    python benchmarks/data.py --part pack --pack-samples 10000 100000 --workers 1 2

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

BFD scaling: the offline packer alone on the same mix at 100k, 400k and 1.6M samples with the
patch budget binding (seq_len 8192, 3 x 8192 patches): CPU seconds per million samples should
stay flat (the old scan was quadratic there: 1.6M in 92 s).

Pack at scale: `vlmcore pack` end to end on a synthetic prepared dataset written straight into
tar shards (the demo's scenes and texts over a pool of 256 images, half captions half
conversations, 1000 samples per shard; its .nv-meta/.info.json is written directly rather than
by `energon prepare`, which is not part of pack). Seq_len 1024, demo model. Reports the wall time
and CPU seconds of each phase, the peak memory of the main process and of the whole tree (the
workers by their unique memory, sampled every 0.2 s), the per-sample state, and extrapolates to
10M samples on N cores by CPU seconds: measuring, writing and the output's `energon prepare`
divide by the cores, best fit does not.
Writes benchmarks/results/data_<part>.json and prints a table.
"""

import argparse
import json
import os
import random
import re
import subprocess
import sys
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


def bench_bfd_scaling(sizes: list[int], seq_len: int, max_patches: int) -> list[dict]:
    rows = []
    for n in sizes:
        tokens, patches = long_tailed_mix(n)
        t0 = time.process_time()
        bins = best_fit_decreasing(tokens, patches, seq_len, max_patches)
        seconds = time.process_time() - t0
        rows.append({"samples": n, "packs": len(bins), "efficiency": sum(tokens) / (len(bins) * seq_len),
                     "max_patches_in_a_pack": max(sum(patches[i] for i in b) for b in bins),
                     "cpu_seconds": seconds, "cpu_seconds_per_million": seconds / n * 1e6})
    return rows


def write_synthetic_prepared(out_dir: Path, n: int, shard_size: int = 1000, seed: int = 0) -> None:
    """A prepared dataset of `n` demo-like samples, fast: 256 images drawn once, reused."""
    import io
    import tarfile

    from vlmcore.data.synthetic import caption_for, conversation_for, draw_scene, random_scene

    rng = random.Random(seed)
    pool = []
    for _ in range(256):
        scene = random_scene(rng, 32, 112)
        png = io.BytesIO()
        draw_scene(scene).save(png, format="PNG")
        pool.append((scene, png.getvalue()))
    out_dir.mkdir(parents=True)
    counts, tar = {}, None
    for i in range(n):
        if i % shard_size == 0:
            if tar:
                tar.close()
            name = f"shard-{i // shard_size:06d}.tar"
            tar, counts[name] = tarfile.open(out_dir / name, "w"), 0
        scene, png = pool[rng.randrange(len(pool))]
        if i % 2 == 0:
            messages = [{"role": "user", "content": "<image>"}, {"role": "assistant", "content": caption_for(scene, rng)}]
            images = [png]
        elif i % 10 == 9:
            other, other_png = pool[rng.randrange(len(pool))]
            messages, images = conversation_for([scene, other], rng), [png, other_png]
        else:
            messages, images = conversation_for([scene], rng), [png]
        names = [f"img{k}.png" for k in range(len(images))]
        parts = [("json", json.dumps({"messages": messages, "images": names}).encode()), *zip(names, images)]
        for part, data in parts:
            info = tarfile.TarInfo(f"{i:09d}.{part}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        counts[name] += 1
    tar.close()
    (out_dir / ".nv-meta").mkdir()
    (out_dir / ".nv-meta" / ".info.json").write_text(json.dumps({"shard_counts": counts}))


def bench_pack(sizes: list[int], worker_counts: list[int], seq_len: int, max_patches: int, cores: int) -> list[dict]:
    import psutil

    from vlmcore.download import build_tiny_model

    root = Path(tempfile.mkdtemp(prefix="vlmcore-bench-pack-"))
    build_tiny_model(root / "model")
    rows = []
    for n in sizes:
        data = root / f"data_{n}"
        t0 = time.perf_counter()
        write_synthetic_prepared(data, n)
        generate_seconds = time.perf_counter() - t0
        for workers in worker_counts:
            out = root / f"packed_{n}_{workers}"
            cmd = [sys.executable, "-m", "vlmcore.cli", "pack", "--data", str(data), "--model", str(root / "model"),
                   "--out", str(out), "--seq-len", str(seq_len), "--max-patches", str(max_patches),
                   "--workers", str(workers)]
            env = {**os.environ, "TQDM_DISABLE": "1"}
            t0 = time.perf_counter()
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
            main = psutil.Process(proc.pid)
            peak_main = peak_tree = 0
            while proc.poll() is None:
                try:  # workers count by their unique memory: the libraries they map are shared
                    rss = main.memory_info().rss
                    unique = sum(p.memory_full_info().uss for p in main.children(recursive=True))
                    peak_main, peak_tree = max(peak_main, rss), max(peak_tree, rss + unique)
                except psutil.Error:
                    pass
                time.sleep(0.2)
            stdout, stderr = proc.communicate()
            wall = time.perf_counter() - t0
            (root / f"pack_{n}_{workers}.log").write_text(stderr)
            if proc.returncode:
                raise RuntimeError(f"pack failed:\n{stderr[-3000:]}")
            phases = {name: re.search(rf"{name}: .* in ([0-9.]+) s \(([0-9.]+) CPU s", stderr).groups()
                      for name in ("measure", "best fit", "write", "index")}
            wall_s = {name: float(w) for name, (w, _) in phases.items()}
            cpu_s = {name: float(c) for name, (_, c) in phases.items()}
            state = int(re.search(r"state ([0-9]+) bytes", stderr).group(1))
            stats = json.loads(stdout.strip().splitlines()[-1])
            startup = wall - sum(wall_s.values())  # imports, model files: constant
            # Extrapolation by CPU seconds (this machine is shared, its wall times are not this
            # process's): measuring, writing and indexing over the cores, best fit in one process.
            parallel_cpu = cpu_s["measure"] + cpu_s["write"] + cpu_s["index"]
            serial_cpu = cpu_s["best fit"]
            rows.append({
                "samples": n, "workers": workers, "generate_s": generate_seconds, "wall_s": wall,
                **{f"{name.replace(' ', '_')}_s": wall_s[name] for name in phases},
                **{f"{name.replace(' ', '_')}_cpu_s": cpu_s[name] for name in phases},
                "measure_samples_per_s_per_core": n / cpu_s["measure"], "samples_per_s": n / wall,
                "peak_main_mb": peak_main / 2**20, "peak_total_mb": peak_tree / 2**20,
                "state_bytes_per_sample": state / n, "packs": stats["packs"], "efficiency": stats["efficiency"],
                f"extrapolated_10M_s_on_{cores}_cores": 1e7 * (parallel_cpu / n / cores + serial_cpu / n) + startup,
            })
            print_table(rows[-1:])
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
    parser.add_argument("--part", choices=["packing", "loader", "bfd-scaling", "pack", "all"], default="all")
    parser.add_argument("--pack-samples", type=int, nargs="+", default=[10000, 100000], help="sizes for --part pack")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="measuring processes for --part pack")
    parser.add_argument("--cores", type=int, default=32, help="cores of the node the pack part extrapolates to")
    parser.add_argument("--samples", type=int, default=20000, help="samples in the packing mix")
    parser.add_argument("--num-train", type=int, default=512, help="synthetic conversations for the loader part")
    parser.add_argument("--batches", type=int, default=30, help="batches timed per worker count")
    args = parser.parse_args()
    RESULTS.mkdir(exist_ok=True)
    if args.part in ("packing", "all"):
        rows = bench_packing(args.samples, seq_len=8192, max_patches=3 * 8192, buffer_size=1000)
        print_table(rows)
        (RESULTS / "data_packing.json").write_text(json.dumps(rows, indent=2) + "\n")
    if args.part in ("bfd-scaling", "all"):
        rows = bench_bfd_scaling([100000, 400000, 1600000], seq_len=8192, max_patches=3 * 8192)
        print_table(rows)
        (RESULTS / "data_bfd_scaling.json").write_text(json.dumps(rows, indent=2) + "\n")
    if args.part == "pack":  # minutes: not part of "all"
        rows = bench_pack(args.pack_samples, args.workers, seq_len=1024, max_patches=4096, cores=args.cores)
        name = "_".join(str(n) for n in args.pack_samples)
        (RESULTS / f"data_pack_{name}.json").write_text(json.dumps(rows, indent=2) + "\n")
    if args.part in ("loader", "all"):
        rows = bench_loader(args.num_train, seq_len=1024, max_patches=4096, batches=args.batches, worker_counts=[0, 1, 2])
        print_table(rows)
        (RESULTS / "data_loader.json").write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
