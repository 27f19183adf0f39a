"""Fixtures shared across test files, and the order of the files."""

import pytest
import torch.distributed as dist

# The files that take longest (minutes each: the demo pipeline) start first, so that under
# pytest-xdist (the README's command: two workers, whole files each) neither worker is left
# running one of them alone at the end. (The real-SLURM tests run apart, after the others.)
LONGEST_FIRST = ("test_pipeline_demo.py",)


def pytest_collection_modifyitems(config, items):
    # A stable sort: every file's tests stay together and in their order.
    items.sort(key=lambda item: item.path.name not in LONGEST_FIRST)


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
