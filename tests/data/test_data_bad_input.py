"""Bad data met after `prepare`: damaged shards are refused by name before any work, and a bad
sample inside a pack is left out alone, counted by reason, while the rest of its pack trains."""

import io
import json
import shutil
import tarfile
from collections import Counter

import numpy as np
import pytest
import webdataset
from helpers import make_demo_model_dir, write_jsonl
from PIL import Image

from vlmcore.cli import main
from vlmcore.data.load.loader import build_loader
from vlmcore.data.load.online import build_online_loader
from vlmcore.data.load.rows import PackedTaskEncoder
from vlmcore.data.media.encoder import IGNORE_INDEX, SampleEncoder
from vlmcore.data.pack.dataset import pack
from vlmcore.data.prepare.dataset import prepare
from vlmcore.data.quality import DataError
from vlmcore.data.shards import ShardWriter, energon_prepare, iter_shard_samples, shard_paths
from vlmcore.data.synthetic.image import generate

SEQ_LEN = 128


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """A prepared and a packed dataset of the synthetic conversations (4 packs per shard)."""
    root = tmp_path_factory.mktemp("bad_data")
    make_demo_model_dir(root / "model")
    generate(root / "raw", num_train=16, num_eval=2, seed=3)
    prepare([root / "raw" / "conversations.jsonl"], root / "data", shard_size=6)
    pack(root / "data", root / "model", root / "packed", seq_len=SEQ_LEN, max_patches=256, shard_size=4)
    return root


def damaged_copy(src, dst, how: str, shard: str = "shard-000001.tar"):
    """A copy of a dataset with one shard cut in half, emptied or deleted."""
    shutil.copytree(src, dst)
    shard = dst / shard
    if how == "truncated":
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    elif how == "empty":
        shard.write_bytes(b"")
    else:
        shard.unlink()
    return shard


def first_pack(demo, min_segments: int = 2):
    """(crude sample as Energon hands it to the cooker, its segments) of a real pack."""
    for shard in shard_paths(demo / "packed"):
        for s in iter_shard_samples(shard):
            segments = json.loads(s.data["json"])["segments"]
            if len(segments) >= min_segments and all(seg["images"] for seg in segments):
                return {"__key__": s.key, "__restore_key__": (), **s.data}, segments
    raise AssertionError("no pack with enough segments")


