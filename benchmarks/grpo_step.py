"""A GRPO step's time split into rollout (the policy's sampling), rewards, reference and update,
measured through `vlmcore train` itself on a packed prompt dataset.

    OMP_NUM_THREADS=1 python benchmarks/grpo_step.py                       # CPU, tiny demo model
    python benchmarks/grpo_step.py --preset 2b --device cuda                # one GPU, the 2B shape
    python benchmarks/grpo_step.py --preset 2b --device cuda --prompts 64 --group-size 5 \\
        --max-new-tokens 2048                                               # EasyR1's recipe per GPU

The model is the demo's Qwen3-VL (its tokenizer and processor: `vlmcore.download.build_tiny_model`)
at the preset's widths with random weights: `tiny` the demo's own, `2b` the Qwen3-VL-2B class
(benchmarks/common.py PRESETS, its 151,936-token vocabulary). The prompts are the synthetic image
demo's RL prompts, prepared and packed as the workflow does. A random model rarely stops, so most
completions run to --max-new-tokens: the rollout's worst case.

Two stages run, one without and one with a KL term (`grpo.beta` 0 and 0.04, the frozen reference
built only for the second); each takes --steps steps, one rollout each (updates_per_rollout 1).
From metrics.jsonl, per step after --warmup: `rollout_generation_s` and `rollout_reward_s` (the
rollout's wall seconds, inside the step's `data_wait_s`), the update (`step_time_s - data_wait_s`:
forward, backward and optimizer step, with the reference's forward in the second stage), and the
reference's cost as the difference of the two stages' updates. Medians; and the largest over
the steps of the rollout-training gap (`grpo_logp_gap`, the mean |old - new| log-probability of a
step's tokens, and `grpo_rollout_kl`, the KL from the sampler to the trainer), which on a GPU in
bf16 measures how far the decode's kernels are from training's. EasyR1's published
setting (512 prompts x 5 samples a step on 8 H100, answers up to 2,048 tokens) is 64 prompts x 5
a GPU. Prints a table and writes benchmarks/results/grpo_step_<device>_<preset>.json (--out, or $OUT).
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml
from common import PRESETS, REPO, print_table, read_metrics, src_env, train_command, write_results


def model_overrides(preset: str) -> dict:
    """build_tiny_model's overrides for a preset: none for the demo's widths, else the preset's."""
    if preset == "tiny":
        return {}
    text = dict(PRESETS[preset]["text"], max_position_embeddings=32768)
    half = text["head_dim"] // 2
    section = [half - 2 * (half * 5 // 16), half * 5 // 16, half * 5 // 16]
    text["rope_parameters"] = {
        "rope_type": "default",
        "rope_theta": 5e6,
        "mrope_section": section,
        "mrope_interleaved": True,
    }
    vision = dict(PRESETS[preset]["vision"], num_position_embeddings=2304)
    return {"text_config": text, "vision_config": vision}


def prompt_dataset(root: Path, args: argparse.Namespace) -> tuple[Path, Path]:
    """(model snapshot, packed prompt dataset) under `root`."""
    from vlmcore.data.pack.dataset import pack
    from vlmcore.data.prepare.dataset import prepare
    from vlmcore.data.synthetic.image import generate
    from vlmcore.download import build_tiny_model

    model = root / "model"
    build_tiny_model(model, overrides=model_overrides(args.preset))
    prompts_needed = args.prompts * (args.steps + args.warmup)
    generate(root / "raw", num_train=prompts_needed, num_eval=1, seed=0)
    prepare([f"prompts:{root / 'raw' / 'prompts.jsonl'}"], root / "data", shard_size=256)
    pack(root / "data", model, root / "packed", seq_len=args.seq_len, max_patches=1024, shard_size=256)
    return model, root / "packed"


def stage_config(root: Path, model: Path, data: Path, args: argparse.Namespace, beta: float) -> Path:
    name = f"beta{beta:g}"
    settings = {
        "model_path": str(model),
        "data_path": str(data),
        "output_dir": str(root / name),
        "steps": args.warmup + args.steps,
        "objective": "grpo",
        "data": {"seq_len": args.seq_len},
        "grpo": {
            "prompts_per_step": args.prompts,
            "group_size": args.group_size,
            "max_new_tokens": args.max_new_tokens,
            "temperature": 1.0,
            "loss": "dapo",
            "epsilon_high": 0.28,
            "beta": beta,
            "rewards": [{"name": "exact_match"}],
            "reward_workers": 1,
        },
        "micro_batch_size": 1,
        # One prompt's group a micro-batch: the update holds one group's rows at a time.
        "grad_accum_steps": args.prompts,
        "optimizer": {"lr": 1e-6},
        "schedule": {"name": "constant", "warmup_steps": 0},
        "checkpoint": {"enabled": False},
        "save_final": False,
        "parallel": {"activation_checkpointing": "full" if args.device == "cuda" else "none"},
        "precision": {"param_dtype": "bfloat16" if args.device == "cuda" else "float32", "reduce_dtype": "float32"},
    }
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(settings))
    return path


def measure(root: Path, model: Path, data: Path, args: argparse.Namespace, beta: float) -> dict:
    config = stage_config(root, model, data, args, beta)
    env = src_env(cpu=args.device == "cpu")
    if args.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    proc = subprocess.run(train_command(1, config), capture_output=True, text=True, env=env, cwd=REPO)
    if proc.returncode != 0:
        raise SystemExit(f"vlmcore train {config} failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    steps = read_metrics(root / f"beta{beta:g}")[args.warmup :]

    def median(values) -> float:
        return statistics.median(list(values))

    return {
        "beta": beta,
        "generation_s": median(m["rollout_generation_s"] for m in steps),
        "rewards_s": median(m["rollout_reward_s"] for m in steps),
        "update_s": median(m["step_time_s"] - m["data_wait_s"] for m in steps),
        "step_s": median(m["step_time_s"] for m in steps),
        "completion_tokens": median(m["completion_length_mean"] * args.prompts * args.group_size for m in steps),
        # One update a rollout: each step's is its rollout's first, so these are the rollout-training gap.
        "logp_gap_mean": max(m["grpo_logp_gap"] for m in steps),
        "rollout_kl": max(m["grpo_rollout_kl"] for m in steps),
        "steps": len(steps),
    }


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=("tiny", "2b"), default="tiny")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--prompts", type=int, default=8, help="grpo.prompts_per_step")
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=None, help="rollout row tokens (default: 256 + max new tokens)")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", REPO / "benchmarks" / "results")))
    return parser


