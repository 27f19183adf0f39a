"""`vlmcore eval`: lm-eval on exported directories, offline.

The demo's held-out VQA questions run through the `vlmcore-vlm` model on a tiny Qwen3-VL; every
choice's score is checked against a direct transformers forward of the chat-templated question
with its image. A local text task runs through lm-eval's `hf` model on a tiny Qwen3.
"""

import json
import re
import zlib

import pandas as pd
import pytest
import torch
import torch.nn.functional as F
from helpers import tiny_hf_snapshot
from PIL import Image
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer

from vlmcore import cli
from vlmcore.data import IGNORE_INDEX
from vlmcore.data.media.encoder import SampleEncoder
from vlmcore.data.media.processor import load_processor
from vlmcore.data.media.video import decode_frames, normalize_video_patches, probe, resize_frames, video_patches
from vlmcore.data.synthetic import video as synthetic_video
from vlmcore.data.synthetic.image import generate
from vlmcore.eval.results import gather, results_table
from vlmcore.eval.runner import BUNDLED_TASKS, EvalSetupError, evaluate, task_manager_for
from vlmcore.eval.vlm import VideoClip

pytestmark = pytest.mark.slow
LIMIT = 9  # three of each question kind


@pytest.fixture(scope="module")
def vqa_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("vqa")
    model = tiny_hf_snapshot("qwen3_vl", root / "model")
    generate(root / "raw", num_train=2, num_eval=12, seed=3)
    out = root / "eval"
    assert (
        cli.main(
            [
                "eval",
                "--model",
                str(model),
                "--tasks",
                "demo_vqa,demo_vqa_gen",
                "--vqa-data",
                str(root / "raw/eval.jsonl"),
                "--out",
                str(out),
                "--limit",
                str(LIMIT),
                "--batch-size",
                "4",
            ]
        )
        == 0
    )
    return root, model, out


def answer_logprob(model, processor, image_path, question, answer) -> float:
    """log p(answer | chat-templated user turn with the image), straight from transformers."""
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "\n" + question}]}]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    answer_ids = processor.tokenizer(answer, add_special_tokens=False)["input_ids"]
    inputs = processor(text=[prompt + answer], images=[Image.open(image_path).convert("RGB")], return_tensors="pt")
    with torch.no_grad():
        logits = model(**inputs).logits[0]
    ids = inputs["input_ids"][0]
    assert ids[-len(answer_ids) :].tolist() == answer_ids
    log_probs = F.log_softmax(logits[-len(answer_ids) - 1 : -1].float(), dim=-1)
    return log_probs.gather(-1, ids[-len(answer_ids) :, None]).sum().item()


def test_vqa_scores_equal_a_direct_transformers_forward(vqa_run):
    root, model_dir, out = vqa_run
    samples = [json.loads(line) for line in (out / "samples_demo_vqa.jsonl").read_text().splitlines()]
    assert len(samples) == LIMIT
    model = AutoModelForImageTextToText.from_pretrained(model_dir).eval()
    processor = load_processor(model_dir)
    for sample in samples[:4]:
        doc = sample["doc"]
        expected = [
            answer_logprob(model, processor, root / "raw" / doc["image"], doc["question"], c) for c in doc["choices"]
        ]
        got = [resp[0][0] for resp in sample["resps"]]
        assert got == pytest.approx(expected, abs=1e-4), doc["id"]
        assert sample["acc"] == float(max(range(len(got)), key=got.__getitem__) == doc["answer"])


def test_preference_accuracy_is_chosen_logp_above_rejected(vqa_run, tmp_path):
    """demo_preference on the held-out pairs beside eval.jsonl: each pair's two scores are the
    log-probabilities of its chosen and rejected answers (a direct transformers forward), and `acc`
    counts the pairs whose chosen answer scores higher: the preference accuracy of DPO."""
    root, model_dir, _ = vqa_run
    out = tmp_path / "eval"
    evaluate(model_dir, ["demo_preference"], out, vqa_data=root / "raw/eval.jsonl", limit=6, batch_size=4)
    samples = [json.loads(line) for line in (out / "samples_demo_preference.jsonl").read_text().splitlines()]
    pairs = [json.loads(line) for line in (root / "raw/preference_eval.jsonl").read_text().splitlines()]
    assert len(samples) == 6
    model = AutoModelForImageTextToText.from_pretrained(model_dir).eval()
    processor = load_processor(model_dir)
    for sample in samples:
        pair = next(p for p in pairs if p["id"] == sample["doc"]["id"])
        image = root / "raw" / pair["images"][0]
        question = pair["prompt"].removeprefix("<image>\n")
        expected = [answer_logprob(model, processor, image, question, pair[side]) for side in ("chosen", "rejected")]
        got = [resp[0][0] for resp in sample["resps"]]
        assert got == pytest.approx(expected, abs=1e-4), pair["id"]
        assert sample["acc"] == float(got[0] > got[1])
    results = json.loads((out / "results.json").read_text())
    assert results["chance"]["demo_preference"] == 0.5
    with pytest.raises(ValueError, match="preference_eval.jsonl: no such file"):
        evaluate(model_dir, ["demo_preference"], tmp_path / "bad", vqa_data=tmp_path / "eval.jsonl")


