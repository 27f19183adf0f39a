"""Per-block torch.compile: blocks repeat, so one compiled graph serves all of them."""

from torch import nn


def apply_compile(blocks: nn.Module) -> None:
    for block in blocks.children():
        block.compile(fullgraph=False)
