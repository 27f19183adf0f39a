"""Qwen3 text decoder (transformers `Qwen3ForCausalLM` layout), and Qwen3-MoE (`Qwen3MoeForCausalLM`):
the same model with sparse mixture-of-experts MLPs (models/moe.py).

Tensor parallelism: q/k/v/gate/up are column-parallel and o/down row-parallel over whole heads;
q_norm/k_norm act per head (shape head_dim), so they are replicated.
"""

from collections.abc import Iterator, Sequence

import torch
from torch import nn
from transformers import PretrainedConfig

from .attention import attention
from .layers import GridThw, RMSNorm, VisualTokens, apply_rotary, head_dim_of, rope_cos_sin, rope_inv_freq
from .linear_attention import token_segments
from .moe import feed_forward
from .parts import LayerCache, ModelCache, ModelOutput, TextModelParts, varies_by_batch


def check_text_config(config: PretrainedConfig, where: str) -> None:
    if config.hidden_act != "silu":
        raise ValueError(f"{where}: hidden_act {config.hidden_act!r} is not supported (only 'silu')")
    if getattr(config, "use_sliding_window", False):
        raise ValueError(f"{where}: use_sliding_window=True is not supported")


class Attention(nn.Module):
    """Grouped-query attention with per-head `norm` on q and k, then RoPE. `gated` (Qwen3.5): q_proj
    rows are per head [query | gate], and sigmoid(gate) scales the output per channel."""

    def __init__(self, config: PretrainedConfig, norm: type[RMSNorm] = RMSNorm, gated: bool = False) -> None:
        super().__init__()
        self.head_dim = head_dim_of(config)
        self.gated = gated
        n_heads, n_kv_heads = config.num_attention_heads, config.num_key_value_heads
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, n_heads * self.head_dim * (2 if gated else 1), bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, n_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, n_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(n_heads * self.head_dim, config.hidden_size, bias=bias)
        self.q_norm = norm(self.head_dim, config.rms_norm_eps)
        self.k_norm = norm(self.head_dim, config.rms_norm_eps)
        # Context parallelism (vlmcore.parallel.cp.apply_cp): x is this rank's chunk of the rows and
        # this runs `attention` on the whole rows over a share of the heads.
        self.context_parallel = None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cu_seqlens: torch.Tensor | None,
        max_seqlen: int | None = None,
        cache: LayerCache | None = None,
    ) -> torch.Tensor:
        batch, seq_len, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds a slice of whole heads.
        q = self.q_proj(x).view(batch, seq_len, -1, self.head_dim * (2 if self.gated else 1))
        if self.gated:
            q, gate = q.chunk(2, dim=-1)
        q = self.q_norm(q)
        k = self.k_norm(self.k_proj(x).view(batch, seq_len, -1, self.head_dim))
        v = self.v_proj(x).view(batch, seq_len, -1, self.head_dim)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if cache is not None and cache.decoding:  # one new token per row, over the cached keys and values
            out = cache.attend(q, k, v)
        elif self.context_parallel is None:
            out = attention(q, k, v, cu_seqlens, max_seqlen, causal=True)
        else:
            out = self.context_parallel(attention, q, k, v, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, causal=True)
        if cache is not None and not cache.decoding:  # a prefill: keep each prompt's keys and values
            cache.store(k, v, cu_seqlens)
        if self.gated:
            out = out * torch.sigmoid(gate)
        return self.o_proj(out.reshape(batch, seq_len, -1))


class Qwen3DecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = feed_forward(config, layer_idx)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cu_seqlens: torch.Tensor | None,
        max_seqlen: int | None = None,
        cache: LayerCache | None = None,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cu_seqlens, max_seqlen=max_seqlen, cache=cache)
        return x + self.mlp(self.post_attention_layernorm(x))