def test_free_answers_equal_transformers_generate(vqa_run):
    """demo_vqa_gen (generation with images, as MMMU-style tasks) in the same chat form."""
    root, model_dir, out = vqa_run
    model = AutoModelForImageTextToText.from_pretrained(model_dir).eval()
    processor = load_processor(model_dir)
    samples = [json.loads(line) for line in (out / "samples_demo_vqa_gen.jsonl").read_text().splitlines()]
    assert len(samples) == LIMIT
    for sample in samples[:2]:
        doc = sample["doc"]
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "\n" + doc["question"]}]}]
        prompt = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        inputs = processor(
            text=[prompt], images=[Image.open(root / "raw" / doc["image"]).convert("RGB")], return_tensors="pt"
        )
        tokens = model.generate(**inputs, max_new_tokens=8, do_sample=False)[0, inputs["input_ids"].shape[1] :]
        text = processor.tokenizer.decode(tokens, skip_special_tokens=False)
        expected = text.split("<|im_end|>")[0].split("\n")[0]
        assert sample["resps"][0][0] == expected.replace("<|endoftext|>", "")
        assert sample["exact_match"] == float(expected.strip().lower() == doc["choices"][doc["answer"]])


def test_vqa_results_have_chance_levels_and_kinds(vqa_run):
    root, _, out = vqa_run
    result = json.loads((out / "results.json").read_text())
    assert result["lm_eval_model"] == "vlmcore-vlm"
    rows = [json.loads(line) for line in (root / "raw/eval.jsonl").read_text().splitlines()][:LIMIT]
    assert result["chance"]["demo_vqa"] == pytest.approx(sum(1 / len(r["choices"]) for r in rows) / LIMIT)
    meta = json.loads((root / "raw/meta.json").read_text())
    breakdown = result["breakdown"]["demo_vqa"]
    assert set(breakdown) == {"color", "shape", "side"}
    for kind, figures in breakdown.items():
        assert (
            figures["chance"] == pytest.approx(meta["chance"][kind])
            and figures["n"] == 3
            and figures["metric"] == "acc"
        )
    acc = result["results"]["demo_vqa"]["acc,none"]
    assert acc == pytest.approx(sum(f["value"] * f["n"] for f in breakdown.values()) / LIMIT)
    generated = result["breakdown"]["demo_vqa_gen"]
    assert {f["metric"] for f in generated.values()} == {"exact_match"} and "demo_vqa_gen" not in result["chance"]

    table = pd.read_csv(out / "results.csv", keep_default_na=False)
    overall = table[(table["task"] == "demo_vqa") & (table["subset"] == "") & (table["metric"] == "acc")]
    assert overall["value"].item() == pytest.approx(acc) and overall["n_samples"].item() == LIMIT
    assert sorted(table[(table["subset"] != "") & (table["task"] == "demo_vqa")]["subset"]) == [
        "color",
        "shape",
        "side",
    ]


def test_gather_stacks_runs_into_one_table(vqa_run):
    _, _, out = vqa_run
    table = gather({"demo/stage1": out, "demo/stage2": out / "results.json"})
    assert list(table.columns[:3]) == ["run", "task", "subset"]
    # demo_vqa: acc, acc_norm and acc of 3 kinds; demo_vqa_gen: exact_match overall and of 3 kinds
    assert table.groupby("run").size().to_dict() == {"demo/stage1": 9, "demo/stage2": 9}
    with pytest.raises(ValueError, match="no eval results"):
        gather({"missing": out / "nope"})


@pytest.fixture(scope="module")
def video_qa_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("video_qa")
    model = tiny_hf_snapshot("qwen3_vl", root / "model")
    synthetic_video.generate(root / "raw", num_train=1, num_eval=6, seed=1)
    out = root / "eval"
    assert (
        cli.main(
            [
                "eval",
                "--model",
                str(model),
                "--tasks",
                "demo_video_qa,demo_video_qa_shuffled",
                "--vqa-data",
                str(root / "raw/eval.jsonl"),
                "--out",
                str(out),
                "--batch-size",
                "4",
            ]
        )
        == 0
    )
    return root, model, out


