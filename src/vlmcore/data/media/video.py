"""Video clips as Qwen3-VL's video processor takes them (transformers' `Qwen3VLVideoProcessor`
and `Qwen3VLProcessor`), without torchvision: the clip's metadata read from its container
without decoding frames (`probe`), the frames it samples (`sample_frames`), the size it resizes
them to (`frame_size`), each frame group's timestamp and its place in the prompt
(`frame_timestamps`, `video_prompt`), and the sampled frames decoded, resized as torchvision
resizes uint8 frames on the CPU, and cut into uint8 patches in the processor's order
(`video_patches`); `normalize_video_patches` is the processor's fused rescale and normalize,
for the device.

Decoder: PyAV. Its wheels bundle FFmpeg (H.264, VP9, MJPEG... with no system package), it
reads from memory, and it decodes frame by frame in the calling process; torchcodec needs a
system FFmpeg of matching version, and decord is unmaintained and known to hang in loader
workers.
"""

import io
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from fractions import Fraction
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F

from vlmcore.data.media.image import load_image
from vlmcore.data.quality import BadSample

if TYPE_CHECKING:
    import av


@dataclass(frozen=True)
class VideoSettings:
    """The video processor's sampling and sizing settings (its preprocessor config's names)."""

    fps: float = 2.0  # frames sampled per second of video
    min_frames: int = 4
    max_frames: int = 768
    min_pixels: int = 128 * 32 * 32  # `size.shortest_edge`: pixels of all sampled frames together, at least
    max_pixels: int = 768 * 32 * 32  # `size.longest_edge`: ... at most
    patch_size: int = 16
    temporal_patch_size: int = 2
    merge_size: int = 2
    image_mean: tuple = (0.5, 0.5, 0.5)
    image_std: tuple = (0.5, 0.5, 0.5)

    @classmethod
    def from_processor_config(cls, config: dict) -> "VideoSettings":
        size = config.get("size") or {}
        values = {
            "min_pixels": size.get("shortest_edge"),
            "max_pixels": size.get("longest_edge"),
            **{
                k: config.get(k)
                for k in ("fps", "min_frames", "max_frames", "patch_size", "temporal_patch_size", "merge_size")
            },
            "image_mean": tuple(config["image_mean"]) if config.get("image_mean") else None,
            "image_std": tuple(config["image_std"]) if config.get("image_std") else None,
        }
        return cls(**{k: v for k, v in values.items() if v is not None})


# The fewest frames a clip needs: one frame group of Qwen3-VL's video processor (its
# temporal_patch_size). `vlmcore prepare` knows no model, so it checks this; the pack checks the model's.
MIN_VIDEO_FRAMES = VideoSettings.temporal_patch_size

# The sampling settings a pack may set (`vlmcore pack --video-*`, the workflow's `pack.video`),
# by their names in the video processor's config.
VIDEO_KEYS = ("fps", "min_frames", "max_frames", "min_pixels", "max_pixels")


def with_video_settings(config: dict, video: dict) -> dict:
    """A video processor config (video_preprocessor_config.json) with `video`'s settings."""
    config = {**config, **{k: v for k, v in video.items() if k in ("fps", "min_frames", "max_frames")}}
    size = {
        **config.get("size", {}),
        **({"shortest_edge": video["min_pixels"]} if "min_pixels" in video else {}),
        **({"longest_edge": video["max_pixels"]} if "max_pixels" in video else {}),
    }
    return {**config, "size": size} if size else config


@dataclass(frozen=True)
class VideoInfo:
    frames: int
    fps: float
    duration_s: float
    width: int
    height: int
    codec: str  # a rotation flag is not read: the processor's decoders hand frames over as stored
    container: str = ""  # the file type, as a file name extension (mp4, webm, avi, mkv, ...)

    def as_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k != "container"}


# FFmpeg's demuxer names -> a file name extension for the shard part.
CONTAINER_EXTENSIONS = {
    "mov,mp4,m4a,3gp,3g2,mj2": "mp4",
    "matroska,webm": "mkv",
    "avi": "avi",
    "mpegts": "ts",
    "flv": "flv",
    "ogg": "ogv",
    "gif": "gif",
    "mpeg": "mpg",
}


