"""The gated delta rule and causal conv1d of vlmcore.models.linear_attention.

Checked against the token-by-token definition, against transformers' own pure-torch Qwen3.5
kernels, and for packed tokens against running every segment on its own.
"""

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

from vlmcore.models.linear_attention import (
    causal_depthwise_conv,
    chunk_gated_delta_rule,
    fla_chunk_gated_delta_rule,
    gated_delta_rule,
    recurrent_gated_delta_rule,
    row_segments,
)


def inputs(n_tokens, heads=3, dk=8, dv=6, seed=0, requires_grad=False):
    """q, k, v, g, beta over n_tokens flattened tokens."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n_tokens, heads, dk, generator=g)
    k = torch.randn(n_tokens, heads, dk, generator=g)
    v = torch.randn(n_tokens, heads, dv, generator=g)
    decay = -F.softplus(torch.randn(n_tokens, heads, generator=g)) * 0.5
    beta = torch.rand(n_tokens, heads, generator=g)
    return [t.requires_grad_(requires_grad) for t in (q, k, v, decay, beta)]


def cu_of(lengths):
    return F.pad(torch.tensor(lengths).cumsum(0), (1, 0)).to(torch.int32)


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def segments(cu):
    return [(s, e) for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()) if e > s]


@pytest.mark.parametrize("seq_len,chunk_size", [(7, 4), (16, 4), (37, 8), (50, 64)])
def test_chunked_equals_recurrent(seq_len, chunk_size):
    x = inputs(2 * seq_len)
    cu = row_segments(None, 2, seq_len, "cpu")
    ref = recurrent_gated_delta_rule(*x, cu)
    assert rel(chunk_gated_delta_rule(*x, cu, chunk_size=chunk_size), ref) < 1e-5


def test_matches_transformers_torch_kernels():
    """transformers' kernels take (B, S, H, D) rows; ours the flattened rows with one segment each."""
    batch, seq_len = 2, 45
    x = inputs(batch * seq_len)
    q, k, v, g, beta = (t.unflatten(0, (batch, seq_len)) for t in x)
    cu = row_segments(None, batch, seq_len, "cpu")
    for l2 in (True, False):
        ref, _ = hf.torch_chunk_gated_delta_rule(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=l2)
        assert rel(chunk_gated_delta_rule(*x, cu, use_qk_l2norm=l2, chunk_size=16), ref.flatten(0, 1)) < 1e-5
    ref, _ = hf.torch_recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True)
    assert rel(recurrent_gated_delta_rule(*x, cu), ref.flatten(0, 1)) < 1e-5


def test_gated_delta_rule_uses_the_torch_path_on_cpu():
    x = inputs(20)
    cu = cu_of([20])
    assert torch.equal(gated_delta_rule(*x, cu), chunk_gated_delta_rule(*x, cu))


@pytest.mark.skipif(
    fla_chunk_gated_delta_rule is None or not torch.cuda.is_available(), reason="needs flash-linear-attention and CUDA"
)
def test_fla_kernel_matches_the_torch_path_packed_with_grads():
    x = [t.cuda().requires_grad_() for t in inputs(300, heads=4, dk=64, dv=64)]
    cu = cu_of([100, 37, 163]).cuda()
    weights = torch.randn(300, 4, 64, device="cuda")
    grads = []
    for fn in (gated_delta_rule, chunk_gated_delta_rule):
        out = fn(*x, cu)
        (out * weights).sum().backward()
        grads.append([out.detach()] + [t.grad.clone() for t in x])
        for t in x:
            t.grad = None
    for fla_value, torch_value in zip(*grads):
        assert rel(fla_value, torch_value) < 2e-3


@pytest.mark.parametrize("lengths", [[5, 11, 16], [1, 30, 1], [9, 0, 23], [8, 8, 8]])
def test_packed_equals_per_segment_with_grads(lengths):
    """Packed tokens == each segment alone, outputs and input gradients; no state crosses segments."""
    x = inputs(sum(lengths), requires_grad=True)
    cu = cu_of(lengths)
    out = chunk_gated_delta_rule(*x, cu, chunk_size=8)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(5))
    (out * weights).sum().backward()
    packed_grads = [t.grad.clone() for t in x]
    for t in x:
        t.grad = None
    for start, end in segments(cu):
        part = [t[start:end] for t in x]
        alone = cu_of([end - start])
        assert rel(out[start:end], recurrent_gated_delta_rule(*part, alone)) < 1e-5
        (chunk_gated_delta_rule(*part, alone, chunk_size=8) * weights[start:end]).sum().backward()
    for packed, single in zip(packed_grads, (t.grad for t in x)):
        assert rel(packed, single) < 1e-5


def test_bf16_inputs_are_computed_in_fp32():
    x = inputs(40)
    cu = cu_of([40])
    out = chunk_gated_delta_rule(*[t.bfloat16() for t in x], cu)
    assert out.dtype == torch.bfloat16
    assert rel(out.float(), chunk_gated_delta_rule(*[t.bfloat16().float() for t in x], cu)) < 1e-2


def test_causal_conv_matches_transformers_and_restarts_per_segment():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 13, 10, generator=g)
    weight = torch.randn(10, 1, 4, generator=g)
    ref = hf.causal_conv1d_fn(x.transpose(1, 2), weight.squeeze(1), None, activation="silu").transpose(1, 2)
    out = causal_depthwise_conv(x.flatten(0, 1), weight, row_segments(None, 2, 13, "cpu"))
    assert rel(out, ref.flatten(0, 1)) < 1e-6

    cu = torch.tensor([0, 2, 9, 13, 26], dtype=torch.int32)
    flat = x.flatten(0, 1)
    out = causal_depthwise_conv(flat, weight, cu)
    for start, end in segments(cu):
        assert rel(out[start:end], causal_depthwise_conv(flat[start:end], weight, cu_of([end - start]))) < 1e-6
