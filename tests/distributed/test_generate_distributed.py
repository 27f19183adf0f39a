"""vlmcore.generate on the model as parallelize leaves it, on 2 gloo processes, against one
process: FSDP2 with its weights gathered once for the rollout (the rollout strategy,
generate/parallel.py) and per layer as in training, tensor parallelism 2 with and without
sequence parallelism; Qwen3-VL with images and a video, Qwen3.5 (Gated DeltaNet), Qwen3 with tied
embeddings (the output layer on the embedding's vocabulary shards under TP); Qwen3-VL-MoE under
expert parallelism 2 with different prompts on each rank, one rank stopping early. Greedy tokens
equal, sampled tokens equal and their log-probabilities to 1e-5. Under FSDP2 and TP, GRPO's
rollout (vlmcore.train.rollout) too: its completions equal one process's, and its batch through
the parallel model's training forward gives back the recorded log-probabilities to 1e-5. One
torchrun launch for all cases; run by pytest, this file launches itself under torchrun."""

import json
import subprocess
import sys
from contextlib import nullcontext
from pathlib import Path

import torch

FAMILIES = ("qwen3_vl", "qwen3_5", "qwen3")
STRATEGIES = ("fsdp-gathered", "fsdp-per-layer", "tp", "tp-sequence-parallel")
# GRPO's rollout, its batch and the training forward on it (rollout_case), on these
ROLLOUT_STRATEGIES = ("fsdp-gathered", "tp")
ROLLOUT_TEMPERATURE = 0.7
PROMPTS = [
    [("text", 3), ("image", (1, 4, 4)), ("text", 2)],
    [("text", 6)],
    [("text", 2), ("video", (2, 4, 2)), ("text", 3)],
]


def parallel_model(path, strategy):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from vlmcore.config import PrecisionConfig
    from vlmcore.models import build_model, load_hf_weights
    from vlmcore.parallel.fsdp import apply_fsdp
    from vlmcore.parallel.tp import apply_tp

    model = build_model(path, device="meta")
    if strategy.startswith("fsdp"):
        mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp_shard",))
        apply_fsdp(model, list(model.decoder_layers()), model.vision_tower(), mesh, mesh, PrecisionConfig())
    else:
        mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
        apply_tp(model, mesh, sequence_parallel=strategy == "tp-sequence-parallel")
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights()
    load_hf_weights(model, path)
    return model.eval()


class count_all_gathers:  # noqa: N801 (a context manager, named as one)
    """Counts FSDP2's all-gathers (torch.distributed.all_gather_single, looked up at each call)."""

    def __enter__(self):
        import torch.distributed as dist

        self.count, self.original = 0, dist.all_gather_single

        def counted(*args, **kwargs):
            self.count += 1
            return self.original(*args, **kwargs)

        dist.all_gather_single = counted
        return self

    def __exit__(self, *exc):
        import torch.distributed as dist

        dist.all_gather_single = self.original


def rollout_case(model, reference, prompts) -> dict:
    """GRPO's rollout (vlmcore.train.rollout) on the parallel model against one process's, then
    its batch through the parallel model's training forward (as the train step runs it): the
    tokens equal, the recorded log-probabilities equal and recomputed by the training forward."""
    from vlmcore.data import IGNORE_INDEX
    from vlmcore.generate import SamplingSettings
    from vlmcore.train.loss import chunked_token_logps
    from vlmcore.train.rollout import rollout, rollout_batch
    from vlmcore.train.step import forward_hidden

    settings = SamplingSettings(max_new_tokens=5, temperature=ROLLOUT_TEMPERATURE, top_p=0.9)
    got = rollout(model, prompts, 2, settings)
    expected = rollout(reference, prompts, 2, settings)
    batch = rollout_batch(prompts, got, torch.ones(len(got)), model.config, seq_len=64).to(torch.device("cpu"))
    with torch.no_grad():
        hidden = forward_hidden(model, batch)
        logps = chunked_token_logps(hidden / ROLLOUT_TEMPERATURE, model.lm_head.weight, batch.labels)
    labelled = batch.labels.flatten() != IGNORE_INDEX
    return {
        "rollout_equal": [c.tokens for c in got] == [c.tokens for c in expected],
        "rollout_log_prob_diff": max(
            abs(a - b) for c, e in zip(got, expected) for a, b in zip(c.logps, e.logps, strict=True)
        ),
        "train_forward_diff": float((logps[labelled] - batch.rollout.old_logps.flatten()[labelled]).abs().max()),
    }


