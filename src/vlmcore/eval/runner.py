"""`vlmcore eval`: lm-eval on an exported HF directory, offline by default.

Text-only models run through lm-eval's `hf` model, vision-language exports through `vlmcore-vlm`
(vlmcore/eval/vlm.py says why; `hf` cannot load them at all: AutoModelForCausalLM does not map
Qwen3-VL), whose free-form answers vlmcore's native decoder generates (`--generator transformers`:
transformers' `generate` on the export, the reference). Tasks are lm-eval's by name (mmlu,
arc_challenge, ...; their datasets must be in the local HF cache), bundled here under vlmcore/eval/tasks/ (on the file given by --vqa-data:
demo_vqa, multiple choice, and demo_vqa_gen, free answers, for the image demo, and demo_preference,
the held-out preference pairs beside that file as a choice of two; demo_video_qa and
its frame-shuffled control demo_video_qa_shuffled for the video demo), the public benchmarks
(mmmu_val, chartqa, docvqa_val, mmbench_en_dev, videomme, videomme_w_subtitle, mvbench: staged
data under --benchmark-data; docs/evaluation.md), or from --include-path.

Under `torchrun --nproc-per-node N -m vlmcore.cli eval ...` the samples of every task are split
among the N processes (lm-eval's data parallelism through accelerate, one GPU each) and the first
process writes the results of all.

EVAL_DIR gets `results.json` (lm-eval's results, configs and versions, plus `chance`: the chance
level of every multiple-choice task, and `breakdown`: the score per question kind of tasks whose
docs have a `kind`, and the public benchmarks' own breakdowns), `results.csv` (one row per task, kind and metric) and `samples_<task>.jsonl`.

A video that does not decode is counted, not fatal (vlmcore/eval/vlm.py says how it is scored):
results.json's `undecodable_videos` has the count per task and reason, and
`undecodable_video_samples` each question (task, doc_id, video, reason, detail); results.csv a
row per task and reason (subset `undecodable_video/<reason>`, metric `undecodable_videos`).
"""

import argparse
import json
import os
from collections.abc import Sequence
from pathlib import Path

# Offline unless the caller says otherwise; set before huggingface_hub / datasets are imported.
for _var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
    os.environ.setdefault(_var, "1")

import lm_eval  # noqa: E402
import lm_eval.models  # noqa: E402,F401  (fills lm-eval's model registry before ours is added)
import torch.distributed as dist  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402
from lm_eval.utils import handle_non_serializable  # noqa: E402

from vlmcore.eval import vlm  # noqa: E402  (registers `vlmcore-vlm`)
from vlmcore.eval.benchmarks.data import BadBenchmarkData  # noqa: E402
from vlmcore.eval.benchmarks.registry import BENCHMARKS  # noqa: E402
from vlmcore.eval.results import results_table  # noqa: E402
from vlmcore.eval.staging import StagingError, check_staged  # noqa: E402

BUNDLED_TASKS = Path(__file__).parent / "tasks"
# The bundled tasks that read the demo's held-out file (`--vqa-data`).
DEMO_TASKS = ("demo_vqa", "demo_vqa_gen", "demo_preference", "demo_video_qa", "demo_video_qa_shuffled")


class EvalSetupError(ValueError):
    """A model directory, task list or staged benchmark that cannot be evaluated, found before the
    model loads: `vlmcore eval` prints it as one line naming the task or file (exit code 2), not as
    a traceback."""


def is_vision_language(model_dir: str | Path) -> bool:
    config_path = Path(model_dir) / "config.json"
    if not config_path.is_file():
        raise EvalSetupError(f"{model_dir}: no config.json; not an HF model directory")
    return "vision_config" in json.loads(config_path.read_text())


def chance(samples: list[dict]) -> float | None:
    """Chance accuracy of the evaluated docs of a multiple-choice task (mean 1/#choices; None for
    other tasks)."""
    if not samples or "acc" not in samples[0]:
        return None
    return sum(1.0 / len(sample["arguments"]) for sample in samples) / len(samples)


