"""A stage that rides out faults inside its allocation (docs/hpc.md section 6): the restart of its
ranks (torchrun's), the trace a failed or hung collective leaves (torch's Flight Recorder), the
ranks that slow the others down named, and the fault injection hook of the tests.

The restart itself is torchrun's (`--max-restarts`, set by workflow/scripts/launch_torchrun.sh from
`resilience.max_restarts`): a worker that dies fails its node's worker group, torchrun starts it
again and, through the c10d rendezvous, every other node's group with it; the trainers resume from
the latest checkpoint as any start does. This module only says so in the log.
"""

import os
import pickle
import signal
import socket
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from vlmcore.config import ConfigError, ResilienceConfig

FAULT_ENV = "VLMCORE_TEST_FAULT"
_DUMP_REQUEST = "vlmcore/flight_recorder/dump"
_DUMPED = "vlmcore/flight_recorder/dumped"
POLL_S = 1.0  # how often each rank looks for a dump request (torch's NCCL watchdog: 1 s too)
DUMP_WAIT_S = 5.0  # how long the failing rank waits for its peers' dumps before it exits


_agreed_restarts = None  # set once a start, by agree_on_restarts


def restart_count() -> int:
    """How many times torchrun restarted this job's ranks so far (0: the first start), the same on
    every rank once `agree_on_restarts` ran; before it, this node's own count."""
    if _agreed_restarts is not None:
        return _agreed_restarts
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def agree_on_restarts() -> int:
    """The restarts so far, agreed by every rank (one tiny all_reduce a start): torchrun counts on
    each node only the restarts its own ranks' failure caused, and a node that restarts because
    another node's ranks did (the rendezvous' membership change) counts none; the most any node
    counted is the job's."""
    global _agreed_restarts
    count = torch.tensor([int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))])
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    _agreed_restarts = int(count.item())
    return _agreed_restarts


def announce_restart(cfg: ResilienceConfig) -> None:
    """Rank 0 says, in the stage's log, that this start is a restart inside the allocation."""
    agree_on_restarts()
    if dist.get_rank() != 0:
        return
    launched_with = os.environ.get("TORCHELASTIC_MAX_RESTARTS")
    if launched_with is not None and int(launched_with) != cfg.max_restarts:
        print(
            f"warning: resilience.max_restarts is {cfg.max_restarts} but torchrun was started with "
            f"--max-restarts {launched_with} (launch_torchrun.sh takes it from $VLMCORE_MAX_RESTARTS)"
        )
    if restart_count() > 0:
        print(
            f"restart {restart_count()} of at most {launched_with} inside this job: a rank failed, torchrun "
            "started the stage's ranks again; resuming from the latest checkpoint"
        )


# --- fault injection (tests only) ------------------------------------------------------------


@dataclass
class Fault:
    """One injected fault: `kind` on `rank` from `step` on. kill: SIGKILL itself before the step;
    hang: stop joining collectives before the step (until torchrun stops the worker group); both on
    the first start only, so the restart gets past them. slow: sleep `seconds` before every step."""

    kind: str
    rank: int
    step: int = 1
    seconds: float = 0.0


def parse_faults(text: str) -> list[Fault]:
    """`$VLMCORE_TEST_FAULT`: faults separated by `;`, each `kind rank=R [step=N] [seconds=S]`,
    e.g. `kill rank=1 step=3` or `slow rank=1 seconds=0.3`."""
    faults = []
    for item in filter(None, (part.strip() for part in text.split(";"))):
        kind, *pairs = item.split()
        try:
            values = dict(pair.split("=", 1) for pair in pairs)
            fault = Fault(
                kind,
                int(values.pop("rank")),
                int(values.pop("step", 1)),
                float(values.pop("seconds", 0)),
            )
        except (KeyError, ValueError) as e:
            raise ValueError(
                f"${FAULT_ENV}: cannot read {item!r} ({e}): want `kind rank=R [step=N] [seconds=S]`"
            ) from e
        if kind not in ("kill", "hang", "slow") or values:
            raise ValueError(f"${FAULT_ENV}: {item!r}: kinds kill, hang, slow; keys rank, step, seconds")
        faults.append(fault)
    return faults


