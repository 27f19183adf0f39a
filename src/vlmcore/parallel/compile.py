"""Per-block torch.compile: blocks repeat, so one compiled graph serves all of them.

Under activation checkpointing dynamo traces a block as one checkpointed region, and anything it
cannot put in that region makes it run the whole block eagerly: compile then does nothing for it.
An MoE block's forward keeps the routing for the load-balancing loss, a side effect that eager
checkpointing would replay in the recompute; the train step turns the keeping off there anyway
(`routing_not_kept`), so dynamo is told that the recompute need not replay side effects.

Still eager under checkpointing: MoE blocks under expert parallelism, whose dispatch reads the
all-to-all split sizes on the host (a graph break). `capture_scalar_outputs` would let dynamo keep
them in the graph: that compiles with selective checkpointing, but with full checkpointing
AOTAutograd fails on torch 2.13 (a DeviceMesh among the tensors the region saves), so it is left
off until a GPU measurement says the compiled region is worth a version-dependent setting.
"""

import torch
from torch import nn

from vlmcore.models.moe import moe_blocks


def apply_compile(blocks: nn.Module) -> None:
    if moe_blocks(blocks) and hasattr(torch._dynamo.config, "skip_fwd_side_effects_in_bwd_under_checkpoint"):
        torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True
    for block in blocks.children():
        block.compile(fullgraph=False)
