"""`metrics.profile_steps`: a torch.profiler trace of chosen steps of the real loop, and what it says.

The steps from the first to the last listed are traced on every rank. Each rank writes to
`output_dir/profile/`: `rank<r>_trace.json.gz` (open it in Perfetto or chrome://tracing) and
`rank<r>_summary.txt`, the figures that say where a slow step's time goes:

    wall_s          host time of the traced steps
    gpu_busy_s      time the GPU spent in kernels, copies and fills (the union of their intervals)
    gpu_idle_s      the gaps between them, split into long ones (1 ms or more: the host is behind,
                    in Python, the optimizer, a sync) and short ones (under 50 us: launch gaps)
    host_syncs      calls that make the host wait for the GPU (stream/device/event synchronize)
    copies_to_host  device-to-host copies (each one a sync when its result is read)
    launches        kernel launches
    top kernels     the device operations by their own time

GPU busy time well under wall time means the GPU waits for the host: launches, syncs, Python or
the data. On a CPU the trace holds the operators' host times and the GPU figures are left out.
"""

import gzip
import json
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC")
DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


class StepProfiler:
    def __init__(self, steps: list[int], folder: Path, rank: int, device: torch.device) -> None:
        self.first, self.last = (min(steps), max(steps)) if steps else (0, -1)
        self.folder = folder
        self.rank = rank
        self.cuda = device.type == "cuda"
        self.profiler = None
        self.started = 0.0

    def step_starts(self, step: int) -> None:
        """Call before step `step` (1-based) takes its data."""
        if step != self.first:
            return
        self.profiler = profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else []))
        if self.cuda:
            torch.cuda.synchronize()
        self.profiler.start()
        self.started = time.perf_counter()

    def step_ended(self, step: int) -> None:
        if step != self.last or self.profiler is None:
            return
        if self.cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - self.started
        self.profiler.stop()
        self.folder.mkdir(parents=True, exist_ok=True)
        trace = self.folder / f"rank{self.rank}_trace.json.gz"
        self.profiler.export_chrome_trace(str(trace))
        events = json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]
        summary = summarize(self.profiler, events, wall, self.last - self.first + 1, self.cuda)
        (self.folder / f"rank{self.rank}_summary.txt").write_text(summary)
        if self.rank == 0:
            print(summary, flush=True)
        self.profiler = None


def summarize(prof: profile, trace_events: list[dict], wall_s: float, steps: int, cuda: bool) -> str:
    """The figures are read off the exported trace (the events Perfetto shows: device operations
    by category, CUDA runtime calls on the host), the table off the profiler's averages."""
    lines = [f"profiled steps: {steps}, wall_s {wall_s:.4f} ({wall_s / steps:.4f} a step)"]
    if cuda:
        lines += device_figures(trace_events, wall_s, steps)
    sort_by = "self_device_time_total" if cuda else "self_cpu_time_total"
    lines += ["", prof.key_averages().table(sort_by=sort_by, row_limit=25, max_name_column_width=70)]
    return "\n".join(lines) + "\n"


def device_figures(trace_events: list[dict], wall_s: float, steps: int) -> list[str]:
    device = [e for e in trace_events if e.get("cat") in DEVICE_CATEGORIES and "dur" in e]
    runtime = [e["name"] for e in trace_events if e.get("cat") == "cuda_runtime"]
    intervals = [(e["ts"], e["ts"] + e["dur"]) for e in device]
    busy_s = busy_time_us(intervals) / 1e6
    gaps = [g / 1e6 for g in idle_gaps_us(intervals)]
    return [
        f"gpu_busy_s {busy_s:.4f} ({100 * busy_s / wall_s:.1f}% of wall)",
        f"gpu_idle_s {sum(gaps):.4f} between the first and last device operation: "
        f"{sum(g for g in gaps if g >= 1e-3):.4f} in gaps of 1 ms or more, "
        f"{sum(g for g in gaps if g < 50e-6):.4f} in gaps under 50 us",
        f"host_syncs {sum(name in SYNCS for name in runtime) / steps:.1f} a step",
        f"copies_to_host {sum('DtoH' in e['name'] for e in device) / steps:.1f} a step",
        f"launches {sum(name in LAUNCHES for name in runtime) / steps:.0f} a step",
    ]


def busy_time_us(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals: the time at least one of them ran."""
    if not intervals:
        return 0.0
    span = max(end for _, end in intervals) - min(start for start, _ in intervals)
    return span - sum(idle_gaps_us(intervals))


def idle_gaps_us(intervals: list[tuple[float, float]]) -> list[float]:
    """The gaps between the intervals' union, first to last."""
    gaps = []
    covered_until = None
    for start, end in sorted(intervals):
        if covered_until is not None and start > covered_until:
            gaps.append(start - covered_until)
        covered_until = end if covered_until is None else max(covered_until, end)
    return gaps
