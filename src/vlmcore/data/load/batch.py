"""The batch the train step works on: packed rows of tokens and the images and videos in them.

The loader (vlmcore.data.load.loader) and the random data (vlmcore.train.random_data) make them on the
host; `to(device)` moves one to the device, where the images' uint8 patches become the image
processor's float32 values (`normalize_patches`) and what the kernels need on the host (the
longest packed segment, the image grids) is taken while the batch is still there. The step, the
metrics and the bridge between module layouts read the fields by name (docs/internals.md "Data
batches"); a new kind of input is a new field here and in its producers.
"""

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch

from vlmcore.data import IGNORE_INDEX
from vlmcore.data.media.image import normalize_patches
from vlmcore.data.media.video import normalize_video_patches
from vlmcore.models.qwen3 import text_position_ids

if TYPE_CHECKING:
    from transformers import PretrainedConfig

TensorMap = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class Images:
    """The images (or the videos) of a batch's rows, in token order. A video is one grid (T, h, w):
    T groups of temporal_patch_size frames, each group its own run of video tokens."""

    pixel_values: torch.Tensor  # (N_patches, C*P*P) uint8 patches (or float values: see `normalize`)
    grid_thw: torch.Tensor | list  # (N_images, 3) int64 (t, h, w) in patches; a list of [t, h, w] after `to`
    normalize: dict | None = None  # the image processor's {rescale_factor, mean, std, temporal_patch_size}
    # (`normalize_patches`) or the video processor's {image_mean, image_std} (`normalize_video_patches`);
    # None: `pixel_values` are the model's float inputs already
    kind: str = "image"  # or "video": which processor's normalisation `normalize` is for

    def to(self, device: torch.device) -> "Images":
        pixels = self.pixel_values.to(device, non_blocking=True)
        if self.normalize is not None:
            normalize = normalize_video_patches if self.kind == "video" else normalize_patches
            pixels = normalize(pixels, **self.normalize)
        grids = self.grid_thw.tolist() if torch.is_tensor(self.grid_thw) else self.grid_thw
        return Images(pixels, grids, None)

    def map_tensors(self, fn: TensorMap) -> "Images":
        """The images with `fn` applied to their pixels (and to the grids while they are a tensor)."""
        return replace(
            self,
            pixel_values=fn(self.pixel_values),
            grid_thw=fn(self.grid_thw) if torch.is_tensor(self.grid_thw) else self.grid_thw,
        )

    def grids(self) -> list[list[int]]:
        return self.grid_thw.tolist() if torch.is_tensor(self.grid_thw) else [list(g) for g in self.grid_thw]

    @staticmethod
    def zero(vision_config: "PretrainedConfig", device: torch.device) -> "Images":
        """A tiny zero image (one merged token) for a vision tower of `vision_config`, on the device:
        what a rank without images runs so that the tower's collectives match its peers'."""
        merge = vision_config.spatial_merge_size
        patch = vision_config.in_channels * vision_config.temporal_patch_size * vision_config.patch_size**2
        return Images(torch.zeros(merge * merge, patch, device=device), [[1, merge, merge]])

    @staticmethod
    def cat(parts: list["Images"]) -> "Images":
        """The images of several batches (or rows) one after the other."""
        if len(parts) == 1:
            return parts[0]
        grids = [g for part in parts for g in part.grids()]
        return Images(
            torch.cat([part.pixel_values for part in parts]),
            torch.tensor(grids, dtype=torch.long),
            parts[0].normalize,
            parts[0].kind,
        )


