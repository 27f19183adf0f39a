"""A GRPO stage through `vlmcore train`: prompts from a packed prompt dataset, rolled out by the
policy itself, scored by rewards in worker processes (a user's `module:function` among them, one
that fails on some completions and is counted, not fatal), one update per micro-batch split; the
first update of each rollout has ratio 1; a stage resumed between two updates of one rollout and
at a rollout's end equals the uninterrupted one."""

import subprocess

import pytest
import torch
import yaml
from helpers import command, cut_back, env, load_dcp, packed_prompt_dataset, read_metrics, train_cases

from vlmcore.tiny import run_config

STEPS = 4
UPDATES = 2

USER_REWARD = '''
def odd_length(completion, answer, sample):
    """1 for a completion of an odd number of characters: a signal a random policy's groups have."""
    return float(len(completion) % 2)


def broken(completion, answer, sample):
    return sample["no such field"]
'''


def grpo_config(root, out, grad_accum_steps=2):
    config = root / f"{out}.yaml"
    settings = run_config(
        root / "model",
        root / out,
        steps=STEPS,
        objective="grpo",
        data_path=str(root / "packed"),
        grad_accum_steps=grad_accum_steps,
        checkpoint={"interval": 1, "keep": 10},
        data={"kind": "packed", "seq_len": 256},
        grpo={
            "prompts_per_step": 4,
            "group_size": 2,
            "max_new_tokens": 6,
            "temperature": 1.0,
            "updates_per_rollout": UPDATES,
            "loss": "dapo",
            "epsilon_high": 0.28,
            "beta": 0.05,
            # The std of the whole step's rewards: on 2 ranks it takes both ranks' (one all-reduce),
            # so the 2-rank runs equal the one-process run only if that reduction is right.
            "scale_rewards": "batch",
            "rewards": [
                {"name": "exact_match"},
                {"name": "grpo_user_reward:odd_length", "weight": 0.5},
                {"name": "grpo_user_reward:broken"},
            ],
            "reward_workers": 1,
        },
        trainable=[],
    )
    config.write_text(yaml.safe_dump(settings))
    return config


def reward_env(extra_path) -> dict:
    run_env = env()
    run_env["PYTHONPATH"] = f"{run_env['PYTHONPATH']}:{extra_path}"
    return run_env


