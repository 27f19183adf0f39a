"""Evaluation throughput: questions a second of `vlmcore eval` on one device, per kind of task and
batch size, its free-form answers generated before (transformers' `generate`) and after (vlmcore's
native decoder).

    python benchmarks/eval_throughput.py --preset tiny                 # CPU, the demo's tiny model
    python benchmarks/eval_throughput.py --video-workers 0,2           # the video tasks also with 2 decoding workers
    python benchmarks/eval_throughput.py --preset 2b --device cuda     # one GPU, Qwen3-VL-2B's shape, bf16

Four tasks, on the synthetic demo data (`vlmcore synth`'s images and clips): image multiple choice
(demo_vqa: one log-likelihood forward per choice, batched), image free-form answers (demo_vqa_gen,
ChartQA/DocVQA-like: greedy generation, batched), video multiple choice (demo_video_qa) and video
free-form answers (the same questions generated, as Video-MME and MVBench are, batched the same
way: vlmcore/eval/vlm.py). Each runs through the real `vlmcore.eval.runner.evaluate` at every batch
size; the figure is questions over the seconds spent in the model's request methods (encoding,
forwards, decoding), so model loading (the native model's too) and lm-eval's task building are
left out (the end-to-end wall time is in the JSON too). The video tasks run once per count of
`--video-workers` (eval.video_workers: processes that decode the clips ahead of the model;
starting them is inside the timed methods), and their answers are checked equal to those of the
first count's run.

The generation tasks run once per `--generators` (`vlmcore eval --generator`): `transformers`,
transformers' `generate` on the export (KV cache, left-padded batches, lm-eval's stopping
criteria), and `vlmcore`, the native decoder (vlmcore.generate: packed prefill, KV cache, each row
leaving the batch at its stop) on the native model loaded from the same snapshot; the native
answers are checked equal to transformers'.

The 2b preset is Qwen3-VL-2B-Instruct's architecture with random weights and the demo tokenizer
(a vocabulary of hundreds, not 151,936); `--model DIR` evaluates an exported directory instead.
Prints a table and writes benchmarks/results/eval_throughput_<device>[_<preset>].json.
"""

import argparse
import contextlib
import functools
import json
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from common import write_results  # noqa: E402 (reads vlmcore: after the path above)

from vlmcore.data.synthetic import image as synthetic_image  # noqa: E402
from vlmcore.data.synthetic import video as synthetic_video  # noqa: E402
from vlmcore.download import build_tiny_model  # noqa: E402
from vlmcore.eval import runner, vlm  # noqa: E402

PRESETS = {
    # The demo's model (vlmcore.tiny.tiny_vl_config), fp32.
    "tiny": dict(overrides=None, dtype="float32"),
    # Qwen3-VL-2B-Instruct's published config.json shape, bf16.
    "2b": dict(
        overrides={
            "text_config": {
                "hidden_size": 2048,
                "intermediate_size": 6144,
                "num_hidden_layers": 28,
                "num_attention_heads": 16,
                "num_key_value_heads": 8,
                "head_dim": 128,
                "tie_word_embeddings": True,
                "rope_parameters": {
                    "rope_type": "default",
                    "rope_theta": 5e6,
                    "mrope_section": [24, 20, 20],
                    "mrope_interleaved": True,
                },
            },
            "vision_config": {
                "depth": 24,
                "hidden_size": 1024,
                "intermediate_size": 4096,
                "num_heads": 16,
                "out_hidden_size": 2048,
                "num_position_embeddings": 2304,
                "deepstack_visual_indexes": [5, 11, 17],
            },
        },
        dtype="bfloat16",
    ),
}
GENERATORS = ("transformers", "vlmcore")  # before and after
# task: (what it measures, the demo data it reads)
TASKS = {
    "demo_vqa": ("image, multiple choice (log-likelihood)", "image"),
    "demo_vqa_gen": ("image, free-form answer (generation)", "image"),
    "demo_video_qa": ("video, multiple choice (log-likelihood)", "video"),
    "bench_video_qa_gen": ("video, free-form answer (generation)", "video"),
}
# The video demo's questions answered freely: generation with videos, as Video-MME and MVBench run.
VIDEO_GENERATION_TASK = """\
include: {demo_video_qa}
task: bench_video_qa_gen
output_type: generate_until
generation_kwargs: {{until: ["<|im_end|>", "\\n"], max_gen_toks: 8, do_sample: false}}
metric_list:
  - {{metric: exact_match, aggregation: mean, higher_is_better: true, ignore_case: true}}
"""
GENERATION_TASKS = ("demo_vqa_gen", "bench_video_qa_gen")