def expert_parallel_case(root: Path) -> dict:
    """Qwen3-VL-MoE under expert parallelism 2, each rank with prompts of its own (as the
    data-parallel ranks of a rollout): rank 0's rows all stop by their second token (its stop
    tokens), rank 1's run on to max_new_tokens, its MoE blocks' all-to-alls joined by rank 0's
    stand-in row. Each rank's generations, greedy and GRPO's rollout, equal one process's of the
    same prompts."""
    import torch.distributed as dist
    from helpers import mm_sample
    from torch.distributed.device_mesh import init_device_mesh

    from vlmcore.generate import Prompt, SamplingSettings, generate
    from vlmcore.models import build_model, from_pretrained, load_hf_weights
    from vlmcore.parallel.expert_parallel import apply_ep
    from vlmcore.train.rollout import rollout

    path, rank = root / "qwen3_vl_moe", dist.get_rank()
    generator = torch.Generator().manual_seed(10 + rank)
    prompts = [Prompt(*mm_sample(items, generator)) for items in (PROMPTS[:2] if rank == 0 else PROMPTS)]
    reference = from_pretrained(path, dtype=torch.float32, device="cpu").eval()
    greedy = SamplingSettings(max_new_tokens=6)
    if rank == 0:
        greedy.stop_token_ids = sorted({g.tokens[1] for g in generate(reference, prompts, greedy)})
    expected = generate(reference, prompts, greedy)
    model = build_model(path, device="meta")
    apply_ep(model, init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("ep",)))
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights()
    load_hf_weights(model, path)
    model.eval()
    got = generate(model, prompts, greedy)
    sampled = SamplingSettings(max_new_tokens=6, temperature=ROLLOUT_TEMPERATURE, stop_token_ids=greedy.stop_token_ids)
    rolled = rollout(model, prompts, 2, sampled)
    rolled_expected = rollout(reference, prompts, 2, sampled)
    return {
        "greedy_equal": [g.tokens for g in got] == [e.tokens for e in expected],
        "greedy_log_prob_diff": max(
            abs(a - b) for g, e in zip(got, expected) for a, b in zip(g.log_probs, e.log_probs, strict=True)
        ),
        "sampled_equal": [c.tokens for c in rolled] == [e.tokens for e in rolled_expected],
        "sampled_log_prob_diff": max(
            abs(a - b) for c, e in zip(rolled, rolled_expected) for a, b in zip(c.logps, e.logps, strict=True)
        ),
        "longest": max(len(g.tokens) for g in got),
    }


