"""Per-module parallel layouts (`parallel.modules`), resolved and checked against a world size
without torch: what each module gets, and each refusal naming its key."""

import pytest

from vlmcore.config import ConfigError, from_dict
from vlmcore.parallel.checks import check_run
from vlmcore.parallel.layout import MODULES, ParallelDims, resolve_layout


def config(parallel: dict, micro_batch_size: int = 1):
    return from_dict(
        {
            "model_path": "m",
            "output_dir": "o",
            "data": {"kind": "random"},
            "micro_batch_size": micro_batch_size,
            "parallel": parallel,
        }
    )


def dims(layout):
    return {
        module: (layout.grid(module).dims.dp_replicate, layout.grid(module).dims.dp_shard, layout.grid(module).dims.tp)
        for module in MODULES
    }


@pytest.mark.parametrize(
    "parallel, world, expected",
    [
        # unset: the language model takes the top-level keys, the vision tower tp 1 (today's layouts)
        ({}, 4, {"language": (1, 4, 1), "vision": (1, 4, 1)}),
        ({"tp": 2}, 4, {"language": (1, 2, 2), "vision": (1, 4, 1)}),
        ({"dp_replicate": 2}, 8, {"language": (2, 4, 1), "vision": (2, 4, 1)}),
        ({"mode": "ddp"}, 4, {"language": (4, 1, 1), "vision": (4, 1, 1)}),
        # colocated, own degrees
        ({"modules": {"vision": {"tp": 2}}}, 4, {"language": (1, 4, 1), "vision": (1, 2, 2)}),
        ({"modules": {"vision": {"tp": 2}}}, 2, {"language": (1, 2, 1), "vision": (1, 1, 2)}),
        (
            {"tp": 2, "modules": {"vision": {"tp": 2, "dp_replicate": 2}}},
            4,
            {"language": (1, 2, 2), "vision": (2, 1, 2)},
        ),
        ({"dp_replicate": 2, "modules": {"vision": {"tp": 2}}}, 8, {"language": (2, 4, 1), "vision": (2, 2, 2)}),
        (
            {"tp": 4, "modules": {"language": {"tp": 2}, "vision": {"tp": 4}}},
            8,
            {"language": (1, 4, 2), "vision": (1, 2, 4)},
        ),
        # disjoint ranges that tile the world (with tp: resolved, then refused by check_run, below)
        (
            {"modules": {"vision": {"ranks": [0, 2], "tp": 2}, "language": {"ranks": [2, 8]}}},
            8,
            {"language": (1, 6, 1), "vision": (1, 1, 2)},
        ),
    ],
)
def test_module_layouts_resolve(parallel, world, expected):
    layout = resolve_layout(config(parallel, micro_batch_size=2).parallel, world)
    assert dims(layout) == expected
    assert resolve_layout(config(parallel).parallel, world).language.dims == ParallelDims(*expected["language"])
    for module in MODULES:
        assert layout.grid(module).dims.world_size == len(layout.grid(module).ranks), module


