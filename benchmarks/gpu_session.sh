#!/usr/bin/env bash
# One GPU session's measurements, ready to run on a lent machine that has a CUDA torch and
# transformers but no network: vlmcore runs from src/, nothing is installed.
#
#   bash benchmarks/gpu_session.sh first               # issue 43 item 7's headline figures in one command:
#                                                      # run this first when a session is lent 15 minutes
#   bash benchmarks/gpu_session.sh qwen3_vl            # issue 15: the 2B Qwen3-VL part of the table
#   bash benchmarks/gpu_session.sh qwen3               # issue 15: the 2B Qwen3 part
#   bash benchmarks/gpu_session.sh qwen3_vl_moe 30b-a3b   # issue 19: Qwen3-VL-30B-A3B's shape, 4 layers
#   bash benchmarks/gpu_session.sh checks              # issue 31 item 3: expert mesh on NCCL, bf16 resume;
#                                                      # issue 43 item 5: the experts' group padding
#   bash benchmarks/gpu_session.sh fp8                 # issue 43 item 4: FP8 (see its block below)
#   bash benchmarks/gpu_session.sh eval                # issue 42 item 4: evaluation throughput,
#                                                      # both generators (transformers, vlmcore)
#   bash benchmarks/gpu_session.sh one_rank            # issue 43 item 3: the one-rank cast vs FSDP2's units
#   bash benchmarks/gpu_session.sh post_training lora  # issue 41 item 7: the 2B's LoRA step vs peft
#   bash benchmarks/gpu_session.sh post_training cost  # LoRA's optimizer step and checkpoint vs full
#   bash benchmarks/gpu_session.sh post_training dpo   # the DPO step vs its FLOPs at the SFT rate
#   bash benchmarks/gpu_session.sh grpo                # a GRPO step's rollout / rewards / reference /
#                                                      # update split, the 2B shape, EasyR1's 64 x 5 a GPU
#
# post_training runs benchmarks/post_training.py on the 2B Qwen3-VL, compiled, one part a command
# (each builds two to four 2B runs and compiles them; the full fine-tuning ones hold 16 bytes a
# parameter, 32 GB, so the dpo part wants an H200 or an 80 GB GPU with room to spare). peft is not
# on the GPU machine: build it here, beside nothing else (transformers is there already),
#     pip install --no-deps --target build/gpu_site "peft==0.21.2" "accelerate==1.15.0"
# and give the device tool carry: ["build/gpu_site"] (build/ is git-ignored, so it travels only
# when carried); this script puts build/gpu_site on the path when it is there.
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
if [ -d build/gpu_site ]; then  # peft and accelerate, carried (post_training above)
    export PYTHONPATH="$PYTHONPATH:$PWD/build/gpu_site"
fi

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
python -c "import transformers; print('transformers:', transformers.__version__)"
python -m vlmcore.cli kernels
out=${OUT:-benchmarks/results}
# Issue 43 item 7 in one command of about 5 minutes, 8.5 at most (a session's device time is 15
# minutes, the machine's start included; the compiled qwen3_vl case took 136 s with transformers
# on an H200, the 30B-A3B's 49 s on an H100): the compiled bare step and real loop of the 2B Qwen3-VL (profiled)
# and Qwen3, each beside its memory estimate; the grouped GEMMs' group padding at the 30B-A3B
# layer; the 30B-A3B shape's compiled step and loop. No transformers, no eager rows (the
# per-family commands below have them). Each part has its own time limit, so that one that
# hangs leaves the rest their time; each writes its results under $OUT as it finishes.
if [ "$family" = first ]; then
    status=0
    part() {  # part SECONDS NAME COMMAND...: runs the command under its time limit, notes its status
        local limit=$1 name=$2
        shift 2
        echo "=== $name (limit ${limit} s) ==="
        timeout --kill-after=10 "$limit" "$@" || { echo "=== $name: exit $? ==="; status=1; }
    }
    part 180 qwen3_vl python benchmarks/train_step.py --preset 2b --family qwen3_vl --compile \
        --skip-transformers --memory-estimate --profile --out "$out/first_qwen3_vl"
    part 150 qwen3 python benchmarks/train_step.py --preset 2b --family qwen3 --compile \
        --skip-transformers --memory-estimate --out "$out/first_qwen3"
    part 60 grouped_mm_alignment python benchmarks/grouped_mm_alignment.py --out "$out/first_grouped_mm"
    part 120 qwen3_vl_moe python benchmarks/train_step.py --preset 30b-a3b --family qwen3_vl_moe --compile \
        --skip-transformers --memory-estimate --out "$out/first_30b_a3b"
    if compgen -G "$out/first_qwen3_vl/profile_*" > /dev/null; then
        (cd "$out/first_qwen3_vl" && tar czf profiles.tar.gz profile_* && rm -r profile_*)
    fi
    exit $status