def breakdown(task: str, samples: list[dict]) -> dict:
    """A task's scores per subset, {subset: {metric, value, chance, n}}: a public benchmark's own
    breakdowns (its record's scores of the logged answers), else, when docs have a `kind`, the
    per-sample score (acc or exact_match) per kind."""
    if task in BENCHMARKS:
        return BENCHMARKS[task].breakdown(samples)
    if not samples:
        return {}
    metric = next((m for m in ("acc", "exact_match") if m in samples[0]), None)
    by_kind = {}
    for sample in samples:
        kind = sample["doc"].get("kind") if isinstance(sample["doc"], dict) else None
        if kind and metric:
            sample_chance = 1.0 / len(sample["arguments"]) if metric == "acc" else None
            by_kind.setdefault(kind, []).append((sample[metric], sample_chance))
    return {
        kind: {
            "metric": metric,
            "value": sum(v for v, _ in rows) / len(rows),
            "chance": sum(c for _, c in rows) / len(rows) if metric == "acc" else None,
            "n": len(rows),
        }
        for kind, rows in sorted(by_kind.items())
    }


def undecodable_videos() -> list[dict]:
    """The questions whose video did not decode, of every process of a data-parallel run."""
    found = sorted(vlm.UNDECODABLE_VIDEOS.values(), key=lambda q: (q["task"], q["doc_id"]))
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return found
    per_process = [None] * dist.get_world_size()
    dist.all_gather_object(per_process, found)
    return sorted((q for found in per_process for q in found), key=lambda q: (q["task"], q["doc_id"]))


def count_by_task_and_reason(questions: list[dict]) -> dict:
    counts = {}
    for question in questions:
        by_reason = counts.setdefault(question["task"], {})
        by_reason[question["reason"]] = by_reason.get(question["reason"], 0) + 1
    return counts


def task_manager_for(tasks: list[str], include_path: Sequence[str | Path], metadata: dict) -> TaskManager:
    """lm-eval's index of the tasks: the include paths alone (ours first) when they define every
    task asked for, else lm-eval's own task files too. lm-eval indexes its own tasks by parsing
    each of its 14,000 YAML files, 5.5 s of a demo evaluation's 16.5 s on a CPU core, for tasks
    that the bundled ones override or that no run asked for."""
    paths = [str(path) for path in include_path]
    own = TaskManager(include_path=paths, include_defaults=False, metadata=metadata)
    if all(task in own.all_tasks for task in tasks):
        return own
    return TaskManager(include_path=paths, metadata=metadata)


def check_tasks(tasks: list[str], task_manager: TaskManager, model_dir: Path, vision_language: bool) -> None:
    """Before the model loads: every task is one lm-eval knows (ours or its own), and the tasks that
    ask about images or videos (the demo's and the public benchmarks) have a vision-language model
    with its image processor to answer them; raises EvalSetupError naming the task or the file."""
    unknown = [task for task in tasks if task not in task_manager.all_tasks]
    if unknown:
        raise EvalSetupError(
            f"--tasks: no task {', '.join(unknown)}; vlmcore's are {', '.join(DEMO_TASKS)} and the benchmarks "
            f"{', '.join(BENCHMARKS)}, the others lm-eval's own (`lm-eval ls tasks` lists them)"
        )
    with_media = [task for task in tasks if task in DEMO_TASKS or task in BENCHMARKS]
    if with_media and not vision_language:
        raise EvalSetupError(
            f"{model_dir}: a text-only model (no vision_config in config.json) cannot answer the image or "
            f"video questions of {', '.join(with_media)}"
        )
    if with_media and not (model_dir / "preprocessor_config.json").is_file():
        raise EvalSetupError(
            f"{model_dir}: no preprocessor_config.json, the image processor that {', '.join(with_media)} "
            "need (`vlmcore export` writes it beside the weights)"
        )


def with_benchmarks_loaded(tasks: list[str], task_manager: TaskManager) -> list:
    """`tasks` with each public benchmark's lm-eval task built, its staged questions read, before
    the model loads (lm-eval builds the tasks after it): a table without a field the benchmark
    reads, or a question whose video is not there, is refused as an EvalSetupError. lm-eval takes
    the built tasks as they are."""
    loaded = []
    for task in tasks:
        if task not in BENCHMARKS:
            loaded.append(task)
            continue
        try:
            loaded.extend(task_manager.load([task])["tasks"].values())
        except BadBenchmarkData as error:
            raise EvalSetupError(str(error)) from error
    return loaded


