"""One rank with a compute dtype (bf16, as on one GPU): no FSDP units; the weights are cast for the
forward in one multi-tensor copy and the gradients back in one (vlmcore.parallel.fsdp.
OneRankMixedPrecision), with FSDP2's arithmetic: the same losses, gradient norms and weights, bit
for bit, as FSDP2 over the one rank (`parallel.one_rank_cast: false`), which casts and copies each
weight alone."""

import itertools
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import env, load_dcp, train, write_config
from safetensors.torch import load_file
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from vlmcore.tiny import tiny_snapshot

REPO = Path(__file__).resolve().parents[2]


def one_rank_run(config: Path, fsdp2: bool):
    """The run of `config` on this one rank, loaded and ready to step, in training mode; `fsdp2`:
    with FSDP2 units (`parallel.one_rank_cast: false`) instead of the one-rank cast."""
    from vlmcore.config import load_config
    from vlmcore.models import load_hf_config
    from vlmcore.parallel.checks import check_run
    from vlmcore.train.build import build_meta_run

    cfg = load_config(config, [f"parallel.one_rank_cast={str(not fsdp2).lower()}"])
    run = build_meta_run(cfg, check_run(cfg, 1, load_hf_config(cfg.model_path)), torch.device("cpu"), 0)
    run.materialize(load=True)
    run.make_step()
    run.model.train()
    assert isinstance(run.model, FSDPModule) == fsdp2
    return run


def random_batches(run, image_fraction: float, grad_accum_steps: int):
    """Random rows of 64 tokens in 2 segments for `run`'s model, one rank's."""
    from vlmcore.train.random_data import RandomBatches

    return RandomBatches(
        run.model.config,
        seq_len=64,
        segments=2,
        image_fraction=image_fraction,
        micro_batch_size=1,
        dp_rank=0,
        dp_world=1,
        grad_accum_steps=grad_accum_steps,
        seed=0,
    )


def train_steps(config: Path, fsdp2: bool, steps: int) -> tuple[list[float], list[float], dict]:
    """`steps` optimizer steps of 2 micro-batches each on one rank: (losses, gradient norms, the
    weights after them, unsharded), and the model's kind checked on the way."""
    run = one_rank_run(config, fsdp2)
    # Micro-batches with and without images (the vision tower's dummy run).
    batches = iter(random_batches(run, image_fraction=0.5, grad_accum_steps=2))
    losses = []
    norms = []
    for _ in range(steps):
        micro = list(itertools.islice(batches, 2))
        label_tokens = sum(b.label_tokens for b in micro)
        result = run.step(micro, label_tokens, set_lr=lambda optimizer: None)
        assert result.applied
        losses.append(result.loss_sum)
        norms.append(result.grad_norm)
    weights = {}
    for name, weight in run.model.named_parameters():
        full = weight.full_tensor() if isinstance(weight, DTensor) else weight
        assert full.dtype == torch.float32, name  # the weights the optimizer steps, between steps
        weights[name] = full.detach().clone()
    return losses, norms, weights


@pytest.mark.parametrize("checkpointing", ["none", "full"])
def test_one_rank_bf16_trains_as_fsdp2_on_one_rank(tmp_path, one_process_group, one_thread, checkpointing):
    """Qwen3-VL with images in some micro-batches, 2 micro-batches a step (gradients added in
    fp32 between them), with and without activation checkpointing (the recompute casts its
    inputs again): bit for bit FSDP2's one-rank results over 3 steps."""
    snapshot = tiny_snapshot("qwen3_vl", tmp_path / "model")
    config = write_config(
        tmp_path / "c.yaml",
        snapshot,
        tmp_path / "out",
        grad_accum_steps=2,
        precision={"param_dtype": "bfloat16", "reduce_dtype": "float32"},
        parallel={"activation_checkpointing": checkpointing},
    )
    cast_once = train_steps(config, fsdp2=False, steps=3)
    fsdp2 = train_steps(config, fsdp2=True, steps=3)
    assert cast_once[0] == fsdp2[0]
    assert cast_once[1] == fsdp2[1]
    assert cast_once[2].keys() == fsdp2[2].keys()
    for name, weight in cast_once[2].items():
        assert torch.equal(weight, fsdp2[2][name]), name
    # The steps trained: bf16 compute moved the loss.
    assert cast_once[0][0] != cast_once[0][-1]


