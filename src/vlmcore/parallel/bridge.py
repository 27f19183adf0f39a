"""Image embeddings between the vision tower's layout and the language model's: colocated on
the same ranks (`parallel.modules.vision` with its own tp, `VisionBridge`) or on disjoint ranks
(`parallel.modules.*.ranks`, `DisjointBridge`, at the end).

Every rank reads the micro-batch of its language data-parallel rank (language tp peers read the
same one) and needs the embeddings of its images. Under vision TP the ranks of a vision TP group
must run the tower on the same patches, so before the tower they gather their images (each
language data-parallel rank's once, in rank order), run it on the union, and each keeps the
rows of its own micro-batch. The tower's output is the same on all of them; in backward each
rank has the gradient of its own rows only, so the gradient of the union is the sum over the
group (an all-reduce in backward), and the tower's backward, TP
collectives included, runs on the same values on every rank of the group.

Whatever the vision layout, each language micro-batch's images are computed `language tp` times
(once per language TP rank, or per vision TP group it is in), and the gradients are summed over
all of them (FSDP reduces by SUM): `count_images_once` scales the gradient of each copy of the
image embeddings by 1 / language tp. (Not FSDP2's gradient divide factor: torch 2.13 applies it
twice on a mesh whose shard dimension has size 1, as under HSDP with dp_shard 1.)
"""

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh

from vlmcore.data.batch import Images
from vlmcore.models.layers import grid_list
from vlmcore.parallel.tp import sum_grad_over


