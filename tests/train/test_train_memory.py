"""`vlmcore memory`: a training stage's peak memory per device, estimated on fake tensors.

The reference is the same training step on real tensors, counted by the same tracker: the
fake run must give every kind of memory to the byte. The rest checks what the estimate must
show: FSDP and TP divide the states, frozen modules hold no optimizer state, activation
checkpointing and shorter rows hold fewer activations.
"""

import json
import subprocess
import sys

import pytest
from helpers import ESTIMATES_DRIVER, command, env, estimates, write_config

from vlmcore.tiny import tiny_snapshot


@pytest.fixture(scope="module")
def configs(tmp_path_factory):
    root = tmp_path_factory.mktemp("memory")
    return {
        kind: write_config(
            root / f"{kind}.yaml",
            tiny_snapshot(kind, root / kind),
            root / f"out_{kind}",
            data={"kind": "random", "seq_len": 96, "segments": 2},
        )
        for kind in ("qwen3", "qwen3_vl", "qwen3_5", "qwen3_moe")
    }


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_vl", "qwen3_5", "qwen3_moe"])
def test_fake_run_counts_what_the_real_run_holds(configs, kind):
    # bf16 compute, two micro-batches (unsynced gradients held between them), selective AC.
    sets = ["precision.param_dtype=bfloat16", "grad_accum_steps=2", "parallel.activation_checkpointing=selective"]
    # Qwen3-VL also with rows holding a video of 2, then 4, frame groups instead of an image.
    videos = (
        [[sets, 1, 96, 2, True, 2], [sets, 1, 96, 2, False, 2], [sets, 1, 96, 2, True, 4]] if kind == "qwen3_vl" else []
    )
    fake, real, *video = estimates(configs[kind], [sets, 1, 96, 2, True], [sets, 1, 96, 2, False], *videos)
    assert fake["peak_bytes_by_kind"] == real["peak_bytes_by_kind"]
    assert fake["peak_bytes"] == real["peak_bytes"] > 0
    assert fake["fake"] and not real["fake"]
    # The step's micro-batches are on the device for the whole step: at least the input ids and
    # labels (int64) of both count as inputs.
    assert fake["peak_bytes_by_kind"]["Inputs"] >= 2 * 2 * 96 * 8
    if video:
        video_fake, video_real, longer = video
        assert video_fake["peak_bytes_by_kind"] == video_real["peak_bytes_by_kind"] and video_fake["video_frames"] == 2
        assert longer["peak_bytes_by_kind"]["Activation"] > video_fake["peak_bytes_by_kind"]["Activation"]


def test_moe_estimate_needs_the_grouped_gemm_dtype(configs):
    proc = subprocess.run(
        [sys.executable, "-c", ESTIMATES_DRIVER, str(configs["qwen3_moe"]), json.dumps([[[], 1, 96, None, True]])],
        capture_output=True,
        text=True,
        env=env(),
        timeout=600,
    )
    assert proc.returncode != 0 and "precision.param_dtype: the memory estimate of a mixture-of-experts" in proc.stderr