class FaultInjection:
    """The faults of `$VLMCORE_TEST_FAULT` that concern this rank; none when it is unset. For tests
    of the restart, the flight recorder and the straggler report: never set it in a real run."""

    def __init__(self, rank: int, stop_requested: Callable[[], bool]) -> None:
        self.faults = [f for f in parse_faults(os.environ.get(FAULT_ENV, "")) if f.rank == rank]
        self.stop_requested = stop_requested  # torchrun asked the worker to stop (SIGTERM)

    def before_step(self, step: int) -> None:
        for fault in self.faults:
            first_start = restart_count() == 0
            if fault.kind == "kill" and step == fault.step and first_start:
                os.kill(os.getpid(), signal.SIGKILL)
            if fault.kind == "hang" and step == fault.step and first_start:
                self._hang()
            if fault.kind == "slow" and step >= fault.step:
                time.sleep(fault.seconds)

    def _hang(self) -> None:
        """Joins no collective any more; ends only when torchrun stops the worker group (SIGTERM),
        as a rank stuck inside a collective ends at its own timeout."""
        while not self.stop_requested():
            time.sleep(0.1)
        os._exit(1)


# --- flight recorder -------------------------------------------------------------------------


def attempt_name() -> str:
    """The same on every rank of one start: the rendezvous id (the SLURM job id under SLURM) and the restart."""
    return f"{os.environ.get('TORCHELASTIC_RUN_ID', 'local')}_restart{restart_count()}"


class FlightRecorder:
    """Each rank's last collectives (torch's Flight Recorder, `TORCH_FR_BUFFER_SIZE`), written to
    `<output_dir>/flight_recorder/<attempt>/rank_<r>` when a collective fails or times out, on
    every rank: the rank that failed asks the others through the process group's store, and a
    thread of each rank answers, also when its main thread is stuck. The files are the pickles
    torch's analyser reads (`python -m torch.distributed.flight_recorder.fr_trace <dir>`), which
    names the collective that not all ranks joined and the ranks missing from it.

    Under NCCL, torch's own watchdog dumps its NCCL entries on a timeout too (`nccl_rank_<r>`);
    the gloo side (and a CPU run) has no watchdog, hence this thread."""

    def __init__(self, cfg: ResilienceConfig, output_dir: Path) -> None:
        self.entries = cfg.flight_recorder_entries
        self.root = Path(output_dir) / "flight_recorder"
        self.dir = self.root / attempt_name()  # this node's count until start() agrees on the job's
        self._dumped = threading.Lock()
        self._stop = threading.Event()
        self._thread = None

    def configure(self) -> None:
        """Before the process group: the recorders' sizes and NCCL's own dump on a timeout."""
        if not self.entries:
            return
        os.environ.setdefault("TORCH_FR_BUFFER_SIZE", str(self.entries))  # NCCL's and gloo's
        os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
        self.nccl_file_is_ours = "TORCH_FR_DUMP_TEMP_FILE" not in os.environ
        if self.nccl_file_is_ours:
            os.environ["TORCH_FR_DUMP_TEMP_FILE"] = str(self.dir / "nccl_rank_")

    def start(self) -> None:
        """After the process group and `agree_on_restarts`: each rank's thread that answers a peer's
        dump request."""
        if not self.entries or dist.get_world_size() == 1:
            return
        self.dir = self.root / attempt_name()
        if self.nccl_file_is_ours:  # NCCL reads it at its first dump
            os.environ["TORCH_FR_DUMP_TEMP_FILE"] = str(self.dir / "nccl_rank_")
        if torch.cuda.is_available():
            self.dir.mkdir(parents=True, exist_ok=True)  # NCCL's watchdog writes here and does not make it
        self.store = dist.distributed_c10d._get_default_store()
        self._thread = threading.Thread(target=self._answer_requests, name="vlmcore-flight-recorder", daemon=True)
        self._thread.start()

    def _answer_requests(self) -> None:
        while not self._stop.wait(POLL_S):
            try:
                if self.store.check([_DUMP_REQUEST]):
                    self.dump()
                    return
            except Exception:  # the store went away with the job: nothing left to answer
                return

    def failed(self, error: BaseException) -> None:
        """A collective failed on this rank: every rank dumps; waits a little for the others' files."""
        if self._thread is None:
            return
        print(
            f"rank {dist.get_rank()}: a collective failed ({str(error).splitlines()[0][:200]}); "
            f"each rank's last collectives go to {self.dir}",
            flush=True,
        )
        try:
            self.store.set(_DUMP_REQUEST, str(dist.get_rank()))
            self.dump()
            deadline = time.monotonic() + DUMP_WAIT_S
            while int(self.store.add(_DUMPED, 0)) < dist.get_world_size() and time.monotonic() < deadline:
                time.sleep(0.1)
        except Exception as e:  # the store is gone (its node died): this rank's own file is written
            print(f"rank {dist.get_rank()}: flight recorder: {e}", flush=True)

    def dump(self) -> None:
        """This rank's recorder into rank_<r>, once."""
        if not self._dumped.acquire(blocking=False):
            return
        trace = pickle.loads(torch._C._distributed_c10d._dump_fr_trace())
        trace["pg_config"] = process_groups(trace.get("pg_config", {}))
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / f"rank_{dist.get_rank()}"
        path.with_suffix(".tmp").write_bytes(pickle.dumps(trace))
        path.with_suffix(".tmp").rename(path)
        self.store.add(_DUMPED, 1)

    def close(self) -> None:
        self._stop.set()


