"""Snapshots: the tiny demo model, manifests, and verification of a staged copy."""

import json

import pytest
import torch

from vlmcore.download import build_tiny_model, use_staged_snapshot, verify_snapshot, write_manifest


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = tmp_path_factory.mktemp("snap") / "model"
    build_tiny_model(out, seed=0)
    return out


def test_tiny_model_is_a_real_snapshot(tiny):
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    from vlmcore.data.media.tokenizer import special_token_ids
    from vlmcore.models import from_pretrained

    manifest = verify_snapshot(tiny)
    assert {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "chat_template.jinja",
        "preprocessor_config.json",
    } <= set(manifest["files"])
    tokenizer = AutoTokenizer.from_pretrained(tiny)
    reference = AutoModelForImageTextToText.from_pretrained(tiny)
    ids = special_token_ids(tokenizer)
    assert reference.config.image_token_id == ids["image_token_id"]
    assert reference.config.text_config.vocab_size >= len(tokenizer)
    native = from_pretrained(tiny)
    input_ids = torch.tensor([tokenizer("a red circle on the left").input_ids])
    with torch.no_grad():
        torch.testing.assert_close(
            native(input_ids).logits, reference(input_ids=input_ids).logits, rtol=1e-4, atol=1e-5
        )


def test_tiny_model_is_deterministic(tiny, tmp_path):
    build_tiny_model(tmp_path / "again", seed=0)
    first = json.loads((tiny / "manifest.json").read_text())["files"]
    second = json.loads((tmp_path / "again" / "manifest.json").read_text())["files"]
    assert first["model.safetensors"]["sha256"] == second["model.safetensors"]["sha256"]
    assert first["tokenizer.json"]["sha256"] == second["tokenizer.json"]["sha256"]


def make_staged(tmp_path):
    staged = tmp_path / "staged"
    staged.mkdir()
    (staged / "config.json").write_text("{}")
    (staged / "model.safetensors").write_bytes(b"\1" * 64)
    write_manifest(staged, "org/model", "abc123")
    return staged


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda d: (d / "model.safetensors").unlink(), "missing file model.safetensors"),
        (lambda d: (d / "model.safetensors").write_bytes(b"\1" * 10), "size 10"),
        (lambda d: (d / "model.safetensors").write_bytes(b"\2" * 64), "sha256 differs"),
        (lambda d: (d / "manifest.json").unlink(), "no manifest.json"),
    ],
)
def test_incomplete_staged_copy_fails_clearly(tmp_path, damage, message):
    staged = make_staged(tmp_path)
    damage(staged)
    with pytest.raises(ValueError, match=message):
        use_staged_snapshot(staged, tmp_path / "model")
    assert not (tmp_path / "model").exists()


def test_staged_revision_must_match_the_pinned_one(tmp_path):
    with pytest.raises(ValueError, match="config pins 'def456'"):
        verify_snapshot(make_staged(tmp_path), revision="def456")


def test_rerunning_a_staged_download_never_touches_the_staged_copy(tmp_path):
    staged = make_staged(tmp_path)
    out = tmp_path / "model"
    use_staged_snapshot(staged, out, revision="abc123")
    assert (out / "model.safetensors").read_bytes() == b"\1" * 64
    (out / "manifest.json").unlink()  # what Snakemake does to the output before a rerun
    use_staged_snapshot(staged, out, revision="abc123")
    assert (staged / "manifest.json").is_file() and verify_snapshot(out)["revision"] == "abc123"


def test_tiny_moe_model_is_a_qwen3_vl_moe_snapshot_transformers_loads(tmp_path):
    """`model.tiny.family: qwen3_vl_moe`: 4 experts, top-2, in every layer; every weight saved is
    one transformers loads, none is left to random initialisation, and the native model reads
    the same model."""
    from safetensors.torch import load_file
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    from vlmcore.models import from_pretrained
    from vlmcore.models.moe import moe_blocks

    out = tmp_path / "moe"
    manifest = build_tiny_model(out, seed=0, family="qwen3_vl_moe", overrides={"text_config": {"num_hidden_layers": 2}})
    assert manifest["repo_id"] == "vlmcore/tiny-qwen3-vl-moe-demo"
    verify_snapshot(out)
    reference, info = AutoModelForImageTextToText.from_pretrained(out, output_loading_info=True)
    assert not any(info.values()), info
    text = reference.config.text_config
    assert (reference.config.model_type, text.num_experts, text.num_experts_per_tok) == ("qwen3_vl_moe", 4, 2)
    saved = load_file(out / "model.safetensors")
    assert any("experts" in name for name in saved) and any(name.endswith("mlp.gate.weight") for name in saved)
    state = reference.state_dict()
    for name, tensor in saved.items():
        torch.testing.assert_close(state[name], tensor, rtol=0, atol=0)
    tokenizer = AutoTokenizer.from_pretrained(out)
    native = from_pretrained(out)
    assert len(moe_blocks(native)) == 2
    input_ids = torch.tensor([tokenizer("a red circle on the left").input_ids])
    with torch.no_grad():
        torch.testing.assert_close(
            native(input_ids).logits, reference(input_ids=input_ids).logits, rtol=1e-4, atol=1e-5
        )


def test_unknown_tiny_family_names_the_key(tmp_path):
    with pytest.raises(ValueError, match="model.tiny.family: 'llama'"):
        build_tiny_model(tmp_path / "model", family="llama")
    assert not list(tmp_path.iterdir())  # nothing written
