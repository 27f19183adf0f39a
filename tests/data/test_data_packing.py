"""Best-fit-decreasing packing and `vlmcore pack`: budgets, efficiency, overlong samples, bad shards."""

import argparse
import io
import json
import os
import random
import shutil
import subprocess
import sys
import tarfile
import time

import pytest
from helpers import make_demo_model_dir, write_jsonl
from PIL import Image

import vlmcore.data.pack.command
import vlmcore.data.pack.dataset
import vlmcore.data.pack.measure
import vlmcore.data.pack.writer
from vlmcore.cli import main
from vlmcore.data.pack.bin_packing import best_fit_decreasing, packing_stats
from vlmcore.data.pack.dataset import pack
from vlmcore.data.prepare.dataset import prepare
from vlmcore.data.shards import iter_shard_samples, shard_paths
from vlmcore.data.synthetic.image import generate


def long_tailed_mix(n: int, seed: int = 0) -> tuple[list[int], list[int]]:
    """Log-normal text lengths, 0-2 images of very different sizes (4 patches per image token)."""
    rng = random.Random(seed)
    tokens, patches = [], []
    for _ in range(n):
        image_patches = sum(rng.choice([64, 256, 1024, 4096]) for _ in range(rng.choice([0, 0, 1, 1, 1, 2])))
        text = max(8, int(rng.lognormvariate(5.0, 1.2)))
        tokens.append(min(8192, text + image_patches // 4))
        patches.append(image_patches)
    return tokens, patches


def test_bfd_efficiency_at_8192_with_patch_budget():
    tokens, patches = long_tailed_mix(20000)
    seq_len, max_patches = 8192, 3 * 8192
    bins = best_fit_decreasing(tokens, patches, seq_len, max_patches)
    stats = packing_stats(bins, tokens, patches, seq_len, max_patches)
    assert sorted(i for b in bins for i in b) == list(range(len(tokens)))
    assert all(sum(tokens[i] for i in b) <= seq_len for b in bins)
    assert all(sum(patches[i] for i in b) <= max_patches for b in bins)
    assert stats["max_patches_in_a_pack"] > 0.95 * max_patches  # the patch budget was binding somewhere
    assert stats["efficiency"] >= 0.998, stats


def test_bfd_respects_a_tight_patch_budget():
    tokens, patches = long_tailed_mix(3000, seed=1)
    bins = best_fit_decreasing(tokens, patches, 8192, 8192)
    assert all(sum(patches[i] for i in b) <= 8192 for b in bins)
    assert sorted(i for b in bins for i in b) == list(range(len(tokens)))
    with pytest.raises(ValueError, match="does not fit"):
        best_fit_decreasing([10, 9000], [0, 0], 8192, 8192)


def reference_best_fit_decreasing(tokens, patches, seq_len, max_patches):
    """The rule in its plainest form (a linear scan per sample): least free tokens among the bins
    with room for both, oldest bin on a tie."""
    bins, free = [], []  # free: [free tokens, free patches] per bin
    for i in sorted(range(len(tokens)), key=lambda i: (-tokens[i], -patches[i], i)):
        fits = [b for b, (ft, fp) in enumerate(free) if ft >= tokens[i] and fp >= patches[i] and ft > 0]
        if fits:
            b = min(fits, key=lambda b: (free[b][0], b))
        else:
            b = len(bins)
            bins.append([])
            free.append([seq_len, max_patches])
        bins[b].append(i)
        free[b][0] -= tokens[i]
        free[b][1] -= patches[i]
    return bins


def test_bfd_matches_the_plain_rule_when_either_budget_binds():
    for seed in range(40):
        rng = random.Random(seed)
        seq_len = rng.choice([16, 100, 1024])
        max_patches = rng.choice([0, 8, 100, 3 * seq_len])
        n = rng.randint(1, 400)
        tokens = [
            rng.randint(1, seq_len) if rng.random() < 0.3 else rng.randint(1, max(1, seq_len // 8)) for _ in range(n)
        ]
        patches = [
            min(max_patches, rng.choice([0, 0, 1, 4, max_patches // 3, max_patches // 2, max_patches]))
            for _ in range(n)
        ]
        expected = reference_best_fit_decreasing(tokens, patches, seq_len, max_patches)
        assert best_fit_decreasing(tokens, patches, seq_len, max_patches) == expected, seed
    tokens, patches = long_tailed_mix(2000, seed=3)
    for max_patches in (3 * 8192, 8192):  # the patch budget binds often at 8192
        expected = reference_best_fit_decreasing(tokens, patches, 8192, max_patches)
        assert best_fit_decreasing(tokens, patches, 8192, max_patches) == expected


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    root = tmp_path_factory.mktemp("pack")
    model = make_demo_model_dir(root / "model")
    generate(root / "raw", num_train=40, num_eval=3, seed=1)
    rows = [json.loads(line) for line in open(root / "raw" / "conversations.jsonl")]
    # Two conversations far longer than the budget: a long answer, and a long question that
    # leaves nothing to train on once truncated.
    image = rows[0]["images"][0]
    rows.append(
        {
            "images": [image],
            "messages": [
                {"role": "user", "content": "<image>\nWhat color is the shape?"},
                {"role": "assistant", "content": "red " * 200},
            ],
        }
    )
    rows.append(
        {
            "images": [image],
            "messages": [
                {"role": "user", "content": "<image>\n" + "What color is the shape? " * 60},
                {"role": "assistant", "content": "red"},
            ],
        }
    )
    write_jsonl(root / "raw" / "mixed.jsonl", rows + [{"text": "A red circle on a gray background."}] * 3)
    prepare([root / "raw" / "mixed.jsonl"], root / "data", shard_size=16)
    return root, model


@pytest.mark.slow
@pytest.mark.parametrize("overlong", ["truncate", "drop"])
def test_pack_writes_packed_energon_dataset(demo, overlong):
    root, model = demo
    out = root / f"packed_{overlong}"
    stats = pack(
        root / "data", model, out, seq_len=160, max_patches=96, overlong=overlong, shard_size=8, max_bad_fraction=0.1
    )
    assert (out / ".nv-meta" / ".info.json").is_file() and (out / "model" / "tokenizer.json").is_file()
    assert stats == json.loads((out / "stats.json").read_text())
    assert stats["bad"]["seen"] == 45
    if overlong == "truncate":
        assert stats["truncated"] == 1 and stats["dropped_overlong"] == 0 and stats["samples"] == 44
        assert stats["bad"]["skipped_by_reason"] == {"no_labels": 1}
    else:
        assert stats["truncated"] == 0 and stats["dropped_overlong"] == 2 and stats["samples"] == 43
        assert stats["bad"]["skipped_by_reason"] == {"overlong": 2}
    packs = [json.loads(s.data["json"]) for shard in shard_paths(out) for s in iter_shard_samples(shard)]
    assert len(packs) == stats["packs"]
    assert sum(len(p["segments"]) for p in packs) == stats["samples"]
    for p in packs:
        assert sum(seg["num_tokens"] for seg in p["segments"]) <= 160
    assert stats["max_patches_in_a_pack"] <= 96
    assert stats["efficiency"] == pytest.approx(stats["tokens"] / (160 * stats["packs"]))


def test_unsafe_shard_members_are_rejected(demo, tmp_path):
    root, model = demo
    data = tmp_path / "data"
    data.mkdir()
    (data / ".nv-meta").mkdir()
    sample = json.dumps({"text": "hello there", "images": []}).encode()
    with tarfile.open(data / "shard-000000.tar", "w") as tar:
        for name in ("000000000.json", "../000000001.json", "/etc/000000002.json", "000000003.json"):
            info = tarfile.TarInfo(name)
            info.size = len(sample)
            tar.addfile(info, io.BytesIO(sample))
    (data / ".nv-meta" / ".info.json").write_text(json.dumps({"shard_counts": {"shard-000000.tar": 4}}))
    out = tmp_path / "packed"
    args = [
        "pack",
        "--data",
        str(data),
        "--model",
        str(model),
        "--out",
        str(out),
        "--seq-len",
        "64",
        "--max-patches",
        "64",
    ]
    assert main(args + ["--max-bad-fraction", "0.4"]) == 1  # 2 of 4 bad
    assert main(args + ["--max-bad-fraction", "0.6"]) == 0
    stats = json.loads((out / "stats.json").read_text())
    assert stats["bad"]["skipped_by_reason"] == {"unsafe_tar_member": 2}
    assert stats["samples"] == 2


def rewrite_member(shard, name: str, data: bytes) -> None:
    """Replace one member of a tar shard in place (same member order)."""
    with tarfile.open(shard) as tar:
        members = [(m, tar.extractfile(m).read()) for m in tar]
    with tarfile.open(shard, "w") as tar:
        for member, content in members:
            content = data if member.name == name else content
            member.size = len(content)
            tar.addfile(member, io.BytesIO(content))


def test_image_truncated_after_its_header_is_bad_at_pack_time(demo, tmp_path):
    root, model = demo
    data = tmp_path / "data"
    shutil.copytree(root / "data", data)
    shard = shard_paths(data)[0]
    victim = next(s for s in iter_shard_samples(shard) if "img0.png" in s.data)
    png = victim.data["img0.png"]
    truncated = png[: len(png) // 2]
    assert Image.open(io.BytesIO(truncated)).size  # the header alone still reads
    rewrite_member(shard, f"{victim.key}.img0.png", truncated)

    out = tmp_path / "packed"
    stats = pack(data, model, out, seq_len=1024, max_patches=4096, shard_size=8, max_bad_fraction=0.1)
    assert stats["bad"]["skipped_by_reason"] == {"corrupt_image": 1}
    assert stats["samples"] == 44
    segments = 0
    for packed_shard in shard_paths(out):
        for s in iter_shard_samples(packed_shard):
            for segment in json.loads(s.data["json"])["segments"]:
                segments += 1
                assert segment["key"] != victim.key
                for name, size in zip(segment["images"], segment["image_sizes"]):
                    image = Image.open(io.BytesIO(s.data[name]))
                    image.load()
                    assert image.size == tuple(size)
    assert segments == 44


def test_killed_pack_never_leaves_an_output_that_looks_finished(demo, tmp_path, monkeypatch):
    root, model = demo
    out = tmp_path / "packed"
    pack(root / "data", model, out, seq_len=1024, max_patches=4096, shard_size=8, max_bad_fraction=0.1)
    finished = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}

    def killed(*_):  # a kill after every shard is written, just before the dataset is indexed
        raise KeyboardInterrupt

    monkeypatch.setattr(vlmcore.data.pack.dataset, "energon_prepare", killed)
    with pytest.raises(KeyboardInterrupt):
        pack(root / "data", model, out, seq_len=512, max_patches=4096, shard_size=8, max_bad_fraction=0.1)
    assert {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()} == finished
    partial = out.with_name("packed.partial")
    assert list(partial.glob("shard-*.tar"))
    with pytest.raises(Exception, match="not a prepared Energon dataset"):  # no index: no reader takes it
        shard_paths(partial)

    monkeypatch.undo()
    pack(root / "data", model, out, seq_len=512, max_patches=4096, shard_size=8, max_bad_fraction=0.1)
    assert json.loads((out / "pack_config.json").read_text())["seq_len"] == 512
    assert not partial.exists() and not out.with_name("packed.old").exists()
    assert len(shard_paths(out)) == len(list(out.glob("shard-*.tar")))


def packed_members(out) -> dict:
    return {(shard.name, s.key): s.data for shard in shard_paths(out) for s in iter_shard_samples(shard)}


def test_packs_hold_the_stored_samples_and_do_not_depend_on_workers(demo, tmp_path):
    """Pass 2 reads each sample back by offset: its json and images exactly as stored, the sizes
    of all its images, the kept ones; 2 measuring processes pack the same."""
    root, model = demo
    one, two = tmp_path / "one", tmp_path / "two"
    stats = pack(root / "data", model, one, seq_len=160, max_patches=96, shard_size=8, max_bad_fraction=0.1, workers=1)
    assert (
        pack(root / "data", model, two, seq_len=160, max_patches=96, shard_size=8, max_bad_fraction=0.1, workers=2)
        == stats
    )
    assert packed_members(one) == packed_members(two)

    stored = {s.key: s.data for shard in shard_paths(root / "data") for s in iter_shard_samples(shard)}
    assert stats["truncated"] == 1 and stats["samples"] == 44
    for data in packed_members(one).values():
        for segment in json.loads(data["json"])["segments"]:
            source = stored[segment["key"]]
            sample = json.loads(source["json"])
            names = sample.pop("images", [])
            assert segment["sample"] == sample
            assert segment["image_sizes"] == [list(Image.open(io.BytesIO(source[n])).size) for n in names]
            assert [data[n] for n in segment["images"]] == [source[n] for n in names[: len(segment["images"])]]


def test_rerun_after_a_kill_while_measuring_measures_only_the_shards_left(demo, tmp_path, monkeypatch):
    root, model = demo
    shards = shard_paths(root / "data")
    expected = tmp_path / "expected"
    pack(root / "data", model, expected, seq_len=160, max_patches=96, shard_size=8, max_bad_fraction=0.1)
    measure_shard = vlmcore.data.pack.measure.measure_shard
    measured = []

    def killed_at_the_third_shard(job):
        if len(measured) == 2:
            raise KeyboardInterrupt
        measured.append(job[1].name)
        return measure_shard(job)

    out = tmp_path / "packed"
    monkeypatch.setattr(vlmcore.data.pack.measure, "measure_shard", killed_at_the_third_shard)
    with pytest.raises(KeyboardInterrupt):
        pack(root / "data", model, out, seq_len=160, max_patches=96, shard_size=8, max_bad_fraction=0.1)
    assert not out.exists() and measured == [shards[0].name, shards[1].name]

    def counted(job):
        measured.append(job[1].name)
        return measure_shard(job)

    monkeypatch.setattr(vlmcore.data.pack.measure, "measure_shard", counted)
    stats = pack(root / "data", model, out, seq_len=160, max_patches=96, shard_size=8, max_bad_fraction=0.1)
    assert measured == [s.name for s in shards]  # the first two were not measured again
    assert stats == json.loads((expected / "stats.json").read_text())
    assert packed_members(out) == packed_members(expected)
    assert not out.with_name("packed.measured").exists()


def test_measure_pass_scattered_over_jobs_packs_the_same_bytes(demo, tmp_path):
    """The workflow's scatter: N `vlmcore pack --measure-group g/N` processes at once fill
    <out>.measured, the pack after them measures nothing and writes what one job writes."""
    root, model = demo
    single = tmp_path / "single"
    stats = pack(root / "data", model, single, seq_len=160, max_patches=96, shard_size=8, max_bad_fraction=0.1)
    out = tmp_path / "scattered"
    args = [
        "--data",
        str(root / "data"),
        "--model",
        str(model),
        "--out",
        str(out),
        "--seq-len",
        "160",
        "--max-patches",
        "96",
        "--shard-size",
        "8",
        "--max-bad-fraction",
        "0.1",
        "--workers",
        "1",
    ]
    groups = 3
    jobs = [
        subprocess.Popen(
            [sys.executable, "-m", "vlmcore.cli", "pack", *args, "--measure-group", f"{g}/{groups}"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for g in range(groups)
    ]
    for job in jobs:
        stdout, stderr = job.communicate(timeout=300)
        assert job.returncode == 0, stderr
    measured = out.with_name("scattered.measured")
    assert sorted(p.name for p in measured.glob("*.npz")) == [
        f"{i:06d}.npz" for i in range(len(shard_paths(root / "data")))
    ]
    assert not out.exists()

    def measuring_again(job):
        raise AssertionError(f"shard {job[1]} measured again")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(vlmcore.data.pack.measure, "measure_shard", measuring_again)
        assert pack(root / "data", model, out, seq_len=160, max_patches=96, shard_size=8, max_bad_fraction=0.1) == stats
    assert packed_members(out) == packed_members(single)
    assert not measured.exists()


@pytest.mark.parametrize("value", ["1", "2/2", "a/3", "-1/2"])
def test_job_group_must_be_g_of_n(value):
    with pytest.raises(argparse.ArgumentTypeError, match="G/N"):
        vlmcore.data.pack.command.job_group(value)


def output_files(out) -> dict:
    """Every file of a packed dataset and its bytes, but energon's random id of the index."""
    return {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file() and p.name != "index.uuid"}


PACK_ARGS = dict(seq_len=160, max_patches=96, shard_size=4, max_bad_fraction=0.1)


def cli_args(root, model, out) -> list[str]:
    return [
        "--data",
        str(root / "data"),
        "--model",
        str(model),
        "--out",
        str(out),
        "--seq-len",
        "160",
        "--max-patches",
        "96",
        "--shard-size",
        "4",
        "--max-bad-fraction",
        "0.1",
        "--workers",
        "1",
    ]


def test_writing_scattered_over_jobs_gives_the_same_bytes(demo, tmp_path):
    """The workflow's scatter of the writing: a plan job, N `--write-group g/N` processes at once
    into <out>.partial, then the pack job, which writes nothing more: the bytes of one job."""
    root, model = demo
    single = tmp_path / "single"
    stats = pack(root / "data", model, single, **PACK_ARGS)
    assert len(shard_paths(single)) >= 4

    out = tmp_path / "scattered"
    assert pack(root / "data", model, out, plan_only=True, **PACK_ARGS) == stats
    partial = out.with_name("scattered.partial")
    assert not out.exists() and not list(partial.glob("shard-*")) and (partial / "plan" / "plan.json").is_file()
    groups = 2
    jobs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "vlmcore.cli",
                "pack",
                *cli_args(root, model, out),
                "--write-group",
                f"{g}/{groups}",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for g in range(groups)
    ]
    for job in jobs:
        stdout, stderr = job.communicate(timeout=300)
        assert job.returncode == 0, stderr
        assert json.loads(stdout)["write_group"][1] == groups
    assert sorted(p.name for p in partial.glob("shard-*")) == sorted(s.name for s in shard_paths(single))
    assert not out.exists()

    def writing_again(index):
        raise AssertionError(f"output shard {index} written again")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(vlmcore.data.pack.writer, "write_shard", writing_again)
        assert pack(root / "data", model, out, **PACK_ARGS) == stats
    assert output_files(out) == output_files(single)
    assert not partial.exists() and not out.with_name("scattered.measured").exists()


def test_write_group_needs_the_plan_of_the_same_settings(demo, tmp_path):
    root, model = demo
    out = tmp_path / "packed"
    args = ["pack", *cli_args(root, model, out), "--write-group", "0/2"]
    assert main(args) == 1  # no plan yet
    pack(root / "data", model, out, plan_only=True, **PACK_ARGS)
    assert main([*args, "--seed", "1"]) == 1  # a plan of another pack order
    assert not list(out.with_name("packed.partial").glob("shard-*"))
    assert main(args) == 0 and list(out.with_name("packed.partial").glob("shard-*"))


def test_killed_while_writing_resumes_with_the_shards_left(demo, tmp_path):
    """A real `vlmcore pack` killed (SIGKILL) while it writes output shard 2: the rerun keeps
    shards 0 and 1 as they are, writes the others, half-written shard 2 included, and gives the
    bytes of an uninterrupted pack."""
    root, model = demo
    expected = tmp_path / "expected"
    pack(root / "data", model, expected, **PACK_ARGS)
    out = tmp_path / "packed"
    pack(root / "data", model, out, plan_only=True, **PACK_ARGS)
    partial = out.with_name("packed.partial")
    # Shard 2's file is a pipe that nobody reads: the writer blocks in it, after shards 0 and 1.
    blocker = partial / "shard-000002.tar.tmp"
    os.mkfifo(blocker)
    job = subprocess.Popen(
        [sys.executable, "-m", "vlmcore.cli", "pack", *cli_args(root, model, out)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 300
        while not (partial / "shard-000001.tar").is_file() and job.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)
        assert job.poll() is None, "the pack did not block at shard 2"
    finally:
        job.kill()
        job.wait()
    assert sorted(p.name for p in partial.glob("shard-*.tar")) == ["shard-000000.tar", "shard-000001.tar"]
    finished = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in partial.glob("shard-*.tar")}
    blocker.unlink()
    # what a writer killed halfway leaves: the first bytes of its shard
    blocker.write_bytes((expected / "shard-000002.tar").read_bytes()[:1000])

    pack(root / "data", model, out, **PACK_ARGS)
    assert {name: ((out / name).stat().st_ino, (out / name).stat().st_mtime_ns) for name in finished} == finished
    assert output_files(out) == output_files(expected)
    assert not partial.exists() and not list(out.glob("*.tmp"))