def text_position_ids(input_ids: torch.Tensor, cu_seqlens: torch.Tensor | None) -> torch.Tensor:
    """(B, S) positions: 0.. per row, restarting at every segment of `cu_seqlens`."""
    batch, seq_len = input_ids.shape
    if cu_seqlens is None:
        return torch.arange(seq_len, device=input_ids.device).expand(batch, seq_len)
    cu_seqlens = cu_seqlens.to(input_ids.device)
    seg = token_segments(cu_seqlens, batch * seq_len).view(batch, seq_len)
    flat = torch.arange(batch * seq_len, device=input_ids.device).view(batch, seq_len)
    return flat - cu_seqlens.long()[seg]


class Qwen3TextModel(nn.Module):
    """The decoder stack; with Qwen3-VL's DeepStack features, `deepstack[i]` is added at the image
    and video tokens (`visual`) after layer i."""

    config_name = "qwen3 config"  # how errors name the config
    norm_class = RMSNorm

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        check_text_config(config, self.config_name)
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList(self.decoder_layers(config))
        self.norm = self.norm_class(config.hidden_size, config.rms_norm_eps)
        # Identity on one device; under sequence parallelism the TP plan makes it split the
        # sequence over the TP ranks (the residual stream between the blocks).
        self.split_sequence = nn.Identity()

    def decoder_layers(self, config: PretrainedConfig) -> Iterator[nn.Module]:
        return (Qwen3DecoderLayer(config, i) for i in range(config.num_hidden_layers))

    def rotary(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin of the RoPE of (B, S) positions."""
        inv_freq = rope_inv_freq(self.config.rope_parameters, head_dim_of(self.config), self.config_name)
        return rope_cos_sin(inv_freq, position_ids, dtype)

    def forward(
        self,
        h: torch.Tensor,
        position_ids: torch.Tensor,
        cu_seqlens: torch.Tensor | None,
        max_seqlen: int | None = None,
        visual: VisualTokens | None = None,
        deepstack: Sequence[torch.Tensor] = (),
        cache: ModelCache | None = None,
    ) -> torch.Tensor:
        """`cache`: generation's (vlmcore.generate): a prefill fills it, a decoding step reads and extends it."""
        cos, sin = self.rotary(position_ids, h.dtype)
        varies_by_batch(cu_seqlens)  # rows hold more or fewer segments
        full_shape, dtype = h.shape, h.dtype
        h = self.split_sequence(h)
        for i, layer in enumerate(self.layers):
            if cache is None:
                h = layer(h, cos, sin, cu_seqlens, max_seqlen=max_seqlen)
            else:
                h = layer(h, cos, sin, cu_seqlens, max_seqlen=max_seqlen, cache=cache.layer(i))
            if i < len(deepstack):
                features = torch.zeros(full_shape, dtype=dtype, device=h.device)
                h = h + self.split_sequence(visual.scatter(features, deepstack[i], check=False))
        return self.norm(h)


class Qwen3ForCausalLM(TextModelParts, nn.Module):
    text_model_class = Qwen3TextModel
    name = "qwen3"  # how errors name the model

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.config = config
        self.head_dim = head_dim_of(config)
        self.model = self.text_model_class(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()

    def forward(
        self,
        input_ids: torch.Tensor,
        pixel_values: torch.Tensor | None = None,
        image_grid_thw: GridThw | None = None,
        position_ids: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        max_seqlen: int | None = None,
        return_hidden: bool = False,
        pixel_values_videos: torch.Tensor | None = None,
        video_grid_thw: GridThw | None = None,
        cache: ModelCache | None = None,
    ) -> ModelOutput:
        if pixel_values is not None or pixel_values_videos is not None:
            raise ValueError(f"{self.name} is a text model: pixel_values and pixel_values_videos must be None")
        if position_ids is None:
            position_ids = text_position_ids(input_ids, cu_seqlens)
        h = self.model(self.model.embed_tokens(input_ids), position_ids, cu_seqlens, max_seqlen, cache=cache)
        return self.output(h, return_hidden)
