"""An optional GPU kernel the model code calls through an adapter of its signature (torch's or
flash-attn's varlen attention, fla's gated delta rule, torch._grouped_mm). The run's choice of
backends (vlmcore.kernels.check) reaches them through `vlmcore.models.use_backends`."""

from collections.abc import Callable
from typing import Any

import torch

# A kernel as imported, or the call an adapter makes of it: their signatures differ by library and version.
Kernel = Callable[..., Any]


class GpuKernel:
    """An optional GPU kernel, called through an adapter of its signature (`adapt(kernel)`).
    `set` swaps it (None: none) and returns the previous setting; `force` also uses it off the
    GPU and in fp32, which is how tests run the CUDA calling path on CPU."""

    def __init__(self, adapt: Callable[[Kernel], Kernel], kernel: Kernel | None = None) -> None:
        self.adapt = adapt
        self.kernel = None
        self.call = None
        self.force = False
        self.set(kernel)

    def set(self, kernel: Kernel | None, force: bool = False) -> tuple[Kernel | None, bool]:
        previous = (self.kernel, self.force)
        self.kernel = kernel
        self.force = force
        self.call = self.adapt(kernel) if kernel is not None else None
        return previous

    def runs_on(self, x: torch.Tensor, half_precision_only: bool = False) -> bool:
        if self.call is None:
            return False
        half = x.dtype in (torch.bfloat16, torch.float16)
        return self.force or (x.is_cuda and (half or not half_precision_only))