def probe(data: bytes) -> VideoInfo:
    """The clip's metadata from its container headers. The packets are counted without decoding:
    the frame count when the container does not record it, and a file cut short when it does."""
    import av

    try:
        with av.open(io.BytesIO(data)) as container:
            info = read_video_info(container)
    except BadSample:
        raise
    except Exception as e:  # FFmpeg's errors come in many types
        raise BadSample("unreadable_video", f"{type(e).__name__}: {e}") from e
    if info.frames == 0:
        raise BadSample("zero_frames", "the video stream has no frames")
    return info


def read_video_info(container: "av.container.InputContainer") -> VideoInfo:
    """`probe` of an open container."""
    if not container.streams.video:
        raise BadSample("no_video_stream", "the container has no video stream")
    stream = container.streams.video[0]
    if stream.codec_context is None:  # a codec this FFmpeg does not know
        raise BadSample("unsupported_codec", "no decoder for the video stream's codec in this FFmpeg")
    rate = stream.average_rate or stream.guessed_rate
    if not rate:
        raise BadSample("unreadable_video", "no frame rate in the container")
    width = stream.codec_context.width
    height = stream.codec_context.height
    # An MPEG-4 Part 2 stream whose frame data is unreadable (zeroed, say) gives no frame size
    # in its headers; refused here, where frame sizes and plans would divide by it.
    if width <= 0 or height <= 0:
        raise BadSample("unreadable_video", f"the video stream gives no frame size ({width}x{height})")
    frames = complete_frame_count(container, stream)
    duration = float(stream.duration * stream.time_base) if stream.duration else frames / float(rate)
    return VideoInfo(
        frames=frames,
        fps=float(rate),
        duration_s=duration,
        width=width,
        height=height,
        codec=stream.codec_context.name,
        container=container_extension(container, stream),
    )


def complete_frame_count(container: "av.container.InputContainer", stream: "av.video.stream.VideoStream") -> int:
    """The stream's frames, counted from its packets where the container does not record them;
    BadSample("truncated_video") when the file holds fewer than it records."""
    packets = 0
    end = 0.0  # seconds: where the last packet's frame ends
    for packet in container.demux(stream):
        if not packet.size:
            continue
        packets += 1
        if packet.pts is not None:
            packet_end = (packet.pts - (stream.start_time or 0) + (packet.duration or 0)) * stream.time_base
            end = max(end, float(packet_end))
    frames = stream.frames or packets
    if packets < frames:
        raise BadSample("truncated_video", f"{packets} of the {frames} frames the container records are there")
    # Without a recorded frame count (webm, mkv), a cut file shows in the time its frames
    # span against the duration its header records (only for video alone: audio may run on).
    recorded = (container.duration or 0) / 1e6
    if not stream.frames and len(container.streams) == 1 and end < 0.9 * recorded:
        raise BadSample("truncated_video", f"its frames span {end:.2f} s of the {recorded:.2f} s the container records")
    return frames


def container_extension(container: "av.container.InputContainer", stream: "av.video.stream.VideoStream") -> str:
    """The file name extension of the container, webm for a Matroska file of a web codec."""
    extension = CONTAINER_EXTENSIONS.get(container.format.name, container.format.name.split(",")[0])
    if extension == "mkv" and stream.codec_context.name in ("vp8", "vp9", "av1"):
        extension = "webm"
    return extension


def check_video(data: bytes, max_pixels: int, max_seconds: float) -> VideoInfo:
    """A clip fit to keep, and its metadata: `probe`, at least MIN_VIDEO_FRAMES frames, a decoder
    for its codec, its first frame decoding, and the pixel and duration limits; BadSample with the
    reason otherwise."""
    import av

    info = probe(data)
    if info.frames < MIN_VIDEO_FRAMES:
        raise BadSample("too_few_video_frames", f"{info.frames} frames, a frame group takes {MIN_VIDEO_FRAMES}")
    try:
        av.codec.Codec(info.codec, "r")
    except Exception as e:
        raise BadSample("unsupported_codec", f"no decoder for {info.codec!r} in this FFmpeg") from e
    if info.width * info.height > max_pixels:
        raise BadSample("video_too_large", f"{info.width}x{info.height} > {max_pixels} pixels a frame")
    if info.duration_s > max_seconds:
        raise BadSample("video_too_long", f"{info.duration_s:.1f} s > {max_seconds} s")
    decode_frames(data, [0])
    return info


