"""One reward worker process: `main()` in a fresh interpreter (`python -c ... <socket fd>
<progress fd>`), started by `RewardWorkers` (workers.py), which holds the other end of the socket.

It imports this package and the user's reward modules, nothing of the trainer's (not torch). It
resolves the rewards, says ready, then answers chunks of calls until told to stop (None) or the
trainer's end closes. While a call runs, the progress file (a shared memory file of two doubles)
holds the call's position in the chunk and its start on the monotonic clock (the same clock in
every process of the machine), for the trainer to find a call past its time limit.
"""

import math
import mmap
import os
import signal
import socket
import struct
import sys
import time
from multiprocessing.connection import Connection

from vlmcore.rewards.registry import load_reward

NOT_A_NUMBER = "not_a_number"
# The progress file: two doubles, the position of the running call (-1: none) and its start.
PROGRESS_BYTES = 16
POSITION_OFFSET, STARTED_OFFSET = 0, 8
DOUBLE = struct.Struct("d")


def reward_value(value: object) -> tuple[float, str | None]:
    """A reward's return value as a float, or 0 and `not_a_number` when it is not a finite real
    number (a string that float() would read included: a reward returns a number, not text)."""
    if isinstance(value, str | bytes):
        return 0.0, NOT_A_NUMBER
    try:
        number = float(value)
    except (TypeError, ValueError):
        return 0.0, NOT_A_NUMBER
    if not math.isfinite(number):
        return 0.0, NOT_A_NUMBER
    return number, None


def call_reward(reward: object, completion: str, answer: str, sample: dict) -> tuple[float, str | None]:
    try:
        value = reward(completion, answer, sample)
    except BaseException as e:  # a reward's sys.exit() too: the worker goes on
        return 0.0, f"raised:{type(e).__name__}"
    return reward_value(value)


def run_chunk(rewards: list, items: list, calls: list, progress: mmap.mmap) -> tuple[list, list]:
    """Every call of a chunk, in order: the values, and None or a failure reason for each."""
    values, reasons = [], []
    for position, (item, reward) in enumerate(calls):
        completion, answer, sample = items[item]
        # The start first, then the position: the trainer reads them in the other order.
        DOUBLE.pack_into(progress, STARTED_OFFSET, time.monotonic())
        DOUBLE.pack_into(progress, POSITION_OFFSET, float(position))
        value, reason = call_reward(rewards[reward], completion, answer, sample)
        values.append(value)
        reasons.append(reason)
    DOUBLE.pack_into(progress, POSITION_OFFSET, -1.0)
    return values, reasons


def serve(conn: Connection, progress: mmap.mmap) -> None:
    names = conn.recv()
    try:
        rewards = [load_reward(name) for name in names]
    except Exception as e:
        conn.send(("error", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready", None))
    while True:
        try:
            request = conn.recv()
        except EOFError:
            return
        if request is None:
            return
        items, calls = request
        conn.send(run_chunk(rewards, items, calls, progress))


def main() -> None:
    # Ctrl-C reaches the whole process group; the trainer handles it and closes the pool.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    socket_fd, progress_fd = int(sys.argv[1]), int(sys.argv[2])
    # Not inherited by a process a reward starts: the socket must close when this one ends, so
    # that the trainer sees the end at once.
    os.set_inheritable(socket_fd, False)
    conn = Connection(socket.socket(fileno=socket_fd).detach())
    progress = mmap.mmap(progress_fd, PROGRESS_BYTES)
    os.close(progress_fd)
    try:
        serve(conn, progress)
    except (BrokenPipeError, ConnectionResetError):
        pass  # the trainer is gone: nobody to answer, leave quietly
