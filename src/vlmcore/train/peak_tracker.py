"""The memory estimate's trackers (vlmcore.train.memory): torch's FSDP2 memory tracker keeping the
device-wide peak only, and the same for a model without FSDP units (one rank). They reach into the
tracker's private hooks, so they live apart from the estimate, imported when it runs."""

import torch
from torch import nn
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker, _FSDPRefType, _FSDPState
from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker, _MemRefType, _RefType, _State
from torch.utils.weak import WeakIdKeyDictionary

from vlmcore.parallel.fsdp import one_rank_cast_of


class PeakTracker(FSDPMemTracker):
    """Keeps the device-wide peak only. The tracker also keeps every module's own peak, a pass
    over all modules after every op: about half the time of a Qwen3-VL-2B estimate. It also
    counts the weights of `frozen` models outside the tracked root (a DPO reference copy):
    its shards as sharded parameters, its buffers as buffers."""

    def __init__(self, mod: nn.Module, optm: torch.optim.Optimizer, frozen: list[nn.Module]) -> None:
        super().__init__(mod, optm)
        self.frozen = frozen
        # Depth of calls whose ops' outputs are not counted: DTensor's sharding propagation (shapes
        # only, no device memory), and tensors that are counted by kind as they are made (`zero_gradients`).
        self.in_sharding_propagation = 0
        self.host_kinds: tuple[str, ...] = ()  # kinds held in host memory (parallel.offload), not on the device
        self.host_peak = 0  # the most bytes of those kinds at any time

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """Lets compiled blocks compile under the tracker (dynamo skips frames under any other
        dispatch mode): it sees the ops of their graphs as they run, not dynamo's tracing."""
        return True

    def __torch_dispatch__(
        self, func: torch._ops.OpOverload, types: tuple, args: tuple = (), kwargs: dict | None = None
    ) -> object:
        if self.in_sharding_propagation:  # not counted here (see __init__)
            return func(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)

    def _register_module_and_optimizer_hooks(self) -> None:
        super()._register_module_and_optimizer_hooks()
        for model in self.frozen:
            for parameter in model.parameters():
                self._update_and_maybe_create_winfos(parameter, _FSDPRefType.SHARDED_PARAM)
            for buffer in model.buffers():
                self._update_and_maybe_create_winfos(buffer, _MemRefType.BUFFER)

    def __enter__(self) -> "PeakTracker":
        entered = super().__enter__()
        if self._depth == 1:
            # torch's tracker starts its peak from the snapshot on entry, host kinds included: with
            # offload that whole total (the weights' shards of Qwen3-VL-30B-A3B, 31 GB a rank) would
            # stay above every later device-only figure, and the entry's 0.1 GB of inputs would be
            # taken for the device's peak. The device's peak starts from the entry without them.
            for dev, snap in self._peak_mem_snap.items():
                host = self._host_bytes(snap)
                self.host_peak = max(self.host_peak, host)
                self._peak_mem[dev] = snap[_TOTAL_KEY] - host
        return entered

    def zero_gradients(self, parameters: list[nn.Parameter]) -> None:
        """A zero gradient for each of `parameters`, counted as a gradient ("Sharded Grad") from the
        start. Made by an op under the tracker, a gradient counts as an activation until backward
        labels it: at the estimate's first-step state (`_first_step_state`) every weight's gradient
        would count as one, outside what `parallel.offload` keeps in host memory."""
        for parameter in parameters:
            self.in_sharding_propagation += 1  # the op's output is not counted as it is made
            try:
                parameter.grad = torch.zeros_like(parameter)
            finally:
                self.in_sharding_propagation -= 1
            self._update_and_maybe_create_winfos(parameter.grad, _FSDPRefType.SHARDED_GRAD)

    def _host_bytes(self, snap: dict) -> int:
        """The bytes of `snap` in host memory: its kinds in `host_kinds`."""
        return sum(n for kind, n in snap.items() if getattr(kind, "value", kind) in self.host_kinds)

    def _update_peak_stats(self, peak_state: _State) -> None:
        """The peak of the device: the kinds in `host_kinds` (offloaded) left out, their own peak kept apart."""
        for dev, snap in self._curr_mem_snap.items():
            host = self._host_bytes(snap)
            self.host_peak = max(self.host_peak, host)
            if self._peak_mem.get(dev, 0) < snap[_TOTAL_KEY] - host:
                self._peak_mem[dev] = snap[_TOTAL_KEY] - host
                self._peak_mem_snap[dev] = dict(snap)