def row_chunk(x: torch.Tensor, cp_rank: int, cp: int, dim: int = 1) -> torch.Tensor:
    """This rank's contiguous 1/cp of the rows along `dim` (their length a multiple of cp)."""
    length = x.shape[dim]
    if length % cp:
        raise ValueError(
            f"rows of {length} tokens do not split into cp {cp} equal chunks: pack rows "
            f"(pack.seq_len) to a multiple of cp"
        )
    return x.narrow(dim, cp_rank * (length // cp), length // cp)


@dataclass
class Rollout:
    """Online RL: what a rollout recorded of each completion token, aligned with the batch's `labels`
    (position t holds the values of the token labels[t]; 0 where labels[t] is IGNORE_INDEX). Token
    tensors, so that context parallelism's cut (`row_chunk`) applies to them as to the labels."""

    old_logps: torch.Tensor  # (B, S) float32: the sampling policy's log-probability of labels[t]
    advantages: torch.Tensor  # (B, S) float32: the advantage of the completion that labels[t] is in

    def map_tensors(self, fn: TensorMap) -> "Rollout":
        return Rollout(fn(self.old_logps), fn(self.advantages))

    def chunk(self, cp_rank: int, cp: int) -> "Rollout":
        return self.map_tensors(lambda t: row_chunk(t, cp_rank, cp))


@dataclass
class Batch:
    """A micro-batch of B packed rows of S tokens."""

    input_ids: torch.Tensor  # (B, S) int64
    labels: torch.Tensor  # (B, S) int64, IGNORE_INDEX where no loss; label[t] is the target of logits[t]
    cu_seqlens: torch.Tensor  # (segments + 1,) int32 over the flattened B*S tokens
    position_ids: torch.Tensor | None = None  # (B, S), or (3, B, S) for M-RoPE models
    images: Images | None = None  # None: no image in the rows
    videos: Images | None = None  # None: no video in the rows
    num_samples: int = 0  # samples in the rows
    skipped_samples: dict = field(default_factory=dict)  # {reason: count} of bad samples left out of the rows
    row_keys: list[str] = field(default_factory=list)  # each row's pack (Energon key)
    # Each row's dataset: its name in the loader's blend (vlmcore.blend.dataset_names); empty: random data
    row_datasets: list[str] = field(default_factory=list)
    max_seqlen: int | None = None  # the longest segment, a host int (set by `to`)
    # Context parallelism (`context_chunk`): per kind present (images, then videos), the indices of
    # the vision tower's output rows at this rank's tokens; None: all of them
    visual_selection: list[torch.Tensor] | None = None
    # Preference data (DPO): (pairs, 2) int64, each pair's (chosen, rejected) segment indices; None: no pairs
    pairs: torch.Tensor | None = None
    # Online RL (GRPO): each completion token's recorded log-probability and advantage; None: no rollout
    rollout: Rollout | None = None

    def to(self, device: torch.device) -> "Batch":
        """The batch on `device`; its host metadata (`max_seqlen`, the image and video grids) stays on the host."""
        lengths = self.cu_seqlens[1:] - self.cu_seqlens[:-1]
        return replace(
            self,
            input_ids=self.input_ids.to(device, non_blocking=True),
            labels=self.labels.to(device, non_blocking=True),
            cu_seqlens=self.cu_seqlens.to(device, non_blocking=True),
            position_ids=None if self.position_ids is None else self.position_ids.to(device, non_blocking=True),
            images=None if self.images is None else self.images.to(device),
            videos=None if self.videos is None else self.videos.to(device),
            visual_selection=None
            if self.visual_selection is None
            else [t.to(device, non_blocking=True) for t in self.visual_selection],
            pairs=None if self.pairs is None else self.pairs.to(device, non_blocking=True),
            rollout=None
            if self.rollout is None
            else self.rollout.map_tensors(lambda t: t.to(device, non_blocking=True)),
            max_seqlen=self.max_seqlen if self.max_seqlen is not None else int(lengths.max()),
        )

    def pin_memory(self) -> "Batch":
        """The batch in page-locked memory, so that `to` copies it without blocking. torch's
        DataLoader (pin_memory=True) calls this on the objects it pins; before the batch had it,
        nothing was pinned and the pixels' copy was pageable (an 8 ms gap a step on an H200)."""
        return self.map_tensors(lambda t: t.pin_memory())

    def map_tensors(self, fn: TensorMap) -> "Batch":
        """The batch with `fn` applied to each of its tensors (its images' and videos' included)."""
        return replace(
            self,
            input_ids=fn(self.input_ids),
            labels=fn(self.labels),
            cu_seqlens=fn(self.cu_seqlens),
            position_ids=None if self.position_ids is None else fn(self.position_ids),
            images=None if self.images is None else self.images.map_tensors(fn),
            videos=None if self.videos is None else self.videos.map_tensors(fn),
            visual_selection=None if self.visual_selection is None else list(map(fn, self.visual_selection)),
            pairs=None if self.pairs is None else fn(self.pairs),
            rollout=None if self.rollout is None else self.rollout.map_tensors(fn),
        )

    def context_chunk(
        self, cp_rank: int, cp: int, visual_tokens: dict | None = None, merge: int = 1, keep_all: bool = False
    ) -> "Batch":
        """Context parallelism (vlmcore.parallel.cp): this rank's contiguous 1/cp of every row's tokens,
        labels and positions (the positions of the whole rows, taken before the cut). `cu_seqlens` and
        `max_seqlen` stay the whole rows': attention sees whole rows after its all-to-all.

        Images and videos' frame groups (the vision tower encodes each on its own: a (t, h, w)
        video is t (1, h, w) grids to it): only those with a token in the chunk stay (one cut by
        the chunk's edge stays on both sides), so a clip longer than a chunk is encoded a part on
        each rank; `visual_selection` says which of their tower's output rows are this chunk's.
        `visual_tokens`: {"image": id, "video": id} of a VL model; `merge`: its spatial merge size.
        `keep_all`: the tower's output comes for the whole rows from elsewhere (a language rank of
        disjoint layouts: vlmcore.parallel.disjoint), so every image and group stays and the
        selection indexes the whole rows' output."""
        positions = (
            self.position_ids if self.position_ids is not None else text_position_ids(self.input_ids, self.cu_seqlens)
        )
        in_chunk = torch.zeros_like(self.input_ids, dtype=torch.bool)
        row_chunk(in_chunk, cp_rank, cp).fill_(True)
        kept = {}
        selections = {}
        for kind in ("images", "videos"):
            items = getattr(self, kind)
            if items is None:
                kept[kind] = None
                continue
            token = visual_tokens[kind.removesuffix("s")]
            selected = in_chunk[self.input_ids == token]  # over the kind's tokens of the whole rows, in order
            grids = items.grids()
            groups = [(i, h * w) for i, (t, h, w) in enumerate(grids) for _ in range(t)]  # (item, patches)
            tokens = [patches // merge**2 for _, patches in groups]
            keep = [keep_all or bool(part.any()) for part in selected.split(tokens)]
            if not any(keep):
                kept[kind] = None
                continue
            rows = torch.cat([torch.full((patches,), k, dtype=torch.bool) for (_, patches), k in zip(groups, keep)])
            # An item's kept groups are consecutive (the chunk is): one grid of that many groups.
            kept_groups = Counter(i for (i, _), k in zip(groups, keep) if k)
            grid_thw = torch.tensor(
                [[kept_groups[i], h, w] for i, (_, h, w) in enumerate(grids) if kept_groups[i]], dtype=torch.long
            )
            kept[kind] = replace(items, pixel_values=items.pixel_values[rows], grid_thw=grid_thw)
            # Indices into the kept groups' tower output rows: those at this chunk's tokens.
            selections[kind] = torch.cat([part for part, k in zip(selected.split(tokens), keep) if k]).nonzero()[:, 0]
        return replace(
            self,
            input_ids=row_chunk(self.input_ids, cp_rank, cp),
            labels=row_chunk(self.labels, cp_rank, cp),
            position_ids=row_chunk(positions, cp_rank, cp, dim=-1),
            images=kept["images"],
            videos=kept["videos"],
            visual_selection=[selections[k] for k in ("images", "videos") if k in selections] or None,
            rollout=None if self.rollout is None else self.rollout.chunk(cp_rank, cp),
        )

    @property
    def has_visual(self) -> bool:
        return self.images is not None or self.videos is not None

    @property
    def label_tokens(self) -> int:
        """Tokens with a loss (read on the host)."""
        return int((self.labels != IGNORE_INDEX).sum())

    @property
    def tokens(self) -> int:
        return self.input_ids.numel()

    def segment_lengths(self) -> torch.Tensor:
        return self.cu_seqlens[1:] - self.cu_seqlens[:-1]