@pytest.mark.parametrize(
    "parallel, world, micro_batch_size, message",
    [
        ({"tp": 3}, 4, 1, "parallel: dp_replicate (1) x dp_shard (-1) x tp (3) does not fit the world size 4"),
        (
            {"modules": {"language": {"tp": 3}}},
            4,
            1,
            "parallel.modules.language: dp_replicate (1) x dp_shard (-1) x tp (3) does not fit the world size 4",
        ),
        (
            {"modules": {"vision": {"tp": 3}}},
            4,
            1,
            "parallel.modules.vision: dp_replicate (1) x dp_shard (-1) x tp (3) does not fit the world size 4",
        ),
        (
            {"modules": {"vision": {"tp": 2, "dp_shard": 4}}},
            4,
            1,
            "parallel.modules.vision: dp_replicate (1) x dp_shard (4) x tp (2) does not fit the world size 4",
        ),
        (
            {"modules": {"vision": {"ranks": [0, 2]}, "language": {"ranks": [3, 4]}}},
            4,
            1,
            "parallel.modules.vision.ranks: [0, 2) and language's [3, 4) do not tile the world of 4 ranks",
        ),
        (
            {"modules": {"vision": {"ranks": [0, 2]}, "language": {"ranks": [1, 4]}}},
            4,
            1,
            "parallel.modules.vision.ranks: [0, 2) and language's [1, 4) do not tile the world of 4 ranks",
        ),
        (
            {"modules": {"vision": {"ranks": [0, 2]}, "language": {"ranks": [2, 6]}}},
            4,
            1,
            "parallel.modules.language.ranks: [2, 6) is outside the world of 4 ranks",
        ),
        (
            {"modules": {"vision": {"ranks": [0, 2], "tp": 4}, "language": {"ranks": [2, 4]}}},
            4,
            1,
            "parallel.modules.vision: dp_replicate (1) x dp_shard (-1) x tp (4) does not fit its 2 ranks",
        ),
        # each module's data-parallel rank needs whole rows of the global micro-batch
        (
            {"tp": 2, "modules": {"vision": {"tp": 1}}},
            4,
            1,
            "micro_batch_size: the global micro-batch (1 x 2 language data-parallel ranks = 2 rows) is not divisible by "
            "4, the LCM of the module data-parallel sizes (language 2, vision 4)",
        ),
        (
            {"modules": {"vision": {"ranks": [0, 2]}, "language": {"ranks": [2, 5]}}},
            5,
            1,
            "micro_batch_size: the global micro-batch (1 x 3 language data-parallel ranks = 3 rows) is not divisible by "
            "6, the LCM of the module data-parallel sizes (language 3, vision 2)",
        ),
    ],
)
def test_module_layouts_that_do_not_fit_are_refused_naming_the_key(parallel, world, micro_batch_size, message):
    with pytest.raises(ConfigError) as e:
        check_run(config(parallel, micro_batch_size), world)
    assert str(e.value) == message
    assert message.startswith(f"{e.value.key}: ")


def test_disjoint_layouts_with_tensor_parallelism_resolve_but_are_refused_by_the_checks():
    """Refused by `check_run`: by the workflow at planning time, `vlmcore memory` and `vlmcore train`."""
    ranks = {"vision": {"ranks": [0, 2]}, "language": {"ranks": [2, 4]}}
    for module in ("vision", "language"):
        parallel = {"modules": {m: dict(r, tp=2) if m == module else r for m, r in ranks.items()}}
        disjoint = config(parallel, micro_batch_size=2)
        resolve_layout(disjoint.parallel, 4)
        message = rf"^parallel.modules.{module}.tp: disjoint layouts .* not implemented yet"
        with pytest.raises(ConfigError, match=message):
            check_run(disjoint, 4)
    for parallel in [{"modules": ranks}, {"modules": {"vision": {"tp": 2}}}]:
        check_run(config(parallel, micro_batch_size=2), 4)


