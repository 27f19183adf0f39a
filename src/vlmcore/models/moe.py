"""Sparse mixture-of-experts feed-forward block (Qwen3-MoE, Qwen3-VL-MoE, Qwen3.5-MoE).

    probs = softmax(gate(x))                       # (tokens, experts), fp32
    weights, experts = top_k(probs)                # renormalised over the k when norm_topk_prob
    y = sum_k weights_k * expert_k(x)              # expert = down(silu(gate(x)) * up(x))
    y += sigmoid(shared_gate(x)) * shared(x)       # Qwen3.5-MoE only

Dropless: every token reaches its k experts. Parameters carry transformers 5's in-memory names and
shapes (`gate.weight` (E, H), `experts.gate_up_proj` (E, 2I, H), `experts.down_proj` (E, H, I)),
whatever layout a snapshot stores them in (see models/hf.py).

The (token, expert) pairs are sorted by expert and run as one grouped GEMM per projection
(`torch._grouped_mm`) where the GPU has it: no Python loop over experts, no host sync. On CPU an
exact loop over the experts' contiguous groups does the same. The block hands its sorted rows
to its dispatcher: `LocalDispatch` runs the experts here; under expert parallelism an
`AllToAllDispatch` (parallel/expert_parallel.py) moves them to the ranks holding their experts
and back, and `GroupedExperts` then holds only the local experts. A dispatcher says whether it
reads the host (`reads_host`), which breaks a compiled graph: the block says so in turn
(`breaks_graph`, parallel/compile.py).

Load balancing: a `RoutingStats` collector receives each block's routing in its forward and
gives transformers' auxiliary loss over all the layers, which the train step adds to the loss.
"""

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.tensor import DTensor
from transformers import PretrainedConfig

from .gpu_kernels import GpuKernel, Kernel
from .layers import SwiGLU

# Rows per expert group are padded to this for the grouped GEMM: its backward contracts over the
# token dimension, which TMA needs 16-byte aligned (8 bf16 rows).
GROUP_ALIGN = 8


def _grouped_mm_adapter(kernel: Kernel) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """`torch._grouped_mm(mat_a (N, K), mat_b (E, K, M), offs=(E,) int32 ends)` -> (N, M)."""

    def call(x: torch.Tensor, weight_t: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return kernel(x, weight_t, offs=offsets)

    return call


grouped_mm = GpuKernel(_grouped_mm_adapter, getattr(torch, "_grouped_mm", None))


class GroupedExperts(nn.Module):
    """`num_experts` SwiGLU experts stored as two 3-D tensors (transformers' fused layout)."""

    def __init__(self, num_experts: int, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.hidden_dim = hidden_dim
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * hidden_dim, dim))
        self.down_proj = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x: (N, H) rows sorted by expert, `counts[e]` rows for local expert e."""
        gate_up, down = self.expert_weights()
        if grouped_mm.runs_on(x, half_precision_only=True):  # the kernel takes bf16 only
            return _grouped_forward(x, counts, gate_up, down)
        return _loop_forward(x, counts, gate_up, down)

    def expert_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The local experts' `gate_up_proj` (E, 2I, H) and `down_proj` (E, H, I) the forward multiplies
        by (models/lora.py adds its adapters' update here)."""
        return _local(self.gate_up_proj), _local(self.down_proj)

    def reset_own_parameters(self, std: float = 0.02) -> None:
        nn.init.normal_(self.gate_up_proj, std=std)
        nn.init.normal_(self.down_proj, std=std)


def _local(weight: torch.Tensor) -> torch.Tensor:
    """An expert-sharded DTensor's local experts (expert parallelism); a plain tensor as is.
    isinstance, not hasattr(weight, "to_local"): under torch.compile, hasattr on a DTensor
    parameter is False and the DTensor would go on into the expert matmuls."""
    return weight.to_local() if isinstance(weight, DTensor) else weight


def _swiglu(h: torch.Tensor) -> torch.Tensor:
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


