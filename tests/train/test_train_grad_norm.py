"""The gradient norm's host work (issue 43, item 3): vlmcore.train.step.total_norm is torch's
get_total_norm bit for bit, without its `.to` of every tensor's norm."""

import pytest
import torch
from torch.profiler import profile

from vlmcore.train.step import total_norm


def gradients() -> list[torch.Tensor]:
    """Gradients of several sizes and scales, in two dtypes (two multi-tensor groups)."""
    generator = torch.Generator().manual_seed(0)
    sizes = [(1,), (7,), (64, 3), (4096,), (300, 333), (5, 1, 9)]
    grads = [torch.randn(size, generator=generator) * 10.0**k for k, size in zip(range(-3, 3), sizes, strict=True)]
    return grads + [g.bfloat16() for g in grads[:3]]


@pytest.mark.parametrize("foreach", [None, True, False])
def test_total_norm_is_get_total_norm_bit_for_bit(foreach):
    grads = gradients()
    ours = total_norm(grads, foreach)
    torch_norm = torch.nn.utils.get_total_norm(grads, foreach=foreach)
    assert ours.dtype == torch_norm.dtype
    assert torch.equal(ours, torch_norm)


def test_total_norm_dispatches_nothing_per_gradient_beyond_the_norm():
    """One multi-tensor norm per dtype and the norm of the norms: no operator per gradient at the
    top level (get_total_norm dispatches one `aten::to` for each)."""
    grads = gradients()

    def top_level_ops(fn) -> list[str]:
        with profile() as prof:
            fn()
        events = [e for e in prof.events() if e.name.startswith("aten::")]
        inner = {child.id for e in events for child in e.cpu_children}
        return [e.name for e in events if e.id not in inner]

    ours = top_level_ops(lambda: total_norm(grads, None))
    theirs = top_level_ops(lambda: torch.nn.utils.get_total_norm(grads))
    assert ours.count("aten::_foreach_norm") == 2
    assert "aten::to" not in ours
    assert theirs.count("aten::to") == len(grads)
    assert len(ours) < 10 < len(grads) + 3 <= len(theirs)


def test_total_norm_of_nothing_is_zero_as_torch_says():
    assert torch.equal(total_norm([], None), torch.nn.utils.get_total_norm([]))
