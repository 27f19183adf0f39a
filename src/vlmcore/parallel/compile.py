"""Per-block torch.compile: blocks repeat, so one compiled graph serves all of them.

Under activation checkpointing dynamo traces a block as one checkpointed region; anything it
cannot put in that region makes it run the whole block eagerly, and as the blocks share their
checkpoint wrapper's code, dynamo then skips it for every block, those that would have compiled
(attention layers, the vision tower's blocks) included.

An MoE block's forward hands its routing to the load-balancing loss's collector, a side effect
that the train step turns off in the recompute anyway (`RoutingStats.not_kept`): dynamo is told
that the recompute need not replay side effects.

Two kinds of blocks hold a graph break no setting removes (`breaks_graph`, models/parts.py):
Gated DeltaNet layers (fla's Triton kernel runs eagerly between two graphs) and MoE blocks under
expert parallelism (the dispatch reads the all-to-all split sizes on the host). Under full
checkpointing they compile inside the checkpoint, in pieces around the break (the recompute
reruns the compiled pieces). Under selective checkpointing they run eagerly: its policy replays
saved outputs in the recompute by counting ops, which compiled pieces do not go through op by
op (tried: the recompute failed for EP blocks, and for Gated DeltaNet layers whenever a dispatch
mode, a memory tracker or a profiler, was active in backward). The other blocks compile as
checkpointed regions either way.
"""

import torch
from torch import nn

from vlmcore.models.moe import moe_blocks
from vlmcore.models.parts import breaks_graph

# The block's own argument, and the same under activation checkpointing, where the code compiled
# is the checkpoint wrapper's `forward(*args, **kwargs)`.
DYNAMIC_MAX_SEQLEN = ("L['max_seqlen']", "L['kwargs']['max_seqlen']")


def apply_compile(
    blocks: nn.Module, checkpointing: str = "none", backend: str = "inductor", whole_graphs_only: bool = False
) -> None:
    """Compiles each child of `blocks`, already wrapped by `apply_ac(blocks, checkpointing)`.
    `backend`: inductor for training; the memory estimate's fake run takes AOTAutograd's partition
    without inductor (`aot_eager_decomp_partition`: the same tensors kept for backward, no kernels),
    and with `whole_graphs_only` leaves the blocks with a graph break eager: what their break reads
    on the host, fake tensors do not hold."""
    if moe_blocks(blocks) and hasattr(torch._dynamo.config, "skip_fwd_side_effects_in_bwd_under_checkpoint"):
        torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True
    # The longest packed segment, a host integer for the attention kernels, changes with every
    # batch: symbolic from the first compile, not specialised to the first batch's value and
    # compiled again for the second.
    sources = getattr(torch.compiler.config, "dynamic_sources", None)  # None: a torch without it
    if sources is not None:
        missing = [source for source in DYNAMIC_MAX_SEQLEN if source not in sources.split(",")]
        torch.compiler.config.dynamic_sources = ",".join(filter(None, [sources, *missing]))
    for block in blocks.children():
        if whole_graphs_only and breaks_graph(block):
            continue
        if checkpointing == "none" or not breaks_graph(block):
            block.compile(fullgraph=False, backend=backend)
        elif checkpointing == "full":
            block._checkpoint_wrapped_module.compile(fullgraph=False, backend=backend)
