"""The training loader: packed datasets -> `Batch`es (vlmcore.data.load.batch, docs/internals.md "Data batches").

Packs are read by index as crude samples (their parts still compressed) and made into rows and
batches by `vlmcore.data.load.rows.PackedTaskEncoder`, with the model files copied into the
packed dataset.

`build_loader` also accepts a blend file (vlmcore.blend: an Energon metadataset YAML) that blends
several packed datasets made with the same model and `seq_len`; each batch names the dataset of
each of its rows (`Batch.row_datasets`). `vlmcore.data.load.online` is the alternative to
offline packing: rows packed in the loader from a prepared dataset with a buffer.

Order and resuming (`RowLoader`): the packs are read in the global row order of
`vlmcore.data.load.order`, each by its index; the position is the rows consumed, so a run resumed
under another layout with the same rows per step goes on exactly.
"""

import json
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

from vlmcore.blend import Blend, read_blend
from vlmcore.data.load.batch import Batch
from vlmcore.data.load.order import RowOrder, rows_of
from vlmcore.data.load.rows import PackedRow, PackedTaskEncoder
from vlmcore.data.load.stream import micro_batch_loader
from vlmcore.data.pack.format import PACK_CONFIG_FILE, PACK_MODEL_DIR, PackConfig
from vlmcore.data.quality import DataError
from vlmcore.data.shards import IndexedShards


def packed_dataset_files(path: str | Path) -> tuple[Path, PackConfig]:
    """The model files and pack config of a packed dataset, or of a blend of packed datasets.

    All datasets of a blend must have been packed with the same tokenizer and pack config: a row's
    tokens are made with the one tokenizer of the run, its length is the one `seq_len`.
    """
    found = []
    for dataset_dir in blend_of(path).paths:
        if not (dataset_dir / PACK_CONFIG_FILE).is_file():
            raise DataError(f"{dataset_dir} is not a packed dataset (no {PACK_CONFIG_FILE}); run `vlmcore pack`")
        found.append((dataset_dir / PACK_MODEL_DIR, PackConfig.read(dataset_dir)))
    model_dir, pack_config = found[0]
    for other_dir, other_config in found[1:]:
        same_tokenizer = (other_dir / "tokenizer.json").read_bytes() == (model_dir / "tokenizer.json").read_bytes()
        if other_config != pack_config or not same_tokenizer:
            raise DataError(
                f"{path}: {other_dir.parent} was packed with another tokenizer or pack config than {model_dir.parent}"
            )
    return model_dir, pack_config


def blend_of(path: str | Path) -> Blend:
    """The datasets of `path`: a dataset directory (one), or a blend file (vlmcore.blend)."""
    path = Path(path)
    if path.is_dir():
        return Blend([path])
    return read_blend(path)


def samples_in(dataset_dir: Path) -> int:
    return sum(json.loads((dataset_dir / ".nv-meta" / ".info.json").read_text())["shard_counts"].values())


