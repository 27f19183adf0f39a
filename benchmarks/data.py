"""Data-path benchmarks: packing quality and memory, and loader throughput vs training.

    python benchmarks/data.py                      # both parts, CPU
    python benchmarks/data.py --part packing       # packing only (seconds)
    python benchmarks/data.py --part bfd-scaling   # best fit decreasing at 100k..1.6M samples
    python benchmarks/data.py --part pack --pack-samples 10000 100000 --workers 1 2
    python benchmarks/data.py --part pack-split --pack-samples 100000 --write-jobs 2
    python benchmarks/data.py --part mixing        # the loader's epoch order against a uniform shuffle
    python benchmarks/data.py --part online        # online packing: measuring every buffer vs making a rank's rows
    python benchmarks/data.py --part video         # rows of 720p/1080p H.264 clips vs one H100's need (minutes)

Packing: one long-tailed mix of samples (log-normal text lengths, 0-2 images of 64-4096
patches, 4 patches per image token), seq_len 8192, image-patch budget 3 x 8192, compared:
  offline BFD   `vlmcore pack`: best fit decreasing over the whole dataset, both budgets
  online BFD    `build_online_loader`: the same algorithm over a buffer of 1000 samples
  seed FFD      the seed project: sort a buffer of 1000 encoded samples, fill one sequence at a
                time first-fit by tokens only, repack when the buffer is used up
Memory held is what the packer keeps per buffer: the seed keeps every encoded sample, pixels
included (float32, patches x 1536 x 4 B); vlmcore's online packer keeps the sample indices of
its last three buffers' packs (a row's samples are read again by index); offline keeps two ints
per sample.

Loader: image-caption samples over photo-like JPEGs (q90; half 1024x768 and half 640x480, and
a high-resolution 2048x1536 case), packed into 8,192-token rows for a model with Qwen3-VL's image
processor defaults, read through `build_loader` with 0, 1 and 2 workers: rows/s, CPU seconds per
row (this process and its workers) and rows/s per core, and how many times one H100's need (2B
model, 0.35 s per row) the cores a GPU gets on MN5 (20) and JUPITER (72) deliver.

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
Pack split: the same pack as the workflow runs it with pack.write_jobs > 1 (a plan job, N
concurrent write jobs, the finishing pack job), one process each, against one plain pack: wall
and CPU seconds of each step, the plan's bytes on disk per sample, and whether the output is
byte-identical.
Mixing: 20,000 demo-like samples packed into 1,024-token rows at pack shard sizes 16 and 1000;
one epoch's pack order through `build_loader` (1 and 2 data-parallel ranks) against a uniform
shuffle (vlmcore.data.load.mixing: rank correlation with the disk order, distance between disk
neighbours, clustering of 16-pack blocks), and the seconds to read the epoch.
Writes benchmarks/results/data_<part>.json and prints a table.
"""

import argparse
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import RESULTS, write_results

os.environ.setdefault("OMP_NUM_THREADS", "1")

from vlmcore.data.pack.bin_packing import best_fit_decreasing  # noqa: E402

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
        "offline BFD (vlmcore pack)": (lambda: best_fit_decreasing(tokens, patches, seq_len, max_patches), n * 16),
        f"online BFD, buffer {buffer_size} (vlmcore)": (
            lambda: buffered(
                lambda ids: best_fit_decreasing(
                    [tokens[i] for i in ids], [patches[i] for i in ids], seq_len, max_patches
                ),
                n,
                buffer_size,
            ),
            3 * buffer_size * 8,
        ),  # the last three buffers' plans: sample indices
        f"seed FFD, buffer {buffer_size} (tokens only)": (
            lambda: buffered(lambda ids: seed_first_fit([tokens[i] for i in ids], seq_len), n, buffer_size),
            buffer_size * (mean_tokens * 8 + mean_pixels),
        ),
    }
    rows = []
    for name, (run, held_bytes) in methods.items():
        t0 = time.perf_counter()
        bins = run()
        seconds = time.perf_counter() - t0
        rows.append(
            {
                "method": name,
                "samples": n,
                "packs": len(bins),
                "efficiency": sum(tokens) / (len(bins) * seq_len),
                "packs_over_patch_budget": sum(sum(patches[i] for i in b) > max_patches for b in bins),
                "memory_held_mb": held_bytes / 2**20,
                "seconds": seconds,
            }
        )
    return rows