def test_states_are_sharded_and_frozen_modules_hold_no_optimizer_state(configs, tmp_path):
    from vlmcore.models import build_model

    model = build_model(str(configs["qwen3_vl"].parent / "qwen3_vl"), device="meta")
    n_all = sum(p.numel() for p in model.parameters())
    n_merger = sum(p.numel() for n, p in model.named_parameters() if n.startswith("model.visual.merger."))
    frozen = ['trainable=["model.visual.merger.*"]']
    one, fsdp4, tp2, stage1 = estimates(
        configs["qwen3_vl"],
        [[], 1, 96, 2, True],
        [[], 4, 96, 2, True],
        [["parallel.tp=2"], 4, 96, 2, True],
        [frozen, 1, 96, 2, True],
    )
    kinds = [r["peak_bytes_by_kind"] for r in (one, fsdp4, tp2, stage1)]
    # fp32 weights; AdamW keeps two fp32 moments per trainable weight (plus a step count each).
    assert kinds[0]["Sharded Param"] == 4 * n_all
    assert 8 * n_all <= kinds[0]["OptState"] < 8 * n_all + 4096
    # FSDP over 4 ranks: a quarter of weights and optimizer state each (dim 0 padded to 4).
    assert kinds[0]["Sharded Param"] / 4 <= kinds[1]["Sharded Param"] < kinds[0]["Sharded Param"] / 4 * 1.05
    assert kinds[1]["OptState"] < kinds[0]["OptState"] / 4 * 1.05
    # dp 2 x tp 2 shards weights over 4 ranks too (the vision tower by FSDP over all 4).
    assert kinds[2]["Sharded Param"] < kinds[0]["Sharded Param"] / 4 * 1.3
    assert (fsdp4["dp_shard"], tp2["dp_shard"], tp2["tp"]) == (4, 2, 2)
    # Stage 1 trains the merger alone: optimizer state for it only.
    assert 8 * n_merger <= kinds[3]["OptState"] < 8 * n_merger + 4096
    assert stage1["peak_bytes"] < one["peak_bytes"]


def test_one_rank_cast_is_counted_with_a_compute_copy_of_every_weight(configs):
    """One rank in bf16 trains without FSDP units (vlmcore.parallel.fsdp.OneRankMixedPrecision): the
    estimate runs that path, with bf16 compute copies of all the weights (frozen ones included)
    held through the step, where FSDP2's units (`parallel.one_rank_cast: false`) hold one block's
    copy at a time. The fake run counts what the real one holds, frozen weights included."""
    from vlmcore.models import build_model

    model = build_model(str(configs["qwen3_vl"].parent / "qwen3_vl"), device="meta")
    n_all = sum(p.numel() for p in model.parameters())
    bf16 = ["precision.param_dtype=bfloat16", "grad_accum_steps=2"]
    stage1 = [*bf16, 'trainable=["model.visual.merger.*"]']
    fsdp2 = [*bf16, "parallel.one_rank_cast=false"]
    cast, fsdp, frozen_fake, frozen_real = estimates(
        configs["qwen3_vl"],
        [bf16, 1, 96, 2, True],
        [fsdp2, 1, 96, 2, True],
        [stage1, 1, 96, 2, True],
        [stage1, 1, 96, 2, False],
    )
    kinds = cast["peak_bytes_by_kind"]
    assert kinds["Unsharded Param"] == 2 * n_all
    assert fsdp["peak_bytes_by_kind"]["Unsharded Param"] < 2 * n_all
    for kind in ("Sharded Param", "OptState", "Inputs"):
        assert kinds[kind] == fsdp["peak_bytes_by_kind"][kind]
    assert kinds["Sharded Param"] == 4 * n_all
    # The peak is in the second micro-batch's backward: the first's fp32 gradients are held, the
    # second's bf16 ones are being made, and no second fp32 copy of them all (the cast is chunked).
    assert kinds["Sharded Grad"] == 4 * n_all and kinds["Unsharded Grad"] < 2 * n_all
    assert frozen_fake["peak_bytes_by_kind"] == frozen_real["peak_bytes_by_kind"]
    assert frozen_fake["peak_bytes_by_kind"]["Unsharded Param"] == 2 * n_all


