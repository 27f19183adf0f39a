"""Evaluation clips decoded by worker processes (vlmcore/eval/video_decode.py): the same tensors and
the same BadSample reasons as decoding in the evaluating process, and a worker that dies is an
error naming the clip, not a hang. Real clips: the video demo's, decoded by PyAV.

The whole evaluation with workers equals it without in tests/eval/test_eval_undecodable_video.py.
"""

import json
import os
import signal

import pytest
import torch

from vlmcore.data.media.video import VideoSettings, plan_video, probe
from vlmcore.data.quality import BadSample
from vlmcore.data.synthetic import video as synthetic_video
from vlmcore.eval.video_decode import ClipJob, ClipPixels, VideoClip

SETTINGS = VideoSettings(max_frames=8)


def clip_job(clip: VideoClip, probed: VideoClip | None = None) -> ClipJob:
    """The clip's decoding job; with `probed`, the metadata and plan are that clip's."""
    meta = {"kind": "file", **probe((probed or clip).read_bytes()).as_dict()}
    return ClipJob(clip, meta, plan_video(meta, SETTINGS))


@pytest.fixture(scope="module")
def jobs(tmp_path_factory) -> list[ClipJob]:
    """Three clips, one shuffled, and a file of garbage probed as a real clip: it fails in the decoding."""
    root = tmp_path_factory.mktemp("clips")
    synthetic_video.generate(root, num_train=1, num_eval=3, seed=3)
    videos = [str(root / json.loads(line)["video"]) for line in (root / "eval.jsonl").read_text().splitlines()]
    (root / "garbage.mp4").write_bytes(b"\x00\x01not a video\xff" * 4)
    clips = [
        clip_job(VideoClip(videos[0])),
        clip_job(VideoClip(videos[1], shuffle_seed=5)),
        clip_job(VideoClip(str(root / "garbage.mp4")), probed=VideoClip(videos[2])),
        clip_job(VideoClip(videos[2])),
    ]
    # As the choices of a question ask: a clip comes again, after others.
    return [clips[0], clips[1], clips[0], clips[2], clips[3], clips[1]]


def decoded(jobs: list[ClipJob], workers: int) -> list:
    """Each job's pixels, or its BadSample's (reason, detail)."""
    results = []
    with ClipPixels(jobs, SETTINGS, workers, ahead=2) as pixels:
        for job in jobs:
            try:
                results.append(pixels.take(job))
            except BadSample as error:
                results.append((error.reason, error.detail))
    return results


def test_workers_decode_the_same_tensors_and_failures(jobs):
    in_process = decoded(jobs, workers=0)
    in_workers = decoded(jobs, workers=2)
    assert in_process[3][0] == "unreadable_video"
    assert in_workers[3] == in_process[3]
    for index in (0, 1, 2, 4, 5):
        assert in_process[index].dtype == torch.float32
        assert torch.equal(in_workers[index], in_process[index])
    assert torch.equal(in_process[0], in_process[2])
    assert not torch.equal(in_process[1], clip_pixels_unshuffled(jobs[1]))


def clip_pixels_unshuffled(job: ClipJob) -> torch.Tensor:
    unshuffled = ClipJob(VideoClip(job.clip.path), job.meta, job.plan)
    return decoded([unshuffled], workers=0)[0]


@pytest.mark.timeout(120)
def test_a_worker_that_dies_is_an_error_naming_the_clip(jobs):
    first, second = jobs[0], jobs[1]
    with ClipPixels([first, second], SETTINGS, workers=1, ahead=0) as pixels:
        pixels.take(first)
        for process in list(pixels.pool._processes.values()):
            os.kill(process.pid, signal.SIGKILL)
        with pytest.raises(RuntimeError, match=f"worker died .* while decoding {second.clip.path}"):
            pixels.take(second)