def bench_bfd_scaling(sizes: list[int], seq_len: int, max_patches: int) -> list[dict]:
    rows = []
    for n in sizes:
        tokens, patches = long_tailed_mix(n)
        t0 = time.process_time()
        bins = best_fit_decreasing(tokens, patches, seq_len, max_patches)
        seconds = time.process_time() - t0
        rows.append(
            {
                "samples": n,
                "packs": len(bins),
                "efficiency": sum(tokens) / (len(bins) * seq_len),
                "max_patches_in_a_pack": max(sum(patches[i] for i in b) for b in bins),
                "cpu_seconds": seconds,
                "cpu_seconds_per_million": seconds / n * 1e6,
            }
        )
    return rows


def write_synthetic_prepared(out_dir: Path, n: int, shard_size: int = 1000, seed: int = 0) -> None:
    """A prepared dataset of `n` demo-like samples, fast: 256 images drawn once, reused."""
    import io
    import tarfile

    from vlmcore.data.synthetic.image import caption_for, conversation_for, draw_scene, random_scene

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
            messages = [
                {"role": "user", "content": "<image>"},
                {"role": "assistant", "content": caption_for(scene, rng)},
            ]
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
            cmd = [
                sys.executable,
                "-m",
                "vlmcore.cli",
                "pack",
                "--data",
                str(data),
                "--model",
                str(root / "model"),
                "--out",
                str(out),
                "--seq-len",
                str(seq_len),
                "--max-patches",
                str(max_patches),
                "--workers",
                str(workers),
            ]
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
            phases = {
                name: re.search(rf"{name}: .* in ([0-9.]+) s \(([0-9.]+) CPU s", stderr).groups()
                for name in ("measure", "best fit", "write", "index")
            }
            wall_s = {name: float(w) for name, (w, _) in phases.items()}
            cpu_s = {name: float(c) for name, (_, c) in phases.items()}
            state = int(re.search(r"state ([0-9]+) bytes", stderr).group(1))
            stats = json.loads(stdout.strip().splitlines()[-1])
            startup = wall - sum(wall_s.values())  # imports, model files: constant
            # Extrapolation by CPU seconds (this machine is shared, its wall times are not this
            # process's): measuring, writing and indexing over the cores, best fit in one process.
            parallel_cpu = cpu_s["measure"] + cpu_s["write"] + cpu_s["index"]
            serial_cpu = cpu_s["best fit"]
            rows.append(
                {
                    "samples": n,
                    "workers": workers,
                    "generate_s": generate_seconds,
                    "wall_s": wall,
                    **{f"{name.replace(' ', '_')}_s": wall_s[name] for name in phases},
                    **{f"{name.replace(' ', '_')}_cpu_s": cpu_s[name] for name in phases},
                    "measure_samples_per_s_per_core": n / cpu_s["measure"],
                    "samples_per_s": n / wall,
                    "peak_main_mb": peak_main / 2**20,
                    "peak_total_mb": peak_tree / 2**20,
                    "state_bytes_per_sample": state / n,
                    "packs": stats["packs"],
                    "efficiency": stats["efficiency"],
                    f"extrapolated_10M_s_on_{cores}_cores": 1e7 * (parallel_cpu / n / cores + serial_cpu / n) + startup,
                }
            )
            print_table(rows[-1:])
    return rows


