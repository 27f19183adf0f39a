"""The training loop's state: the run's counters, the same on every rank, and how the run splits
the global batch. A checkpoint stores it under `train` (vlmcore.train.checkpoint) as flat keys:
the counters by name and the split as `layout_<field>`."""

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field

from vlmcore.parallel.layout import BatchSplit

COUNTERS = ("step", "samples", "tokens", "skipped_steps", "data_rows")


def split_state_dict(split: BatchSplit) -> dict[str, int]:
    """The split as a checkpoint stores it: `layout_<field>` keys."""
    return {f"layout_{name}": value for name, value in dataclasses.asdict(split).items()}


def split_from_state_dict(state: dict[str, int]) -> BatchSplit:
    """The split a checkpoint's `layout_<field>` keys record."""
    return BatchSplit(**{field.name: state[f"layout_{field.name}"] for field in dataclasses.fields(BatchSplit)})


@dataclass
class TrainState:
    """What the loop counts, checkpoints and logs (`Trainer`, vlmcore.train.loop)."""

    split: BatchSplit  # this run's; a resumed checkpoint's own is read by vlmcore.train.checkpoint.resume
    step: int = 0
    samples: int = 0
    tokens: int = 0
    skipped_steps: int = 0  # optimizer steps skipped for a non-finite loss or gradient norm
    data_rows: int = 0  # global rows consumed (vlmcore.data.load.order): where the data stream goes on
    # A blend's rows consumed per dataset, counted from the batches. Not checkpointed: a resume
    # recounts them from the row order up to `data_rows` (RowLoader.rows_by_dataset), exactly.
    dataset_rows: dict[str, int] = field(default_factory=dict)

    def count_step(
        self, applied: bool, samples: int, tokens: int, dataset_rows: Mapping[str, int] | None = None
    ) -> None:
        """Counts one optimizer step over the global batch (`applied`: False when it was skipped)."""
        self.skipped_steps += not applied
        self.step += 1
        self.data_rows += self.split.global_batch_rows
        self.samples += samples
        self.tokens += tokens
        for name, rows in (dataset_rows or {}).items():
            self.dataset_rows[name] = self.dataset_rows.get(name, 0) + rows

    def state_dict(self) -> dict[str, int]:
        """The checkpoint form: the counters, then the split's `layout_*` keys."""
        counters = {name: getattr(self, name) for name in COUNTERS}
        return counters | split_state_dict(self.split)

    def load_state_dict(self, state: dict[str, int]) -> None:
        """The counters `state` has; the split stays this run's."""
        for name in COUNTERS:
            if name in state:
                setattr(self, name, state[name])
