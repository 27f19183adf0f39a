"""The training loader: batch format of docs/internals.md, exact resume, blends, layout changes."""

import dataclasses
import json
import pickle
from functools import partial

import pytest
import torch
from helpers import make_demo_model_dir, write_config

from vlmcore.blend import write_blend
from vlmcore.data.load.loader import build_loader, samples_in
from vlmcore.data.load.online import build_online_loader
from vlmcore.data.media.encoder import IGNORE_INDEX, SampleEncoder
from vlmcore.data.pack.dataset import pack
from vlmcore.data.prepare.dataset import prepare
from vlmcore.data.quality import DataError
from vlmcore.data.synthetic.image import generate
from vlmcore.models import load_hf_config, position_ids

SEQ_LEN = 128


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    root = tmp_path_factory.mktemp("loader")
    model = make_demo_model_dir(root / "model")
    generate(root / "raw", num_train=48, num_eval=3, seed=2)
    for name in ("captions", "conversations"):
        prepare([root / "raw" / f"{name}.jsonl"], root / "data" / name, shard_size=16)
        pack(root / "data" / name, model, root / "packed" / name, seq_len=SEQ_LEN, max_patches=256, shard_size=4)
    return root


def take(loader, n):
    it = iter(loader)
    return [next(it) for _ in range(n)]


def fields(batch) -> dict:
    """A batch's fields by name, its images' too."""
    out = {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch) if f.name != "images"}
    if batch.images is not None:
        out.update({f"images.{f.name}": getattr(batch.images, f.name) for f in dataclasses.fields(batch.images)})
    return out


