"""What every native model is to the rest of vlmcore: its named parts and its output.

Parallelism, freezing, parameter groups and the train step act on the parts these accessors
name, never on module paths; `breaks_graph` is how a block says that torch.compile cannot trace it
whole, and `varies_by_batch` which sizes of its inputs change from batch to batch (parallel/compile.py).
"""

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from .layers import init_std, init_weights


@dataclass
class ModelOutput:
    """What every model returns: `logits` (B, S, V), or `hidden_states` (B, S, H) with `return_hidden=True`."""

    logits: torch.Tensor | None = None
    hidden_states: torch.Tensor | None = None


class LayerCache(Protocol):
    """One decoder layer's part of a generation cache (vlmcore.generate.cache), as the layers use it.

    `decoding` False: a prefill runs the training forward on packed prompts (one per segment of
    `cu_seqlens`) and leaves each prompt's state here: an attention layer calls
    `store(k, v, cu_seqlens)`; a Gated DeltaNet layer sets `conv_window` (the last inputs of its
    convolution) and `recurrent_state`. `decoding` True: one new token per row; an attention layer
    calls `attend(q, k, v)` (appends k and v, attends over the row's cache), a Gated DeltaNet layer
    steps its `conv_window` and `recurrent_state`."""

    decoding: bool


class ModelCache(Protocol):
    """A generation cache of the whole decoder: `layer(i)` is decoder layer i's part."""

    def layer(self, index: int) -> LayerCache: ...


class TextModelParts:
    """The named parts of a text-only model: `self.model` is the decoder stack, `self.lm_head` the
    output projection."""

    # State-dict prefixes of the parts this rank does not hold (disjoint layouts,
    # vlmcore.parallel.parallelize): the snapshot's tensors under them are not loaded here.
    dropped_prefixes: tuple[str, ...] = ()

    def text_model(self) -> nn.Module:
        """The decoder stack: `embed_tokens`, `layers`, `norm`, `split_sequence`."""
        return self.model

    def decoder_layers(self) -> nn.ModuleList:
        return self.text_model().layers

    def token_embedding(self) -> nn.Embedding:
        return self.text_model().embed_tokens

    def vision_tower(self) -> nn.Module | None:
        return None

    def vision_layers(self) -> nn.ModuleList | None:
        """The vision tower's transformer blocks."""
        return None

    def projectors(self) -> list[nn.Module]:
        """The modules that map vision features into the LLM (inside the vision tower)."""
        return []

    def output(self, h: torch.Tensor, return_hidden: bool) -> ModelOutput:
        return ModelOutput(hidden_states=h) if return_hidden else ModelOutput(logits=self.lm_head(h))

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.token_embedding().weight

    def init_weights(self) -> None:
        init_weights(self, init_std(self.config))
        self.tie_weights()


class VisionLanguageParts(TextModelParts):
    """The named parts of a VL model: `model.language_model`, `model.visual` and its mergers."""

    def text_model(self) -> nn.Module:
        return self.model.language_model

    def vision_tower(self) -> nn.Module:
        return self.model.visual

    def vision_layers(self) -> nn.ModuleList:
        return self.model.visual.blocks

    def projectors(self) -> list[nn.Module]:
        return [self.model.visual.merger, *self.model.visual.deepstack_merger_list]


def breaks_graph(block: nn.Module) -> bool:
    """Whether dynamo must break the graph of `block`: one of its modules says so (a Gated DeltaNet
    mixer, whose fla kernel runs eagerly; an MoE block whose dispatch reads the host)."""
    return any(getattr(m, "breaks_graph", False) for m in block.modules())


def varies_by_batch(tensor: torch.Tensor | None, dim: int = 0) -> None:
    """Says that `tensor`'s size at `dim` changes from batch to batch (a packed row's segment
    bounds, the vision tower's patches), for the blocks it goes into: compiled, they take it as a
    symbol from their first compile. Unmarked, dynamo makes the first batch's size a constant, and
    compiles every block kind again at the first batch of another size. Nothing changes in eager."""
    if tensor is not None and not torch.compiler.is_compiling():
        torch._dynamo.maybe_mark_dynamic(tensor, dim)
