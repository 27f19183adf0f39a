"""HF snapshot IO of vlmcore.models: sharded save / load, round trips, transformers reading what we
write, errors on bad snapshots, meta-device builds, init_weights against transformers' init."""

import json

import pytest
import torch
from helpers import hf_vl_logits, max_rel, vl_sample
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import (
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    Qwen3_5ForCausalLM,
    Qwen3_5ForConditionalGeneration,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
)

import vlmcore.models as models
from vlmcore.tiny import qwen3_5_config, qwen3_5_text_config, qwen3_config, qwen3_vl_config


def random_model(config):
    torch.manual_seed(0)
    model = models.build_model(config)
    model.to_empty(device="cpu")
    model.init_weights()
    return model.eval()


def snapshot_tensors(path) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            out.update({name: f.get_tensor(name) for name in f.keys()})  # noqa: SIM118 (a safetensors safe_open is not iterable: keys() lists its tensors)
    return out


def assert_same_tensors(a: dict, b: dict):
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name


def test_sharded_save_writes_an_index_and_loads_back(tmp_path):
    model = random_model(qwen3_vl_config())
    models.save_pretrained(model, tmp_path / "out", max_shard_size="200KB")
    shards = sorted(p.name for p in (tmp_path / "out").glob("*.safetensors"))
    assert len(shards) > 1
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == shards
    assert sorted(index["weight_map"]) == sorted(model.state_dict())
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in model.state_dict().values())
    assert (tmp_path / "out" / "config.json").exists() and (tmp_path / "out" / "generation_config.json").exists()
    loaded = models.from_pretrained(tmp_path / "out")
    assert_same_tensors(loaded.state_dict(), model.state_dict())


HF_SNAPSHOTS = {
    "qwen3": lambda: Qwen3ForCausalLM(qwen3_config(tied=True)),
    "qwen3_vl": lambda: Qwen3VLForConditionalGeneration(qwen3_vl_config()),
    "qwen3_5": lambda: Qwen3_5ForConditionalGeneration(qwen3_5_config()),
    "qwen3_5_text": lambda: Qwen3_5ForCausalLM(qwen3_5_text_config()),
}