@pytest.mark.parametrize("vision_ranks, world, micro_batch_size", [(2, 4, 1), (3, 5, 3), (1, 4, 1), (2, 3, 2)])
def test_disjoint_bridge_sends_every_row_once_to_its_language_rank(vision_ranks, world, micro_batch_size):
    """Planned on every rank from the batches it reads (as `vlmcore train` does): each encoder
    rank encodes a contiguous slice of the global micro-batch's rows, whose slice may cross the
    language ranks' micro-batches; what each sends to a language rank is what that rank expects,
    and the images (and the videos) over the encoder ranks are the global micro-batch's, in
    order, each once."""
    import torch

    from vlmcore.parallel.disjoint import DisjointBridge
    from vlmcore.tiny import hf_config
    from vlmcore.train.random_data import RandomBatches

    model_config = hf_config("qwen3_vl")
    parallel = {"modules": {"vision": {"ranks": [0, vision_ranks]}, "language": {"ranks": [vision_ranks, world]}}}
    layout = check_run(config(parallel, micro_batch_size), world)
    language = layout.language.dims.dp
    loaders = [
        RandomBatches(
            model_config,
            seq_len=64,
            segments=3,
            image_fraction=0.5,
            video_fraction=0.5,
            micro_batch_size=micro_batch_size,
            dp_rank=j,
            dp_world=language,
            grad_accum_steps=2,
            seed=0,
        )
        for j in range(language)
    ]
    steps = [[[next(iter(loader)) for _ in range(2)] for loader in loaders] for _ in range(3)]  # [step][rank][micro]
    bridges = [
        DisjointBridge(model_config, layout, micro_batch_size, torch.float32, torch.device("cpu"), rank)
        for rank in range(world)
    ]
    seen = {"images": 0, "videos": 0}
    for step in steps:
        inputs = {}
        for bridge in bridges:
            if bridge.is_vision:
                sources = [tuple(step[j][a] for j in bridge.source_ranks()) for a in range(2)]
                inputs[bridge.rank] = bridge.plan_step(sources)
            else:
                bridge.plan_step(step[bridge.rank - vision_ranks])
        for a in range(2):
            for e in range(vision_ranks):
                for lang in range(vision_ranks, world):
                    assert bridges[e].plans[a].send[lang] == bridges[lang].plans[a].receive[e]
                    for kind in ("images", "videos"):
                        assert bridges[e].plans[a].by_kind[kind][lang] == bridges[lang].plans[a].by_kind[kind][e]
            batches = [step[j][a] for j in range(language)]
            for kind, token in (("images", model_config.image_token_id), ("videos", model_config.video_token_id)):
                expected = [
                    g for b in batches if getattr(b, kind) is not None for g in getattr(b, kind).grid_thw.tolist()
                ]
                encoded = [getattr(inputs[e][a], kind) for e in range(vision_ranks) if inputs[e][a] is not None]
                encoded = [x for x in encoded if x is not None]
                assert [g for x in encoded for g in x.grid_thw.tolist()] == expected
                if expected:
                    torch.testing.assert_close(
                        torch.cat([x.pixel_values for x in encoded]),
                        torch.cat([getattr(b, kind).pixel_values for b in batches if getattr(b, kind) is not None]),
                    )
                tokens = sum(int((b.input_ids == token).sum()) for b in batches)
                received = sum(sum(bridges[lang].plans[a].by_kind[kind]) for lang in range(vision_ranks, world))
                sent = sum(sum(bridges[e].plans[a].by_kind[kind]) for e in range(vision_ranks))
                assert received == sent == tokens
                seen[kind] += len(expected)
    assert seen["images"] > 0 and seen["videos"] > 0


@pytest.mark.slow
def test_memory_estimate_of_a_vision_layout(tmp_path):
    """`vlmcore memory` with the vision tower on its own tp (the layout bridge on fake tensors,
    every rank of a vision TP group holding a batch like rank 0's): the tower is gathered 1/tp
    per rank for its attention and MLP, its sharded states spread over world / tp ranks only, and
    a rank holds the activations of its group's images."""
    from helpers import estimates, write_config

    from vlmcore.tiny import tiny_snapshot

    config = write_config(
        tmp_path / "vl.yaml",
        tiny_snapshot("qwen3_vl", tmp_path / "vl"),
        tmp_path / "out",
        data={"kind": "random", "seq_len": 96, "segments": 2},
    )
    default, vision_tp = [
        r["peak_bytes_by_kind"]
        for r in estimates(config, ([], 2, 48, 2, True), (["parallel.modules.vision.tp=2"], 2, 48, 2, True))
    ]
    assert vision_tp["Unsharded Param"] < default["Unsharded Param"]
    assert vision_tp["Sharded Param"] > default["Sharded Param"]
    assert vision_tp["Activation"] > default["Activation"]


