"""The training loader: packed Energon dataset -> `Batch`es (vlmcore.data.batch, docs/internals.md "Data batches").

Packs are read as crude samples (their parts still compressed); `encode_sample` (in the loader
workers) tokenizes every segment with the model files copied into the packed dataset, decodes and
resizes the images as the transformers image processor does and writes their uint8 patches into
one buffer per row (`ImagePatcher`; the step normalises them on the device), concatenates the
segments, pads the row to `seq_len` (the padding is a segment of its own, with no loss), and
computes the per-segment position ids with `vlmcore.models.position_ids`.

`build_loader` also accepts an Energon metadataset YAML (`write_blend`) that blends several packed
datasets made with the same model and `seq_len`. `vlmcore.data.online` is the alternative to
offline packing: rows packed in the loader from a prepared dataset with a buffer.

Order and resuming (`RowLoader`): the packs are read in the global row order of
`vlmcore.data.order`, each by its index; the position is the rows consumed, so a run resumed
under another layout with the same rows per step goes on exactly.
"""

import json
import logging
from collections import Counter
from pathlib import Path

import torch
import yaml
from megatron.energon import (
    Cooker,
    DefaultTaskEncoder,
    Sample,
    edataclass,
    stateless,
)

from vlmcore.data.batch import Batch, Images
from vlmcore.data.encoder import IGNORE_INDEX, EncodingError, SampleEncoder, TextEncoding
from vlmcore.data.measure import video_part_names
from vlmcore.data.order import RowOrder, rows_of
from vlmcore.data.pack import PACK_MODEL_DIR
from vlmcore.data.processor import ImagePatcher
from vlmcore.data.quality import LOGGED_PER_REASON, BadSample, load_image, load_json
from vlmcore.data.shards import IndexedShards
from vlmcore.data.video import clip_patches
from vlmcore.models import load_hf_config, position_ids

logger = logging.getLogger(__name__)


@edataclass
class PackedRow(Sample):
    input_ids: torch.Tensor  # (S,)
    labels: torch.Tensor  # (S,)
    position_ids: torch.Tensor  # (3, S) for M-RoPE models, (S,) otherwise
    seq_lens: list[int]  # segment lengths, padding last
    pixel_values: torch.Tensor | None  # uint8 patches (`ImagePatcher`), normalised on the device
    image_grid_thw: torch.Tensor | None
    num_samples: int
    skipped: dict[str, int]  # bad samples left out of this row, by reason
    video_pixels: torch.Tensor | None = None  # uint8 patches of the row's videos (`video_patches`)
    video_grid_thw: torch.Tensor | None = None


@edataclass
class StoredSample(Sample):
    meta: bytes  # the `json` part
    parts: dict[str, bytes]  # the other parts (images), still compressed


def packed_dataset_files(path) -> tuple[Path, dict]:
    """The model files and pack config of a packed dataset, or of a blend of packed datasets.

    All datasets of a blend must have been packed with the same tokenizer and pack config.
    """
    found = []
    for dataset_dir in blend_entries(path)[0]:
        config = dataset_dir / "pack_config.json"
        if not config.is_file():
            raise FileNotFoundError(f"{dataset_dir} is not a packed dataset (no pack_config.json); run `vlmcore pack`")
        found.append((dataset_dir / PACK_MODEL_DIR, json.loads(config.read_text())))
    model_dir, pack_config = found[0]
    for other_dir, other_config in found[1:]:
        if (
            other_config != pack_config
            or (other_dir / "tokenizer.json").read_bytes() != (model_dir / "tokenizer.json").read_bytes()
        ):
            raise ValueError(
                f"{path}: {other_dir.parent} was packed with another tokenizer or pack config than {model_dir.parent}"
            )
    return model_dir, pack_config


def blend_entries(path) -> tuple[list[Path], list[float] | None, list[int] | None]:
    """(dataset directories, weights or None, repetitions or None) of a dataset directory or a blend YAML."""
    path = Path(path)
    if path.is_dir():
        return [path], None, None
    node = yaml.safe_load(path.read_text())["splits"]["train"]
    entries = node.get("blend") or node.get("blend_epochized") or [node]
    dirs = [(path.parent / entry["path"]).resolve() for entry in entries]
    if "blend" in node:
        return dirs, [float(entry["weight"]) for entry in entries], None
    return dirs, None, [int(entry["repetitions"]) for entry in entries] if "blend_epochized" in node else None


def samples_in(dataset_dir: Path) -> int:
    return sum(json.loads((dataset_dir / ".nv-meta" / ".info.json").read_text())["shard_counts"].values())


