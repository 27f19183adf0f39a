"""Fixtures shared across test files, and the order of the files."""

import pytest
import torch.distributed as dist
from helpers import require_slurm

# The files that take longest (minutes each), longest first, start before all others, so that
# under pytest-xdist (tests/run_all.sh: two workers, whole files each, `--no-loadscope-reorder`,
# which keeps this order instead of xdist's default of the files with most tests first) neither
# worker is left running one of them alone at the end.
LONGEST_FIRST = (
    "test_pipeline_demo.py",  # the demo pipeline run, its reruns, then the DPO demo on it
    "test_parallel_exactness.py",
    "test_slurm_demo.py",  # the video demo through SLURM
    "test_parallel_moe.py",
    "test_parallel_cp.py",
    "test_recipe_models.py",
    "test_train_checkpoint.py",
    "test_train_lora.py",
    "test_train_elastic.py",
    "test_train_faults.py",
    "test_slurm_restart.py",  # a 2-node SLURM job with a restart, then the reference run
    "test_train_resilience.py",
    "test_slurm_fake.py",
    "test_benchmark_train_step.py",
    "test_benchmark_cp_step.py",
)


def pytest_collection_modifyitems(config, items):
    # A stable sort: every file's tests stay together and in their order.
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONGEST_FIRST)))


@pytest.fixture(scope="module")
def slurm():
    """A real SLURM with two usable nodes (tests/helpers.py), or the test is skipped (failed in CI)."""
    require_slurm()


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
