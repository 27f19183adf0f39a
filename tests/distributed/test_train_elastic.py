"""Resume on another number of processes (issue 32): the data stream follows the global batch.

A 2-process run (micro-batch 1) on a packed dataset is cut back to its step-2 checkpoint, as if
its job had ended there, and resumed by 1 process (which makes up the stage's `global_batch_rows` with
2 micro-batches of gradient accumulation), by 4 processes (dp_shard 2 x tp 2) and by 3 processes
of a disjoint layout (the vision tower on rank 0, the language model on ranks 1-2, whose encoder
rank must read the language ranks' rows): each ends where the uninterrupted 2-process run ends
(every later loss, the final weights, within 1e-5 relative), having read the same packs. A resume
with another number of rows per step is refused, naming the keys, unless
allow_global_batch_change says to go on from the rows consumed.

A stage on a weighted mix of two packed datasets (a blend file) resumes the same way: under its
own split bit for bit, on 2 processes with the same rows from each dataset at every step.
"""

import json
import tarfile

import pytest
import torch
from helpers import cut_back, load_dcp, read_metrics, train, train_cases, write_config

from vlmcore.blend import write_blend
from vlmcore.data.pack.dataset import pack
from vlmcore.data.prepare.dataset import prepare
from vlmcore.data.synthetic.image import generate
from vlmcore.download import build_tiny_model

pytestmark = pytest.mark.slow
STEPS, CUT = 6, 2


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("elastic")
    build_tiny_model(root / "model", overrides={"text_config": {"num_hidden_layers": 1}, "vision_config": {"depth": 1}})
    generate(root / "raw", num_train=12, num_eval=1, seed=5)
    prepare([root / "raw" / "conversations.jsonl"], root / "data")
    pack(root / "data", root / "model", root / "packed", seq_len=128, max_patches=256, shard_size=3)
    damage_an_image(root / "packed" / "shard-000001.tar")
    # As a workflow stage would set it: the rows per step, whatever the number of nodes.
    settings = dict(
        steps=STEPS,
        global_batch_rows=2,
        data_path=str(root / "packed"),
        data={"kind": "packed"},
        checkpoint={"interval": 1, "keep": 10},
    )
    reference = write_config(root / "reference.yaml", root / "model", root / "reference", **settings)
    # One launch of 2 processes for the reference and a stage on a mix resumed on 2 ranks.
    train_cases(2, [reference, mix_resumed_on_two_ranks(root, settings)])
    return root, settings


def mix_settings(root, settings):
    """A stage on a blend of two packed datasets by weight 1:2 (what train.stages.<name>.datasets
    makes): the conversations of `setup` and the captions of the same images."""
    return dict(settings, data_path=str(root / "data_mix.yaml"))


def mix_resumed_on_two_ranks(root, settings):
    """The mix's stage run by one process with 2 micro-batches a step (mix_reference), cut back to its
    step-2 checkpoint for 2 processes to resume (mix_two_ranks): the config of that resume."""
    prepare([root / "raw" / "captions.jsonl"], root / "captions_data")
    pack(root / "captions_data", root / "model", root / "captions", seq_len=128, max_patches=256, shard_size=3)
    write_blend(root / "data_mix.yaml", [(root / "captions", 1), (root / "packed", 2)])
    mix = mix_settings(root, settings)
    train_cases(1, [write_config(root / "mix_reference.yaml", root / "model", root / "mix_reference", **mix)])
    cut_back(root / "mix_reference", root / "mix_two_ranks", CUT)
    return write_config(root / "mix_two_ranks.yaml", root / "model", root / "mix_two_ranks", **mix)


def damage_an_image(shard):
    """Zeroes the shard's first image after its signature, in place (offsets unchanged): the
    sample holding it is skipped and counted as corrupt_image by the loader, in whichever step
    reads that pack."""
    with tarfile.open(shard) as tar:
        image = next(m for m in tar if m.name.rsplit(".", 1)[-1] in ("png", "jpg", "jpeg"))
    with open(shard, "r+b") as f:
        f.seek(image.offset_data + 8)
        f.write(b"\0" * (image.size - 8))


def relative_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


DISJOINT = {"parallel": {"modules": {"vision": {"ranks": [0, 1]}, "language": {"ranks": [1, 3]}}}}