def train_grpo(root, out, extra_path) -> subprocess.CompletedProcess:
    config = grpo_config(root, out)
    proc = subprocess.run(
        command(1, "train", str(config)), capture_output=True, text=True, env=reward_env(extra_path), timeout=600
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


@pytest.fixture(scope="module")
def grpo_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("grpo_stage")
    packed_prompt_dataset(root, long_question=False)
    user = root / "user"
    user.mkdir()
    (user / "grpo_user_reward.py").write_text(USER_REWARD)
    train_grpo(root, "reference", user)
    # Resumed after step 1 (between the two updates of the first rollout) and after step 2 (at its end).
    for cut in (1, 2):
        cut_back(root / "reference", root / f"resumed{cut}", cut)
        train_grpo(root, f"resumed{cut}", user)
    # On 2 FSDP2 ranks in one launch: the whole stage (one micro-batch a rank: the same rows per
    # step), and the reference's checkpoint at a rollout's end (step 2) resumed with two micro-batches
    # a rank (twice the rows per step: a GRPO step is its prompts at any split).
    cut_back(root / "reference", root / "layout2-resumed", 2)
    configs = [grpo_config(root, "layout2", grad_accum_steps=1), grpo_config(root, "layout2-resumed")]
    launch = train_cases(2, configs, run_env=reward_env(user))
    (root / "layout2.stdout").write_text(launch.stdout)
    return root


def test_a_grpo_stage_samples_scores_and_updates_with_its_first_ratio_one(grpo_runs):
    metrics = read_metrics(grpo_runs / "reference")
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    assert (grpo_runs / "reference" / "done").exists() and (grpo_runs / "reference" / "final").is_dir()
    for m in metrics:
        assert m["samples"] == 4 * 2 * m["step"] and 0 <= m["reward_mean"] <= 1.5  # completions, counted
        assert {"reward_mean/exact_match", "reward_mean/grpo_user_reward:odd_length", "grpo_kl"} <= set(m)
        assert 1 <= m["completion_length_mean"] <= 6 and m["rollouts"] == (m["step"] + 1) // UPDATES
        # The reward that raises scores 0 on every completion, counted by reason; the stage goes on.
        assert m["reward_failures/grpo_user_reward:broken/raised:KeyError"] == 8
    # The first update of each rollout: the policy is the sampler, the ratio exactly 1.
    for first in metrics[::UPDATES]:
        assert first["grpo_ratio"] == pytest.approx(1.0, abs=1e-5) and first["grpo_logp_gap"] < 1e-5
    # The second: the weights moved, the ratio with them.
    assert any(abs(m["grpo_ratio"] - 1) > 1e-6 for m in metrics[1::UPDATES])


@pytest.mark.parametrize("cut", [1, 2])
def test_a_resumed_grpo_stage_equals_the_uninterrupted_one(grpo_runs, cut):
    reference = read_metrics(grpo_runs / "reference")
    resumed = read_metrics(grpo_runs / f"resumed{cut}")
    keys = ("loss", "grad_norm", "reward_mean", "grpo_ratio", "completion_length_mean")
    trajectory = lambda metrics: torch.tensor([[m[k] for k in keys] for m in metrics])  # noqa: E731
    torch.testing.assert_close(trajectory(resumed[cut:]), trajectory(reference[cut:]), rtol=1e-5, atol=1e-6)
    ref_weights = load_dcp(grpo_runs / "reference" / "final")
    weights = load_dcp(grpo_runs / f"resumed{cut}" / "final")
    for key, value in ref_weights.items():
        torch.testing.assert_close(weights[key], value, rtol=1e-5, atol=1e-6, msg=key)


def test_a_grpo_stage_on_2_ranks_and_resumed_on_them_equals_one_process(grpo_runs):
    """Each prompt's completions are drawn from seeds of their own (its place in the stream), so
    the stage on 2 FSDP2 ranks (each rank half the prompts, one micro-batch) samples, scores and
    updates as one process with two micro-batches; and one process's checkpoint at a rollout's end
    goes on on 2 ranks of two micro-batches as it would have on one."""
    reference = read_metrics(grpo_runs / "reference")
    keys = ("loss", "grad_norm", "reward_mean", "grpo_ratio", "completion_length_mean", "grpo_kl")
    trajectory = lambda metrics: torch.tensor([[m[k] for k in keys] for m in metrics])  # noqa: E731
    for name, first in (("layout2", 0), ("layout2-resumed", 2)):
        metrics = read_metrics(grpo_runs / name)
        assert [m["step"] for m in metrics] == list(range(1, STEPS + 1)), name
        assert [m["samples"] for m in metrics] == [m["samples"] for m in reference], name
        torch.testing.assert_close(trajectory(metrics[first:]), trajectory(reference[first:]), rtol=1e-4, atol=1e-6)
        weights = load_dcp(grpo_runs / name / "final")
        for key, value in load_dcp(grpo_runs / "reference" / "final").items():
            torch.testing.assert_close(weights[key], value, rtol=1e-4, atol=1e-5, msg=f"{name} {key}")
    assert "model and optimizer resharded" in (grpo_runs / "layout2.stdout").read_text()


def test_the_report_shows_a_grpo_stages_rollouts(grpo_runs, tmp_path):
    """`vlmcore report` on the stage: its GRPO table row (first and final reward, the first updates'
    rollout-training gap) and its plot of reward, KL, gap, length and clipping."""
    from PIL import Image

    from vlmcore.report.scaling import write_report

    md = write_report(tmp_path / "report", train={"grpo": grpo_runs / "reference"}).read_text()
    section = md.split("## GRPO", 1)[1].split("\n## ", 1)[0]
    row = next(line for line in section.splitlines() if line.startswith("| grpo |"))
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    metrics = read_metrics(grpo_runs / "reference")
    assert cells[1] == str(STEPS) and float(cells[2]) == pytest.approx(metrics[0]["reward_mean"], abs=1e-3)
    assert float(cells[5]) < 1e-5  # the policy samples itself: no gap on a rollout's first update
    plot = tmp_path / "report" / "plots" / "grpo_grpo.png"
    assert Image.open(plot).size[0] > 600
