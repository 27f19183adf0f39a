"""`vlmcore memory` of a GRPO stage on random data (each segment a rollout's completion): the
fake run counts what a real CPU run of the same GRPO steps holds, to the byte; with a KL term
(`grpo.beta` > 0) the frozen reference's weights are added, sharded as the policy's, without
gradients or optimizer state; without one, no reference is built. The rollout beside the step
(generation's cache, the gathered weights, the prefill) is estimated apart and bounds a real
rollout's allocations."""

import json
import subprocess
import weakref

import pytest
import torch
from helpers import env, estimates, mm_sample, write_config
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from vlmcore.tiny import tiny_snapshot

pytestmark = pytest.mark.slow


def test_a_grpo_stage_with_a_kl_term_adds_the_references_weights(tmp_path):
    from vlmcore.models import build_model

    snapshot = tiny_snapshot("qwen3_vl", tmp_path / "qwen3_vl")
    config = write_config(
        tmp_path / "stage.yaml",
        snapshot,
        tmp_path / "out",
        data={"kind": "random", "seq_len": 96, "segments": 2},
        objective="grpo",
        grpo={"rewards": [{"name": "exact_match", "weight": 1.0}]},
    )
    model = build_model(str(snapshot), device="meta")
    reference_weights = 4 * sum(p.numel() for p in model.parameters())  # fp32, as the policy's
    with_kl = ["grpo.beta=0.04"]
    without_kl, fake, real = estimates(
        config, [[], 1, 96, 2, True], [with_kl, 1, 96, 2, True], [with_kl, 1, 96, 2, False]
    )
    assert fake["peak_bytes_by_kind"] == real["peak_bytes_by_kind"]
    assert fake["peak_bytes"] == real["peak_bytes"] > 0

    def kind(result: dict, name: str) -> int:
        return result["peak_bytes_by_kind"].get(name, 0)

    assert kind(fake, "Sharded Param") == kind(without_kl, "Sharded Param") + reference_weights
    assert kind(fake, "OptState") == kind(without_kl, "OptState")
    assert kind(fake, "Sharded Grad") == kind(without_kl, "Sharded Grad")
    assert without_kl["peak_bytes"] < fake["peak_bytes"] <= without_kl["peak_bytes"] + 2 * reference_weights


class LiveBytes(TorchDispatchMode):
    """The most bytes held at once by the storages that ops create inside (what was allocated
    before, such as the weights, is not counted): a CPU stand-in for torch.cuda.max_memory_allocated."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self.counted: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            if not isinstance(tensor, torch.Tensor) or tensor.untyped_storage().data_ptr() in self.counted:
                continue
            storage = tensor.untyped_storage()
            key, size = storage.data_ptr(), storage.nbytes()
            self.counted.add(key)
            self.live += size
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._free, key, size)
        return out

    def _free(self, key: int, size: int) -> None:
        self.live -= size
        self.counted.discard(key)


def test_the_estimate_of_a_rollout_bounds_a_real_rollouts_memory(tmp_path):
    """`vlmcore memory` of a GRPO stage adds its rollout: what the step keeps, the weights gathered
    under FSDP2 (dp_shard 2), the generation cache of the rank's prompts x group_size rows and the
    prefill; a real rollout of those rows, each prompt as long as a rollout row allows with the
    estimate's image, allocates no more than the estimate above what it keeps between steps."""
    import vlmcore.models as models
    from vlmcore.generate import Prompt, SamplingSettings
    from vlmcore.generate.cache import cache_bytes
    from vlmcore.models import build_model, load_hf_config
    from vlmcore.train.rollout import rollout

    snapshot = tiny_snapshot("qwen3_vl", tmp_path / "qwen3_vl")
    seq_len, new_tokens, prompts_per_step, group_size = 96, 16, 4, 6
    config = write_config(
        tmp_path / "stage.yaml",
        snapshot,
        tmp_path / "out",
        data={"kind": "random", "seq_len": seq_len, "segments": 1},
        objective="grpo",
        grpo={
            "prompts_per_step": prompts_per_step,
            "group_size": group_size,
            "max_new_tokens": new_tokens,
            "rewards": [{"name": "exact_match"}],
        },
    )
    estimates = {}
    for world in (1, 2):
        out = tmp_path / f"estimate_{world}.json"
        proc = subprocess.run(
            ["vlmcore", "memory", str(config), "--world-size", str(world), "--json", str(out)],
            capture_output=True,
            text=True,
            env=env(),
            timeout=600,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "rollout (grpo)" in proc.stdout, proc.stdout
        estimates[world] = json.loads(out.read_text())
    one, two = estimates[1]["rollout"], estimates[2]["rollout"]
    text = load_hf_config(str(snapshot)).get_text_config()
    weights = 4 * sum(p.numel() for p in build_model(str(snapshot), device="meta").parameters())  # fp32
    assert (one["rows"], two["rows"]) == (prompts_per_step * group_size, prompts_per_step // 2 * group_size)
    assert one["cache_bytes"] == cache_bytes(text, one["rows"], seq_len, torch.float32)
    assert (one["gathered_weights_bytes"], two["gathered_weights_bytes"]) == (0, weights)
    for result in estimates.values():
        assert result["peak_bytes"] == max(result["step_peak_bytes"], result["rollout"]["peak_bytes"])

    model = models.from_pretrained(snapshot, dtype=torch.float32, device="cpu")
    media = torch.Generator().manual_seed(1)
    image = [("image", (1, 4, 4))]  # the estimate's image: 2 x 2 merged patches
    prompt_tokens = seq_len - new_tokens - 6  # with the image's 4 tokens and its 2 markers
    prompts = [Prompt(*mm_sample([("text", 2), *image, ("text", prompt_tokens - 2)], media)) for _ in range(4)]
    assert {len(p.input_ids) for p in prompts} == {seq_len - new_tokens}
    settings = SamplingSettings(max_new_tokens=new_tokens, temperature=1.0, stop_token_ids=[])
    with torch.no_grad(), LiveBytes() as live:
        completions = rollout(model, prompts, group_size, settings)
    assert len(completions) == one["rows"] and max(c.length for c in completions) == new_tokens
    allocated = one["peak_bytes"] - one["resident_bytes"]
    assert 0 < live.peak <= allocated, (live.peak, one)