class ModelClock:
    """Seconds and requests spent in the vlmcore-vlm model's request methods."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.requests = 0

    @contextlib.contextmanager
    def timing(self, device: str) -> Iterator[None]:
        originals = {name: getattr(vlm.VisionLanguageLM, name) for name in ("loglikelihood", "generate_until")}

        def timed(method):  # noqa: ANN001, ANN202 (a wrapper of lm-eval's methods)
            @functools.wraps(method)
            def wrapper(model, requests, *args, **kwargs):  # noqa: ANN001, ANN202
                if method.__name__ == "generate_until" and model.generator == "vlmcore":
                    model.native_model  # noqa: B018 (loaded on first use: loading is left out of the clock)
                synchronize(device)
                start = time.perf_counter()
                result = method(model, requests, *args, **kwargs)
                synchronize(device)
                self.seconds += time.perf_counter() - start
                self.requests += len(requests)
                return result

            return wrapper

        for name, method in originals.items():
            setattr(vlm.VisionLanguageLM, name, timed(method))
        try:
            yield
        finally:
            for name, method in originals.items():
                setattr(vlm.VisionLanguageLM, name, method)


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def write_data(root: Path, questions: int) -> dict[str, Path]:
    """The demo's held-out image and video questions, and the extra video generation task."""
    synthetic_image.generate(root / "image", num_train=1, num_eval=questions, seed=3)
    synthetic_video.generate(root / "video", num_train=1, num_eval=questions, seed=1)
    tasks = root / "tasks"
    tasks.mkdir()
    demo_video_qa = runner.BUNDLED_TASKS / "demo_video_qa" / "demo_video_qa.yaml"
    (tasks / "bench_video_qa_gen.yaml").write_text(VIDEO_GENERATION_TASK.format(demo_video_qa=demo_video_qa))
    return {"image": root / "image/eval.jsonl", "video": root / "video/eval.jsonl", "tasks": tasks}


def run_task(
    model: Path,
    task: str,
    data: dict[str, Path],
    out: Path,
    args: argparse.Namespace,
    batch: int,
    workers: int,
    generator: str,
) -> dict:
    """One evaluation of one task at one batch size, count of video workers and generator: its row
    of the table."""
    clock = ModelClock()
    start = time.perf_counter()
    with clock.timing(args.device):
        result = runner.evaluate(
            model,
            [task],
            out,
            vqa_data=data[TASKS[task][1]],
            limit=args.limit,
            batch_size=batch,
            device=args.device,
            dtype=args.dtype,
            include_path=[data["tasks"]],
            video_workers=workers,
            generator=generator,
        )
    wall = time.perf_counter() - start
    questions = result["n-samples"][task]["effective"]
    return {
        "task": task,
        "kind": TASKS[task][0],
        "batch_size": batch,
        "video_workers": workers,
        # A multiple-choice task generates nothing: its generator makes no difference.
        "generator": generator if task in GENERATION_TASKS else "-",
        "questions": questions,
        "requests": clock.requests,
        "model_seconds": round(clock.seconds, 4),
        "questions_per_s": round(questions / clock.seconds, 3),
        "wall_seconds": round(wall, 3),
    }


def same_answers(out: Path, first: Path, task: str) -> bool:
    """Whether the run in `out` logged the same responses as the run in `first`."""

    def responses(directory: Path) -> list:
        lines = (directory / f"samples_{task}.jsonl").read_text().splitlines()
        return [json.loads(line)["resps"] for line in lines]

    return responses(out) == responses(first)


def comparison(before: dict, after: dict, same: bool) -> dict:
    """A generation task's figures before (transformers' generate) and after (the native decoder)."""
    return {
        "task": before["task"],
        "batch_size": before["batch_size"],
        "video_workers": before["video_workers"],
        "questions": before["questions"],
        "transformers_questions_per_s": before["questions_per_s"],
        "vlmcore_questions_per_s": after["questions_per_s"],
        "speedup": round(after["questions_per_s"] / before["questions_per_s"], 2),
        "same_answers": same,
    }


