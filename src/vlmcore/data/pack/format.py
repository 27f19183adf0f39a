"""The packed dataset's format: what `vlmcore pack` writes and the loader reads, in one place.

A packed dataset directory holds:
  shard-000000.tar, ...  webdataset shards, one sample a pack: `json` (the pack's segments,
                         `encode_pack`), and the segments' images and videos as parts named by
                         `image_part_name` and `video_part_name`
  .nv-meta/              the shards' index (`energon prepare`)
  model/                 the model files the loader encodes with (PACK_MODEL_DIR, MODEL_FILES)
  pack_config.json       the row budget and video settings (PackConfig)
  stats.json             what the pack measured, dropped and truncated

A segment is one sample of a pack, stored crude: its prepared json and the sizes of its images,
tokenized again by the loader with the model files in `model/`. A preference pair (DPO) is two
segments of one pack, its chosen then its rejected side (`Segment.preference`), sharing the
pair's image and video parts: no pair is ever split between packs, rows or ranks.
"""

import json
from dataclasses import dataclass, field
from pathlib import Path

from vlmcore.data.quality import load_json

PACK_MODEL_DIR = "model"
PACK_CONFIG_FILE = "pack_config.json"
STATS_FILE = "stats.json"
# The files of a model snapshot that the loader encodes with, copied into PACK_MODEL_DIR when present.
MODEL_FILES = [
    "config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "merges.txt",
    "preprocessor_config.json",
    "video_preprocessor_config.json",
    "processor_config.json",
]


def shard_name(index: int) -> str:
    return f"shard-{index:06d}.tar"


def pack_key(index: int) -> str:
    """The webdataset key of pack `index`."""
    return f"{index:09d}"


def image_part_name(segment: int, image: int, prepared_name: str) -> str:
    """The part of a segment's image in its pack, with the extension of its prepared part."""
    return f"s{segment}_img{image}.{prepared_name.rsplit('.', 1)[-1]}"


def video_part_name(segment: int, video: int, part: int, prepared_name: str) -> str:
    """The part of a segment's video file (part 0) or of one of its frames, with the extension of its prepared part."""
    return f"s{segment}_vid{video}_{part:05d}.{prepared_name.rsplit('.', 1)[-1]}"


@dataclass
class Segment:
    key: str  # the sample's key in the prepared dataset
    sample: dict  # its prepared json, without the `images` and `videos` part lists
    image_sizes: list[tuple[int, int]]  # (width, height) of each of its images, the ones truncation drops included
    images: list[str]  # the part names of the images it keeps
    num_tokens: int  # its tokens after truncation: the loader checks its encoding against it
    # Each video's metadata (the text holds all their tags; truncation drops the later ones again
    # in the loader), the kept ones with their part names (`part` for a file, `parts` for frames).
    videos: list[dict] = field(default_factory=list)
    max_frames: int | None = None  # the frames its videos are sampled at; None: the processor's max_frames
    # A preference pair's side, "chosen" or "rejected": a pair is two segments of one pack, the
    # chosen one first, with the same images and videos (the same parts); None: any other sample.
    preference: str | None = None

    def to_json(self) -> dict:
        out = {"key": self.key, "sample": self.sample, "image_sizes": self.image_sizes, "images": self.images}
        if self.videos:
            out["videos"] = self.videos
            out["max_frames"] = self.max_frames
        if self.preference:
            out["preference"] = self.preference
        out["num_tokens"] = self.num_tokens
        return out

    @classmethod
    def from_json(cls, segment: dict) -> "Segment":
        """KeyError or TypeError when a field is missing or not of its kind."""
        return cls(
            key=segment["key"],
            sample=segment["sample"],
            image_sizes=[tuple(size) for size in segment["image_sizes"]],
            images=segment["images"],
            num_tokens=segment["num_tokens"],
            videos=segment.get("videos", []),
            max_frames=segment.get("max_frames"),
            preference=segment.get("preference"),
        )


def encode_pack(segments: list[Segment]) -> bytes:
    """A pack's `json` part."""
    return json.dumps({"segments": [segment.to_json() for segment in segments]}).encode()


def pack_segments(meta: bytes) -> list:
    """The segments of a pack's `json` part, each still a dict for `Segment.from_json`; BadSample
    when it is not UTF-8 JSON, KeyError or TypeError when it holds no segments."""
    return load_json(meta)["segments"]


@dataclass
class PackConfig:
    seq_len: int  # tokens a row
    max_patches: int  # image and video patches a row
    video: dict | None = None  # the pack's video sampling settings (`vlmcore pack --video-*`), if any
    video_groups: int = 0  # the longest clip's frame groups, for `vlmcore memory`; 0: no video

    def to_json(self) -> dict:
        out = {"seq_len": self.seq_len, "max_patches": self.max_patches}
        if self.video:
            out["video"] = self.video
        if self.video_groups:
            out["video_groups"] = self.video_groups
        return out

    def write(self, dataset_dir: Path) -> None:
        (dataset_dir / PACK_CONFIG_FILE).write_text(json.dumps(self.to_json()) + "\n")

    @classmethod
    def read(cls, dataset_dir: Path) -> "PackConfig":
        config = json.loads((dataset_dir / PACK_CONFIG_FILE).read_text())
        return cls(config["seq_len"], config["max_patches"], config.get("video"), config.get("video_groups", 0))
