"""Pass 1 of `vlmcore pack`: every sample measured as the loader will encode it.

Each sample is read and its images decoded in full (a file truncated after its header is counted
as bad here, never met by the loader), measured with the model's processor (token count after
image-token expansion, image patches from the image size) and the overlong policy applied; shards
are measured in parallel by `workers` processes, results kept in shard order. Memory holds only
compact arrays per sample (where its json and images lie in its shard, its tokens and patches:
about 75 bytes). Each shard's measurements are kept in `<out>.measured` as they come, so a killed
pack measures only the shards left (vlmcore.data.pack.dataset runs the passes).
"""

import json
import multiprocessing
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image
from tqdm import tqdm

from vlmcore.data import IGNORE_INDEX
from vlmcore.data.media.encoder import EncodingError, SampleEncoder, TextEncoding
from vlmcore.data.media.image import open_image
from vlmcore.data.pack.format import MODEL_FILES
from vlmcore.data.prepare.preference import preference_sides
from vlmcore.data.quality import BadSample, load_json
from vlmcore.data.shards import ShardSample, iter_shard_samples, video_part_names

# Per-sample state of pass 1, kept in compact arrays (about 55 bytes a sample, 20 an image or a
# video part, plus its key): where its json part lies in its shard, its images (then its videos'
# parts, in the `IMAGE` rows after its images), and its budget. `max_frames`: the frames its
# videos were sampled at to fit the row (0: the processor's setting); `video_groups`: its
# longest video's frame groups; `rejected_tokens`: a preference pair's rejected side (its `tokens` and
# `patches` are both sides'), 0 for any other sample.
SAMPLE = np.dtype([
    ("shard", "<u4"), ("json_offset", "<u8"), ("json_size", "<u4"), ("key_offset", "<u8"), ("key_size", "<u2"),
    ("first_image", "<u8"), ("num_images", "<u2"), ("kept_images", "<u2"), ("tokens", "<u4"), ("patches", "<u4"),
    ("video_parts", "<u2"), ("kept_videos", "<u2"), ("max_frames", "<u2"), ("video_groups", "<u2"),
    ("rejected_tokens", "<u4"),
])  # fmt: skip
FORMAT = 3  # version of the measurements kept between runs: a cache of another version is measured again
IMAGE = np.dtype([("offset", "<u8"), ("size", "<u4"), ("width", "<u4"), ("height", "<u4")])


@dataclass
class MeasuredShard:
    samples: np.ndarray  # SAMPLE; key_offset and first_image count from this shard's start
    images: np.ndarray  # IMAGE, every image of every kept sample, in order
    keys: bytes
    seen: int
    bad: list[tuple[str, str, str]]  # (reason, where, detail)
    counts: dict
    cpu_seconds: float


def measure_sample(
    sample: dict,
    parts: dict,
    encoder: SampleEncoder,
    seq_len: int,
    max_patches: int,
    overlong: str,
    counts: dict,
    decode: bool = True,
) -> tuple[TextEncoding, list[str], list[tuple[int, int]], int]:
    """Encode the text of one stored sample as the loader will, and apply the overlong policy;
    its images are decoded in full, or with `decode` False only their headers are read. Videos
    are measured from the metadata `vlmcore prepare` keeps; a sample too long for the row or the
    patch budget samples fewer frames from its videos (halving the processor's `max_frames`, not
    under its `min_frames`) before the overlong policy applies, and is counted.

    Returns the encoding, the names of the image parts it keeps, the sizes of all its images and
    the frames its videos are sampled at (0: the processor's `max_frames`).
    Raises BadSample or EncodingError for samples to skip.
    """
    videos = sample.get("videos", [])
    missing = [name for video in videos for name in video_part_names(video) if name not in parts]
    if missing:
        raise BadSample("missing_video", f"parts {missing[:3]}")
    names = sample.get("images", [])
    sizes = image_sizes(names, parts, decode)
    enc = encoder.encode_text(sample, sizes, videos)
    max_frames = 0
    if videos and not fits(enc, seq_len, max_patches):
        enc, max_frames = with_fewer_frames(enc, sample, sizes, encoder, seq_len, max_patches)
        counts["fewer_video_frames"] = counts.get("fewer_video_frames", 0) + 1
    enc = apply_overlong(enc, encoder, seq_len, max_patches, overlong, counts)
    if all(label == IGNORE_INDEX for label in enc.labels):
        raise BadSample("no_labels", "nothing to train on")
    return enc, names[: len(enc.image_grid_thw)], sizes, max_frames


