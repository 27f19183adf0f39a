"""The state a generation keeps between decoding steps, one part per decoder layer.

Rows are sequences (a prompt's sample each). An attention layer keeps its keys and values in
(rows, capacity, kv heads, head dim) buffers, row r's first `lengths[r]` slots filled; a Gated
DeltaNet layer keeps the last inputs of its causal convolution, (rows, kernel - 1, channels), and
its recurrent state, (rows, heads, Dk, Dv) in fp32. Buffers are made at the prefill from the
shapes the layers give them, so under tensor parallelism each rank holds its own heads.

The prefill is the training forward on the prompts packed into one row (`cu_seqlens`): each
segment's keys and values go to their row's cache. A decoding step writes each row's new key and
value at its length and attends over the slots up to it.
"""

from collections.abc import Sequence

import torch
import torch.nn.functional as F


class Lengths:
    """The tokens each row holds (shared by the layers of one cache): (rows,) on the device, and the
    largest on the host (the slice every decoding step attends over: no device read)."""

    def __init__(self, lengths: torch.Tensor) -> None:
        self.per_row = lengths
        self.longest = int(lengths.max())

    def advance(self) -> None:
        self.per_row = self.per_row + 1
        self.longest += 1


class AttentionCache:
    """Keys and values of one attention layer."""

    def __init__(self, lengths: Lengths, capacity: int) -> None:
        self.lengths = lengths
        self.capacity = capacity
        self.decoding = False
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    def store(self, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor) -> None:
        """k, v (1, T, H, D) of prompts packed by `cu_seqlens` -> row i holds segment i's at [0, length)."""
        rows = cu_seqlens.shape[0] - 1
        shape = (rows, self.capacity, *k.shape[2:])
        self.keys, self.values = k.new_zeros(shape), v.new_zeros(shape)
        cu = cu_seqlens.long().to(k.device)
        row = torch.bucketize(torch.arange(k.shape[1], device=k.device), cu[1:], right=True)
        slot = torch.arange(k.shape[1], device=k.device) - cu[row]
        self.keys[row, slot] = k[0]
        self.values[row, slot] = v[0]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q, k, v (rows, 1, H, D): each row's new token, attending over its cache and itself."""
        rows = torch.arange(q.shape[0], device=q.device)
        at = self.lengths.per_row
        self.keys[rows, at] = k[:, 0]
        self.values[rows, at] = v[:, 0]
        span = self.lengths.longest + 1
        visible = torch.arange(span, device=q.device)[None] <= at[:, None]  # (rows, span)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            self.keys[:, :span].transpose(1, 2),
            self.values[:, :span].transpose(1, 2),
            attn_mask=visible[:, None, None],
            enable_gqa=k.shape[2] != q.shape[2],
        )
        return out.transpose(1, 2)

    def select_rows(self, index: torch.Tensor) -> None:
        self.keys, self.values = self.keys[index], self.values[index]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.keys, self.values) if t is not None)


class LinearAttentionCache:
    """The convolution window and recurrent state of one Gated DeltaNet layer (set by the layer)."""

    def __init__(self) -> None:
        self.decoding = False
        self.conv_window: torch.Tensor | None = None
        self.recurrent_state: torch.Tensor | None = None

    def select_rows(self, index: torch.Tensor) -> None:
        self.conv_window, self.recurrent_state = self.conv_window[index], self.recurrent_state[index]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.conv_window, self.recurrent_state) if t is not None)


class GenerationCache:
    """A model's cache for one generation: a part per decoder layer, by the layer's kind."""

    def __init__(self, layer_types: Sequence[str], prompt_lengths: torch.Tensor, capacity: int) -> None:
        """`layer_types`: each decoder layer's, "full_attention" or "linear_attention" (the text
        config's `layer_types`); `prompt_lengths` (rows,): the tokens the prefill will give each row;
        `capacity`: the most tokens a row will hold (its prompt and its generated tokens)."""
        self.lengths = Lengths(prompt_lengths)
        self.layers = [
            LinearAttentionCache() if kind == "linear_attention" else AttentionCache(self.lengths, capacity)
            for kind in layer_types
        ]

    def layer(self, index: int) -> AttentionCache | LinearAttentionCache:
        return self.layers[index]

    def start_decoding(self) -> None:
        for part in self.layers:
            part.decoding = True

    def advance(self) -> None:
        """After a decoding step: every row holds one token more."""
        self.lengths.advance()

    def select_rows(self, index: torch.Tensor) -> None:
        """Keep (and repeat) rows: `index` (new rows,) of old rows, e.g. each prompt's row n times for
        n samples sharing its prefill, or the rows still generating."""
        for part in self.layers:
            part.select_rows(index)
        self.lengths.per_row = self.lengths.per_row[index]
        self.lengths.longest = int(self.lengths.per_row.max())

    def nbytes(self) -> int:
        return sum(part.nbytes() for part in self.layers)


def layer_types(text_config: object) -> list[str]:
    """Each decoder layer's kind: the config's `layer_types` (Qwen3.5), else all full attention."""
    kinds = getattr(text_config, "layer_types", None)
    return list(kinds) if kinds else ["full_attention"] * text_config.num_hidden_layers


def cache_bytes(text_config: object, rows: int, capacity: int, dtype: torch.dtype, tp: int = 1) -> int:
    """The bytes of a generation cache of `rows` rows of `capacity` tokens on one rank of `tp`
    tensor-parallel ranks: keys and values of the attention layers in the model's dtype, the
    convolution windows (model dtype) and fp32 recurrent states of the Gated DeltaNet layers."""
    size = torch.empty((), dtype=dtype).element_size()
    head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // text_config.num_attention_heads
    kv_heads = max(1, text_config.num_key_value_heads // tp)
    total = 0
    for kind in layer_types(text_config):
        if kind == "linear_attention":
            k_heads, v_heads = text_config.linear_num_key_heads // tp, text_config.linear_num_value_heads // tp
            k_dim, v_dim = text_config.linear_key_head_dim, text_config.linear_value_head_dim
            channels = 2 * k_heads * k_dim + v_heads * v_dim
            total += rows * (text_config.linear_conv_kernel_dim - 1) * channels * size
            total += rows * v_heads * k_dim * v_dim * 4
        else:
            total += 2 * rows * capacity * kv_heads * head_dim * size
    return total