@dataclass(frozen=True)
class VideoPlan:
    """What the processor makes of a clip, from its metadata alone."""

    indices: list  # the sampled frames
    size: tuple  # (height, width) of the resized frames
    grid: tuple  # (t, h, w) in patches: t frame groups
    timestamps: list  # seconds of each frame group

    @property
    def patches(self) -> int:
        return self.grid[0] * self.grid[1] * self.grid[2]


DEFAULT_FPS = 24  # what the processor assumes of frames given without a rate (it warns)


def plan_video(meta: dict, s: VideoSettings) -> VideoPlan:
    """The processor's frames, size, grid and timestamps for a clip whose metadata (frames, fps,
    width, height: `vlmcore prepare` keeps them with the sample) is `meta`."""
    fps = meta.get("fps") or DEFAULT_FPS
    indices = sample_frames(meta["frames"], fps, s)
    height, width = frame_size(len(indices), meta["height"], meta["width"], s)
    t = -(-len(indices) // s.temporal_patch_size)
    grid = (t, height // s.patch_size, width // s.patch_size)
    return VideoPlan(indices, (height, width), grid, frame_timestamps(indices, fps, s.temporal_patch_size))


def sample_frames(total_frames: int, video_fps: float, s: VideoSettings) -> list[int]:
    """The frame indices the processor samples: `fps` a second, at least `min_frames` and at most
    `max_frames` (and the clip's frames), spread evenly from the first frame to the last."""
    count = int(total_frames / video_fps * s.fps)
    count = min(max(count, s.min_frames), s.max_frames, total_frames)
    return np.linspace(0, total_frames - 1, count).round().astype(int).tolist()


def frame_size(num_frames: int, height: int, width: int, s: VideoSettings) -> tuple[int, int]:
    """(height, width) of the resized frames: multiples of patch x merge, the aspect ratio kept,
    the pixels of all frames together between min_pixels and max_pixels."""
    factor = s.patch_size * s.merge_size
    temporal = s.temporal_patch_size
    if num_frames < temporal:
        raise ValueError(f"{num_frames} frames: a clip needs at least temporal_patch_size ({temporal})")
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"aspect ratio {max(height, width) / min(height, width):.0f} over 200")
    h, w = round(height / factor) * factor, round(width / factor) * factor
    t = round(num_frames / temporal) * temporal
    if t * h * w > s.max_pixels:
        beta = math.sqrt(num_frames * height * width / s.max_pixels)
        h, w = (
            max(factor, math.floor(height / beta / factor) * factor),
            max(factor, math.floor(width / beta / factor) * factor),
        )
    elif t * h * w < s.min_pixels:
        beta = math.sqrt(s.min_pixels / (num_frames * height * width))
        h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h, w


def frame_timestamps(indices: list[int], video_fps: float, temporal_patch_size: int = 2) -> list[float]:
    """Seconds of each frame group: the mean of its first and last frame's time (the last frame
    repeated to fill the final group)."""
    indices = list(indices) + [indices[-1]] * (-len(indices) % temporal_patch_size)
    times = [i / video_fps for i in indices]
    return [(times[i] + times[i + temporal_patch_size - 1]) / 2 for i in range(0, len(times), temporal_patch_size)]


def video_prompt(grid_thw: tuple[int, int, int], timestamps: list[float], merge_size: int, tokens: dict) -> str:
    """What the processor writes for one video: per frame group `<t.t seconds>`, vision start,
    the group's video tokens, vision end. `tokens`: the strings of video, vision_start, vision_end."""
    t, h, w = grid_thw
    group = tokens["video"] * (h * w // merge_size**2)
    return "".join(
        f"<{timestamps[i]:.1f} seconds>{tokens['vision_start']}{group}{tokens['vision_end']}" for i in range(t)
    )


def decode_frames(data: bytes, indices: list[int]) -> torch.Tensor:
    """The frames at `indices` (in decode order, counting every decoded frame), RGB uint8 (T, 3, H, W)."""
    import av

    wanted = set(indices)
    frames = {}
    try:
        with av.open(io.BytesIO(data)) as container:
            for n, frame in enumerate(container.decode(video=0)):
                if n in wanted:
                    frames[n] = frame.to_ndarray(format="rgb24")
                if n >= indices[-1]:
                    break
    except Exception as e:
        raise BadSample("unreadable_video", f"{type(e).__name__}: {e}") from e
    if len(frames) < len(wanted):
        raise BadSample("truncated_video", f"{len(frames)} of the {len(wanted)} sampled frames decode")
    return torch.from_numpy(np.stack([frames[i] for i in indices])).permute(0, 3, 1, 2).contiguous()


def resize_frames(frames: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """uint8 (T, 3, H, W) -> (T, 3, height, width), as torchvision's resize does on the CPU (which
    the processor calls): torch's native uint8 bicubic with antialiasing."""
    if frames.shape[-2:] == (height, width):
        return frames
    return F.interpolate(frames, size=(height, width), mode="bicubic", align_corners=False, antialias=True)


def video_patches(frames: torch.Tensor, s: VideoSettings) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """Resized uint8 frames (T, 3, H, W) -> uint8 patches (t * h * w, 3 * temporal * patch**2) in
    the processor's order (frame groups, merge windows, patches; channel, time, row, column in
    a patch) and the grid (t, h, w); the last frame repeats to fill the last group."""
    if pad := -frames.shape[0] % s.temporal_patch_size:
        frames = torch.cat([frames, frames[-1:].expand(pad, -1, -1, -1)])
    n, c, height, width = frames.shape
    p, m, tp = s.patch_size, s.merge_size, s.temporal_patch_size
    t, h, w = n // tp, height // p, width // p
    x = frames.view(t, tp, c, h // m, m, p, w // m, m, p).permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return x.reshape(t * h * w, c * tp * p * p), (t, h, w)


def normalize_video_patches(
    patches: torch.Tensor, image_mean: Sequence[float], image_std: Sequence[float]
) -> torch.Tensor:
    """uint8 patches -> the processor's float32 pixel_values_videos (rescale and normalize fused:
    (x - 255 mean) / (255 std), per channel)."""
    mean = torch.tensor(image_mean, device=patches.device) * (1.0 / (1 / 255))
    std = torch.tensor(image_std, device=patches.device) * (1.0 / (1 / 255))
    per_value = patches.shape[-1] // len(image_mean)
    x = patches.to(torch.float32).view(patches.shape[0], len(image_mean), per_value)
    return x.sub(mean[:, None]).div(std[:, None]).view(patches.shape)


def clip_frames(meta: dict, parts: list[bytes], indices: list[int]) -> torch.Tensor:
    """The frames at `indices` of a clip stored as a file (`parts`: its bytes) or as frame images
    (`parts`: one image a frame), RGB uint8 (T, 3, H, W)."""
    if meta["kind"] == "file":
        return decode_frames(parts[0], indices)
    frames = [np.asarray(load_image(parts[i]).convert("RGB")) for i in indices]
    return torch.from_numpy(np.stack(frames)).permute(0, 3, 1, 2).contiguous()


def clip_patches(meta: dict, parts: list[bytes], plan: VideoPlan, s: VideoSettings) -> tuple[torch.Tensor, tuple]:
    """The uint8 patches and grid of a clip as `plan` samples and sizes it."""
    return video_patches(resize_frames(clip_frames(meta, parts, plan.indices), *plan.size), s)


def encode_clip(
    frames: Sequence[np.ndarray],
    rate: int | Fraction,
    codec: str = "libx264",
    container: str = "mp4",
    pix_fmt: str = "yuv420p",
    rotation: int | None = None,
) -> bytes:
    """RGB uint8 frames (each H x W x 3) encoded as a video file at `rate` frames a second. FFmpeg's
    own encoders (mpeg4, mjpeg) give the same bytes for the same frames; libx264 does not always."""
    import av

    buf = io.BytesIO()
    with av.open(buf, "w", format=container) as out:
        stream = out.add_stream(codec, rate=rate)
        stream.height, stream.width = frames[0].shape[:2]
        stream.pix_fmt = pix_fmt
        if rotation is not None:
            stream.set_display_rotation(rotation)
        for frame in frames:
            out.mux(stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(frame), format="rgb24")))
        out.mux(stream.encode())
    return buf.getvalue()


def encode_video(data: bytes, s: VideoSettings) -> tuple[torch.Tensor, tuple[int, int, int], list[float], VideoInfo]:
    """One clip file, end to end: (uint8 patches, grid, frame group timestamps, metadata)."""
    info = probe(data)
    meta = {"kind": "file", **info.as_dict()}
    plan = plan_video(meta, s)
    patches, grid = clip_patches(meta, [data], plan, s)
    return patches, grid, plan.timestamps, info
