"""Rewards computed apart from the trainer: a pool of worker processes, a time limit per call,
failures scored 0 and counted by reason, never fatal.

Why processes: a reward is user code (a regular expression that backtracks for minutes, a
parser that recurses without end, a crash in a C extension); in the trainer it would stall or
kill every rank's step. A worker is a fresh interpreter (`vlmcore.rewards.worker.main`),
never a fork: the trainer holds torch, CUDA and threads, which a forked child inherits in an
undefined state. Not multiprocessing's spawn or forkserver either: both run the trainer's main
module again in each worker (a training script that imports torch would import it into every
worker) and spawn leaves its resource tracker process behind. A worker imports this package and
what a user's reward imports, nothing else (not torch).

One step's batch is cut into one contiguous chunk per worker, sent in one message; the worker
runs every reward on each of its completions and sends all the values back in one message, so a
batch costs one round trip per worker, not one per completion. While a call runs, the worker
keeps its position and start time in a small shared memory file; the trainer waits on the
workers' replies and, at each call's deadline, kills the worker whose call is past its time
limit (a call stuck in C code that holds the GIL included, which no in-process alarm would stop).
A killed (or dead) worker is replaced at once: the call it was on scores 0, the calls of its
chunk that it had done run again on the replacement with those it had not reached, so the
values stay in the order of the batch.

Failure reasons, counted per reward name: `raised:<ExceptionType>` (the reward raised),
`timeout` (past the time limit: its worker is killed), `not_a_number` (it returned something that
is not a finite real number: a string, None, NaN, infinity), `worker_died` (its process ended
during the call: `os._exit`, a segfault, the out-of-memory killer).
"""

import mmap
import os
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait

from vlmcore.rewards.registry import RewardSpec, as_spec
from vlmcore.rewards.worker import DOUBLE, POSITION_OFFSET, PROGRESS_BYTES, STARTED_OFFSET

# The failure reasons the trainer's side finds (a worker finds `raised:<type>` and `not_a_number`).
TIMEOUT = "timeout"
WORKER_DIED = "worker_died"
# The longest a worker may take to start: a fresh interpreter importing the rewards' modules.
START_TIMEOUT_S = 120.0
# How long `close` waits for a worker to leave by itself before killing it.
CLOSE_TIMEOUT_S = 5.0
# Re-check a worker that has its chunk but has not started a call after this long.
NOT_STARTED_RECHECK_S = 0.01


@dataclass(eq=False)  # a worker is itself, whatever its fields hold
class Worker:
    process: subprocess.Popen
    conn: Connection
    progress: mmap.mmap  # shared with the worker: the position of its running call and its start
    calls: list[tuple[int, int]] = field(default_factory=list)  # its chunk: (completion, reward) of the batch

    def position(self) -> int:
        return int(DOUBLE.unpack_from(self.progress, POSITION_OFFSET)[0])

    def started(self) -> float:
        return DOUBLE.unpack_from(self.progress, STARTED_OFFSET)[0]

    def stop(self) -> None:
        self.process.kill()
        self.process.wait()
        self.conn.close()
        self.progress.close()


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


@dataclass
class RewardScores:
    """One batch's rewards: the weighted sum per completion (`totals`, in the batch's order),
    each reward's own value per completion (`per_reward`, 0 where it failed) and its failures by
    reason (`failures[name]["timeout"]`, ...)."""

    totals: list[float]
    per_reward: dict[str, list[float]]
    failures: dict[str, Counter]

    def metrics(self) -> dict[str, float]:
        """The batch's means (`reward`, `reward/<name>`) and failure counts
        (`reward_failures/<name>/<reason>`), for metrics.jsonl."""
        metrics = {"reward": mean(self.totals)}
        for name, values in self.per_reward.items():
            metrics[f"reward/{name}"] = mean(values)
        for name, reasons in self.failures.items():
            for reason, count in sorted(reasons.items()):
                metrics[f"reward_failures/{name}/{reason}"] = float(count)
        return metrics


def contiguous_chunks(count: int, parts: int) -> list[range]:
    """range(count) cut into `parts` contiguous ranges whose sizes differ by at most one."""
    base, extra = divmod(count, parts)
    chunks, start = [], 0
    for index in range(parts):
        size = base + (1 if index < extra else 0)
        chunks.append(range(start, start + size))
        start += size
    return chunks