def image_sizes(names: list[str], parts: dict, decode: bool) -> list[tuple[int, int]]:
    """(width, height) of each named image part, each checked (decoded in full if `decode`)."""
    sizes = []
    for name in names:
        if name not in parts:
            raise BadSample("missing_image", f"part {name}")
        try:
            sizes.append(open_image(parts[name], Image.MAX_IMAGE_PIXELS, decode=decode).size)
        except BadSample as e:
            raise BadSample(e.reason, f"{name}: {e.detail}") from e
    return sizes


def fits(enc: TextEncoding, seq_len: int, max_patches: int) -> bool:
    return len(enc.input_ids) <= seq_len and enc.num_patches <= max_patches


def with_fewer_frames(
    enc: TextEncoding,
    sample: dict,
    sizes: list[tuple[int, int]],
    encoder: SampleEncoder,
    seq_len: int,
    max_patches: int,
) -> tuple[TextEncoding, int]:
    """The encoding with the videos' frames halved until the sample fits or they reach
    `min_frames`, and the frames they are sampled at then."""
    videos = sample["videos"]
    frames = max(len(encoder.video_plan(video).indices) for video in videos)
    max_frames = 0
    while not fits(enc, seq_len, max_patches) and frames > encoder.video.min_frames:
        frames = max(frames // 2, encoder.video.min_frames)
        enc = encoder.encode_text(sample, sizes, videos, frames)
        max_frames = frames
    return enc, max_frames


def apply_overlong(
    enc: TextEncoding, encoder: SampleEncoder, seq_len: int, max_patches: int, overlong: str, counts: dict
) -> TextEncoding:
    """Too many patches: dropped; too many tokens: dropped or truncated (`overlong`), and counted."""
    if enc.num_patches > max_patches:
        counts["dropped_overlong"] += 1
        raise BadSample("too_many_patches", f"{enc.num_patches} patches > max_patches {max_patches}")
    if len(enc.input_ids) <= seq_len:
        return enc
    if overlong == "drop":
        counts["dropped_overlong"] += 1
        raise BadSample("overlong", f"{len(enc.input_ids)} tokens > seq_len {seq_len}")
    enc = encoder.truncate(enc, encoder.truncation_point(enc.input_ids, seq_len, enc.video_spans))
    if all(label == IGNORE_INDEX for label in enc.labels):
        raise BadSample("no_labels", f"nothing left to train on after truncation to {seq_len} tokens")
    counts["truncated"] += 1
    return enc


def measure_pair(
    sample: dict, parts: dict, encoder: SampleEncoder, seq_len: int, max_patches: int, counts: dict
) -> tuple[TextEncoding, TextEncoding, list[tuple[int, int]]]:
    """Both sides of a preference pair (`vlmcore.data.prepare.preference`) encoded as the loader
    will, and its images' sizes. Both go into one row: a pair is never truncated, nor its videos'
    frames reduced; one that does not fit a row is dropped and counted."""
    videos = sample.get("videos", [])
    missing = [name for video in videos for name in video_part_names(video) if name not in parts]
    if missing:
        raise BadSample("missing_video", f"parts {missing[:3]}")
    sizes = image_sizes(sample.get("images", []), parts, decode=True)
    chosen, rejected = [encoder.encode_text(side, sizes, videos) for side in preference_sides(sample)]
    tokens = len(chosen.input_ids) + len(rejected.input_ids)
    patches = chosen.num_patches + rejected.num_patches
    if tokens > seq_len or patches > max_patches:
        counts["dropped_overlong"] += 1
        raise BadSample(
            "overlong_pair", f"{tokens} tokens, {patches} patches > seq_len {seq_len}, max_patches {max_patches}"
        )
    for side, enc in zip(("chosen", "rejected"), (chosen, rejected)):
        if all(label == IGNORE_INDEX for label in enc.labels):
            raise BadSample("no_labels", f"the {side} side has nothing to train on")
    return chosen, rejected, sizes


@dataclass
class Measurement:
    """One sample's measurement: a preference pair's `enc` is its chosen side, `rejected` its other."""

    enc: TextEncoding
    sample: dict
    sizes: list[tuple[int, int]]  # its images' (width, height)
    max_frames: int  # the frames its videos are sampled at (0: the processor's max_frames)
    rejected: TextEncoding | None = None

    @property
    def tokens(self) -> int:
        return len(self.enc.input_ids) + (len(self.rejected.input_ids) if self.rejected else 0)

    @property
    def patches(self) -> int:
        return self.enc.num_patches + (self.rejected.num_patches if self.rejected else 0)


def measure(
    shard_sample: ShardSample, encoder: SampleEncoder, seq_len: int, max_patches: int, overlong: str, counts: dict
) -> Measurement:
    """Size one shard sample as the loader will encode it; raises BadSample/EncodingError to skip it."""
    if shard_sample.unsafe_names:
        raise BadSample("unsafe_tar_member", repr(shard_sample.unsafe_names[0]))
    if "json" not in shard_sample.data:
        raise BadSample("malformed_row", f"no json part, parts {sorted(shard_sample.parts)}")
    sample = load_json(shard_sample.data["json"])
    if isinstance(sample, dict) and "rejected" in sample:
        chosen, rejected, sizes = measure_pair(sample, shard_sample.data, encoder, seq_len, max_patches, counts)
        return Measurement(chosen, sample, sizes, 0, rejected)
    enc, _, sizes, max_frames = measure_sample(
        sample, shard_sample.data, encoder, seq_len, max_patches, overlong, counts
    )
    return Measurement(enc, sample, sizes, max_frames)


_worker = {}  # per measuring process: the encoder and the pack settings


def start_worker(model_dir: Path, seq_len: int, max_patches: int, overlong: str, video: dict | None = None) -> None:
    _worker.update(encoder=SampleEncoder(model_dir, video), seq_len=seq_len, max_patches=max_patches, overlong=overlong)


def measure_shard(job: tuple[int, Path]) -> MeasuredShard:
    """The measurements of one (shard index, shard), in a measuring process (`start_worker`)."""
    shard_index, shard = job
    start = time.process_time()
    samples = []  # SAMPLE rows
    images = []  # IMAGE rows
    keys = bytearray()
    bad = []
    counts = {"truncated": 0, "dropped_overlong": 0, "fewer_video_frames": 0}
    seen = 0
    for shard_sample in iter_shard_samples(shard):
        seen += 1
        try:
            measured = measure(
                shard_sample,
                _worker["encoder"],
                _worker["seq_len"],
                _worker["max_patches"],
                _worker["overlong"],
                counts,
            )
        except (BadSample, EncodingError) as e:
            bad.append((e.reason, f"{shard.name}:{shard_sample.key}", str(e)))
            continue
        enc = measured.enc
        sample = measured.sample
        key = shard_sample.key.encode()
        json_part = shard_sample.parts["json"]
        names = sample.get("images", [])
        video_parts = [
            (name, (video["width"], video["height"]))
            for video in sample.get("videos", [])
            for name in video_part_names(video)
        ]
        samples.append(
            (
                shard_index,
                json_part.offset,
                json_part.size,
                len(keys),
                len(key),
                len(images),
                len(names),
                len(enc.image_grid_thw),
                measured.tokens,
                measured.patches,
                len(video_parts),
                len(enc.video_grid_thw),
                measured.max_frames,
                max((t for t, _, _ in enc.video_grid_thw), default=0),
                len(measured.rejected.input_ids) if measured.rejected else 0,
            )
        )
        keys += key
        images += [
            (shard_sample.parts[n].offset, shard_sample.parts[n].size, w, h)
            for n, (w, h) in [*zip(names, measured.sizes), *video_parts]
        ]
    return MeasuredShard(
        np.array(samples, SAMPLE), np.array(images, IMAGE), bytes(keys), seen, bad, counts, time.process_time() - start
    )


def inputs_identity(
    shards: list[Path], model_dir: Path, seq_len: int, max_patches: int, overlong: str, video: dict | None = None
) -> dict:
    """What the measurements depend on: the measure settings and every input file's size and mtime."""
    inputs = shards + [model_dir / name for name in MODEL_FILES if (model_dir / name).is_file()]
    return {
        "format": FORMAT,
        "settings": [str(model_dir), seq_len, max_patches, overlong, video or {}],
        "files": [[str(p), p.stat().st_size, p.stat().st_mtime_ns] for p in inputs],
    }


def measure_shards(
    shards: list[Path],
    model_dir: Path,
    seq_len: int,
    max_patches: int,
    overlong: str,
    workers: int,
    cache: Path,
    identity: dict,
    group: tuple[int, int] = (0, 1),
    video: dict | None = None,
) -> list[MeasuredShard]:
    """MeasuredShard per shard, in shard order, from `workers` processes. Each shard's result is
    saved in `cache` (measurements of the inputs `identity`) as it comes, so a rerun after a kill
    measures only the shards left. `group` (g, n): measure only the shards whose index is g modulo
    n and return nothing; n such jobs, run at once, fill the same cache (the workflow's scatter of
    the measure pass)."""
    settings = (model_dir, seq_len, max_patches, overlong, video)
    identity = json.dumps(identity)
    stamp = cache / "identity.json"
    if stamp.is_file() and stamp.read_text() != identity:  # measured from other inputs or settings
        shutil.rmtree(cache)
    if not stamp.is_file():  # scattered jobs may get here together: each writes the same stamp, atomically
        cache.mkdir(parents=True, exist_ok=True)
        stamp.with_suffix(f".tmp{os.getpid()}").write_text(identity)
        stamp.with_suffix(f".tmp{os.getpid()}").replace(stamp)
    g, n = group
    jobs = [(i, shard) for i, shard in enumerate(shards) if i % n == g and not (cache / f"{i:06d}.npz").is_file()]
    workers = min(workers, max(len(jobs), 1))
    progress = tqdm(
        desc=f"measure ({workers} workers)", unit="shard", total=len(shards), initial=len(shards) - len(jobs)
    )
    if workers <= 1:
        start_worker(*settings)
        for i, shard in jobs:
            save_measured(cache / f"{i:06d}.npz", measure_shard((i, shard)))
            progress.update()
    else:
        # fork: the workers share the parent's imported libraries instead of loading their own copy
        with multiprocessing.get_context("fork").Pool(workers, start_worker, settings) as pool:
            for (i, _), measured in zip(jobs, pool.imap(measure_shard, jobs)):
                save_measured(cache / f"{i:06d}.npz", measured)
                progress.update()
    progress.close()
    if n > 1:
        return []
    return [load_measured(cache / f"{i:06d}.npz") for i in range(len(shards))]


def save_measured(path: Path, m: MeasuredShard) -> None:
    info = {"seen": m.seen, "bad": m.bad, "counts": m.counts, "cpu_seconds": m.cpu_seconds}
    with open(path.with_suffix(".tmp"), "wb") as f:
        np.savez(
            f, samples=m.samples, images=m.images, keys=np.frombuffer(m.keys, np.uint8), info=np.array(json.dumps(info))
        )
    path.with_suffix(".tmp").replace(path)


def load_measured(path: Path) -> MeasuredShard:
    with np.load(path) as saved:
        info = json.loads(str(saved["info"]))
        return MeasuredShard(
            saved["samples"],
            saved["images"],
            saved["keys"].tobytes(),
            info["seen"],
            [tuple(bad) for bad in info["bad"]],
            info["counts"],
            info["cpu_seconds"],
        )


def concatenate(measured: list[MeasuredShard]) -> tuple[np.ndarray, np.ndarray, bytes]:
    """The shards' measurements as one dataset's arrays (offsets made global)."""
    key_start = image_start = 0
    for m in measured:
        m.samples["key_offset"] += key_start
        m.samples["first_image"] += image_start
        key_start += len(m.keys)
        image_start += len(m.images)
    return (
        np.concatenate([np.zeros(0, SAMPLE)] + [m.samples for m in measured]),
        np.concatenate([np.zeros(0, IMAGE)] + [m.images for m in measured]),
        b"".join(m.keys for m in measured),
    )
