"""Attention over packed rows, with the kernel chosen at run time.

Inputs are (B, S, H, D) with grouped-query heads allowed (k/v may have fewer heads).
`cu_seqlens` (int32, over the flattened B*S tokens) splits rows into independent segments:

- CUDA, bf16/fp16: `torch.nn.attention.varlen.varlen_attn` (flash) on the flattened tokens, or
  flash-attn's `flash_attn_varlen_func` when torch has no varlen kernel;
- otherwise (CPU, fp32): SDPA over the block-diagonal mask, computed block by block, i.e. one SDPA
  call per segment (cheaper than a dense (S, S) mask: only the diagonal blocks are computed).
Without `cu_seqlens` every row is one sequence and plain SDPA is used everywhere.
"""

import torch
import torch.nn.functional as F

try:
    from torch.nn.attention.varlen import varlen_attn
except ImportError:
    varlen_attn = None

try:
    from flash_attn import flash_attn_varlen_func
except ImportError:
    flash_attn_varlen_func = None


def segment_ids(cu_seqlens: torch.Tensor, batch: int, seq_len: int) -> torch.Tensor:
    """(B, S) index of the segment each token belongs to."""
    tokens = torch.arange(batch * seq_len, device=cu_seqlens.device)
    return torch.bucketize(tokens, cu_seqlens[1:].to(tokens.dtype), right=True).view(batch, seq_len)


def use_varlen_kernel(x: torch.Tensor) -> bool:
    """The flash kernels run on CUDA in half precision only."""
    has_kernel = varlen_attn is not None or flash_attn_varlen_func is not None
    return x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and has_kernel


# Kept out of torch.compile graphs: segment lengths are read on the host and vary every batch.
@torch.compiler.disable
def attention(q, k, v, cu_seqlens=None, causal=True, scale=None) -> torch.Tensor:
    """q (B, S, Hq, D), k/v (B, S, Hkv, D) -> (B, S, Hq, D)."""
    batch, seq_len, n_heads, _ = q.shape
    if cu_seqlens is None:
        return sdpa(q, k, v, causal, scale)
    if use_varlen_kernel(q):
        return varlen(q, k, v, cu_seqlens, causal, scale).view(batch, seq_len, n_heads, -1)
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    segments = zip(*(t.flatten(0, 1).split(lengths) for t in (q, k, v)))
    out = [sdpa(qs[None], ks[None], vs[None], causal, scale)[0] for qs, ks, vs in segments]
    return torch.cat(out).view(batch, seq_len, n_heads, -1)


def sdpa(q, k, v, causal, scale):
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
        is_causal=causal, scale=scale, enable_gqa=k.shape[2] != q.shape[2],
    )
    return out.transpose(1, 2)


def varlen(q, k, v, cu_seqlens, causal, scale):
    q, k, v = (t.flatten(0, 1) for t in (q, k, v))
    # One host sync per call: the kernels need the longest segment as a Python int.
    max_len = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    if varlen_attn is not None:
        return varlen_attn(
            q, k, v, cu_seqlens, cu_seqlens, max_len, max_len, scale=scale,
            window_size=(-1, 0) if causal else (-1, -1), enable_gqa=k.shape[1] != q.shape[1],
        )
    return flash_attn_varlen_func(
        q, k, v, cu_seqlens, cu_seqlens, max_len, max_len, softmax_scale=scale, causal=causal
    )