def video_answer_logprob(model, encoder, clip: bytes, question, answer, frame_order=None) -> float:
    """log p(answer | the question about the clip), the row encoded as the training data is
    (SampleEncoder: the conversation with its answer), scored by a transformers forward."""
    info = probe(clip)
    meta = {"kind": "file", **info.as_dict()}
    conversation = {
        "messages": [{"role": "user", "content": "<video>\n" + question}, {"role": "assistant", "content": answer}]
    }
    enc = encoder.encode_text(conversation, [], [meta])
    first = next(t for t, label in enumerate(enc.labels) if label != IGNORE_INDEX) + 1  # the answer's first token
    answer_ids = encoder.tokenizer(answer, add_special_tokens=False)["input_ids"]
    ids = enc.input_ids[: first + len(answer_ids)]
    assert ids[first:] == answer_ids
    plan = encoder.video_plan(meta)
    frames = decode_frames(clip, plan.indices)
    if frame_order is not None:
        frames = frames[frame_order]
    patches, grid = video_patches(resize_frames(frames, *plan.size), encoder.video)
    inputs = {
        "input_ids": torch.tensor([ids]),
        "video_grid_thw": torch.tensor([grid]),
        "pixel_values_videos": normalize_video_patches(patches, encoder.video.image_mean, encoder.video.image_std),
        "mm_token_type_ids": torch.tensor(encoder.processor.create_mm_token_type_ids([ids])),
    }
    with torch.no_grad():
        logits = model(**inputs).logits[0]
    log_probs = F.log_softmax(logits[first - 1 : len(ids) - 1].float(), dim=-1)
    return log_probs.gather(-1, torch.tensor(answer_ids)[:, None]).sum().item()


def test_video_questions_score_as_a_transformers_forward_of_the_training_encoding(video_qa_run):
    """A video question's choice scores equal transformers' forward of the row as training encodes it;
    the control feeds the same frames in a shuffled order, one fixed permutation per clip."""
    root, model_dir, out = video_qa_run
    model = AutoModelForImageTextToText.from_pretrained(model_dir).eval()
    encoder = SampleEncoder(model_dir)
    for task in ("demo_video_qa", "demo_video_qa_shuffled"):
        samples = [json.loads(line) for line in (out / f"samples_{task}.jsonl").read_text().splitlines()]
        assert len(samples) == 6 and {s["doc"]["kind"] for s in samples} == {"direction", "order", "count"}
        for sample in samples[:3]:
            doc = sample["doc"]
            clip = (root / "raw" / doc["video"]).read_bytes()
            order = None
            if task.endswith("shuffled"):
                order = VideoClip(doc["video_path"], zlib.crc32(doc["id"].encode())).frame_order(8)
                assert sorted(order) == list(range(8)) and order != list(range(8))
            expected = [video_answer_logprob(model, encoder, clip, doc["question"], c, order) for c in doc["choices"]]
            got = [resp[0][0] for resp in sample["resps"]]
            assert got == pytest.approx(expected, abs=1e-4), (task, doc["id"])
    result = json.loads((out / "results.json").read_text())
    assert set(result["breakdown"]["demo_video_qa_shuffled"]) == {"direction", "order", "count"}
    assert result["chance"]["demo_video_qa"] == pytest.approx((2 / 4 + 2 / 6 + 2 / 3) / 6)


TEXT_TASK = """task: tiny_colors
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - {{metric: acc, aggregation: mean, higher_is_better: true}}
metadata: {{version: 1.0}}
"""


def test_text_task_runs_through_lm_eval_hf_model(tmp_path):
    model_dir = tiny_hf_snapshot("qwen3", tmp_path / "model")
    data = tmp_path / "tiny_colors.jsonl"
    questions = [
        ("What color is the sky?", ["blue", "red", "green"], 0),
        ("What color is grass?", ["red", "green"], 1),
        ("What color is snow?", ["white", "black", "red", "blue"], 0),
    ]
    data.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in questions))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "tiny_colors.yaml").write_text(TEXT_TASK.format(data=data))
    result = evaluate(model_dir, ["tiny_colors"], tmp_path / "eval", include_path=[tasks], batch_size=2)
    assert result["lm_eval_model"] == "hf"
    assert result["chance"]["tiny_colors"] == pytest.approx((1 / 3 + 1 / 2 + 1 / 4) / 3)
    sample = json.loads((tmp_path / "eval" / "samples_tiny_colors.jsonl").read_text().splitlines()[0])
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    context = tokenizer("Question: What color is the sky?\nAnswer:")["input_ids"]
    for choice, resp in zip(["blue", "red", "green"], sample["resps"]):
        continuation = tokenizer(" " + choice)["input_ids"]
        with torch.no_grad():
            logits = model(torch.tensor([context + continuation])).logits[0]
        log_probs = F.log_softmax(logits[len(context) - 1 : -1], dim=-1)
        assert resp[0][0] == pytest.approx(
            log_probs.gather(-1, torch.tensor(continuation)[:, None]).sum().item(), abs=1e-4
        )
    assert results_table(result)["task"].tolist() == ["tiny_colors"]


