"""Video clips as Qwen3-VL's processor takes them (vlmcore.data.media.video), on real encoded clips
made here with PyAV: H.264 in mp4 at 30, 29.97 and 23.976 fps, VP9 in webm, MJPEG in avi, odd
sizes, a clip shorter than min_frames, a rotation flag; bad clips by reason.

transformers' video processor needs torchvision, whose wheels here are CUDA builds that do not
load beside the CPU torch. So its pure-Python parts are compared here, read from transformers'
own source (frame sampling, patchify) or imported (`smart_resize`, the processor's timestamps);
the resize follows torchvision's CPU path for uint8 bicubic frames (native uint8 `interpolate`
with antialiasing, the frames returned untouched at their own size).
"""

import ast
import fractions
import importlib.util
import io
import math
import struct
import textwrap
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from helpers import audio_only_clip, make_clip

from vlmcore.data.media.video import (
    VideoSettings,
    decode_frames,
    encode_video,
    frame_size,
    frame_timestamps,
    normalize_video_patches,
    probe,
    resize_frames,
    sample_frames,
    video_patches,
    video_prompt,
)
from vlmcore.data.quality import BadSample

QWEN3_VL = "transformers.models.qwen3_vl"


def transformers_method(module: str, cls: str, name: str):
    """A method of a transformers class, compiled from transformers' own source without its
    annotations (the class itself does not import here: it needs torchvision)."""
    text = Path(importlib.util.find_spec(module).origin).read_text()
    node = next(
        f
        for c in ast.parse(text).body
        if isinstance(c, ast.ClassDef) and c.name == cls
        for f in c.body
        if isinstance(f, ast.FunctionDef) and f.name == name
    )
    for arg in node.args.args + node.args.kwonlyargs:
        arg.annotation = None
    node.returns, node.decorator_list = None, []
    namespace = {"np": np, "torch": torch, "math": math, "logger": SimpleNamespace(warning_once=lambda *a: None)}
    exec(textwrap.dedent(ast.unparse(node)), namespace)
    return namespace[name]


CLIPS = {
    "h264_mp4_30": dict(codec="libx264", fmt="mp4", frames=24, rate=30, width=96, height=64),
    "h264_mp4_29.97": dict(
        codec="libx264", fmt="mp4", frames=31, rate=fractions.Fraction(30000, 1001), width=96, height=64
    ),
    "h264_mp4_23.976": dict(
        codec="libx264", fmt="mp4", frames=25, rate=fractions.Fraction(24000, 1001), width=64, height=96
    ),
    "vp9_webm": dict(codec="libvpx-vp9", fmt="webm", frames=12, rate=25, width=80, height=48),
    "mjpeg_avi_odd_size": dict(codec="mjpeg", fmt="avi", frames=9, rate=15, width=71, height=45, pix_fmt="yuvj444p"),
    "shorter_than_min_frames": dict(codec="libx264", fmt="mp4", frames=3, rate=30, width=64, height=64),
    "rotation_flag": dict(codec="libx264", fmt="mp4", frames=8, rate=30, width=96, height=64, rotation=90),
}


@pytest.fixture(scope="module")
def clips():
    return {name: make_clip(**spec) for name, spec in CLIPS.items()}


@pytest.mark.parametrize("name", CLIPS)
def test_probe_reads_the_metadata_without_decoding(clips, name):
    spec, info = CLIPS[name], probe(clips[name])
    assert (info.frames, info.width, info.height) == (spec["frames"], spec["width"], spec["height"])
    assert info.fps == pytest.approx(float(spec["rate"]))
    assert info.duration_s == pytest.approx(spec["frames"] / float(spec["rate"]), rel=0.15)
    assert info.codec == {"libx264": "h264", "libvpx-vp9": "vp9"}.get(spec["codec"], spec["codec"])


def test_frame_sampling_is_the_processors():
    reference = transformers_method(f"{QWEN3_VL}.video_processing_qwen3_vl", "Qwen3VLVideoProcessor", "sample_frames")
    for s in (VideoSettings(), VideoSettings(fps=1.0, min_frames=2, max_frames=16)):
        stand_in = SimpleNamespace(fps=s.fps, min_frames=s.min_frames, max_frames=s.max_frames)
        for total in (1, 3, 4, 7, 31, 300, 1799, 20000):
            for fps in (30.0, 30000 / 1001, 24000 / 1001, 25.0, 7.5):
                expected = reference(stand_in, SimpleNamespace(total_num_frames=total, fps=fps)).tolist()
                assert sample_frames(total, fps, s) == expected, (total, fps)


