"""The pixels of an evaluation's video clips, decoded by worker processes ahead of the model.

A clip's plan (its sampled frames, size and grid) comes from its container headers alone, so the
evaluation model (vlmcore/eval/vlm.py) encodes every request's tokens first, orders them into
batches, and then asks for the clips' pixels in batch order. `ClipPixels` decodes them (PyAV
decode, resize, patches, normalize: pure CPU work on the clip's bytes) in a pool of worker
processes, up to `ahead` clips in advance: while the model scores or generates one batch, the
workers decode the clips of the next ones. Tokenization and the model stay in the main process.
With no workers every clip is decoded in this process when it is asked for, the same calls in
the same order, so both ways give the same tensors.

Why `concurrent.futures.ProcessPoolExecutor` and not torch's DataLoader: the work is a list of
independent clips known in advance, asked for in an order set by the batches; a future per clip
is that exactly, with no dataset or sampler to fit it into. The workers are started by `spawn`
(the parent runs torch's threads, which a fork would copy mid-state) and run torch single-threaded
(the workers are the parallelism). A worker that dies (killed, out of memory) breaks the pool:
the clip being waited for raises an error naming it instead of waiting forever.

A clip that does not decode is a `BadSample`, raised again in the main process with its reason and
detail (an exception with its own constructor arguments does not survive pickling as itself).
"""

import dataclasses
import multiprocessing
import zipfile
from collections import Counter
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

import torch

from vlmcore.data.media.video import (
    VideoPlan,
    VideoSettings,
    clip_frames,
    normalize_video_patches,
    resize_frames,
    video_patches,
)
from vlmcore.data.quality import BadSample


@dataclasses.dataclass(frozen=True)
class VideoClip:
    """A video file among a request's visuals; `shuffle_seed` set: its sampled frames go to the
    model in an order shuffled by that seed (a control for questions that need time). `member`:
    the clip is that member of the zip archive `path` (benchmarks ship their videos zipped).
    `max_frames`: sample at most this many frames (default: the video processor's own limit)."""

    path: str
    shuffle_seed: int | None = None
    member: str | None = None
    max_frames: int | None = None

    def read_bytes(self) -> bytes:
        if self.member is None:
            return Path(self.path).read_bytes()
        with zipfile.ZipFile(self.path) as archive:
            return archive.read(self.member)

    def frame_order(self, count: int) -> list[int]:
        order = list(range(count))
        if self.shuffle_seed is not None and count > 1:
            generator = torch.Generator().manual_seed(self.shuffle_seed)
            while order == sorted(order):
                order = torch.randperm(count, generator=generator).tolist()
        return order

    @property
    def name(self) -> str:
        return self.member or self.path


@dataclasses.dataclass(frozen=True)
class ClipJob:
    """What decoding a clip needs: the clip, its probed metadata and its plan."""

    clip: VideoClip
    meta: dict = dataclasses.field(hash=False, compare=False)
    plan: VideoPlan = dataclasses.field(hash=False, compare=False)


def clip_pixels(job: ClipJob, settings: VideoSettings) -> torch.Tensor:
    """The clip's pixel_values_videos, as the training data has them."""
    data = job.clip.read_bytes()
    indices = job.plan.indices
    frames = clip_frames(job.meta, [data], indices)[job.clip.frame_order(len(indices))]
    patches, _ = video_patches(resize_frames(frames, *job.plan.size), settings)
    return normalize_video_patches(patches, settings.image_mean, settings.image_std)


def clip_pixels_or_reason(job: ClipJob, settings: VideoSettings) -> torch.Tensor | tuple[str, str]:
    """`clip_pixels` in a worker: a clip that does not decode comes back as (reason, detail)."""
    try:
        return clip_pixels(job, settings)
    except BadSample as error:
        return error.reason, error.detail


def single_threaded_worker() -> None:
    torch.set_num_threads(1)


class ClipPixels:
    """The pixels of the clips of `jobs`, given in the order they will be asked for (a clip may
    come more than once: the choices of a question share it). With `workers` > 0 a pool decodes
    them up to `ahead` clips in advance; each clip's pixels are kept until its last use."""

    def __init__(self, jobs: list[ClipJob], settings: VideoSettings | None, workers: int, ahead: int) -> None:
        self.settings = settings
        self.uses = Counter(jobs)
        self.order = list(self.uses)  # each clip once, in the order of its first use
        self.position = {job: index for index, job in enumerate(self.order)}
        self.ahead = ahead
        self.submitted = 0
        self.futures: dict[ClipJob, Future] = {}
        self.done: dict[ClipJob, torch.Tensor | tuple[str, str]] = {}
        self.pool = None
        if workers > 0 and self.order:
            context = multiprocessing.get_context("spawn")
            self.pool = ProcessPoolExecutor(workers, mp_context=context, initializer=single_threaded_worker)

    def __enter__(self) -> "ClipPixels":
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)

    def take(self, job: ClipJob) -> torch.Tensor:
        """The clip's pixels; raises its BadSample when it does not decode."""
        if job not in self.done:
            self.done[job] = self.decode(job)
        result = self.done[job]
        self.uses[job] -= 1
        if self.uses[job] == 0:
            del self.done[job]
        if isinstance(result, tuple):
            raise BadSample(*result)
        return result

    def decode(self, job: ClipJob) -> torch.Tensor | tuple[str, str]:
        if self.pool is None:
            return clip_pixels_or_reason(job, self.settings)
        try:
            # Keep the pool `ahead` clips beyond this one busy while the model works on its batch.
            last = min(self.position[job] + self.ahead, len(self.order) - 1)
            while self.submitted <= last:
                upcoming = self.order[self.submitted]
                self.futures[upcoming] = self.pool.submit(clip_pixels_or_reason, upcoming, self.settings)
                self.submitted += 1
            return self.futures.pop(job).result()
        except BrokenProcessPool as error:
            raise RuntimeError(
                f"a video decoding worker died (killed or out of memory?) while decoding {job.clip.name}"
                " (or a clip decoded beside it)"
            ) from error