def evaluate(
    model_dir: str | Path,
    tasks: list[str],
    out: str | Path,
    vqa_data: str | Path | None = None,
    limit: int | None = None,
    batch_size: int = 8,
    device: str = "cpu",
    dtype: str = "auto",
    include_path: Sequence[str | Path] = (),
    apply_chat_template: bool = False,
    num_fewshot: int | None = None,
    benchmark_data: str | Path | None = None,
    video_workers: int = 0,
    generator: str = "vlmcore",
) -> dict:
    """Runs lm-eval and writes EVAL_DIR/results.json, results.csv and samples_<task>.jsonl.
    `video_workers`: processes that decode the video clips ahead of the model (0: the evaluating
    process decodes them itself). `generator`: what generates the free-form answers of a
    vision-language model, vlmcore's native decoder ("vlmcore") or transformers' `generate` on the
    export ("transformers", the reference)."""
    model_dir = Path(model_dir).resolve()
    out = Path(out)
    model = "vlmcore-vlm" if is_vision_language(model_dir) else "hf"
    if generator not in vlm.GENERATORS:
        raise EvalSetupError(f"--generator: {generator!r}; must be one of {', '.join(vlm.GENERATORS)}")
    if set(DEMO_TASKS) & set(tasks) and vqa_data is None:
        raise EvalSetupError(
            f"tasks {', '.join(DEMO_TASKS)} need --vqa-data (the raw/eval.jsonl written by `vlmcore synth`)"
        )
    # Offline by construction: a public benchmark's staged copy is checked before the model loads
    # (under torchrun, its checksums by the first process only: every process reads the same files).
    rank = int(os.environ.get("RANK", "0"))
    try:
        check_staged(tasks, benchmark_data, checksums=rank == 0)
    except StagingError as error:
        raise EvalSetupError(str(error)) from error
    # Task metadata reaches the bundled tasks' loaders (demo_vqa reads `vqa_data`, a public
    # benchmark `benchmark_data`/<task>).
    metadata = {"vqa_data": str(Path(vqa_data).resolve())} if vqa_data else {}
    if benchmark_data:
        metadata["benchmark_data"] = str(Path(benchmark_data).resolve())
    task_manager = task_manager_for(tasks, [BUNDLED_TASKS, *include_path], metadata)
    check_tasks(tasks, task_manager, model_dir, model == "vlmcore-vlm")
    to_run = with_benchmarks_loaded(tasks, task_manager)
    model_args = {"pretrained": str(model_dir), "dtype": dtype}
    if model == "vlmcore-vlm":
        model_args["video_workers"] = video_workers
        model_args["generator"] = generator
    vlm.UNDECODABLE_VIDEOS.clear()
    result = lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=to_run,
        num_fewshot=num_fewshot,
        batch_size=batch_size,
        device=device,
        limit=limit,
        task_manager=task_manager,
        apply_chat_template=apply_chat_template,
        log_samples=True,
        bootstrap_iters=1000,
    )
    undecodable = undecodable_videos()  # every process takes part in the gathering
    if result is None:  # another than the first process of a data-parallel run: the first writes
        return {}
    samples = result.pop("samples")
    result["lm_eval_model"] = model
    # lm-eval's `hf` model (text-only exports) generates with transformers' `generate`.
    result["generator"] = generator if model == "vlmcore-vlm" else "transformers"
    result["undecodable_videos"] = count_by_task_and_reason(undecodable)
    result["undecodable_video_samples"] = undecodable
    chances = {task: chance(task_samples) for task, task_samples in samples.items()}
    result["chance"] = {task: level for task, level in chances.items() if level is not None}
    subsets = {task: breakdown(task, task_samples) for task, task_samples in samples.items()}
    # A public benchmark's breakdown is written even when it has no subsets (DocVQA).
    result["breakdown"] = {task: found for task, found in subsets.items() if found or task in BENCHMARKS}

    out.mkdir(parents=True, exist_ok=True)
    for task, task_samples in samples.items():
        lines = [json.dumps(sample, default=handle_non_serializable) + "\n" for sample in task_samples]
        (out / f"samples_{task}.jsonl").write_text("".join(lines))
    results_table(result).to_csv(out / "results.csv", index=False)
    tmp = out / "results.json.tmp"
    tmp.write_text(json.dumps(result, indent=2, default=handle_non_serializable) + "\n")
    os.replace(tmp, out / "results.json")
    return result


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from vlmcore.cli import existing_dir, existing_file, non_negative_int, positive_int

    parser.add_argument("--model", required=True, type=existing_dir, help="exported HF directory (vlmcore export)")
    parser.add_argument(
        "--tasks", required=True, help="comma-separated lm-eval task names (e.g. demo_vqa,arc_challenge)"
    )
    parser.add_argument("--out", required=True, help="output directory (results.json, results.csv, samples)")
    parser.add_argument(
        "--vqa-data", type=existing_file, help="raw/eval.jsonl of the demo, for the tasks " + ", ".join(DEMO_TASKS)
    )
    parser.add_argument(
        "--benchmark-data",
        type=existing_dir,
        help="directory of the staged public benchmarks (one folder per task: DIR/mmmu_val/, DIR/videomme/, ...; "
        "`vlmcore stage-benchmark`), checked before the model loads",
    )
    parser.add_argument("--limit", type=positive_int, help="at most this many examples per task")
    parser.add_argument("--batch-size", type=positive_int, default=8)
    parser.add_argument(
        "--video-workers",
        type=non_negative_int,
        default=0,
        help="processes that decode the video clips ahead of the model, per evaluating process "
        "(0 = the evaluating process decodes them itself)",
    )
    parser.add_argument(
        "--generator",
        choices=vlm.GENERATORS,
        default="vlmcore",
        help="what generates the free-form answers of a vision-language model: vlmcore's native decoder on "
        "the model loaded from the same snapshot (default), or transformers' generate on the export (the "
        "reference; lm-eval model_args generator=transformers)",
    )
    parser.add_argument("--device", default="cpu", help="torch device: cpu, cuda, cuda:0, ...")
    parser.add_argument("--dtype", default="auto", help="model dtype (auto = as saved, float32, bfloat16)")
    parser.add_argument("--num-fewshot", type=non_negative_int, help="few-shot examples (default: each task's own)")
    parser.add_argument(
        "--include-path",
        action="append",
        default=[],
        type=existing_dir,
        help="extra directory of lm-eval task YAMLs (repeatable)",
    )
    parser.add_argument(
        "--apply-chat-template",
        action="store_true",
        help="render every task through the chat template (image tasks always use it)",
    )


