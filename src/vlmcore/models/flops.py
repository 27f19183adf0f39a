"""Training FLOPs (forward + backward) for MFU, the LLM and the vision tower counted apart.

Convention (PaLM, torchtitan): every matmul weight costs 6 FLOPs per token that passes through
it (2 forward, 4 backward); attention scores and values cost 12 * heads * head_dim per pair of
tokens that may attend to each other, counting the full square of each segment (no causal
halving), in full-attention layers only. Embedding lookups, norms, biases and rotary are left
out; the LM head is counted even when tied to the embedding, since its matmul runs. The vision
tower (Qwen3-VL's, which Qwen3.5 reuses without DeepStack) works per image: patches pass through
the patch embedding and the blocks, merged tokens through the mergers, and each frame attends
to itself.

For the LLM that gives, per token of a segment of `seq_len` tokens:
    6 * N + 12 * layers * heads * head_dim * seq_len,   N = matmul weights per token.

Mixture-of-experts layers (qwen3_moe, qwen3_vl_moe, qwen3_5_moe) count the parameters a token
is routed through, not the parameters the layer holds: the router (H x E), its top_k experts
(3 x H x I each: gate, up, down) and, in Qwen3.5-MoE, the shared expert (3 x H x I_shared) and its
1-wide sigmoid gate (H). So a MoE layer's N is
    H * E + top_k * 3 * H * I  (+ 3 * H * I_shared + H),
with E = num_experts, top_k = num_experts_per_tok, I = moe_intermediate_size,
I_shared = shared_expert_intermediate_size. Layers listed in mlp_only_layers, and those that
decoder_sparse_step skips (layer i is sparse when (i + 1) % step == 0), keep the dense
3 * H * intermediate_size MLP, as in transformers. The memory estimate and parameter counts
hold all E experts: only the FLOPs are per active parameter.

Qwen3.5's linear-attention (Gated DeltaNet) layers replace the quadratic term by the matmuls of
the chunked gated delta rule, per value head and token: chunk * (4 Dk + 2 Dv) for the scores and
values inside a chunk, chunk * (Dk + Dv) for the two triangular solves, 6 Dk Dv for reading,
correcting and updating the state; times 3 for training. Their depthwise causal conv is left
out like the norms (a few multiply-adds per channel).
"""

from collections.abc import Sequence

import torch
from transformers import PretrainedConfig

from vlmcore.families import family

from .layers import GridThw, head_dim_of
from .linear_attention import CHUNK_SIZE
from .moe import is_sparse_layer


def text_config_of(config: PretrainedConfig) -> PretrainedConfig:
    family(config)  # a known family, or ValueError naming the supported ones
    return getattr(config, "text_config", config)


def layer_counts(text: PretrainedConfig) -> tuple[int, int]:
    """(full-attention layers, linear-attention layers)."""
    n_linear = sum(t == "linear_attention" for t in (getattr(text, "layer_types", None) or []))
    return text.num_hidden_layers - n_linear, n_linear


def full_attention_params(config: PretrainedConfig) -> int:
    """q (with the output gate where the family has one), k, v, o."""
    text = text_config_of(config)
    dim = text.hidden_size
    head_dim = head_dim_of(text)
    q_heads = (2 if family(config).gated_attention else 1) * text.num_attention_heads
    return dim * head_dim * (q_heads + 2 * text.num_key_value_heads + text.num_attention_heads)


def linear_attention_params(text: PretrainedConfig) -> int:
    """Gated DeltaNet: in_proj_qkv, in_proj_z, in_proj_a, in_proj_b, out_proj."""
    key = text.linear_num_key_heads * text.linear_key_head_dim
    value = text.linear_num_value_heads * text.linear_value_head_dim
    dim = text.hidden_size
    return dim * (2 * key + value) + dim * value + 2 * dim * text.linear_num_value_heads + value * dim


def moe_active_params(text: PretrainedConfig) -> int:
    """Matmul weights one token goes through in a MoE block: the router, its top_k experts, and
    Qwen3.5-MoE's shared expert with its sigmoid gate."""
    dim = text.hidden_size
    active = dim * text.num_experts + text.num_experts_per_tok * 3 * dim * text.moe_intermediate_size
    shared = getattr(text, "shared_expert_intermediate_size", 0) or 0
    if shared:
        active += 3 * dim * shared + dim
    return active


