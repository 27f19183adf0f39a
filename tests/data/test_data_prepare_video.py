"""Videos from the source to the batch (issue 29, items 1-3): `vlmcore prepare` keeps video rows
of every source shape with their files as they were and the clip's metadata, and counts bad
videos by reason with the good data kept; `vlmcore pack` measures clips from their metadata
(fewer frames for a clip too long for a row); the loaders decode them into the batch exactly as
the processor would; a text model's pack names the video samples it cannot take."""

import base64
import io
import json
import shutil

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from helpers import audio_only_clip, make_clip, make_demo_model_dir, write_jsonl
from PIL import Image

from vlmcore.data.media.video import probe
from vlmcore.data.pack.dataset import pack
from vlmcore.data.prepare.dataset import prepare
from vlmcore.data.shards import iter_shard_samples, shard_paths


def png(seed: int, w: int = 32, h: int = 24) -> bytes:
    out = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)).save(out, format="PNG")
    return out.getvalue()


@pytest.fixture(scope="module")
def raw(tmp_path_factory):
    root = tmp_path_factory.mktemp("video_sources")
    clips = {
        "a.mp4": make_clip("libx264", "mp4", frames=30, rate=30, width=64, height=48),
        "b.webm": make_clip("libvpx-vp9", "webm", frames=10, rate=25, width=48, height=32),
        "c.avi": make_clip("mjpeg", "avi", frames=6, rate=15, width=33, height=21, pix_fmt="yuvj444p"),
    }
    (root / "clips").mkdir()
    for name, data in clips.items():
        (root / "clips" / name).write_bytes(data)
    for i in range(4):
        (root / f"f{i}.png").write_bytes(png(i))
    (root / "x.png").write_bytes(png(9))
    return root, clips


def read_back(dataset_dir) -> list[tuple[dict, dict]]:
    return [
        (json.loads(s.data["json"]), s.data) for shard in shard_paths(dataset_dir) for s in iter_shard_samples(shard)
    ]


def convo(user: str, answer: str = "A square moves right.") -> list[dict]:
    return [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]


def test_video_rows_of_every_source_shape(raw, tmp_path):
    root, clips = raw
    jsonl = write_jsonl(
        root / "rows.jsonl",
        [
            # LLaVA-Video-178K: one clip, ShareGPT turns
            {
                "video": "clips/a.mp4",
                "conversations": [
                    {"from": "human", "value": "<video>\nWhat moves?"},
                    {"from": "gpt", "value": "A square."},
                ],
            },
            # several videos and an image in one sample
            {
                "videos": ["clips/b.webm", "clips/c.avi"],
                "image": "x.png",
                "messages": convo("<video><video><image> Compare the clips with the picture."),
            },
            # no tags: prepended, as for images (LLaVA's convention), and counted as a repair
            {"video": "clips/a.mp4", "messages": convo("Describe the clip.")},
            # a clip shipped as frames, with its rate
            {"video": ["f0.png", "f1.png", "f2.png", "f3.png"], "video_fps": 2, "caption": "Four frames."},
            # embedded as base64, a caption row
            {"video": {"bytes": base64.b64encode(clips["c.avi"]).decode()}, "caption": "A clip."},
        ],
    )
    json_list = root / "rows.json"
    json_list.write_text(json.dumps([{"videos": ["clips/b.webm"], "messages": convo("<video> What is it?")}]))
    parquet = root / "rows.parquet"
    pq.write_table(
        pa.Table.from_pylist(
            [{"video": {"bytes": clips["a.mp4"], "path": "a.mp4"}, "messages": convo("<video> Watch.")}]
        ),
        parquet,
    )
    sources = [jsonl, json_list, parquet]
    import datasets  # a dependency of vlmcore (save_to_disk sources)

    datasets.Dataset.from_list(
        [{"video": {"bytes": clips["b.webm"], "path": "b.webm"}, "caption": "From a save_to_disk directory."}]
    ).save_to_disk(str(root / "hf"))
    sources.append(root / "hf")

    stats = prepare(sources, tmp_path / "data", shard_size=3, max_bad_fraction=0.0)
    assert stats["samples"] == 8 and stats["videos"] == 9 and stats["images"] == 1
    assert stats["bad"]["skipped"] == 0 and stats["bad"]["repaired_by_reason"] == {"added_video_tags": 1}
    samples = read_back(tmp_path / "data")
    files = {name: data for name, data in clips.items()}
    expected_files = [["a.mp4"], ["b.webm", "c.avi"], ["a.mp4"], [], ["c.avi"], ["b.webm"], ["a.mp4"], ["b.webm"]]
    for (sample, parts), names in zip(samples, expected_files):
        entries = [v for v in sample["videos"] if v["kind"] == "file"]
        assert [parts[v["part"]] for v in entries] == [files[n] for n in names]  # the bytes as they were
        for entry, name in zip(entries, names):
            meta = probe(files[name]).as_dict()
            assert {k: entry[k] for k in meta} == meta and entry["part"].endswith("." + name.split(".")[1])
        tags = sum(m["content"].count("<video>") for m in sample["messages"])
        assert tags == len(sample["videos"])
    assert samples[1][0]["images"] == ["img0.png"]
    assert samples[2][0]["messages"][0]["content"] == "<video>\nDescribe the clip."
    frames = samples[3][0]["videos"][0]
    assert frames == {
        "kind": "frames",
        "frames": 4,
        "fps": 2,
        "width": 32,
        "height": 24,
        "parts": [f"vid0_{j:05d}.png" for j in range(4)],
    }
    assert [samples[3][1][p] for p in frames["parts"]] == [(root / f"f{j}.png").read_bytes() for j in range(4)]