def run(args: argparse.Namespace) -> int:
    from vlmcore.cli import UsageError

    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if not tasks:
        raise UsageError(f"--tasks: no task names in {args.tasks!r}")
    if set(DEMO_TASKS) & set(tasks) and args.vqa_data is None:
        raise UsageError(
            f"--vqa-data: required by the tasks {', '.join(DEMO_TASKS)} (raw/eval.jsonl of `vlmcore synth`)"
        )
    try:
        result = evaluate(
            args.model,
            tasks,
            args.out,
            vqa_data=args.vqa_data,
            limit=args.limit,
            batch_size=args.batch_size,
            device=args.device,
            dtype=args.dtype,
            include_path=args.include_path,
            apply_chat_template=args.apply_chat_template,
            num_fewshot=args.num_fewshot,
            benchmark_data=args.benchmark_data,
            video_workers=args.video_workers,
            generator=args.generator,
        )
    except EvalSetupError as error:
        raise UsageError(str(error)) from error
    end_data_parallel()
    if result:
        print(results_table(result).to_string(index=False))
    return 0


def end_data_parallel() -> None:
    """Under torchrun: every process waits for the others (the first writes the results), then the
    process group (accelerate's, gloo or NCCL) is destroyed before the interpreter exits. Left to
    exit, a process could abort in gloo's teardown ("terminate called without an active exception",
    1 run in 6 on CPU), and torchrun then stops the first process, perhaps before it has written."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