def test_lm_eval_task_files_are_indexed_only_when_a_task_needs_them():
    """The bundled tasks alone when they define every task asked for; with a task of lm-eval's
    own (arc_easy), lm-eval's task files too, the bundled benchmarks still overriding theirs."""
    own = task_manager_for(["demo_vqa", "chartqa"], [BUNDLED_TASKS], {})
    assert {"demo_vqa", "chartqa", "videomme"} <= set(own.all_tasks)
    assert "arc_easy" not in own.all_tasks
    with_lm_eval = task_manager_for(["demo_vqa", "arc_easy"], [BUNDLED_TASKS], {})
    assert {"demo_vqa", "arc_easy"} <= set(with_lm_eval.all_tasks)
    assert with_lm_eval._index["chartqa"].yaml_path == BUNDLED_TASKS / "benchmarks" / "chartqa.yaml"


def test_bad_inputs_fail_with_the_file_and_line(tmp_path, vqa_run):
    root, model_dir, _ = vqa_run
    with pytest.raises(ValueError, match="--vqa-data"):
        evaluate(model_dir, ["demo_vqa"], tmp_path / "eval")
    rows = (root / "raw/eval.jsonl").read_text().splitlines()
    broken = json.loads(rows[1]) | {"answer": 17}
    bad = root / "raw" / "bad.jsonl"
    bad.write_text(rows[0] + "\n" + json.dumps(broken) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:2: answer 17"):
        evaluate(model_dir, ["demo_vqa"], tmp_path / "eval", vqa_data=bad)
    with pytest.raises(ValueError, match="no config.json"):
        evaluate(tmp_path, ["demo_vqa"], tmp_path / "eval", vqa_data=bad)


def test_bad_tasks_and_models_fail_before_the_model_loads(tmp_path, vqa_run, capsys):
    """An unknown task name, a text-only model asked image questions, a vision-language export
    without its image processor, and a benchmark without its staged data: each refused, naming
    the task or the file, before any weight is read (the weights here are not even valid
    safetensors). `vlmcore eval` prints the refusal as one line with the usage exit code, not as a
    traceback, and writes nothing; `evaluate` raises it as an EvalSetupError, a ValueError."""
    root, model_dir, _ = vqa_run
    vqa = root / "raw" / "eval.jsonl"
    config = json.loads((model_dir / "config.json").read_text())
    text_only = tmp_path / "text_only"
    text_only.mkdir()
    (text_only / "config.json").write_text(json.dumps({**config["text_config"], "model_type": "qwen3"}))
    (text_only / "model.safetensors").write_text("not weights")
    no_processor = tmp_path / "no_processor"
    no_processor.mkdir()
    (no_processor / "config.json").write_text(json.dumps(config))
    (no_processor / "model.safetensors").write_text("not weights")

    capsys.readouterr()
    for model, tasks, expected in (
        (model_dir, "demo_vqa,no_such_task", r"--tasks: no task no_such_task; vlmcore's are demo_vqa.*mmmu_val"),
        (text_only, "demo_vqa", r"text_only: a text-only model .* questions of demo_vqa"),
        (no_processor, "demo_vqa", r"no_processor: no preprocessor_config.json, .* demo_vqa"),
        (model_dir, "chartqa", r"task chartqa reads staged data: give --benchmark-data DIR"),
    ):
        argv = ["eval", "--model", str(model), "--tasks", tasks, "--vqa-data", str(vqa), "--out", str(tmp_path / "cli")]
        assert cli.main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("vlmcore eval: error: ") and "\n" not in err, err
        assert re.search(expected, err), err
    assert not (tmp_path / "cli").exists()
    with pytest.raises(EvalSetupError, match="a text-only model"):
        evaluate(text_only, ["demo_vqa"], tmp_path / "eval", vqa_data=vqa)
    assert issubclass(EvalSetupError, ValueError)