@pytest.mark.parametrize(
    "nproc,sets",
    [(1, {}), (4, {"parallel": {"tp": 2}}), (3, DISJOINT)],
    ids=["1proc_accum2", "4proc_dp2_tp2", "3proc_disjoint"],
)
def test_resume_on_another_layout_matches_the_uninterrupted_run(setup, nproc, sets):
    root, settings = setup
    reference = read_metrics(root / "reference")
    out = root / f"resumed_{nproc}"
    cut_back(root / "reference", out, CUT)
    proc = train(nproc, write_config(root / f"resumed_{nproc}.yaml", root / "model", out, **settings, **sets))
    assert f"the data goes on from global row {2 * CUT}" in proc.stdout
    resumed = read_metrics(out)
    assert [m["step"] for m in resumed] == list(range(1, STEPS + 1))
    assert [m["data_rows"] for m in resumed] == [2 * step for step in range(1, STEPS + 1)]
    assert sum(m["skipped_samples"] for m in reference) > 0  # the damaged image was read, and counted
    for ref, got in zip(reference[CUT:], resumed[CUT:]):
        for key in ("label_tokens", "samples", "skipped_samples"):  # the same packs, the same bad samples
            assert got[key] == ref[key], key
        assert got["loss"] == pytest.approx(ref["loss"], rel=1e-5)
    weights, ref_weights = load_dcp(out / "final"), load_dcp(root / "reference" / "final")
    assert weights.keys() == ref_weights.keys()
    worst = max(relative_difference(weights[k], ref_weights[k]) for k in ref_weights)
    assert worst < 1e-5, worst


def test_another_global_batch_size_is_refused_unless_allowed(setup):
    root, settings = setup
    out = root / "bigger"
    cut_back(root / "reference", out, CUT)
    cfg = write_config(root / "bigger.yaml", root / "model", out, **(settings | {"global_batch_rows": 4}))
    proc = train(1, cfg, check=False)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "written with 2 rows per step" in proc.stderr and "this run takes 4" in proc.stderr
    assert "allow_global_batch_change" in proc.stderr
    assert read_metrics(out)[-1]["step"] == CUT  # nothing trained

    proc = train(1, cfg, "allow_global_batch_change=true")
    assert "the data goes on from global row 4" in proc.stdout
    rows = [m["data_rows"] for m in read_metrics(out)]
    assert rows == [2, 4] + [4 + 4 * k for k in range(1, STEPS - CUT + 1)]
    assert json.loads((out / "final" / "meta.json").read_text())["step"] == STEPS


def test_a_stage_on_a_mix_logs_its_realised_mix_and_the_report_compares_it(setup):
    """Every step logs the rows each dataset gave so far (data_mix_rows) and their shares
    (data_mix); the report's data mix table holds, per dataset, the configured weight as a share
    (from the run's own record of its blend) against the rows of the whole stage; a stage on one
    dataset has no row there."""
    from vlmcore.report.scaling import write_report

    root, _ = setup
    reference = root / "mix_reference"
    metrics = read_metrics(reference)
    rows = [m["data_mix_rows"] for m in metrics]
    assert [sum(r.values()) for r in rows] == [2 * step for step in range(1, STEPS + 1)]
    assert rows[-1].keys() == {"captions", "packed"} and min(rows[-1].values()) > 0
    assert metrics[-1]["data_mix"] == {name: n / (2 * STEPS) for name, n in rows[-1].items()}
    stages = {"one": root / "reference" / "metrics.jsonl", "mixed": reference / "metrics.jsonl"}
    md = write_report(root / "mix_report", train=stages).read_text()  # the stage on one dataset has no rows
    table = md.split("## Data mix")[1].split("\n\n")[2].splitlines()
    assert table[2:] == [
        f"| mixed | captions | 0.333 | {rows[-1]['captions']} | {rows[-1]['captions'] / (2 * STEPS):.3f} |",
        f"| mixed | packed | 0.667 | {rows[-1]['packed']} | {rows[-1]['packed'] / (2 * STEPS):.3f} |",
    ]


def test_a_stage_on_a_mix_resumes_exactly(setup):
    """Cut back to its step-2 checkpoint and resumed under its own split, every later step of a
    stage on a mix is the uninterrupted run's bit for bit (loss, gradient norm, the packs' counts,
    the rows per dataset, recounted from the row order up to the checkpoint) and so are the final
    weights; resumed by 2 processes (each rank counts its own rows, summed over the ranks), the
    same rows per dataset at every step and the losses within 1e-5."""
    root, settings = setup
    reference = root / "mix_reference"
    expected = read_metrics(reference)
    same = root / "mix_resumed"
    cut_back(reference, same, CUT)
    proc = train(1, write_config(root / "mix_resumed.yaml", root / "model", same, **mix_settings(root, settings)))
    assert f"resumed from {same / 'checkpoints' / f'step_{CUT}'} at step {CUT}" in proc.stdout
    resumed = read_metrics(same)
    for key in ("loss", "grad_norm", "samples", "label_tokens", "skipped_samples", "data_mix_rows", "data_mix"):
        assert [m[key] for m in resumed] == [m[key] for m in expected], key
    weights, ref_weights = load_dcp(same / "final"), load_dcp(reference / "final")
    assert weights.keys() == ref_weights.keys()
    assert all(torch.equal(weights[k], ref_weights[k]) for k in ref_weights)

    resumed = read_metrics(root / "mix_two_ranks")  # resumed in setup's launch of 2 processes
    assert [m["data_mix_rows"] for m in resumed] == [m["data_mix_rows"] for m in expected]
    for ref, got in zip(expected[CUT:], resumed[CUT:]):
        assert got["samples"] == ref["samples"] and got["loss"] == pytest.approx(ref["loss"], rel=1e-5)
