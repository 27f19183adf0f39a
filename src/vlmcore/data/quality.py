"""Bad input, shared by every stage: the reasons a sample is skipped or repaired, and their counts.

A bad sample never crashes a stage and is never silent: it is skipped (or repaired where that is
safe), counted under a short reason, and logged (the first few of each reason). When the skipped
fraction exceeds `max_bad_fraction` the stage fails with the counts. The checks themselves live
with what they check (`vlmcore.data.media.image`, `vlmcore.data.media.video`,
`vlmcore.data.prepare.samples`); here are the exceptions, the counts and the JSON and path checks
every stage needs.
"""

import json
import logging
from collections import Counter
from collections.abc import Callable
from pathlib import PurePosixPath

logger = logging.getLogger(__name__)

LOGGED_PER_REASON = 5


class BadSample(Exception):
    """A sample a stage skips (or could repair); `reason` is the short name it is counted under."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


class DataError(RuntimeError):
    """Input a stage cannot read at all (a truncated shard, a missing dataset); names the file."""


class TooMuchBadData(DataError):
    """More of the samples were bad than `max_bad_fraction` allows."""


class BadDataLog:
    """Counts of samples seen, skipped and repaired, by reason."""

    def __init__(self, stage: str, max_bad_fraction: float) -> None:
        self.stage = stage
        self.max_bad_fraction = max_bad_fraction
        self.seen = 0
        self.skipped = Counter()
        self.repaired = Counter()

    def skip(self, reason: str, where: str, detail: str = "") -> None:
        self.skipped[reason] += 1
        if self.skipped[reason] <= LOGGED_PER_REASON:
            logger.warning("%s: skipping %s (%s) %s", self.stage, where, reason, detail)

    def repair(self, reason: str, where: str) -> None:
        self.repaired[reason] += 1
        if self.repaired[reason] <= LOGGED_PER_REASON:
            logger.info("%s: repaired %s (%s)", self.stage, where, reason)

    @property
    def bad_fraction(self) -> float:
        return sum(self.skipped.values()) / max(self.seen, 1)

    def as_dict(self) -> dict:
        return {
            "seen": self.seen,
            "skipped": sum(self.skipped.values()),
            "skipped_by_reason": dict(sorted(self.skipped.items())),
            "repaired_by_reason": dict(sorted(self.repaired.items())),
            "bad_fraction": self.bad_fraction,
            "max_bad_fraction": self.max_bad_fraction,
        }

    def check(self) -> None:
        if self.bad_fraction > self.max_bad_fraction:
            reasons = ", ".join(f"{r}={n}" for r, n in self.skipped.most_common())
            raise TooMuchBadData(
                f"{self.stage}: {sum(self.skipped.values())} of {self.seen} samples were bad "
                f"({self.bad_fraction:.1%} > max_bad_fraction {self.max_bad_fraction:.1%}): {reasons}"
            )


def run_stage(stage: Callable[[], dict], out: str, stage_logger: logging.Logger) -> dict | None:
    """The stats `stage()` returns, or None once the DataError it raised is logged (the CLI's exit 1)."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        return stage()
    except TooMuchBadData as e:
        stage_logger.error("%s (details in %s/stats.json)", e, out)
    except DataError as e:
        stage_logger.error("%s", e)
    return None


def safe_relative_path(name: str) -> str:
    """`name` normalised, or BadSample if it is absolute or climbs out of its directory."""
    path = PurePosixPath(name.replace("\\", "/"))
    if not name or path.is_absolute() or ".." in path.parts:
        raise BadSample("unsafe_path", repr(name))
    return str(path)


def decode_utf8(raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadSample("non_utf8_text", str(e)) from e


def load_json(raw: bytes) -> object:
    try:
        return json.loads(decode_utf8(raw))
    except json.JSONDecodeError as e:
        raise BadSample("malformed_json", str(e)) from e
