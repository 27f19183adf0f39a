"""A video that does not decode is counted, not fatal: `vlmcore eval` runs on, answers the question
as a model that gives no answer (an empty answer, scored by the benchmark's rule for one; -inf for
every choice of a multiple-choice question) and reports the count per task and reason.

lmms-eval's video models that catch a clip that cannot load (llava_vid, oryx) answer a fixed text
that the task then scores; MVBench's scoring (lmms-eval's, ours equal) leaves an empty answer out
of both counts. Real clips: the video demo's, and MVBench's layout staged as the login-node rule
stages it; one clip a few bytes of garbage, one a real clip cut in half.
"""

import json
import shutil
import zipfile

import pandas as pd
import pytest
from helpers import tiny_hf_snapshot

from vlmcore.data.media.video import probe
from vlmcore.data.synthetic import video as synthetic_video
from vlmcore.eval.benchmarks.registry import BENCHMARKS
from vlmcore.eval.benchmarks.videomme_w_subtitle import subtitles_at_frames
from vlmcore.eval.runner import evaluate
from vlmcore.eval.staging import stage_snapshot

pytestmark = pytest.mark.slow
GARBAGE = b"\x00\x01not a video\xff" * 4


def cut_in_half(data: bytes) -> bytes:
    return data[: len(data) // 2]


def write_mvbench(repository, clips: list[bytes]) -> None:
    """MVBench's action_antonym task (json/<task>.json, its videos in video/ssv2_video_mp4.zip)."""
    candidates = ["walking", "not walking", "running"]
    rows = [
        {"video": f"clip_{i}.mp4", "question": f"What happens ({i})?", "candidates": candidates, "answer": "walking"}
        for i in range(len(clips))
    ]
    (repository / "json").mkdir(parents=True)
    (repository / "video").mkdir()
    (repository / "json/action_antonym.json").write_text(json.dumps(rows))
    with zipfile.ZipFile(repository / "video/ssv2_video_mp4.zip", "w") as archive:
        for row, data in zip(rows, clips):
            archive.writestr(f"ssv2_video_mp4/{row['video']}", data)


@pytest.fixture(scope="module")
def run_with_bad_videos(tmp_path_factory):
    root = tmp_path_factory.mktemp("undecodable")
    tiny_hf_snapshot("qwen3_vl", root / "model")
    synthetic_video.generate(root / "raw", num_train=1, num_eval=4, seed=2)
    questions = [json.loads(line) for line in (root / "raw/eval.jsonl").read_text().splitlines()]
    good_clip = (root / "raw" / questions[2]["video"]).read_bytes()
    (root / "raw" / questions[0]["video"]).write_bytes(GARBAGE)
    (root / "raw" / questions[1]["video"]).write_bytes(cut_in_half(good_clip))
    write_mvbench(root / "hub/mvbench", [good_clip, GARBAGE, cut_in_half(good_clip)])
    stage_snapshot(root / "hub/mvbench", root / "benchmarks/mvbench", BENCHMARKS["mvbench"], "local", patterns=["*"])
    out = root / "eval"
    result = evaluate_video_tasks(root, out)
    return result, out


def evaluate_video_tasks(root, out, video_workers: int = 0) -> dict:
    return evaluate(
        root / "model",
        ["demo_video_qa", "mvbench"],
        out,
        vqa_data=root / "raw/eval.jsonl",
        benchmark_data=root / "benchmarks",
        batch_size=4,
        video_workers=video_workers,
    )


def samples(out, task: str) -> list[dict]:
    return [json.loads(line) for line in (out / f"samples_{task}.jsonl").read_text().splitlines()]


def test_undecodable_videos_are_counted_by_task_and_reason(run_with_bad_videos):
    result, out = run_with_bad_videos
    assert result["undecodable_videos"] == {
        "demo_video_qa": {"unreadable_video": 2},
        "mvbench": {"unreadable_video": 2},
    }
    listed = [(q["task"], q["doc_id"]) for q in result["undecodable_video_samples"]]
    assert listed == [("demo_video_qa", 0), ("demo_video_qa", 1), ("mvbench", 1), ("mvbench", 2)]
    assert result["undecodable_video_samples"][2]["video"] == "ssv2_video_mp4/clip_1.mp4"
    written = json.loads((out / "results.json").read_text())
    assert written["undecodable_videos"] == result["undecodable_videos"]
    table = pd.read_csv(out / "results.csv").set_index(["task", "subset"])
    assert table.loc[("mvbench", "undecodable_video/unreadable_video"), "value"] == 2
    assert table.loc[("mvbench", "undecodable_video/unreadable_video"), "metric"] == "undecodable_videos"


def test_their_questions_get_no_answer_and_the_run_goes_on(run_with_bad_videos):
    result, out = run_with_bad_videos
    assert result["n-samples"]["mvbench"]["effective"] == 3
    assert result["n-samples"]["demo_video_qa"]["effective"] == 4
    generated = {sample["doc_id"]: sample for sample in samples(out, "mvbench")}
    for doc_id in (1, 2):
        assert generated[doc_id]["resps"] == [[""]]
        # MVBench's rule: an empty answer is in neither count; the score is the decoded clip's alone.
        assert generated[doc_id]["mvbench_accuracy"] == {"task": "action_antonym", "answered": False, "correct": False}
    assert generated[0]["resps"][0][0] != ""
    assert generated[0]["mvbench_accuracy"]["answered"]
    decoded_score = 100.0 * generated[0]["mvbench_accuracy"]["correct"]
    assert result["results"]["mvbench"]["mvbench_accuracy,none"] == pytest.approx(decoded_score)
    chosen = {sample["doc_id"]: sample for sample in samples(out, "demo_video_qa")}
    for doc_id, sample in chosen.items():
        scores = [score for score, _ in sample["filtered_resps"]]
        if doc_id in (0, 1):
            assert scores == [float("-inf")] * len(scores)
        else:
            assert all(score > float("-inf") for score in scores)


def garbage_after_the_first_frame(data: bytes) -> bytes:
    """The clip with its frame data after the first frame's overwritten: its headers (and so its
    plan) read, its frames fail in the decoding, after the rows are put into batches."""
    frames_start = data.find(b"mdat") + 200
    frames_end = data.find(b"moov") - 4
    assert 0 < frames_start < frames_end, "the demo's clips keep their frames before their index"
    garbage = (b"\xff\x00\x13" * len(data))[: frames_end - frames_start]
    return data[:frames_start] + garbage + data[frames_end:]


def test_decoding_in_worker_processes_gives_the_same_results(run_with_bad_videos, tmp_path):
    """Two processes decode the clips ahead of the model: every sample (log-likelihoods, generated
    answers, scores) and every count of undecodable videos is exactly as when the evaluating
    process decodes them itself, with a third clip that fails only in the decoding."""
    _, out = run_with_bad_videos
    root = tmp_path / "data"
    shutil.copytree(out.parent, root, ignore=shutil.ignore_patterns("eval"))
    questions = [json.loads(line) for line in (root / "raw/eval.jsonl").read_text().splitlines()]
    clip = root / "raw" / questions[3]["video"]
    clip.write_bytes(garbage_after_the_first_frame(clip.read_bytes()))
    assert probe(clip.read_bytes()).width > 0  # it fails in the decoding, not in the probe
    in_process = evaluate_video_tasks(root, tmp_path / "in_process")
    in_workers = evaluate_video_tasks(root, tmp_path / "in_workers", video_workers=2)
    assert in_process["undecodable_videos"]["demo_video_qa"] == {"unreadable_video": 3}
    listed = [(q["task"], q["doc_id"]) for q in in_process["undecodable_video_samples"]]
    assert ("demo_video_qa", 3) in listed
    assert in_workers["undecodable_video_samples"] == in_process["undecodable_video_samples"]
    assert in_workers["undecodable_videos"] == in_process["undecodable_videos"]
    assert in_workers["results"] == in_process["results"]
    for task in ("demo_video_qa", "mvbench"):
        assert samples(tmp_path / "in_workers", task) == samples(tmp_path / "in_process", task)


def test_video_mme_subtitles_of_an_undecodable_video_are_none(tmp_path):
    """The subtitle lookup probes the video; a clip that does not decode is counted by the model."""
    (tmp_path / "bad.mp4").write_bytes(GARBAGE)
    (tmp_path / "bad.srt").write_text('1\n00:00:00,000 --> 00:00:01,000\n<font color="white" size=".72c">hi</font>\n')
    doc = {
        "subtitle_path": str(tmp_path / "bad.srt"),
        "subtitle_member": "",
        "video_path": str(tmp_path / "bad.mp4"),
        "video_member": "",
    }
    assert subtitles_at_frames(doc, 32) == "No subtitles available"
