"""Image embeddings between the vision tower's layout and the language model's on the same ranks
(`parallel.modules.vision` with its own tp: `VisionBridge`). Disjoint ranks have their own bridge:
vlmcore.parallel.disjoint.

Every rank reads the micro-batch of its language data-parallel rank (language tp peers read the
same one) and needs the embeddings of its images. Under vision TP the ranks of a vision TP group
must run the tower on the same patches, so before the tower they gather their images (each
language data-parallel rank's once, in rank order), run it on the union, and each keeps the
rows of its own micro-batch. In backward each rank has the gradient of its own rows only: the
union's is their sum over the group (an all-reduce), so the tower's backward, TP collectives
included, runs on the same values on every rank of the group.

Whatever the vision layout, each language micro-batch's images are computed `language tp` times
(once per language TP rank, or per vision TP group it is in), and the gradients are summed over
all of them (FSDP reduces by SUM): `count_images_once` scales the gradient of each copy of the
image embeddings by 1 / language tp. (Not FSDP2's gradient divide factor: torch 2.13 applies it
twice on a mesh whose shard dimension has size 1, as under HSDP with dp_shard 1.)
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.distributed.device_mesh import DeviceMesh

from vlmcore.models.layers import grid_list
from vlmcore.parallel.tp import sum_grad_over

# What a vision tower returns: the image embeddings and the DeepStack features.
TowerOutput = tuple[torch.Tensor, list[torch.Tensor]]


class VisionBridge:
    def __init__(self, vision: nn.Module, tp_mesh: DeviceMesh, language_tp: int) -> None:
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

    def gather_images(self, module: nn.Module, args: tuple) -> tuple:
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
        union = torch.cat([gathered[i][: counts[i]] for i in self.sources])
        return (union, [grid for i in self.sources for grid in all_grids[i]], *args[2:])

    def keep_own_rows(self, module: nn.Module, args: tuple, output: TowerOutput) -> TowerOutput:
        embeds, deepstack = output
        union = sum_grad_over(torch.cat([embeds, *deepstack], dim=1), self.tp_mesh)  # one all-reduce in backward
        embeds, *deepstack = union.narrow(0, *self.rows).split(embeds.shape[1], dim=1)
        return embeds, deepstack


def count_images_once(vision: nn.Module, copies: int) -> None:
    """Scales the gradient of the vision tower's outputs by 1 / `copies` (the language tp)."""

    def hook(module: nn.Module, args: tuple, output: TowerOutput) -> TowerOutput:
        embeds, deepstack = output
        for t in (embeds, *deepstack):
            if t.requires_grad:
                t.register_hook(lambda grad: grad / copies)
        return output

    if copies > 1:
        vision.register_forward_hook(hook)