def test_bad_videos_are_counted_by_reason_and_the_good_rows_kept(raw, tmp_path):
    root, clips = raw
    avi = make_clip("mjpeg", "avi", frames=30, rate=30, width=64, height=48, pix_fmt="yuvj444p")
    webm = make_clip("libvpx-vp9", "webm", frames=30, rate=30, width=64, height=48)
    bad_files = {
        "garbage.mp4": b"not a video" * 50,
        "cut.avi": avi[: len(avi) * 6 // 10],
        "cut.webm": webm[: len(webm) * 6 // 10],
        "sound.wav": audio_only_clip(),
        "long.mp4": make_clip("libx264", "mp4", frames=90, rate=30, width=64, height=48),
        "big.mp4": make_clip("libx264", "mp4", frames=4, rate=30, width=128, height=96),
        # an MJPEG avi whose FourCC names a codec no FFmpeg knows
        "unknown.avi": avi.replace(b"MJPG", b"VLMX"),
    }
    for name, data in bad_files.items():
        (root / "clips" / name).write_bytes(data)
    (root / "wide.png").write_bytes(png(5, w=40))
    rows = [{"video": "clips/a.mp4", "caption": f"good {i}"} for i in range(12)] + [
        {"video": "clips/missing.mp4", "caption": "no such file"},
        {"video": "clips/garbage.mp4", "caption": "x"},
        {"video": "clips/cut.avi", "caption": "x"},
        {"video": "clips/cut.webm", "caption": "x"},
        {"video": "clips/sound.wav", "caption": "x"},
        {"video": "clips/long.mp4", "caption": "3 s > 2 s"},
        {"video": "clips/big.mp4", "caption": "128x96 > 10,000 pixels"},
        {"video": "clips/unknown.avi", "caption": "x"},
        {"video": "clips/a.mp4", "messages": convo("<video> and <video>?")},
        {"messages": convo("<video> with no video")},
        {"video": ["f0.png", "wide.png"], "caption": "frames of two sizes"},
        {"video": ["f0.png", "gone.png"], "caption": "a frame missing"},
        {"video": "clips/a.mp4", "text": "a text document cannot carry a video"},
    ]
    stats = prepare(
        [write_jsonl(root / "bad.jsonl", rows)],
        tmp_path / "data",
        max_bad_fraction=0.6,
        max_video_seconds=2,
        max_image_pixels=10_000,
    )
    assert stats["samples"] == 12
    assert stats["bad"]["skipped_by_reason"] == {
        "missing_video": 1,
        "unreadable_video": 1,
        "truncated_video": 2,
        "no_video_stream": 1,
        "video_too_long": 1,
        "video_too_large": 1,
        "video_tag_mismatch": 3,
        "bad_video_frame": 2,
        "unsupported_codec": 1,
    }


def test_a_clip_shorter_than_a_frame_group_is_counted_by_prepare(raw, tmp_path):
    """One frame cannot fill a frame group of the video processor (temporal_patch_size 2): the
    clip is counted as too_few_video_frames where it is probed, not kept for the pack to drop
    under another name; as a file and as frame images alike."""
    root, _ = raw
    (root / "clips" / "one.mp4").write_bytes(make_clip("mpeg4", "mp4", frames=1, rate=30, width=64, height=48))
    rows = [{"video": "clips/a.mp4", "caption": f"good {i}"} for i in range(4)] + [
        {"video": "clips/one.mp4", "caption": "a clip of one frame"},
        {"video": ["f0.png"], "video_fps": 2, "caption": "one frame image"},
    ]
    stats = prepare([write_jsonl(root / "one_frame.jsonl", rows)], tmp_path / "data", max_bad_fraction=0.5)
    assert stats["samples"] == 4
    assert stats["bad"]["skipped_by_reason"] == {"too_few_video_frames": 2}


def test_the_encoder_names_a_clip_shorter_than_a_frame_group(tmp_path):
    """A clip prepared elsewhere (or for a model with a longer frame group) meets the same reason in the pack."""
    from vlmcore.data.media.encoder import EncodingError, SampleEncoder

    encoder = SampleEncoder(make_demo_model_dir(tmp_path / "model", max_pixels=64 * 64))
    one_frame = {"kind": "file", "frames": 1, "fps": 30.0, "width": 64, "height": 48}
    with pytest.raises(EncodingError) as error:
        encoder.video_plan(one_frame)
    assert error.value.reason == "too_few_video_frames"


def video_rows(clips_dir: str) -> list[dict]:
    return [
        {"video": f"{clips_dir}/a.mp4", "messages": convo("<video> What moves?")},
        {
            "videos": [f"{clips_dir}/b.webm", f"{clips_dir}/c.avi"],
            "image": "x.png",
            "messages": convo("<video><image><video> Which is longer?"),
        },
        {"video": ["f0.png", "f1.png", "f2.png", "f3.png", "f0.png"], "video_fps": 2, "caption": "Frames."},
    ] + [{"text": f"a document number {i} about shapes"} for i in range(3)]


@pytest.fixture(scope="module")
def packed_videos(raw, tmp_path_factory):
    root, _ = raw
    out = tmp_path_factory.mktemp("packed_videos")
    prepare([write_jsonl(root / "videos.jsonl", video_rows("clips"))], out / "data", shard_size=4, max_bad_fraction=0.0)
    model = make_demo_model_dir(out / "model", max_pixels=64 * 64)
    stats = pack(out / "data", model, out / "packed", seq_len=512, max_patches=2048, shard_size=2, max_bad_fraction=0.0)
    return out, stats


def test_videos_are_packed_and_loaded_as_the_processor_makes_them(raw, packed_videos):
    """prepare -> pack -> loader: every video sample kept, and each row's tokens, video patches
    (normalised on the device), grids and positions those of the encoder, the clip pipeline
    (`plan_video`, decode, resize, patchify: each tested against transformers' video processor)
    and the model's position rule, for file clips (H.264, VP9, MJPEG) and a clip given as frames."""
    from vlmcore.data.load.loader import build_loader
    from vlmcore.data.media.encoder import SampleEncoder
    from vlmcore.data.media.video import clip_patches, normalize_video_patches
    from vlmcore.models import load_hf_config, position_ids

    root, clips = raw
    out, stats = packed_videos
    assert stats["samples"] == 6 and stats["bad"]["skipped"] == 0 and stats["fewer_video_frames"] == 0
    encoder = SampleEncoder(out / "model")
    config = load_hf_config(out / "model")
    expected = {}  # sample key -> (ids, [uint8 patches of each video], [grids])
    for (sample, parts), key in zip(read_back(out / "data"), [f"{i:09d}" for i in range(6)]):
        videos = sample.get("videos", [])
        images = [Image.open(io.BytesIO(parts[name])).size for name in sample["images"]]
        enc = encoder.encode_text(sample, images, videos)
        patches = [
            clip_patches(
                v,
                [parts[n] for n in ([v["part"]] if v["kind"] == "file" else v["parts"])],
                encoder.video_plan(v),
                encoder.video,
            )
            for v in videos
        ]
        expected[key] = (enc.input_ids, patches)
    loader = build_loader(out / "packed", dp_rank=0, dp_world=1, micro_batch_size=1, seed=0, num_workers=0)
    seen = set()
    for batch in [
        next(it) for it in [iter(loader)] for _ in range(len(list((out / "packed").glob("shard-*.tar"))) * 2)
    ]:
        ids, video_patches, video_grids = batch.input_ids[0].tolist(), [], []
        position = 0
        for length in batch.segment_lengths().tolist():
            segment = ids[position : position + length]
            key = next((k for k, (e, _) in expected.items() if e == segment), None)
            if key is not None:
                seen.add(key)
                video_patches += [p for p, _ in expected[key][1]]
                video_grids += [list(g) for _, g in expected[key][1]]
            position += length
        if not video_grids:
            assert batch.videos is None
            continue
        assert batch.videos.grids() == video_grids
        assert torch.equal(batch.videos.pixel_values, torch.cat(video_patches))
        on_device = batch.to(torch.device("cpu")).videos.pixel_values
        assert torch.equal(
            on_device,
            normalize_video_patches(torch.cat(video_patches), encoder.video.image_mean, encoder.video.image_std),
        )
        assert torch.equal(
            batch.position_ids,
            position_ids(
                config,
                batch.input_ids,
                batch.images.grid_thw if batch.images else None,
                batch.cu_seqlens,
                batch.videos.grid_thw,
            ),
        )
    assert seen == set(expected)
    longest = max(g[0] for _, patches in expected.values() for _, g in patches)
    assert stats["videos"] == 4 and stats["video_groups"] == longest  # what `vlmcore memory` estimates with
    assert json.loads((out / "packed" / "pack_config.json").read_text())["video_groups"] == longest


def test_a_clip_too_long_for_the_row_gets_fewer_frames(raw, tmp_path):
    """Within the processor's rules: `max_frames` halved (not under `min_frames`) until the sample
    fits the row and the patch budget, counted; the loader samples the same frames."""
    from vlmcore.data.load.loader import build_loader
    from vlmcore.data.media.encoder import SampleEncoder

    root, _ = raw
    long_clip = make_clip("libx264", "mp4", frames=120, rate=30, width=64, height=48)  # 4 s: 8 frames at 2 fps
    (root / "clips" / "long4s.mp4").write_bytes(long_clip)
    prepare(
        [write_jsonl(root / "long.jsonl", [{"video": "clips/long4s.mp4", "messages": convo("<video> What?")}])],
        tmp_path / "data",
        max_bad_fraction=0.0,
    )
    model = make_demo_model_dir(tmp_path / "model", max_pixels=64 * 64)
    ((sample, _),) = read_back(tmp_path / "data")
    encoder = SampleEncoder(model)
    whole = len(encoder.encode_text(sample, [], sample["videos"]).input_ids)
    halved = len(encoder.encode_text(sample, [], sample["videos"], max_frames=4).input_ids)
    assert halved < whole
    full = pack(tmp_path / "data", model, tmp_path / "full", seq_len=whole, max_patches=4096, max_bad_fraction=0.0)
    fewer = pack(tmp_path / "data", model, tmp_path / "fewer", seq_len=halved, max_patches=4096, max_bad_fraction=0.0)
    assert full["fewer_video_frames"] == 0 and fewer["fewer_video_frames"] == 1
    assert full["truncated"] == fewer["truncated"] == 0
    grids = []
    for path in (tmp_path / "full", tmp_path / "fewer"):
        batch = next(iter(build_loader(path, dp_rank=0, dp_world=1, micro_batch_size=1, seed=0, num_workers=0)))
        grids.append(batch.videos.grids())
    assert grids[0][0][0] == 4 and grids[1][0][0] == 2  # frame groups: 8 frames sampled, then 4


def test_online_packing_reads_videos_too(raw, packed_videos):
    from vlmcore.data.load.online import build_online_loader

    out, _ = packed_videos
    loader = build_online_loader(
        out / "data",
        out / "model",
        seq_len=512,
        max_patches=2048,
        buffer_size=6,
        dp_rank=0,
        dp_world=1,
        micro_batch_size=1,
        seed=0,
        num_workers=0,
    )
    rows = [loader.row(j) for j in range(len(loader.plan(0)))]
    assert sum(row.num_samples for row in rows) == 6 and not any(row.skipped for row in rows)
    assert sum(len(row.video_grid_thw) for row in rows if row.video_grid_thw is not None) == 4


def test_a_text_model_refuses_video_samples_by_name(raw, tmp_path):
    root, _ = raw
    rows = [{"text": f"a document number {i} about shapes"} for i in range(6)] + [
        {"video": "clips/a.mp4", "messages": convo("<video> What moves?")}
    ]
    prepare([write_jsonl(root / "mixed.jsonl", rows)], tmp_path / "data", max_bad_fraction=0.0)
    text = shutil.copytree(make_demo_model_dir(tmp_path / "vl"), tmp_path / "text")
    for name in ("preprocessor_config.json", "video_preprocessor_config.json"):  # a text-only snapshot
        (text / name).unlink(missing_ok=True)
    stats = pack(tmp_path / "data", text, tmp_path / "packed", seq_len=128, max_patches=256, max_bad_fraction=0.2)
    assert stats["bad"]["skipped_by_reason"] == {"video_for_text_model": 1}


def test_vlmcore_train_steps_on_packed_videos(raw, tmp_path):
    """`vlmcore train` on a packed dataset with video samples (file clips and a clip of frames):
    the steps run, the loss is finite and the vision tower does work on the rows with videos."""
    import math

    from helpers import read_metrics, train, write_config

    from vlmcore.download import build_tiny_model

    root, _ = raw
    build_tiny_model(
        tmp_path / "model", overrides={"text_config": {"num_hidden_layers": 1}, "vision_config": {"depth": 1}}
    )
    prepare([write_jsonl(root / "train_videos.jsonl", video_rows("clips"))], tmp_path / "data", max_bad_fraction=0.0)
    pack(
        tmp_path / "data",
        tmp_path / "model",
        tmp_path / "packed",
        seq_len=512,
        max_patches=2048,
        shard_size=2,
        max_bad_fraction=0.0,
    )
    config = write_config(
        tmp_path / "train.yaml",
        tmp_path / "model",
        tmp_path / "out",
        steps=3,
        data_path=str(tmp_path / "packed"),
        data={"kind": "packed"},
    )
    train(1, config)
    metrics = read_metrics(tmp_path / "out")
    assert len(metrics) == 3 and all(math.isfinite(m["loss"]) for m in metrics)
    assert any(m["vision_tflops_per_device"] > 0 for m in metrics)


def test_video_sampling_settings_of_a_pack(raw, tmp_path):
    """`pack.video` (`vlmcore pack --video-*`): the clips sampled at the pack's settings, which
    the packed dataset's model files carry, so the loader samples the same frames."""
    from vlmcore.data.load.loader import build_loader

    root, _ = raw
    (root / "clips" / "long4s.mp4").write_bytes(make_clip("libx264", "mp4", frames=120, rate=30, width=64, height=48))
    prepare(
        [write_jsonl(root / "long.jsonl", [{"video": "clips/long4s.mp4", "messages": convo("<video> What?")}])],
        tmp_path / "data",
        max_bad_fraction=0.0,
    )
    model = make_demo_model_dir(tmp_path / "model", max_pixels=64 * 64)
    grids = {}
    for name, video in (("default", None), ("one_fps", {"fps": 1.0}), ("capped", {"max_frames": 6, "fps": 4.0})):
        pack(
            tmp_path / "data", model, tmp_path / name, seq_len=512, max_patches=4096, max_bad_fraction=0.0, video=video
        )
        batch = next(
            iter(build_loader(tmp_path / name, dp_rank=0, dp_world=1, micro_batch_size=1, seed=0, num_workers=0))
        )
        grids[name] = batch.videos.grids()[0][0]
        config = json.loads((tmp_path / name / "model" / "video_preprocessor_config.json").read_text())
        assert all(config[k] == v for k, v in (video or {}).items())
    assert grids == {"default": 4, "one_fps": 2, "capped": 3}  # frame groups of 8, 4 and 6 sampled frames
