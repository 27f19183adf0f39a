"""Requests vlmcore.generate cannot serve are refused by name before the model runs: an unknown
or out-of-range sampling setting, a prompt that does not fit the context with max_new_tokens, a
batch whose cache does not fit the memory; and the cache estimate equals what a prefill holds."""

import pytest
import torch

from vlmcore.generate import GenerationError, Prompt, SamplingSettings, generate, sampling_settings
from vlmcore.generate.cache import GenerationCache, cache_bytes, layer_types
from vlmcore.generate.decode import prefill
from vlmcore.models import build_model
from vlmcore.tiny import hf_config


@pytest.fixture(scope="module", params=["qwen3", "qwen3_5"])
def model(request):
    torch.manual_seed(0)
    model = build_model(hf_config(request.param), device="cpu")
    model.init_weights()
    calls = []
    model.register_forward_pre_hook(lambda *_: calls.append(1))
    model.calls = calls
    return model.eval()


def refused(model, prompts, settings, match, **kwargs):
    before = len(model.calls)
    with pytest.raises(GenerationError, match=match):
        generate(model, prompts, settings, **kwargs)
    assert len(model.calls) == before, "the model ran before the refusal"


def test_unknown_and_out_of_range_settings_are_named():
    with pytest.raises(GenerationError, match=r"unknown sampling setting\(s\) \['temprature'\]"):
        sampling_settings(temprature=0.7)
    for given, name in [
        (dict(top_p=0.0), "top_p=0.0"),
        (dict(top_k=-1), "top_k=-1"),
        (dict(temperature=-1.0), "temperature=-1.0"),
        (dict(max_new_tokens=0), "max_new_tokens=0"),
        (dict(n=2), "n=2"),  # greedy samples would all be equal
    ]:
        with pytest.raises(GenerationError, match=name):
            sampling_settings(**given)


def test_requests_that_cannot_fit_are_refused_before_the_model_runs(model):
    prompts = [Prompt(torch.arange(1, 9)), Prompt(torch.arange(1, 4))]
    context = model.config.get_text_config().max_position_embeddings
    refused(model, prompts, SamplingSettings(max_new_tokens=context - 5), r"prompt 0: 8 tokens \+ max_new_tokens")
    refused(model, prompts, SamplingSettings(top_p=2.0), "top_p")
    refused(model, [], SamplingSettings(), "no prompts")
    refused(model, [Prompt(torch.arange(0))], SamplingSettings(), "prompt 0 has no tokens")
    refused(model, prompts, SamplingSettings(stop_strings=["\n"]), "stop_strings needs a tokenizer")
    settings = SamplingSettings(max_new_tokens=8, temperature=1.0, n=4)
    refused(model, prompts, settings, r"2 prompts x n 4 with max_new_tokens 8 needs a", memory_limit=1000)
    assert generate(model, prompts, settings)  # the same batch with the device's memory


def test_the_cache_estimate_is_what_a_prefill_holds(model):
    prompts = [Prompt(torch.arange(1, 9)), Prompt(torch.arange(1, 4))]
    cache, _, _ = prefill(model, prompts, max_new_tokens=5)
    config = model.config.get_text_config()
    assert isinstance(cache, GenerationCache) and len(cache.layers) == len(layer_types(config))
    assert cache.nbytes() == cache_bytes(config, rows=2, capacity=8 + 5, dtype=torch.float32)


def test_vlmcore_memory_gives_the_generation_cache(tmp_path, capsys):
    """`vlmcore memory --generation-rows R --generation-tokens T`: the cache of R rows of T tokens
    under the stage's TP, as a prefill of such rows holds it (cache_bytes, checked above)."""
    import json

    from helpers import write_config

    from vlmcore import cli
    from vlmcore.tiny import tiny_snapshot

    model_dir = tiny_snapshot("qwen3_5", tmp_path / "model")
    config = write_config(tmp_path / "stage.yaml", model_dir, tmp_path / "out", parallel={"tp": 2})
    argv = ["memory", str(config), "--world-size", "2", "--generation-rows", "6", "--generation-tokens", "300"]
    assert cli.main([*argv, "--json", str(tmp_path / "est.json")]) == 0
    text_config = models_config(model_dir)
    expected = cache_bytes(text_config, rows=6, capacity=300, dtype=torch.float32, tp=2)
    assert json.loads((tmp_path / "est.json").read_text())["generation_cache"]["bytes"] == expected
    assert (
        f"generation cache: {expected / 2**30:.2f} GiB per rank for 6 rows of 300 tokens (tp 2"
        in capsys.readouterr().out
    )


def models_config(path):
    from vlmcore.models import load_hf_config

    return load_hf_config(path).get_text_config()