def test_an_encoder_rank_holds_the_vision_tower_only_and_refuses_to_hold_a_frozen_one(tmp_path):
    """Rank 0 of disjoint layouts (a fake world of 4) builds the vision tower only, FSDP over
    the encoder ranks; a stage that trains nothing of it is refused naming `trainable`."""
    import torch

    from vlmcore.tiny import tiny_snapshot
    from vlmcore.train.build import build_meta_run
    from vlmcore.train.memory import _process_group

    snapshot = tiny_snapshot("qwen3_vl", tmp_path / "vl")
    parallel = {"modules": {"vision": {"ranks": [0, 2]}, "language": {"ranks": [2, 4]}}}
    with _process_group(4, fake=True):
        for trainable in ([], ["model.language_model.*"]):
            cfg = from_dict(
                {
                    "model_path": str(snapshot),
                    "output_dir": "o",
                    "data": {"kind": "random"},
                    "micro_batch_size": 2,
                    "trainable": trainable,
                    "parallel": parallel,
                }
            )
            layout = check_run(cfg, 4)
            if trainable:
                with pytest.raises(ConfigError, match=r"^trainable: no parameter of the vision tower trains"):
                    build_meta_run(cfg, layout, torch.device("cpu"), 0)
                continue
            run = build_meta_run(cfg, layout, torch.device("cpu"), 0)
            model, partial = run.model, run.partial
            names = set(model.state_dict())
            assert partial == [] and model.dropped_prefixes == ("model.language_model.", "lm_head.")
            assert "model.visual.merger.linear_fc2.weight" in names
            assert all(name.startswith("model.visual.") for name in names)
            assert {p.device_mesh.mesh.tolist() == [0, 1] for p in model.parameters()} == {True}  # FSDP on 0-1


