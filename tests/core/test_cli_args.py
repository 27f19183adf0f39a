"""Every `vlmcore` command refuses a bad argument before any work: one error line naming the
flag and what is allowed, exit code 2, nothing written. In-process, no model or data needed."""

import pytest

from vlmcore.cli import main

# argv with {dir} (an existing directory), {file} (an existing file), {missing} (no such path),
# {out} (an output path that must not be created); then the flag the error line must name.
REFUSED = [
    (["download", "--tiny"], "--out"),
    (["download", "--tiny", "--out", "{out}", "--seed", "-1"], "--seed"),
    (["download", "--tiny", "--out", "{out}", "--tiny-config", "{{not json"], "--tiny-config"),
    (["download", "--staged", "{missing}", "--out", "{out}"], "--staged"),
    (["download", "--verify", "{file}"], "--verify"),
    (["download", "--repo-id", "org/model", "--out", "{out}"], "--revision"),
    (["synth", "--out", "{out}", "--num-train", "0"], "--num-train"),
    (["synth", "--out", "{out}", "--num-eval", "-1"], "--num-eval"),
    (["synth", "--out", "{out}", "--min-size", "200"], "--min-size"),
    (["prepare", "--source", "{missing}", "--out", "{out}"], "--source"),
    (["prepare", "--source", "captions:{missing}", "--out", "{out}"], "--source"),
    (["prepare", "--source", "{file}", "--out", "{out}", "--images", "{missing}"], "--images"),
    (["prepare", "--source", "{file}", "--out", "{out}", "--shard-size", "0"], "--shard-size"),
    (["prepare", "--source", "{file}", "--out", "{out}", "--max-bad-fraction", "1.5"], "--max-bad-fraction"),
    (["prepare", "--source", "{file}", "--out", "{out}", "--max-bad-fraction", "nan"], "--max-bad-fraction"),
    (["prepare", "--source", "{file}", "--out", "{out}", "--workers", "0"], "--workers"),
    (["prepare", "--source", "{file}", "--out", "{out}", "--max-image-pixels", "-1"], "--max-image-pixels"),
    (
        ["pack", "--data", "{dir}", "--model", "{dir}", "--out", "{out}", "--seq-len", "0", "--max-patches", "64"],
        "--seq-len",
    ),
    (
        ["pack", "--data", "{dir}", "--model", "{dir}", "--out", "{out}", "--seq-len", "x", "--max-patches", "64"],
        "--seq-len",
    ),
    (
        ["pack", "--data", "{dir}", "--model", "{dir}", "--out", "{out}", "--seq-len", "64", "--max-patches", "-1"],
        "--max-patches",
    ),
    (
        [
            "pack",
            "--data",
            "{dir}",
            "--model",
            "{dir}",
            "--out",
            "{out}",
            "--seq-len",
            "64",
            "--max-patches",
            "64",
            "--shard-size",
            "0",
        ],
        "--shard-size",
    ),
    (
        [
            "pack",
            "--data",
            "{dir}",
            "--model",
            "{dir}",
            "--out",
            "{out}",
            "--seq-len",
            "64",
            "--max-patches",
            "64",
            "--max-bad-fraction",
            "-0.1",
        ],
        "--max-bad-fraction",
    ),
    (
        ["pack", "--data", "{missing}", "--model", "{dir}", "--out", "{out}", "--seq-len", "64", "--max-patches", "64"],
        "--data",
    ),
    (
        ["pack", "--data", "{dir}", "--model", "{missing}", "--out", "{out}", "--seq-len", "64", "--max-patches", "64"],
        "--model",
    ),
    (
        ["pack", "--data", "{dir}", "--model", "{file}", "--out", "{out}", "--seq-len", "64", "--max-patches", "64"],
        "--model",
    ),
    (
        ["pack", "--data", "{dir}", "--model", "{dir}", "--out", "{dir}", "--seq-len", "64", "--max-patches", "64"],
        "--out",
    ),
    (["train", "{missing}"], "config"),
    (["memory", "{file}", "--world-size", "0"], "--world-size"),
    (["memory", "{file}", "--world-size", "1", "--seq-len", "-5"], "--seq-len"),
    (["kernels", "--gpu-capability", "hopper"], "--gpu-capability"),
    (["export", "--checkpoint", "{missing}", "--model", "{dir}", "--out", "{out}"], "--checkpoint"),
    (
        ["export", "--checkpoint", "{dir}", "--model", "{dir}", "--out", "{out}", "--max-shard-size", "5XB"],
        "--max-shard-size",
    ),
    (
        ["export", "--checkpoint", "{dir}", "--model", "{dir}", "--out", "{out}", "--stage-config", "{missing}"],
        "--stage-config",
    ),
    (["eval", "--model", "{missing}", "--tasks", "arc_easy", "--out", "{out}"], "--model"),
    (["eval", "--model", "{dir}", "--tasks", "arc_easy", "--out", "{out}", "--batch-size", "0"], "--batch-size"),
    (["eval", "--model", "{dir}", "--tasks", "arc_easy", "--out", "{out}", "--limit", "0"], "--limit"),
    (["eval", "--model", "{dir}", "--tasks", "demo_vqa", "--out", "{out}"], "--vqa-data"),
    (["eval", "--model", "{dir}", "--tasks", " , ", "--out", "{out}"], "--tasks"),
    (["report", "--out", "{out}", "--warmup-steps", "-1"], "--warmup-steps"),
    (["report", "--out", "{out}", "--train", "stage1={missing}"], "--train"),
    (["report", "--out", "{out}", "--scaling", "{dir}"], "--scaling"),
    (["report", "--out", "{out}", "--import", "{missing}"], "--import"),
]


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    (root / "dir").mkdir()
    (root / "file.yaml").write_text("model_path: nowhere\n")
    return {
        "dir": str(root / "dir"),
        "file": str(root / "file.yaml"),
        "missing": str(root / "missing"),
        "out": str(root / "out"),
        "root": root,
    }


@pytest.mark.parametrize("argv,flag", REFUSED, ids=[f"{a[0]} {f}" for a, f in REFUSED])
def test_bad_argument_refused_before_any_work(paths, argv, flag, capsys):
    before = sorted(paths["root"].rglob("*"))
    assert main([a.format(**paths) for a in argv]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"vlmcore {argv[0]}: error: ") and flag in lines[0], lines[0]
    assert sorted(paths["root"].rglob("*")) == before  # nothing written, no output directory