class PackedTaskEncoder(DefaultTaskEncoder):
    decoder = None  # the cooker decodes the raw parts itself

    def __init__(self, model_dir, seq_len: int, video: dict | None = None):
        super().__init__()
        self.encoder = SampleEncoder(model_dir, video)
        self.patcher = ImagePatcher(self.encoder.processor.image_processor) if self.encoder.processor else None
        self.model_config = load_hf_config(model_dir)
        self.seq_len = seq_len
        self.cookers = [Cooker(self.cook)]

    @stateless
    def cook(self, crude: dict) -> StoredSample:
        """Nothing decoded: the shuffle buffer after the cooker holds compressed samples."""
        return StoredSample(
            **basic_keys(crude),
            meta=crude["json"],
            parts={k: v for k, v in crude.items() if not k.startswith("__") and k != "json"},
        )

    @stateless
    def encode_sample(self, stored: StoredSample) -> PackedRow:
        """A bad segment (malformed, an image missing or not decoding, an encoding error) is left
        out and counted in the row's `skipped`; the pack's other segments still train."""
        skipped = Counter()
        segments = []
        try:
            segments = load_json(stored.meta)["segments"]
        except BadSample as e:
            skip(skipped, e.reason, f"pack {stored.__key__}", e)
        except (KeyError, TypeError) as e:
            skip(skipped, "malformed_json", f"pack {stored.__key__}", e)
        encoded = []
        for i, segment in enumerate(segments):
            try:
                encoded.append(self.encode_segment(stored, segment))
            except (BadSample, EncodingError) as e:
                skip(skipped, e.reason, f"pack {stored.__key__} segment {i}", e)
        return self.assemble_row(basic_keys(stored), encoded, skipped)

    def encode_segment(self, stored: StoredSample, segment: dict) -> tuple:
        try:
            sizes = [tuple(size) for size in segment["image_sizes"]]
            videos, max_frames = segment.get("videos", []), segment.get("max_frames")
            enc = self.encoder.truncate(
                self.encoder.encode_text(segment["sample"], sizes, videos, max_frames), segment["num_tokens"]
            )
            clips = self.clips(enc, videos, max_frames, stored.parts)
            missing = [name for name in segment["images"] if name not in stored.parts]
        except (KeyError, TypeError, AttributeError) as e:
            raise BadSample("malformed_segment", f"{type(e).__name__}: {e}") from e
        if missing:
            raise BadSample("missing_image", f"parts {missing}")
        if len(enc.input_ids) != segment["num_tokens"]:
            raise ValueError(
                f"pack {stored.__key__}, sample {segment['key']}: encodes to {len(enc.input_ids)} tokens but was "
                f"packed as {segment['num_tokens']}; the packed dataset's model/ files changed since `vlmcore pack`"
            )
        return segment["key"], enc, [stored.parts[name] for name in segment["images"]], clips

    def clips(self, enc: TextEncoding, videos: list[dict], max_frames: int | None, parts: dict) -> list:
        """(metadata, plan, parts' bytes) of each video the encoding keeps."""
        out = []
        for video in videos[: len(enc.video_grid_thw)]:
            names = video_part_names(video)
            if any(name not in parts for name in names):
                raise BadSample("missing_video", f"parts {[n for n in names if n not in parts][:3]}")
            out.append((video, self.encoder.video_plan(video, max_frames), [parts[name] for name in names]))
        return out

    def assemble_row(self, keys: dict, segments: list[tuple], skipped: Counter) -> PackedRow:
        """Concatenate encoded samples (key, encoding, kept images' bytes, kept clips) into one
        padded row; a sample whose images or videos do not decode is left out and counted in `skipped`."""
        ids, labels, seq_lens, images, videos = [], [], [], [], []
        for key, enc, image_bytes, clips in segments:
            try:
                decoded = [load_image(data) for data in image_bytes]
                clip_results = [clip_patches(meta, data, plan, self.encoder.video) for meta, plan, data in clips]
            except BadSample as e:
                skip(skipped, e.reason, f"sample {key}", e)
                continue
            resized = [self.patcher.resized(image) for image in decoded]
            grids = [self.patcher.grid(image) for image in resized]
            if grids != [tuple(g) for g in enc.image_grid_thw] or [grid for _, grid in clip_results] != [
                tuple(g) for g in enc.video_grid_thw
            ]:
                raise ValueError(
                    f"{keys.get('__key__')}: image grids {grids} (videos "
                    f"{[grid for _, grid in clip_results]}) != {enc.image_grid_thw} ({enc.video_grid_thw})"
                )
            images += resized
            videos += clip_results
            ids += enc.input_ids
            labels += enc.labels
            seq_lens.append(len(enc.input_ids))
        num_samples = len(seq_lens)
        padding = self.seq_len - len(ids)
        if padding < 0:
            raise ValueError(f"{keys.get('__key__')}: {len(ids)} tokens do not fit seq_len {self.seq_len}")
        if padding:
            ids += [self.encoder.pad_id] * padding
            labels += [IGNORE_INDEX] * padding
            seq_lens.append(padding)
        input_ids = torch.tensor(ids, dtype=torch.long)
        pixel_values, image_grid_thw = self.row_patches(images) if images else (None, None)
        video_pixels = torch.cat([patches for patches, _ in videos]) if videos else None
        video_grid_thw = torch.tensor([grid for _, grid in videos], dtype=torch.long) if videos else None
        cu_seqlens = torch.tensor([0] + seq_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
        positions = position_ids(self.model_config, input_ids[None], image_grid_thw, cu_seqlens, video_grid_thw)
        return PackedRow(
            **keys,
            input_ids=input_ids,
            labels=torch.tensor(labels, dtype=torch.long),
            position_ids=positions[:, 0] if positions.dim() == 3 else positions[0],
            seq_lens=seq_lens,
            pixel_values=pixel_values,
            image_grid_thw=image_grid_thw,
            num_samples=num_samples,
            skipped=dict(skipped),
            video_pixels=video_pixels,
            video_grid_thw=video_grid_thw,
        )

    def row_patches(self, images: list) -> tuple[torch.Tensor, torch.Tensor]:
        """The resized images' uint8 patches, written once into the row's one buffer, and their grids."""
        grids = [self.patcher.grid(image) for image in images]
        image_grid_thw = torch.tensor(grids, dtype=torch.long)
        pixel_values = torch.empty(int(image_grid_thw.prod(-1).sum()), self.patcher.patch_dim, dtype=torch.uint8)
        start = 0
        for image, (t, h, w) in zip(images, grids):
            self.patcher.write_patches(image, pixel_values[start : start + t * h * w].numpy())
            start += t * h * w
        return pixel_values, image_grid_thw

    def batch(self, rows: list[PackedRow]) -> Batch:
        seq_lens = [n for row in rows for n in row.seq_lens]
        with_images = [row for row in rows if row.pixel_values is not None]
        images = (
            Images.cat([Images(row.pixel_values, row.image_grid_thw, self.patcher.normalize) for row in with_images])
            if with_images
            else None
        )
        with_videos = [row for row in rows if row.video_pixels is not None]
        video_normalize = {"image_mean": self.encoder.video.image_mean, "image_std": self.encoder.video.image_std}
        videos = (
            Images.cat([Images(row.video_pixels, row.video_grid_thw, video_normalize, "video") for row in with_videos])
            if with_videos
            else None
        )
        return Batch(
            input_ids=torch.stack([row.input_ids for row in rows]),
            labels=torch.stack([row.labels for row in rows]),
            cu_seqlens=torch.tensor([0] + seq_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32),
            position_ids=torch.stack([row.position_ids for row in rows], dim=-2),
            images=images,
            videos=videos,
            num_samples=sum(row.num_samples for row in rows),
            skipped_samples=dict(sum((Counter(row.skipped) for row in rows), Counter())),
            row_keys=[row.__key__ for row in rows],
        )


def skip(skipped: Counter, reason: str, where: str, error: Exception) -> None:
    """Count a bad sample left out of a row; the first few of each reason are logged."""
    skipped[reason] += 1
    _logged[reason] += 1
    if _logged[reason] <= LOGGED_PER_REASON:
        logger.warning("loader: skipping %s (%s): %s", where, reason, error)


_logged = Counter()  # per loader process


def basic_keys(sample) -> dict:
    """The Energon bookkeeping fields (restore key etc.) of a crude dict or a Sample."""
    names = ("__key__", "__restore_key__", "__subflavors__", "__sources__")
    if isinstance(sample, dict):
        return {k: sample[k] for k in names if k in sample}
    return {k: getattr(sample, k) for k in names}


class RowLoader:
    """The batches of one data-parallel rank over a packed dataset (or a blend of them), read in
    the global row order of `vlmcore.data.order`: micro-batch `a` of step `k` on rank `r` holds the
    rows `rows_of(k, a, r)`, each pack read by index (`IndexedShards`). The position is the number
    of micro-batches taken; under another layout with the same global batch (rows per step) it
    is found again from the rows consumed (`seek`), at no cost but the index reads of the rows.

    Loader workers take micro-batches in turn (worker w the ones congruent to w), and torch's
    DataLoader hands them out in that order, so the worker count does not change the stream."""

    anchor = None  # where finding a row starts, for a stream whose rows are found by walking it (online packing)

    def __init__(
        self,
        path,
        task_encoder: PackedTaskEncoder,
        *,
        dp_rank: int,
        dp_world: int,
        micro_batch_size: int,
        grad_accum_steps: int,
        seed: int,
        num_workers: int,
    ):
        self.task_encoder = task_encoder
        self.split = {
            "dp_rank": dp_rank,
            "dp_world": dp_world,
            "micro_batch_size": micro_batch_size,
            "grad_accum_steps": grad_accum_steps,
        }
        self.num_workers = num_workers
        entries, weights, repetitions = blend_entries(path)
        self.datasets = [IndexedShards(d) for d in entries]
        self.order = RowOrder([len(d) for d in self.datasets], seed, weights, repetitions)
        self.first_row, self.micro_batches = 0, 0  # where this layout started, micro-batches taken since

    @property
    def global_batch_rows(self) -> int:
        return self.split["dp_world"] * self.split["micro_batch_size"] * self.split["grad_accum_steps"]

    def seek(self, rows: int) -> None:
        """Go on from global row `rows`: the next step's global batch is the `global_batch_rows` rows after it."""
        self.first_row, self.micro_batches = rows, 0

    def rows_consumed(self) -> int:
        """The global rows of the steps this rank has completed (every rank of the step read its share)."""
        return self.first_row + self.micro_batches // self.split["grad_accum_steps"] * self.global_batch_rows

    def micro_batch(self, m: int) -> Batch:
        step, micro = divmod(m, self.split["grad_accum_steps"])
        return self.task_encoder.batch([self.row(self.first_row + j) for j in rows_of(step, micro, **self.split)])

    def row(self, j: int) -> PackedRow:
        """Global row j: its pack, read by index and encoded."""
        dataset, index = self.order[j]
        crude = self.datasets[dataset].read(index)
        return self.task_encoder.encode_sample(self.task_encoder.cook({**crude, "__restore_key__": ()}))

    def __iter__(self):
        stream = _MicroBatches(self, self.micro_batches)
        loader = torch.utils.data.DataLoader(
            stream,
            batch_size=None,
            num_workers=self.num_workers,
            collate_fn=_as_is,
            pin_memory=torch.cuda.is_available(),
        )
        for batch, anchor in loader:
            self.micro_batches += 1
            self.anchor = anchor  # where a loader worker's walk over the stream got to
            yield batch

    def state_dict(self) -> dict:
        return {
            "first_row": self.first_row,
            "micro_batches": self.micro_batches,
            "rows": self.rows_consumed(),
            **self.split,
        }

    def load_state_dict(self, state: dict) -> None:
        """This loader's own state, or (at a step boundary) another layout's with the same global batch."""
        if {k: state.get(k) for k in self.split} == self.split:
            self.first_row, self.micro_batches = state["first_row"], state["micro_batches"]
            return
        other = state["dp_world"] * state["micro_batch_size"] * state["grad_accum_steps"]
        if other != self.global_batch_rows:
            raise ValueError(
                f"the saved position is in steps of {other} rows, this loader's are {self.global_batch_rows}"
            )
        self.seek(state["rows"])


class _MicroBatches(torch.utils.data.IterableDataset):
    """Micro-batches `start`, `start + 1`, ... of a `RowLoader`; loader worker w of W makes every Wth."""

    def __init__(self, loader: RowLoader, start: int):
        self.loader, self.start = loader, start

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        m, stride = (self.start, 1) if info is None else (self.start + info.id, info.num_workers)
        while True:
            yield self.loader.micro_batch(m), self.loader.anchor
            m += stride


def _as_is(batch):
    return batch


def build_loader(
    packed_dir,
    *,
    dp_rank: int,
    dp_world: int,
    micro_batch_size: int,
    seed: int,
    num_workers: int,
    grad_accum_steps: int = 1,
) -> RowLoader:
    """Batches from a packed dataset (`vlmcore pack`) or a blend YAML of packed datasets (`write_blend`)."""
    model_dir, pack_config = packed_dataset_files(packed_dir)
    return RowLoader(
        packed_dir,
        PackedTaskEncoder(model_dir, pack_config["seq_len"]),
        dp_rank=dp_rank,
        dp_world=dp_world,
        micro_batch_size=micro_batch_size,
        grad_accum_steps=grad_accum_steps,
        seed=seed,
        num_workers=num_workers,
    )


def write_blend(path, datasets: list[tuple[str, float]], epochized: bool = False) -> None:
    """An Energon metadataset over packed `datasets` [(dir, weight), ...].

    Weighted: packs are sampled from each dataset with probability proportional to its weight.
    Epochized: each "epoch" of the blend holds every dataset exactly `weight` (an integer) times.
    """
    path = Path(path)
    if epochized:
        node = {"blend_epochized": [{"repetitions": int(w), "path": str(Path(d).resolve())} for d, w in datasets]}
    else:
        node = {"blend": [{"weight": w, "path": str(Path(d).resolve())} for d, w in datasets]}
    doc = {"__module__": "megatron.energon", "__class__": "MetadatasetV2", "splits": {"train": node}}
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
