"""Gated DeltaNet token mixing over packed tokens: the gated delta rule and its causal conv1d.

Per head, with a (Dk, Dv) state S, decay g_t <= 0 (log space) and write strength beta_t:

    S_t = exp(g_t) S_{t-1} + k_t (beta_t (v_t - exp(g_t) S_{t-1}^T k_t))^T
    o_t = S_t^T q_t

Inputs are the flattened B*S tokens of a batch, (T, heads, dim). `cu_seqlens` (int32) splits
them into independent segments (`row_segments` gives one per row when a batch is not packed):
the state and the convolution window start from zero at every segment, so packed samples do
not see each other.

`gated_delta_rule` runs flash-linear-attention's `chunk_gated_delta_rule` when fla is
importable, the tensors are on CUDA and the backend is not set to torch (`vlmcore.kernels`
checks before training that fla is correct on the GPU), and otherwise `chunk_gated_delta_rule`
below: the same chunked algorithm in plain torch (fp32, differentiable, any device, no host sync).
`recurrent_gated_delta_rule` is the token-by-token definition, kept as the reference.
"""

import inspect
from collections.abc import Callable

import torch
import torch.nn.functional as F

from .gpu_kernels import GpuKernel

try:
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk_gated_delta_rule
except ImportError:
    fla_chunk_gated_delta_rule = None

# Tokens per chunk of the chunked algorithm, fla's too; FLOPs counts depend on it.
CHUNK_SIZE = 64


def row_segments(cu_seqlens: torch.Tensor | None, batch: int, seq_len: int, device: torch.device | str) -> torch.Tensor:
    """`cu_seqlens` as given, or one segment per row of a (batch, seq_len) batch."""
    if cu_seqlens is not None:
        return cu_seqlens.to(device)
    return torch.arange(0, (batch + 1) * seq_len, seq_len, dtype=torch.int32, device=device)


def token_segments(cu_seqlens: torch.Tensor, n_tokens: int) -> torch.Tensor:
    """(T,) index of the segment of every token."""
    tokens = torch.arange(n_tokens, device=cu_seqlens.device)
    return torch.bucketize(tokens, cu_seqlens[1:].long(), right=True)


