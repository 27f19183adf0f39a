"""Qwen3.5 (transformers `Qwen3_5ForConditionalGeneration` and the text-only `Qwen3_5ForCausalLM`)
and Qwen3.5-MoE (`Qwen3_5MoeForConditionalGeneration`, `Qwen3_5MoeForCausalLM`): the same model
whose every MLP is a sparse MoE block (models/moe.py) with top-k renormalised routing and a
sigmoid-gated shared expert.

A hybrid decoder: `config.layer_types` interleaves Gated DeltaNet linear-attention layers with
gated full-attention layers (query plus a per-head output gate, per-head zero-centred q/k norms,
rotary on the first `partial_rotary_factor` of each head, interleaved M-RoPE). All decoder norms
are zero-centred (scale 1 + weight). The vision tower is Qwen3-VL's without DeepStack.

Tensor parallelism: `in_proj_qkv` is [q (key heads) | k (key heads) | v (value heads)] and
`conv1d` has one channel per output row of it, so no single-dimension shard gives a rank whole
heads of all three. The TP plan sets `GatedDeltaNet.head_shard`; the mixer then takes its rank's
rows of each of the three blocks (and of `A_log`, `dt_bias`) from the full weights, while
`in_proj_z/a/b` are column-parallel and `out_proj` row-parallel. In full-attention layers
`q_proj` rows are per head [query (head_dim) | gate (head_dim)], so a column split over whole
heads keeps pairs together.
"""

from collections.abc import Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Partial
from transformers import PretrainedConfig

from .layers import RMSNorm, VisualTokens, ZeroCenteredRMSNorm, head_dim_of, mrope_cos_sin, rope_inv_freq
from .linear_attention import (
    causal_depthwise_conv,
    conv_step,
    conv_window,
    gated_delta_rule,
    gated_delta_step,
    host_segments,
    row_segments,
)
from .moe import feed_forward
from .parts import LayerCache, ModelCache, varies_by_batch
from .qwen3 import Attention, Qwen3ForCausalLM, Qwen3TextModel
from .qwen3_vl import Qwen3VLForConditionalGeneration

DEFAULT_MROPE_SECTION = [11, 11, 10]  # transformers' value when the config has none


class GatedRMSNorm(RMSNorm):
    """RMSNorm (unit-initialised scale) followed by a SiLU gate, per value head."""

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return (super().forward(x) * F.silu(gate.float())).to(x.dtype)