def test_frame_size_is_the_processors():
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize

    s = VideoSettings()
    for frames in (2, 3, 4, 8, 64, 768):
        for height, width in ((45, 71), (64, 96), (720, 1280), (1080, 1920), (20, 500), (1920, 1080)):
            expected = smart_resize(
                num_frames=frames,
                height=height,
                width=width,
                factor=32,
                temporal_factor=2,
                min_pixels=s.min_pixels,
                max_pixels=s.max_pixels,
            )
            assert frame_size(frames, height, width, s) == tuple(expected), (frames, height, width)


def test_timestamps_and_prompt_are_the_processors():
    reference = transformers_method(f"{QWEN3_VL}.processing_qwen3_vl", "Qwen3VLProcessor", "_calculate_timestamps")
    for indices in ([0, 10, 20, 30], [0, 7, 15], [0, 1, 2, 3, 4, 5, 6, 7, 8]):
        for fps in (30.0, 30000 / 1001, 24000 / 1001):
            assert frame_timestamps(indices, fps) == reference(None, list(indices), fps, 2)
    tokens = {"video": "<|video_pad|>", "vision_start": "<|vision_start|>", "vision_end": "<|vision_end|>"}
    prompt = video_prompt((2, 4, 6), [0.5, 1.25], 2, tokens)
    assert prompt == (
        "<0.5 seconds><|vision_start|>" + "<|video_pad|>" * 6 + "<|vision_end|>"
        "<1.2 seconds><|vision_start|>" + "<|video_pad|>" * 6 + "<|vision_end|>"
    )


