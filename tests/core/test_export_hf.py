"""`vlmcore export`: a training `final/` checkpoint -> an HF directory transformers loads with the
same logits as vlmcore's own model on that checkpoint, for Qwen3, Qwen3-VL and Qwen3.5."""

import json
from pathlib import Path

import pytest
import torch
from helpers import perturbed, tiny_hf_snapshot, write_final_checkpoint
from PIL import Image
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

from vlmcore import cli
from vlmcore.export import export_hf, load_final_state_dict

AUTO_CLASS = {
    "qwen3": AutoModelForCausalLM,
    "qwen3_vl": AutoModelForImageTextToText,
    "qwen3_5": AutoModelForImageTextToText,
}


def vl_inputs(model_dir: Path) -> dict:
    """A chat-templated question about a real image, through the snapshot's processor."""
    from vlmcore.data.media.processor import load_processor

    processor = load_processor(model_dir)
    image = Image.new("RGB", (96, 64), (200, 40, 40))
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What color is the shape?"}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) + "red"
    return dict(processor(text=[text], images=[image], return_tensors="pt"))


@pytest.fixture(scope="module", params=["qwen3", "qwen3_vl", "qwen3_5"])
def exported(request, tmp_path_factory):
    """(family, snapshot, final/, export dir, the trained transformers model)."""
    family = request.param
    root = tmp_path_factory.mktemp(family)
    snapshot = tiny_hf_snapshot(family, root / "model")
    trained = perturbed(AUTO_CLASS[family].from_pretrained(snapshot)).eval()
    final = write_final_checkpoint(trained, root / "train" / "stage1")
    out = export_hf(
        final, snapshot, root / "hf", stage_configs=[root / "train/stage1/config.yaml"], max_shard_size="100KB"
    )
    return family, snapshot, final, out, trained


def test_export_writes_a_complete_sharded_hf_directory(exported):
    family, snapshot, _, out, _ = exported
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(out.glob("model-*.safetensors"))
    assert len(shards) > 1 and set(index["weight_map"].values()) == {p.name for p in shards}
    for name in [
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
    ]:
        assert (out / name).read_bytes() == (snapshot / name).read_bytes(), name
    if family != "qwen3":
        assert (out / "preprocessor_config.json").is_file() and (out / "processor_config.json").is_file()
    assert not (out / "manifest.json").exists(), "the snapshot's manifest describes other weights"
    assert not list(out.parent.glob(f".{out.name}.tmp-*"))


def test_transformers_logits_equal_the_checkpoint(exported):
    family, snapshot, _, out, trained = exported
    loaded = AUTO_CLASS[family].from_pretrained(out).eval()
    inputs = {"input_ids": torch.randint(0, 300, (2, 17))} if family == "qwen3" else vl_inputs(snapshot)
    with torch.no_grad():
        expected, got = trained(**inputs).logits, loaded(**inputs).logits
    source = AUTO_CLASS[family].from_pretrained(snapshot).eval()
    with torch.no_grad():
        assert not torch.allclose(source(**inputs).logits, got), (
            "the export must hold the trained weights, not the snapshot's"
        )
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_transformers_logits_equal_vlmcore_native_model(exported):
    family, snapshot, final, out, _ = exported
    import vlmcore.models
    from vlmcore.train.checkpoint import load_model_weights

    native = vlmcore.models.from_pretrained(snapshot)
    load_model_weights(native, final)  # how a later stage reads final/
    loaded = AUTO_CLASS[family].from_pretrained(out).eval()
    inputs = {"input_ids": torch.randint(0, 300, (1, 23))} if family == "qwen3" else vl_inputs(snapshot)
    native_inputs = {k: v for k, v in inputs.items() if k in ("input_ids", "pixel_values", "image_grid_thw")}
    with torch.no_grad():
        torch.testing.assert_close(loaded(**inputs).logits, native.eval()(**native_inputs).logits, rtol=1e-4, atol=1e-4)


def test_load_final_state_dict_matches_the_trained_weights(exported):
    family, snapshot, final, _, trained = exported
    weights = load_final_state_dict(final, snapshot)
    expected = trained.state_dict()
    if family == "qwen3":  # tied: the snapshot stores no lm_head
        assert "lm_head.weight" not in weights
        expected.pop("lm_head.weight")
    assert weights.keys() == expected.keys()
    assert all(torch.equal(weights[k], expected[k]) for k in weights)