def test_a_forward_without_gradients_before_a_backward_leaves_it_alone(tmp_path, one_process_group):
    """A no-grad forward (a DPO reference's, an evaluation's) between a forward and its backward
    runs on the compute copies and leaves them held: the backward, whose checkpointed blocks
    recompute their forward, gives the gradients it gives without it; after it the modules hold
    the fp32 weights, with fp32 gradients."""
    from vlmcore.train.step import forward_hidden

    snapshot = tiny_snapshot("qwen3_vl", tmp_path / "model")
    bf16 = {"param_dtype": "bfloat16", "reduce_dtype": "float32"}
    config = write_config(
        tmp_path / "c.yaml", snapshot, tmp_path / "out", precision=bf16, parallel={"activation_checkpointing": "full"}
    )
    run = one_rank_run(config, fsdp2=False)
    batch = next(iter(random_batches(run, image_fraction=1.0, grad_accum_steps=1)))
    grads = []
    for forward_between in (False, True):
        hidden = forward_hidden(run.model, batch)
        assert run.model.lm_head.weight.dtype == torch.bfloat16
        if forward_between:
            with torch.no_grad():
                forward_hidden(run.model, batch)
            assert run.model.lm_head.weight.dtype == torch.bfloat16
        hidden.float().square().mean().backward()
        weights = dict(run.model.named_parameters())
        assert all(w.dtype == torch.float32 for w in weights.values())
        grads.append({name: w.grad.clone() for name, w in weights.items() if w.grad is not None})
        run.optimizer.zero_grad(set_to_none=True)
    assert grads[0] and grads[0].keys() == grads[1].keys()
    assert all(g.dtype == torch.float32 and torch.equal(g, grads[1][name]) for name, g in grads[0].items())


def test_a_frozen_model_forwards_as_fsdp2_on_one_rank(tmp_path, one_process_group):
    """A model that never trains (a DPO reference copy), forward after forward without gradients:
    the hidden states FSDP2's one-rank path gives, bit for bit, with its weights in fp32 between
    forwards (its compute copies are made for each forward)."""
    from vlmcore.train.step import forward_hidden

    snapshot = tiny_snapshot("qwen3_vl", tmp_path / "model")
    config = write_config(tmp_path / "c.yaml", snapshot, tmp_path / "out", precision={"param_dtype": "bfloat16"})
    outputs = {}
    for fsdp2 in (False, True):
        run = one_rank_run(config, fsdp2)
        for weight in run.model.parameters():
            weight.requires_grad_(False)
        run.model.eval()
        batches = iter(random_batches(run, image_fraction=0.5, grad_accum_steps=1))
        with torch.no_grad():
            outputs[fsdp2] = [forward_hidden(run.model, next(batches)) for _ in range(3)]
        if not fsdp2:
            assert all(w.dtype == torch.float32 for w in run.model.parameters())
    for cast_once, fsdp2 in zip(outputs[False], outputs[True], strict=True):
        assert cast_once.dtype == torch.bfloat16 and torch.equal(cast_once, fsdp2)


def loaded_state(nproc: int, config: Path, out_file: Path) -> dict[str, torch.Tensor]:
    """The model and optimizer state of `config`'s latest checkpoint as `nproc` processes load it
    (tests/helpers.py dump-state), unsharded."""
    args = [str(REPO / "tests" / "helpers.py"), "dump-state", str(config), str(out_file)]
    if nproc == 1:
        cmd = [sys.executable, *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env(), check=False)
    assert proc.returncode == 0, proc.stderr[-5000:]
    return load_file(out_file)


@pytest.mark.slow
def test_one_rank_bf16_checkpoint_reshards_to_two_ranks(tmp_path):
    """In bf16 a one-rank run's checkpoint (plain tensors) loads on 2 FSDP ranks: the model and
    optimizer state the writer finished with. (2 ranks' in bf16 on one: tests/distributed/test_train_checkpoint.py.)"""
    snapshot = tiny_snapshot("qwen3_vl", tmp_path / "model")
    bf16 = {"param_dtype": "bfloat16", "reduce_dtype": "float32"}
    out = tmp_path / "written_by_one"
    config = write_config(tmp_path / "one.yaml", snapshot, out, steps=2, precision=bf16)
    train(1, config)
    state = loaded_state(2, config, tmp_path / "read_by_two.safetensors")
    assert int(state["train.step"]) == 2 and any(k.endswith("exp_avg_sq") for k in state)
    final = load_dcp(out / "final")
    assert final and all(torch.equal(state[k], final[k]) for k in final)
