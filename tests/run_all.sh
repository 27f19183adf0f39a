#!/usr/bin/env bash
# The whole suite, as CI runs it (README "Quick start"). Extra arguments (pytest options) go to
# every pytest run.
#
# 1. Two pytest-xdist workers take whole test files (a file's module-scoped fixtures, such as the
#    demo pipeline run, are made once), the longest files first (tests/conftest.py), one thread
#    each: most tests are one process, so the second worker keeps the second core busy.
# 2. Beside them, a third pytest runs the real-SLURM tests that do not time anything (the two-node
#    stage and the video demo through SLURM): they mostly wait on SLURM (job start-up, status polls),
#    so they fill what the workers leave idle instead of running alone at the end.
# 3. Last, alone on a quiet machine, the time-limit test: it sizes its run from the step time it
#    measures, which a load that changes under it would make wrong.
#
# Needs a SLURM for the last two (.ci/slurm_setup.sh); without one they are skipped (failed in CI).
set -uo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1

# pytest's exit code, with "no tests collected" (all deselected, say by -m "not slow") as a pass.
pytest_rc() { local rc=$1; [ "$rc" -eq 5 ] && rc=0; return "$rc"; }

slurm_log=$(mktemp)
python -m pytest -q -p no:cacheprovider --durations=5 -k "not time_limit" "$@" tests/test_slurm_real.py >"$slurm_log" 2>&1 &
slurm_pid=$!
trap 'kill "$slurm_pid" 2>/dev/null' EXIT

python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=40 --ignore=tests/test_slurm_real.py "$@" tests
status=$?
wait "$slurm_pid"; pytest_rc $? || status=$?
echo "== tests/test_slurm_real.py, beside the workers:"
cat "$slurm_log"

echo "== tests/test_slurm_real.py, alone:"
python -m pytest -q -p no:cacheprovider --durations=5 -k "time_limit" "$@" tests/test_slurm_real.py
pytest_rc $? || status=$?
exit "$status"
