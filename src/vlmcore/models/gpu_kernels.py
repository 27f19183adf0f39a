"""The optional GPU kernels the model code calls through an adapter of their signature (torch's or
flash-attn's varlen attention, fla's gated delta rule, torch._grouped_mm), and the one place the run's
choice of backends (vlmcore.kernels.check) is handed to them."""

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


def use_backends(backends: dict) -> None:
    """Makes the model code use the backends `vlmcore.kernels.check` chose for this run."""
    from .linear_attention import set_gdn_kernel

    if backends.get("linear_attention") == "torch":
        set_gdn_kernel(None)
