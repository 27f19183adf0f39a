"""A pack -> one training row -> a `Batch` (vlmcore.data.load.batch).

`PackedTaskEncoder.encode_sample` (in the loader workers) tokenizes every segment of a pack
(`vlmcore.data.pack.format`) with the model files copied into the packed dataset, decodes and
resizes the images as the transformers image processor does and writes their uint8 patches into
one buffer per row (`ImagePatcher`; the step normalises them on the device), concatenates the
segments, pads the row to `seq_len` (the padding is a segment of its own, with no loss), and
computes the per-segment position ids with `vlmcore.models.position_ids`. `batch` stacks rows.

A bad segment (malformed, an image missing or not decoding, an encoding error) is left out of
its row and counted in the row's `skipped`; the pack's other segments still train.
"""

import logging
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

from vlmcore.data import IGNORE_INDEX
from vlmcore.data.load.batch import Batch, Images
from vlmcore.data.media.encoder import EncodingError, SampleEncoder, TextEncoding
from vlmcore.data.media.image import load_image
from vlmcore.data.media.processor import ImagePatcher
from vlmcore.data.media.video import clip_patches
from vlmcore.data.pack.format import Segment, pack_segments
from vlmcore.data.quality import LOGGED_PER_REASON, BadSample
from vlmcore.data.shards import video_part_names
from vlmcore.models import load_hf_config, position_ids

logger = logging.getLogger(__name__)


@dataclass
class StoredSample:
    """A pack as read from its shard, nothing decoded."""

    key: str
    meta: bytes  # the `json` part
    parts: dict[str, bytes]  # the other parts (images, videos), still compressed


@dataclass
class PackedRow:
    key: str  # the pack's key (several packs' keys, comma separated, for an online row)
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
    pairs: list[tuple[int, int]] | None = None  # preference pairs: (chosen, rejected) segment indices in the row


# One segment ready to join a row: its key, its encoding, its kept images' bytes, its kept clips,
# its preference side ("chosen", "rejected" or None).
EncodedSegment = tuple[str, TextEncoding, list[bytes], list, str | None]