def main() -> int:
    args = build_parser().parse_args()
    args.seq_len = args.seq_len or 256 + args.max_new_tokens
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model, data = prompt_dataset(root, args)
        without, with_kl = (measure(root, model, data, args, beta) for beta in (0.0, 0.04))
    reference = with_kl["update_s"] - without["update_s"]
    rows = []
    for run, reference_s in ((without, None), (with_kl, reference)):
        tokens_per_s = run["completion_tokens"] / run["step_s"]
        rows.append(
            [
                f"beta {run['beta']:g}",
                run["generation_s"],
                run["rewards_s"],
                reference_s,
                run["update_s"],
                run["step_s"],
                run["completion_tokens"],
                tokens_per_s,
                run["logp_gap_mean"],
                run["rollout_kl"],
            ]
        )
    print(
        f"GRPO step, {args.preset} on {args.device}: {args.prompts} prompts x {args.group_size} samples, "
        f"up to {args.max_new_tokens} new tokens, rows of {args.seq_len}; medians of {args.steps} steps"
    )
    print_table(
        [
            ("stage", "<10"),
            ("rollout s", ">11.3f"),
            ("rewards s", ">11.3f"),
            ("reference s", ">13.3f"),
            ("update s", ">10.3f"),
            ("step s", ">9.3f"),
            ("tokens", ">9.0f"),
            ("tokens/s", ">10.1f"),
            ("|dlogp| mean", ">14.2e"),
            ("rollout KL", ">12.2e"),
        ],
        rows,
    )
    result = {
        "preset": args.preset,
        "device": args.device,
        "prompts_per_step": args.prompts,
        "group_size": args.group_size,
        "max_new_tokens": args.max_new_tokens,
        "seq_len": args.seq_len,
        "runs": [without, with_kl],
        "reference_s": reference,
    }
    write_results(args.out / f"grpo_step_{args.device}_{args.preset}.json", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