class VisionBridge:
    def __init__(self, vision: nn.Module, tp_mesh: DeviceMesh, language_tp: int):
        self.tp_mesh, self.group = tp_mesh, tp_mesh.get_group()
        ranks = dist.get_process_group_ranks(self.group)
        # The group's first rank of each language data-parallel rank brings that micro-batch's images.
        data_rank = [rank // language_tp for rank in ranks]
        self.sources = [i for i, d in enumerate(data_rank) if d not in data_rank[:i]]
        self.own_source = data_rank.index(dist.get_rank() // language_tp)
        self.merge = vision.merge
        self.rows = None  # (start, length) of this rank's embeddings in the union's
        vision.register_forward_pre_hook(self.gather_images)
        vision.register_forward_hook(self.keep_own_rows)

    def gather_images(self, module, args):
        pixels, grids = args[0], grid_list(args[1])
        size = self.tp_mesh.size()
        all_grids = [grids] * size  # the memory estimate's fake tensors: every rank holds a batch like this one
        if not isinstance(pixels, FakeTensor):
            dist.all_gather_object(all_grids, grids, group=self.group)
        counts = [sum(t * h * w for t, h, w in g) for g in all_grids]
        padded = F.pad(pixels, (0, 0, 0, max(counts) - pixels.shape[0]))
        gathered = [torch.empty_like(padded) for _ in range(size)]
        dist.all_gather(gathered, padded, group=self.group)
        start = sum(counts[i] for i in self.sources if i < self.own_source)
        self.rows = (start // self.merge**2, counts[self.own_source] // self.merge**2)
        union = torch.cat([gathered[i][:counts[i]] for i in self.sources])
        return (union, [grid for i in self.sources for grid in all_grids[i]], *args[2:])

    def keep_own_rows(self, module, args, output):
        embeds, deepstack = output
        union = sum_grad_over(torch.cat([embeds, *deepstack], dim=1), self.tp_mesh)  # one all-reduce in backward
        embeds, *deepstack = union.narrow(0, *self.rows).split(embeds.shape[1], dim=1)
        return embeds, deepstack


def count_images_once(vision: nn.Module, copies: int) -> None:
    """Scales the gradient of the vision tower's outputs by 1 / `copies` (the language tp)."""
    def hook(module, args, output):
        embeds, deepstack = output
        for t in (embeds, *deepstack):
            if t.requires_grad:
                t.register_hook(lambda grad: grad / copies)
        return output

    if copies > 1:
        vision.register_forward_hook(hook)


# Disjoint layouts (`parallel.modules.*.ranks`): the vision tower on its ranks, the language model on the others.

def row_grids(batch, image_token_id: int, merge: int) -> list[list[list[int]]]:
    """The image grids of each row of a host micro-batch (images are in token order, so a row's
    image tokens are those of its images)."""
    grids = iter(batch.images.grids() if batch.images is not None else [])
    rows = []
    for tokens in (batch.input_ids == image_token_id).sum(1).tolist():
        rows.append([])
        while tokens > 0:
            rows[-1].append(next(grids))
            tokens -= math.prod(rows[-1][-1]) // merge**2
    return rows


class SourceBatches:
    """An encoder rank's data: the micro-batches of the language data-parallel ranks whose rows
    it encodes (their own loaders, so the global micro-batch is the one the language ranks read)."""

    def __init__(self, loaders: list):
        self.loaders = loaders

    def __iter__(self):
        return zip(*self.loaders)

    def state_dict(self) -> dict:
        return {f"source{i}": loader.state_dict() for i, loader in enumerate(self.loaders)}

    def load_state_dict(self, state: dict) -> None:
        for i, loader in enumerate(self.loaders):
            loader.load_state_dict(state[f"source{i}"])


class ReceivedImages(nn.Module):
    """Stands in for the vision tower on the language ranks: returns the image embeddings (and
    DeepStack features) the bridge received for this micro-batch. No parameters; an empty merger
    list so the model's accessors (projectors) still answer."""

    def __init__(self, width: int):
        super().__init__()
        self.width, self.received = width, None
        self.merger, self.deepstack_merger_list = nn.Identity(), nn.ModuleList()

    def forward(self, pixel_values, grid_thw):
        embeds, *deepstack = self.received.split(self.width, dim=1)
        return embeds, deepstack


class DisjointBridge:
    """Moves image embeddings from the encoder ranks to the language ranks (forward) and their
    gradients back (backward): one all_to_all over the world per micro-batch, differentiable.

    The global micro-batch is the language data-parallel ranks' micro-batches in rank order
    (`micro_batch_size` rows each); encoder data-parallel rank i encodes the images of its
    contiguous slice of those rows and sends each row's embeddings to the language rank that owns
    the row. Every rank computes the sizes from the batches it holds (no host exchange).
    Language and vision tp are 1 (refused otherwise), so a data-parallel rank is one rank.
    """

    def __init__(self, config, layouts: dict, micro_batch_size: int, dtype: torch.dtype, device: torch.device,
                 rank: int, world_size: int):
        self.vision_ranks, self.language_ranks = layouts["vision"][1], layouts["language"][1]
        self.rank, self.world = rank, world_size
        self.is_vision = self.rank in self.vision_ranks
        self.micro_batch_size = micro_batch_size
        self.rows_per_encoder = micro_batch_size * len(self.language_ranks) // len(self.vision_ranks)
        vision = config.vision_config
        self.merge, self.image_token_id = vision.spatial_merge_size, config.image_token_id
        self.width = vision.out_hidden_size
        self.columns = self.width * (1 + len(getattr(vision, "deepstack_visual_indexes", None) or []))
        self.dtype, self.device = dtype, device
        self.plans = []  # per micro-batch of the step: (send sizes, receive sizes) by world rank
        self.stand_in = None  # ReceivedImages on a language rank

    def encoder_rows(self) -> range:
        i = self.rank - self.vision_ranks.start
        return range(i * self.rows_per_encoder, (i + 1) * self.rows_per_encoder)

    def source_ranks(self) -> range:
        """The language data-parallel ranks whose rows this encoder rank encodes."""
        rows = self.encoder_rows()
        return range(rows.start // self.micro_batch_size, (rows.stop - 1) // self.micro_batch_size + 1)

    def plan_step(self, host_micro: list) -> list:
        """Plans the step's micro-batches from the host batches this rank read: on a language
        rank its own micro-batches (returned as they are), on an encoder rank a tuple of the
        source ranks' for each (returned: the host image batch of its rows, None if imageless)."""
        self.plans = []
        if self.is_vision:
            return [self._plan_encoder(sources) for sources in host_micro]
        for batch in host_micro:
            self._plan_language(batch)
        return host_micro

    def _plan_encoder(self, sources: tuple) -> Images | None:
        send, pixels, grids = [0] * self.world, [], []
        for j, batch in zip(self.source_ranks(), sources):
            start = 0
            for k, images in enumerate(row_grids(batch, self.image_token_id, self.merge)):
                patches = sum(math.prod(g) for g in images)
                if images and j * self.micro_batch_size + k in self.encoder_rows():
                    pixels.append(batch.images.pixel_values[start:start + patches])
                    grids += images
                    send[self.language_ranks[j]] += patches // self.merge**2
                start += patches
        self.plans.append((send, [0] * self.world))
        if not grids:
            return None
        normalize = next(b.images.normalize for b in sources if b.images is not None)
        return Images(torch.cat(pixels), torch.tensor(grids), normalize)

    def _plan_language(self, batch: dict) -> None:
        receive, j = [0] * self.world, self.rank - self.language_ranks.start
        for k, images in enumerate(row_grids(batch, self.image_token_id, self.merge)):
            encoder = self.vision_ranks[(j * self.micro_batch_size + k) // self.rows_per_encoder]
            receive[encoder] += sum(math.prod(g) for g in images) // self.merge**2
        self.plans.append(([0] * self.world, receive))

    def exchange(self, i: int, send: torch.Tensor) -> torch.Tensor:
        """Micro-batch i's all_to_all: `send` (rows for the language ranks, in their order) goes
        out, this rank's rows come in; backward sends the gradients the other way."""
        send_sizes, receive_sizes = self.plans[i]
        return all_to_all_single_autograd(send.to(self.dtype).contiguous(), receive_sizes, send_sizes,
                                          dist.group.WORLD)

    def receive(self, i: int) -> torch.Tensor:
        """On a language rank: micro-batch i's image embeddings, for the model's stand-in."""
        nothing = torch.zeros(0, self.columns, dtype=self.dtype, device=self.device, requires_grad=True)
        self.stand_in.received = self.exchange(i, nothing)
        return self.stand_in.received

    def global_norm(self, norm: torch.Tensor) -> torch.Tensor:
        """The gradient norm over both grids from each module's own (the same on its ranks)."""
        first = self.vision_ranks.start if self.is_vision else self.language_ranks.start
        squares = norm.double() ** 2 if self.rank == first else torch.zeros((), dtype=torch.float64,
                                                                            device=norm.device)
        dist.all_reduce(squares)
        return squares.sqrt()