def mlp_params(text: PretrainedConfig) -> int:
    """Matmul weights of the MLPs of all layers one token goes through: dense 3 * H * I, or the
    active part of a MoE block."""
    return sum(
        moe_active_params(text) if is_sparse_layer(text, layer) else 3 * text.hidden_size * text.intermediate_size
        for layer in range(text.num_hidden_layers)
    )


def llm_matmul_params(config: PretrainedConfig) -> int:
    """Matmul weights one LLM token goes through: attention or linear attention and the MLP (its
    active experts in MoE layers) in every layer, the LM head."""
    text = text_config_of(config)
    n_full, n_linear = layer_counts(text)
    mixers = n_full * full_attention_params(config)
    if n_linear:
        mixers += n_linear * linear_attention_params(text)
    return mixers + mlp_params(text) + text.hidden_size * text.vocab_size


def linear_attention_flops_per_token(config: PretrainedConfig) -> float:
    """Training FLOPs of the chunked gated delta rule per token, all linear-attention layers."""
    text = text_config_of(config)
    n_linear = layer_counts(text)[1]
    if not n_linear:
        return 0.0
    dk, dv = text.linear_key_head_dim, text.linear_value_head_dim
    per_head = CHUNK_SIZE * (4 * dk + 2 * dv) + CHUNK_SIZE * (dk + dv) + 6 * dk * dv
    return 3.0 * n_linear * text.linear_num_value_heads * per_head


def attention_flops_per_pair(config: PretrainedConfig) -> float:
    """Training FLOPs of one (query, key) pair over all full-attention layers."""
    text = text_config_of(config)
    return 12.0 * layer_counts(text)[0] * text.num_attention_heads * head_dim_of(text)


def llm_flops_per_token(config: PretrainedConfig, seq_len: int) -> float:
    """6 * N + 12 * layers * heads * head_dim * seq_len (+ the linear-attention layers' delta
    rule) for a token of a `seq_len`-token segment."""
    return (
        6.0 * llm_matmul_params(config)
        + linear_attention_flops_per_token(config)
        + attention_flops_per_pair(config) * seq_len
    )


def llm_flops(config: PretrainedConfig, seq_lens: Sequence[int] | torch.Tensor) -> float:
    """FLOPs of a batch of segments: `seq_lens` (a list or 1-D tensor of segment lengths)."""
    lengths = torch.as_tensor(seq_lens, dtype=torch.float64)
    per_token = 6.0 * llm_matmul_params(config) + linear_attention_flops_per_token(config)
    return float(per_token * lengths.sum() + attention_flops_per_pair(config) * lengths.pow(2).sum())


def vision_matmul_params(config: PretrainedConfig) -> tuple[int, int]:
    """(weights per patch: patch embedding + blocks, weights per merged token: the mergers)."""
    vision = config.vision_config
    dim = vision.hidden_size
    patch_embed = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2 * dim
    block = 4 * dim * dim + 2 * dim * vision.intermediate_size
    merged = dim * vision.spatial_merge_size**2
    merger = merged * merged + merged * vision.out_hidden_size
    n_mergers = 1 + len(getattr(vision, "deepstack_visual_indexes", None) or [])
    return patch_embed + vision.depth * block, n_mergers * merger


def vision_flops(config: PretrainedConfig, image_grid_thw: GridThw | None) -> float:
    """FLOPs of the vision tower over the images of `image_grid_thw` (N, 3) = (t, h, w) in patches."""
    if image_grid_thw is None or len(image_grid_thw) == 0:
        return 0.0
    vision = config.vision_config
    grid = torch.as_tensor(image_grid_thw, dtype=torch.float64).view(-1, 3)
    frames = grid[:, 0]
    frame_len = grid[:, 1] * grid[:, 2]
    patches = float((frames * frame_len).sum())
    per_patch, per_merged = vision_matmul_params(config)
    matmuls = 6.0 * (per_patch * patches + per_merged * patches / vision.spatial_merge_size**2)
    attn = 12.0 * vision.depth * vision.hidden_size * float((frames * frame_len**2).sum())
    return matmuls + attn


def vision_flops_per_token(config: PretrainedConfig, image_grid_thw: GridThw) -> float:
    """Vision FLOPs per LLM image token (merged patch) of the given images."""
    grid = torch.as_tensor(image_grid_thw).view(-1, 3)
    tokens = int(grid.prod(-1).sum()) // config.vision_config.spatial_merge_size**2
    return vision_flops(config, grid) / tokens
