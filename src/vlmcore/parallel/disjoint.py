"""Disjoint layouts (`parallel.modules.*.ranks`): the vision tower on its ranks (encoder ranks), the
language model on the others. `hold_one_module` keeps a rank's module of the meta model (a language
rank gets a parameterless stand-in, `ReceivedImages`, for the tower); `DisjointBridge` carries the
embeddings between them (a language rank's model takes them as its `vision_embeds` argument), runs
an encoder rank's side of the step and gives it its data.

Each module runs with tp 1 (vlmcore.parallel.checks refuses tensor parallelism here).
Under context parallelism each language rank of a row receives the whole row's embeddings and
keeps the rows of its chunk (`Batch.context_chunk(keep_all=True)`).
"""

import copy
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from transformers import PretrainedConfig

from vlmcore.config import ConfigError, TrainConfig
from vlmcore.data.load.batch import Batch, Images
from vlmcore.models.qwen3_vl import VisionEmbeds
from vlmcore.parallel.ac import apply_ac
from vlmcore.parallel.cp import apply_cp
from vlmcore.parallel.fsdp import apply_fsdp
from vlmcore.parallel.layout import RunLayout
from vlmcore.parallel.mesh import Meshes


def _replace(model: nn.Module, part: nn.Module, new: nn.Module | None) -> str:
    """Puts `new` where `part` is in `model`; returns the part's state-dict prefix."""
    name = next(name for name, module in model.named_modules() if module is part)
    parent, _, attribute = name.rpartition(".")
    setattr(model.get_submodule(parent), attribute, new)
    return name + "."


def hold_one_module(model: nn.Module, module: str, cfg: TrainConfig, meshes: Meshes) -> None:
    """This rank holds `module` ("vision" or "language") of the meta model only, FSDP-sharded over
    its own ranks' mesh: an encoder rank drops the language model and the LM head."""
    if module == "vision":
        model.dropped_prefixes = tuple(_replace(model, part, None) for part in (model.text_model(), model.lm_head))
        model.config = copy.copy(model.config)
        model.config.tie_word_embeddings = False
        stack = model.vision_layers()
        root = model.vision_tower()
        blocks = []  # the tower is one FSDP unit
    else:
        width = model.config.vision_config.out_hidden_size
        model.dropped_prefixes = (_replace(model, model.vision_tower(), ReceivedImages(width)),)
        stack = model.decoder_layers()
        root = model
        blocks = list(model.decoder_layers().children())
        if meshes.layout.language.dims.cp > 1:
            apply_cp(model, meshes.cp())
    if not any(p.requires_grad for p in model.parameters()):  # its ranks would have nothing to do
        raise ConfigError(
            f"trainable: no parameter of the {'vision tower' if module == 'vision' else 'language model'}"
            f" trains, but it has ranks of its own (parallel.modules.{module}.ranks); train this stage "
            f"with colocated layouts",
            "trainable",
        )
    apply_ac(stack, cfg.parallel.activation_checkpointing, cfg.parallel.compile)
    apply_fsdp(root, blocks, None, meshes.dp(module), None, cfg.precision)


def row_grids(batch: Batch, images: Images | None, token_id: int, merge: int) -> list[list[list[int]]]:
    """The grids of `images` (a host micro-batch's images, or its videos) in each of its rows
    (they are in token order, so a row's image tokens are those of its images)."""
    grids = iter(images.grids() if images is not None else [])
    rows = []
    for tokens in (batch.input_ids == token_id).sum(1).tolist():
        rows.append([])
        while tokens > 0:
            rows[-1].append(next(grids))
            tokens -= math.prod(rows[-1][-1]) // merge**2
    return rows