class PackedTaskEncoder:
    """Packs -> rows -> batches for the model snapshot in `model_dir` (the packed dataset's `model/`)."""

    def __init__(self, model_dir: str | Path, seq_len: int, video: dict | None = None) -> None:
        self.encoder = SampleEncoder(model_dir, video)
        self.patcher = ImagePatcher(self.encoder.processor.image_processor) if self.encoder.processor else None
        self.model_config = load_hf_config(model_dir)
        self.seq_len = seq_len

    def cook(self, crude: dict) -> StoredSample:
        """A pack's crude dict (`__key__` and its parts' bytes, as `IndexedShards.read` gives it)."""
        return StoredSample(
            key=crude["__key__"],
            meta=crude["json"],
            parts={k: v for k, v in crude.items() if not k.startswith("__") and k != "json"},
        )

    def encode_sample(self, stored: StoredSample) -> PackedRow:
        """A bad segment (malformed, an image missing or not decoding, an encoding error) is left
        out and counted in the row's `skipped`; the pack's other segments still train."""
        skipped = Counter()
        segments = []
        try:
            segments = pack_segments(stored.meta)
        except BadSample as e:
            skip(skipped, e.reason, f"pack {stored.key}", e)
        except (KeyError, TypeError) as e:
            skip(skipped, "malformed_json", f"pack {stored.key}", e)
        encoded = []
        for i, segment in enumerate(segments):
            try:
                encoded.append(self.encode_segment(stored, segment))
            except (BadSample, EncodingError) as e:
                skip(skipped, e.reason, f"pack {stored.key} segment {i}", e)
        return self.assemble_row(stored.key, whole_pairs(encoded, stored.key, skipped), skipped)

    def encode_segment(self, stored: StoredSample, raw_segment: object) -> EncodedSegment:
        try:
            segment = Segment.from_json(raw_segment)
            enc = self.encoder.encode_text(segment.sample, segment.image_sizes, segment.videos, segment.max_frames)
            enc = self.encoder.truncate(enc, segment.num_tokens)
            clips = self.clips(enc, segment.videos, segment.max_frames, stored.parts)
            missing = [name for name in segment.images if name not in stored.parts]
        except (KeyError, TypeError, AttributeError) as e:
            raise BadSample("malformed_segment", f"{type(e).__name__}: {e}") from e
        if missing:
            raise BadSample("missing_image", f"parts {missing}")
        if len(enc.input_ids) != segment.num_tokens:
            raise ValueError(
                f"pack {stored.key}, sample {segment.key}: encodes to {len(enc.input_ids)} tokens but was "
                f"packed as {segment.num_tokens}; the packed dataset's model/ files changed since `vlmcore pack`"
            )
        return segment.key, enc, [stored.parts[name] for name in segment.images], clips, segment.preference

    def clips(self, enc: TextEncoding, videos: list[dict], max_frames: int | None, parts: dict) -> list:
        """(metadata, plan, parts' bytes) of each video the encoding keeps."""
        out = []
        for video in videos[: len(enc.video_grid_thw)]:
            names = video_part_names(video)
            if any(name not in parts for name in names):
                raise BadSample("missing_video", f"parts {[n for n in names if n not in parts][:3]}")
            out.append((video, self.encoder.video_plan(video, max_frames), [parts[name] for name in names]))
        return out

    def assemble_row(self, key: str, segments: list[EncodedSegment], skipped: Counter) -> PackedRow:
        """Concatenate encoded samples into one padded row; a sample whose images or videos do not
        decode is left out and counted in `skipped`."""
        ids = []
        labels = []
        seq_lens = []
        images = []
        videos = []
        pairs = []
        for sample_key, enc, image_bytes, clips, preference in segments:
            try:
                decoded = [load_image(data) for data in image_bytes]
                clip_results = [clip_patches(meta, data, plan, self.encoder.video) for meta, plan, data in clips]
            except BadSample as e:  # a pair's sides share their media: both are left out
                skip(skipped, e.reason, f"sample {sample_key}", e)
                continue
            if preference == "rejected":
                pairs.append((len(seq_lens) - 1, len(seq_lens)))
            resized = [self.patcher.resized(image) for image in decoded]
            self.check_grids(key, enc, resized, clip_results)
            images += resized
            videos += clip_results
            ids += enc.input_ids
            labels += enc.labels
            seq_lens.append(len(enc.input_ids))
        num_samples = len(seq_lens)
        padding = self.seq_len - len(ids)
        if padding < 0:
            raise ValueError(f"{key}: {len(ids)} tokens do not fit seq_len {self.seq_len}")
        if padding:
            ids += [self.encoder.pad_id] * padding
            labels += [IGNORE_INDEX] * padding
            seq_lens.append(padding)
        row = self.row_tensors(key, ids, labels, seq_lens, images, videos, num_samples, skipped)
        row.pairs = pairs
        return row

    def check_grids(self, key: str, enc: TextEncoding, resized: list, clip_results: list) -> None:
        """The images and clips as decoded must have the grids the text was encoded with."""
        grids = [self.patcher.grid(image) for image in resized]
        video_grids = [grid for _, grid in clip_results]
        if grids != [tuple(g) for g in enc.image_grid_thw] or video_grids != [tuple(g) for g in enc.video_grid_thw]:
            raise ValueError(
                f"{key}: image grids {grids} (videos {video_grids}) != {enc.image_grid_thw} ({enc.video_grid_thw})"
            )

    def row_tensors(
        self,
        key: str,
        ids: list[int],
        labels: list[int],
        seq_lens: list[int],
        images: list,
        videos: list,
        num_samples: int,
        skipped: Counter,
    ) -> PackedRow:
        """The row's tensors: its tokens, its images' and videos' patches and its position ids."""
        input_ids = torch.tensor(ids, dtype=torch.long)
        pixel_values = None
        image_grid_thw = None
        if images:
            pixel_values, image_grid_thw = self.row_patches(images)
        video_pixels = None
        video_grid_thw = None
        if videos:
            video_pixels = torch.cat([patches for patches, _ in videos])
            video_grid_thw = torch.tensor([grid for _, grid in videos], dtype=torch.long)
        cu_seqlens = torch.tensor([0] + seq_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
        positions = position_ids(self.model_config, input_ids[None], image_grid_thw, cu_seqlens, video_grid_thw)
        return PackedRow(
            key=key,
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
        images = None
        if with_images:
            images = Images.cat(
                [Images(row.pixel_values, row.image_grid_thw, self.patcher.normalize) for row in with_images]
            )
        with_videos = [row for row in rows if row.video_pixels is not None]
        videos = None
        if with_videos:
            video_normalize = {"image_mean": self.encoder.video.image_mean, "image_std": self.encoder.video.image_std}
            videos = Images.cat(
                [Images(row.video_pixels, row.video_grid_thw, video_normalize, "video") for row in with_videos]
            )
        return Batch(
            pairs=batch_pairs(rows),
            input_ids=torch.stack([row.input_ids for row in rows]),
            labels=torch.stack([row.labels for row in rows]),
            cu_seqlens=torch.tensor([0] + seq_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32),
            position_ids=torch.stack([row.position_ids for row in rows], dim=-2),
            images=images,
            videos=videos,
            num_samples=sum(row.num_samples for row in rows),
            skipped_samples=dict(sum((Counter(row.skipped) for row in rows), Counter())),
            row_keys=[row.key for row in rows],
        )


def whole_pairs(segments: list[EncodedSegment], key: str, skipped: Counter) -> list[EncodedSegment]:
    """The segments without the preference sides whose other side was left out (counted as
    `preference_side_left_out`): a pair trains whole or not at all. A pair is its chosen side
    followed by its rejected side (`vlmcore.data.pack.format.Segment`)."""
    kept = []
    for i, segment in enumerate(segments):
        sample_key = segment[0]
        preference = segment[4]
        partner = {"chosen": (i + 1, "rejected"), "rejected": (i - 1, "chosen")}.get(preference)
        if partner is not None:
            j, side = partner
            whole = 0 <= j < len(segments) and segments[j][4] == side and segments[j][0] == sample_key
            if not whole:
                skip(skipped, "preference_side_left_out", f"pack {key} sample {sample_key}", ValueError(preference))
                continue
        kept.append(segment)
    return kept


def batch_pairs(rows: list[PackedRow]) -> torch.Tensor | None:
    """(pairs, 2) segment indices over the batch's segments (the rows' in turn, padding included),
    or None when no row holds a pair."""
    if not any(row.pairs for row in rows):
        return None
    pairs = []
    first = 0  # the row's first segment in the batch
    for row in rows:
        pairs += [(first + chosen, first + rejected) for chosen, rejected in row.pairs or []]
        first += len(row.seq_lens)
    return torch.tensor(pairs, dtype=torch.long).reshape(-1, 2)


def skip(skipped: Counter, reason: str, where: str, error: Exception) -> None:
    """Count a bad sample left out of a row; the first few of each reason are logged."""
    skipped[reason] += 1
    _logged[reason] += 1
    if _logged[reason] <= LOGGED_PER_REASON:
        logger.warning("loader: skipping %s (%s): %s", where, reason, error)


_logged = Counter()  # per loader process
