import math

import pytest
from torch import nn

from vlmcore.config import ConfigError, OptimizerConfig, ScheduleConfig
from vlmcore.models.parts import VisionLanguageParts
from vlmcore.train.optim import freeze, lr_factor, param_groups


def test_cosine_warmup_then_decay_to_min():
    cfg = ScheduleConfig(name="cosine", warmup_steps=4, min_lr_ratio=0.1)
    values = [lr_factor(cfg, step, 14) for step in range(1, 15)]
    assert values[:4] == [0.25, 0.5, 0.75, 1.0]  # never 0 at the first step
    # halfway through the 10 decay steps the cosine is at its midpoint
    assert values[8] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 5 / 10)))
    assert values[-1] == pytest.approx(0.1)
    assert all(a > b for a, b in zip(values[3:], values[4:]))


@pytest.mark.parametrize("cooldown, halfway", [("linear", 0.5), ("cosine", 0.5), ("1-sqrt", 1 - math.sqrt(0.5))])
def test_wsd_is_flat_then_cools_down(cooldown, halfway):
    cfg = ScheduleConfig(name="wsd", warmup_steps=2, decay_fraction=0.2, cooldown=cooldown, min_lr_ratio=0.0)
    values = [lr_factor(cfg, step, 100) for step in range(1, 101)]
    assert values[:2] == [0.5, 1.0]
    assert values[2:80] == [1.0] * 78  # stable until the last 20 steps
    assert values[89] == pytest.approx(halfway)  # step 90: 10 of 20 cooldown steps done
    assert values[-1] == pytest.approx(0.0)


def test_wsd_in_samples():
    cfg = ScheduleConfig(
        name="wsd",
        unit="samples",
        warmup_samples=100,
        total_samples=1000,
        decay_fraction=0.5,
        cooldown="linear",
        min_lr_ratio=0.2,
    )
    assert lr_factor(cfg, 50, 1000) == 0.5
    assert lr_factor(cfg, 400, 1000) == 1.0
    assert lr_factor(cfg, 750, 1000) == pytest.approx(0.2 + 0.8 * 0.5)
    assert lr_factor(cfg, 1200, 1000) == pytest.approx(0.2)  # past the end: stays at the minimum


def test_constant():
    cfg = ScheduleConfig(name="constant", warmup_steps=2)
    assert [lr_factor(cfg, s, 10) for s in (1, 2, 3, 10)] == [0.5, 1.0, 1.0, 1.0]


class TinyVLM(VisionLanguageParts, nn.Module):
    """Parameter names and parts as in Qwen3-VL."""

    def __init__(self):
        super().__init__()
        self.model = nn.Module()
        self.model.visual = nn.Module()
        self.model.visual.blocks = nn.ModuleList([nn.Linear(4, 4)])
        self.model.visual.pos_embed = nn.Embedding(4, 4)
        self.model.visual.merger = nn.Sequential(nn.LayerNorm(4), nn.Linear(4, 8))
        self.model.visual.deepstack_merger_list = nn.ModuleList()
        self.model.language_model = nn.Module()
        self.model.language_model.embed_tokens = nn.Embedding(10, 8)
        self.model.language_model.layers = nn.ModuleList([nn.Linear(8, 8)])
        self.model.language_model.norm = nn.LayerNorm(8)
        self.lm_head = nn.Linear(8, 10, bias=False)


