"""FSDP2 (fully_shard) wrapping: one unit per decoder block, the vision tower as one unit, the
rest (embeddings, final norm, LM head) in the root unit. On a 2-D mesh the same call gives HSDP,
and with a shard size of 1 it is plain data parallelism (DDP). Under expert parallelism each
block's experts (already sharded over `ep`) are a unit of their own over the data-parallel ranks
orthogonal to EP.

Over a single rank there is nothing to shard, and FSDP2 would cast and copy every weight on its
own, twice per unit and step (1,843 copies a step for Qwen3-VL 2B, benchmarks/host_work.py). There
the model stays a plain module, as torchtitan leaves it without FSDP: with no dtype to cast to
(fp32 training, as on CPU) it trains as it is; with a compute dtype (bf16 on a GPU) its weights
are cast by `OneRankMixedPrecision`, in one multi-tensor copy a forward, and its gradients back in
a few a backward, with FSDP2's arithmetic (`parallel.one_rank_cast: false`: FSDP2's units, which
hold one block's compute copy at a time instead of all of them from forward to backward)."""

import dataclasses
import weakref

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.profiler import record_function
from torch.utils._pytree import tree_leaves, tree_map

from vlmcore.config import PrecisionConfig
from vlmcore.models.moe import moe_blocks


def apply_fsdp(
    model: nn.Module,
    blocks: list[nn.Module],
    vision: nn.Module | None,
    mesh: DeviceMesh,
    vision_mesh: DeviceMesh,
    precision: PrecisionConfig,
    expert_mesh: DeviceMesh | None = None,
    one_rank_cast: bool = True,
    offload: bool = False,
) -> None:
    """`vision_mesh`: the vision tower's own data-parallel mesh (vlmcore.parallel.bridge);
    `expert_mesh`: the experts' under expert parallelism; `one_rank_cast` (`parallel.one_rank_cast`):
    on one rank with a cast, `OneRankMixedPrecision` instead of FSDP2 units; `offload`
    (`parallel.offload`): every unit's shards, gradients and so the optimizer state in host memory,
    FSDP2 units on one rank too (the run materializes the model on the CPU: `Run.materialize`)."""
    param_dtype = getattr(torch, precision.param_dtype)
    reduce_dtype = getattr(torch, precision.reduce_dtype)
    weight_dtypes = {p.dtype for p in model.parameters()}
    if dist.get_world_size() == 1 and not offload:
        if weight_dtypes == {param_dtype} and param_dtype == reduce_dtype:
            return
        # FSDP2 reduces the gradients in reduce_dtype and gives them back in the weights' dtype:
        # one cast when the two are one dtype (fp32 weights, reduced in fp32). Float8 weights
        # keep FSDP2 (its float8 all-gather works on them).
        if one_rank_cast and weight_dtypes == {reduce_dtype} and precision.fp8.recipe == "none":
            units = [model, *blocks]
            if vision is not None:
                units.append(vision)
            OneRankMixedPrecision(model, units, param_dtype)
            return
    mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    # Pinned host memory where there is a GPU to copy to and from without a staging copy.
    policy = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if offload else OffloadPolicy()
    for block in blocks:
        if expert_mesh is not None:
            for moe in moe_blocks(block):
                fully_shard(moe.experts, mesh=expert_mesh, mp_policy=mp_policy, offload_policy=policy)
        fully_shard(block, mesh=mesh, mp_policy=mp_policy, offload_policy=policy)
    if vision is not None:
        # Kept unsharded from forward to backward: no all-gather during backward, whose position
        # would differ between ranks with and without images (DeepStack feeds several layers);
        # the reduce-scatter then runs at the end of backward, in the same order on every rank.
        fully_shard(vision, mesh=vision_mesh, mp_policy=mp_policy, reshard_after_forward=False, offload_policy=policy)
    # The root keeps embed_tokens and lm_head together (they may be tied) and, being the root,
    # stays unsharded from forward to backward, so the loss can use lm_head.weight directly.
    fully_shard(model, mesh=mesh, mp_policy=mp_policy, offload_policy=policy)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            # The loss is already divided by the global number of label tokens: reduce by SUM.
            # (The vision tower's repeated images are counted once by vlmcore.parallel.bridge.)
            module.set_gradient_divide_factor(1.0)
            # Plain SUM collectives (no PREMUL_SUM: gloo lacks it).
            module.set_force_sum_reduction_for_comms(True)