def causal_depthwise_conv(x: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """SiLU of the depthwise causal convolution of x (T, C), restarting at every segment.

    weight (C, 1, K) is in nn.Conv1d's layout: out[t] = sum_j weight[:, 0, j] * x[t - K + 1 + j].
    Accumulated in fp32 and rounded once to the weight's dtype, as a convolution kernel does.
    """
    n_tokens = x.shape[0]
    kernel = weight.shape[-1]
    x = x.to(weight.dtype).float()
    w = weight[:, 0].float()
    seg = token_segments(cu_seqlens, n_tokens)
    out = x * w[:, kernel - 1]
    for shift in range(1, kernel):
        past = F.pad(x, (0, 0, shift, 0))[:n_tokens]
        same_segment = F.pad(seg, (shift, 0), value=-1)[:n_tokens] == seg
        out = out + past * same_segment[:, None] * w[:, kernel - 1 - shift]
    return F.silu(out.to(weight.dtype))


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(|x|^2 + eps), as fla's in-kernel q/k normalisation."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def _prepare(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, use_qk_l2norm: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 inputs, with q and k normalised and q scaled by Dk^-1/2."""
    if k.shape != q.shape or v.shape[:2] != q.shape[:2] or g.shape != q.shape[:2] or beta.shape != q.shape[:2]:
        raise ValueError(
            f"gated delta rule: q {tuple(q.shape)} and k {tuple(k.shape)} must match; v {tuple(v.shape)}, "
            f"g {tuple(g.shape)} and beta {tuple(beta.shape)} must share their (tokens, heads)"
        )
    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    return q * q.shape[-1] ** -0.5, k, v, g, beta


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    use_qk_l2norm: bool = True,
    chunk_size: int = CHUNK_SIZE,
    bound_chunks: bool | None = None,
    final_state: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Gated delta rule by chunks: exact within a chunk by a triangular solve, a scan across chunks.

    q, k (T, H, Dk), v (T, H, Dv), g and beta (T, H) -> (T, H, Dv) in v's dtype; with
    `final_state` also each segment's state after its last token, (N_segments, H, Dk, Dv) in fp32
    (generation goes on from it: vlmcore.generate).
    Every segment is laid out on whole chunks (zero padding after its end, which neither decays
    nor writes the state), so a chunk never mixes two segments and the scan resets the state at
    the first chunk of each segment.
    """
    n_tokens, n_heads, head_v_dim = v.shape
    out_dtype = v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta, use_qk_l2norm)

    cu = cu_seqlens.long()
    seg = token_segments(cu_seqlens, n_tokens)
    seg_chunks = (cu[1:] - cu[:-1] + chunk_size - 1) // chunk_size
    first_chunk = seg_chunks.cumsum(0) - seg_chunks
    dest = first_chunk[seg] * chunk_size + torch.arange(n_tokens, device=cu.device) - cu[seg]
    # On a GPU the padded layout is sized by a bound known from the shapes (each segment adds at
    # most one partial chunk), not the exact count, which would be a host read; the spare chunks at
    # the end are all zero, so they neither write the state nor reach the output. On the host the
    # exact count is free (`bound_chunks` None: the bound unless on the host).
    if bound_chunks is None:
        bound_chunks = cu.device.type != "cpu"
    if bound_chunks:
        n_segments = cu_seqlens.shape[0] - 1
        n_chunks = max(1, min(n_tokens, (n_tokens + n_segments * (chunk_size - 1)) // chunk_size))
    else:
        n_chunks = int(seg_chunks.sum())
    keep_state = torch.ones(n_chunks + 1, device=q.device)
    keep_state.scatter_(0, torch.where(seg_chunks > 0, first_chunk, n_chunks), 0.0)
    keep_state = keep_state[:n_chunks]

    def chunked(t: torch.Tensor) -> torch.Tensor:  # (T, H, ...) -> (H, N, C, ...)
        padded = t.new_zeros(n_chunks * chunk_size, *t.shape[1:]).index_copy(0, dest, t)
        padded = padded.view(n_chunks, chunk_size, *t.shape[1:])
        return padded.permute(2, 0, 1, *range(3, padded.dim()))

    q, k, v, g, beta = (chunked(t) for t in (q, k, v, g, beta))
    decay = g.cumsum(-1)  # (H, N, C): log decay from the chunk start up to and including each token
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    pair_decay = (decay[..., :, None] - decay[..., None, :]).masked_fill(~causal, float("-inf")).exp()

    # Within a chunk the written values u solve (I + A) u = beta v - beta exp(decay) K S0 with
    # A[i, j] = beta_i exp(decay_i - decay_j) k_i.k_j (j < i); S0 is the state entering the chunk.
    k_beta = k * beta[..., None]
    system = (k_beta @ k.transpose(-1, -2) * pair_decay).tril(-1)  # unit diagonal implied
    u = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, k_beta * decay.exp()[..., None], upper=False, unitriangular=True)
    intra = (q @ k.transpose(-1, -2)) * pair_decay
    q_decayed = q * decay.exp()[..., None]
    k_to_end = k * (decay[..., -1:] - decay).exp()[..., None]
    chunk_decay = decay[..., -1].exp()[..., None, None]  # (H, N, 1, 1)

    state = q.new_zeros(n_heads, q.shape[-1], head_v_dim)
    out, states = [], []
    # Per-chunk views by unbind: its backward is one stack, where indexing chunk n would give
    # every chunk's gradient a full-size zero tensor of its own.
    per_chunk = zip(
        keep_state.unbind(0),
        u.unbind(1),
        w.unbind(1),
        q_decayed.unbind(1),
        intra.unbind(1),
        chunk_decay.unbind(1),
        k_to_end.transpose(-1, -2).unbind(1),
    )
    for keep, u_n, w_n, q_n, intra_n, decay_n, k_n in per_chunk:
        state = state * keep
        u_n = u_n - w_n @ state
        out.append(q_n @ state + intra_n @ u_n)
        state = state * decay_n + k_n @ u_n
        if final_state:
            states.append(state)
    out = torch.stack(out, dim=1).permute(1, 2, 0, 3).reshape(n_chunks * chunk_size, n_heads, head_v_dim)
    out = out[dest].to(out_dtype)
    if not final_state:
        return out
    # A segment's state is the one after its last chunk (the padding after its end changes nothing).
    return out, torch.stack(states)[first_chunk + seg_chunks - 1]


def recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    use_qk_l2norm: bool = True,
) -> torch.Tensor:
    """The gated delta rule one token at a time (the definition; slow). Same arguments as the chunked one."""
    out_dtype = v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta, use_qk_l2norm)
    starts = set(cu_seqlens.tolist())
    state = q.new_zeros(q.shape[1], q.shape[2], v.shape[2])
    out = []
    for t in range(q.shape[0]):
        if t in starts:
            state = torch.zeros_like(state)
        state = state * g[t].exp()[:, None, None]
        delta = beta[t][:, None] * (v[t] - torch.einsum("hk,hkv->hv", k[t], state))
        state = state + k[t][:, :, None] * delta[:, None, :]
        out.append(torch.einsum("hk,hkv->hv", q[t], state))
    return torch.stack(out).to(out_dtype)


def gated_delta_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    use_qk_l2norm: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of each of B sequences through the gated delta rule (decoding): q, k (B, H, Dk),
    v (B, H, Dv), g and beta (B, H), state (B, H, Dk, Dv) in fp32 -> (out (B, H, Dv) in v's dtype,
    the new state). The same update as `recurrent_gated_delta_rule`, batched over sequences."""
    out_dtype = v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta, use_qk_l2norm)
    state = state * g.exp()[..., None, None]
    delta = beta[..., None] * (v - torch.einsum("bhk,bhkv->bhv", k, state))
    state = state + k[..., :, None] * delta[..., None, :]
    return torch.einsum("bhk,bhkv->bhv", q, state).to(out_dtype), state