def test_param_groups_by_kind_and_decay():
    model = TinyVLM()
    cfg = OptimizerConfig(lr=1.0, vision_lr=0.1, projector_lr=0.5, weight_decay=0.01)
    groups = {g["name"]: g for g in param_groups(model, cfg)}
    names = {id(p): n for n, p in model.named_parameters()}
    members = {k: sorted(names[id(p)] for p in g["params"]) for k, g in groups.items()}
    assert members["llm"] == ["lm_head.weight", "model.language_model.layers.0.weight"]
    assert members["llm_no_decay"] == [
        "model.language_model.embed_tokens.weight",
        "model.language_model.layers.0.bias",
        "model.language_model.norm.bias",
        "model.language_model.norm.weight",
    ]
    assert members["vision"] == ["model.visual.blocks.0.weight"]
    assert "model.visual.pos_embed.weight" in members["vision_no_decay"]
    assert members["projector"] == ["model.visual.merger.1.weight"]
    assert (groups["vision"]["lr"], groups["projector"]["lr"], groups["llm"]["lr"]) == (0.1, 0.5, 1.0)
    assert groups["llm_no_decay"]["weight_decay"] == 0.0 and groups["llm"]["weight_decay"] == 0.01


def test_freeze_by_patterns():
    model = TinyVLM()
    assert freeze(model, ["model.visual.merger.*"]) == 4
    trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    assert trainable == [
        "model.visual.merger.0.bias",
        "model.visual.merger.0.weight",
        "model.visual.merger.1.bias",
        "model.visual.merger.1.weight",
    ]
    groups = param_groups(model, OptimizerConfig())
    assert {g["name"] for g in groups} == {"projector", "projector_no_decay"}
    with pytest.raises(ConfigError, match=r"model\.visul\.\*"):
        freeze(model, ["model.visul.*"])
    freeze(model, [])
    assert all(p.requires_grad for p in model.parameters())


class Position:
    """A data stream's resumable position, as the loader's state_dict gives it."""

    def __init__(self):
        self.consumed = 0

    def state_dict(self):
        return {"consumed": self.consumed}

    def load_state_dict(self, state):
        self.consumed = state["consumed"]


def test_resume_keeps_the_configured_group_settings(tmp_path, one_process_group):
    """The checkpoint's optimizer states are loaded, its group settings are not: they are kept by
    group index, which ranks holding different modules share (disjoint layouts), so a resume took
    another rank's settings or AdamW's defaults, and the fused kernel was lost. Here the run that
    wrote the checkpoint had other settings and the multi-tensor kernel."""
    import torch

    from vlmcore.parallel.layout import BatchSplit
    from vlmcore.train.checkpoint import Checkpointer, resume, rng_state
    from vlmcore.train.optim import build_optimizer
    from vlmcore.train.state import TrainState

    torch.manual_seed(0)
    model = TinyVLM()
    other = OptimizerConfig(lr=0.5, vision_lr=0.2, weight_decay=0.3, betas=[0.8, 0.9], eps=1e-6)
    written = torch.optim.AdamW(param_groups(model, other), fused=False, foreach=True)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    written.step()
    written.zero_grad(set_to_none=True)
    data = Position()
    data.consumed = 7
    split = BatchSplit(world_size=1, dp_replicate=1, dp_shard=1, tp=1, grad_accum_steps=1, micro_batch_size=1)
    train_state = TrainState(split, step=1).state_dict()
    del train_state["data_rows"]  # a checkpoint without the rows consumed: they follow from its split
    Checkpointer(tmp_path, keep=1).save(
        1, model, written, train_state, {"rng": rng_state(), "loader": data.state_dict()}
    )

    cfg = OptimizerConfig(lr=1.0, vision_lr=0.1, projector_lr=0.5, weight_decay=0.01)
    optimizer = build_optimizer(model, cfg)
    built = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    state, data = TrainState(split), Position()
    resume(Checkpointer(tmp_path, keep=1), tmp_path / "checkpoints" / "step_1", model, optimizer, data, state)
    assert [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups] == built
    assert all(g["fused"] for g in optimizer.param_groups)
    assert state.step == 1 and data.consumed == 7
    for p in model.parameters():
        assert torch.equal(optimizer.state[p]["exp_avg"], written.state[p]["exp_avg"])
        assert torch.equal(optimizer.state[p]["exp_avg_sq"], written.state[p]["exp_avg_sq"])
