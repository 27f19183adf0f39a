"""Native Qwen3 text model against transformers' Qwen3ForCausalLM on tiny random configs."""

import pytest
import torch
from helpers import hf_and_native, logits_loss_then_grad_diffs, max_rel, token_loss
from transformers import Qwen3ForCausalLM

import vlmcore.models as models
from vlmcore.tiny import qwen3_config

SHAPES = {
    "tied-gqa2": dict(tied=True),
    "untied-gqa4-headdim32": dict(tied=False, heads=8, kv_heads=2, head_dim=32),
    "untied-mha-headdim8": dict(tied=False, heads=4, kv_heads=4, head_dim=8, layers=3),
}


def pair(tmp_path, **shape):
    return hf_and_native(Qwen3ForCausalLM, qwen3_config(**shape), tmp_path / "hf")


@pytest.mark.parametrize("shape", SHAPES)
def test_logits_loss_and_grads_match_transformers(tmp_path, shape):
    hf, native = pair(tmp_path, **SHAPES[shape])
    ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(1))
    ref = hf(input_ids=ids).logits
    out = native(ids).logits
    diffs = logits_loss_then_grad_diffs(native, hf, ids, out, ref)
    assert max(diffs.values()) < 1e-4, sorted(diffs.items(), key=lambda kv: -kv[1])[:5]
    assert native.config.tie_word_embeddings == (native.lm_head.weight is native.model.embed_tokens.weight)


def test_hidden_states_through_lm_head(tmp_path):
    hf, native = pair(tmp_path, **SHAPES["tied-gqa2"])
    ids = torch.randint(0, 256, (1, 17), generator=torch.Generator().manual_seed(2))
    hidden = native(ids, return_hidden=True).hidden_states
    assert hidden.shape == (1, 17, 64)
    assert max_rel(native.lm_head(hidden), hf(input_ids=ids).logits) < 1e-4


def test_packed_rows_equal_samples_run_alone(tmp_path):
    _, native = pair(tmp_path, **SHAPES["untied-gqa4-headdim32"])
    g = torch.Generator().manual_seed(3)
    lengths = [7, 13, 4, 9, 11, 4]  # two rows of 24 tokens, three samples each
    samples = [torch.randint(0, 256, (n,), generator=g) for n in lengths]
    ids = torch.cat(samples).view(2, 24)
    cu = torch.nn.functional.pad(torch.tensor(lengths).cumsum(0), (1, 0)).to(torch.int32)
    positions = models.position_ids(native.config, ids, None, cu)
    assert torch.equal(positions.flatten(), torch.cat([torch.arange(n) for n in lengths]))

    packed = native(ids, cu_seqlens=cu).logits.flatten(0, 1)
    flat_ids = ids.flatten()[None]
    sum(token_loss(packed[None, a:b], flat_ids[:, a:b]) for a, b in zip(cu[:-1], cu[1:])).backward()
    packed_grads = {n: p.grad.clone() for n, p in native.named_parameters()}
    native.zero_grad()
    alone = [native(s[None]).logits for s in samples]
    sum(token_loss(logits, s[None]) for logits, s in zip(alone, samples)).backward()
    assert max_rel(packed, torch.cat(alone, dim=1)[0]) < 1e-5
    for name, p in native.named_parameters():
        assert max_rel(packed_grads[name], p.grad) < 1e-4, name


def test_bf16_top1_agrees_with_transformers(tmp_path):
    hf, _ = pair(tmp_path, **SHAPES["untied-gqa4-headdim32"])
    native = models.from_pretrained(tmp_path / "hf", dtype=torch.bfloat16).eval()
    hf16 = Qwen3ForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.bfloat16).eval()
    ids = torch.randint(0, 256, (4, 400), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        top1 = {
            "native": native(ids).logits.argmax(-1),
            "hf16": hf16(input_ids=ids).logits.argmax(-1),
            "hf32": hf(input_ids=ids).logits.argmax(-1),
        }
    agree = lambda a, b: (top1[a] == top1[b]).float().mean().item()
    assert agree("native", "hf16") >= 0.99
    assert agree("native", "hf32") >= agree("hf16", "hf32") - 0.01


def test_weights_load_into_a_model_sharded_on_meta(tmp_path, one_process_group):
    """The training flow: build on meta, shard with FSDP2, materialize, load (one gloo process)."""
    from torch.distributed.fsdp import fully_shard

    hf, native = pair(tmp_path, **SHAPES["tied-gqa2"])
    model = models.build_model(tmp_path / "hf")
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    model.to_empty(device="cpu")
    models.load_hf_weights(model, tmp_path / "hf")
    assert model.lm_head.weight is model.model.embed_tokens.weight
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(5))
    assert max_rel(model(ids).logits, hf(input_ids=ids).logits) < 1e-4
