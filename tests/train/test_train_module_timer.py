"""The vision tower and the LLM timed apart (vlmcore.train.module_timer): each part of forward
and backward is credited to the module that runs it, on the real model and the real
forward/backward of a training step; the switch turns them off in a real run."""

import time

import pytest
import torch
from helpers import read_metrics, train, write_config

from vlmcore.models import build_model
from vlmcore.tiny import hf_config, tiny_snapshot
from vlmcore.train.module_timer import ModuleTimer
from vlmcore.train.random_data import RandomBatches
from vlmcore.train.step import forward_backward

DELAY = 0.5  # seconds added to each of four places; the tiny model's own compute is a few ms (up to
# 0.7 s on a loaded 2-core machine, which 0.25 s did not leave room for below 6 * DELAY)


def batches(model, image_fraction: float, n: int, device: str = "cpu") -> list:
    data = RandomBatches(
        model.config,
        seq_len=32,
        segments=2,
        image_fraction=image_fraction,
        micro_batch_size=1,
        dp_rank=0,
        dp_world=1,
        grad_accum_steps=n,
        seed=0,
    )
    return [b.to(torch.device(device)) for b, _ in zip(data, range(n))]


def delay_forward_and_backward(module: torch.nn.Module) -> None:
    """Sleeps DELAY after the module's forward and again when its output's gradient arrives."""

    def hook(mod, args, output):
        time.sleep(DELAY)
        out = output[0] if isinstance(output, tuple) else output
        if out.requires_grad:
            out.register_hook(lambda grad: time.sleep(DELAY))

    module.register_forward_hook(hook)


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA events need a GPU")),
    ],
)
def test_each_part_is_credited_to_its_module(device):
    """On a GPU the host's sleeps leave the GPU idle between the events, so they are timed too."""
    torch.manual_seed(0)
    model = build_model(hf_config("qwen3_vl"), device=device)
    timer = ModuleTimer(model, torch.device(device))
    delay_forward_and_backward(model.vision_layers()[0])
    delay_forward_and_backward(model.decoder_layers()[0])
    micro = batches(model, image_fraction=1.0, n=2, device=device)
    assert all(b.images is not None for b in micro)
    label_tokens = sum(b.label_tokens for b in micro)

    start = time.perf_counter()
    loss, _, _ = forward_backward(model, micro, label_tokens, None, chunk_tokens=64)
    loss.item()  # the step's one host read
    wall = time.perf_counter() - start
    times = timer.read()
    # Two micro-batches, each with DELAY in the vision forward and backward and in the LLM's.
    assert 4 * DELAY <= times["vision_time_s"] < 6 * DELAY
    assert 4 * DELAY <= times["llm_time_s"] < 6 * DELAY
    assert 0.9 * wall <= times["vision_time_s"] + times["llm_time_s"] <= wall
    assert times["vision_patches"] == sum(b.images.pixel_values.shape[0] for b in micro)
    assert timer.read() == {"vision_time_s": 0.0, "llm_time_s": 0.0, "vision_patches": 0}  # read starts over

    with torch.no_grad():  # a forward without backward is left out
        model(micro[0].input_ids, pixel_values=micro[0].images.pixel_values, image_grid_thw=micro[0].images.grid_thw)
    assert timer.read() == {"vision_time_s": 0.0, "llm_time_s": 0.0, "vision_patches": 0}


def test_text_only_model_has_no_vision_time():
    model = build_model(hf_config("qwen3"), device="cpu")
    timer = ModuleTimer(model, torch.device("cpu"))
    micro = batches(model, image_fraction=0.0, n=1)
    forward_backward(model, micro, sum(b.label_tokens for b in micro), None, chunk_tokens=64)
    times = timer.read()
    assert times.keys() == {"llm_time_s"} and times["llm_time_s"] > 0


def test_a_run_without_module_times(tmp_path):
    """metrics.module_times: false leaves the fields out (a run with them on: test_train_loop.py,
    test_stage_outputs and test_text_and_hybrid_families_train)."""
    snapshot = tiny_snapshot("qwen3_vl", tmp_path / "model")
    train(
        1,
        write_config(
            tmp_path / "off.yaml",
            snapshot,
            tmp_path / "off",
            steps=1,
            save_final=False,
            checkpoint={"enabled": False},
            metrics={"tensorboard": False, "module_times": False},
        ),
    )
    metrics = read_metrics(tmp_path / "off")
    assert len(metrics) == 1 and not metrics[0].keys() & {"vision_time_s", "llm_time_s", "vision_patches"}