def cut_after_header(png: bytes) -> bytes:
    """The PNG with its header intact and its pixel data cut short: opens, does not decode."""
    return png[: max(len(png) // 2, 64)]


def test_directory_that_is_not_a_prepared_dataset_refused_by_pack(demo, tmp_path, caplog):
    (tmp_path / "raw").mkdir()
    out = tmp_path / "packed"
    assert (
        main(
            [
                "pack",
                "--data",
                str(tmp_path / "raw"),
                "--model",
                str(demo / "model"),
                "--out",
                str(out),
                "--seq-len",
                str(SEQ_LEN),
                "--max-patches",
                "256",
            ]
        )
        == 1
    )
    assert f"{tmp_path / 'raw'} is not a prepared Energon dataset" in caplog.text and not out.exists()


@pytest.mark.parametrize("how", ["truncated", "empty", "missing"])
def test_damaged_prepared_shard_refused_by_pack(demo, tmp_path, how, caplog):
    shard = damaged_copy(demo / "data", tmp_path / "data", how)
    out = tmp_path / "packed"
    args = [
        "pack",
        "--data",
        str(tmp_path / "data"),
        "--model",
        str(demo / "model"),
        "--out",
        str(out),
        "--seq-len",
        str(SEQ_LEN),
        "--max-patches",
        "256",
    ]
    assert main(args) == 1
    assert (
        str(shard) in caplog.text
        and {"truncated": "truncated (", "empty": "truncated (0 bytes", "missing": "missing"}[how] in caplog.text
    )
    assert "Traceback" not in caplog.text
    assert not out.exists()  # refused before anything was written


@pytest.mark.parametrize("how", ["truncated", "empty", "missing"])
def test_damaged_packed_shard_refused_by_loader(demo, tmp_path, how):
    shard = damaged_copy(demo / "packed", tmp_path / "packed", how)
    with pytest.raises(DataError, match=f"{shard}: {'missing' if how == 'missing' else 'truncated'}"):
        build_loader(tmp_path / "packed", dp_rank=0, dp_world=1, micro_batch_size=1, seed=0, num_workers=0)


def test_tar_damaged_inside_names_shard_and_samples_read(tmp_path):
    """Damage the index check cannot see (the shard is long enough): the read names the shard."""
    shard = tmp_path / "shard-000000.tar"
    with tarfile.open(shard, "w") as tar:
        for key in range(3):
            data = json.dumps({"text": "x" * 600}).encode()
            info = tarfile.TarInfo(f"{key:09d}.json")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    raw = bytearray(shard.read_bytes())
    raw[1024 + 512 : 1024 + 1024] = b"\xff" * 512  # the second sample's header: not a tar header
    shard.write_bytes(bytes(raw))
    read = []
    with pytest.raises(DataError, match=rf"{shard}: unreadable after 1 samples"):
        for sample in iter_shard_samples(shard):
            read.append(sample.key)
    assert read == ["000000000"]


def test_truncated_image_in_a_pack_drops_that_sample_only(demo, tmp_path, capfd):
    """Through Energon: a one-pack dataset whose second sample's image is cut after its header."""
    crude, segments = first_pack(demo, min_segments=3)
    bad = segments[1]["images"][0]
    packed = tmp_path / "packed"
    shutil.copytree(demo / "packed" / "model", packed / "model")
    shutil.copy(demo / "packed" / "pack_config.json", packed)
    with webdataset.ShardWriter(str(packed / "shard-%06d.tar"), maxcount=10, verbose=0) as writer:
        writer.write({k: (cut_after_header(v) if k == bad else v) for k, v in crude.items() if k != "__restore_key__"})
    energon_prepare(packed)

    loader = build_loader(packed, dp_rank=0, dp_world=1, micro_batch_size=1, seed=0, num_workers=0)
    batch = next(iter(loader))
    assert batch.skipped_samples == {"corrupt_image": 1}
    assert batch.num_samples == len(segments) - 1
    encoder = SampleEncoder(demo / "model")
    expected = [
        encoder.encode_text(s["sample"], [tuple(x) for x in s["image_sizes"]]) for i, s in enumerate(segments) if i != 1
    ]
    cu = batch.cu_seqlens.tolist()
    ids, labels = batch.input_ids[0].tolist(), batch.labels[0].tolist()
    for (a, b), enc in zip(zip(cu, cu[1:]), expected):
        assert ids[a:b] == enc.input_ids and labels[a:b] == enc.labels
    assert cu[-1] == SEQ_LEN and all(label == IGNORE_INDEX for label in labels[cu[len(expected)] :])
    assert batch.images.pixel_values.shape[0] == sum(t * h * w for e in expected for t, h, w in e.image_grid_thw)
    captured = capfd.readouterr()
    assert "Traceback" not in captured.out + captured.err


def junk_all_images(crude, segments):
    for s in segments:
        crude[s["images"][0]] = b"not an image"


BAD_SEGMENTS = {
    # case: (edit of (crude, segments), skipped by reason, samples left in the row)
    "undecodable_image": (lambda c, s: c.update({s[1]["images"][0]: b"\x89PNG junk"}), {"corrupt_image": 1}, -1),
    "image_cut_after_header": (
        lambda c, s: c.update({s[0]["images"][0]: cut_after_header(c[s[0]["images"][0]])}),
        {"corrupt_image": 1},
        -1,
    ),
    "image_part_missing": (lambda c, s: c.pop(s[1]["images"][0]), {"missing_image": 1}, -1),
    "segment_not_an_object": (lambda c, s: s.__setitem__(1, "oops"), {"malformed_segment": 1}, -1),
    "segment_without_sample": (lambda c, s: s[0].pop("sample"), {"malformed_segment": 1}, -1),
    "image_tag_without_image": (lambda c, s: s[1].update(image_sizes=[], images=[]), {"image_tag_mismatch": 1}, -1),
    "pack_json_cut_short": (lambda c, s: c.update(json=c["json"][:40]), {"malformed_json": 1}, 0),
    "pack_json_not_utf8": (lambda c, s: c.update(json=b"\xff\xfe" + c["json"]), {"non_utf8_text": 1}, 0),
    "pack_json_without_segments": (lambda c, s: c.update(json=b'{"segment": []}'), {"malformed_json": 1}, 0),
    "every_image_bad": (junk_all_images, "all corrupt_image", 0),
}


@pytest.mark.parametrize("case", BAD_SEGMENTS)
def test_bad_segment_is_skipped_and_counted(demo, case, caplog, monkeypatch):
    from vlmcore.data.load import rows

    monkeypatch.setattr(rows, "_logged", Counter())  # the first few of each reason are logged
    edit, skipped, left = BAD_SEGMENTS[case]
    crude, segments = first_pack(demo)
    edit(crude, segments)
    if not case.startswith("pack_json"):
        crude["json"] = json.dumps({"segments": segments}).encode()
    if skipped == "all corrupt_image":
        skipped = {"corrupt_image": len(segments)}
    encoder = PackedTaskEncoder(demo / "packed" / "model", SEQ_LEN)
    row = encoder.encode_sample(encoder.cook(crude))
    assert row.skipped == skipped
    assert row.num_samples == (len(segments) - 1 if left == -1 else 0)
    assert row.input_ids.shape == (SEQ_LEN,) and sum(row.seq_lens) == SEQ_LEN
    if row.num_samples == 0:  # a row of padding: nothing to train on, the counts still reach the metrics
        assert (row.labels == IGNORE_INDEX).all() and row.pixel_values is None
    else:
        assert (row.labels != IGNORE_INDEX).any()
    assert f"({next(iter(skipped))})" in caplog.text and "Traceback" not in caplog.text


def test_online_packing_counts_bad_samples(demo, tmp_path):
    """Online packing: an image whose header does not decode fails the measure, one cut after its
    header fails in the row; each rides along in a pack and is counted there, once."""
    rows = [json.loads(line) for line in open(demo / "raw" / "conversations.jsonl")][:6]
    data = tmp_path / "data"
    writer = ShardWriter(data, shard_size=8)
    for i, row in enumerate(rows):
        pngs = [(demo / "raw" / name).read_bytes() for name in row["images"]]
        pngs[0] = {0: b"\x89PNG junk", 1: cut_after_header(pngs[0])}.get(i, pngs[0])
        writer.write({"messages": row["messages"]}, [(png, "png") for png in pngs])
    writer.close()
    energon_prepare(data)
    loader = build_online_loader(
        data,
        demo / "model",
        seq_len=SEQ_LEN,
        max_patches=256,
        buffer_size=6,
        dp_rank=0,
        dp_world=1,
        micro_batch_size=1,
        seed=0,
        num_workers=0,
    )
    assert sorted(i for pack in loader.plan(0) for i in pack) == list(range(6))  # the bad ones ride along
    rows = [loader.row(j) for j in range(len(loader.plan(0)))]
    assert sum(row.num_samples for row in rows) == 4
    assert sum((Counter(row.skipped) for row in rows), Counter()) == {"corrupt_image": 2}
    assert all(row.input_ids.shape == (SEQ_LEN,) and (row.labels != IGNORE_INDEX).any() for row in rows)

    # The same through the loader's batches: the counts reach them.
    batches = take_until(loader, lambda seen: seen["corrupt_image"] >= 2)
    assert all(set(b.skipped_samples) <= {"corrupt_image"} for b in batches)


def take_until(loader, done, limit: int = 20) -> list[dict]:
    seen, batches = Counter(), []
    for batch in loader:
        batches.append(batch)
        seen.update(batch.skipped_samples)
        if done(seen) or len(batches) == limit:
            return batches


# prepare: rows and image archives that are bad in ways the loader never sees.


def rgb_png(seed: int) -> bytes:
    out = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (24, 32, 3), dtype=np.uint8)).save(out, format="PNG")
    return out.getvalue()