def test_provenance_records_source_stages_code_and_data(tmp_path):
    snapshot = tiny_hf_snapshot("qwen3", tmp_path / "model")
    final = write_final_checkpoint(
        AutoModelForCausalLM.from_pretrained(snapshot), tmp_path / "train" / "stage2", step=11
    )
    stats = []
    for dataset, samples in [("captions", 100), ("conversations", 250)]:
        path = tmp_path / "packed" / dataset / "stats.json"
        path.parent.mkdir(parents=True)
        path.write_text(json.dumps({"num_samples": samples, "efficiency": 0.9, "skipped": {"too_long": 1}}))
        stats.append(path)
    out = tmp_path / "hf"
    assert (
        cli.main(
            [
                "export",
                "--checkpoint",
                str(final),
                "--model",
                str(snapshot),
                "--out",
                str(out),
                "--stage-config",
                str(tmp_path / "train/stage2/config.yaml"),
                "--data-stats",
                str(stats[0]),
                "--data-stats",
                str(stats[1]),
            ]
        )
        == 0
    )
    provenance = json.loads((out / "provenance.json").read_text())
    assert provenance["source"]["repo_id"] == "test/tiny-qwen3" and provenance["source"]["revision"] == "seed0"
    assert provenance["checkpoint"]["meta"]["step"] == 11
    assert provenance["stages"] == {"stage2": {"stage": "stage2", "steps": 11, "optimizer": {"lr": 0.001}}}
    assert provenance["code"]["vlmcore_version"] and "commit" in provenance["code"]
    data = provenance["data"]
    assert data["datasets"]["conversations"]["num_samples"] == 250 and len(data["fingerprint"]) == 64
    # The fingerprint follows the data: other packing statistics, another fingerprint.
    stats[1].write_text(json.dumps({"num_samples": 251, "efficiency": 0.9}))
    export_hf(final, snapshot, out, data_stats=stats)
    assert json.loads((out / "provenance.json").read_text())["data"]["fingerprint"] != data["fingerprint"]


def test_dtype_cast_and_default_keeps_the_snapshot_dtype(tmp_path):
    snapshot = tiny_hf_snapshot("qwen3", tmp_path / "model")
    final = write_final_checkpoint(AutoModelForCausalLM.from_pretrained(snapshot), tmp_path / "train" / "stage1")
    assert (
        cli.main(
            [
                "export",
                "--checkpoint",
                str(final),
                "--model",
                str(snapshot),
                "--out",
                str(tmp_path / "bf16"),
                "--dtype",
                "bfloat16",
            ]
        )
        == 0
    )
    with safe_open(tmp_path / "bf16" / "model.safetensors", framework="pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}  # noqa: SIM118 (a safetensors safe_open is not iterable: keys() lists its tensors)
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "bf16").dtype == torch.bfloat16
    export_hf(final, snapshot, tmp_path / "same")
    with safe_open(tmp_path / "same" / "model.safetensors", framework="pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"F32"}  # noqa: SIM118 (a safetensors safe_open is not iterable: keys() lists its tensors)


def test_mismatched_checkpoint_fails_and_keeps_the_previous_export(tmp_path):
    snapshot = tiny_hf_snapshot("qwen3", tmp_path / "model")
    final = write_final_checkpoint(AutoModelForCausalLM.from_pretrained(snapshot), tmp_path / "train" / "stage1")
    out = export_hf(final, snapshot, tmp_path / "hf")
    before = (out / "model.safetensors").read_bytes()
    other = tiny_hf_snapshot("qwen3_vl", tmp_path / "vl-model")
    with pytest.raises(ValueError, match="does not match snapshot.*missing"):
        export_hf(final, other, out)
    assert (out / "model.safetensors").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "model", "train", "vl-model"]
    with pytest.raises(ValueError, match="not a torch.distributed.checkpoint"):
        export_hf(tmp_path / "train", snapshot, tmp_path / "hf2")


def test_untrained_snapshot_tensors_are_carried_over(tmp_path):
    """Qwen3.5 releases carry an MTP head the native model does not train; the export keeps it."""
    snapshot = tiny_hf_snapshot("qwen3_5", tmp_path / "model")
    model = AutoModelForImageTextToText.from_pretrained(snapshot)
    final = write_final_checkpoint(model, tmp_path / "train" / "stage1")
    weights = load_file(snapshot / "model.safetensors")
    mtp = {"mtp.fc.weight": torch.randn(64, 128), "mtp.norm.weight": torch.ones(64)}
    save_file({**weights, **mtp}, snapshot / "model.safetensors", metadata={"format": "pt"})
    out = export_hf(final, snapshot, tmp_path / "hf")
    exported = {}
    for shard in out.glob("*.safetensors"):
        exported.update(load_file(shard))
    assert torch.equal(exported["mtp.fc.weight"], mtp["mtp.fc.weight"])
    assert json.loads((out / "provenance.json").read_text())["copied_from_snapshot"] == sorted(mtp)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_5"])