def process_groups(recorded: dict) -> dict:
    """The dump's `pg_config` with every process group this rank is in, by name: torch 2.13's gloo
    recorder registers its groups without their names (one entry ''), which its analyser cannot
    match the entries to."""
    groups = {name: info for name, info in recorded.items() if name}
    for group, name in dist.distributed_c10d._world.pg_names.items():
        groups.setdefault(
            name, {"name": name, "desc": group.group_desc, "ranks": str(dist.get_process_group_ranks(group))}
        )
    return groups


# --- stragglers -------------------------------------------------------------------------------


class StragglerWatch:
    """Every `straggler_interval` steps, one all_gather of each rank's mean busy time over those
    steps (its step time less its wait for the others at the step's start), and the ranks busier
    than the median by more than `straggler_margin` named with their host."""

    def __init__(self, cfg: ResilienceConfig) -> None:
        self.cfg = cfg
        self.busy = []
        self.hosts = None
        if cfg.straggler_interval and dist.get_world_size() > 1:
            self.hosts = [None] * dist.get_world_size()
            dist.all_gather_object(self.hosts, socket.gethostname())  # once a start

    def after_step(self, step: int, step_s: float, wait_s: float) -> dict:
        """The metrics of a gather step (nothing on the others)."""
        if self.hosts is None:
            return {}
        self.busy.append((step_s - wait_s, step_s))
        if step % self.cfg.straggler_interval:
            return {}
        mine = torch.tensor([statistics.fmean(b for b, _ in self.busy), statistics.fmean(s for _, s in self.busy)])
        self.busy = []
        gathered = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, mine)
        busy, step_times = [float(g[0]) for g in gathered], [float(g[1]) for g in gathered]
        check_timeout(self.cfg, statistics.median(step_times), step)
        return {"rank_busy_s": busy, "stragglers": self.name_stragglers(busy, step)}

    def name_stragglers(self, busy: list[float], step: int) -> list[dict]:
        median = statistics.median_low(busy)  # a rank's own time (of 2 ranks: the faster one's)
        slow = [
            {"rank": rank, "host": self.hosts[rank], "busy_s": b, "over_median": b / median - 1}
            for rank, b in enumerate(busy)
            if b > median * (1 + self.cfg.straggler_margin)
        ]
        if slow and dist.get_rank() == 0:
            names = ", ".join(
                f"rank {s['rank']} on {s['host']} ({s['busy_s']:.3f} s, +{100 * s['over_median']:.0f}%)" for s in slow
            )
            print(f"step {step}: stragglers: {names}; the median rank is busy {median:.3f} s a step", flush=True)
        return slow


def check_timeout(cfg: ResilienceConfig, step_s: float, step: int) -> None:
    """A collective timeout shorter than a step would fail a healthy run at its first slow rank;
    every rank sees the same gathered times, so every rank stops here."""
    if step_s >= cfg.collective_timeout_s:
        raise ConfigError(
            f"resilience.collective_timeout_s: {cfg.collective_timeout_s:g} s is shorter than a step "
            f"({step_s:.1f} s, the median up to step {step}): raise it well above the step time",
            key="resilience.collective_timeout_s",
        )