def images_tar(path, count: int) -> bytes:
    with tarfile.open(path, "w") as tar:
        for i in range(count):
            data = rgb_png(i)
            info = tarfile.TarInfo(f"{i}.png")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path.read_bytes()


def test_caption_row_without_image_is_counted_missing_image(tmp_path):
    """A caption describes an image: without one it would teach describing what is not there, so
    it is bad (missing_image), not a text-only sample (those are {"text": ...} rows)."""
    (tmp_path / "a.png").write_bytes(rgb_png(0))
    source = write_jsonl(
        tmp_path / "c.jsonl",
        [
            {"image": "a.png", "caption": "noise"},
            {"caption": "no image here"},
            {"image": None, "caption": "a null image"},
        ],
    )
    stats = prepare([source], tmp_path / "data", max_bad_fraction=1.0)
    assert stats["samples"] == 1 and stats["bad"]["skipped_by_reason"] == {"missing_image": 2}


def test_video_rows_are_never_kept_as_text(tmp_path):
    """A row with a video (a field or a `<video>` tag) is not a text sample with its video dropped:
    a video that is not there is counted (missing_video), a tag without its video too
    (video_tag_mismatch); the other rows are kept (tests/data/test_data_prepare_video.py: good videos)."""
    (tmp_path / "a.png").write_bytes(rgb_png(0))
    rows = [{"image": "a.png", "caption": f"image {i}"} for i in range(20)] + [
        {
            "video": "clip.mp4",
            "conversations": [
                {"from": "human", "value": "<video>\nWhat happens?"},
                {"from": "gpt", "value": "A ball rolls."},
            ],
        },
        {
            "videos": ["x.mp4"],
            "messages": [{"role": "user", "content": "Describe."}, {"role": "assistant", "content": "Nothing."}],
        },
        {"messages": [{"role": "user", "content": "<video> and text"}, {"role": "assistant", "content": "ok"}]},
        {"video": None, "text": "a document that merely has a null video field"},
    ]
    stats = prepare([write_jsonl(tmp_path / "c.jsonl", rows)], tmp_path / "data", max_bad_fraction=0.2)
    assert stats["samples"] == 21
    assert stats["bad"]["skipped_by_reason"] == {"missing_video": 2, "video_tag_mismatch": 1}