class RowLoader:
    """The batches of one data-parallel rank over a packed dataset (or a blend of them), read in
    the global row order of `vlmcore.data.load.order`: micro-batch `a` of step `k` on rank `r` holds the
    rows `rows_of(k, a, r)`, each pack read by index (`IndexedShards`). The position is the number
    of micro-batches taken; under another layout with the same global batch (rows per step) it
    is found again from the rows consumed (`seek`), at no cost but the index reads of the rows.

    Loader workers take micro-batches in turn (`vlmcore.data.load.stream`), so the worker count
    does not change the stream."""

    anchor = None  # where finding a row starts, for a stream whose rows are found by walking it (online packing)

    def __init__(
        self,
        path: str | Path,
        task_encoder: PackedTaskEncoder,
        *,
        dp_rank: int,
        dp_world: int,
        micro_batch_size: int,
        grad_accum_steps: int,
        seed: int,
        num_workers: int,
    ) -> None:
        self.task_encoder = task_encoder
        self.split = {
            "dp_rank": dp_rank,
            "dp_world": dp_world,
            "micro_batch_size": micro_batch_size,
            "grad_accum_steps": grad_accum_steps,
        }
        self.num_workers = num_workers
        blend = blend_of(path)
        self.datasets = [IndexedShards(d) for d in blend.paths]
        self.dataset_names = blend.names  # what each row's `row_datasets` entry says
        self.order = RowOrder([len(d) for d in self.datasets], seed, blend.weights, blend.repetitions)
        self.first_row = 0  # where this layout started
        self.micro_batches = 0  # taken since

    @property
    def global_batch_rows(self) -> int:
        return self.split["dp_world"] * self.split["micro_batch_size"] * self.split["grad_accum_steps"]

    def seek(self, rows: int, steps: int | None = None) -> None:
        """Go on from global row `rows`: the next step's global batch is the `global_batch_rows` rows
        after it (`steps`: unused, the position is the rows)."""
        self.first_row = rows
        self.micro_batches = 0

    def rows_consumed(self) -> int:
        """The global rows of the steps this rank has completed (every rank of the step read its share)."""
        return self.first_row + self.micro_batches // self.split["grad_accum_steps"] * self.global_batch_rows

    def micro_batch(self, m: int) -> Batch:
        step, micro = divmod(m, self.split["grad_accum_steps"])
        rows = [self.first_row + j for j in rows_of(step, micro, **self.split)]
        batch = self.task_encoder.batch([self.row(j) for j in rows])
        return replace(batch, row_datasets=[self.dataset_of(j) for j in rows])

    def dataset_of(self, j: int) -> str:
        """The name of global row j's dataset."""
        if len(self.datasets) == 1:  # no look-up: online packing's order is over samples, not rows
            return self.dataset_names[0]
        return self.dataset_names[self.order[j][0]]

    def rows_by_dataset(self, rows: int) -> dict[str, int]:
        """How many of the first `rows` global rows each dataset gave (the row order's count, no data read)."""
        return dict(zip(self.dataset_names, self.order.dataset_counts(rows).tolist()))

    def row(self, j: int) -> PackedRow:
        """Global row j: its pack, read by index and encoded."""
        dataset, index = self.order[j]
        crude = self.datasets[dataset].read(index)
        return self.task_encoder.encode_sample(self.task_encoder.cook(crude))

    def micro_batch_and_anchor(self, m: int) -> tuple[Batch, object]:
        """Micro-batch `m` and where finding its rows got to (a loader worker's walk over the stream)."""
        batch = self.micro_batch(m)
        return batch, self.anchor

    def __iter__(self) -> Iterator[Batch]:
        loader = micro_batch_loader(self.micro_batch_and_anchor, self.micro_batches, self.num_workers, self.order.seed)
        for batch, anchor in loader:
            self.micro_batches += 1
            self.anchor = anchor  # where a loader worker's walk over the stream got to
            yield batch

    def state_dict(self) -> dict:
        return {
            "first_row": self.first_row,
            "micro_batches": self.micro_batches,
            "rows": self.rows_consumed(),
            **self.split,
        }

    def load_state_dict(self, state: dict) -> None:
        """This loader's own state, or (at a step boundary) another layout's with the same global batch."""
        if {k: state.get(k) for k in self.split} == self.split:
            self.first_row = state["first_row"]
            self.micro_batches = state["micro_batches"]
            return
        other = state["dp_world"] * state["micro_batch_size"] * state["grad_accum_steps"]
        if other != self.global_batch_rows:
            raise ValueError(
                f"the saved position is in steps of {other} rows, this loader's are {self.global_batch_rows}"
            )
        self.seek(state["rows"])


def build_loader(
    packed_dir: str | Path,
    *,
    dp_rank: int,
    dp_world: int,
    micro_batch_size: int,
    seed: int,
    num_workers: int,
    grad_accum_steps: int = 1,
) -> RowLoader:
    """Batches from a packed dataset (`vlmcore pack`) or a blend file of packed datasets (vlmcore.blend)."""
    model_dir, pack_config = packed_dataset_files(packed_dir)
    return RowLoader(
        packed_dir,
        PackedTaskEncoder(model_dir, pack_config.seq_len),
        dp_rank=dp_rank,
        dp_world=dp_world,
        micro_batch_size=micro_batch_size,
        grad_accum_steps=grad_accum_steps,
        seed=seed,
        num_workers=num_workers,
    )