def worker(root: Path) -> None:
    import torch.distributed as dist
    from helpers import mm_sample

    from vlmcore.generate import Prompt, SamplingSettings, generate
    from vlmcore.generate.parallel import fsdp_modules, gathered_weights
    from vlmcore.models import from_pretrained
    from vlmcore.parallel.mesh import init_distributed

    init_distributed(torch.device("cpu"))
    greedy = SamplingSettings(max_new_tokens=6)
    sampled = SamplingSettings(max_new_tokens=6, temperature=0.8, top_k=30, n=2, seed=5)
    report = {}
    for kind in FAMILIES:
        path = root / kind
        generator = torch.Generator().manual_seed(1)
        specs = PROMPTS if kind != "qwen3" else [[("text", n)] for n in (5, 9, 2)]
        prompts = [Prompt(*mm_sample(items, generator)) for items in specs]
        reference = from_pretrained(path, dtype=torch.float32, device="cpu").eval()
        expected = {name: generate(reference, prompts, s) for name, s in (("greedy", greedy), ("sampled", sampled))}
        for strategy in STRATEGIES:
            model = parallel_model(path, strategy)
            rollout = gathered_weights(model) if strategy == "fsdp-gathered" else nullcontext()
            gathers = count_all_gathers()
            with gathers, rollout:
                got = {name: generate(model, prompts, s) for name, s in (("greedy", greedy), ("sampled", sampled))}
            case = {"all_gathers": gathers.count, "fsdp_units": len(fsdp_modules(model))}
            case["blocks"] = len(model.decoder_layers())
            for name in got:
                case[f"{name}_equal"] = [g.tokens for g in got[name]] == [g.tokens for g in expected[name]]
                case[f"{name}_log_prob_diff"] = max(
                    abs(a - b)
                    for g, e in zip(got[name], expected[name])
                    for a, b in zip(g.log_probs, e.log_probs, strict=True)
                )
            if strategy == "fsdp-gathered":  # resharded after the rollout, as training needs it
                case["resharded"] = all(type(p).__name__ == "DTensor" for p in model.decoder_layers()[0].parameters())
            if strategy in ROLLOUT_STRATEGIES:
                case.update(rollout_case(model, reference, prompts))
            report[f"{kind}-{strategy}-rank{dist.get_rank()}"] = case
    report[f"qwen3_vl_moe-ep-rank{dist.get_rank()}"] = expert_parallel_case(root)
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, report)
    if dist.get_rank() == 0:
        (root / "report.json").write_text(json.dumps({k: v for r in out for k, v in r.items()}))
    dist.destroy_process_group()


def test_generation_on_fsdp2_and_tp_equals_one_process(tmp_path):
    from helpers import env
    from transformers import (
        Qwen3_5ForConditionalGeneration,
        Qwen3ForCausalLM,
        Qwen3VLForConditionalGeneration,
        Qwen3VLMoeForConditionalGeneration,
    )

    from vlmcore.tiny import qwen3_5_config, qwen3_config, qwen3_vl_config, qwen3_vl_moe_config

    for kind, hf_class, config in [
        ("qwen3_vl", Qwen3VLForConditionalGeneration, qwen3_vl_config()),
        ("qwen3_5", Qwen3_5ForConditionalGeneration, qwen3_5_config()),
        ("qwen3", Qwen3ForCausalLM, qwen3_config(tied=True)),
        ("qwen3_vl_moe", Qwen3VLMoeForConditionalGeneration, qwen3_vl_moe_config()),
    ]:
        torch.manual_seed(0)
        hf_class(config).save_pretrained(tmp_path / kind)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", __file__, str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env())
    assert proc.returncode == 0, proc.stderr[-6000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert len(report) == (len(FAMILIES) * len(STRATEGIES) + 1) * 2
    assert sum("rollout_equal" in r for r in report.values()) == len(FAMILIES) * len(ROLLOUT_STRATEGIES) * 2
    # Under expert parallelism rank 0 stopped early and joined rank 1's steps until its end.
    assert report["qwen3_vl_moe-ep-rank0"]["longest"] <= 2 < report["qwen3_vl_moe-ep-rank1"]["longest"] == 6
    for case, r in report.items():
        assert r["greedy_equal"] and r["sampled_equal"], (case, r)
        assert r["greedy_log_prob_diff"] < 1e-5 and r["sampled_log_prob_diff"] < 1e-5, (case, r)
        assert r.get("resharded", True), case
        if "rollout_equal" in r:
            assert r["rollout_equal"] and r["rollout_log_prob_diff"] < 1e-5, (case, r)
            assert r["train_forward_diff"] < 1e-5, (case, r)
        # The rollout strategy gathers each FSDP2 unit once for both generations. Per layer, each
        # decoder block is gathered again at every forward, 6 per generation (the prefill and 5
        # steps); the root and the vision tower stay unsharded after their first.
        if "fsdp-gathered" in case:
            assert r["all_gathers"] == r["fsdp_units"], (case, r)
        elif "fsdp-per-layer" in case:
            assert r["all_gathers"] == 2 * 6 * r["blocks"] + r["fsdp_units"] - r["blocks"], (case, r)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    worker(Path(sys.argv[1]))
