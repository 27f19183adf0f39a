"""SHA-256 digests of files and of lists of digests: snapshot manifests, checkpoint manifests,
export provenance."""

import hashlib
from collections.abc import Iterable
from pathlib import Path


def sha256_of(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def sha256_of_digests(digests: Iterable[str]) -> str:
    """One digest of several (in the order given)."""
    return hashlib.sha256("".join(digests).encode()).hexdigest()
