"""The video demo through a real SLURM (.ci/slurm_setup.sh), every rule a SLURM job. It times
nothing, so it runs on the test workers beside the other files; tests/slurm/test_slurm_real.py, whose
time-limit test sizes its run from a measured step time, runs alone after them (tests/run_all.sh).

In CI (CI=true) a missing SLURM is a failure; elsewhere this test is skipped.
"""

import json

import pytest
import yaml
from helpers import slurm_jobs, snakemake_on_slurm, write_experiment_config

pytestmark = [pytest.mark.workflow, pytest.mark.slow]

# Held-out accuracy each kind must reach (100 questions a kind): the worst of seeds 0 and 1
# (docs/video.md, "The video demo": direction 0.48, order 1.00, count 0.61) less 0.1, about two
# standard errors of a 100-question score.
FLOORS = {"direction": 0.38, "order": 0.9, "count": 0.51}
# How far each kind must score above its frame-shuffled control: the smallest measured gap
# (direction 0.16, order 0.59, count 0.24) less 0.1, rounded down to 0.05.
CONTROL_MARGINS = {"direction": 0.05, "order": 0.45, "count": 0.1}


def test_video_demo_through_slurm(slurm, tmp_path):
    """The video demo (config/demo-video.yaml) at its own size, every rule a SLURM job; training and
    scaling as 2-node jobs (the same 2 training processes as the local run, so the same model).
    The model learns every kind of question, and uses the frames' order for each: it scores well
    above chance and above the same questions on frame-shuffled clips."""
    configfile, root = write_experiment_config(tmp_path, "demo-video", "demo-video.yaml", nodes=2, nproc_per_node=1)
    config = yaml.safe_load(configfile.read_text())
    config["scaling"]["steps"] = 4
    configfile.write_text(yaml.safe_dump(config))
    snakemake_on_slurm(tmp_path, configfile, "train_all", timeout=3600)

    jobs = slurm_jobs(tmp_path, "train_stage")
    assert len(jobs) == 2 and all(j["NumNodes"] == "2" and j["JobState"] == "COMPLETED" for j in jobs.values())
    assert (root / "report" / "SCALABILITY.md").is_file()
    stats = json.loads((root / "packed" / "conversations" / "stats.json").read_text())
    assert stats["videos"] == 1500 and stats["bad"]["skipped"] == 0
    # One results.json per task of the last stage's export.
    breakdown = {}
    for task in ("demo_video_qa", "demo_video_qa_shuffled"):
        breakdown |= json.loads((root / "eval" / "stage2" / task / "results.json").read_text())["breakdown"]
    for task in ("demo_video_qa", "demo_video_qa_shuffled"):
        assert {kind: figures["n"] for kind, figures in breakdown[task].items()} == {
            "direction": 100,
            "order": 100,
            "count": 100,
        }
    for kind, floor in FLOORS.items():
        score = breakdown["demo_video_qa"][kind]["value"]
        control = breakdown["demo_video_qa_shuffled"][kind]["value"]
        assert score >= floor and score >= control + CONTROL_MARGINS[kind], (kind, score, control, breakdown)