def check_batch(completions: Sequence[str], answers: Sequence[str], samples: Sequence[dict]) -> None:
    """A batch's mistakes are the trainer's, not a reward's: raised, not scored 0 (an answer read
    as a number from a JSON row would fail every built-in reward quietly)."""
    if not len(completions) == len(answers) == len(samples):
        raise ValueError(
            f"one answer and one sample per completion: got {len(completions)} completions, "
            f"{len(answers)} answers and {len(samples)} samples"
        )
    for index, (completion, answer, sample) in enumerate(zip(completions, answers, samples)):
        if not isinstance(completion, str) or not isinstance(answer, str) or not isinstance(sample, dict):
            raise ValueError(
                f"completion {index}: a completion and an answer are strings and a sample is a dict, got "
                f"{type(completion).__name__}, {type(answer).__name__} and {type(sample).__name__}"
            )


class RewardWorkers:
    """A pool of `workers` processes computing a stage's rewards (specs checked by
    `check_rewards` first), each call limited to `timeout_s`. Use it as a context manager:
    closing it stops every worker (and kills the ones that do not stop)."""

    def __init__(self, specs: Sequence, workers: int = 2, timeout_s: float = 10.0) -> None:
        if workers < 1 or timeout_s <= 0:
            raise ValueError(f"workers must be >= 1 and timeout_s > 0, got {workers} and {timeout_s}")
        self.specs: list[RewardSpec] = [as_spec(spec) for spec in specs]
        self.names = [spec.name for spec in self.specs]
        self.timeout_s = timeout_s
        self.restarts = 0  # workers replaced after a timeout or a death, over the pool's life
        # Start them all, then wait for all: their start-ups overlap.
        self.workers = [self.start_worker() for _ in range(workers)]
        try:
            for worker in self.workers:
                self.wait_ready(worker)
        except RuntimeError:
            self.close()  # none left behind by a pool that could not start
            raise

    def __enter__(self) -> "RewardWorkers":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start_worker(self) -> Worker:
        """A fresh interpreter running `vlmcore.rewards.worker`, with the trainer's sys.path (the
        user's reward modules import there as here) and a socket and a progress file shared."""
        ours, theirs = socket.socketpair()
        progress_fd = os.memfd_create("reward-worker-progress")
        os.ftruncate(progress_fd, PROGRESS_BYTES)
        progress = mmap.mmap(progress_fd, PROGRESS_BYTES)
        DOUBLE.pack_into(progress, POSITION_OFFSET, -1.0)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(path for path in sys.path if path))
        entry = "from vlmcore.rewards.worker import main; main()"
        command = [sys.executable, "-c", entry, str(theirs.fileno()), str(progress_fd)]
        process = subprocess.Popen(command, pass_fds=(theirs.fileno(), progress_fd), stdin=subprocess.DEVNULL, env=env)
        theirs.close()
        os.close(progress_fd)
        conn = Connection(ours.detach())
        conn.send(self.names)
        return Worker(process, conn, progress)

    def wait_ready(self, worker: Worker) -> None:
        if not worker.conn.poll(START_TIMEOUT_S):
            raise RuntimeError(f"a reward worker did not start within {START_TIMEOUT_S:.0f} s")
        try:
            status, detail = worker.conn.recv()
        except EOFError:
            raise RuntimeError(f"a reward worker died while starting (exit code {worker.process.wait()})") from None
        if status != "ready":
            raise RuntimeError(f"a reward worker cannot load the rewards {self.names}: {detail}")

    def close(self) -> None:
        """Stop every worker: asked to leave, then killed if it has not within CLOSE_TIMEOUT_S."""
        for worker in self.workers:
            try:
                worker.conn.send(None)
            except OSError:
                pass  # already gone
        deadline = time.monotonic() + CLOSE_TIMEOUT_S
        for worker in self.workers:
            try:
                worker.process.wait(max(deadline - time.monotonic(), 0.0))
            except subprocess.TimeoutExpired:
                pass
            worker.stop()
        self.workers = []

    def score(self, completions: Sequence[str], answers: Sequence[str], samples: Sequence[dict]) -> RewardScores:
        """Every reward of every completion (with its prompt row's answer and other fields), in
        the batch's order; a failed call scores 0 and is counted, never raised. An error of the
        batch itself (a sample that does not pickle) closes the pool and is raised."""
        check_batch(completions, answers, samples)
        if not self.workers:
            raise RuntimeError("the reward workers are closed")
        self.replace_dead_idle_workers()
        items = list(zip(completions, answers, samples))
        values = [[0.0] * len(items) for _ in self.names]
        failures = {name: Counter() for name in self.names}
        try:
            busy = []
            for worker, chunk in zip(self.workers, contiguous_chunks(len(items), len(self.workers))):
                if chunk:
                    self.submit(worker, items, [(item, reward) for item in chunk for reward in range(len(self.names))])
                    busy.append(worker)
            while busy:
                busy = self.collect(busy, items, values, failures)
        except BaseException:
            # A batch that cannot finish (a sample that does not pickle, Ctrl-C) would leave its
            # replies in the sockets for the next one to read: the pool closes instead.
            self.close()
            raise
        totals = [
            sum(spec.weight * values[reward][item] for reward, spec in enumerate(self.specs))
            for item in range(len(items))
        ]
        return RewardScores(totals, dict(zip(self.names, values)), failures)

    def replace_dead_idle_workers(self) -> None:
        """A worker that ended between two batches (the out-of-memory killer, a signal) is
        replaced before it is given a chunk; no call was running, none is charged."""
        for index, worker in enumerate(self.workers):
            if worker.process.poll() is not None:
                worker.stop()
                self.workers[index] = self.start_worker()
                self.restarts += 1
                self.wait_ready(self.workers[index])

    def submit(self, worker: Worker, items: list, calls: list[tuple[int, int]]) -> None:
        """Send a worker its calls with only the completions they need, renumbered."""
        needed = sorted({item for item, _ in calls})
        local = {item: index for index, item in enumerate(needed)}
        worker.calls = calls
        worker.conn.send(([items[item] for item in needed], [(local[item], reward) for item, reward in calls]))

    def seconds_to_next_deadline(self, busy: list[Worker]) -> float:
        now = time.monotonic()
        deadlines = []
        for worker in busy:
            if worker.position() >= 0:
                deadlines.append(worker.started() + self.timeout_s)
            else:
                deadlines.append(now + NOT_STARTED_RECHECK_S)
        return max(min(deadlines) - now, 0.0)

    def is_overdue(self, worker: Worker) -> bool:
        # The position first, then the start (the worker writes them in the other order).
        position = worker.position()
        started = worker.started()
        return position >= 0 and time.monotonic() - started > self.timeout_s

    def collect(self, busy: list[Worker], items: list, values: list, failures: dict) -> list[Worker]:
        """Wait until a worker replies, dies or passes a deadline; take what came. The workers
        still busy after it."""
        # A worker's end closes its socket: a death wakes this as a reply does.
        wait([w.conn for w in busy], self.seconds_to_next_deadline(busy))
        still_busy = []
        for worker in busy:
            if worker.conn.poll():
                try:
                    chunk_values, reasons = worker.conn.recv()
                except EOFError:
                    still_busy.extend(self.replace(worker, items, failures, WORKER_DIED))
                    continue
                for (item, reward), value, reason in zip(worker.calls, chunk_values, reasons):
                    values[reward][item] = value
                    if reason is not None:
                        failures[self.names[reward]][reason] += 1
                worker.calls = []
            elif worker.process.poll() is not None:
                still_busy.extend(self.replace(worker, items, failures, WORKER_DIED))
            elif self.is_overdue(worker):
                still_busy.extend(self.replace(worker, items, failures, TIMEOUT))
            else:
                still_busy.append(worker)
        return still_busy

    def replace(self, lost: Worker, items: list, failures: dict, reason: str) -> list[Worker]:
        """Kill a worker whose call timed out or that died, count that call's failure, start its
        replacement and give it the rest of the chunk. The replacement, if it is busy."""
        # Died between two calls: the first call not done is the one charged, so that every
        # death uses up a call and a batch always ends.
        position = max(lost.position(), 0)
        _, reward = lost.calls[position]
        failures[self.names[reward]][reason] += 1
        rest = lost.calls[:position] + lost.calls[position + 1 :]
        lost.stop()
        replacement = self.start_worker()
        self.workers[self.workers.index(lost)] = replacement
        self.restarts += 1
        self.wait_ready(replacement)
        if not rest:
            return []
        self.submit(replacement, items, rest)
        return [replacement]
