"""Online packing: rows packed in the loader from a prepared (unpacked) dataset, in a global order.

The samples are read in the epoch order of `vlmcore.data.load.order` (every sample once an epoch,
a new shuffle the next). Buffer b holds the samples at positions [b * B, (b + 1) * B) of that
order; it is measured (text tokenized, images sized from their headers, the overlong policy
applied) and packed by best fit decreasing, and its packs are the next global rows. So row j is
a function of the dataset, the model files, the pack settings, the seed and j only, as with
offline packing: a rank's share of a step is a slice, and a run resumed under another layout
with the same rows per step goes on exactly.

Finding row j walks the buffers from an anchor (a buffer and its first row) that the loader
keeps in its state, so resuming costs the buffers after the anchor, not a pass over the data.
The price of the global order: every loader worker of every rank measures every buffer (the text
tokenized, image headers read, no pixels decoded); only its own rows' images are decoded. Offline
packing (`vlmcore pack`) measures each sample once, for all ranks, and is the path for corpora.

A sample that fails the measure rides along in its buffer's first pack, to be counted in that
row's `skipped`; an image that passes its header check but does not decode is counted when its
row is made (`PackedTaskEncoder.assemble_row`).
"""

from collections import Counter
from pathlib import Path

from vlmcore.data.load.loader import RowLoader
from vlmcore.data.load.rows import EncodedSegment, PackedRow, PackedTaskEncoder, skip
from vlmcore.data.media.encoder import EncodingError, TextEncoding
from vlmcore.data.pack.bin_packing import best_fit_decreasing
from vlmcore.data.pack.measure import measure_sample
from vlmcore.data.quality import BadSample, load_json


class OnlineRowLoader(RowLoader):
    def __init__(
        self,
        data_dir: str | Path,
        task_encoder: PackedTaskEncoder,
        *,
        max_patches: int,
        overlong: str,
        buffer_size: int,
        **split: int,
    ) -> None:
        super().__init__(data_dir, task_encoder, **split)
        if len(self.datasets) != 1:
            raise ValueError(f"{data_dir}: online packing reads one prepared dataset; blends are of packed datasets")
        self.max_patches = max_patches
        self.overlong = overlong
        self.buffer_size = buffer_size
        self.anchor = (0, 0)  # (buffer, its first global row): a walk to a later row starts here
        self._plans = {}  # buffer -> its packs (sample indices), the last few

    def measure(self, crude: dict) -> tuple[TextEncoding, list[bytes], list]:
        """(encoding, the kept images' bytes, the kept clips) of a sample read by index; BadSample or
        EncodingError if it is bad."""
        parts = {k: v for k, v in crude.items() if k not in ("__key__", "json")}
        if "json" not in crude:
            raise BadSample("malformed_row", f"no json part, parts {sorted(parts)}")
        sample = load_json(crude["json"])
        if isinstance(sample, dict) and "rejected" in sample:
            raise BadSample("preference_pair_online", "preference pairs are packed by `vlmcore pack`, not online")
        enc, kept, _, max_frames = measure_sample(
            sample,
            parts,
            self.task_encoder.encoder,
            self.task_encoder.seq_len,
            self.max_patches,
            self.overlong,
            Counter(),
            decode=False,
        )
        clips = self.task_encoder.clips(enc, sample.get("videos", []), max_frames or None, parts)
        return enc, [parts[name] for name in kept], clips

    def plan(self, b: int) -> list[list[int]]:
        """The packs of buffer b, each a list of sample indices (bad samples in the first)."""
        if b not in self._plans:
            good = []
            tokens = []
            patches = []
            bad = []
            for position in range(b * self.buffer_size, (b + 1) * self.buffer_size):
                index = self.order[position][1]
                try:
                    enc = self.measure(self.datasets[0].read(index))[0]
                except (BadSample, EncodingError):
                    bad.append(index)
                    continue
                good.append(index)
                tokens.append(len(enc.input_ids))
                patches.append(enc.num_patches)
            bins = best_fit_decreasing(tokens, patches, self.task_encoder.seq_len, self.max_patches)
            packs = [[good[i] for i in pack] for pack in bins] or [[]]
            packs[0] += bad
            if len(self._plans) >= 3:
                self._plans.pop(next(iter(self._plans)))
            self._plans[b] = packs
        return self._plans[b]

    def locate(self, j: int) -> list[int]:
        """The sample indices of global row j, walking the buffers from the anchor (from the
        start if j lies before it)."""
        b, first = self.anchor if j >= self.anchor[1] else (0, 0)  # (buffer, its first row)
        while j >= first + len(self.plan(b)):
            first += len(self.plan(b))
            b += 1
        self.anchor = (b, first)
        return self.plan(b)[j - first]

    def row(self, j: int) -> PackedRow:
        skipped = Counter()
        segments: list[EncodedSegment] = []
        keys = []
        for index in self.locate(j):
            crude = self.datasets[0].read(index)
            try:
                segments.append((crude["__key__"], *self.measure(crude), None))
                keys.append(crude["__key__"])
            except (BadSample, EncodingError) as e:
                skip(skipped, e.reason, f"sample {crude['__key__']}", e)
        return self.task_encoder.assemble_row(",".join(keys), segments, skipped)

    def state_dict(self) -> dict:
        return {**super().state_dict(), "anchor": list(self.anchor)}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.anchor = tuple(state["anchor"])


def build_online_loader(
    data_dir: str | Path,
    model_dir: str | Path,
    *,
    seq_len: int,
    max_patches: int,
    buffer_size: int,
    overlong: str = "truncate",
    dp_rank: int,
    dp_world: int,
    micro_batch_size: int,
    seed: int,
    num_workers: int,
    grad_accum_steps: int = 1,
    video: dict | None = None,
) -> OnlineRowLoader:
    """Batches packed online from a prepared dataset, `buffer_size` samples at a time; `video`:
    sampling settings in place of the model's video processor's (as `vlmcore pack --video-*`)."""
    return OnlineRowLoader(
        data_dir,
        PackedTaskEncoder(model_dir, seq_len, video),
        max_patches=max_patches,
        overlong=overlong,
        buffer_size=buffer_size,
        dp_rank=dp_rank,
        dp_world=dp_world,
        micro_batch_size=micro_batch_size,
        grad_accum_steps=grad_accum_steps,
        seed=seed,
        num_workers=num_workers,
    )