def assert_same_batches(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        x, y = fields(x), fields(y)
        assert x.keys() == y.keys()
        for key in x:
            assert torch.equal(x[key], y[key]) if torch.is_tensor(x[key]) else x[key] == y[key], key


def test_batch_format(packed):
    loader = build_loader(
        packed / "packed" / "conversations", dp_rank=0, dp_world=1, micro_batch_size=2, seed=0, num_workers=0
    )
    config = load_hf_config(packed / "model")
    for batch in take(loader, 4):
        ids, labels, pos, cu = batch.input_ids, batch.labels, batch.position_ids, batch.cu_seqlens
        assert ids.shape == labels.shape == (2, SEQ_LEN) and ids.dtype == labels.dtype == torch.int64
        assert pos.shape == (3, 2, SEQ_LEN) and pos.dtype == torch.int64
        assert cu.dtype == torch.int32 and cu[0] == 0 and cu[-1] == 2 * SEQ_LEN
        assert SEQ_LEN in cu.tolist()  # segments end at the row boundary
        assert torch.equal(pos, position_ids(config, ids, batch.images.grid_thw, cu))
        grid = batch.images.grid_thw
        assert batch.images.pixel_values.dtype == torch.uint8 and batch.images.pixel_values.shape == (
            int(grid.prod(-1).sum()),
            3 * 16 * 16,
        )
        pixel_values = batch.to(torch.device("cpu")).images.pixel_values  # what the model gets
        assert grid.dtype == torch.int64 and pixel_values.shape == (int(grid.prod(-1).sum()), 3 * 2 * 16 * 16)
        assert int((ids == config.image_token_id).sum()) == batch.images.pixel_values.shape[0] // 4
        # No target crosses a segment boundary: the last position of every segment has no label.
        flat = labels.flatten()
        assert all(flat[end - 1] == IGNORE_INDEX for end in cu[1:].tolist())
        segments = list(zip(cu[:-1].tolist(), cu[1:].tolist()))
        with_labels = sum(1 for a, b in segments if (flat[a:b] != IGNORE_INDEX).any())
        assert batch.num_samples == with_labels  # the rest is row padding


def test_rows_hold_the_encoded_samples(packed):
    """Each segment of a packed row is exactly the encoder's output for that sample."""
    from vlmcore.data.shards import iter_shard_samples, shard_paths

    loader = build_loader(
        packed / "packed" / "captions", dp_rank=0, dp_world=1, micro_batch_size=1, seed=0, num_workers=0
    )
    encoder = SampleEncoder(packed / "model")
    segments_by_tokens = {}
    for shard in shard_paths(packed / "packed" / "captions"):
        for s in iter_shard_samples(shard):
            for seg in json.loads(s.data["json"])["segments"]:
                enc = encoder.encode_text(seg["sample"], [tuple(x) for x in seg["image_sizes"]])
                segments_by_tokens[tuple(enc.input_ids)] = enc.labels
    for batch in take(loader, 3):
        ids, labels, cu = batch.input_ids[0], batch.labels[0], batch.cu_seqlens.tolist()
        for a, b in zip(cu[:-1], cu[1:]):
            key = tuple(ids[a:b].tolist())
            if key in segments_by_tokens:
                assert labels[a:b].tolist() == segments_by_tokens[key]
            else:  # row padding
                assert (ids[a:b] == encoder.pad_id).all() and (labels[a:b] == IGNORE_INDEX).all()
        assert sum(tuple(ids[a:b].tolist()) in segments_by_tokens for a, b in zip(cu[:-1], cu[1:])) == batch.num_samples


def test_row_pixels_equal_the_image_processor(packed):
    """A batch of two packed rows carries uint8 patches that the step turns into exactly the image
    processor's pixel_values for the rows' images, in order."""
    from vlmcore.data.load.rows import PackedTaskEncoder
    from vlmcore.data.media.image import load_image
    from vlmcore.data.shards import iter_shard_samples, shard_paths

    path = packed / "packed" / "conversations"
    task_encoder = PackedTaskEncoder(path / "model", SEQ_LEN)
    stored = [
        task_encoder.cook({"__key__": s.key, "__restore_key__": (), **s.data})
        for s in iter_shard_samples(shard_paths(path)[0])
    ][:2]
    batch = task_encoder.batch([task_encoder.encode_sample(s) for s in stored])
    images = [
        load_image(s.parts[name]) for s in stored for seg in json.loads(s.meta)["segments"] for name in seg["images"]
    ]
    assert len(images) >= 2
    expected = task_encoder.encoder.pixel_values(images)
    assert batch.images.pixel_values.dtype == torch.uint8
    assert torch.equal(batch.images.grid_thw, expected[1])
    assert torch.equal(batch.to(torch.device("cpu")).images.pixel_values, expected[0])


def check_resume(path, num_workers):
    kwargs = dict(dp_rank=0, dp_world=1, micro_batch_size=2, seed=3, num_workers=num_workers)
    loader = build_loader(path, **kwargs)
    it = iter(loader)
    [next(it) for _ in range(3)]
    state = pickle.loads(pickle.dumps(loader.state_dict()))
    expected = [next(it) for _ in range(5)]
    resumed = build_loader(path, **kwargs)
    resumed.load_state_dict(state)
    assert_same_batches(take(resumed, 5), expected)


def test_resume_yields_the_same_batches(packed):
    check_resume(packed / "packed" / "conversations", num_workers=0)


@pytest.mark.slow
def test_resume_with_workers_yields_the_same_batches(packed):
    check_resume(packed / "packed" / "conversations", num_workers=2)


def global_batches(
    path, steps, *, dp_world, micro_batch_size, grad_accum_steps, num_workers=0, seed=0, state=None, build=build_loader
):
    """The row keys of `steps` global batches, rank after rank, micro-batch after micro-batch."""
    kwargs = dict(
        dp_world=dp_world,
        micro_batch_size=micro_batch_size,
        grad_accum_steps=grad_accum_steps,
        seed=seed,
        num_workers=num_workers,
    )
    loaders = [build(path, dp_rank=r, **kwargs) for r in range(dp_world)]
    if state is not None:
        for loader in loaders:
            loader.load_state_dict(state)
    its = [iter(loader) for loader in loaders]
    batches = [[key for it in its for _ in range(grad_accum_steps) for key in next(it).row_keys] for _ in range(steps)]
    return batches, loaders[0].state_dict()


# The same global batch of 4 rows per step, split over ranks, micro-batches and workers differently.
LAYOUTS = [
    dict(dp_world=1, micro_batch_size=4, grad_accum_steps=1),
    dict(dp_world=2, micro_batch_size=1, grad_accum_steps=2),
    dict(dp_world=4, micro_batch_size=1, grad_accum_steps=1, num_workers=2),
    dict(dp_world=1, micro_batch_size=2, grad_accum_steps=2, num_workers=3),
]


@pytest.mark.parametrize("blend", [None, "weighted", "epochized"])
def test_global_batches_do_not_depend_on_the_layout(packed, blend):
    """Global batch k is the same rows in the same order (a rank's share a slice of it) whatever
    the data-parallel size, micro-batch size, gradient accumulation and loader workers."""
    path = packed / "packed" / "conversations"
    if blend:
        path = packed / f"blend_{blend}.yaml"
        write_blend(
            path,
            [(packed / "packed" / "captions", 1), (packed / "packed" / "conversations", 2)],
            epochized=blend == "epochized",
        )
    runs = [global_batches(path, 6, **layout)[0] for layout in LAYOUTS]
    assert all(run == runs[0] for run in runs[1:])
    assert len({key for batch in runs[0] for key in batch}) > 12  # not one pack over and over


def test_resume_on_another_layout_continues_the_stream(packed):
    """A position saved under one layout, loaded under another with the same rows per step, goes
    on with the next rows of the uninterrupted stream; another global batch size is refused."""
    path = packed / "packed" / "conversations"
    uninterrupted, _ = global_batches(path, 5, **LAYOUTS[0])
    first, state = global_batches(path, 2, **LAYOUTS[1])
    assert first == uninterrupted[:2]
    for layout in LAYOUTS[2:] + LAYOUTS[:1]:
        assert global_batches(path, 3, **layout, state=state)[0] == uninterrupted[2:]
    with pytest.raises(ValueError, match="steps of 4 rows, this loader's are 2"):
        build_loader(path, dp_rank=0, dp_world=1, micro_batch_size=2, seed=0, num_workers=0).load_state_dict(state)


def test_every_pack_once_an_epoch_and_a_new_shuffle_the_next(packed):
    path = packed / "packed" / "captions"
    n = samples_in(path)
    (keys,), _ = global_batches(path, 1, dp_world=1, micro_batch_size=2 * n, grad_accum_steps=1)
    assert sorted(keys[:n]) == sorted(keys[n:]) and len(set(keys[:n])) == n
    assert keys[:n] != keys[n:]


@pytest.mark.parametrize("epochized", [False, True])
def test_blend_of_packed_datasets(packed, epochized):
    blend = packed / "blend.yaml"
    write_blend(
        blend, [(packed / "packed" / "captions", 1), (packed / "packed" / "conversations", 2)], epochized=epochized
    )
    loader = build_loader(blend, dp_rank=0, dp_world=1, micro_batch_size=1, seed=0, num_workers=0)
    encoder = SampleEncoder(packed / "model")
    seen = {"captions": 0, "conversations": 0}
    question = encoder.tokenizer("What", add_special_tokens=False)["input_ids"][0]
    for batch in take(loader, 12):
        seen["conversations" if (batch.input_ids == question).any() else "captions"] += 1
    assert seen["captions"] > 0 and seen["conversations"] > 0


@pytest.mark.parametrize("epochized", [False, True])
def test_each_row_names_its_dataset_and_the_order_counts_them(packed, epochized):
    """A blend's batches say which dataset each row came from (told apart here by the
    conversations' questions), and the row order's count of the rows each dataset gave up to a
    row (what a resumed run starts its per-dataset counts from) is the count of those rows."""
    blend = packed / f"blend_named_{epochized}.yaml"
    write_blend(
        blend, [(packed / "packed" / "captions", 1), (packed / "packed" / "conversations", 2)], epochized=epochized
    )
    loader = build_loader(blend, dp_rank=0, dp_world=1, micro_batch_size=2, seed=0, num_workers=0)
    assert loader.dataset_names == ["captions", "conversations"]
    question = SampleEncoder(packed / "model").tokenizer("What", add_special_tokens=False)["input_ids"][0]
    named = []
    for batch in take(loader, 8):
        for row, name in zip(batch.input_ids, batch.row_datasets, strict=True):
            assert name == ("conversations" if (row == question).any() else "captions")
        named += batch.row_datasets
    assert set(named) == {"captions", "conversations"}
    assert loader.rows_by_dataset(len(named)) == {name: named.count(name) for name in ("captions", "conversations")}


@pytest.mark.parametrize("repetitions", [None, [1, 2]])
def test_blend_counts_are_the_rows_drawn_and_follow_the_weights(repetitions):
    """`RowOrder.dataset_counts(j)` adds row j's dataset when it steps to j + 1, at every row, at the
    ends of epochs and of the weighted draws' blocks of CHUNK rows too; over 100,000 rows a 1:2
    weighted blend gives each dataset its share within 0.5% (the binomial spread is 0.15%)."""
    from vlmcore.data.load.order import CHUNK, RowOrder

    order = RowOrder([3, 5], seed=4, weights=None if repetitions else [1, 2], repetitions=repetitions)
    epoch = 3 * 1 + 5 * 2
    for start in (0, 5 * epoch - 3, CHUNK - 20, 3 * CHUNK - 5):
        counts = order.dataset_counts(start)
        for j in range(start, start + 40):
            step = order.dataset_counts(j + 1) - counts
            assert step.tolist() == [int(order[j][0] == 0), int(order[j][0] == 1)], j
            counts += step
    shares = order.dataset_counts(100_000) / 100_000
    expected = [3 / epoch, 10 / epoch] if repetitions else [1 / 3, 2 / 3]
    assert shares.tolist() == pytest.approx(expected, abs=0.005)


def test_bad_blend_file_is_refused_naming_it(packed, tmp_path, capsys):
    """`vlmcore train` on a blend file that is not one, or whose weights cannot weigh a mix, or that
    names a directory that is not there: exit code 2, one line naming the file, before any work."""
    from vlmcore.cli import main

    captions = str(packed / "packed" / "captions")
    blends = {
        "not a blend": "- just a list\n",
        "splits.train.blend must be a non-empty list": "splits: {train: {blend: []}}\n",
        "weight -1 is negative": f"splits: {{train: {{blend: [{{weight: -1, path: {captions}}}]}}}}\n",
        "the weights sum to 0": f"splits: {{train: {{blend: [{{weight: 0, path: {captions}}}]}}}}\n",
        "blend[0].weight is 'a lot'": f"splits: {{train: {{blend: [{{weight: a lot, path: {captions}}}]}}}}\n",
        "blend[1] has no path": f"splits: {{train: {{blend: [{{weight: 1, path: {captions}}}, {{weight: 1}}]}}}}\n",
        "is not a directory": "splits: {train: {blend: [{weight: 1, path: missing}]}}\n",
    }
    for i, (message, text) in enumerate(blends.items()):
        blend = tmp_path / f"blend{i}.yaml"
        blend.write_text(text)
        out = tmp_path / f"out{i}"
        cfg = write_config(
            tmp_path / f"c{i}.yaml", packed / "model", out, steps=1, data={"kind": "packed"}, data_path=str(blend)
        )
        assert main(["train", str(cfg)]) == 2, message
        err = capsys.readouterr().err
        assert err.startswith(f"error: {cfg}: data_path: ") and err.count("\n") == 1, err
        assert message in err and str(blend) in err, err
        assert not out.exists()


def test_blend_of_datasets_packed_differently_is_refused_naming_them(packed, tmp_path):
    """The datasets of a blend share one tokenizer and one pack config (a row's length, its patch
    budget): a blend of datasets packed with another seq_len is refused when the loader is built."""
    other = tmp_path / "conversations_64"
    pack(packed / "data" / "conversations", packed / "model", other, seq_len=64, max_patches=256, shard_size=4)
    blend = tmp_path / "blend.yaml"
    write_blend(blend, [(packed / "packed" / "captions", 1), (other, 1)])
    with pytest.raises(DataError, match=f"{blend}: {other} was packed with another tokenizer or pack config than"):
        build_loader(blend, dp_rank=0, dp_world=1, micro_batch_size=1, seed=0, num_workers=0)


def test_memory_estimate_reads_the_limits_of_a_blends_datasets(packed, tmp_path):
    """`vlmcore memory` of a stage on a blend sizes its rows from the blend's datasets' pack config."""
    from vlmcore.config import from_dict
    from vlmcore.train.memory import packed_limits

    blend = tmp_path / "blend.yaml"
    write_blend(blend, [(packed / "packed" / "captions", 1), (packed / "packed" / "conversations", 1)])
    cfg = from_dict({"model_path": str(packed / "model"), "output_dir": str(tmp_path), "data_path": str(blend)})
    assert packed_limits(cfg)["seq_len"] == SEQ_LEN and packed_limits(cfg)["max_patches"] == 256


def test_data_parallel_ranks_read_different_packs(packed):
    path = packed / "packed" / "conversations"
    first = [build_loader(path, dp_rank=r, dp_world=2, micro_batch_size=1, seed=0, num_workers=0) for r in (0, 1)]
    a, b = (take(loader, 3) for loader in first)
    assert not any(torch.equal(x.input_ids, y.input_ids) for x in a for y in b)


def test_online_packing_loader(packed):
    kwargs = dict(
        seq_len=SEQ_LEN,
        max_patches=256,
        buffer_size=16,
        dp_rank=0,
        dp_world=1,
        micro_batch_size=2,
        seed=1,
        num_workers=0,
    )
    loader = build_online_loader(packed / "data" / "conversations", packed / "model", **kwargs)
    it = iter(loader)
    first = [next(it) for _ in range(2)]
    state = loader.state_dict()
    expected = [next(it) for _ in range(3)]
    for batch in first + expected:
        assert batch.input_ids.shape == (2, SEQ_LEN) and batch.cu_seqlens[-1] == 2 * SEQ_LEN
        assert batch.images.pixel_values.shape[0] <= 2 * 256
    resumed = build_online_loader(packed / "data" / "conversations", packed / "model", **kwargs)
    resumed.load_state_dict(state)
    assert_same_batches(take(resumed, 3), expected)


def online(packed, buffer_size=6):
    return partial(
        build_online_loader, model_dir=packed / "model", seq_len=SEQ_LEN, max_patches=256, buffer_size=buffer_size
    )


def test_online_packing_follows_the_global_batch(packed):
    """Online packing keeps the global row order too: the same global batches under every layout
    (workers included), a position saved under one layout goes on under the others, and an
    epoch's buffers hold every sample once."""
    path, build = packed / "data" / "conversations", online(packed)
    runs = [global_batches(path, 6, **layout, build=build)[0] for layout in LAYOUTS]
    assert all(run == runs[0] for run in runs[1:])
    keys = [key for batch in runs[0] for row in batch for key in row.split(",")]
    n = samples_in(path)
    assert len(keys) > n and len(set(keys[:n])) == n  # several samples a row; the first epoch has each once
    first, state = global_batches(path, 2, **LAYOUTS[1], build=build)
    assert state["anchor"][0] > 0  # the position says where the walk over the buffers got to
    for layout in LAYOUTS[2:] + LAYOUTS[:1]:
        assert global_batches(path, 4, **layout, state=state, build=build)[0] == runs[0][2:]
    loader = build(path, dp_rank=0, dp_world=1, micro_batch_size=1, seed=0, num_workers=0)
    epoch = sorted(i for b in range(n // 6) for pack in loader.plan(b) for i in pack)
    assert epoch == list(range(n))
    assert [loader.order[p][1] for p in range(n, 2 * n)] != [loader.order[p][1] for p in range(n)]  # a new shuffle


@pytest.fixture(scope="module")
def many_packs(tmp_path_factory):
    """About 600 one-or-two-sample packs of the same plan, written in 16-pack shards by one job
    and by 2 write jobs, and in one 1000-pack shard."""
    root = tmp_path_factory.mktemp("mixing")
    model = make_demo_model_dir(root / "model")
    generate(root / "raw", num_train=1200, num_eval=3, seed=0, min_size=32, max_size=32)
    prepare([root / "raw" / "captions.jsonl"], root / "data", shard_size=1000)
    settings = dict(seq_len=48, max_patches=64, workers=1)
    pack(root / "data", model, root / "shards16", shard_size=16, **settings)
    pack(root / "data", model, root / "jobs2", shard_size=16, plan_only=True, **settings)
    for group in range(2):
        pack(root / "data", model, root / "jobs2", shard_size=16, write_group=(group, 2), **settings)
    pack(root / "data", model, root / "jobs2", shard_size=16, **settings)
    pack(root / "data", model, root / "shards1000", shard_size=1000, **settings)
    return root


@pytest.mark.parametrize("dp_world", [1, 2])
def test_epoch_order_is_a_uniform_shuffle_whatever_the_shards(many_packs, dp_world):
    """One epoch's pack order is indistinguishable from a uniform shuffle (rank correlation with
    the disk order, distance between disk neighbours, clustering of 16-pack blocks, each within
    the range of 200 uniform shuffles), and it is the same order whatever the shard size or the
    number of write jobs. Before every pack was a slice of its own (Energon read slices of up to
    100 packs in sequence), disk neighbours were 0.3-0.55 of the uniform distance apart and
    blocks clustered 8-14 times the uniform spread (docs/internals.md "Sample order")."""
    from vlmcore.data.load.mixing import epoch_order, order_statistics, outside_uniform, uniform_reference

    orders = {name: epoch_order(many_packs / name, dp_world) for name in ("shards16", "jobs2", "shards1000")}
    assert orders["shards16"] == orders["jobs2"] == orders["shards1000"]
    order = orders["shards16"]
    stats = order_statistics(order)
    assert stats["items"] > 500
    assert not outside_uniform(stats, uniform_reference(len(order))), stats
    assert epoch_order(many_packs / "shards16", dp_world, seed=1) != order  # the seed sets the shuffle
