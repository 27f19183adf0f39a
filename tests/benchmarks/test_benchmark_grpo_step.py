"""benchmarks/grpo_step.py, a GRPO step's time split into rollout, rewards, reference and update,
runs end to end through `vlmcore train` at its smallest setting (2 prompts x 2 samples, 4 new
tokens, 2 steps of which 1 is warm-up) and writes its table and results file."""

import json
import subprocess
import sys
from pathlib import Path

from helpers import env

REPO = Path(__file__).resolve().parents[2]


def test_a_grpo_step_is_split_into_rollout_rewards_reference_and_update(tmp_path):
    script = REPO / "benchmarks" / "grpo_step.py"
    command = [sys.executable, str(script), "--prompts", "2", "--group-size", "2", "--max-new-tokens", "4"]
    command += ["--steps", "1", "--warmup", "1", "--out", str(tmp_path)]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "GRPO step, tiny on cpu: 2 prompts x 2 samples, up to 4 new tokens" in proc.stdout
    assert "reference s" in proc.stdout
    result = json.loads((tmp_path / "grpo_step_cpu_tiny.json").read_text())
    without, with_kl = result["runs"]
    assert (without["beta"], with_kl["beta"]) == (0.0, 0.04)
    for run in result["runs"]:
        assert run["steps"] == 1 and 0 < run["completion_tokens"] <= 2 * 2 * 4
        assert run["generation_s"] > 0 and run["rewards_s"] > 0 and 0 < run["update_s"] < run["step_s"]
        # The rollout is inside the step's wait for its data.
        assert run["generation_s"] + run["rewards_s"] < run["step_s"]
        # fp32 on the CPU: the policy samples itself, no gap
        assert run["logp_gap_mean"] < 1e-5 and abs(run["rollout_kl"]) < 1e-9
    assert result["reference_s"] == with_kl["update_s"] - without["update_s"]
