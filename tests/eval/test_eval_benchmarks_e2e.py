"""The public benchmarks' task definitions end to end, without any download: a handful of
questions written locally in each benchmark's exact format (its hub repository's files: parquet
tables with the `datasets` image feature, MVBench's JSON files, videos inside zip archives,
Video-MME's subtitles), run through `vlmcore eval` on a tiny exported Qwen3-VL in one call for
all seven tasks. The results must carry each benchmark's metric and breakdowns, and every logged
answer must score as its benchmark's record (vlmcore/eval/benchmarks/<task>.py) scores it, so a change in a loader, a prompt
or a scorer fails here. A second call with `--generator transformers` must give the same answers
and scores as the default native decoder.
"""

import json
import zipfile
from pathlib import Path

import datasets
import numpy as np
import pytest
from helpers import tiny_hf_snapshot
from PIL import Image

from vlmcore import cli
from vlmcore.data.media.video import encode_clip, probe
from vlmcore.eval.benchmarks import mvbench
from vlmcore.eval.benchmarks.data import MissingBenchmarkData
from vlmcore.eval.benchmarks.registry import BENCHMARKS
from vlmcore.eval.benchmarks.tasks import load
from vlmcore.eval.benchmarks.videomme_w_subtitle import subtitles_at_frames

TASKS = ["mmmu_val", "chartqa", "docvqa_val", "mmbench_en_dev", "videomme", "videomme_w_subtitle", "mvbench"]
# Video-MME's duration buckets: short under 2 minutes, medium 4-15, long 30-60 (seconds here, at 1 fps).
VIDEOMME_SECONDS = {"short": 20, "medium": 250, "long": 1805}


def image(seed: int, size: tuple[int, int] = (48, 40)) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8))