class GatedDeltaNet(nn.Module):
    breaks_graph = True  # fla's kernel runs between two compiled graphs (parallel/compile.py)

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.n_k_heads, self.n_v_heads = config.linear_num_key_heads, config.linear_num_value_heads
        self.k_dim, self.v_dim = config.linear_key_head_dim, config.linear_value_head_dim
        key_size, value_size = self.n_k_heads * self.k_dim, self.n_v_heads * self.v_dim
        self.split = [key_size, key_size, value_size]
        conv_dim = sum(self.split)
        self.in_proj_qkv = nn.Linear(config.hidden_size, conv_dim, bias=False)
        self.in_proj_z = nn.Linear(config.hidden_size, value_size, bias=False)
        self.in_proj_b = nn.Linear(config.hidden_size, self.n_v_heads, bias=False)
        self.in_proj_a = nn.Linear(config.hidden_size, self.n_v_heads, bias=False)
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, config.linear_conv_kernel_dim, groups=conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.n_v_heads))
        self.A_log = nn.Parameter(torch.empty(self.n_v_heads))
        self.norm = GatedRMSNorm(self.v_dim, config.rms_norm_eps)
        self.out_proj = nn.Linear(value_size, config.hidden_size, bias=False)
        # (rank, ranks) under tensor parallelism: this rank computes heads [rank/ranks, (rank+1)/ranks)
        # of every head group; their inputs from the column-parallel projections arrive already split.
        self.head_shard = (0, 1)
        self.context_parallel = None  # vlmcore.parallel.cp.apply_cp
        self.reset_own_parameters()

    def reset_own_parameters(self, std: float = 0.02) -> None:
        nn.init.ones_(self.dt_bias)
        with torch.no_grad():
            self.A_log.copy_(torch.empty_like(self.A_log).uniform_(0.01, 16).log())

    def forward(
        self,
        x: torch.Tensor,
        cu_seqlens: torch.Tensor | None,
        cu_seqlens_cpu: torch.Tensor | None = None,
        cache: LayerCache | None = None,
    ) -> torch.Tensor:
        """`cache` (generation): a prefill leaves each segment's convolution window and state in it; a
        decoding step (one token per row) goes on from them."""
        batch, seq_len, _ = x.shape
        decoding = cache is not None and cache.decoding
        # Under context parallelism x is this rank's chunk of the rows; the recurrence and the
        # convolution run on whole rows for a share of the heads (vlmcore.parallel.cp).
        cp = self.context_parallel
        length = seq_len * (cp.cp if cp is not None else 1)
        cu_seqlens = row_segments(cu_seqlens, batch, length, x.device)
        x = x.flatten(0, 1)
        # Under TP, x is a replicated DTensor (the column-parallel projections take it as is) and the
        # rows of qkv read here are plain tensors: this rank's heads give a part of x's gradient.
        x_local = x.to_local(grad_placements=[Partial()]) if isinstance(x, DTensor) else x
        sizes = [size // self.head_shard[1] for size in self.split]
        # This rank's heads (all of them without TP).
        mixed = F.linear(x_local, block_share(self.in_proj_qkv.weight, self.split, *self.head_shard))
        if getattr(self.in_proj_qkv, "adapters_enabled", False):  # LoRA (models/lora.py) on this rank's heads
            mixed = mixed + self.in_proj_qkv.update(
                x_local, block_share(self.in_proj_qkv.lora_B, self.split, *self.head_shard)
            )
        conv_weight = block_share(self.conv1d.weight, self.split, *self.head_shard)
        A_log = block_share(self.A_log, [self.n_v_heads], *self.head_shard)
        dt_bias = block_share(self.dt_bias, [self.n_v_heads], *self.head_shard)
        beta = self.in_proj_b(x).sigmoid()
        g = -A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + dt_bias)
        if cp is not None:
            mixed = cp.channels_to_rows(mixed.view(batch, seq_len, -1), sizes).flatten(0, 1)
            conv_weight = block_share(conv_weight, sizes, cp.rank, cp.cp)
            sizes = [size // cp.cp for size in sizes]
            gates = torch.stack([beta.float(), g], dim=-1).view(batch, seq_len, -1)  # head h: channels 2h, 2h + 1
            gates = cp.channels_to_rows(gates, [gates.shape[-1]]).flatten(0, 1).unflatten(-1, (-1, 2))
            beta, g = gates[..., 0].to(beta.dtype), gates[..., 1]
        if decoding:
            qkv, cache.conv_window = conv_step(mixed, cache.conv_window, conv_weight)
        else:
            qkv = causal_depthwise_conv(mixed, conv_weight, cu_seqlens)
            if cache is not None:
                cache.conv_window = conv_window(mixed, cu_seqlens, conv_weight.shape[-1])
        qkv = qkv.to(x.dtype)
        q, k, v = qkv.split(sizes, dim=-1)
        q, k = q.unflatten(-1, (-1, self.k_dim)), k.unflatten(-1, (-1, self.k_dim))
        v = v.unflatten(-1, (-1, self.v_dim))
        # Each key head serves a run of consecutive value heads.
        groups = v.shape[1] // q.shape[1]
        q, k = q.repeat_interleave(groups, dim=1), k.repeat_interleave(groups, dim=1)
        # z before the kernel: under torch.compile the kernel is a graph break, and a DTensor view
        # (x) live across it cannot be rebuilt after it.
        z = self.in_proj_z(x).unflatten(-1, (-1, self.v_dim))
        if decoding:
            out, cache.recurrent_state = gated_delta_step(q, k, v, g, beta, cache.recurrent_state)
        elif cache is not None:
            out, cache.recurrent_state = gated_delta_rule(
                q, k, v, g, beta, cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu, final_state=True
            )
        else:
            out = gated_delta_rule(q, k, v, g, beta, cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu)
        if cp is not None:
            out = cp.heads_to_chunk(out.view(batch, length, -1, self.v_dim)).flatten(0, 1)
        out = self.norm(out, z)
        return self.out_proj(out.reshape(batch, seq_len, -1))


def block_share(t: torch.Tensor, sizes: list[int], rank: int, ranks: int) -> torch.Tensor:
    """Share `rank` of `ranks` equal parts of each block of `sizes` rows of t (all of t for one rank)."""
    if ranks == 1:
        return t
    return torch.cat([block.chunk(ranks)[rank] for block in t.split(sizes)])


class Qwen3_5DecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, layer_type: str, layer_idx: int) -> None:
        super().__init__()
        self.layer_type = layer_type
        if layer_type == "linear_attention":
            self.linear_attn = GatedDeltaNet(config)
        elif layer_type == "full_attention":
            self.self_attn = Attention(config, ZeroCenteredRMSNorm, gated=True)
        else:
            raise ValueError(f"qwen3_5 text config: unknown layer type {layer_type!r} in layer_types")
        self.input_layernorm = ZeroCenteredRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = feed_forward(config, layer_idx)  # SwiGLU, or Qwen3.5-MoE's sparse block

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cu_seqlens: torch.Tensor | None,
        max_seqlen: int | None = None,
        cu_seqlens_cpu: torch.Tensor | None = None,
        cache: LayerCache | None = None,
    ) -> torch.Tensor:
        h = self.input_layernorm(x)
        if self.layer_type == "linear_attention":
            x = x + self.linear_attn(h, cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu, cache=cache)
        else:
            x = x + self.self_attn(h, cos, sin, cu_seqlens, max_seqlen=max_seqlen, cache=cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3_5TextModel(Qwen3TextModel):
    config_name = "qwen3_5 text config"
    norm_class = ZeroCenteredRMSNorm

    def decoder_layers(self, config: PretrainedConfig) -> Iterator[nn.Module]:
        if len(config.layer_types) != config.num_hidden_layers:
            raise ValueError(
                f"qwen3_5 text config: {len(config.layer_types)} layer_types for {config.num_hidden_layers} layers"
            )
        return (Qwen3_5DecoderLayer(config, t, i) for i, t in enumerate(config.layer_types))

    def rotary(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin of the partial interleaved M-RoPE; (B, S) positions drive all three axes."""
        rope = self.config.rope_parameters
        rot_dim = int(head_dim_of(self.config) * rope.get("partial_rotary_factor", 1.0))
        inv_freq = rope_inv_freq(rope, rot_dim, self.config_name)
        if position_ids.dim() == 2:
            position_ids = position_ids.expand(3, -1, -1)
        return mrope_cos_sin(inv_freq, position_ids, rope.get("mrope_section", DEFAULT_MROPE_SECTION), dtype)

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
        """`visual` and `deepstack` are not used: Qwen3.5 has no DeepStack. `cache`: generation's."""
        cos, sin = self.rotary(position_ids, h.dtype)
        bounds = host_segments(cu_seqlens, h)
        varies_by_batch(cu_seqlens)  # rows hold more or fewer segments
        varies_by_batch(bounds)
        h = self.split_sequence(h)
        for i, layer in enumerate(self.layers):
            if cache is None:
                h = layer(h, cos, sin, cu_seqlens, max_seqlen=max_seqlen, cu_seqlens_cpu=bounds)
            else:
                h = layer(h, cos, sin, cu_seqlens, max_seqlen=max_seqlen, cu_seqlens_cpu=bounds, cache=cache.layer(i))
        return self.norm(h)


class Qwen3_5ForConditionalGeneration(Qwen3VLForConditionalGeneration):
    """Qwen3-VL's model around the Qwen3.5 decoder (its vision tower has no DeepStack)."""

    text_model_class = Qwen3_5TextModel


class Qwen3_5ForCausalLM(Qwen3ForCausalLM):
    """The text-only variant (`model_type` "qwen3_5_text" / "qwen3_5_moe_text"): `model.*`, `lm_head.weight`."""

    text_model_class = Qwen3_5TextModel
    name = property(lambda self: self.config.model_type)
