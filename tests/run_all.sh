#!/usr/bin/env bash
# The whole suite, as CI runs it (README "Quick start"). Extra arguments (pytest options) go to
# every pytest run.
#
# 1. Two pytest-xdist workers take whole test files (a file's module-scoped fixtures, such as the
#    demo pipeline run, are made once), the longest files first (tests/conftest.py), one thread
#    each: most tests are one process, so the second worker keeps the second core busy. The video
#    demo through SLURM (tests/slurm/test_slurm_demo.py) is one of these files.
# 2. Then, alone on a quiet machine, tests/slurm/test_slurm_real.py: its time-limit test sizes its run
#    from the step time it measures, which a load that changes under it would make wrong. (A third
#    process beside the workers was tried: on 2 cores it slowed them more than it saved.)
#
# Compiled code: all processes share inductor's cache (TORCHINDUCTOR_CACHE_DIR, by default
# /tmp/torchinductor_$USER): a graph one run compiled is a cache hit for every later run (in a
# compile test, the run under activation checkpointing finds the compiled run's graphs there). No
# warm-up step before the workers: each test's graphs are its own (its model and layout), so a
# warm-up would only move their compiling earlier and add its own start-up. What stays compiled
# twice: the graphs of a torchrun's two ranks, the same graphs, which both compile at once and so
# both miss in the cache; a warm-up would have to run those ranks itself.
#
# The SLURM tests need a SLURM (.ci/slurm_setup.sh); without one they are skipped (failed in CI).
set -uo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1

# pytest's exit code, with "no tests collected" (all deselected, say by -m "not slow") as a pass.
pytest_rc() { local rc=$1; [ "$rc" -eq 5 ] && rc=0; return "$rc"; }

python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=40 --ignore=tests/slurm/test_slurm_real.py "$@" tests
status=$?
echo "== tests/slurm/test_slurm_real.py, alone:"
python -m pytest -q --durations=5 "$@" tests/slurm/test_slurm_real.py
pytest_rc $? || status=$?
exit "$status"
