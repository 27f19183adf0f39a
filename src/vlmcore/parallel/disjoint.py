"""Disjoint layouts (`parallel.modules.*.ranks`): the vision tower on its ranks (encoder ranks), the
language model on the others, and everything that makes them one run:

- `hold_one_module`: each rank keeps its module of the meta model, FSDP-sharded over its own
  ranks' mesh; an encoder rank drops the language model and the LM head, a language rank puts a
  parameterless stand-in (`ReceivedImages`) where the vision tower was;
- `DisjointBridge`: moves each micro-batch's image embeddings from the encoder ranks to the language
  ranks and their gradients back (one differentiable all_to_all over the world), runs an encoder
  rank's side of the step (`encoder_step`), combines the two grids' gradient norms, and gives an
  encoder rank its data (`encoder_data`): the micro-batches of the language data-parallel ranks
  whose rows it encodes (`SourceBatches`), so the global micro-batch is the one the language
  ranks read.

Each module runs with tp 1 for now (vlmcore.parallel.checks refuses tensor parallelism here).
"""

import copy
import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd

from vlmcore.config import ConfigError, TrainConfig
from vlmcore.data.batch import Images
from vlmcore.parallel.ac import apply_ac
from vlmcore.parallel.compile import apply_compile
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
    its own ranks' mesh."""
    if module == "vision":
        model.dropped_prefixes = tuple(_replace(model, part, None) for part in (model.text_model(), model.lm_head))
        model.config = copy.copy(model.config)
        model.config.tie_word_embeddings = False
        stack, root, blocks = model.vision_layers(), model.vision_tower(), []
    else:
        width = model.config.vision_config.out_hidden_size
        model.dropped_prefixes = (_replace(model, model.vision_tower(), ReceivedImages(width)),)
        stack, root, blocks = model.decoder_layers(), model, list(model.decoder_layers().children())
    if not any(p.requires_grad for p in model.parameters()):  # its ranks would have nothing to do
        raise ConfigError(f"trainable: no parameter of the {'vision tower' if module == 'vision' else 'language model'}"
                          f" trains, but it has ranks of its own (parallel.modules.{module}.ranks); train this stage "
                          f"with colocated layouts", "trainable")
    apply_ac(stack, cfg.parallel.activation_checkpointing)
    if cfg.parallel.compile:
        apply_compile(stack, cfg.parallel.activation_checkpointing)
    apply_fsdp(root, blocks, None, meshes.dp(module), None, param_dtype=getattr(torch, cfg.precision.param_dtype),
               reduce_dtype=getattr(torch, cfg.precision.reduce_dtype))


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

    def seek(self, rows: int) -> None:
        for loader in self.loaders:
            loader.seek(rows)


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

    def __init__(self, config, layout: RunLayout, micro_batch_size: int, dtype: torch.dtype, device: torch.device,
                 rank: int):
        self.vision_ranks, self.language_ranks = layout.vision.ranks, layout.language.ranks
        self.data_world = layout.language.dims.dp
        self.rank, self.world = rank, layout.world_size
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

    def encoder_data(self, build_data) -> "SourceBatches":
        """An encoder rank's data: `build_data(data_rank, data_world)` of each language
        data-parallel rank whose rows it encodes."""
        return SourceBatches([build_data(j, self.data_world) for j in self.source_ranks()])

    def plan_step(self, host_micro: list) -> list:
        """Plans the step's micro-batches from the host batches this rank read: on a language
        rank its own micro-batches (returned as they are), on an encoder rank a tuple of the
        source ranks' for each (returned: the host image batch of its rows, None if imageless)."""
        self.plans = []
        if any(b.videos is not None for batch in host_micro for b in (batch if self.is_vision else (batch,))):
            raise ConfigError("parallel.modules.vision.ranks: disjoint module layouts do not carry videos yet; "
                              "train rows with videos with colocated layouts", "parallel.modules.vision.ranks")
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

    def _plan_language(self, batch) -> None:
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

    def encoder_step(self, model: nn.Module, images: list[Images | None]) -> torch.Tensor:
        """An encoder rank's forward and backward: runs the vision tower on the images of its rows
        of each micro-batch, sends the embeddings to the language ranks and backpropagates the
        gradients they send back. Without images it runs a tiny zero image and sends none of it, so
        the tower's collectives match its other ranks'. Returns a zero loss sum (the language ranks
        have it)."""
        vision, device = model.vision_tower(), next(model.parameters()).device
        for i, batch in enumerate(images):
            vision.set_requires_gradient_sync(i == len(images) - 1)
            batch = batch if batch is not None else Images.zero(model.config.vision_config, device)
            embeds, deepstack = vision(batch.pixel_values, batch.grid_thw)
            sent = torch.cat([embeds, *deepstack], dim=1)
            received = self.exchange(i, sent if images[i] is not None else sent[:0])
            received.sum().backward()  # nothing arrives on an encoder rank; its backward brings `sent`'s gradient
        return torch.zeros((), dtype=torch.float64, device=device)

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
