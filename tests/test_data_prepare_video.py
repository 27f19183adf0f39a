"""`vlmcore prepare` with videos (issue 29, item 1): video rows of every source shape kept with
their files as they were and the clip's metadata, bad videos counted by reason with the good
data kept, and `vlmcore pack` never treating a video sample as text."""

import base64
import io
import json
import shutil

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from _data_helpers import audio_only_clip, make_clip, make_demo_model_dir, write_jsonl
from vlmcore.data.pack import pack
from vlmcore.data.prepare import prepare
from vlmcore.data.shards import iter_shard_samples, shard_paths
from vlmcore.data.video import probe


def png(seed: int, w: int = 32, h: int = 24) -> bytes:
    out = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)).save(out, format="PNG")
    return out.getvalue()


@pytest.fixture(scope="module")
def raw(tmp_path_factory):
    root = tmp_path_factory.mktemp("video_sources")
    clips = {"a.mp4": make_clip("libx264", "mp4", frames=30, rate=30, width=64, height=48),
             "b.webm": make_clip("libvpx-vp9", "webm", frames=10, rate=25, width=48, height=32),
             "c.avi": make_clip("mjpeg", "avi", frames=6, rate=15, width=33, height=21, pix_fmt="yuvj444p")}
    (root / "clips").mkdir()
    for name, data in clips.items():
        (root / "clips" / name).write_bytes(data)
    for i in range(4):
        (root / f"f{i}.png").write_bytes(png(i))
    (root / "x.png").write_bytes(png(9))
    return root, clips


def read_back(dataset_dir) -> list[tuple[dict, dict]]:
    return [(json.loads(s.data["json"]), s.data) for shard in shard_paths(dataset_dir) for s in iter_shard_samples(shard)]


def convo(user: str, answer: str = "A square moves right.") -> list[dict]:
    return [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]


def test_video_rows_of_every_source_shape(raw, tmp_path):
    root, clips = raw
    jsonl = write_jsonl(root / "rows.jsonl", [
        # LLaVA-Video-178K: one clip, ShareGPT turns
        {"video": "clips/a.mp4", "conversations": [{"from": "human", "value": "<video>\nWhat moves?"},
                                                    {"from": "gpt", "value": "A square."}]},
        # several videos and an image in one sample
        {"videos": ["clips/b.webm", "clips/c.avi"], "image": "x.png",
         "messages": convo("<video><video><image> Compare the clips with the picture.")},
        # no tags: prepended, as for images (LLaVA's convention), and counted as a repair
        {"video": "clips/a.mp4", "messages": convo("Describe the clip.")},
        # a clip shipped as frames, with its rate
        {"video": ["f0.png", "f1.png", "f2.png", "f3.png"], "video_fps": 2, "caption": "Four frames."},
        # embedded as base64, a caption row
        {"video": {"bytes": base64.b64encode(clips["c.avi"]).decode()}, "caption": "A clip."},
    ])
    json_list = root / "rows.json"
    json_list.write_text(json.dumps([{"videos": ["clips/b.webm"], "messages": convo("<video> What is it?")}]))
    parquet = root / "rows.parquet"
    pq.write_table(pa.Table.from_pylist([{"video": {"bytes": clips["a.mp4"], "path": "a.mp4"},
                                          "messages": convo("<video> Watch.")}]), parquet)
    sources = [jsonl, json_list, parquet]
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_list([{"video": {"bytes": clips["b.webm"], "path": "b.webm"},
                                 "caption": "From a save_to_disk directory."}]).save_to_disk(str(root / "hf"))
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
    assert frames == {"kind": "frames", "frames": 4, "fps": 2, "width": 32, "height": 24,
                      "parts": [f"vid0_{j:05d}.png" for j in range(4)]}
    assert [samples[3][1][p] for p in frames["parts"]] == [(root / f"f{j}.png").read_bytes() for j in range(4)]


def test_bad_videos_are_counted_by_reason_and_the_good_rows_kept(raw, tmp_path):
    root, clips = raw
    avi = make_clip("mjpeg", "avi", frames=30, rate=30, width=64, height=48, pix_fmt="yuvj444p")
    webm = make_clip("libvpx-vp9", "webm", frames=30, rate=30, width=64, height=48)
    bad_files = {"garbage.mp4": b"not a video" * 50, "cut.avi": avi[: len(avi) * 6 // 10],
                 "cut.webm": webm[: len(webm) * 6 // 10], "sound.wav": audio_only_clip(),
                 "long.mp4": make_clip("libx264", "mp4", frames=90, rate=30, width=64, height=48),
                 "big.mp4": make_clip("libx264", "mp4", frames=4, rate=30, width=128, height=96)}
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
        {"video": "clips/a.mp4", "messages": convo("<video> and <video>?")},
        {"messages": convo("<video> with no video")},
        {"video": ["f0.png", "wide.png"], "caption": "frames of two sizes"},
        {"video": ["f0.png", "gone.png"], "caption": "a frame missing"},
        {"video": "clips/a.mp4", "text": "a text document cannot carry a video"},
    ]
    stats = prepare([write_jsonl(root / "bad.jsonl", rows)], tmp_path / "data", max_bad_fraction=0.6,
                    max_video_seconds=2, max_image_pixels=10_000)
    assert stats["samples"] == 12
    assert stats["bad"]["skipped_by_reason"] == {
        "missing_video": 1, "unreadable_video": 1, "truncated_video": 2, "no_video_stream": 1,
        "video_too_long": 1, "video_too_large": 1, "video_tag_mismatch": 3, "bad_video_frame": 2}


def test_pack_never_measures_a_video_sample_as_text(raw, tmp_path):
    """Until the pack measures clips (issue 29 item 3) a video sample is counted, by model: a
    model without video support names that."""
    root, _ = raw
    rows = [{"text": f"a document number {i} about shapes"} for i in range(6)] + [
        {"video": "clips/a.mp4", "messages": convo("<video> What moves?")}]
    prepare([write_jsonl(root / "mixed.jsonl", rows)], tmp_path / "data", max_bad_fraction=0.0)
    vl = make_demo_model_dir(tmp_path / "vl")
    text = shutil.copytree(vl, tmp_path / "text")
    for name in ("preprocessor_config.json", "video_preprocessor_config.json"):  # a text-only snapshot
        (text / name).unlink(missing_ok=True)
    for name, model, reason in [("vl", vl, "video_not_supported"), ("text", text, "video_for_text_model")]:
        stats = pack(tmp_path / "data", model, tmp_path / f"packed_{name}", seq_len=128, max_patches=256,
                     max_bad_fraction=0.2)
        assert stats["bad"]["skipped_by_reason"] == {reason: 1}, name
