"""Where a result came from: the commit of the vlmcore source that made it. Torch-free, so that
the report (and anything else that records provenance) does not import the models to ask git."""

import subprocess
from pathlib import Path

import vlmcore


def git_commit() -> dict:
    """Commit of the vlmcore source tree, when it is a git checkout."""
    source = Path(vlmcore.__file__).resolve().parent
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=source, capture_output=True, text=True, check=True)
        status = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=source,
            capture_output=True,
            text=True,
            check=True,
        )
    except (OSError, subprocess.CalledProcessError):
        return {"commit": None, "dirty": None}
    return {"commit": commit.stdout.strip(), "dirty": bool(status.stdout.strip())}
