#!/usr/bin/env bash
# One GPU session's measurements, ready to run on a lent machine that has a CUDA torch and
# transformers but no network: vlmcore runs from src/, nothing is installed.
#
#   bash benchmarks/gpu_session.sh qwen3_vl            # issue 15: the 2B Qwen3-VL part of the table
#   bash benchmarks/gpu_session.sh qwen3               # issue 15: the 2B Qwen3 part
#   bash benchmarks/gpu_session.sh qwen3_vl_moe 30b-a3b   # issue 19: Qwen3-VL-30B-A3B's shape, 4 layers
#   bash benchmarks/gpu_session.sh checks              # issue 31 item 3: expert mesh on NCCL, bf16 resume
#   bash benchmarks/gpu_session.sh eval                # issue 42 item 4: evaluation throughput
#
# Prints the machine and kernel versions, then `benchmarks/train_step.py --all` for one family:
# compiled then eager, bare step, transformers and the real `vlmcore train` loop, each case
# printed and written to $OUT (the device tool's folder; benchmarks/results without it) as it
# finishes, with a torch.profiler trace and summary of two bare and two loop steps of each case
# (profile_* folders). One family per command keeps each under the device tool's 10 minutes per
# command (qwen3_vl compiled took 136 s on an H200, 2026-11-27; 30b-a3b compiled without
# transformers 49 s on an H100, the checks about 3 minutes).
set -euo pipefail
cd "$(dirname "$0")/.."
family=${1:-qwen3_vl}
preset=${2:-2b}
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
python -c "import transformers; print('transformers:', transformers.__version__)"
python -m vlmcore.cli kernels
out=${OUT:-benchmarks/results}
if [ "$family" = checks ]; then
    exec python benchmarks/gpu_checks.py --out "$out"
fi
# Issue 42 item 4: questions a second of `vlmcore eval` on a random Qwen3-VL-2B-shaped export (bf16),
# per task kind and batch size, and its generation against transformers' generate. Not yet run on a
# GPU; sized for the 10 minutes of one command: the 2B model is built on the CPU once, then each of
# the 12 evaluations loads it and answers 64 questions.
if [ "$family" = eval ]; then
    exec python benchmarks/eval_throughput.py --preset 2b --device cuda --limit 64 --batch-sizes 1,4,8 \
        --note "$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)" --out "$out"
fi
python benchmarks/train_step.py --preset "$preset" --all --family "$family" --profile --out "$out"
# One file for the traces and summaries: the device tool brings back at most 8 files.
(cd "$out" && tar czf "profiles_${family}_${preset}.tar.gz" profile_* && rm -r profile_*)