@pytest.mark.parametrize("family", HF_SNAPSHOTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_load_save_load_is_bit_exact(tmp_path, family, dtype):
    torch.manual_seed(0)
    HF_SNAPSHOTS[family]().to(dtype).save_pretrained(tmp_path / "hf")
    first = models.from_pretrained(tmp_path / "hf")
    assert first.config.model_type == family
    assert next(first.parameters()).dtype == dtype
    models.save_pretrained(first, tmp_path / "a", max_shard_size="300KB")
    second = models.from_pretrained(tmp_path / "a")
    models.save_pretrained(second, tmp_path / "b")
    assert_same_tensors(snapshot_tensors(tmp_path / "hf"), snapshot_tensors(tmp_path / "a"))
    assert_same_tensors(snapshot_tensors(tmp_path / "a"), snapshot_tensors(tmp_path / "b"))
    assert_same_tensors(first.state_dict(), second.state_dict())


def test_dtype_argument_casts_the_snapshot_and_save_records_it(tmp_path):
    model = random_model(qwen3_vl_config())
    models.save_pretrained(model, tmp_path / "fp32")
    bf16 = models.from_pretrained(tmp_path / "fp32", dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in bf16.parameters())
    assert_same_tensors(bf16.state_dict(), {n: t.to(torch.bfloat16) for n, t in model.state_dict().items()})
    models.save_pretrained(bf16, tmp_path / "bf16")
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    assert next(models.from_pretrained(tmp_path / "bf16").parameters()).dtype == torch.bfloat16


def test_saving_again_replaces_the_old_shards(tmp_path):
    model = random_model(qwen3_config(tied=False))
    models.save_pretrained(model, tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    models.save_pretrained(model, tmp_path)
    assert sorted(p.name for p in tmp_path.glob("model*")) == ["model.safetensors"]
    assert_same_tensors(models.from_pretrained(tmp_path).state_dict(), model.state_dict())


def test_save_from_an_fsdp_sharded_model_gathers_full_tensors(tmp_path, one_process_group):
    """The export flow: parameters are DTensors (FSDP2 over a one-process gloo group)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    model = random_model(qwen3_vl_config())
    reference = {name: t.clone() for name, t in model.state_dict().items()}
    for block in [*model.model.visual.blocks, *model.model.language_model.layers]:
        fully_shard(block)
    fully_shard(model)
    assert isinstance(model.lm_head.weight, DTensor)
    models.save_pretrained(model, tmp_path / "out", max_shard_size="300KB")
    assert_same_tensors(snapshot_tensors(tmp_path / "out"), reference)


def test_tied_lm_head_is_not_saved_and_stays_tied(tmp_path):
    model = random_model(qwen3_config(tied=True))
    models.save_pretrained(model, tmp_path / "out")
    assert "lm_head.weight" not in snapshot_tensors(tmp_path / "out")
    loaded = models.from_pretrained(tmp_path / "out")
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    assert torch.equal(loaded.lm_head.weight, model.model.embed_tokens.weight)


def test_transformers_loads_the_saved_vl_model_with_identical_logits(tmp_path):
    native = random_model(qwen3_vl_config(deepstack=(0, 1)))
    models.save_pretrained(native, tmp_path / "out", max_shard_size="300KB")
    hf = AutoModelForImageTextToText.from_pretrained(tmp_path / "out").eval()
    assert isinstance(hf, Qwen3VLForConditionalGeneration)
    ids, pixels, grid = vl_sample([(1, 4, 6), (1, 2, 4)], [3, 4, 2], torch.Generator().manual_seed(1))
    ids = ids[None]
    with torch.no_grad():
        assert max_rel(native(ids, pixels, grid).logits, hf_vl_logits(hf, ids, pixels, grid)) < 1e-5
    assert_same_tensors(hf.state_dict(), native.state_dict())


@pytest.mark.parametrize("tied", [True, False])
def test_transformers_loads_the_saved_text_model_with_identical_logits(tmp_path, tied):
    native = random_model(qwen3_config(tied=tied))
    models.save_pretrained(native, tmp_path / "out")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert isinstance(hf, Qwen3ForCausalLM)
    ids = torch.randint(0, 256, (2, 30), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert max_rel(native(ids).logits, hf(input_ids=ids).logits) < 1e-5


def test_side_files_are_copied_and_state_dict_overrides_the_model(tmp_path):
    model = random_model(qwen3_config(tied=False))
    source = tmp_path / "source"
    source.mkdir()
    side = {
        "tokenizer.json": "{}",
        "tokenizer_config.json": "{}",
        "chat_template.jinja": "{{ messages }}",
        "preprocessor_config.json": "{}",
        "generation_config.json": '{"eos_token_id": 7}',
    }
    for name, text in side.items():
        (source / name).write_text(text)
    state = {name: torch.full_like(t, 0.5) for name, t in model.state_dict().items()}
    models.save_pretrained(model, tmp_path / "out", source_dir=source, state_dict=state)
    for name, text in side.items():
        assert (tmp_path / "out" / name).read_text() == text
    assert_same_tensors(snapshot_tensors(tmp_path / "out"), state)


def corrupt(tmp_path, edit):
    """A saved tiny Qwen3 snapshot whose tensors went through `edit(dict)`."""
    model = random_model(qwen3_config(tied=False))
    models.save_pretrained(model, tmp_path)
    tensors = snapshot_tensors(tmp_path)
    edit(tensors)
    save_file(tensors, tmp_path / "model.safetensors")
    return tmp_path


def test_missing_unexpected_and_misshaped_tensors_are_listed(tmp_path):
    path = corrupt(tmp_path / "a", lambda t: (t.pop("model.norm.weight"), t.update(extra=torch.zeros(2))))
    with pytest.raises(ValueError, match=r"missing \['model.norm.weight'\], unexpected \['extra'\]"):
        models.from_pretrained(path)
    path = corrupt(tmp_path / "b", lambda t: t.update({"lm_head.weight": torch.zeros(3, 64)}))
    with pytest.raises(ValueError, match=r"lm_head.weight: checkpoint \(3, 64\) vs model \(256, 64\)"):
        models.from_pretrained(path)


def test_unknown_model_type_and_pickle_weights_are_refused(tmp_path):
    config = qwen3_config()
    config.model_type = "llama"
    with pytest.raises(ValueError, match="unknown model_type 'llama'"):
        models.build_model(config)
    qwen3_config().save_pretrained(tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="safetensors"):
        models.from_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match="config.json"):
        models.from_pretrained(tmp_path / "nowhere")


def init_stats(model):
    return {
        n: (p.float().mean().item(), p.float().std().item() if p.numel() > 1 else 0.0)
        for n, p in model.named_parameters()
    }


@pytest.mark.parametrize("family", ["qwen3", "qwen3_vl"])
def test_meta_build_then_init_weights_matches_transformers_init(family):
    config = qwen3_config(tied=False) if family == "qwen3" else qwen3_vl_config(deepstack=(0, 1))
    hf_class = Qwen3ForCausalLM if family == "qwen3" else Qwen3VLForConditionalGeneration
    model = models.build_model(config)
    assert all(p.is_meta for p in model.parameters())
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights()
    ours, ref = init_stats(model), init_stats(hf_class(config))
    assert sorted(ours) == sorted(ref)
    for name, (mean, std) in ours.items():
        ref_mean, ref_std = ref[name]
        assert abs(std - ref_std) <= 0.1 * ref_std + 1e-6, (name, std, ref_std)
        assert abs(mean - ref_mean) <= 0.1 * ref_std + 1e-6, (name, mean, ref_mean)


QWEN3_VL_8B_TEXT = dict(
    vocab_size=151936,
    hidden_size=4096,
    intermediate_size=12288,
    num_hidden_layers=36,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    rope_parameters={
        "rope_type": "default",
        "rope_theta": 5e6,
        "mrope_section": [24, 20, 20],
        "mrope_interleaved": True,
    },
)
QWEN3_VL_8B_VISION = dict(
    depth=27,
    hidden_size=1152,
    intermediate_size=4304,
    num_heads=16,
    out_hidden_size=4096,
    patch_size=16,
    spatial_merge_size=2,
    temporal_patch_size=2,
    num_position_embeddings=2304,
    deepstack_visual_indexes=[8, 16, 24],
)


def parameter_count(model) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", ["qwen3-vl-8b", "qwen3-8b", "qwen3-0.6b"])
def test_real_size_configs_build_on_meta_with_transformers_parameter_count(name):
    if name == "qwen3-vl-8b":
        config = Qwen3VLConfig(
            text_config=QWEN3_VL_8B_TEXT, vision_config=QWEN3_VL_8B_VISION, tie_word_embeddings=False
        )
        hf_class, expected = Qwen3VLForConditionalGeneration, 8.77e9
    elif name == "qwen3-8b":
        config = Qwen3Config(
            vocab_size=151936,
            hidden_size=4096,
            intermediate_size=12288,
            num_hidden_layers=36,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            tie_word_embeddings=False,
        )
        hf_class, expected = Qwen3ForCausalLM, 8.19e9
    else:  # head_dim 128 != 1024 / 16, tied embeddings
        config = Qwen3Config(
            vocab_size=151936,
            hidden_size=1024,
            intermediate_size=3072,
            num_hidden_layers=28,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=128,
            tie_word_embeddings=True,
        )
        hf_class, expected = Qwen3ForCausalLM, 0.596e9
    model = models.build_model(config)
    with torch.device("meta"):
        hf = hf_class(config)
    assert parameter_count(model) == parameter_count(hf)
    assert abs(parameter_count(model) / expected - 1) < 0.01
    assert {n: tuple(p.shape) for n, p in model.state_dict().items()} == {
        n: tuple(p.shape) for n, p in hf.state_dict().items()
    }