fi
if [ "$family" = checks ]; then
    exec python benchmarks/gpu_checks.py --out "$out"
fi

# --- FP8 (issue 43 item 4) ---------------------------------------------------------------------
# The real `vlmcore train` loop on the 2B preset's Qwen3 (2048 wide, MLP 6144, 28 layers, 8192
# tokens a step), compiled, in bf16 and with torchao float8 (precision.fp8) tensorwise and
# rowwise, one GPU: step time and peak memory of each (the bare step of train_step.py stays bf16:
# --loop-set reaches the loop only). The machine has no torchao and no network: the device tool's
# `carry` brings the wheel, downloaded here beforehand into build/wheels/ (git-ignored):
#   pip download "torchao==0.18.0" --no-deps -d build/wheels
# and the run is `bash benchmarks/gpu_session.sh fp8` with carry ["build/wheels"]. torchao 0.18
# needs torch >= 2.11 (its __init__.py), which the machine has; its wheel is cp310-abi3.
if [ "$family" = fp8 ]; then
    pip install --no-deps --no-index --find-links build/wheels "torchao==0.18.0"
    for recipe in none tensorwise rowwise; do
        python benchmarks/train_step.py --preset 2b --family qwen3 --compile --skip-transformers \
            --loop-set "precision.fp8.recipe=$recipe" --out "$out/fp8_$recipe"
    done
    exit 0
fi
# --- end FP8 -----------------------------------------------------------------------------------
# Issue 43 item 3: one GPU's compiled 2B Qwen3-VL step (bare and the real loop, profiled) with the
# one-rank cast (the default: the weights cast in one copy, no FSDP units) and with FSDP2's units
# over the one GPU, each beside the memory estimate of its own path (CPU, 2026-11-29: 48.4 and
# 45.8 GiB; the host-work counts in docs/performance.md).
if [ "$family" = one_rank ]; then
    for path in cast fsdp2; do
        flag=""
        if [ "$path" = fsdp2 ]; then flag="--one-rank-fsdp2"; fi
        python benchmarks/train_step.py --preset 2b --family qwen3_vl --compile --skip-transformers \
            --memory-estimate --profile $flag --out "$out/one_rank_$path"
        (cd "$out/one_rank_$path" && tar czf "profiles.tar.gz" profile_* && rm -r profile_*)
    done
    exit 0
fi
# A GRPO step of the 2B Qwen3-VL shape (random weights, bf16) through `vlmcore train`, EasyR1's
# geometry3k setting scaled to one GPU: 64 prompts x 5 samples, answers up to 1024 tokens (a random
# model rarely stops: the rollout's worst case), with and without a frozen reference, and the
# rollout-training gap in bf16 (mean |d log p|, the sampler-to-trainer KL). Not yet run
# on a GPU; two stages of 1 warm-up and 2 measured steps each.
if [ "$family" = grpo ]; then
    exec python benchmarks/grpo_step.py --preset 2b --device cuda --prompts 64 --group-size 5 \
        --max-new-tokens 1024 --steps 2 --warmup 1 --out "$out"
fi
if [ "$family" = post_training ]; then
    exec python benchmarks/post_training.py --preset 2b --compile --part "${2:-lora}" --out "$out"
fi
# Issue 42 item 4: questions a second of `vlmcore eval` on a random Qwen3-VL-2B-shaped export (bf16),
# per task kind and batch size, the free-form answers generated by both generators (transformers'
# generate, before, and vlmcore's native decoder, after: answers checked equal); the video tasks
# with their clips decoded in the evaluating process and by 8 workers (of the machine's 16 cores).
# Not yet run on a GPU; sized for the 10 minutes of one command: the 2B model is built on the CPU
# once, then each of the 27 evaluations loads it (the native runs also vlmcore's model) and answers
# 32 questions.
if [ "$family" = eval ]; then
    exec python benchmarks/eval_throughput.py --preset 2b --device cuda --limit 32 --batch-sizes 1,4,8 \
        --video-workers 0,8 --generators transformers,vlmcore \
        --note "$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)" --out "$out"
fi
python benchmarks/train_step.py --preset "$preset" --all --family "$family" --profile --out "$out"
# One file for the traces and summaries: the device tool brings back at most 8 files.
(cd "$out" && tar czf "profiles_${family}_${preset}.tar.gz" profile_* && rm -r profile_*)
