"""`vlmcore prepare`: every source kind, and every kind of bad input counted by reason."""

import base64
import io
import json
import struct
import tarfile
import zlib

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import write_jsonl
from PIL import Image

from vlmcore.data.prepare.dataset import prepare
from vlmcore.data.quality import TooMuchBadData
from vlmcore.data.shards import iter_shard_samples, shard_paths


def png_bytes(image: Image.Image, fmt: str = "PNG") -> bytes:
    out = io.BytesIO()
    image.save(out, format=fmt)
    return out.getvalue()


def png_claiming_size(width: int, height: int) -> bytes:
    """A small PNG whose header claims another size (a decompression bomb, as far as PIL can tell)."""
    data = bytearray(png_bytes(Image.new("RGB", (8, 8))))
    ihdr = 8  # after the signature: length(4) type(4) width(4) height(4) ...
    data[ihdr + 8 : ihdr + 16] = struct.pack(">II", width, height)
    data[ihdr + 21 : ihdr + 25] = struct.pack(">I", zlib.crc32(bytes(data[ihdr + 4 : ihdr + 21])))
    return bytes(data)


def rgb(w=40, h=30, seed=0) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


def read_back(dataset_dir) -> list[dict]:
    samples = []
    for shard in shard_paths(dataset_dir):
        for s in iter_shard_samples(shard):
            sample = json.loads(s.data["json"])
            sample["_images"] = [Image.open(io.BytesIO(s.data[name])) for name in sample["images"]]
            samples.append(sample)
    return samples


def test_all_source_kinds(tmp_path):
    raw = tmp_path / "raw"
    (raw / "images").mkdir(parents=True)
    for i in range(3):
        rgb(seed=i).save(raw / "images" / f"{i}.png")
    captions = write_jsonl(raw / "captions.jsonl", [{"image": "images/0.png", "caption": "a caption"}])
    # LLaVA JSON list: human/gpt turns, two images (one file, one embedded as base64), multi-turn.
    llava = raw / "llava.json"
    llava.write_text(
        json.dumps(
            [
                {
                    "id": "x",
                    "images": ["images/1.png", {"bytes": base64.b64encode(png_bytes(rgb(seed=7))).decode()}],
                    "conversations": [
                        {"from": "human", "value": "<image>\n<image>\nCompare."},
                        {"from": "gpt", "value": "Both are noise."},
                        {"from": "human", "value": "Sure?"},
                        {"from": "gpt", "value": "Yes."},
                    ],
                }
            ]
        )
    )
    # FineVision-style parquet: embedded image structs and user/assistant text pairs.
    finevision = raw / "finevision.parquet"
    pq.write_table(
        pa.table(
            {
                "images": [[{"bytes": png_bytes(rgb(seed=8)), "path": None}]],
                "texts": [[{"user": "What is this?", "assistant": "Noise."}]],
            }
        ),
        finevision,
    )
    text_parquet = raw / "text.parquet"
    pq.write_table(pa.table({"text": ["first document", "second document"]}), text_parquet)
    text_jsonl = write_jsonl(raw / "text.jsonl", [{"text": "third document"}])
    # datasets.save_to_disk with an Image feature.
    import datasets

    hf_dir = raw / "hf"
    datasets.Dataset.from_dict(
        {"image": [str(raw / "images" / "2.png")], "caption": ["from datasets"]},
        features=datasets.Features({"image": datasets.Image(), "caption": datasets.Value("string")}),
    ).save_to_disk(str(hf_dir))

    out = tmp_path / "data"
    stats = prepare(
        [f"captions:{captions}", f"conversations:{llava}", finevision, text_parquet, text_jsonl, hf_dir],
        out,
        shard_size=3,
    )
    assert stats["samples"] == 7 and stats["shards"] == 3
    assert stats["samples_by_kind"] == {"conversation": 4, "text": 3}
    assert stats["images"] == 5
    assert stats["bad"]["skipped"] == 0
    assert (out / ".nv-meta" / ".info.json").is_file() and (out / "stats.json").is_file()

    samples = read_back(out)
    assert samples[0]["messages"] == [
        {"role": "user", "content": "<image>"},
        {"role": "assistant", "content": "a caption"},
    ]
    assert [m["role"] for m in samples[1]["messages"]] == ["user", "assistant", "user", "assistant"]
    assert len(samples[1]["_images"]) == 2
    assert np.array_equal(np.asarray(samples[1]["_images"][1]), np.asarray(rgb(seed=7)))
    assert samples[2]["messages"][0]["content"] == "<image>\nWhat is this?"  # tag added (no tags in FineVision)
    assert [s.get("text") for s in samples[3:6]] == ["first document", "second document", "third document"]
    assert samples[6]["messages"][1]["content"] == "from datasets"
    assert np.array_equal(np.asarray(samples[6]["_images"][0]), np.asarray(rgb(seed=2)))