def print_table(rows: list[dict], comparisons: list[dict], header: str) -> None:
    print(header)
    print(
        f"{'task':<22} {'kind':<40} {'batch':>5} {'workers':>7} {'generator':>12} {'questions':>9} "
        f"{'requests':>8} {'q/s':>9} {'wall s':>8}"
    )
    for row in rows:
        print(
            f"{row['task']:<22} {row['kind']:<40} {row['batch_size']:>5} {row['video_workers']:>7} "
            f"{row['generator']:>12} {row['questions']:>9} {row['requests']:>8} {row['questions_per_s']:>9.3f} "
            f"{row['wall_seconds']:>8.1f}"
        )
    print("free-form answers, questions a second: transformers' generate (before) vs vlmcore's decoder (after)")
    print(f"{'task':<22} {'batch':>5} {'workers':>7} {'transformers':>12} {'vlmcore':>9} {'speed-up':>8} {'same':>5}")
    for c in comparisons:
        print(
            f"{c['task']:<22} {c['batch_size']:>5} {c['video_workers']:>7} {c['transformers_questions_per_s']:>12.3f} "
            f"{c['vlmcore_questions_per_s']:>9.3f} {c['speedup']:>7.2f}x {str(c['same_answers']):>5}"
        )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=PRESETS, default="tiny")
    parser.add_argument("--model", type=Path, help="an exported HF directory to evaluate (default: a random one)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None, help="default: the preset's (float32 tiny, bfloat16 2b)")
    parser.add_argument("--batch-sizes", default="1,4,8", help="comma-separated")
    parser.add_argument(
        "--video-workers",
        default="0",
        help="comma-separated counts of the processes that decode the video tasks' clips (0 = in process)",
    )
    parser.add_argument(
        "--generators",
        default=",".join(GENERATORS),
        help="comma-separated generators of the free-form tasks (vlmcore eval --generator), of "
        + ", ".join(GENERATORS),
    )
    parser.add_argument("--limit", type=int, default=16, help="questions per task")
    parser.add_argument("--tasks", default=",".join(TASKS), help="comma-separated, of " + ", ".join(TASKS))
    parser.add_argument("--note", default="", help="a line about the machine, kept in the JSON")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    return parser


def main() -> int:
    args = build_parser().parse_args()
    args.dtype = args.dtype or PRESETS[args.preset]["dtype"]
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    video_workers = [int(w) for w in args.video_workers.split(",")]
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    generators = [g.strip() for g in args.generators.split(",") if g.strip()]
    unknown = sorted(set(generators) - set(GENERATORS))
    if unknown or not generators:
        raise SystemExit(f"--generators {args.generators!r}: each must be one of {', '.join(GENERATORS)}")
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory(prefix="eval_throughput_") as tmp:
        root = Path(tmp)
        model = args.model
        if model is None:
            model = root / "model"
            build_tiny_model(model, seed=0, overrides=PRESETS[args.preset]["overrides"])
        data = write_data(root / "data", args.limit)
        rows = []
        comparisons = []
        for task in tasks:
            for batch in batch_sizes:
                # Image tasks have no clips to decode: in process only.
                counts = video_workers if TASKS[task][1] == "video" else [0]
                # Multiple-choice tasks generate nothing: one run.
                task_generators = generators if task in GENERATION_TASKS else generators[-1:]
                for workers in counts:
                    by_generator = {}
                    for generator in task_generators:
                        out = root / "eval" / f"{task}_{batch}_{workers}_{generator}"
                        row = run_task(model, task, data, out, args, batch, workers, generator)
                        first = root / "eval" / f"{task}_{batch}_{counts[0]}_{generator}"
                        row["same_answers_as_first_run"] = same_answers(out, first, task)
                        rows.append(row)
                        by_generator[generator] = (row, out)
                        print(json.dumps(row), flush=True)
                    if set(GENERATORS) <= set(by_generator):
                        (before, before_out), (after, after_out) = (by_generator[g] for g in GENERATORS)
                        comparisons.append(comparison(before, after, same_answers(after_out, before_out, task)))
    device_name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    result = {
        "device": device_name,
        "preset": args.preset if args.model is None else str(args.model),
        "dtype": args.dtype,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "date": time.strftime("%Y-%m-%d"),
        "note": args.note,
        "limit": args.limit,
        "rows": rows,
        "generators": generators,
        "native_vs_transformers": comparisons,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    tag = "cpu" if device_name == "cpu" else "cuda"
    path = args.out / f"eval_throughput_{tag}{'' if args.preset == 'tiny' else '_' + args.preset}.json"
    write_results(path, result)
    print_table(rows, comparisons, f"{device_name}, {args.preset}, {args.dtype}, torch {torch.__version__}")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
