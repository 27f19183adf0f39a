"""Refusals of `vlmcore export` and `vlmcore stage-benchmark`, tried with the bad inputs a new user
gives, and a usage error of `python -m vlmcore.cli` (how torchrun starts `vlmcore eval` when
eval.nproc > 1): each is one line naming the flag or the file, exit code 2 (the CLI's usage-error
code), and nothing written."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import tiny_hf_snapshot as tiny_snapshot
from helpers import write_final_checkpoint
from transformers import Qwen3VLForConditionalGeneration

from vlmcore import cli

REPO = Path(__file__).resolve().parents[2]


def refused(argv: list[str], capsys) -> str:
    """The one line `vlmcore` printed for `argv`, which it refused with exit code 2."""
    capsys.readouterr()
    assert cli.main(argv) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    command = " ".join(argv[:1])
    assert err.startswith(f"vlmcore {command}: error: ") and "\n" not in err and "Traceback" not in err, err
    return err


def test_python_dash_m_prints_a_usage_error_as_one_line(tmp_path):
    """Run as a module, cli.py is `__main__` and the command raises vlmcore.cli's UsageError: the
    module's main must still be the one that catches it."""
    env = {"PYTHONPATH": str(REPO / "src"), "PATH": "/usr/bin:/bin"}
    proc = subprocess.run(
        [sys.executable, "-m", "vlmcore.cli", "stage-benchmark", "mmmu_val"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == "vlmcore stage-benchmark: error: --out is required unless --verify (see --help)\n"
    assert list(tmp_path.iterdir()) == []


@pytest.fixture(scope="module")
def stage(tmp_path_factory):
    """A tiny Qwen3-VL snapshot, a text-only one, and a full fine-tuning stage's final/ (no LoRA)."""
    root = tmp_path_factory.mktemp("export_refusals")
    snapshot = tiny_snapshot("qwen3_vl", root / "model")
    text_only = tiny_snapshot("qwen3", root / "text_model")
    final = write_final_checkpoint(Qwen3VLForConditionalGeneration.from_pretrained(snapshot), root / "train/stage1")
    return snapshot, text_only, final


def test_export_refusals_are_one_line_and_write_nothing(stage, tmp_path, capsys):
    snapshot, text_only, final = stage
    (tmp_path / "empty").mkdir()
    out = tmp_path / "hf"
    adapter = out / "peft_adapter"

    def export(checkpoint, model, *extra) -> str:
        return refused(
            ["export", "--checkpoint", str(checkpoint), "--model", str(model), "--out", str(out), *extra], capsys
        )

    assert "empty: not a torch.distributed.checkpoint directory (no .metadata)" in export(tmp_path / "empty", snapshot)
    assert f"--model {tmp_path / 'empty'}: no config.json; not an HF snapshot" in export(final, tmp_path / "empty")
    assert f"checkpoint {final} does not match snapshot {text_only}: " in export(final, text_only)
    # A peft adapter of a stage without LoRA: refused before the merged model is written.
    err = export(final, snapshot, "--peft-adapter", str(adapter))
    assert f"{final}: no LoRA adapters (`adapters.*`): not the final/ of a stage with lora.rank > 0" in err
    assert "--peft-base: only with --peft-adapter" in export(final, snapshot, "--peft-base", str(snapshot))
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["empty"]
    assert not list(final.parent.parent.glob(".hf.tmp-*"))


def staged_copy(root: Path) -> Path:
    """A staged mmmu_val directory: one data file and the manifest that `stage-benchmark` writes."""
    from vlmcore.download import write_manifest

    staged = root / "mmmu_val"
    (staged / "data").mkdir(parents=True)
    (staged / "data/validation-00000-of-00001.parquet").write_bytes(b"questions")
    extra = {"benchmark": "mmmu_val", "split": "validation", "configs": [], "patterns": ["data/validation-*"]}
    write_manifest(staged, "lmms-lab-encoder/MMMU", "c0ffee", extra=extra)
    return staged


def test_stage_benchmark_refusals_are_one_line_and_write_nothing(tmp_path, capsys):
    staged = staged_copy(tmp_path / "copy")
    argv = ["stage-benchmark", "mmmu_val", "--verify", str(staged)]
    assert cli.main(argv) == 0
    out = tmp_path / "experiment/benchmarks/mmmu_val"
    (staged / "data/validation-00000-of-00001.parquet").write_bytes(b"other data")
    err = refused(argv, capsys)
    assert f"benchmark mmmu_val: the staged data at {staged} failed verification (" in err
    assert err.endswith("): data/validation-00000-of-00001.parquet: size 10, manifest says 9 (see --help)")
    # A copy staged elsewhere that fails verification is not linked into --out.
    assert "failed verification" in refused(
        ["stage-benchmark", "mmmu_val", "--staged", str(staged), "--out", str(out)], capsys
    )
    assert not out.parent.exists()
    (staged / "manifest.json").write_text("{not json")
    assert f"benchmark mmmu_val: {staged / 'manifest.json'} is not valid JSON (" in refused(argv, capsys)
    (staged / "manifest.json").write_text(json.dumps(["files"]))
    assert "is not a staging manifest (no `files` mapping)" in refused(argv, capsys)
    (staged / "manifest.json").unlink()
    assert f"benchmark mmmu_val: no staged data at {staged} (no manifest.json)" in refused(argv, capsys)