def test_patches_and_normalisation_are_the_processors():
    """uint8 patches in the processor's order; normalised, its float32 pixel_values_videos
    (rescale and normalize fused, then patchify), bit for bit; an odd frame count repeats the last."""
    patchify = transformers_method(f"{QWEN3_VL}.video_processing_qwen3_vl", "Qwen3VLVideoProcessor", "patchify")
    s = VideoSettings(image_mean=(0.48145466, 0.4578275, 0.40821073), image_std=(0.26862954, 0.26130258, 0.27577711))
    frames = torch.randint(0, 256, (5, 3, 64, 96), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    patches, grid = video_patches(frames, s)
    assert patches.dtype == torch.uint8 and grid == (3, 4, 6)
    mean = torch.tensor(s.image_mean) * (1.0 / (1 / 255))
    std = torch.tensor(s.image_std) * (1.0 / (1 / 255))
    normalized = frames.to(torch.float32).sub_(mean[:, None, None]).div_(std[:, None, None])  # torchvision's normalize
    expected, t, h, w = patchify(None, normalized[None], 16, 2, 2)
    assert (t, h, w) == grid
    assert torch.equal(normalize_video_patches(patches, s.image_mean, s.image_std), expected[0])


def test_resize_follows_torchvision_on_the_cpu(clips):
    frames = decode_frames(clips["h264_mp4_30"], [0, 5])
    assert frames.dtype == torch.uint8 and frames.shape == (2, 3, 64, 96)
    assert resize_frames(frames, 64, 96) is frames  # torchvision returns a frame of the asked size as it is
    resized = resize_frames(frames, 32, 64)
    expected = torch.nn.functional.interpolate(frames, size=(32, 64), mode="bicubic", antialias=True)
    assert resized.dtype == torch.uint8 and torch.equal(resized, expected)


@pytest.mark.parametrize("name", CLIPS)
def test_encode_video_end_to_end(clips, name):
    patches, grid, timestamps, info = encode_video(clips[name], VideoSettings())
    indices = sample_frames(info.frames, info.fps, VideoSettings())
    assert grid[0] == math.ceil(len(indices) / 2) == len(timestamps)
    assert patches.shape == (grid[0] * grid[1] * grid[2], 3 * 2 * 16 * 16)
    assert grid[1] % 2 == 0 and grid[2] % 2 == 0
    # the sampled frames are the decoded frames at those indices (the square has moved between them)
    frames = decode_frames(clips[name], indices)
    assert len(frames) == len(indices) and not torch.equal(frames[0], frames[-1])


def frame_data_zeroed(mp4: bytes) -> bytes:
    """The MP4 with its `mdat` box's payload (all frames' data) zeroed and its other boxes kept:
    an MPEG-4 Part 2 stream then reads with a frame size of 0x0 from its headers."""
    start = mp4.find(b"mdat") - 4
    size = struct.unpack(">I", mp4[start : start + 4])[0]
    return mp4[: start + 8] + bytes(size - 8) + mp4[start + size :]


def test_bad_clips_are_refused_by_reason(clips):
    reasons = {}
    for name, data in {
        "garbage": b"not a video at all" * 10,
        "cut_short": clips["h264_mp4_30"][: len(clips["h264_mp4_30"]) // 3],
    }.items():
        with pytest.raises(BadSample) as e:
            encode_video(data, VideoSettings())
        reasons[name] = e.value.reason
    with pytest.raises(BadSample) as e:
        probe(audio_only_clip())
    reasons["audio_only"] = e.value.reason
    with pytest.raises(BadSample) as e:
        encode_video(
            frame_data_zeroed(make_clip("mpeg4", "mp4", frames=8, rate=4, width=64, height=48)), VideoSettings()
        )
    reasons["frame_data_zeroed"] = e.value.reason
    assert reasons == {
        "garbage": "unreadable_video",
        "cut_short": reasons["cut_short"],
        "audio_only": "no_video_stream",
        "frame_data_zeroed": "unreadable_video",
    }
    assert reasons["cut_short"] in ("unreadable_video", "truncated_video")


# A whole sample: tokens and labels against transformers' Qwen3VLProcessor. Its video processor
# needs torchvision, which does not load beside the CPU torch here: a stand-in hands the processor
# what the video processor returns (the grid and the sampled frames' metadata), computed by
# `plan_video`, whose pieces are tested against the video processor's own code above. The text
# expansion, the template and the tokenizer are the processor's.


class VideoProcessorStandIn:
    def __init__(self, plans, fps):
        self.plans, self.fps = plans, fps
        self.merge_size, self.temporal_patch_size = 2, 2

    def __call__(self, videos, **kwargs):
        return {
            "pixel_values_videos": torch.zeros(1, 1),
            "video_grid_thw": torch.tensor([plan.grid for plan in self.plans]),
            "video_metadata": [
                SimpleNamespace(fps=fps, frames_indices=plan.indices) for plan, fps in zip(self.plans, self.fps)
            ],
        }


@pytest.fixture(scope="module")
def video_model(tmp_path_factory):
    from helpers import make_demo_model_dir

    return make_demo_model_dir(tmp_path_factory.mktemp("video_model") / "model", max_pixels=64 * 64)


@pytest.fixture(scope="module")
def encoder(video_model):
    from vlmcore.data.media.encoder import SampleEncoder

    return SampleEncoder(video_model)


SAMPLES = {
    "one video": (
        [{"role": "user", "content": "<video>\nWhat moves?"}, {"role": "assistant", "content": "A green square."}],
        ["h264_mp4_30"],
        [],
    ),
    "two videos and an image, two turns": (
        [
            {"role": "user", "content": "<video> then <image> then <video>: same square?"},
            {"role": "assistant", "content": "Yes."},
            {"role": "user", "content": "Which is faster?"},
            {"role": "assistant", "content": "The first."},
        ],
        ["h264_mp4_29.97", "mjpeg_avi_odd_size"],
        [(40, 30)],
    ),
    "frames without a rate, shorter than min_frames": (
        [{"role": "user", "content": "<video>"}, {"role": "assistant", "content": "Three frames."}],
        ["shorter_than_min_frames"],
        [],
    ),
}


@pytest.mark.parametrize("name", SAMPLES)
def test_video_sample_tokens_are_the_processors(encoder, clips, name):
    from PIL import Image

    from vlmcore.data.media.encoder import IGNORE_INDEX, to_chat_messages

    messages, clip_names, image_sizes = SAMPLES[name]
    metas = [probe(clips[c]).as_dict() for c in clip_names]
    if name.startswith("frames without a rate"):
        metas = [{**meta, "fps": None} for meta in metas]
    enc = encoder.encode_text({"messages": messages}, image_sizes, metas)
    plans = [encoder.video_plan(meta) for meta in metas]
    processor = encoder.processor
    processor.video_processor = VideoProcessorStandIn(plans, [meta["fps"] or 24 for meta in metas])
    try:
        text = processor.apply_chat_template([to_chat_messages(messages)], tokenize=False)
        images = [Image.new("RGB", size) for size in image_sizes] or None
        expected = processor(
            text=text, images=images, videos=[np.zeros((2, 8, 8, 3), np.uint8)] * len(metas), return_metadata=True
        )
    finally:
        processor.video_processor = None
    assert enc.input_ids == expected["input_ids"][0]
    assert enc.video_grid_thw == [tuple(g) for g in expected["video_grid_thw"].tolist()]
    if image_sizes:
        assert enc.image_grid_thw == [tuple(g) for g in expected["image_grid_thw"].tolist()]
    # Labels: the assistant answers and their end-of-turn tokens, nothing of the videos.
    answers = encoder.tokenizer.decode([t for t in enc.labels if t != IGNORE_INDEX])
    assert answers == "".join(m["content"] + "<|im_end|>" for m in messages if m["role"] == "assistant")
    assert len(enc.video_spans) == len(metas)
    for (start, end), plan in zip(enc.video_spans, plans):
        pads = enc.input_ids[start:end].count(encoder.tokenizer.convert_tokens_to_ids("<|video_pad|>"))
        assert pads == plan.patches // 4


def whole_video_processor(model_dir):
    """transformers' processor with its own video processor, where torchvision loads (the GPU
    machines' CUDA torch); None here, where torchvision's CUDA wheel fails beside the CPU torch."""
    try:
        import torchvision  # noqa: F401
        from transformers import AutoProcessor

        processor = AutoProcessor.from_pretrained(model_dir)
    except Exception:  # the CUDA wheel fails at import with a RuntimeError, not an ImportError
        return None
    return processor if getattr(processor, "video_processor", None) is not None else None


@pytest.mark.parametrize("name", SAMPLES)
def test_video_samples_equal_the_whole_processor_where_torchvision_loads(encoder, clips, video_model, name):
    """The real thing, where it loads: transformers' Qwen3VLProcessor with its Qwen3VLVideoProcessor,
    given each clip's decoded frames and metadata, samples, resizes and lays out the clips as
    vlmcore does: the same token ids and grids, and pixel_values_videos equal to the loader's
    patches normalized on the device. Passed on 2026-11-28 on the CPU machine with torchvision
    0.28.0's Python parts loaded by hand (its C++ ops, which the video processor does not use,
    taken out); skipped where torchvision does not load."""
    from PIL import Image

    from vlmcore.data.media.encoder import to_chat_messages
    from vlmcore.data.media.video import clip_patches, normalize_video_patches

    processor = whole_video_processor(video_model)
    if processor is None:
        pytest.skip("transformers' video processor needs torchvision, which does not load beside this CPU torch")
    messages, clip_names, image_sizes = SAMPLES[name]
    infos = [probe(clips[c]) for c in clip_names]
    metas = [info.as_dict() for info in infos]
    if name.startswith("frames without a rate"):
        metas = [{**meta, "fps": None} for meta in metas]
    frames = [decode_frames(clips[c], list(range(info.frames))) for c, info in zip(clip_names, infos)]
    metadata = [
        {
            "total_num_frames": meta["frames"],
            "fps": meta["fps"],
            "width": meta["width"],
            "height": meta["height"],
            "duration": meta["duration_s"] if meta["fps"] else None,
        }
        for meta in metas
    ]
    text = processor.apply_chat_template([to_chat_messages(messages)], tokenize=False)
    images = [Image.new("RGB", size) for size in image_sizes] or None
    out = processor(
        text=text, images=images, videos=frames, video_metadata=metadata, do_sample_frames=True, return_tensors="pt"
    )
    enc = encoder.encode_text({"messages": messages}, image_sizes, metas)
    assert out["input_ids"][0].tolist() == enc.input_ids
    assert out["video_grid_thw"].tolist() == [list(g) for g in enc.video_grid_thw]
    settings = encoder.video
    ours = torch.cat(
        [
            normalize_video_patches(
                clip_patches({"kind": "file", **meta}, [clips[c]], encoder.video_plan(meta), settings)[0],
                settings.image_mean,
                settings.image_std,
            )
            for c, meta in zip(clip_names, metas)
        ]
    )
    torch.testing.assert_close(out["pixel_values_videos"], ours, rtol=0, atol=1e-5)


def test_truncation_never_splits_a_video(encoder, clips):
    messages, clip_names, _ = SAMPLES["one video"]
    metas = [probe(clips[c]).as_dict() for c in clip_names]
    enc = encoder.encode_text({"messages": [{"role": "user", "content": "Look: <video>"}] + messages[1:]}, [], metas)
    ((start, end),) = enc.video_spans
    for max_len in (start + 1, (start + end) // 2, end - 1):
        assert encoder.truncation_point(enc.input_ids, max_len, enc.video_spans) == start
        truncated = encoder.truncate(enc, start)
        assert truncated.video_grid_thw == [] and truncated.video_spans == []
    assert encoder.truncate(enc, end).video_grid_thw == enc.video_grid_thw


def test_positions_of_an_encoded_video_sample_are_transformers(video_model, encoder, clips):
    """The processor's layout (the template's wrapper around the frame groups) gives the M-RoPE
    positions transformers' get_rope_index gives."""
    from transformers import AutoConfig, Qwen3VLForConditionalGeneration

    import vlmcore.models as models

    messages, clip_names, image_sizes = SAMPLES["two videos and an image, two turns"]
    enc = encoder.encode_text({"messages": messages}, image_sizes, [probe(clips[c]).as_dict() for c in clip_names])
    config = AutoConfig.from_pretrained(video_model)
    ids = torch.tensor([enc.input_ids])
    grid, video_grid = torch.tensor(enc.image_grid_thw), torch.tensor(enc.video_grid_thw)
    types = (ids == config.image_token_id).long() + 2 * (ids == config.video_token_id).long()
    expected, _ = Qwen3VLForConditionalGeneration(config).model.get_rope_index(ids, types, grid, video_grid)
    assert torch.equal(models.position_ids(config, ids, grid, None, video_grid), expected)


def vfr_clip() -> bytes:
    """An H.264/mp4 clip whose frames come at uneven times (a variable frame rate, as phones record)."""
    import av

    buf, times_ms = io.BytesIO(), [0, 33, 100, 117, 150, 250, 267, 300, 400, 417, 450, 533, 567, 600]
    with av.open(buf, "w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=30)
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
        stream.codec_context.time_base = fractions.Fraction(1, 1000)
        for i, t in enumerate(times_ms):
            image = np.full((48, 64, 3), 15 * i, np.uint8)
            frame = av.VideoFrame.from_ndarray(image, format="rgb24")
            frame.pts, frame.time_base = t, fractions.Fraction(1, 1000)
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buf.getvalue()


@pytest.mark.parametrize("name", [*CLIPS, "variable_frame_rate"])
def test_metadata_and_sampled_frames_are_transformers_pyav_readers(clips, name, tmp_path):
    """transformers' own PyAV video reader (`read_video_pyav`: the frame count and average rate
    the container records, frames counted in decode order) gives the metadata `probe` reads and
    the frames `decode_frames` returns, for the same sampled indices, a variable frame rate
    included. A webm records no frame count: that reader sees 0 frames and fails, `probe` counts
    the packets."""
    import av
    from transformers.video_utils import read_video_pyav

    data = vfr_clip() if name == "variable_frame_rate" else clips[name]
    if name == "vp9_webm":
        with av.open(io.BytesIO(data)) as container:
            assert container.streams.video[0].frames == 0
        assert probe(data).frames == CLIPS[name]["frames"]
        return
    (tmp_path / "clip").write_bytes(data)
    info, s = probe(data), VideoSettings(min_frames=2)
    video, metadata = read_video_pyav(
        str(tmp_path / "clip"), lambda metadata, **kw: sample_frames(metadata.total_num_frames, metadata.fps, s)
    )
    assert (metadata.total_num_frames, metadata.fps) == (info.frames, info.fps)
    assert metadata.frames_indices == sample_frames(info.frames, info.fps, s)
    assert torch.equal(torch.from_numpy(video).permute(0, 3, 1, 2), decode_frames(data, metadata.frames_indices))