def conv_window(x: torch.Tensor, cu_seqlens: torch.Tensor, kernel: int) -> torch.Tensor:
    """Each segment's last kernel - 1 inputs of the causal convolution, (N_segments, kernel - 1, C),
    zeros before a segment's start (what `causal_depthwise_conv` sees there): a decoding step's
    convolution goes on from them."""
    cu = cu_seqlens.long()
    offsets = torch.arange(1 - kernel, 0, device=x.device)  # kernel - 1 tokens before each end
    index = cu[1:, None] + offsets  # (N, K - 1)
    inside = index >= cu[:-1, None]
    return x[index.clamp(min=0)] * inside[..., None]


def conv_step(x: torch.Tensor, window: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of each of B sequences through the causal convolution: x (B, C), window (B, K - 1, C)
    of the inputs before it, weight (C, 1, K) -> (SiLU of the convolution (B, C), the new window).
    Accumulated in the order and precision of `causal_depthwise_conv`."""
    kernel = weight.shape[-1]
    w = weight[:, 0].float()
    x = x.to(weight.dtype)
    taps = torch.cat([window.to(weight.dtype), x[:, None]], dim=1).float()  # (B, K, C): oldest first
    out = taps[:, kernel - 1] * w[:, kernel - 1]
    for shift in range(1, kernel):
        out = out + taps[:, kernel - 1 - shift] * w[:, kernel - 1 - shift]
    return F.silu(out.to(weight.dtype)), taps[:, 1:].to(window.dtype)


def adapt_fla_kernel(kernel: Callable[..., tuple[torch.Tensor, torch.Tensor]]) -> Callable[..., torch.Tensor]:
    """A call `(q, k, v, g, beta, cu_seqlens, use_qk_l2norm, cu_seqlens_cpu) -> out` on (T, H, D)
    tensors for fla's `chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None,
    output_final_state=False, use_qk_l2norm_in_kernel=False, ..., cu_seqlens=None,
    [cu_seqlens_cpu=None,] ...)` on (1, T, H, D) tensors, returning (out, final_state).
    `cu_seqlens_cpu` (fla >= 0.5) spares fla a host read of the segment bounds."""
    params = inspect.signature(kernel).parameters
    for name in ("g", "beta", "cu_seqlens", "use_qk_l2norm_in_kernel"):
        if name not in params:
            raise TypeError(
                f"{kernel.__module__}.{kernel.__name__}{inspect.signature(kernel)}: no argument {name!r}; "
                "not a known fla chunk_gated_delta_rule signature"
            )
    takes_host_bounds = "cu_seqlens_cpu" in params

    def call(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        cu_seqlens: torch.Tensor,
        use_qk_l2norm: bool,
        cu_seqlens_cpu: torch.Tensor | None = None,
        final_state: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        extra = {}
        if takes_host_bounds and cu_seqlens_cpu is not None:
            extra["cu_seqlens_cpu"] = cu_seqlens_cpu.long()
        if final_state:
            extra["output_final_state"] = True
        out, state = kernel(
            q[None],
            k[None],
            v[None],
            g=g[None].float(),
            beta=beta[None],
            cu_seqlens=cu_seqlens.long(),
            use_qk_l2norm_in_kernel=use_qk_l2norm,
            **extra,
        )
        return (out[0], state.float()) if final_state else out[0]

    return call


FLA = GpuKernel(adapt_fla_kernel, fla_chunk_gated_delta_rule)
set_gdn_kernel = FLA.set  # None: the torch chunked rule everywhere


def host_segments(cu_seqlens: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor | None:
    """The segment bounds on the host, read once per forward for fla (which would otherwise read
    them in every layer); None when fla does not run."""
    return None if cu_seqlens is None or not FLA.runs_on(x) else cu_seqlens.cpu()


# Run eagerly under torch.compile: fla's kernels are Triton already, and not traceable.
@torch.compiler.disable
def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    use_qk_l2norm: bool = True,
    cu_seqlens_cpu: torch.Tensor | None = None,
    final_state: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule with the fastest kernel available: fla on CUDA, else the torch chunked one.
    `final_state`: also each segment's last state (a generation's prefill)."""
    if FLA.runs_on(q):
        return FLA.call(q, k, v, g, beta, cu_seqlens, use_qk_l2norm, cu_seqlens_cpu, final_state)
    return chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens, use_qk_l2norm, final_state=final_state)
