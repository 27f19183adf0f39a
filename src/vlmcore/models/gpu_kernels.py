"""An optional GPU kernel the model code calls through an adapter of its signature (torch's or
flash-attn's varlen attention, fla's gated delta rule, torch._grouped_mm). The run's choice of
backends (vlmcore.kernels.check) reaches them through `vlmcore.models.use_backends`."""

import torch


class GpuKernel:
    """An optional GPU kernel, called through an adapter of its signature (`adapt(kernel)`).
    `set` swaps it (None: none) and returns the previous setting; `force` also uses it off the
    GPU and in fp32, which is how tests run the CUDA calling path on CPU."""

    def __init__(self, adapt, kernel=None):
        self.adapt = adapt
        self.kernel, self.call, self.force = None, None, False
        self.set(kernel)

    def set(self, kernel, force: bool = False):
        previous = (self.kernel, self.force)
        self.kernel, self.force = kernel, force
        self.call = self.adapt(kernel) if kernel is not None else None
        return previous

    def runs_on(self, x: torch.Tensor, half_precision_only: bool = False) -> bool:
        if self.call is None:
            return False
        half = x.dtype in (torch.bfloat16, torch.float16)
        return self.force or (x.is_cuda and (half or not half_precision_only))
