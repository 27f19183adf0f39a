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


@pytest.fixture
def one_thread():
    """Intra-op reductions on one thread, whatever OMP_NUM_THREADS says: for comparisons at the
    edge of float32 that the order of a parallel sum would move."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