def test_compiled_blocks_keep_what_aot_autograd_saves(configs):
    """`parallel.compile`: the blocks run as AOTAutograd partitions them (what inductor then fuses),
    so they keep less for backward than eager ones (benchmarks/compiled_activations.py); the fake
    run counts what a real run of the same compiled blocks holds, and the states are unchanged."""
    bf16 = ["precision.param_dtype=bfloat16"]
    compiled = [*bf16, "parallel.compile=true"]
    # Qwen3-VL: its vision blocks compiled too; the tiny model's peak is not where its blocks' activations are.
    fake, real = estimates(configs["qwen3_vl"], [compiled, 1, 96, 2, True], [compiled, 1, 96, 2, False])
    assert fake["compile"] and fake["peak_bytes_by_kind"] == real["peak_bytes_by_kind"]
    eager, fake, real = estimates(
        configs["qwen3"], [bf16, 1, 96, 2, True], [compiled, 1, 96, 2, True], [compiled, 1, 96, 2, False]
    )
    assert fake["compile"] and not eager["compile"]
    from vlmcore.train.memory import format_table

    assert "compute, compiled blocks" in format_table(fake) and "compute, eager" in format_table(eager)
    assert fake["peak_bytes_by_kind"] == real["peak_bytes_by_kind"]
    assert fake["peak_bytes_by_kind"]["Activation"] < 0.85 * eager["peak_bytes_by_kind"]["Activation"]
    for kind in ("Sharded Param", "OptState", "Inputs"):
        assert fake["peak_bytes_by_kind"][kind] == eager["peak_bytes_by_kind"][kind]


def test_checkpointing_and_shorter_rows_hold_fewer_activations(configs):
    none, selective, full, short = estimates(
        configs["qwen3"],
        [["parallel.activation_checkpointing=none"], 1, 192, 2, True],
        [["parallel.activation_checkpointing=selective"], 1, 192, 2, True],
        [["parallel.activation_checkpointing=full"], 1, 192, 2, True],
        [["parallel.activation_checkpointing=none"], 1, 96, 2, True],
    )
    act = [r["peak_bytes_by_kind"]["Activation"] for r in (none, selective, full, short)]
    assert act[2] < act[1] < act[0]
    assert act[3] < act[0] * 0.6


def test_moe_recompute_is_freed_layer_by_layer(configs, tmp_path):
    """Under full activation checkpointing a MoE layer's recomputed forward is freed once its
    backward is done: what backward holds beyond the states does not grow with the layers. (The
    routing its recompute kept held each recomputed layer's graph to the end of backward: 0.67 GiB
    per layer of Qwen3-VL-30B-A3B, 32 GiB of its estimated 68.)"""
    import transformers

    from vlmcore.tiny import MOE, TEXT

    transformers.Qwen3MoeConfig(
        **dict(TEXT, num_hidden_layers=4), **MOE, norm_topk_prob=True, tie_word_embeddings=False
    ).save_pretrained(tmp_path / "m")
    four = write_config(tmp_path / "c.yaml", tmp_path / "m", tmp_path / "out")
    sets = ["precision.param_dtype=bfloat16", "parallel.activation_checkpointing=full"]
    (two,) = estimates(configs["qwen3_moe"], [sets, 1, 256, 2, False])
    real, fake = estimates(four, [sets, 1, 256, 2, False], [sets, 1, 256, 2, True])
    assert real["peak_bytes_by_kind"]["Temp"] == two["peak_bytes_by_kind"]["Temp"] > 0
    assert fake["peak_bytes_by_kind"] == real["peak_bytes_by_kind"]


