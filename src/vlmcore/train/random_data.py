"""Deterministic synthetic packed batches (`Batch`es, like the loader's) for `data.kind: random`.

For benchmarks and for engine tests that must not depend on a prepared dataset. Row j's content
depends only on j and the seed, and the rows of each step are taken as the packed loader takes
them (`vlmcore.data.load.order.rows_of`): every layout with the same rows per step sees the same
global batch at every step, which is what the exactness and resume tests compare.

They come as the packed loader's do (`vlmcore.data.load.stream`): from torch's DataLoader, made
by `num_workers` worker processes in an order that does not depend on their count, and pinned on
a GPU machine. Made in the training process instead, a GPU loop's "data wait" was the time to
draw a row (its tokens, its image's patches, its M-RoPE positions: 3.5% of the 2B Qwen3-VL step
on an H200), which is not what the packed loader costs.
"""

import math
from collections.abc import Iterator

import torch
from transformers import PretrainedConfig

from vlmcore.data import IGNORE_INDEX
from vlmcore.data.load.batch import Batch, Images, Rollout
from vlmcore.data.load.order import rows_of
from vlmcore.data.load.stream import micro_batch_loader


class RandomBatches:
    def __init__(
        self,
        model_config: PretrainedConfig,
        *,
        seq_len: int,
        segments: int,
        image_fraction: float,
        micro_batch_size: int,
        dp_rank: int,
        dp_world: int,
        grad_accum_steps: int,
        seed: int,
        image_side: int = 2,
        video_fraction: float = 0.0,
        video_frames: int = 2,
        pairs: bool = False,
        num_workers: int = 0,
        rollout: bool = False,
    ) -> None:
        """`pairs`: each row's consecutive segments are preference pairs (DPO), (0, 1), (2, 3), ...
        `num_workers`: the DataLoader's worker processes (0: the batches are made in this one).
        `rollout`: each segment is a rollout's completion (GRPO, `Batch.rollout`): at each label a
        uniform policy's log-probability, -log(vocabulary), and the advantages +1 and -1 by turns
        over the segments."""
        self.config = model_config
        self.text = getattr(model_config, "text_config", model_config)
        self.vision = getattr(model_config, "vision_config", None)
        self.seq_len = seq_len
        self.segments = segments
        self.image_fraction = image_fraction
        self.micro_batch_size = micro_batch_size
        self.seed = seed
        self.image_side = image_side  # merged patches per side of each image (and video frame)
        self.video_fraction = video_fraction
        self.video_frames = video_frames  # frame groups per video
        self.pairs = pairs
        self.rollout = rollout
        self.dp_rank = dp_rank
        self.dp_world = dp_world
        self.accum = grad_accum_steps
        self.num_workers = num_workers
        self.first_row = 0  # where this layout started
        self.consumed = 0  # micro-batches taken since

    def state_dict(self) -> dict:
        return {"first_row": self.first_row, "consumed": self.consumed}

    def load_state_dict(self, state: dict) -> None:
        self.first_row = int(state.get("first_row", 0))
        self.consumed = int(state["consumed"])

    def seek(self, rows: int, steps: int | None = None) -> None:
        """Go on from global row `rows`: the next step's global batch is the rows after it (`steps`:
        unused, the position is the rows)."""
        self.first_row = rows
        self.consumed = 0

    def micro_batch(self, m: int) -> Batch:
        """This rank's micro-batch `m` from where this layout started (`first_row`)."""
        step, a = divmod(m, self.accum)
        rows = rows_of(
            step,
            a,
            self.dp_rank,
            dp_world=self.dp_world,
            micro_batch_size=self.micro_batch_size,
            grad_accum_steps=self.accum,
        )
        return self.rows(range(self.first_row + rows.start, self.first_row + rows.stop))

    def __iter__(self) -> Iterator[Batch]:
        for batch in micro_batch_loader(self.micro_batch, self.consumed, self.num_workers, self.seed):
            self.consumed += 1
            yield batch

    def _text_vocab(self) -> int:
        """Ordinary tokens only: stay below the special (image, vision start/end) ids."""
        special = [getattr(self.config, k, None) for k in ("image_token_id", "video_token_id", "vision_start_token_id")]
        return min([self.text.vocab_size] + [s for s in special if s is not None])

    def batch(self, index: int) -> Batch:
        """Global micro-batch `index`: rows index * micro_batch_size, ... (each drawn on its own)."""
        return self.rows(range(index * self.micro_batch_size, (index + 1) * self.micro_batch_size))

    def rows(self, indices: range) -> Batch:
        rows = [self.row(j) for j in indices]
        lengths = [n for row in rows for n in row["lengths"]]
        batch = Batch(
            input_ids=torch.stack([row["ids"] for row in rows]),
            labels=torch.stack([row["labels"] for row in rows]),
            cu_seqlens=torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0).to(torch.int32),
            num_samples=len(lengths),
        )
        if self.pairs:
            batch.pairs = torch.arange(len(lengths)).reshape(-1, 2)
        if self.rollout:
            batch.rollout = self._rollout(batch.labels, lengths)
        if self.vision is not None:
            for name in ("images", "videos"):
                parts = [row[name] for row in rows if row[name] is not None]
                if parts:
                    setattr(
                        batch,
                        name,
                        Images(
                            torch.cat([p for p, _ in parts]),
                            torch.tensor([g for _, grids in parts for g in grids], dtype=torch.int64),
                        ),
                    )
            from vlmcore.models import position_ids

            batch.position_ids = position_ids(
                self.config,
                batch.input_ids,
                batch.images.grid_thw if batch.images else None,
                batch.cu_seqlens,
                batch.videos.grid_thw if batch.videos else None,
            )
        return batch

    def row(self, j: int) -> dict:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + j)
        grids, video_grids = [], []
        vocab = self._text_vocab()
        cuts = torch.randperm(self.seq_len // 2 - 1, generator=g)[: self.segments - 1] * 2 + 2
        bounds = [0] + sorted(cuts.tolist()) + [self.seq_len]
        ids = torch.randint(0, vocab, (self.seq_len,), generator=g)
        lab = torch.full((self.seq_len,), IGNORE_INDEX)
        segments = list(zip(bounds[:-1], bounds[1:]))
        visual_span = {}  # segment -> tokens of the image or video at its start
        if self.vision is not None and torch.rand((), generator=g) < self.image_fraction:
            image_at = max(segments, key=lambda se: se[1] - se[0])
            grids.append(self._add_image(ids, *image_at))
            visual_span[image_at] = self._image_span()
        # Drawn only when videos are asked for: the image-only streams stay as they were.
        if self.vision is not None and self.video_fraction > 0 and torch.rand((), generator=g) < self.video_fraction:
            free = [se for se in segments if se not in visual_span and se[1] - se[0] >= self._video_span() + 2]
            if free:  # the longest segment without an image; none long enough: no video in this row
                video_at = max(free, key=lambda se: se[1] - se[0])
                video_grids.append(self._add_video(ids, *video_at, g))
                visual_span[video_at] = self._video_span()
        lengths = []
        for start, end in segments:
            prompt_end = start + visual_span.get((start, end), 0)
            # Supervise the end of each segment, of random length, like an answer.
            first = int(torch.randint(prompt_end + 1, end, (1,), generator=g))
            lab[first - 1 : end - 1] = ids[first:end]
            lengths.append(end - start)
        row = {"ids": ids, "labels": lab, "lengths": lengths, "images": None, "videos": None}
        if self.vision is not None:
            v = self.vision
            patch_dim = v.in_channels * v.temporal_patch_size * v.patch_size**2
            for name, kind_grids in (("images", grids), ("videos", video_grids)):
                if kind_grids:
                    patches = int(torch.tensor(kind_grids).prod(-1).sum())
                    row[name] = (torch.randn(patches, patch_dim, generator=g), kind_grids)
        return row

    def _rollout(self, labels: torch.Tensor, lengths: list[int]) -> Rollout:
        """The rows' segments as completions of a rollout (`rollout` in __init__)."""
        labelled = labels != IGNORE_INDEX
        old_logps = torch.where(labelled, -math.log(self.text.vocab_size), 0.0)
        signs = torch.tensor([1.0, -1.0]).repeat((len(lengths) + 1) // 2)[: len(lengths)]
        advantages = signs.repeat_interleave(torch.tensor(lengths)).view(labels.shape) * labelled
        return Rollout(old_logps.float(), advantages.float())

    def _image_span(self) -> int:
        """Tokens of one image: vision start, the merged patches, vision end."""
        return self.image_side**2 + 2

    def _video_span(self) -> int:
        """Tokens of one video: per frame group a 3-token timestamp, vision start, its merged
        patches, vision end (as Qwen3-VL's processor lays a video out)."""
        return self.video_frames * (self.image_side**2 + 5)

    def _add_video(self, ids: torch.Tensor, start: int, end: int, g: torch.Generator) -> list[int]:
        merge = self.vision.spatial_merge_size
        group = self.image_side**2  # merged patches of a frame group
        for f in range(self.video_frames):
            at = start + f * (group + 5)
            ids[at : at + 3] = torch.randint(0, self._text_vocab(), (3,), generator=g)  # the timestamp's text
            ids[at + 3] = self.config.vision_start_token_id
            ids[at + 4 : at + 4 + group] = self.config.video_token_id
            ids[at + 4 + group] = self.config.vision_end_token_id
        return [self.video_frames, self.image_side * merge, self.image_side * merge]

    def _add_image(self, ids: torch.Tensor, start: int, end: int) -> list[int]:
        """Puts one square image (image_side x image_side merged patches) at the start of a segment."""
        merge = self.vision.spatial_merge_size
        span = self._image_span()
        if end - start < span + 2:
            raise ValueError(
                f"data.seq_len / data.segments: segment of {end - start} tokens too short for an image of {span} tokens"
            )
        ids[start] = self.config.vision_start_token_id
        ids[start + 1 : start + span - 1] = self.config.image_token_id
        ids[start + span - 1] = self.config.vision_end_token_id
        return [1, self.image_side * merge, self.image_side * merge]
