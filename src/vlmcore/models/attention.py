"""Attention over packed rows, with the kernel chosen at run time.

Inputs are (B, S, H, D) with grouped-query heads allowed (k/v may have fewer heads).
`cu_seqlens` (int32, over the flattened B*S tokens) splits rows into independent segments and
`max_seqlen` is the longest of them, a Python int that the batch carries from the host (the
kernels need it and reading it from the device would stall the GPU at every layer).

- CUDA, bf16/fp16: a varlen flash kernel on the flattened tokens: torch's
  `torch.nn.attention.varlen.varlen_attn`, else flash-attn's `flash_attn_varlen_func`. Both are
  custom ops that torch.compile traces, so attention stays inside a compiled block. Their calling
  conventions differ between versions; `adapt_varlen_kernel` reads the signature once and calls
  each the way it takes (see `VARLEN_SIGNATURES` in the tests for the real ones).
- otherwise (CPU, fp32): SDPA over the block-diagonal mask, computed block by block, i.e. one SDPA
  call per segment (cheaper than a dense (S, S) mask: only the diagonal blocks are computed).
Without `cu_seqlens` every row is one sequence and plain SDPA is used everywhere.
"""

import inspect
import os
from collections.abc import Callable

import torch
import torch.nn.functional as F

from .gpu_kernels import GpuKernel, Kernel

# (q, k, v, cu_seqlens, max_seqlen, causal, scale) -> out, on flattened (T, H, D) tensors.
VarlenCall = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, bool, float | None], torch.Tensor]


def adapt_varlen_kernel(kernel: Kernel) -> VarlenCall:
    """A call `(q, k, v, cu_seqlens, max_seqlen, causal, scale) -> out` on flattened (T, H, D)
    tensors, for a varlen kernel with one of the known signatures:

    - torch 2.10: `varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, is_causal=False, return_aux=None)`,
      no scale, no GQA;
    - torch 2.11: `varlen_attn(..., max_k, *, return_aux, scale, window_size)`, no GQA;
    - torch 2.12+: as 2.11 plus `enable_gqa`;
    - flash-attn 2: `flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, softmax_scale,
      causal, ...)`, GQA by k/v heads alone.
    Where the kernel has no GQA flag k/v heads are repeated; where it takes no scale, q is scaled.
    """
    params = inspect.signature(kernel).parameters
    if "softmax_scale" in params:  # flash-attn

        def call(
            q: torch.Tensor,
            k: torch.Tensor,
            v: torch.Tensor,
            cu_seqlens: torch.Tensor,
            max_seqlen: int,
            causal: bool,
            scale: float | None,
        ) -> torch.Tensor:
            out = kernel(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, softmax_scale=scale, causal=causal)
            return out[0] if isinstance(out, tuple) else out  # some releases also return the lse

        return call
    if "is_causal" not in params and "window_size" not in params:
        raise TypeError(
            f"{getattr(kernel, '__module__', '')}.{kernel.__name__}{inspect.signature(kernel)}: "
            "not a known varlen attention signature"
        )
    has_gqa = "enable_gqa" in params
    has_scale = "scale" in params

    def call(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_seqlens: torch.Tensor,
        max_seqlen: int,
        causal: bool,
        scale: float | None,
    ) -> torch.Tensor:
        extra = {}
        if k.shape[1] != q.shape[1]:
            if has_gqa:
                extra["enable_gqa"] = True
            else:
                repeats = q.shape[1] // k.shape[1]
                k = k.repeat_interleave(repeats, dim=1)
                v = v.repeat_interleave(repeats, dim=1)
        if scale is not None:
            if has_scale:
                extra["scale"] = scale
            else:  # the kernel's own scale is D**-0.5
                q = q * (scale * q.shape[-1] ** 0.5)
        if "window_size" in params:
            extra["window_size"] = (-1, 0) if causal else (-1, -1)
        else:
            extra["is_causal"] = causal
        return kernel(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, **extra)

    return call


def _installed_varlen_kernel() -> Kernel | None:
    """The best varlen kernel importable here, or None. VLMCORE_ATTENTION=flash_attn prefers flash-attn."""
    torch_kernel = flash_kernel = None
    try:
        from torch.nn.attention.varlen import varlen_attn as torch_kernel
    except ImportError:
        pass
    try:
        from flash_attn import flash_attn_varlen_func as flash_kernel
    except ImportError:
        pass
    if os.environ.get("VLMCORE_ATTENTION") == "flash_attn" and flash_kernel is not None:
        return flash_kernel
    return torch_kernel or flash_kernel


VARLEN = GpuKernel(adapt_varlen_kernel, _installed_varlen_kernel())
set_varlen_kernel = VARLEN.set


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor | None = None,
    max_seqlen: int | None = None,
    causal: bool = True,
    scale: float | None = None,
) -> torch.Tensor:
    """q (B, S, Hq, D), k/v (B, S, Hkv, D) -> (B, S, Hq, D)."""
    batch, seq_len, n_heads, _ = q.shape
    if cu_seqlens is None:
        return sdpa(q, k, v, causal, scale)
    if VARLEN.runs_on(q, half_precision_only=True):  # the flash kernels take bf16/fp16 only
        if max_seqlen is None:  # outside training (a batch without it): one host read
            max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
        q, k, v = (t.flatten(0, 1) for t in (q, k, v))
        return VARLEN.call(q, k, v, cu_seqlens, max_seqlen, causal, scale).view(batch, seq_len, n_heads, -1)
    return segment_sdpa(q, k, v, cu_seqlens, causal, scale)


# Kept out of torch.compile graphs: the segment lengths are read on the host (free on CPU).
@torch.compiler.disable
def segment_sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    causal: bool,
    scale: float | None,
) -> torch.Tensor:
    batch, seq_len, n_heads, _ = q.shape
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    segments = zip(*(t.flatten(0, 1).split(lengths) for t in (q, k, v)))
    out = [sdpa(qs[None], ks[None], vs[None], causal, scale)[0] for qs, ks, vs in segments]
    return torch.cat(out).view(batch, seq_len, n_heads, -1)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float | None) -> torch.Tensor:
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        is_causal=causal,
        scale=scale,
        enable_gqa=k.shape[2] != q.shape[2],
    )
    return out.transpose(1, 2)
