"""The video demo through a real SLURM (.ci/slurm_setup.sh), every rule a SLURM job. It times
nothing, so it runs on the test workers beside the other files; tests/test_slurm_real.py, whose
time-limit test sizes its run from a measured step time, runs alone after them (tests/run_all.sh).

In CI (CI=true) a missing SLURM is a failure; elsewhere this test is skipped.
"""

import json

import pytest
import yaml
from _slurm_helpers import slurm_jobs, snakemake, write_config

pytestmark = [pytest.mark.workflow, pytest.mark.slow]


def test_video_demo_through_slurm(slurm, tmp_path):
    """The video demo (config/demo-video.yaml), every rule a SLURM job; training and scaling as
    2-node jobs. Small (150 clips, 10 + 30 steps): that the model learns is measured with the whole
    config (docs/video.md, benchmarks/demo_learning.py) and, for the image demo with the same
    rules, checked by tests/test_pipeline_demo.py."""
    configfile, root = write_config(tmp_path, "demo-video", "demo-video.yaml", nodes=2, nproc_per_node=1)
    config = yaml.safe_load(configfile.read_text())
    config["data"]["synthetic"].update(num_train=150, num_eval=30)
    config["train"]["stages"]["stage1"]["steps"] = 10
    config["train"]["stages"]["stage2"]["steps"] = 30
    config["scaling"]["steps"] = 4
    configfile.write_text(yaml.safe_dump(config))
    snakemake(tmp_path, configfile, "train_all", timeout=3600)

    jobs = slurm_jobs(tmp_path, "train_stage")
    assert len(jobs) == 2 and all(j["NumNodes"] == "2" and j["JobState"] == "COMPLETED" for j in jobs.values())
    assert (root / "report" / "SCALABILITY.md").is_file()
    stats = json.loads((root / "packed" / "conversations" / "stats.json").read_text())
    assert stats["videos"] == 150 and stats["bad"]["skipped"] == 0
    results = json.loads((root / "eval" / "results.json").read_text())
    for task in ("demo_video_qa", "demo_video_qa_shuffled"):
        assert {kind: figures["n"] for kind, figures in results["breakdown"][task].items()} == {
            "direction": 10,
            "order": 10,
            "count": 10,
        }