def test_export_of_a_tensor_parallel_training_run(tmp_path, family):
    """`vlmcore train` under torchrun with tp=2 (Qwen3.5's fused projections sharded by head) writes
    final/; the export of it gives transformers the logits vlmcore's single-process model has."""
    import helpers

    import vlmcore.models
    from vlmcore.tiny import tiny_snapshot
    from vlmcore.train.checkpoint import load_model_weights

    snapshot = tiny_snapshot(family, tmp_path / "model")
    config = helpers.write_config(
        tmp_path / "stage.yaml",
        snapshot,
        tmp_path / "train" / "stage1",
        steps=2,
        parallel={"dp_shard": 1, "tp": 2},
        data={"seq_len": 24},
    )
    helpers.train(2, config)
    final = tmp_path / "train" / "stage1" / "final"
    out = export_hf(final, snapshot, tmp_path / "hf", stage_configs=[tmp_path / "train/stage1/config.yaml"])
    assert json.loads((out / "provenance.json").read_text())["stages"]["stage1"]["parallel"]["tp"] == 2

    native = vlmcore.models.from_pretrained(snapshot).eval()
    load_model_weights(native, final)
    loaded = AutoModelForImageTextToText.from_pretrained(out).eval()
    source = AutoModelForImageTextToText.from_pretrained(snapshot).eval()
    image_token = loaded.config.image_token_id
    grid = torch.tensor([[1, 4, 6]])  # 24 patches -> 6 image tokens after the 2x2 merge
    input_ids = torch.cat(
        [torch.randint(0, 200, (1, 5)), torch.full((1, 6), image_token), torch.randint(0, 200, (1, 7))], 1
    )
    inputs = {
        "input_ids": input_ids,
        "pixel_values": torch.randn(24, 3 * 2 * 16 * 16),
        "image_grid_thw": grid,
        "mm_token_type_ids": (input_ids == image_token).long(),
    }
    with torch.no_grad():
        got = loaded(**inputs).logits
        assert not torch.allclose(got, source(**inputs).logits), "training must have changed the weights"
        expected = native(input_ids, pixel_values=inputs["pixel_values"], image_grid_thw=grid).logits
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("exported", ["qwen3_vl", "qwen3_5"], indirect=True)  # the video models
def test_exported_model_reads_video_as_the_native_model_does(exported):
    """The export keeps what video needs (the config's video token, the vision tower): transformers
    on the exported directory and the native model on final/ give the same logits for a video of
    two frame groups (transformers' names: pixel_values_videos, video_grid_thw)."""
    family, snapshot, final, out, _ = exported
    import vlmcore.models
    from vlmcore.train.checkpoint import load_model_weights

    native = vlmcore.models.from_pretrained(snapshot)
    load_model_weights(native, final)
    config = native.config
    g = torch.Generator().manual_seed(0)
    group = [config.vision_start_token_id] + [config.video_token_id] * 4 + [config.vision_end_token_id]
    ids = torch.cat(
        [torch.randint(0, 300, (5,), generator=g)]
        + [torch.cat([torch.randint(0, 300, (3,), generator=g), torch.tensor(group)]) for _ in range(2)]
        + [torch.randint(0, 300, (4,), generator=g)]
    )[None]
    grid = torch.tensor([[2, 4, 4]])
    pixels = torch.randn(2 * 16, 3 * 2 * 16 * 16, generator=g)
    loaded = AUTO_CLASS[family].from_pretrained(out).eval()
    with torch.no_grad():
        ref = loaded(
            input_ids=ids,
            pixel_values_videos=pixels,
            video_grid_thw=grid,
            mm_token_type_ids=2 * (ids == config.video_token_id).int(),
        ).logits
        got = native.eval()(ids, pixel_values_videos=pixels, video_grid_thw=grid).logits
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


def test_export_samples_video_as_the_packed_data_was(tmp_path):
    """`--packed-data`: the video sampling the last stage's data was packed with (`pack.video`,
    written into packed/<dataset>/model) goes into the export; without it, the snapshot's."""
    from vlmcore.data.media.encoder import SampleEncoder
    from vlmcore.data.pack.writer import copy_model_files

    snapshot = tiny_hf_snapshot("qwen3_vl", tmp_path / "model")
    final = write_final_checkpoint(AutoModelForImageTextToText.from_pretrained(snapshot), tmp_path / "train" / "stage1")
    packed = tmp_path / "packed" / "videos"
    copy_model_files(snapshot, packed, video={"fps": 1, "max_frames": 32, "max_pixels": 4096})
    assert (
        cli.main(
            [
                "export",
                "--checkpoint",
                str(final),
                "--model",
                str(snapshot),
                "--out",
                str(tmp_path / "hf"),
                "--packed-data",
                str(packed),
            ]
        )
        == 0
    )
    settings = SampleEncoder(tmp_path / "hf").video
    assert (settings.fps, settings.max_frames, settings.max_pixels) == (1, 32, 4096)
    assert settings == SampleEncoder(packed / "model").video != SampleEncoder(snapshot).video
    # A stage on random batches has an empty packed folder: the snapshot's settings stay.
    (tmp_path / "packed" / "random").mkdir()
    export_hf(final, snapshot, tmp_path / "hf", packed_dir=tmp_path / "packed" / "random")
    assert SampleEncoder(tmp_path / "hf").video == SampleEncoder(snapshot).video