def estimate_packed(config, tmp_path, limits: dict, world_size: int):
    """`vlmcore memory` of `config` on a packed dataset whose pack_config.json is `limits`:
    (the process, its JSON estimate)."""
    packed = tmp_path / "packed"
    packed.mkdir()
    (packed / "pack_config.json").write_text(json.dumps(limits))
    out = tmp_path / "estimate.json"
    proc = subprocess.run(
        command(
            1,
            "memory",
            str(config),
            "--world-size",
            str(world_size),
            "--set",
            f"data_path={packed}",
            "--set",
            "data.kind=packed",
            "--json",
            str(out),
        ),
        capture_output=True,
        text=True,
        env=env(),
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc, json.loads(out.read_text())


def test_cli_takes_the_row_shape_from_the_packed_dataset(configs, tmp_path):
    proc, result = estimate_packed(configs["qwen3_vl"], tmp_path, {"seq_len": 160, "max_patches": 144}, 2)
    # 144 patches at most: a 12x12-patch image, 6x6 merged (spatial merge 2).
    assert (result["seq_len"], result["image_side"], result["dp_shard"]) == (160, 6, 2)
    assert "rank 0 of 2 (dp_replicate 1 x dp_shard 2 x tp 1), 1 x 160 tokens" in proc.stdout
    total = next(line for line in proc.stdout.splitlines() if line.startswith("total")).split()
    assert total[0] == "total" and float(total[1]) == pytest.approx(result["peak_bytes"] / 2**20, abs=0.01)


def test_a_packed_dataset_with_videos_is_estimated_with_its_longest_clip(configs, tmp_path):
    """pack_config.json's `video_groups` (the longest clip's frame groups, written by the pack):
    the estimate's row holds a video that long, its frames sharing the patch budget."""
    proc, result = estimate_packed(
        configs["qwen3_vl"], tmp_path, {"seq_len": 160, "max_patches": 144, "video_groups": 3}, 1
    )
    # 3 frame groups of 48 patches at most: 6x6-patch frames, 3x3 merged.
    assert (result["video_frames"], result["image_side"]) == (3, 3)
    assert "video of 3 frame groups" in proc.stdout


def test_cli_names_what_does_not_fit(configs, tmp_path, capsys):
    from vlmcore.cli import main

    assert main(["memory", str(configs["qwen3"]), "--world-size", "3", "--set", "parallel.tp=2"]) == 2
    assert (
        "parallel: dp_replicate (1) x dp_shard (-1) x tp (2) does not fit the world size 3" in capsys.readouterr().err
    )
    assert main(["memory", str(configs["qwen3"]), "--world-size", "1", "--set", f"model_path={tmp_path}"]) == 2
    assert f"model_path: {tmp_path}/config.json not found" in capsys.readouterr().err
    assert main(["memory", str(configs["qwen3"]), "--world-size", "1", "--gpu-memory-gib", "0"]) == 2
    assert "--gpu-memory-gib: must be positive, got 0.0" in capsys.readouterr().err
    assert main(["memory", str(configs["qwen3"]), "--world-size", "1", "--host-memory-gib", "-1"]) == 2
    assert "--host-memory-gib: must be positive, got -1.0" in capsys.readouterr().err
    assert main(["memory", str(configs["qwen3"]), "--world-size", "1", "--host-memory-gib", "8"]) == 2
    assert "--host-memory-gib: checked beside --gpu-memory-gib, which is not given" in capsys.readouterr().err


def test_gpu_memory_check_says_what_to_change(configs, tmp_path):
    """--gpu-memory-gib: exit 0 and 'fits' under the usable memory (10% kept free), exit 1 above
    it with what does not fit and what to change; the estimate is written either way."""
    runs = {}
    for name, gib in (("roomy", 1.0), ("tight", None)):
        out = tmp_path / f"{name}.json"
        if gib is None:  # just under the peak once 10% is kept free
            gib = json.loads(runs["roomy"][1].read_text())["peak_bytes"] / 2**30 / 0.9 * 0.99
        proc = subprocess.run(
            command(
                1,
                "memory",
                str(configs["qwen3_vl"]),
                "--world-size",
                "1",
                "--set",
                "micro_batch_size=4",
                "--gpu-memory-gib",
                str(gib),
                "--json",
                str(out),
            ),
            capture_output=True,
            text=True,
            env=env(),
            timeout=300,
        )
        runs[name] = proc, out
    roomy, tight = (json.loads(runs[n][1].read_text()) for n in ("roomy", "tight"))
    assert runs["roomy"][0].returncode == 0 and roomy["fits"] and roomy["usable_bytes"] == int(0.9 * 2**30)
    assert "fits: " in runs["roomy"][0].stdout and "usable on a 1 GiB GPU" in runs["roomy"][0].stdout
    proc = runs["tight"][0]
    assert proc.returncode == 1 and not tight["fits"] and tight["peak_bytes"] == roomy["peak_bytes"]
    assert "DOES NOT FIT" in proc.stdout
    error = proc.stderr.strip().splitlines()[-1]
    assert error.startswith(f"error: {configs['qwen3_vl']}: estimated peak") and "largest: " in error
    # The tiny model's activations outweigh its states: checkpointing and smaller micro-batches first.
    assert "parallel.activation_checkpointing: selective (now none)" in error
    assert "micro_batch_size: 2 with twice the grad_accum_steps (now 4)" in error
    assert "more ranks to shard over, or tensor parallel (now dp_shard 1 x tp 1)" in error


def test_chunked_loss_never_holds_the_full_logits(tmp_path):
    """32k vocabulary, 512 tokens: the fp32 logits of the row alone take 64 MiB. Chunks of 64
    tokens hold 7/8 of that less at the peak than one chunk of the whole row (whose softmax and
    gradient are computed in the logits' own buffer)."""
    import transformers

    from vlmcore.tiny import TEXT

    transformers.Qwen3Config(**dict(TEXT, vocab_size=32768), tie_word_embeddings=True).save_pretrained(tmp_path / "m")
    config = write_config(tmp_path / "c.yaml", tmp_path / "m", tmp_path / "out")
    logits = 512 * 32768 * 4
    chunked, whole = estimates(
        config, [["loss_chunk_tokens=64"], 1, 512, 2, True], [["loss_chunk_tokens=512"], 1, 512, 2, True]
    )
    assert whole["peak_bytes"] - chunked["peak_bytes"] > 0.9 * logits * 7 / 8
    assert logits < whole["peak_bytes_by_kind"]["Activation"] < 1.5 * logits  # the logits, once


def test_offload_moves_the_states_to_host_memory_and_bf16_moments_halve_them(configs):
    """`parallel.offload`: the weights' shards, their gradients and AdamW's state leave the device's
    peak for the host memory line; `optimizer.moments_dtype: bfloat16`: 4 bytes of state a weight."""
    from vlmcore.models import build_model

    n_all = sum(
        p.numel() for p in build_model(str(configs["qwen3_vl"].parent / "qwen3_vl"), device="meta").parameters()
    )
    offload = ["parallel.offload=true", "parallel.one_rank_cast=false"]
    fake, real, fsdp4, offload4, moments, staged = estimates(
        configs["qwen3_vl"],
        [offload, 1, 96, 2, True],
        [offload, 1, 96, 2, False],
        [[], 4, 96, 2, True],
        [offload, 4, 96, 2, True],
        [["optimizer.moments_dtype=bfloat16"], 4, 96, 2, True],
        [["checkpoint.async=true"], 4, 96, 2, True],
    )
    # An async checkpoint's host copy: the rank's weights and optimizer state, beside the device's peak.
    kinds = fsdp4["peak_bytes_by_kind"]
    assert staged["host_bytes_by_kind"] == {"Checkpoint staging": kinds["Sharded Param"] + kinds["OptState"]}
    assert staged["peak_bytes"] == fsdp4["peak_bytes"]
    assert fake["peak_bytes_by_kind"] == real["peak_bytes_by_kind"] and fake["host_bytes"] == real["host_bytes"]
    # The states leave the device: what it holds at its fullest is at most the peak without them.
    states = kinds["Sharded Param"] + kinds["OptState"]
    assert fsdp4["host_bytes"] == 0 and not offload4["peak_bytes_by_kind"].get("OptState")
    assert 0 < offload4["peak_bytes"] <= fsdp4["peak_bytes"] - states
    assert offload4["peak_bytes_by_kind"]["Activation"] == kinds["Activation"]
    # The host holds the shards, the optimizer state and at the end of backward every gradient (the
    # fake run counts a unit's reduce-scatter output there as well, below another set of gradients).
    offloaded = offload4["host_bytes_by_kind"]["Offloaded states"]
    assert states + kinds["Sharded Param"] * 0.9 <= offloaded <= states + kinds["Sharded Param"] * 2
    # Two bf16 moments a weight, a quarter of the weights on each of 4 ranks (dim 0 padded).
    assert 4 * n_all / 4 <= moments["peak_bytes_by_kind"]["OptState"] < 4 * n_all / 4 * 1.05
    assert moments["peak_bytes_by_kind"]["OptState"] < kinds["OptState"] * 0.55


def test_offloaded_peak_starts_from_the_device_not_the_entrys_whole_total(one_process_group):
    """With `parallel.offload` the device's peak leaves out the weights' shards, which torch's tracker
    counts from its entry on. On a model whose shards outweigh everything else a step holds (as
    Qwen3-VL-30B-A3B's do: 31 GB a rank, against 9 GB of gathered units and activations), the peak
    is the step's, with its gathered weights, not the inputs alone that the entry held beside them."""
    import torch
    from torch import nn
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    from vlmcore.train.memory import OFFLOADED
    from vlmcore.train.peak_tracker import PeakTracker

    width, layers = 256, 8
    model = nn.Sequential(*(nn.Linear(width, width, bias=False) for _ in range(layers)))
    for layer in model:
        fully_shard(layer, offload_policy=CPUOffloadPolicy(pin_memory=False))
    fully_shard(model, offload_policy=CPUOffloadPolicy(pin_memory=False))
    optimizer = torch.optim.AdamW(model.parameters())
    inputs = torch.randn(2, width)
    tracker = PeakTracker(model, optimizer, [])
    tracker.host_kinds = OFFLOADED
    tracker.track_inputs((inputs,))
    with tracker:
        model(inputs).sum().backward()
        optimizer.step()
    peak = {
        str(getattr(k, "value", k)): n for k, n in tracker.get_tracker_snapshot("peak")[torch.device("cpu")].items()
    }
    one_layer = width * width * 4
    # The shards (8 layers) stayed above the device's figures all step: the peak read as the entry's.
    assert peak["Total"] - sum(peak.get(kind, 0) for kind in OFFLOADED) > 1.5 * one_layer, peak
    assert peak["Unsharded Param"] >= one_layer, peak
    assert tracker.host_peak >= layers * one_layer * 3  # the shards, their gradients and AdamW's two moments


def test_host_memory_check_counts_what_offload_keeps_on_the_host(configs, tmp_path, capsys):
    """--host-memory-gib beside --gpu-memory-gib: with `parallel.offload` the host holds the states;
    exit 0 and 'host memory fits' under the host's usable share (10% kept free), exit 1 above it
    naming the host memory and what would shrink it; without offload the host holds nothing."""
    from vlmcore.cli import main

    offload = ["--set", "parallel.offload=true", "--set", "parallel.one_rank_cast=false"]
    args = ["memory", str(configs["qwen3_vl"]), "--world-size", "1", *offload, "--gpu-memory-gib", "1"]
    assert main([*args, "--host-memory-gib", "1", "--json", str(tmp_path / "roomy.json")]) == 0
    roomy = json.loads((tmp_path / "roomy.json").read_text())
    assert "host memory fits: " in capsys.readouterr().out
    assert roomy["fits"] and roomy["host_fits"] and roomy["usable_host_bytes"] == int(0.9 * 2**30)
    tight_gib = roomy["host_bytes"] / 2**30 / 0.9 * 0.99  # just under what the host holds, 10% kept free
    assert main([*args, "--host-memory-gib", str(tight_gib)]) == 1
    out, err = capsys.readouterr()
    assert "HOST MEMORY DOES NOT FIT" in out and "fits: " in out  # the GPU's part still fits
    error = err.strip().splitlines()[-1]
    assert error.startswith(f"error: {configs['qwen3_vl']}: estimated host memory") and "Offloaded states" in error
    assert "optimizer.moments_dtype: bfloat16" in error