class PlainPeakTracker(PeakTracker):
    """The peak of a model without FSDP units: on one rank a plain module, or one whose weights
    `OneRankMixedPrecision` casts. FSDP2's tracker hooks FSDP units only, and torch's tracker
    of plain modules (MemTracker) fails on frozen weights (it hooks every weight's gradient).
    The kinds are FSDP2's, for the same table: the weights and their gradients are "sharded"
    (what the rank holds of them: all of them), the cast's compute copies and their
    gradients "unsharded", as FSDP2's unsharded weights in the compute dtype are."""

    def __init__(self, mod: nn.Module, optm: torch.optim.Optimizer, frozen: list[nn.Module]) -> None:
        # FSDPMemTracker's own state, without its check that the root is an FSDP unit.
        MemTracker.__init__(self)
        self._root_mod = mod
        self._optm = optm
        self._fsdp_mod_to_saved_methods = WeakIdKeyDictionary()
        self._fsdp_state = _FSDPState.PRE_FW
        self._ref_class = _FSDPRefType
        self.frozen = frozen
        self.in_sharding_propagation = 0
        self.host_kinds = ()
        self.host_peak = 0
        self.cast = one_rank_cast_of(mod)
        self.casting_grads = False  # in the cast's end of backward, whose new tensors are gradients
        self.handles = []
        self.hooked_copies: set[int] = set()

    def _track(self, reftype: _RefType, t: torch.Tensor) -> None:
        super()._track(_FSDPRefType.SHARDED_GRAD if self.casting_grads else reftype, t)

    def _register_module_and_optimizer_hooks(self) -> None:
        super()._register_module_and_optimizer_hooks()
        for weight in self._root_mod.parameters():
            self._update_and_maybe_create_winfos(weight, _FSDPRefType.SHARDED_PARAM)
            if weight.grad is not None:
                self._update_and_maybe_create_winfos(weight.grad, _FSDPRefType.SHARDED_GRAD)
            if weight.requires_grad:  # a plain module's: autograd accumulates into them
                self.handles.append(weight.register_post_accumulate_grad_hook(self._label_sharded_grad))
        if self.cast is None:
            return
        # After the cast's hook before the forward, which makes the compute copies at the first
        # (as activations: the peak is never there, the forward's activations come on top).
        self.handles.append(self._root_mod.register_forward_pre_hook(self._label_copies))
        # The cast's end of backward (queued by name at each forward) makes the weights' gradients.
        cast_grads = self.cast._after_backward

        def after_backward() -> None:
            self.casting_grads = True
            try:
                cast_grads()
            finally:
                self.casting_grads = False

        self.cast._after_backward = after_backward

    def _deregister_module_and_optimizer_hooks(self) -> None:
        super()._deregister_module_and_optimizer_hooks()
        for handle in self.handles:
            handle.remove()
        self.handles = []
        if self.cast is not None:
            del self.cast._after_backward  # the method again

    def _label_sharded_grad(self, weight: nn.Parameter) -> None:
        self._update_and_maybe_create_winfos(weight.grad, _FSDPRefType.SHARDED_GRAD)

    def _label_copies(self, module: nn.Module, args: tuple) -> None:
        for copy in self.cast.compute:
            self._update_and_maybe_create_winfos(copy, _FSDPRefType.UNSHARDED_PARAM)
            if copy.requires_grad and id(copy) not in self.hooked_copies:
                self.hooked_copies.add(id(copy))
                self.handles.append(copy.register_post_accumulate_grad_hook(self._label_unsharded_grad))

    def _label_unsharded_grad(self, copy: nn.Parameter) -> None:
        self._update_and_maybe_create_winfos(copy.grad, _FSDPRefType.UNSHARDED_GRAD)