def write_parquet(path: Path, rows: list[dict], features: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    datasets.Dataset.from_list(rows, features=datasets.Features(features)).to_parquet(str(path))


def string() -> datasets.Value:
    return datasets.Value("string")


def write_mmmu(root: Path) -> None:
    rows = []
    for i, (subject, kind) in enumerate(
        [
            ("Art_Theory", "multiple-choice"),
            ("Math", "multiple-choice"),
            ("Math", "open"),
            ("Finance", "multiple-choice"),
        ]
    ):
        rows.append(
            {
                "id": f"validation_{subject}_{i + 1}",
                "question": f"<image 1> Which period is shown? {'Compare with <image 2>.' if i == 1 else ''}",
                "options": str(["Baroque", "Gothic", "Modern", "Roman"]) if kind != "open" else "[]",
                "explanation": "",
                "image_1": image(i),
                "image_2": image(i + 10) if i == 1 else None,
                "img_type": "['Paintings']",
                "answer": "B" if kind != "open" else "12",
                "topic_difficulty": "Easy",
                "question_type": kind,
                "subfield": subject,
            }
        )
    features = {name: string() for name in rows[0] if not name.startswith("image")}
    features.update(image_1=datasets.Image(), image_2=datasets.Image())
    write_parquet(root / "mmmu_val/data/validation-00000-of-00001.parquet", rows, features)


def write_chartqa(root: Path) -> None:
    rows = [
        {
            "type": "human_test" if i % 2 else "augmented_test",
            "question": f"What is bar {i}?",
            "answer": a,
            "image": image(20 + i),
        }
        for i, a in enumerate(["12", "Yes", "40%", "blue"])
    ]
    features = {"type": string(), "question": string(), "answer": string(), "image": datasets.Image()}
    write_parquet(root / "chartqa/data/test-00000-of-00001.parquet", rows, features)


def write_docvqa(root: Path) -> None:
    rows = [
        {
            "questionId": str(100 + i),
            "question": f"What is the total on page {i}?",
            "question_types": ["form"],
            "image": image(30 + i, (64, 80)),
            "docId": i,
            "ucsf_document_id": f"doc{i}",
            "ucsf_document_page_no": "1",
            "answers": answers,
            "data_split": "val",
        }
        for i, answers in enumerate([["$1,250.00", "1250"], ["Acme Corp."], ["March 3, 1998"]])
    ]
    features = {name: string() for name in rows[0]}
    features.update(
        question_types=datasets.Sequence(string()),
        image=datasets.Image(),
        docId=datasets.Value("int64"),
        answers=datasets.Sequence(string()),
    )
    write_parquet(root / "docvqa_val/DocVQA/validation-00000-of-00001.parquet", rows, features)


def write_mmbench(root: Path) -> None:
    """Two questions with their circular copies (index + k * 1e6), the second with three options."""
    rows = []
    for index, options, answer, category, l2 in (
        (1, ["red", "blue", "green", "yellow"], 0, "color_recognition", "Coarse Perception"),
        (2, ["cat", "dog", "bird"], 1, "object_localization", "Fine-grained Perception"),
    ):
        for shift in range(len(options)):
            rotated = options[shift:] + options[:shift]
            rows.append(
                {
                    "index": index + shift * 1_000_000,
                    "question": f"What is shown in picture {index}?",
                    "hint": "Look at the centre." if index == 1 else None,
                    "A": rotated[0],
                    "B": rotated[1],
                    "C": rotated[2],
                    "D": rotated[3] if len(rotated) > 3 else None,
                    "answer": "ABCD"[rotated.index(options[answer])],
                    "category": category,
                    "image": image(40 + index),
                    "source": "test",
                    "L2-category": l2,
                    "comment": None,
                    "split": "dev",
                }
            )
    features = {name: string() for name in rows[0]}
    features.update(index=datasets.Value("int64"), image=datasets.Image())
    write_parquet(root / "mmbench_en_dev/en/dev-00000-of-00001.parquet", rows, features)


def clip(seconds: int, fps: int = 1, seed: int = 0) -> bytes:
    """A small clip of `seconds` seconds: frames of changing colour, 32x48 pixels."""
    rng = np.random.default_rng(seed)
    colours = rng.integers(0, 255, (seconds * fps, 1, 1, 3), dtype=np.uint8)
    return encode_clip(list(np.broadcast_to(colours, (seconds * fps, 32, 48, 3))), fps, codec="mpeg4")


def srt(seconds: int) -> str:
    blocks = []
    for n, start in enumerate(range(0, seconds, max(seconds // 4, 1)), 1):
        end = start + max(seconds // 8, 1)
        blocks.append(
            f"{n}\n00:{start // 60:02d}:{start % 60:02d},000 --> 00:{end // 60:02d}:{end % 60:02d},000\n"
            f'<font color="white" size=".72c">line {n} at {start}s</font>'
        )
    return "\n\n".join(blocks) + "\n"


def write_videomme(root: Path) -> None:
    """Three videos (short, medium, long) of two questions each, in videos_chunked_01.zip under
    data/, the subtitles of two of them in subtitle.zip under subtitle/."""
    rows = []
    categories = [
        ("Knowledge", "Humanity & History", "Counting Problem"),
        ("Sports Competition", "Football", "Action Recognition"),
        ("Multilingual", "Multilingual", "Information Synopsis"),
    ]
    videos = {}
    subtitles = {}
    for number, (duration, seconds) in enumerate(VIDEOMME_SECONDS.items()):
        video_id = f"vid{number:03d}"
        videos[f"data/{video_id}.mp4"] = clip(seconds, seed=number)
        if duration != "long":
            subtitles[f"subtitle/{video_id}.srt"] = srt(seconds)
        domain, sub_category, task_type = categories[number]
        for question in range(2):
            rows.append(
                {
                    "video_id": f"{number + 1:03d}",
                    "duration": duration,
                    "domain": domain,
                    "sub_category": sub_category,
                    "url": f"https://www.youtube.com/watch?v={video_id}",
                    "videoID": video_id,
                    "question_id": f"{number + 1:03d}-{question + 1}",
                    "task_type": task_type,
                    "question": f"What happens in the video ({question})?",
                    "options": ["A. a goal", "B. a speech", "C. a song", "D. nothing"],
                    "answer": "ABCD"[(number + question) % 4],
                }
            )
    features = {name: string() for name in rows[0]}
    features["options"] = datasets.Sequence(string())
    for task, with_subtitles in (("videomme", False), ("videomme_w_subtitle", True)):
        write_parquet(root / f"{task}/videomme/test-00000-of-00001.parquet", rows, features)
        with zipfile.ZipFile(root / f"{task}/videos_chunked_01.zip", "w") as archive:
            for name, data in videos.items():
                archive.writestr(name, data)
        if with_subtitles:
            with zipfile.ZipFile(root / f"{task}/subtitle.zip", "w") as archive:
                for name, text in subtitles.items():
                    archive.writestr(name, text)


def write_mvbench(root: Path) -> None:
    """Two of MVBench's tasks: json/<task>.json and their videos in video/<source>.zip."""
    tasks = {
        "action_antonym": ("ssv2_video_mp4", ["walking", "not walking", "running"]),
        "moving_count": ("clevrer/video_validation", ["0", "1", "2", "3"]),
    }
    (root / "mvbench/json").mkdir(parents=True)
    (root / "mvbench/video").mkdir(parents=True)
    for number, (task, (folder, candidates)) in enumerate(tasks.items()):
        rows = [
            {
                "video": f"video_{number}{i}.mp4",
                "question": f"What does the object do ({i})?",
                "candidates": candidates,
                "answer": candidates[i % len(candidates)],
            }
            for i in range(3)
        ]
        (root / f"mvbench/json/{task}.json").write_text(json.dumps(rows))
        with zipfile.ZipFile(root / f"mvbench/video/{folder.split('/')[0]}.zip", "w") as archive:
            for i, row in enumerate(rows):
                archive.writestr(f"{folder}/{row['video']}", clip(6 + i, fps=4, seed=50 + i))


@pytest.fixture(scope="module")
def benchmark_data(tmp_path_factory):
    """Each benchmark's repository files written locally, then staged as the login-node rule stages
    a downloaded snapshot (links and a manifest with checksums, which `vlmcore eval` verifies)."""
    from vlmcore.eval.staging import stage_snapshot

    repositories = tmp_path_factory.mktemp("hub")
    for write in (write_mmmu, write_chartqa, write_docvqa, write_mmbench, write_videomme, write_mvbench):
        write(repositories)
    root = tmp_path_factory.mktemp("benchmarks")
    for task in TASKS:
        stage_snapshot(repositories / task, root / task, BENCHMARKS[task], "local", patterns=["*"])
    return root


def test_loaders_read_each_format_and_find_every_video(benchmark_data):
    counts = {"mmmu_val": 4, "chartqa": 4, "docvqa_val": 3, "mmbench_en_dev": 7, "videomme": 6, "mvbench": 6}
    for task, count in counts.items():
        rows = load(str(benchmark_data), task)["test"]
        assert len(rows) == count, task
    videos = load(str(benchmark_data), "videomme_w_subtitle")["test"]
    assert [row["video_member"] for row in videos][::2] == ["data/vid000.mp4", "data/vid001.mp4", "data/vid002.mp4"]
    assert [bool(row["subtitle_member"]) for row in videos][::2] == [True, True, False]
    durations = {}
    for row in videos:
        with zipfile.ZipFile(row["video_path"]) as archive:
            durations[row["duration"]] = probe(archive.read(row["video_member"])).duration_s
    assert durations["short"] < 120 and 240 <= durations["medium"] <= 900 and 1800 <= durations["long"] <= 3600
    # The short clip's 32 sampled frames (one every ~0.6 s) see each of its four subtitle lines.
    text = subtitles_at_frames(videos[0], 32)
    assert text.splitlines() == ["line 1 at 0s", "line 2 at 5s", "line 3 at 10s", "line 4 at 15s"]
    assert subtitles_at_frames(videos[4], 32) == "No subtitles available"
    mvbench = load(str(benchmark_data), "mvbench")["test"]
    assert sorted(set(mvbench["task"])) == ["action_antonym", "moving_count"]
    assert all(
        member.startswith(("ssv2_video_mp4/", "clevrer/video_validation/")) for member in mvbench["video_member"]
    )


def test_missing_or_wrong_data_fails_naming_the_task(benchmark_data, tmp_path):
    with pytest.raises(MissingBenchmarkData, match="chartqa: .* does not exist; stage the benchmark"):
        load(str(tmp_path), "chartqa")
    with pytest.raises(MissingBenchmarkData, match="--benchmark-data"):
        load(None, "videomme")
    bad = tmp_path / "docvqa_val/DocVQA/validation-00000-of-00001.parquet"
    write_parquet(bad, [{"question": "q", "image": image(0)}], {"question": string(), "image": datasets.Image()})
    with pytest.raises(ValueError, match="docvqa_val: .* no field questionId, answers"):
        load(str(tmp_path), "docvqa_val")
    (tmp_path / "mvbench/json").mkdir(parents=True)
    (tmp_path / "mvbench/json/action_antonym.json").write_text(
        json.dumps([{"video": "missing.mp4", "question": "q", "candidates": ["a", "b"], "answer": "a"}])
    )
    with pytest.raises(MissingBenchmarkData, match="mvbench: question action_antonym 0: its video missing.mp4"):
        load(str(tmp_path), "mvbench")


def test_every_registered_benchmark_has_a_task_definition_with_its_metric():
    """Each record of the registry (what the staging rule downloads) is a task lm-eval finds in
    the bundled folder, scored under the record's headline metric."""
    import yaml

    folder = Path(__file__).resolve().parents[2] / "src/vlmcore/eval/tasks/benchmarks"
    for name, benchmark in BENCHMARKS.items():
        text = (folder / f"{name}.yaml").read_text()
        config = yaml.safe_load(text.replace("!function ", ""))
        assert config["task"] == name
        assert config["dataset_kwargs"] == {"task": name}
        assert config["metric_list"][0]["metric"] == benchmark.metric
        assert callable(benchmark.record) and callable(benchmark.scores)
    assert sorted(BENCHMARKS) == sorted(TASKS)


def run_benchmarks(model: Path, benchmark_data: Path, out: Path, *extra: str) -> Path:
    args = ["eval", "--model", str(model), "--tasks", ",".join(TASKS), "--benchmark-data", str(benchmark_data)]
    assert cli.main([*args, "--out", str(out), "--batch-size", "4", *extra]) == 0
    return out


@pytest.fixture(scope="module")
def benchmark_run(benchmark_data, tmp_path_factory):
    """The seven benchmarks evaluated with the default generator, vlmcore's native decoder."""
    root = tmp_path_factory.mktemp("benchmark_run")
    model = tiny_hf_snapshot("qwen3_vl", root / "model")
    return run_benchmarks(model, benchmark_data, root / "eval")


@pytest.mark.slow
def test_native_generation_gives_the_answers_and_scores_of_transformers_generate(benchmark_run, benchmark_data):
    """Every free-form answer of the seven benchmarks (their stop sequences and token budgets, in
    batches of 4 with prompts of different lengths, images and videos) is the same string from
    vlmcore's decoder as from transformers' `generate` (`--generator transformers`), so every
    score and breakdown is unchanged."""
    reference = run_benchmarks(
        benchmark_run.parent / "model",
        benchmark_data,
        benchmark_run.parent / "transformers",
        "--generator",
        "transformers",
    )
    native = json.loads((benchmark_run / "results.json").read_text())
    expected = json.loads((reference / "results.json").read_text())
    assert native["generator"] == "vlmcore" and expected["generator"] == "transformers"
    for task in TASKS:
        assert native["configs"][task]["output_type"] == "generate_until", task
        ours = [json.loads(line) for line in (benchmark_run / f"samples_{task}.jsonl").read_text().splitlines()]
        theirs = [json.loads(line) for line in (reference / f"samples_{task}.jsonl").read_text().splitlines()]
        assert [s["doc_id"] for s in ours] == [s["doc_id"] for s in theirs]
        assert [s["resps"] for s in ours] == [s["resps"] for s in theirs], task
    # MMMU draws a random letter for an answer that names no option: seeded by lm-eval, the same draws.
    assert native["results"] == expected["results"]
    assert native["breakdown"] == expected["breakdown"]
    # Answers were generated (the decoder ran), not all empty.
    assert any(json.loads(line)["resps"][0][0] for line in (benchmark_run / "samples_chartqa.jsonl").open())


EXPECTED_SUBSETS = {
    "mmmu_val": ["discipline/Art and Design", "discipline/Science", "discipline/Business", "subject/Math"],
    "chartqa": ["split/human", "split/augmented"],
    "docvqa_val": [],
    "mmbench_en_dev": ["category/color_recognition", "l2_category/Fine-grained Perception"],
    "videomme": [
        "duration/short",
        "duration/medium",
        "duration/long",
        "domain/Knowledge",
        "task_type/Counting Problem",
    ],
    "videomme_w_subtitle": ["duration/long", "sub_category/Football"],
    "mvbench": ["task/action_antonym", "task/moving_count"],
}


@pytest.mark.slow
def test_every_benchmark_runs_end_to_end_with_its_metric_and_breakdowns(benchmark_run):
    result = json.loads((benchmark_run / "results.json").read_text())
    for task in TASKS:
        metric = BENCHMARKS[task].metric
        value = result["results"][task][f"{metric},none"]
        assert 0 <= value <= BENCHMARKS[task].scale, task
        for subset in EXPECTED_SUBSETS[task]:
            assert result["breakdown"][task][subset]["metric"] == metric, (task, subset)
    assert result["breakdown"]["mmbench_en_dev"]["category/color_recognition"]["n"] == 1  # copies count once
    assert result["breakdown"]["videomme"]["duration/long"]["n"] == 2
    table = (benchmark_run / "results.csv").read_text()
    assert "videomme,duration/short,videomme_perception_score" in table


@pytest.mark.slow
def test_logged_answers_score_as_our_scoring_and_prompts_are_the_benchmarks(benchmark_run):
    for task in TASKS:
        lines = (benchmark_run / f"samples_{task}.jsonl").read_text().splitlines()
        samples = [json.loads(line) for line in lines]
        record_of, scores = BENCHMARKS[task].record, BENCHMARKS[task].scores
        metric = BENCHMARKS[task].metric
        records = []
        for sample in samples:
            logged = sample[metric]
            if task != "mmmu_val":  # MMMU draws a random letter for answers naming no option
                expected = record_of(sample["doc"], sample["resps"][0][0])
                assert (expected.get(metric, expected) if not isinstance(logged, dict) else expected) == logged
            records.append(logged if isinstance(logged, dict) else {metric: logged})
        if isinstance(samples[0][metric], dict):
            result = json.loads((benchmark_run / "results.json").read_text())
            assert scores(records)["score"] == pytest.approx(result["results"][task][f"{metric},none"])
    # The first question's prompt (lm-eval logs each request's arguments: context, generation kwargs, visuals).
    prompts = {
        task: json.loads((benchmark_run / f"samples_{task}.jsonl").read_text().splitlines()[0])["arguments"][0][0]
        for task in TASKS
    }
    assert prompts["mmmu_val"].startswith("Question: <image 1> Which period is shown?")
    assert prompts["mmmu_val"].endswith(
        "Options:\nA. Baroque\nB. Gothic\nC. Modern\nD. Roman\nAnswer with the option letter only."
    )
    assert prompts["chartqa"].endswith("\nAnswer the question with a single word.")
    assert prompts["docvqa_val"].endswith("\nAnswer the question using a single word or phrase.")
    assert prompts["mmbench_en_dev"] == (
        "Look at the centre. What is shown in picture 1? There are several options:\n"
        "A. red\nB. blue\nC. green\nD. yellow\nAnswer with the option's letter from the given choices directly."
    )
    assert prompts["videomme"] == (
        "Question: What happens in the video (0)?\nOptions:\nA. a goal\nB. a speech\nC. a song\nD. nothing\n"
        "Answer with the option letter only."
    )
    assert prompts["videomme_w_subtitle"].startswith("This video's subtitles are listed below: \nline 1 at 0s\n")
    assert prompts["videomme_w_subtitle"].endswith(prompts["videomme"])
    # MVBench's tasks come in its own order: moving_count before action_antonym.
    assert prompts["mvbench"].startswith("Question:What does the object do (0)?\nOption:\n(A) 0\n(B) 1\n(C) 2\n(D) 3\n")
    assert prompts["mvbench"].endswith("Only give the best option.\n")


@pytest.mark.slow
def test_the_tiny_models_answers_score_as_lmms_eval_scores_them(benchmark_run):
    """The answers the tiny model gave, fed to lmms-eval 0.7.3's scoring: the same headline scores
    (MMMU is left out: an answer naming no option gets a random letter there)."""
    from lmms_eval.api.metrics import anls
    from lmms_eval.tasks.chartqa.utils import chartqa_process_results
    from lmms_eval.tasks.mmbench.en_utils import mmbench_process_results
    from lmms_eval.tasks.mmbench.mmbench_evals import MMBench_Evaluator
    from lmms_eval.tasks.mvbench.utils import mvbench_aggregate_results, mvbench_process_results
    from lmms_eval.tasks.videomme.utils import videomme_aggregate_results, videomme_process_results

    result = json.loads((benchmark_run / "results.json").read_text())

    def answers_of(task: str) -> list[tuple[dict, str]]:
        samples = [json.loads(line) for line in (benchmark_run / f"samples_{task}.jsonl").read_text().splitlines()]
        return [(sample["doc"], sample["resps"][0][0].strip()) for sample in samples]

    def ours(task: str) -> float:
        return result["results"][task][f"{BENCHMARKS[task].metric},none"]

    chartqa = [chartqa_process_results(doc, [answer])["relaxed_overall"] for doc, answer in answers_of("chartqa")]
    assert ours("chartqa") == pytest.approx(sum(chartqa) / len(chartqa))
    docvqa = [anls(doc["answers"], [answer])["anls"] for doc, answer in answers_of("docvqa_val")]
    assert ours("docvqa_val") == pytest.approx(sum(docvqa) / len(docvqa))
    mmbench = [mmbench_process_results(doc, [answer])["gpt_eval_score"] for doc, answer in answers_of("mmbench_en_dev")]
    overall, _, _ = MMBench_Evaluator().eval_result(mmbench, eval_method="static")
    assert ours("mmbench_en_dev") == pytest.approx(100 * overall)
    for task in ("videomme", "videomme_w_subtitle"):
        records = [
            videomme_process_results(doc, [answer])["videomme_perception_score"] for doc, answer in answers_of(task)
        ]
        assert ours(task) == pytest.approx(videomme_aggregate_results(records))
    per_task = {}
    for doc, answer in answers_of("mvbench"):
        per_task.setdefault(doc["task"], []).append(mvbench_process_results(doc, [answer])["mvbench_accuracy"])
    task_scores = [mvbench_aggregate_results(records) for records in per_task.values()]
    assert ours("mvbench") == pytest.approx(sum(task_scores) / len(task_scores))
    for task, (score, _) in mvbench.scores([mvbench.record(doc, answer) for doc, answer in answers_of("mvbench")])[
        "breakdown"
    ].items():
        assert result["breakdown"]["mvbench"][task]["value"] == score


@pytest.mark.slow
def test_video_answers_are_greedy_decoding_of_the_training_encoding(benchmark_run, benchmark_data):
    """A Video-MME answer equals greedy decoding, one full transformers forward per token (no
    cache), of the question encoded as the training data is (SampleEncoder: the clip's frames at
    most 32, their timestamps, the chat template), cut where lm-eval stops."""
    import torch
    from transformers import AutoModelForImageTextToText

    from vlmcore.data import IGNORE_INDEX
    from vlmcore.data.media.encoder import SampleEncoder
    from vlmcore.data.media.video import decode_frames, normalize_video_patches, resize_frames, video_patches

    model_dir = benchmark_run.parent / "model"
    model = AutoModelForImageTextToText.from_pretrained(model_dir).eval()
    encoder = SampleEncoder(model_dir)
    eos = model.generation_config.eos_token_id
    stop_ids = {encoder.tokenizer.convert_tokens_to_ids("<|im_end|>"), *(eos if isinstance(eos, list) else [eos])}
    samples = [json.loads(line) for line in (benchmark_run / "samples_videomme.jsonl").read_text().splitlines()]
    for sample in samples[::2]:  # one question per video: short, medium, long
        doc = sample["doc"]
        with zipfile.ZipFile(doc["video_path"]) as archive:
            clip_bytes = archive.read(doc["video_member"])
        meta = {"kind": "file", **probe(clip_bytes).as_dict()}
        conversation = {
            "messages": [
                {"role": "user", "content": "<video>" + sample["arguments"][0][0]},
                {"role": "assistant", "content": "A"},
            ]
        }
        encoding = encoder.encode_text(conversation, [], [meta], max_frames=32)
        answer_start = next(t for t, label in enumerate(encoding.labels) if label != IGNORE_INDEX) + 1
        ids = encoding.input_ids[:answer_start]
        plan = encoder.video_plan(meta, 32)
        assert len(plan.indices) == min(32, meta["frames"])
        patches, grid = video_patches(resize_frames(decode_frames(clip_bytes, plan.indices), *plan.size), encoder.video)
        pixels = normalize_video_patches(patches, encoder.video.image_mean, encoder.video.image_std)
        generated = []
        with torch.no_grad():
            for _ in range(16):  # the task's max_gen_toks
                tokens = ids + generated
                logits = model(
                    input_ids=torch.tensor([tokens]),
                    pixel_values_videos=pixels,
                    video_grid_thw=torch.tensor([grid]),
                    mm_token_type_ids=torch.tensor(encoder.processor.create_mm_token_type_ids([tokens])),
                ).logits
                generated.append(int(logits[0, -1].argmax()))
                if generated[-1] in stop_ids:
                    break
        expected = encoder.tokenizer.decode(generated, skip_special_tokens=True)
        assert sample["resps"][0][0] == expected, doc["question_id"]
