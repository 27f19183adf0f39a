"""Evaluation throughput: questions a second of `vlmcore eval` on one device, per kind of task and
batch size, and its free-form generation against transformers' `generate` on the same prompts.

    python benchmarks/eval_throughput.py --preset tiny                 # CPU, the demo's tiny model
    python benchmarks/eval_throughput.py --video-workers 0,2           # the video tasks also with 2 decoding workers
    python benchmarks/eval_throughput.py --preset 2b --device cuda     # one GPU, Qwen3-VL-2B's shape, bf16

Four tasks, on the synthetic demo data (`vlmcore synth`'s images and clips): image multiple choice
(demo_vqa: one log-likelihood forward per choice, batched), image free-form answers (demo_vqa_gen,
ChartQA/DocVQA-like: greedy generation with the KV cache, batched), video multiple choice
(demo_video_qa) and video free-form answers (the same questions generated, as Video-MME and
MVBench are, batched the same way: vlmcore/eval/vlm.py). Each runs through the real
`vlmcore.eval.runner.evaluate` at every batch size; the figure is questions over the seconds spent
in the model's request methods (encoding, forwards, decoding), so model loading and lm-eval's task
building are left out (the end-to-end wall time is in the JSON too). The video tasks run once per
count of `--video-workers` (eval.video_workers: processes that decode the clips ahead of the model;
starting them is inside the timed methods), and their answers are checked equal to those of the
first count's run.

The native model (vlmcore.models) has no KV cache: `vlmcore eval` generates with transformers'
`generate` on the export, in its own batches with lm-eval's stopping criteria. The comparison runs
transformers' `generate` directly on the export (the processor's left-padded batch of the same
prompts in the same order, greedy, the task's max_new_tokens, no stopping criteria) and checks the
answers are the same tokens.

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
STOPS = ("<|im_end|>", "\n")  # demo_vqa_gen's stop sequences


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
    model: Path, task: str, data: dict[str, Path], out: Path, args: argparse.Namespace, batch: int, workers: int
) -> dict:
    """One evaluation of one task at one batch size and count of video workers: its row of the table."""
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
        )
    wall = time.perf_counter() - start
    questions = result["n-samples"][task]["effective"]
    return {
        "task": task,
        "kind": TASKS[task][0],
        "batch_size": batch,
        "video_workers": workers,
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


def cut_at_stops(text: str) -> str:
    for stop in STOPS:
        text = text.split(stop)[0]
    return text


def transformers_generation(model_dir: Path, samples_file: Path, image_root: Path, args, batch: int) -> dict:  # noqa: ANN001
    """transformers' `generate` on the export, on demo_vqa_gen's prompts as vlmcore-vlm builds them
    (timed with the processor, as ours is with its encoding), against our logged answers."""
    from PIL import Image
    from transformers import AutoModelForImageTextToText

    from vlmcore.data.media.processor import load_processor

    dtype = torch.float32 if args.dtype in ("auto", "float32") else getattr(torch, args.dtype)
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=dtype).to(args.device).eval()
    processor = load_processor(model_dir)
    processor.tokenizer.padding_side = "left"
    end_of_turn = processor.tokenizer.convert_tokens_to_ids(STOPS[0])
    samples = sorted((json.loads(line) for line in samples_file.read_text().splitlines()), key=lambda s: s["doc_id"])
    prompts = []
    images = []
    for sample in samples:
        messages = vlm.user_turn("<image>\n" + sample["doc"]["question"], 1)
        prompts.append(processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))
        images.append(Image.open(image_root / sample["doc"]["image"]).convert("RGB"))
    # Ours batches the longest prompts first: the same batches pad the same way.
    lengths = [len(processor(text=[p], images=[i])["input_ids"][0]) for p, i in zip(prompts, images)]
    order = sorted(range(len(samples)), key=lambda i: -lengths[i])
    samples = [samples[i] for i in order]
    prompts = [prompts[i] for i in order]
    images = [images[i] for i in order]
    answers = []
    seconds = 0.0
    with torch.no_grad():
        for start in range(0, len(prompts), batch):
            synchronize(args.device)
            begin = time.perf_counter()
            inputs = processor(
                text=prompts[start : start + batch],
                images=images[start : start + batch],
                padding=True,
                return_tensors="pt",
            ).to(args.device)
            inputs["pixel_values"] = inputs["pixel_values"].to(dtype)
            tokens = model.generate(**inputs, max_new_tokens=8, do_sample=False)[:, inputs["input_ids"].shape[1] :]
            synchronize(args.device)
            seconds += time.perf_counter() - begin
            for row in tokens.tolist():
                # As lm-eval decodes: up to the stop token (its stopping criterion), special tokens
                # skipped, then cut at the stop sequences.
                if end_of_turn in row:
                    row = row[: row.index(end_of_turn)]
                answers.append(cut_at_stops(processor.tokenizer.decode(row, skip_special_tokens=True)))
    ours = [sample["resps"][0][0] for sample in samples]
    return {
        "batch_size": batch,
        "questions": len(samples),
        "transformers_seconds": round(seconds, 4),
        "transformers_questions_per_s": round(len(samples) / seconds, 3),
        "same_answers": sum(a == b for a, b in zip(ours, answers)),
        "differing": [
            {"doc_id": s["doc_id"], "ours": o, "transformers": t} for s, o, t in zip(samples, ours, answers) if o != t
        ],
    }


def print_table(rows: list[dict], comparisons: list[dict], header: str) -> None:
    print(header)
    print(
        f"{'task':<22} {'kind':<52} {'batch':>5} {'workers':>7} {'questions':>9} {'requests':>8} {'q/s':>9} "
        f"{'wall s':>8}"
    )
    for row in rows:
        print(
            f"{row['task']:<22} {row['kind']:<52} {row['batch_size']:>5} {row['video_workers']:>7} "
            f"{row['questions']:>9} {row['requests']:>8} {row['questions_per_s']:>9.3f} {row['wall_seconds']:>8.1f}"
        )
    print("free-form image answers: vlmcore eval vs transformers' generate called directly")
    for comparison in comparisons:
        print(
            f"  batch {comparison['batch_size']}: ours {comparison['ours_questions_per_s']:.3f} q/s, "
            f"transformers {comparison['transformers_questions_per_s']:.3f} q/s, "
            f"same answers {comparison['same_answers']}/{comparison['questions']}, faster: {comparison['faster']}"
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
                for workers in counts:
                    out = root / "eval" / f"{task}_{batch}_{workers}"
                    row = run_task(model, task, data, out, args, batch, workers)
                    first = root / "eval" / f"{task}_{batch}_{counts[0]}"
                    row["same_answers_as_first_run"] = same_answers(out, first, task)
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                if task == "demo_vqa_gen":
                    comparison = transformers_generation(
                        model, out / "samples_demo_vqa_gen.jsonl", data["image"].parent, args, batch
                    )
                    comparison["ours_questions_per_s"] = row["questions_per_s"]
                    ours_faster = row["questions_per_s"] >= comparison["transformers_questions_per_s"]
                    comparison["faster"] = "vlmcore eval" if ours_faster else "transformers generate"
                    comparisons.append(comparison)
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
        "generation_vs_transformers": comparisons,
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