@pytest.fixture
def bad_source(tmp_path):
    """One good sample and one sample per kind of bad input."""
    raw = tmp_path / "raw"
    img = raw / "img"
    img.mkdir(parents=True)
    rgb().save(img / "good.png")
    good_png = png_bytes(rgb(64, 64))
    (img / "truncated.png").write_bytes(good_png[: len(good_png) // 2])
    (img / "corrupt.jpg").write_bytes(b"\xff\xd8\xff\xe0 not really a jpeg" * 10)
    (img / "empty.png").write_bytes(b"")
    Image.new("CMYK", (40, 30), (0, 255, 255, 0)).save(img / "cmyk.jpg")
    Image.fromarray(np.full((30, 40), 40000, dtype=np.uint16)).save(img / "sixteen.png")
    Image.new("RGBA", (40, 30), (255, 0, 0, 0)).save(img / "alpha.png")
    Image.new("P", (40, 30), 3).save(img / "palette.png")
    Image.new("RGB", (1, 1)).save(img / "tiny.png")
    Image.new("RGB", (300, 300)).save(img / "huge.png")
    (img / "bomb.png").write_bytes(png_claiming_size(100_000, 100_000))
    (raw / "secret.png").write_bytes(png_bytes(rgb()))

    def conv(image, question="What is it?"):
        return {
            "image": image,
            "conversations": [{"from": "human", "value": f"<image>\n{question}"}, {"from": "gpt", "value": "red"}],
        }

    rows = [
        conv("img/good.png"),
        conv("img/truncated.png"),
        conv("img/corrupt.jpg"),
        conv("img/empty.png"),
        conv("img/missing.png"),
        conv("img/cmyk.jpg"),
        conv("img/sixteen.png"),
        conv("img/alpha.png"),
        conv("img/palette.png"),
        conv("img/tiny.png"),
        conv("img/huge.png"),
        conv("img/bomb.png"),
        conv("../secret.png"),
        {"image": "img/good.png", "conversations": []},
        {
            "image": "img/good.png",
            "conversations": [{"from": "alien", "value": "<image>"}, {"from": "gpt", "value": "x"}],
        },
        conv("img/good.png", "<image> two tags, one image"),
        {"text": "smuggled <|image_pad|> token"},
    ]
    path = raw / "bad.jsonl"
    with open(path, "wb") as f:
        for row in rows:
            f.write(json.dumps(row).encode() + b"\n")
        f.write(b'{"text": "caf\xe9 in latin-1"}\n')
        f.write(b'{"text": "unterminated\n')
    return path


EXPECTED_SKIPS = {
    "corrupt_image": 2,
    "empty_image_file": 1,
    "missing_image": 1,
    "image_too_small": 1,
    "image_too_large": 2,
    "unsafe_path": 1,
    "empty_conversation": 1,
    "malformed_conversation": 1,
    "image_tag_mismatch": 1,
    "special_token_in_text": 1,
    "non_utf8_text": 1,
    "malformed_json": 1,
}
EXPECTED_REPAIRS = {"cmyk_to_rgb": 1, "16bit_to_8bit": 1, "alpha_on_white": 1, "palette_to_rgb": 1}


def test_bad_input_is_skipped_or_repaired_and_counted(bad_source, tmp_path):
    out = tmp_path / "data"
    stats = prepare([bad_source], out, max_bad_fraction=1.0, max_image_pixels=200 * 200)
    assert stats["bad"]["skipped_by_reason"] == EXPECTED_SKIPS
    assert stats["bad"]["repaired_by_reason"] == EXPECTED_REPAIRS
    assert stats["bad"]["seen"] == 19 and stats["samples"] == 5
    samples = read_back(out)
    for sample in samples:
        assert all(im.mode == "RGB" for im in sample["_images"])
    sixteen, alpha = samples[2]["_images"][0], samples[3]["_images"][0]
    assert sixteen.getpixel((0, 0)) == (156, 156, 156)  # 40000/65535 scaled to 8 bits, not clipped to 255
    assert alpha.getpixel((0, 0)) == (255, 255, 255)  # fully transparent -> white background


def test_max_bad_fraction_fails_with_report(bad_source, tmp_path):
    from vlmcore.cli import main

    out = tmp_path / "data"
    with pytest.raises(TooMuchBadData, match="14 of 19 samples were bad"):
        prepare([bad_source], out, max_bad_fraction=0.5, max_image_pixels=200 * 200)
    stats = json.loads((out / "stats.json").read_text())  # the report is kept for inspection
    assert stats["bad"]["skipped"] == 14
    assert not (out / ".nv-meta").exists()
    assert main(["prepare", "--source", str(bad_source), "--out", str(out), "--max-bad-fraction", "0.5"]) == 1


def test_image_tar_members_leaving_the_archive_are_rejected(tmp_path):
    archive = tmp_path / "images.tar"
    with tarfile.open(archive, "w") as tar:
        for name in ("ok/a.png", "../evil.png", "/abs.png"):
            data = png_bytes(rgb())
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    rows = [
        {"image": "ok/a.png", "caption": "fine"},
        {"image": "../evil.png", "caption": "escape"},
        {"image": "abs.png", "caption": "absolute member, not reachable"},
    ]
    source = write_jsonl(tmp_path / "c.jsonl", rows)
    stats = prepare([source], tmp_path / "data", images=archive, max_bad_fraction=1.0)
    assert stats["rejected_tar_members"] == 2
    assert stats["samples"] == 1
    assert stats["bad"]["skipped_by_reason"] == {"unsafe_path": 1, "missing_image": 1}