@pytest.mark.parametrize("cut", ["inside_a_member", "empty_archive"])
def test_images_tar_cut_short_counts_lost_images(tmp_path, cut):
    full = images_tar(tmp_path / "full.tar", 4)
    archive = tmp_path / "images.tar"
    archive.write_bytes(full[: 512 + 3 * 1024 - 300] if cut == "inside_a_member" else b"")
    rows = [{"image": f"{i}.png", "caption": f"image {i}"} for i in range(4)] + [{"text": "a document"}]
    stats = prepare([write_jsonl(tmp_path / "c.jsonl", rows)], tmp_path / "data", images=archive, max_bad_fraction=1.0)
    kept = stats["samples"] - 1
    assert stats["bad"]["skipped_by_reason"] == {"missing_image": 4 - kept}
    assert 1 <= kept < 4 if cut == "inside_a_member" else kept == 0


@pytest.mark.parametrize("source", ["truncated.parquet", "not_a_list.json", "missing.jsonl"])
def test_unreadable_source_refused_by_name(tmp_path, source, caplog):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / source
    if source.endswith(".parquet"):
        pq.write_table(pa.table({"text": ["a document"] * 50}), path)
        path.write_bytes(path.read_bytes()[:-100])
    elif source.endswith(".json"):
        path.write_text('{"text": "one row, not a list"}')
    out = tmp_path / "data"
    if source.startswith("missing"):  # the CLI refuses it as an argument; the function before writing
        with pytest.raises(DataError, match=f"sources not found: {path}"):
            prepare([path], out)
    else:
        assert main(["prepare", "--source", str(path), "--out", str(out)]) == 1
        assert str(path) in caplog.text and "Traceback" not in caplog.text
    assert not (out / ".nv-meta").exists() and not (out / "stats.json").exists()