class SourceBatches:
    """An encoder rank's data: the micro-batches of the language data-parallel ranks whose rows
    it encodes (their own loaders, so the global micro-batch is the one the language ranks read)."""

    def __init__(self, loaders: list) -> None:
        self.loaders = loaders

    def __iter__(self) -> Iterator[tuple]:
        return zip(*self.loaders)

    def state_dict(self) -> dict:
        return {f"source{i}": loader.state_dict() for i, loader in enumerate(self.loaders)}

    def load_state_dict(self, state: dict) -> None:
        for i, loader in enumerate(self.loaders):
            loader.load_state_dict(state[f"source{i}"])

    def seek(self, rows: int, steps: int | None = None) -> None:
        for loader in self.loaders:
            loader.seek(rows, steps)


@dataclass
class EncoderInputs:
    """An encoder rank's share of a micro-batch: the images and the videos of its rows."""

    images: Images | None
    videos: Images | None

    def to(self, device: torch.device) -> "EncoderInputs":
        images = None if self.images is None else self.images.to(device)
        videos = None if self.videos is None else self.videos.to(device)
        return EncoderInputs(images, videos)

    def map_tensors(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> "EncoderInputs":
        images = None if self.images is None else self.images.map_tensors(fn)
        videos = None if self.videos is None else self.videos.map_tensors(fn)
        return EncoderInputs(images, videos)


class ReceivedImages(nn.Module):
    """Stands in for the vision tower on the language ranks, which never run it: the model takes
    the embeddings the bridge received as its `vision_embeds` argument. No parameters; an empty
    merger list so the model's accessors (projectors) still answer."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.width = width
        self.merger = nn.Identity()
        self.deepstack_merger_list = nn.ModuleList()

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> None:
        raise RuntimeError(
            "the vision tower runs on the encoder ranks: pass the received embeddings as the model's vision_embeds"
        )


@dataclass
class ExchangePlan:
    """One micro-batch's all_to_all on this rank, by world rank: the embedding rows it sends to each
    rank and receives from each, and of those, per kind ("images", "videos"), the rows exchanged with
    each rank (an encoder rank's for its destinations, a language rank's from its sources)."""

    send: list[int]
    receive: list[int]
    by_kind: dict[str, list[int]]


class DisjointBridge:
    """Moves image and video embeddings from the encoder ranks to the language ranks (forward) and
    their gradients back (backward): one all_to_all over the world per micro-batch, differentiable.

    The global micro-batch is the language data-parallel ranks' micro-batches in rank order
    (`micro_batch_size` rows each); encoder data-parallel rank i encodes the images and videos of
    its contiguous slice of those rows and sends each row's embeddings to the language rank that
    owns the row, each destination's images then its videos. A language rank puts what it
    receives (its sources' images and videos, source after source) in the order its model takes
    the tower's output: all images, then all videos. Every rank computes the sizes from the
    batches it holds (no host exchange). With tp 1, a data-parallel rank is one rank, or under
    context parallelism `cp` consecutive ranks, each sent the embeddings of the whole rows.
    """

    def __init__(
        self,
        config: PretrainedConfig,
        layout: RunLayout,
        micro_batch_size: int,
        dtype: torch.dtype,
        device: torch.device,
        rank: int,
    ) -> None:
        self.vision_ranks = layout.vision.ranks
        self.language_ranks = layout.language.ranks
        self.data_world = layout.language.dims.dp
        self.cp = layout.language.dims.cp
        self.rank = rank
        self.world = layout.world_size
        self.is_vision = self.rank in self.vision_ranks
        self.micro_batch_size = micro_batch_size
        self.rows_per_encoder = micro_batch_size * self.data_world // len(self.vision_ranks)
        vision = config.vision_config
        self.merge = vision.spatial_merge_size
        self.width = vision.out_hidden_size
        self.kinds = {"images": config.image_token_id, "videos": getattr(config, "video_token_id", None)}
        self.columns = self.width * (1 + len(getattr(vision, "deepstack_visual_indexes", None) or []))
        self.dtype = dtype
        self.device = device
        self.plans: list[ExchangePlan] = []  # the step's, one per micro-batch
        # A reference's tower on an encoder rank (DPO's, or GRPO's with a KL term:
        # `vlmcore.train.build.use_reference`): (pixels, grids) -> (embeds, deepstack), run before
        # the policy's tower on each micro-batch.
        self.reference_tower: Callable | None = None

    def encoder_rows(self) -> range:
        i = self.rank - self.vision_ranks.start
        return range(i * self.rows_per_encoder, (i + 1) * self.rows_per_encoder)

    def source_ranks(self) -> range:
        """The language data-parallel ranks whose rows this encoder rank encodes."""
        rows = self.encoder_rows()
        return range(rows.start // self.micro_batch_size, (rows.stop - 1) // self.micro_batch_size + 1)

    def encoder_data(self, build_data: Callable[[int, int], Iterable]) -> SourceBatches:
        """An encoder rank's data: `build_data(data_rank, data_world)` of each language
        data-parallel rank whose rows it encodes."""
        return SourceBatches([build_data(j, self.data_world) for j in self.source_ranks()])

    def plan_step(self, host_micro: list) -> list:
        """Plans the step's micro-batches from the host batches this rank read: on a language
        rank its own micro-batches (returned as they are), on an encoder rank a tuple of the
        source ranks' for each (returned: the images and videos of its rows, None if it has none)."""
        self.plans = []
        if self.is_vision:
            return [self._plan_encoder(sources) for sources in host_micro]
        for batch in host_micro:
            self._plan_language(batch)
        return host_micro

    def _plan_encoder(self, sources: tuple) -> EncoderInputs | None:
        sizes = {}  # per kind, the rows for each rank (every cp rank of a row gets it)
        inputs = {}
        for kind, token in self.kinds.items():
            sizes[kind] = [0] * self.world
            pixels = []
            grids = []
            for j, batch in zip(self.source_ranks(), sources):
                start = 0
                for k, images in enumerate(row_grids(batch, getattr(batch, kind), token, self.merge)):
                    patches = sum(math.prod(g) for g in images)
                    if images and j * self.micro_batch_size + k in self.encoder_rows():
                        pixels.append(getattr(batch, kind).pixel_values[start : start + patches])
                        grids += images
                        for rank in self.language_ranks[j * self.cp : (j + 1) * self.cp]:
                            sizes[kind][rank] += patches // self.merge**2
                    start += patches
            first = next((getattr(b, kind) for b in sources if getattr(b, kind) is not None), None)
            inputs[kind] = (
                Images(torch.cat(pixels), torch.tensor(grids), first.normalize, first.kind) if grids else None
            )
        send = [a + b for a, b in zip(sizes["images"], sizes["videos"])]
        self.plans.append(ExchangePlan(send=send, receive=[0] * self.world, by_kind=sizes))
        return None if inputs["images"] is None and inputs["videos"] is None else EncoderInputs(**inputs)

    def _plan_language(self, batch: Batch) -> None:
        sizes = {}
        j = (self.rank - self.language_ranks.start) // self.cp  # this rank's language data-parallel rank
        for kind, token in self.kinds.items():
            sizes[kind] = [0] * self.world
            for k, images in enumerate(row_grids(batch, getattr(batch, kind), token, self.merge)):
                encoder = self.vision_ranks[(j * self.micro_batch_size + k) // self.rows_per_encoder]
                sizes[kind][encoder] += sum(math.prod(g) for g in images) // self.merge**2
        receive = [a + b for a, b in zip(sizes["images"], sizes["videos"])]
        self.plans.append(ExchangePlan(send=[0] * self.world, receive=receive, by_kind=sizes))

    def exchange(self, i: int, send: torch.Tensor) -> torch.Tensor:
        """Micro-batch i's all_to_all: `send` (rows for the language ranks, in their order) goes
        out, this rank's rows come in; backward sends the gradients the other way."""
        plan = self.plans[i]
        return all_to_all_single_autograd(send.to(self.dtype).contiguous(), plan.receive, plan.send, dist.group.WORLD)

    def encoder_step(self, model: nn.Module, inputs: list[EncoderInputs | None]) -> torch.Tensor:
        """An encoder rank's forward and backward: runs the vision tower on the images and videos
        of its rows of each micro-batch (in one pass, images first, as the model does), sends the
        embeddings to the language ranks and backpropagates the gradients they send back. Without
        either it runs a tiny zero image and sends none of it, so the tower's collectives match its
        other ranks'. With a `reference_tower` (DPO) the reference's embeddings go first, without
        gradients, in an exchange of their own. Returns a zero loss sum (the language ranks have it)."""
        vision = model.vision_tower()
        device = next(model.parameters()).device
        for i, batch in enumerate(inputs):
            vision.set_requires_gradient_sync(i == len(inputs) - 1)
            kinds = (
                [Images.zero(model.config.vision_config, device)]
                if batch is None
                else [x for x in (batch.images, batch.videos) if x is not None]
            )
            pixels = torch.cat([x.pixel_values for x in kinds]) if len(kinds) > 1 else kinds[0].pixel_values
            grids = [g for x in kinds for g in x.grids()]
            if self.reference_tower is not None:
                with torch.no_grad():
                    self.exchange(i, self._sent(i, batch, *self.reference_tower(pixels, grids)))
            received = self.exchange(i, self._sent(i, batch, *vision(pixels, grids)))
            received.sum().backward()  # nothing arrives on an encoder rank; its backward brings `sent`'s gradient
        return torch.zeros((), dtype=torch.float64, device=device)

    def _sent(
        self, i: int, batch: EncoderInputs | None, embeds: torch.Tensor, deepstack: list[torch.Tensor]
    ) -> torch.Tensor:
        """What an encoder rank sends of micro-batch i's tower output (nothing for a zero image)."""
        sent = torch.cat([embeds, *deepstack], dim=1)
        return self._by_destination(sent, self.plans[i].by_kind) if batch is not None else sent[:0]

    def _by_destination(self, rows: torch.Tensor, sizes: dict) -> torch.Tensor:
        """The tower's output (all images, then all videos, each by language data-parallel rank) as
        the all_to_all sends it: each destination's images, then its videos (the same to each cp
        rank of a data-parallel rank)."""
        # The tower ran once per data-parallel rank's rows: their sizes are those of its first cp rank.
        firsts = self.language_ranks[:: self.cp]
        images_by_data = [sizes["images"][rank] for rank in firsts]
        videos_by_data = [sizes["videos"][rank] for rank in firsts]
        images, videos = rows.split([sum(images_by_data), sum(videos_by_data)])
        parts = zip(images.split(images_by_data), videos.split(videos_by_data))
        return torch.cat([part for pair in parts for _ in range(self.cp) for part in pair])

    def receive(self, i: int) -> VisionEmbeds:
        """On a language rank: micro-batch i's image and video embeddings, as the model's
        `vision_embeds` takes them: the images of every source, then the videos (as the model's
        tower pass orders them), the DeepStack features as further columns."""
        nothing = torch.zeros(0, self.columns, dtype=self.dtype, device=self.device, requires_grad=True)
        received = self.exchange(i, nothing)
        plan = self.plans[i]
        from_sources = zip(received.split(plan.receive), plan.by_kind["images"], plan.by_kind["videos"])
        by_source = [part.split([image_rows, video_rows]) for part, image_rows, video_rows in from_sources]
        images = [images for images, _ in by_source]
        videos = [videos for _, videos in by_source]
        return VisionEmbeds(torch.cat(images + videos))

    def global_norm(self, norm: torch.Tensor) -> torch.Tensor:
        """The gradient norm over both grids from each module's own (the same on its ranks)."""
        first = self.vision_ranks.start if self.is_vision else self.language_ranks.start
        squares = norm.double() ** 2 if self.rank == first else torch.zeros((), dtype=torch.float64, device=norm.device)
        dist.all_reduce(squares)
        return squares.sqrt()