# Eager inside a compiled block: traced, the loop's code specialises on each expert's row count
# (0 and 1 rows above all), so each new routing would compile the block again.
@torch.compiler.disable
def _loop_forward(x: torch.Tensor, counts: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """Exact reference: one matmul per expert over its contiguous rows (host reads the counts)."""
    out = []
    # unbind, not gate_up[e]: backward then stacks the experts' gradients once, where indexing
    # would build a zero gradient of all the experts for each one (experts^2 memory traffic).
    for rows, w1, w2 in zip(x.split(counts.tolist()), gate_up.unbind(0), down.unbind(0)):
        out.append(_swiglu(rows @ w1.t()) @ w2.t())
    return torch.cat(out) if out else x.new_zeros(0, down.shape[1])


def _grouped_forward(x: torch.Tensor, counts: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """Two grouped GEMMs. Each expert's rows go to a group padded to GROUP_ALIGN rows, in a buffer
    sized by a bound known without reading `counts` (no sync); padding rows are zero."""
    padded = (counts + GROUP_ALIGN - 1) // GROUP_ALIGN * GROUP_ALIGN
    ends = padded.cumsum(0)
    expert_of_row = torch.repeat_interleave(torch.arange(len(counts), device=x.device), counts, output_size=x.shape[0])
    # A row's slot is its place among the sorted rows, moved on by the padding of the groups before
    # its own: 2 kernels fewer than its group's start plus its place in the group.
    padding = padded - counts
    padding_before = padding.cumsum(0) - padding
    slot = torch.arange(x.shape[0], device=x.device) + padding_before[expert_of_row]
    capacity = x.shape[0] + len(counts) * (GROUP_ALIGN - 1)
    buffer = x.new_zeros(capacity, x.shape[1]).index_copy(0, slot, x)
    offsets = ends.to(torch.int32)
    h = _swiglu(grouped_mm.call(buffer, gate_up.transpose(-2, -1), offsets))
    y = grouped_mm.call(h, down.transpose(-2, -1), offsets)
    return y.index_select(0, slot)


class TopKRouter(nn.Module):
    """Linear gate over the experts; softmax in fp32, top-k, optional renormalisation."""

    def __init__(self, num_experts: int, dim: int, top_k: int, norm_topk_prob: bool) -> None:
        super().__init__()
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.weight = nn.Parameter(torch.zeros(num_experts, dim))

    def reset_own_parameters(self, std: float = 0.02) -> None:
        nn.init.normal_(self.weight, std=std)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (T, H) -> probabilities (T, E) fp32, top-k weights (T, k) in x's dtype, experts (T, k)."""
        probs = F.softmax(F.linear(x, self.weight), dim=-1, dtype=torch.float)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return probs, weights.to(x.dtype), experts


class LocalDispatch:
    """All experts on this rank: run them directly (rows sorted by expert, `counts` per expert)."""

    reads_host = False  # the GPU's grouped GEMM needs no host read (the CPU loop runs outside the graph)

    def __call__(self, x_sorted: torch.Tensor, counts: torch.Tensor, experts: GroupedExperts) -> torch.Tensor:
        return experts(x_sorted, counts)


class SparseMoeBlock(nn.Module):
    """Router + experts (+ Qwen3.5's gated shared expert), transformers' module names."""

    def __init__(
        self, dim: int, num_experts: int, top_k: int, hidden_dim: int, norm_topk_prob: bool, shared_hidden_dim: int = 0
    ) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.top_k = top_k
        self.gate = TopKRouter(num_experts, dim, top_k, norm_topk_prob)
        self.experts = GroupedExperts(num_experts, dim, hidden_dim)
        if shared_hidden_dim:
            self.shared_expert = SwiGLU(dim, shared_hidden_dim)
            self.shared_expert_gate = nn.Linear(dim, 1, bias=False)
        self.dispatch = LocalDispatch()  # an AllToAllDispatch under expert parallelism
        self.routing: RoutingStats | None = None  # where the forward's routing goes (the train step's)

    @property
    def breaks_graph(self) -> bool:
        return self.dispatch.reads_host

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        probs, weights, experts = self.gate(x)
        flat_experts = experts.reshape(-1)
        # scatter_add, not bincount: a fixed output shape, no host sync, fake-tensor friendly.
        counts = torch.zeros(self.num_experts, dtype=torch.long, device=x.device).scatter_add_(
            0, flat_experts, torch.ones_like(flat_experts)
        )
        if self.routing is not None:
            self.routing.record(self, counts.detach(), probs.sum(dim=0), x.shape[0])
        # (token, k) pairs sorted by expert: stable, so tokens keep their order within an expert.
        order = torch.argsort(flat_experts, stable=True)
        token = order // self.top_k
        y = self.dispatch(x[token], counts, self.experts)
        y = y * weights.reshape(-1)[order, None]
        out = torch.zeros_like(x).index_add(0, token, y.to(x.dtype))
        if hasattr(self, "shared_expert"):
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out.reshape(shape)


def moe_blocks(model: nn.Module) -> list[SparseMoeBlock]:
    """The model's MoE blocks, in layer order (found by type, through any wrappers)."""
    return [m for m in model.modules() if isinstance(m, SparseMoeBlock)]


class RoutingStats:
    """The routing of the blocks' last forward, for the load-balancing loss and the load metrics:
    per block, the tokens per expert (E,), the summed router probabilities (E,) and the tokens."""

    def __init__(self, blocks: list[SparseMoeBlock], row_group: ProcessGroup | None = None) -> None:
        """`row_group`: under context parallelism, the ranks that hold the other chunks of the rows."""
        self.blocks = blocks
        self.keeping = True
        self.row_group = row_group
        for block in blocks:
            block.routing = self
        self.clear()

    def record(self, block: SparseMoeBlock, counts: torch.Tensor, probs: torch.Tensor, tokens: int) -> None:
        # Kept on the block: an attribute set is a side effect torch.compile replays without
        # compiling each block again (an index per block would be a constant of each one's graph).
        if self.keeping:
            block.last_routing = (counts, probs, tokens)

    def loss(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """transformers' auxiliary loss over the blocks' last forward, and the per-block tokens per
        expert (blocks, E):

            aux = E * sum_e f_e * P_e,   f_e = routed pairs to e / (layers * tokens),
                                         P_e = summed probability of e / (layers * tokens)

        where both sums run over all MoE layers at once (not a mean of per-layer losses).

        Under context parallelism (`row_group`) the sums are the whole rows': f from the routed
        pairs of every chunk (summed over the group, no gradient flows through f), P from this
        rank's chunk only, so the group's losses add up to the rows' loss, gradient included."""
        routed = [b.last_routing for b in self.blocks if b.last_routing is not None]
        if not routed:
            return None
        counts = torch.stack([c for c, _, _ in routed])
        probs = torch.stack([p for _, p, _ in routed]).sum(dim=0)
        rows = sum(n for _, _, n in routed)
        routed_pairs = counts.sum(dim=0).float()
        if self.row_group is not None:
            torch.distributed.all_reduce(routed_pairs, group=self.row_group)
            rows *= torch.distributed.get_world_size(self.row_group)  # the chunks are equal
        aux = self.blocks[0].num_experts * (routed_pairs / rows * (probs / rows)).sum()
        return aux, counts

    def clear(self) -> None:
        """Drop the kept tensors (their graph) once the loss has used them."""
        for block in self.blocks:
            block.last_routing = None

    @contextmanager
    def not_kept(self) -> Iterator[None]:
        """The blocks' forwards inside the context keep nothing. The train step runs backward in it:
        activation checkpointing's recompute would otherwise keep the recomputed layer's whole graph
        until the next forward (0.67 GiB per layer of Qwen3-VL-30B-A3B at 8,192 tokens, all 48 at once)."""
        self.keeping = False
        try:
            yield
        finally:
            self.keeping = True


def is_sparse_layer(config: PretrainedConfig, layer_idx: int) -> bool:
    """transformers' rule: a layer of a text config with experts is sparse unless mlp_only_layers
    lists it or decoder_sparse_step skips it (layer i is sparse when (i + 1) % step == 0)."""
    if not getattr(config, "num_experts", 0):
        return False
    step = getattr(config, "decoder_sparse_step", 1) or 1
    dense_layers = getattr(config, "mlp_only_layers", None) or []
    return layer_idx not in dense_layers and (layer_idx + 1) % step == 0


def feed_forward(config: PretrainedConfig, layer_idx: int) -> nn.Module:
    """A decoder layer's MLP: sparse on the layers the config makes sparse (every layer of Qwen3.5-MoE
    and, by default, of Qwen3-(VL-)MoE), else the dense SwiGLU."""
    if not is_sparse_layer(config, layer_idx):
        return SwiGLU(config.hidden_size, config.intermediate_size)
    return SparseMoeBlock(
        config.hidden_size,
        config.num_experts,
        config.num_experts_per_tok,
        config.moe_intermediate_size,
        norm_topk_prob=getattr(config, "norm_topk_prob", True),
        shared_hidden_dim=getattr(config, "shared_expert_intermediate_size", 0) or 0,
    )