def bench_resume(n: int, seq_len: int, max_patches: int) -> list[dict]:
    """The training loader on a corpus-scale pack (issue 32, item 4): building it, finding the
    position of a resume at growing row counts (`seek`, then the first batch), the state a
    checkpoint keeps, and reading on from there."""
    import pickle

    from vlmcore.data.load.loader import build_loader
    from vlmcore.download import build_tiny_model

    root = Path(tempfile.mkdtemp(prefix="vlmcore-bench-resume-"))
    build_tiny_model(root / "model")
    write_synthetic_prepared(root / "data", n)
    out = root / "packed"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "vlmcore.cli",
            "pack",
            "--data",
            str(root / "data"),
            "--model",
            str(root / "model"),
            "--out",
            str(out),
            "--seq-len",
            str(seq_len),
            "--max-patches",
            str(max_patches),
            "--workers",
            "2",
        ],
        check=True,
        capture_output=True,
        env={**os.environ, "TQDM_DISABLE": "1"},
    )
    rows = []
    for blend in (False, True):
        path = out
        if blend:  # the same packs twice, weighted 2:1: a blend's resume counts the draws before the row
            from vlmcore.blend import write_blend

            path = root / "blend.yaml"
            write_blend(path, [(out, 2), (out, 1)])
        start = time.perf_counter()
        loader = build_loader(path, dp_rank=0, dp_world=1, micro_batch_size=1, seed=0, num_workers=0)
        build_s = time.perf_counter() - start
        packs = sum(len(d) for d in loader.datasets)
        for at in (0, packs // 2, 10 * packs):
            loader = build_loader(path, dp_rank=0, dp_world=1, micro_batch_size=1, seed=0, num_workers=0)
            start = time.perf_counter()
            loader.seek(at)
            it = iter(loader)
            next(it)
            first_s = time.perf_counter() - start
            start = time.perf_counter()
            for _ in range(200):
                next(it)
            per_row = (time.perf_counter() - start) / 200
            rows.append(
                {
                    "samples": n,
                    "packs": packs,
                    "blend": blend,
                    "build_s": build_s,
                    "resume_at_row": at,
                    "seek_and_first_batch_s": first_s,
                    "next_rows_ms": per_row * 1e3,
                    "state_bytes": len(pickle.dumps(loader.state_dict())),
                }
            )
            print_table(rows[-1:])
    return rows


def children_cpu_seconds() -> float:
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def bench_pack_split(n: int, write_jobs: int, seq_len: int, max_patches: int) -> list[dict]:
    """The workflow's split of one pack: `--plan-only`, `write_jobs` concurrent `--write-group g/N`
    processes, then the plain pack that indexes and renames, against one plain pack; each step's
    wall and CPU seconds (one process each), the plan's size on disk, and whether the bytes match."""
    from vlmcore.download import build_tiny_model

    root = Path(tempfile.mkdtemp(prefix="vlmcore-bench-pack-split-"))
    build_tiny_model(root / "model")
    write_synthetic_prepared(root / "data", n)
    env = {**os.environ, "TQDM_DISABLE": "1"}

    def command(out: Path, *step: str) -> list[str]:
        return [
            sys.executable,
            "-m",
            "vlmcore.cli",
            "pack",
            "--data",
            str(root / "data"),
            "--model",
            str(root / "model"),
            "--out",
            str(out),
            "--seq-len",
            str(seq_len),
            "--max-patches",
            str(max_patches),
            "--workers",
            "1",
            *step,
        ]

    def run(*commands: list[str]) -> tuple[float, float]:
        """Runs the commands at once; their wall and CPU seconds."""
        t0, cpu0 = time.perf_counter(), children_cpu_seconds()
        procs = [
            subprocess.Popen(c, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env) for c in commands
        ]
        for proc in procs:
            if proc.wait():
                raise RuntimeError(f"pack failed:\n{proc.stderr.read()[-3000:]}")
        return time.perf_counter() - t0, children_cpu_seconds() - cpu0

    single = run(command(root / "single"))
    out = root / "split"
    plan = run(command(out, "--plan-only"))
    plan_bytes = sum(f.stat().st_size for f in (root / "split.partial" / "plan").iterdir())
    write = run(*[command(out, "--write-group", f"{g}/{write_jobs}") for g in range(write_jobs)])
    finish = run(command(out))

    def files(d: Path) -> dict:
        return {f.relative_to(d): f.read_bytes() for f in d.rglob("*") if f.is_file() and f.name != "index.uuid"}

    row = {
        "samples": n,
        "write_jobs": write_jobs,
        "single_wall_s": single[0],
        "single_cpu_s": single[1],
        "plan_wall_s": plan[0],
        "plan_cpu_s": plan[1],
        "write_wall_s": write[0],
        "write_cpu_s": write[1],
        "finish_wall_s": finish[0],
        "finish_cpu_s": finish[1],
        "plan_bytes_per_sample": plan_bytes / n,
        "same_bytes": files(out) == files(root / "single"),
    }
    print_table([row])
    return [row]


# One H100 trains the 2B Qwen3-VL at about 0.35 s per 8,192-token row (issue 17's estimate, ~23k tokens/s;
# the seed project reports 15k tokens/s per GH200 for its 2B model, so this need is on the safe side);
# the CPU cores a GPU gets: MareNostrum 5 ACC (80 cores, 4 H100) and JUPITER (288 cores, 4 GH200).
GPU_SECONDS_PER_ROW = 0.35
CORES_PER_GPU = {"MN5": 20, "JUPITER": 72}
IMAGE_MIXES = {"jpeg mix 1024x768 / 640x480": [(1024, 768), (640, 480)], "high-res 2048x1536": [(2048, 1536)]}


def natural_pixels(width: int, height: int, rng):
    """Photo-like RGB pixels: smooth colour fields from upsampled noise, plus fine grain."""
    import numpy as np
    from PIL import Image

    coarse = Image.fromarray(rng.integers(0, 256, (6, 8, 3), dtype=np.uint8)).resize((width, height), Image.BICUBIC)
    grain = rng.normal(0, 12, (height, width, 3))
    return np.clip(np.asarray(coarse, dtype=np.float32) + grain, 0, 255).astype(np.uint8)


def natural_jpeg(width: int, height: int, rng) -> bytes:
    """A photo-like JPEG (q90) of `natural_pixels`."""
    import io

    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(natural_pixels(width, height, rng)).save(out, format="JPEG", quality=90)
    return out.getvalue()


def image_dataset(
    root: Path, sizes: list[tuple[int, int]], num_samples: int, distinct: int = 8, packed: bool = True
) -> Path:
    """Captions of 20-120 words over `distinct` JPEGs per size, prepared and (if `packed`) packed
    into 8,192-token rows for a model with Qwen3-VL's image processor defaults."""
    import numpy as np

    from vlmcore.data.media.processor import write_processor_files
    from vlmcore.data.pack.dataset import pack
    from vlmcore.data.prepare.dataset import prepare
    from vlmcore.download import build_tiny_model

    rng = np.random.default_rng(0)
    build_tiny_model(root / "model")
    write_processor_files(root / "model", min_pixels=65536, max_pixels=16777216)  # Qwen3-VL's published sizes
    (root / "images").mkdir()
    names = []
    for w, h in sizes:
        for i in range(distinct):
            names.append(f"{w}x{h}_{i}.jpg")
            (root / "images" / names[-1]).write_bytes(natural_jpeg(w, h, rng))
    words = [
        "a",
        "photo",
        "of",
        "the",
        "scene",
        "shows",
        "some",
        "objects",
        "near",
        "the",
        "middle",
        "and",
        "left",
        "side",
    ]
    with open(root / "captions.jsonl", "w") as f:
        for i in range(num_samples):
            caption = " ".join(rng.choice(words, int(rng.integers(20, 120))))
            f.write(json.dumps({"id": f"s{i}", "image": names[i % len(names)], "caption": caption}) + "\n")
    prepare([f"captions:{root / 'captions.jsonl'}"], root / "data", images=root / "images", shard_size=64)
    if not packed:
        return root / "data"
    pack(root / "data", root / "model", root / "packed", seq_len=8192, max_patches=4 * 8192, shard_size=8)
    return root / "packed"


def cpu_seconds() -> float:
    """CPU time of this process and its live children (the loader workers), from /proc."""
    total = time.process_time()
    pid = os.getpid()
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    for child in children:
        fields = Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime
    return total


def paced_data_wait(it, rows: int) -> tuple[float, float]:
    """Mean time `next` blocks when each row is consumed by a step of GPU_SECONDS_PER_ROW, as the
    training loop measures `data_wait_s` (the step is a sleep: this machine has no GPU), and the
    CPU time the training process itself spends in `next` (receiving the batch)."""
    wait = receive = 0.0
    for _ in range(rows):
        t0, c0 = time.perf_counter(), time.thread_time()
        next(it)
        wait += time.perf_counter() - t0
        receive += time.thread_time() - c0
        time.sleep(GPU_SECONDS_PER_ROW)
    return wait / rows, receive / rows


def bench_loader(rows: int, worker_counts: list[int], samples: int) -> list[dict]:
    """Rows/s of `build_loader` over realistic JPEG rows, per CPU core, against one H100's need."""
    from vlmcore.data.load.loader import build_loader

    need = 1 / GPU_SECONDS_PER_ROW
    results = []
    for mix, sizes in IMAGE_MIXES.items():
        packed = image_dataset(Path(tempfile.mkdtemp(prefix="vlmcore-bench-loader-")), sizes, samples)
        for workers in worker_counts:
            loader = build_loader(packed, dp_rank=0, dp_world=1, micro_batch_size=1, seed=0, num_workers=workers)
            it = iter(loader)
            next(it)  # worker start-up and first fill
            images = 0
            t0, c0 = time.perf_counter(), cpu_seconds()
            for _ in range(rows):
                images += len(next(it).images.grids())
            seconds, cpu = time.perf_counter() - t0, cpu_seconds() - c0
            per_core = rows / cpu
            wait, receive = paced_data_wait(it, rows)
            results.append(
                {
                    "images": mix,
                    "workers": workers,
                    "rows": rows,
                    "images_per_row": images / rows,
                    "rows_per_s": rows / seconds,
                    "cpu_s_per_row": cpu / rows,
                    "rows_per_s_per_core": per_core,
                    **{f"x_need_{name}": per_core * cores / need for name, cores in CORES_PER_GPU.items()},
                    "data_wait_of_step": wait / GPU_SECONDS_PER_ROW,
                    "receive_ms": receive * 1e3,
                }
            )
            del it, loader
    return results


VIDEO_CLIPS = {
    "720p 10 s": (1280, 720, 10),
    "720p 60 s": (1280, 720, 60),
    "1080p 10 s": (1920, 1080, 10),
    "1080p 30 s": (1920, 1080, 30),
}
# Qwen3-VL's published video processor settings (Qwen3-VL-2B-Instruct's video_preprocessor_config.json).
QWEN3_VL_VIDEO = {"fps": 2.0, "min_frames": 4, "max_frames": 768, "min_pixels": 4096, "max_pixels": 25165824}
GPU_SECONDS_PER_TOKEN = GPU_SECONDS_PER_ROW / 8192  # the 2B model on one H100 (the image loader's estimate)


def natural_clip(width: int, height: int, seconds: int, rng) -> bytes:
    """An H.264 clip (30 fps, x264 veryfast, CRF 23, keyframe every 250 frames: x264's default)
    of smooth colour fields panning under moving shapes and grain: decoding it costs what a
    camera clip of that size does, not what a flat test pattern does."""
    import io

    import av
    import numpy as np

    base = natural_pixels(width * 2, height, rng)
    out = io.BytesIO()
    with av.open(out, "w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=30, options={"preset": "veryfast", "crf": "23"})
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for i in range(30 * seconds):
            x = (i * 3) % width
            frame = base[:, x : x + width].copy()
            y, s = int(height / 2 + height / 3 * np.sin(i / 20)), height // 8
            frame[max(0, y - s) : y + s, (i * 7) % (width - 2 * s) : (i * 7) % (width - 2 * s) + 2 * s] = (220, 60, 40)
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return out.getvalue()


def bench_video(clips: dict, worker_counts: list[int], rows: int) -> list[dict]:
    """Rows with one clip each (prepare -> pack -> `build_loader`, Qwen3-VL's video settings) per
    CPU core, against what one H100 trains on the 2B model per token."""
    import numpy as np

    from vlmcore.data.load.loader import build_loader
    from vlmcore.data.media.processor import write_processor_files
    from vlmcore.data.pack.dataset import pack
    from vlmcore.data.prepare.dataset import prepare
    from vlmcore.download import build_tiny_model

    results = []
    for name, (width, height, seconds) in clips.items():
        root = Path(tempfile.mkdtemp(prefix="vlmcore-bench-video-"))
        build_tiny_model(root / "model")
        write_processor_files(root / "model", min_pixels=65536, max_pixels=16777216)
        t0 = time.perf_counter()
        (root / "clip.mp4").write_bytes(natural_clip(width, height, seconds, np.random.default_rng(0)))
        encode_s = time.perf_counter() - t0
        with open(root / "videos.jsonl", "w") as f:
            for i in range(rows + 1):
                f.write(
                    json.dumps({"video": "clip.mp4", "caption": f"clip {i}: a red block moves over a landscape"}) + "\n"
                )
        prepare([root / "videos.jsonl"], root / "data", shard_size=64)
        stats = pack(
            root / "data",
            root / "model",
            root / "packed",
            seq_len=32768,
            max_patches=4 * 32768,
            shard_size=8,
            video=QWEN3_VL_VIDEO,
        )
        for workers in worker_counts:
            loader = build_loader(
                root / "packed", dp_rank=0, dp_world=1, micro_batch_size=1, seed=0, num_workers=workers
            )
            it = iter(loader)
            next(it)  # worker start-up and the first row
            tokens = 0
            t0, c0 = time.perf_counter(), cpu_seconds()
            for _ in range(rows):
                tokens += int((next(it).segment_lengths()[:-1]).sum())
            seconds_, cpu = time.perf_counter() - t0, cpu_seconds() - c0
            need_cpu = tokens / rows * GPU_SECONDS_PER_TOKEN  # GPU seconds a row's tokens take, per row
            results.append(
                {
                    "clip": name,
                    "workers": workers,
                    "clip_mb": (root / "clip.mp4").stat().st_size / 1e6,
                    "clips_per_row": stats["samples"] / stats["packs"],
                    "tokens_per_row": tokens / rows,
                    "cpu_s_per_row": cpu / rows,
                    "rows_per_s": rows / seconds_,
                    **{f"x_need_{c}": cores * need_cpu / (cpu / rows) for c, cores in CORES_PER_GPU.items()},
                    "encode_clip_s": encode_s,
                }
            )
            del it, loader
        shutil.rmtree(root, ignore_errors=True)
    return results


def bench_online(samples: int, buffer_size: int, dp_worlds: list[int], workers: int) -> list[dict]:
    """Online packing in the global order (vlmcore.data.load.online): the CPU time to measure a sample
    (every loader worker of every rank measures every buffer) against the time to make a row
    (only a rank's own rows), and what the measuring adds to a rank's loader work at a few
    data-parallel sizes with `workers` loader workers each."""
    from vlmcore.data.load.online import build_online_loader

    results = []
    for mix, sizes in IMAGE_MIXES.items():
        data = image_dataset(Path(tempfile.mkdtemp(prefix="vlmcore-bench-online-")), sizes, samples, packed=False)
        loader = build_online_loader(
            data,
            data.parent / "model",
            seq_len=8192,
            max_patches=4 * 8192,
            buffer_size=buffer_size,
            dp_rank=0,
            dp_world=1,
            micro_batch_size=1,
            seed=0,
            num_workers=0,
        )
        buffers = samples // buffer_size
        c0 = time.process_time()
        rows = sum(len(loader.plan(b)) for b in range(buffers))
        measure = (time.process_time() - c0) / (buffers * buffer_size)
        c0 = time.process_time()
        for j in range(min(rows, 16)):
            loader.row(j)
        row = (time.process_time() - c0) / min(rows, 16)
        per_row = buffers * buffer_size / rows
        result = {
            "images": mix,
            "buffer_size": buffer_size,
            "samples_per_row": per_row,
            "measure_ms_per_sample": measure * 1e3,
            "row_ms": row * 1e3,
        }
        for dp in dp_worlds:  # a rank makes 1/dp of the rows and measures all of them, in each worker
            result[f"measure_share_dp{dp}_w{workers}"] = (
                workers * dp * per_row * measure / (row + workers * dp * per_row * measure)
            )
        results.append(result)
    return results


def bench_mixing(samples: int, dp_worlds: list[int]) -> list[dict]:
    """One epoch's pack order through the training loader against a uniform shuffle
    (vlmcore.data.load.mixing), at pack shard sizes 16 and 1000, and the time to read the epoch. Since
    issue 32 the loader reads packs by index in a seeded global order (vlmcore.data.load.order); the
    figures before it (Energon's slices of 1 or 100 packs) are in docs/performance.md."""
    from vlmcore.data.load.mixing import epoch_order, order_statistics, uniform_reference
    from vlmcore.data.pack.dataset import pack
    from vlmcore.download import build_tiny_model

    root = Path(tempfile.mkdtemp(prefix="vlmcore-bench-mixing-"))
    build_tiny_model(root / "model")
    write_synthetic_prepared(root / "data", samples)
    results, reference = [], None
    for shard_size in (16, 1000):
        out = root / f"packed{shard_size}"
        pack(root / "data", root / "model", out, seq_len=1024, max_patches=4096, shard_size=shard_size, workers=1)
        for dp_world in dp_worlds:
            start = time.perf_counter()
            order = epoch_order(out, dp_world)
            seconds = time.perf_counter() - start
            reference = reference or uniform_reference(len(order))
            results.append(
                {"shard_size": shard_size, "dp_world": dp_world, **order_statistics(order), "epoch_s": seconds}
            )
    for key, (low, high) in reference.items():
        results.append(
            {"shard_size": "uniform (0.5%, 99.5%)", "dp_world": "-", "statistic": key, "low": low, "high": high}
        )
    return results


def print_table(rows: list[dict]) -> None:
    keys = list(rows[0])
    print(" | ".join(keys))
    for row in rows:
        print(" | ".join(f"{row[k]:.4g}" if isinstance(row[k], float) else str(row[k]) for k in keys))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--part",
        choices=[
            "packing",
            "loader",
            "bfd-scaling",
            "pack",
            "pack-split",
            "mixing",
            "resume",
            "online",
            "video",
            "all",
        ],
        default="all",
    )
    parser.add_argument("--pack-samples", type=int, nargs="+", default=[10000, 100000], help="sizes for --part pack")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="measuring processes for --part pack")
    parser.add_argument("--write-jobs", type=int, default=2, help="concurrent write jobs for --part pack-split")
    parser.add_argument("--cores", type=int, default=32, help="cores of the node the pack part extrapolates to")
    parser.add_argument("--samples", type=int, default=20000, help="samples in the packing mix")
    parser.add_argument("--loader-samples", type=int, default=256, help="image-caption samples for the loader part")
    parser.add_argument(
        "--mixing-samples", type=int, default=20000, help="demo-like samples packed for the mixing part"
    )
    parser.add_argument("--video-rows", type=int, default=3, help="rows timed per clip and worker count (--part video)")
    parser.add_argument("--rows", type=int, default=16, help="8,192-token rows timed per image mix and worker count")
    args = parser.parse_args()
    if args.part in ("packing", "all"):
        rows = bench_packing(args.samples, seq_len=8192, max_patches=3 * 8192, buffer_size=1000)
        print_table(rows)
        write_results(RESULTS / "data_packing.json", rows)
    if args.part in ("bfd-scaling", "all"):
        rows = bench_bfd_scaling([100000, 400000, 1600000], seq_len=8192, max_patches=3 * 8192)
        print_table(rows)
        write_results(RESULTS / "data_bfd_scaling.json", rows)
    if args.part == "pack-split":  # minutes: not part of "all"
        rows = [
            r for n in args.pack_samples for r in bench_pack_split(n, args.write_jobs, seq_len=1024, max_patches=4096)
        ]
        write_results(RESULTS / f"data_pack_split_{'_'.join(str(n) for n in args.pack_samples)}.json", rows)
    if args.part == "pack":  # minutes: not part of "all"
        rows = bench_pack(args.pack_samples, args.workers, seq_len=1024, max_patches=4096, cores=args.cores)
        name = "_".join(str(n) for n in args.pack_samples)
        write_results(RESULTS / f"data_pack_{name}.json", rows)
    if args.part == "resume":  # minutes (the pack): not part of "all"
        rows = bench_resume(args.pack_samples[-1], seq_len=1024, max_patches=4096)
        write_results(RESULTS / f"data_resume_{args.pack_samples[-1]}.json", rows)
    if args.part == "video":  # minutes (clips are encoded first): not part of "all"
        rows = bench_video(VIDEO_CLIPS, worker_counts=[0, 2], rows=args.video_rows)
        print_table(rows)
        write_results(RESULTS / "data_video.json", rows)
    if args.part in ("online", "all"):
        rows = bench_online(512, buffer_size=128, dp_worlds=[1, 8, 64], workers=4)
        print_table(rows)
        write_results(RESULTS / "data_online.json", rows)
    if args.part in ("mixing", "all"):
        rows = bench_mixing(args.mixing_samples, dp_worlds=[1, 2])
        for row in rows:
            print(" | ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()))
        write_results(RESULTS / "data_mixing.json", rows)
    if args.part in ("loader", "all"):
        rows = bench_loader(args.rows, worker_counts=[0, 1, 2], samples=args.loader_samples)
        print_table(rows)
        write_results(RESULTS / "data_loader.json", rows)


if __name__ == "__main__":
    main()
