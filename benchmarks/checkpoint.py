"""How long a checkpoint holds training up: blocking and total save time against model size, for a
synchronous save and the two async ones (`checkpoint.async: true`, `checkpoint.async_mode: process`
or `thread`), and how much a training step slows while a save is written behind it.

    python benchmarks/checkpoint.py                               # CPU: 10M to 200M parameters
    python benchmarks/checkpoint.py --sizes 1e7 1e8 --out benchmarks/results/checkpoint_cpu_small.json
    torchrun --nproc_per_node=4 benchmarks/checkpoint.py --device cuda --sizes 1e8 1e9 2e9 \\
        --dir /path/on/the/cluster/file/system --out benchmarks/results/checkpoint_cuda_h100.json   # GPU

Each size is a stack of linear layers holding that many fp32 parameters, with AdamW's state (two
fp32 moments, 12 bytes a parameter in all), sharded over the ranks by FSDP2 when there are several,
saved through vlmcore's own `Checkpointer` (the trainer's path: DCP, manifest, rename, `latest`).
For each save: `blocking_s`, the time `save` held the caller (the state dict, the host copy, the
writer's start-up), `total_s` to published; `ratio` = blocking / the synchronous save's total. The
first async save of a process starts DCP's writer process (seconds); each size is saved twice and
the second one counted. While the second save is written, a probe step (forward and backward of a
small MLP) runs as a training step would; `step_slowdown` = its median time then / when idle.
Prints a table and writes benchmarks/results/checkpoint_<device>.json (or --out).
"""

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from vlmcore.train.checkpoint import Checkpointer

REPO = Path(__file__).resolve().parents[1]
WIDTH = 2048  # the layers' size: a layer holds WIDTH**2 parameters


def init_group(device: str) -> None:
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group("cuda:nccl,cpu:gloo" if device == "cuda" else "gloo")
        if device == "cuda":
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    else:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


def model_of(parameters: float, device: torch.device) -> tuple[nn.Module, torch.optim.Optimizer]:
    """Linear layers of about `parameters` in all, with AdamW's state made by one step."""
    from torch.distributed.fsdp import fully_shard

    layers = max(1, round(parameters / WIDTH**2))
    model = nn.Sequential(*(nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(layers))).to(device)
    if dist.get_world_size() > 1:
        for layer in model:
            fully_shard(layer)
        fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return model, optimizer


def probe(device: torch.device) -> callable:
    """A small training step: forward and backward of an MLP, as a step running beside the save."""
    net = nn.Sequential(nn.Linear(512, 2048), nn.GELU(), nn.Linear(2048, 512)).to(device)
    x = torch.randn(256, 512, device=device)

    def step() -> float:
        start = time.perf_counter()
        net(x).square().mean().backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    return step


def measure(size: float, mode: str, root: Path, device: torch.device, step) -> dict:
    model, optimizer = model_of(size, device)
    directory = root / f"{mode}_{int(size)}"
    checkpointer = Checkpointer(directory, keep=1, async_save=mode != "sync", async_mode=mode)
    rows = []
    for step_no in (1, 2):  # the second save counts: the first async one starts the writer process
        dist.barrier()
        start = time.perf_counter()
        checkpointer.save(step_no, model, optimizer, {"step": step_no}, {})
        returned = time.perf_counter()
        during = []
        while checkpointer.save_running():
            during.append(step())
        checkpointer.wait()
        done = time.perf_counter()
        rows.append({"blocking_s": returned - start, "total_s": done - start, "steps_during": during})
    checkpointer.close()
    idle = [step() for _ in range(max(5, len(rows[-1]["steps_during"])))]
    row = rows[-1]
    bytes_per_rank = sum(f.stat().st_size for f in (directory / "checkpoints" / "step_2").glob("*.distcp"))
    during = row.pop("steps_during")
    return {
        "mode": mode,
        "parameters": sum(p.numel() for p in model.parameters()),
        "bytes_rank0_files": bytes_per_rank,
        "blocking_s": round(row["blocking_s"], 4),
        "total_s": round(row["total_s"], 4),
        "first_save_total_s": round(rows[0]["total_s"], 4),
        "steps_during_save": len(during),
        "step_slowdown": round(statistics.median(during) / statistics.median(idle), 2) if during else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--sizes", type=float, nargs="+", default=[1e7, 5e7, 2e8])
    parser.add_argument("--modes", nargs="+", default=["sync", "thread", "process"])
    parser.add_argument("--dir", type=Path, help="where the checkpoints are written (default: a temporary directory)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    init_group(args.device)
    device = torch.device(args.device, int(os.environ.get("LOCAL_RANK", 0))) if args.device == "cuda" else None
    device = device or torch.device("cpu")
    step = probe(device)
    rows = []
    with tempfile.TemporaryDirectory(dir=args.dir) as root:
        for size in args.sizes:
            sync_total = None
            for mode in args.modes:
                row = measure(size, mode, Path(root), device, step)
                sync_total = row["total_s"] if mode == "sync" else sync_total
                row["ratio_to_sync"] = round(row["blocking_s"] / sync_total, 3) if sync_total else None
                rows.append(row)
                if dist.get_rank() == 0:
                    print(
                        f"{row['parameters'] / 1e6:>8.0f}M {mode:>8} blocking {row['blocking_s']:>8.3f} s  total "
                        f"{row['total_s']:>8.3f} s  ratio {row['ratio_to_sync']}  steps during {row['steps_during_save']:>4}"
                        f"  step slowdown {row['step_slowdown']}",
                        flush=True,
                    )
    if dist.get_rank() == 0:
        machine = torch.cuda.get_device_name() if args.device == "cuda" else f"CPU, {os.cpu_count()} cores"
        result = {
            "machine": machine,
            "torch": torch.__version__,
            "world_size": dist.get_world_size(),
            "date": time.strftime("%Y-%m-%d"),
            "rows": rows,
        }
        out = args.out or REPO / "benchmarks" / "results" / f"checkpoint_{args.device}.json"
        out.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {out}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
