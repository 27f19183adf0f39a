"""Rows with videos through the train step (random data, one process): the videos reach the
vision tower, their FLOPs and patches are counted, and the settings are checked."""

import pytest
import torch

from vlmcore.config import ConfigError, from_dict
from vlmcore.models import build_model
from vlmcore.tiny import hf_config
from vlmcore.train.metrics_log import batch_flops
from vlmcore.train.module_timer import ModuleTimer
from vlmcore.train.random_data import RandomBatches
from vlmcore.train.step import forward_backward


def video_batch(config, seed=0):
    data = RandomBatches(
        config,
        seq_len=64,
        segments=2,
        image_fraction=0.0,
        video_fraction=1.0,
        video_frames=3,
        micro_batch_size=2,
        dp_rank=0,
        dp_world=1,
        grad_accum_steps=1,
        seed=seed,
    )
    return data.batch(0)


@pytest.mark.parametrize("kind", ["qwen3_vl", "qwen3_5"])
def test_a_video_only_batch_trains_the_vision_tower(kind):
    torch.manual_seed(0)
    config = hf_config(kind)
    model = build_model(config, device="cpu")
    batch = video_batch(config)
    assert batch.images is None and batch.videos.grids() == [[3, 4, 4], [3, 4, 4]]
    assert int((batch.input_ids == config.video_token_id).sum()) == 2 * 3 * 4  # 3 groups of 2x2 merged patches
    timer = ModuleTimer(model, torch.device("cpu"))
    loss, _, _ = forward_backward(model, [batch], batch.label_tokens, None, chunk_tokens=64)
    assert model.model.visual.patch_embed.proj.weight.grad.abs().sum() > 0
    assert timer.read()["vision_patches"] == 2 * 3 * 16
    # The loss depends on the video's pixels.
    other = batch.map_tensors(lambda t: t)
    other.videos = other.videos.map_tensors(lambda t: t + 1.0 if t.is_floating_point() else t)
    other_loss, _, _ = forward_backward(model, [other], batch.label_tokens, None, chunk_tokens=64)
    assert abs(other_loss.item() - loss.item()) > 1e-6


def test_video_flops_count_every_frame_group():
    config = hf_config("qwen3_vl")
    batch = video_batch(config)
    _, vision = batch_flops(config, batch)
    frames = batch.map_tensors(lambda t: t)
    frames.images, frames.videos = frames.videos, None  # the same grids as images: the same tower work
    assert vision > 0 and vision == batch_flops(config, frames)[1]


def test_video_settings_are_checked():
    from vlmcore.parallel.checks import check_run

    data = {"kind": "random", "seq_len": 32, "segments": 2, "video_fraction": 0.5, "video_frames": 2}
    # 2 groups x (4 tokens + timestamp 3 + start and end) + 2 = 20 tokens: not in a 16-token segment.
    with pytest.raises(ConfigError, match=r"data.video_frames: must leave room for a video"):
        from_dict({"model_path": "m", "output_dir": "o", "data": data})
    # Disjoint layouts carry videos (tests/distributed/test_parallel_exactness.py runs one against one process).
    cfg = from_dict(
        {
            "model_path": "m",
            "output_dir": "o",
            "data": {**data, "seq_len": 40},
            "parallel": {"modules": {"vision": {"ranks": [0, 1]}, "language": {"ranks": [1, 2]}}},
        }
    )
    assert check_run(cfg, 2, hf_config("qwen3_vl")).disjoint
