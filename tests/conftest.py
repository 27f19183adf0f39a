"""Fixtures shared across test files."""

import pytest
import torch.distributed as dist


@pytest.fixture
def one_process_group():
    """A one-process gloo group, for code that needs torch.distributed initialised (FSDP2, DTensor,
    DCP) without launching processes."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()