@pytest.mark.slow
def test_training_on_a_pack_with_a_bad_image_logs_the_count(tmp_path):
    """`vlmcore train` on a packed dataset whose packs each hold one image cut after its header:
    every step trains on the other samples and metrics.jsonl counts the bad ones by reason."""
    from helpers import train, write_config

    from vlmcore.download import build_tiny_model

    build_tiny_model(
        tmp_path / "model", overrides={"text_config": {"num_hidden_layers": 1}, "vision_config": {"depth": 1}}
    )
    generate(tmp_path / "raw", num_train=8, num_eval=1, seed=4)
    prepare([tmp_path / "raw" / "conversations.jsonl"], tmp_path / "data")
    pack(tmp_path / "data", tmp_path / "model", tmp_path / "good", seq_len=SEQ_LEN, max_patches=256)
    packed = tmp_path / "packed"
    shutil.copytree(tmp_path / "good" / "model", packed / "model")
    shutil.copy(tmp_path / "good" / "pack_config.json", packed)
    with webdataset.ShardWriter(str(packed / "shard-%06d.tar"), maxcount=100, verbose=0) as writer:
        for shard in shard_paths(tmp_path / "good"):
            for s in iter_shard_samples(shard):
                first_image = json.loads(s.data["json"])["segments"][0]["images"][0]
                writer.write({"__key__": s.key, **s.data, first_image: cut_after_header(s.data[first_image])})
    energon_prepare(packed)

    config = write_config(
        tmp_path / "stage.yaml",
        tmp_path / "model",
        tmp_path / "out",
        steps=2,
        data_path=str(packed),
        data={"kind": "packed"},
    )
    train(1, config)
    records = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [r["skipped_samples"] for r in records] == [1, 1]
    assert all(r["skipped_samples_by_reason"] == {"corrupt_image": 1} and r["label_tokens"] > 0 for r in records)

    # A truncated shard: refused by name when the loader is built, before any step or output.
    shard = damaged_copy(packed, tmp_path / "damaged", "truncated", "shard-000000.tar")
    config = write_config(
        tmp_path / "damaged.yaml",
        tmp_path / "model",
        tmp_path / "out2",
        steps=2,
        data_path=str(tmp_path / "damaged"),
        data={"kind": "packed"},
    )
    proc = train(1, config, check=False)
    assert proc.returncode == 1 and f"error: {shard}: truncated" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "out2").exists()


def test_a_truncated_image_is_refused_whatever_pils_switch_says(monkeypatch):
    """PIL's process-wide LOAD_TRUNCATED_IMAGES, which libraries turn on at import (lmms-eval's
    api/task.py does), must not let a file cut short through as a good image."""
    from PIL import ImageFile

    from vlmcore.data.media.image import load_image, open_image
    from vlmcore.data.quality import BadSample

    monkeypatch.setattr(ImageFile, "LOAD_TRUNCATED_IMAGES", True)
    encoded = io.BytesIO()
    Image.new("RGB", (64, 64), (200, 10, 10)).save(encoded, "PNG")
    cut = encoded.getvalue()[:-40]
    with pytest.raises(BadSample, match="corrupt_image"):
        open_image(cut, max_pixels=1 << 20)
    with pytest.raises(BadSample, match="corrupt_image"):
        load_image(cut)
    assert ImageFile.LOAD_TRUNCATED_IMAGES  # the switch is left as the caller set it