class OneRankMixedPrecision:
    """FSDP2's mixed precision on one rank, without FSDP2's work per weight: the forward and
    backward run on compute copies of the weights in `param_dtype` (2 bytes a weight in bf16),
    cast from the weights in one multi-tensor copy before each forward and freed after the
    backward; after each backward the compute copies' gradients are cast to the weights' dtype in
    `GRAD_CAST_CHUNKS` multi-tensor copies (and, over several micro-batches, added to those
    already there in the weights' dtype). The arithmetic is FSDP2's: the same casts of weights,
    inputs and gradients, gradients accumulated in the weights' dtype (here `reduce_dtype`, which
    FSDP2 reduces in), so the same losses and gradients bit for bit (tests/parallel/test_parallel_fsdp_one_rank.py).
    Between forward and backward the modules hold the compute copies; otherwise the weights
    themselves, so the optimizer, the checkpoint and `model.parameters()` see the weights."""

    def __init__(self, model: nn.Module, units: list[nn.Module], param_dtype: torch.dtype) -> None:
        """`units`: the modules whose floating-point inputs are cast to `param_dtype`, as FSDP2 casts
        the inputs of each of its units (the root, the vision tower, each decoder block)."""
        self.param_dtype = param_dtype
        # Found at the first forward, once the weights are on their device and loaded.
        self.weights: list[nn.Parameter] = []
        self.places: list[list[tuple[nn.Module, str]]] = []  # where each weight is held (tied: twice)
        self.compute: list[nn.Parameter] = []
        self.computing = False  # the modules hold the compute copies
        self.backward_due = False  # a forward's output awaits its backward, which needs them held
        for unit in units:
            unit.register_forward_pre_hook(self._cast_inputs, prepend=True, with_kwargs=True)
        model.register_forward_pre_hook(self._before_forward, prepend=True)
        model.register_forward_hook(self._after_forward)
        _ONE_RANK_CASTS[model] = self

    def _cast_inputs(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        def cast(x: object) -> object:
            if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != self.param_dtype:
                return x.to(self.param_dtype)
            return x

        return tree_map(cast, args), tree_map(cast, kwargs)

    def _before_forward(self, module: nn.Module, args: tuple) -> None:
        if self.computing:  # a second forward before the backward of the first: the same weights
            return
        if not self.compute:
            self._find_weights(module)
            # Normal tensors even if the first forward is an inference-mode one: training's
            # forwards copy into them.
            with torch.inference_mode(False):
                self.compute = [
                    nn.Parameter(torch.empty_like(w, dtype=self.param_dtype), requires_grad=w.requires_grad)
                    for w in self.weights
                ]
        with torch.no_grad(), record_function("OneRankMixedPrecision::cast_weights"):
            for copy in self.compute:
                storage = copy.untyped_storage()
                if storage.nbytes() == 0:  # freed since the last forward (`_free_copies`)
                    storage.resize_(copy.numel() * copy.element_size())
            torch._foreach_copy_(self.compute, self.weights)
        self._hold(self.compute)

    def _free_copies(self) -> None:
        """Frees the compute copies' memory until the next forward, as FSDP2 frees its unsharded
        weights: the optimizer step, evaluation and checkpointing between steps run without them.
        Their storage is resized to nothing, the tensors kept, so compiled blocks see the same
        parameters at every step."""
        for copy in self.compute:
            copy.untyped_storage().resize_(0)

    def _find_weights(self, model: nn.Module) -> None:
        self.weights = []
        self.places = []
        index = {}
        for module in model.modules():
            for name, weight in module._parameters.items():
                if weight is None:
                    continue
                if id(weight) not in index:
                    index[id(weight)] = len(self.weights)
                    self.weights.append(weight)
                    self.places.append([])
                self.places[index[id(weight)]].append((module, name))

    def _after_forward(self, module: nn.Module, args: tuple, output: object) -> None:
        needs_grad = [t for t in output_tensors(output) if t.requires_grad]
        if not needs_grad:  # no backward to come (no_grad, a frozen model): the weights back now
            if not self.backward_due:
                self._hold(self.weights)
                self._free_copies()
            return
        self.backward_due = True
        # At the end of the backward that reaches this output (the autograd engine's callback, as
        # FSDP2's and the module timer's).
        needs_grad[0].register_hook(lambda grad: Variable._execution_engine.queue_callback(self._after_backward))

    def _after_backward(self) -> None:
        with torch.no_grad(), record_function("OneRankMixedPrecision::cast_grads"):
            trained = [(w, c) for w, c in zip(self.weights, self.compute, strict=True) if c.grad is not None]
            # In a few chunks, each chunk's compute gradients freed once cast: the gradients in both
            # dtypes (6 bytes a weight from bf16 to fp32) are never all held at once, nor, after a
            # second micro-batch, a second copy of them all in the weights' dtype.
            for chunk in split_by_size(trained, [w.numel() for w, _ in trained], GRAD_CAST_CHUNKS):
                weights = [w for w, _ in chunk]
                grads = [c.grad for _, c in chunk]
                for _, compute in chunk:
                    compute.grad = None
                cast = [torch.empty_like(w) for w in weights]
                torch._foreach_copy_(cast, grads)
                del grads  # the chunk's compute gradients are freed here
                add_grads(weights, cast)
        self.backward_due = False
        self._hold(self.weights)
        self._free_copies()

    def _hold(self, tensors: list[nn.Parameter]) -> None:
        """Puts `tensors` (the weights or their compute copies) where the weights are held."""
        for tensor, places in zip(tensors, self.places, strict=True):
            for module, name in places:
                module._parameters[name] = tensor
        self.computing = tensors is self.compute


# The gradients' cast after backward, in this many chunks of about equal size: two multi-tensor
# calls each (the cast, and over several micro-batches the sum), against two per weight in FSDP2,
# for at most an eighth of the gradients held twice at a time.
GRAD_CAST_CHUNKS = 8


def split_by_size(items: list, sizes: list[int], parts: int) -> list[list]:
    """`items` in order, in at most `parts` runs of about equal total size: each item goes to the
    part where its first element falls when the total is cut into `parts` equal shares."""
    total = sum(sizes)
    runs: dict[int, list] = {}
    before = 0
    for item, size in zip(items, sizes, strict=True):
        runs.setdefault(before * parts // max(total, 1), []).append(item)
        before += size
    return list(runs.values())


# The model's cast, for the memory estimate's tracker (vlmcore.train.memory), which labels the
# compute copies and the gradients it makes.
_ONE_RANK_CASTS: "weakref.WeakKeyDictionary[nn.Module, OneRankMixedPrecision]" = weakref.WeakKeyDictionary()


def one_rank_cast_of(model: nn.Module) -> OneRankMixedPrecision | None:
    """The `OneRankMixedPrecision` that casts `model`'s weights, if one does."""
    return _ONE_RANK_CASTS.get(model)


def add_grads(weights: list[nn.Parameter], grads: list[torch.Tensor]) -> None:
    """Gives each weight its gradient, or adds it to the one it holds (the micro-batches before)
    in one multi-tensor add."""
    held = [w for w in weights if w.grad is not None]
    added = [g for w, g in zip(weights, grads, strict=True) if w.grad is not None]
    for weight, grad in zip(weights, grads, strict=True):
        if weight.grad is None:
            weight.grad = grad
    if held:
        torch._foreach_add_([w.grad for w in held], added)


def output_tensors(output: object) -> list[torch.Tensor]:
    """The tensors of a module's output: in tuples, lists, dicts and dataclasses (the models'
    ModelOutput)."""
    if dataclasses.is_dataclass(output) and not isinstance(output, type):
        output = [getattr(output, f.name) for f in dataclasses.fields(output)]
    return [t for t in tree_leaves(output) if isinstance(t, torch.Tensor)]