def test_memory_estimate_of_disjoint_layouts(tmp_path):
    """`vlmcore memory` of disjoint layouts (today's only way to size such a stage before the queue)
    estimates an encoder rank and a language rank: each holds its own module's weights, gradients
    and AdamW state, sharded over its module's ranks, and the bridge's all_to_all runs on fake
    tensors too. The top level is the larger of the two."""
    from vlmcore.models import build_model
    from vlmcore.tiny import tiny_snapshot
    from vlmcore.train.memory import estimate_memory, format_table

    snapshot = tiny_snapshot("qwen3_vl", tmp_path / "vl")
    disjoint = config({"modules": {"vision": {"ranks": [0, 1]}, "language": {"ranks": [1, 4]}}}, micro_batch_size=1)
    disjoint.model_path = str(snapshot)
    result = estimate_memory(disjoint, 4, 64, 2)
    modules = result["modules"]
    assert {m: (e["rank"], e["ranks"]) for m, e in modules.items()} == {"vision": (0, [0, 1]), "language": (1, [1, 4])}
    model = build_model(snapshot, device="meta")
    vision = list(model.vision_tower().parameters())
    language = [p for p in model.parameters() if all(p is not v for v in vision)]
    for module, params, ranks in (("vision", vision, 1), ("language", language, 3)):
        # FSDP2 shards dim 0, padded to a multiple of the ranks; fp32
        shard = sum(-(-p.shape[0] // ranks) * (p.numel() // p.shape[0]) for p in params) * 4
        kinds = modules[module]["peak_bytes_by_kind"]
        assert kinds["Sharded Param"] == shard, module
        assert kinds["OptState"] == pytest.approx(2 * shard, abs=1024), module  # AdamW's two moments (+ step counts)
    assert result["peak_bytes"] == max(e["peak_bytes"] for e in modules.values())
    assert "vision on ranks [0, 1) (estimated on rank 0), language on ranks [1, 4)" in format_table(result)


def test_one_rank_trains_a_plain_module_unless_it_casts(tmp_path, one_process_group):
    """FSDP2 over a single rank only copies and casts weights and gradients, one at a time: one rank
    trains the plain module, in fp32 as it is, in bf16 with the casts done for all weights at once
    (vlmcore.parallel.fsdp.OneRankMixedPrecision, tests/parallel/test_parallel_fsdp_one_rank.py), unless
    `parallel.one_rank_cast: false` asks for FSDP2's units (one block's compute copy at a time)."""
    import torch
    from helpers import write_config
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    from vlmcore.config import load_config
    from vlmcore.parallel.fsdp import one_rank_cast_of
    from vlmcore.tiny import tiny_snapshot
    from vlmcore.train.build import build_meta_run

    config = write_config(tmp_path / "c.yaml", tiny_snapshot("qwen3_vl", tmp_path / "m"), tmp_path / "o")
    kinds = {}
    for dtype, cast in (("float32", True), ("bfloat16", True), ("float32", False), ("bfloat16", False)):
        cfg = load_config(config, [f"precision.param_dtype={dtype}", f"parallel.one_rank_cast={str(cast).lower()}"])
        model = build_meta_run(cfg, check_run(cfg, 1), torch.device("cpu"), 0).model
        kinds[dtype, cast] = (
            isinstance(model, FSDPModule),
            isinstance(model.lm_head.weight, DTensor),
            one_rank_cast_of(model) is not None,
        )
    assert kinds == {
        ("float32", True): (False, False, False),
        ("bfloat16", True): (False, False, True),
        ("float32", False): (False, False, False),
        ("bfloat16", False): (True, True, False),
    }


@pytest.mark.parametrize(
    "world, tp, micro_batch_size, expected", [(8, 1, 1, 4), (4, 1, 1, 8), (4, 2, 2, 8), (32, 1, 1, 1)]
)
def test_global_batch_rows_sets_the_gradient_accumulation_of_each_world(world, tp, micro_batch_size, expected):
    """A stage with global_batch_rows keeps its rows per step on any number of nodes."""
    cfg = from_dict(
        {
            "model_path": "m",
            "output_dir": "o",
            "data": {"kind": "random"},
            "global_batch_rows": 32,
            "micro_batch_size": micro_batch_size,
            "parallel": {"tp": tp},
        }
    )
    assert check_run(cfg, world).grad_accum_steps == expected
    assert cfg.grad_accum_steps == 1  # the config stays as written; the layout of each world holds the count


@pytest.mark.parametrize(
    "settings, world, message",
    [
        (
            {"global_batch_rows": 6},
            4,
            "global_batch_rows: 6 is not a multiple of micro_batch_size x data-parallel ranks = 1 x 4 = 4",
        ),
        (
            {"global_batch_rows": 2},
            4,
            "global_batch_rows: 2 is not a multiple of micro_batch_size x data-parallel ranks = 1 x 4 = 4",
        ),
        (
            {"global_batch_rows": 16, "grad_accum_steps": 2},
            4,
            "grad_accum_steps: 2 with global_batch_rows 16 on 4 "
            "data-parallel ranks (which makes it 4); set one of the two",
        ),
    ],
)
def test_global_batch_rows_that_do_not_fit_are_refused_naming_the_key(settings, world, message):
    cfg = from_dict({"model_path": "m", "output_dir": "o", "data": {"kind": "random"}, **settings})
    with pytest.raises(ConfigError) as e:
        check_run(cfg, world)
    assert str(e.value) == message and e.value.key == message.split(":")[0]


def test_a_grpo_stage_whose_rollout_rows_exceed_the_models_context_is_refused_naming_data_seq_len():
    """grpo.max_new_tokens < data.seq_len is the config's rule; the row within the model's context
    (max_position_embeddings 512 in the tiny Qwen3-VL) is check_run's, before any work."""
    from vlmcore.tiny import hf_config

    stage = {
        "model_path": "m",
        "data_path": "d",
        "output_dir": "o",
        "objective": "grpo",
        "grpo": {"max_new_tokens": 64, "rewards": [{"name": "exact_match"}]},
    }
    model_config = hf_config("qwen3_vl")
    assert check_run(from_dict({**stage, "data": {"seq_len": 512}}), 1, model_config).world_size == 1
    with pytest.raises(ConfigError) as e:
        check_run(from_dict({**stage, "data": {"seq_len": 1024}}), 1, model_config)
    assert e.value.key == "data.seq_len" and str(e.value) == (
        "data.seq_len: 1024 tokens a rollout row (a prompt and grpo.max_new_tokens 64) exceed the qwen3_vl "
        "model's context (max_position_embeddings 512)"
    )
