"""Context parallelism (vlmcore.parallel.cp) on 2 gloo processes.

The attention: each rank holds a contiguous half of packed rows, the all-to-all over heads gives
it the whole rows for half the heads, and the packed-row attention on them equals one process's
on the whole rows, forward and backward, with grouped-query heads, documents crossing the chunk
boundary and several rows (this file launches itself under torchrun). The run: `parallel.cp: 2`
trains Qwen3 as one process does (loss and gradient-norm trajectories, final weights), and its
checkpoint resumes at cp 1 on the uninterrupted run."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

CASES = {  # name: (rows, row length, q heads, k/v heads, segment lengths of the flattened rows)
    "gqa, a document across the chunks": (1, 24, 4, 2, [5, 14, 5]),
    "two rows, mha": (2, 16, 2, 2, [16, 3, 9, 4]),
    "one document a row": (2, 12, 8, 2, [12, 12]),
}


def worker(report_path: Path) -> None:
    import torch.distributed as dist

    from vlmcore.data.load.batch import row_chunk
    from vlmcore.models.attention import attention
    from vlmcore.parallel.cp import ulysses_attention
    from vlmcore.parallel.mesh import init_distributed

    init_distributed(torch.device("cpu"))
    rank, cp, group = dist.get_rank(), dist.get_world_size(), dist.group.WORLD
    report = {}
    for name, (rows, length, q_heads, kv_heads, segments) in CASES.items():
        generator = torch.Generator().manual_seed(len(name))
        q, k, v, weight = (
            torch.randn(rows, length, heads, 8, generator=generator) for heads in (q_heads, kv_heads, kv_heads, q_heads)
        )
        cu_seqlens = torch.tensor([0, *torch.tensor(segments).cumsum(0).tolist()], dtype=torch.int32)
        whole = [t.clone().requires_grad_() for t in (q, k, v)]
        out = attention(*whole, cu_seqlens=cu_seqlens)
        (out * weight).sum().backward()

        chunks = [row_chunk(t, rank, cp).detach().clone().requires_grad_() for t in (q, k, v)]
        chunk_out = ulysses_attention(attention, *chunks, group, cp, cu_seqlens=cu_seqlens)
        (chunk_out * row_chunk(weight, rank, cp)).sum().backward()
        report[name] = {
            "out": (chunk_out - row_chunk(out, rank, cp)).abs().max().item(),
            "grads": max((c.grad - row_chunk(w.grad, rank, cp)).abs().max().item() for c, w in zip(chunks, whole)),
            "shape": list(chunk_out.shape),
        }
    report["gated deltanet"] = gated_deltanet_case(rank, cp, group)
    reports = [None] * cp
    dist.all_gather_object(reports, report)
    if rank == 0:
        report_path.write_text(json.dumps(reports))
    dist.destroy_process_group()


def gated_deltanet_case(rank: int, cp: int, group) -> dict:
    """Qwen3.5's Gated DeltaNet layer (2 key, 4 value heads, kernel 4) on two rows of 24 tokens with
    documents across the edge, whole on one rank against chunks under the all-to-all: output,
    input gradient, and weight gradients summed over the cp ranks."""
    import torch.distributed as dist

    from vlmcore.data.load.batch import row_chunk
    from vlmcore.models.qwen3_5 import GatedDeltaNet
    from vlmcore.parallel.cp import UlyssesAttention
    from vlmcore.tiny import hf_config

    torch.manual_seed(0)
    layer = GatedDeltaNet(hf_config("qwen3_5").text_config)
    for param in layer.parameters():
        torch.nn.init.normal_(param, std=0.3)
    x, weight = torch.randn(2, 24, layer.in_proj_qkv.in_features), torch.randn(2, 24, layer.out_proj.out_features)
    cu_seqlens = torch.tensor([0, 10, 24, 31, 48], dtype=torch.int32)
    whole = x.clone().requires_grad_()
    out = layer(whole, cu_seqlens)
    (out * weight).sum().backward()
    whole_grads = {name: p.grad.clone() for name, p in layer.named_parameters()}
    layer.zero_grad()
    layer.context_parallel = UlyssesAttention(group, cp)
    chunk = row_chunk(x, rank, cp).clone().requires_grad_()
    chunk_out = layer(chunk, cu_seqlens)
    (chunk_out * row_chunk(weight, rank, cp)).sum().backward()
    for p in layer.parameters():
        dist.all_reduce(p.grad, group=group)
    return {
        "out": (chunk_out - row_chunk(out, rank, cp)).abs().max().item(),
        "grads": max(
            [(chunk.grad - row_chunk(whole.grad, rank, cp)).abs().max().item()]
            + [(p.grad - whole_grads[name]).abs().max().item() for name, p in layer.named_parameters()]
        ),
        "shape": list(chunk_out.shape),
    }


@pytest.mark.slow
def test_all_to_all_attention_and_gated_deltanet_equal_one_process(tmp_path):
    from helpers import env

    out = tmp_path / "report.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", __file__, str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env())
    assert proc.returncode == 0, proc.stderr[-6000:]
    reports = json.loads(out.read_text())
    for rank, report in enumerate(reports):
        assert set(report) == set(CASES) | {"gated deltanet"}
        deltanet = report.pop("gated deltanet")
        assert deltanet["shape"] == [2, 12, 64], rank
        assert deltanet["out"] < 1e-5 and deltanet["grads"] < 1e-4, (rank, deltanet)
        for name, r in report.items():
            rows, length, q_heads, _, _ = CASES[name]
            assert r["shape"] == [rows, length // 2, q_heads, 8], (rank, name)
            assert r["out"] < 1e-6 and r["grads"] < 1e-6, (rank, name, r)


STEPS, CUT = 6, 3


def config(tmp_path, snapshot, name, data, **overrides):
    from helpers import write_config

    settings = {"steps": STEPS, "grad_accum_steps": 2, "optimizer": {"lr": 3.0e-3, "weight_decay": 0.01}, **overrides}
    return write_config(tmp_path / f"{name}.yaml", snapshot, tmp_path / name, data=data, **settings)


# Qwen3: rows of 3 documents. Qwen3-VL: every row with images (4 tokens each), some cut by the
# chunks' edge (checked below), and vision tower trained too. Qwen3.5: Gated DeltaNet layers (their
# convolution and recurrence across the edge) and gated attention, images in half the rows.
# Qwen3-VL-MoE: experts split over the two cp ranks (ep 2), the load-balancing loss of whole rows,
# rows with images or videos of 2 frame groups (one cut by the edge, checked below).
DATA = {
    "qwen3": {"kind": "random", "seq_len": 32, "segments": 3},
    "qwen3_vl": {"kind": "random", "seq_len": 48, "segments": 2, "image_fraction": 1.0},
    "qwen3_5": {"kind": "random", "seq_len": 32, "segments": 2, "image_fraction": 0.5},
    "qwen3_vl_moe": {
        "kind": "random",
        "seq_len": 48,
        "segments": 2,
        "image_fraction": 0.5,
        "video_fraction": 0.5,
        "video_frames": 2,
    },
}
# case: (family, ranks, parallel settings of the cp run, its other settings); every run has a
# global batch of 2 rows a step (2 micro-batches on one data-parallel rank, 1 on each of two).
RUNS = {
    "qwen3": ("qwen3", 4, {"cp": 2, "dp_shard": 2}, {"grad_accum_steps": 1, "global_batch_rows": 2}),
    # Qwen3-VL's blocks compiled under full activation checkpointing (the all-to-all inside the
    # graph), its vision tower with a layout of its own: tp 2 over the two cp ranks, which bring
    # the images of their chunks.
    "qwen3_vl": (
        "qwen3_vl",
        2,
        {"cp": 2, "compile": True, "activation_checkpointing": "full", "modules": {"vision": {"tp": 2}}},
        {},
    ),
    # Disjoint layouts: the vision tower on rank 0 sends the whole rows' embeddings to both cp
    # ranks; two rows a micro-batch, so a chunk holds the image of one row and not the other's.
    "qwen3_vl_disjoint": (
        "qwen3_vl",
        3,
        {"cp": 2, "modules": {"vision": {"ranks": [0, 1]}, "language": {"ranks": [1, 3]}}},
        {"micro_batch_size": 2, "grad_accum_steps": 1},
    ),
    # Qwen3.5 with 4 k/v heads (and 4 linear key heads): 1 a rank under cp 2 x tp 2.
    "qwen3_5": ("qwen3_5", 4, {"cp": 2, "tp": 2}, {}),
    "qwen3_vl_moe": ("qwen3_vl_moe", 2, {"cp": 2, "ep": 2}, {}),
}


@pytest.fixture(scope="module")
def cp_runs(tmp_path_factory):
    """The runs of every case of RUNS, its one-process reference and its cp run: the references in
    one launch, the cp runs of one world size in one launch (train_cases). case -> (its directory,
    its snapshot, the error of the launch that stopped before its runs finished, or None)."""
    from helpers import train_cases

    from vlmcore.tiny import tiny_snapshot

    folders = {}
    launches = {}  # world size -> [(case, config)]
    for case, (family, ranks, parallel, settings) in RUNS.items():
        tmp_path = tmp_path_factory.mktemp(case)
        heads = {"num_key_value_heads": 4, "linear_num_key_heads": 4} if parallel.get("tp", 1) > 1 else {}
        snapshot = tiny_snapshot(family, tmp_path / "model", **heads)
        folders[case] = (tmp_path, snapshot)
        # The reference takes the same micro-batches of the global batch (the sum order of fp32 gradients).
        reference = config(
            tmp_path,
            snapshot,
            "reference",
            DATA[family],
            **settings,
            checkpoint={"interval": 1, "keep": 10} if family == "qwen3_5" else {"enabled": False},
        )
        launches.setdefault(1, []).append((case, reference))
        cp_run = config(
            tmp_path,
            snapshot,
            "cp2",
            DATA[family],
            checkpoint={"interval": 1, "keep": 10},
            parallel=parallel,
            **settings,
        )
        launches.setdefault(ranks, []).append((case, cp_run))
    errors = {}
    for nproc, runs in sorted(launches.items()):
        try:
            train_cases(nproc, [cfg for _, cfg in runs], timeout=len(runs) * 300)
        except AssertionError as error:
            for case, cfg in runs:
                if not (cfg.with_suffix("") / "done").exists():  # the run's output directory
                    errors.setdefault(case, str(error))
    return {case: (*folder, errors.get(case)) for case, folder in folders.items()}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(RUNS))
def test_cp2_trains_as_one_process(cp_runs, case):
    """cp 2 (with dp_shard 2, tp 2, ep 2, a vision layout of its own or disjoint layouts) against one eager process over 6 steps of 2 micro-batches
    (4 heads, 2 k/v heads): loss and gradient-norm trajectories, label counts, final weights (and the
    MoE load-balancing loss, a term of the loss). Resumes across cp sizes: Qwen3's step-3 checkpoint
    at cp 2 x dp_shard 2 resumed by one process, and one process's step-3 checkpoint of Qwen3.5
    resumed at cp 2 x tp 2, each end as the uninterrupted run."""
    from helpers import cut_back, load_dcp, read_metrics, train

    family, ranks, parallel, settings = RUNS[case]
    tmp_path, snapshot, error = cp_runs[case]
    assert error is None, error
    reference, run = read_metrics(tmp_path / "reference"), read_metrics(tmp_path / "cp2")
    trajectory = lambda metrics: torch.tensor([(m["loss"], m["grad_norm"]) for m in metrics])  # noqa: E731
    torch.testing.assert_close(trajectory(run), trajectory(reference), rtol=1e-5, atol=1e-5)
    assert [m["label_tokens"] for m in run] == [m["label_tokens"] for m in reference]
    if family == "qwen3_vl_moe":
        aux = lambda metrics: torch.tensor([m["moe_aux_loss"] for m in metrics])  # noqa: E731
        torch.testing.assert_close(aux(run), aux(reference), rtol=1e-5, atol=1e-6)
    ref_weights = load_dcp(tmp_path / "reference" / "final")
    resumed = {"qwen3": ("cp1_resumed", "cp2", 1), "qwen3_5": ("cp2_resumed", "reference", ranks)}.get(case)
    for out in ("cp2",) + ((resumed[0],) if resumed else ()):
        if resumed and out == resumed[0]:
            _, source, resumed_ranks = resumed
            cut_back(tmp_path / source, tmp_path / out, CUT)
            train(
                resumed_ranks,
                config(
                    tmp_path,
                    snapshot,
                    out,
                    DATA[family],
                    checkpoint={"interval": 1, "keep": 10},
                    parallel=parallel if resumed_ranks > 1 else {},
                ),
            )
            torch.testing.assert_close(
                trajectory(read_metrics(tmp_path / out)[CUT:]), trajectory(reference[CUT:]), rtol=1e-5, atol=1e-5
            )
        weights = load_dcp(tmp_path / out / "final")
        assert weights.keys() == ref_weights.keys()
        assert any(".visual." in key for key in weights) == (family != "qwen3")
        # fp32 sums in another order, which AdamW's normalisation magnifies where a gradient is near
        # zero: compiled blocks (1.1e-5 seen), TP's partial sums (1.05e-5), disjoint layouts (2.5e-5).
        atol = 5e-5 if parallel.get("compile") or parallel.get("tp", 1) > 1 or "modules" in parallel else 1e-5
        for key, value in ref_weights.items():
            torch.testing.assert_close(weights[key], value, rtol=1e-5, atol=atol, msg=key)


def test_qwen3_vl_rows_have_images_and_videos_cut_by_the_chunks_edge():
    """The Qwen3-VL case above trains on images on both sides of the edge and cut by it; the
    Qwen3-VL-MoE case on videos, one of them cut by the edge between its frame groups."""
    from vlmcore.tiny import SPECIAL, hf_config
    from vlmcore.train.random_data import RandomBatches

    for family, token in (("qwen3_vl", SPECIAL["image_token_id"]), ("qwen3_vl_moe", SPECIAL["video_token_id"])):
        data = {k: v for k, v in DATA[family].items() if k != "kind"}
        batches = RandomBatches(
            hf_config(family), **data, micro_batch_size=1, dp_rank=0, dp_world=1, grad_accum_steps=2, seed=0
        )
        edge, seen, cut = data["seq_len"] // 2, 0, 0
        for i in range(2 * STEPS):
            ids = batches.batch(i).input_ids[0]
            visual = ids == token
            seen += bool(visual.any())
            cut += bool(visual[:edge].any() and visual[edge:].any())
        assert seen > STEPS and cut > 0, family


def test_context_chunk_keeps_the_images_at_its_tokens():
    """Two rows of 8 tokens, cp 2: an image (4 tokens) in row 0 cut by the edge at 4, one in row 1
    inside chunk 1. Each chunk keeps the images with a token in it, and says which of their tower
    output rows are its tokens; together the chunks take every image token once. Likewise a video
    whose frame groups fall on both sides: each chunk keeps only its own groups."""
    from vlmcore.data.load.batch import Batch, Images

    I = 9  # noqa: E741  the image token
    ids = torch.tensor([[1, 2, I, I, I, I, 3, 4], [5, 6, 7, 8, I, I, I, I]])
    grids = torch.tensor([[1, 4, 4], [1, 4, 4]])  # 16 patches, 4 tokens each (merge 2)
    pixels = torch.arange(32)[:, None].expand(32, 3)
    batch = Batch(
        ids,
        ids.clone(),
        torch.tensor([0, 8, 16], dtype=torch.int32),
        torch.arange(8).expand(2, 8),
        images=Images(pixels, grids),
    )
    chunks = [batch.context_chunk(r, 2, {"image": I, "video": None}, merge=2) for r in range(2)]
    assert chunks[0].input_ids.tolist() == [[1, 2, I, I], [5, 6, 7, 8]]
    assert chunks[0].images.grid_thw.tolist() == [[1, 4, 4]] and chunks[0].images.pixel_values[:, 0].tolist() == list(
        range(16)
    )
    assert [t.tolist() for t in chunks[0].visual_selection] == [[0, 1]]
    assert chunks[1].images.grid_thw.tolist() == [[1, 4, 4], [1, 4, 4]]
    assert [t.tolist() for t in chunks[1].visual_selection] == [[2, 3, 4, 5, 6, 7]]
    assert chunks[1].position_ids.tolist() == [[4, 5, 6, 7], [4, 5, 6, 7]]
    # A video of 2 frame groups (4 tokens each, a timestamp token between them) cut by the edge at 6.
    V = 7  # noqa: E741  the video token
    ids = torch.tensor([[1, V, V, V, V, 2, V, V, V, V, 3, 4]])
    video = Images(torch.arange(32)[:, None].expand(32, 3), torch.tensor([[2, 4, 4]]), kind="video")
    batch = Batch(
        ids, ids.clone(), torch.tensor([0, 12], dtype=torch.int32), torch.arange(12).expand(3, 1, 12), videos=video
    )
    chunks = [batch.context_chunk(r, 2, {"image": I, "video": V}, merge=2) for r in range(2)]
    # Each chunk keeps the frame group at its tokens (the tower encodes each group on its own).
    assert [c.videos.grid_thw.tolist() for c in chunks] == [[[1, 4, 4]]] * 2 and chunks[0].images is None
    assert [c.videos.pixel_values[:, 0].tolist() for c in chunks] == [list(range(16)), list(range(16, 32))]
    assert [[t.tolist() for t in c.visual_selection] for c in chunks] == [[[0, 1, 2, 3]], [[0, 1, 2, 3]]]
    assert chunks[1].position_ids.shape == (3, 1, 6)  # M-RoPE positions, cut on the sequence
    text = Batch(ids[:1], ids[:1], torch.tensor([0, 5, 12], dtype=torch.int32))
    assert text.context_chunk(1, 2).position_ids.tolist() == [[1, 2, 3, 4, 5, 6]]  # the whole row's, from 5 on
    # A video of 3 groups (tokens 1-4, 6-9, 11-14) over 4 chunks of 4: chunk 1 holds the end of group
    # 0 and the start of group 1, chunk 2 the end of group 1 and the start of group 2; each chunk has
    # one grid for the video's groups it keeps.
    ids = torch.tensor([[1, V, V, V, V, 2, V, V, V, V, 3, V, V, V, V, 4]])
    video = Images(torch.arange(48)[:, None].expand(48, 3), torch.tensor([[3, 4, 4]]), kind="video")
    batch = Batch(
        ids, ids.clone(), torch.tensor([0, 16], dtype=torch.int32), torch.arange(16).expand(3, 1, 16), videos=video
    )
    quarters = [batch.context_chunk(r, 4, {"image": I, "video": V}, merge=2) for r in range(4)]
    assert [c.videos.grid_thw.tolist() for c in quarters] == [[[1, 4, 4]], [[2, 4, 4]], [[2, 4, 4]], [[1, 4, 4]]]
    assert quarters[1].videos.pixel_values[:, 0].tolist() == list(range(32))
    assert quarters[3].videos.pixel_values[:, 0].tolist() == list(range(32, 48))
    assert [[t.tolist() for t in c.visual_selection] for c in quarters] == [
        [[0, 1, 2]],
        [[3, 4, 5]],
        [[2, 3, 4]],
        [[1, 2, 3]],
    ]


@pytest.mark.parametrize(
    "parallel, world, model, message",
    [
        (
            {"cp": 2, "tp": 2},
            4,
            "qwen3",
            r"parallel.cp: cp x tp = 2 x 2 does not divide the model's num_key_value_heads \(2\)",
        ),
        (
            {"cp": 2},
            3,
            "qwen3",
            r"parallel: dp_replicate \(1\) x dp_shard \(-1\) x cp \(2\) x tp \(1\) does not fit the world size 3",
        ),
        ({"cp": 4}, 4, "qwen3_5", r"parallel.cp: 4 does not divide the model's num_key_value_heads \(2\)"),
        (
            {"cp": 2, "ep": 4},
            2,
            "qwen3_vl_moe",
            r"parallel.ep: 4 does not divide the data-parallel shard ranks \(dp_shard 1 x cp 2 on 2 ranks\)",
        ),
        ({"cp": 4}, 4, "qwen3", r"parallel.cp: 4 does not divide the model's num_key_value_heads \(2\)"),
        ({"cp": 3}, 3, "qwen3", r"parallel.cp: 3 does not divide the rows' length \(data.seq_len 32\)"),
    ],
)
def test_unsupported_or_unfit_cp_is_refused_naming_the_key(parallel, world, model, message):
    from vlmcore.config import ConfigError, from_dict
    from vlmcore.parallel.checks import check_run
    from vlmcore.tiny import hf_config

    cfg = from_dict(
        {"model_path": "m", "output_dir": "o", "parallel": parallel, "data": {"kind": "random", "seq_len": 32}}
    )
    with pytest.raises(ConfigError, match=message):
        check_run(cfg, world, hf_config(model))


def test_cp_ranks_share_their_data_rank():
    from vlmcore.config import from_dict
    from vlmcore.parallel.checks import check_run

    layout = check_run(
        from_dict({"model_path": "m", "output_dir": "o", "parallel": {"cp": 2}, "data": {"kind": "random"}}), 8
    )
    grid = layout.language
    assert (grid.dims.dp_shard, grid.dims.cp, grid.dims.world_size) == (4, 2, 8)
    assert [grid.data_rank(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [grid.cp_rank(r) for r in range(8)] == [0, 1] * 4


def test_memory_estimate_follows_the_split_of_the_rows(tmp_path):
    """`vlmcore memory` runs the real step on fake tensors: at cp 2 a rank's activations are half
    of one rank's with the whole rows (8,192-token rows of a tiny Qwen3)."""
    from vlmcore.config import from_dict
    from vlmcore.tiny import tiny_snapshot
    from vlmcore.train.memory import estimate_stage, format_table

    snapshot = tiny_snapshot("qwen3", tmp_path / "model")
    activations = {}
    for cp in (1, 2):
        cfg = from_dict(
            {
                "model_path": str(snapshot),
                "output_dir": str(tmp_path / "out"),
                "parallel": {"cp": cp},
                "data": {"kind": "random", "seq_len": 8192, "segments": 2},
            }
        )
        result = estimate_stage(cfg, cp)
        activations[cp] = result["peak_bytes_by_kind"]["Activation"]
        assert result["cp"] == cp and (f"cp {cp} x tp 1" in format_table(result)) == (cp > 1)
    assert 0.45 < activations[2] / activations[1] < 0.55, activations


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the helpers in tests/
    worker(Path(sys.argv[1]))
