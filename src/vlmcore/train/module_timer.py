"""Forward + backward time of the vision tower and of the language model, apart, per step.

Marks are taken at five points of each micro-batch (CUDA events on a GPU, the wall clock on a CPU):

    A   the model's forward starts (a forward pre-hook on the whole model)
    Vs  the vision tower's forward starts, Ve it ends (hooks on `model.vision_tower()`)
    Vb  the last gradient reaches the vision tower's outputs: its backward starts (tensor hooks)
    E   the backward pass ends (an autograd engine callback, queued when the first gradient
        reaches the model's output)

    vision = (Ve - Vs) + (E - Vb)        llm = (E - A) - vision

summed over the step's micro-batches. The vision time is the tower with its mergers and their
FSDP all-gathers; the LLM time is the rest of forward and backward, not the optimizer step,
gradient norm or clipping. A micro-batch without images runs the tower on a dummy image
(step.VisionDummy), timed and counted like any other.

Nothing waits for the GPU: CUDA events are recorded on the current stream, and `read` is called
after the step's one host read (step.read_host), when every event of the step has completed.
Times are those of the rank that reads them (rank 0 in the metrics).
"""

import time

import torch
from torch import nn
from torch.autograd import Variable

from vlmcore.models.parts import ModelOutput

# A point in time: the host clock (seconds), or on a GPU an event recorded on the stream.
Mark = float | torch.cuda.Event


class ModuleTimer:
    def __init__(self, model: torch.nn.Module, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.vision = model.vision_tower()
        self.micro: list[dict] = []
        model.register_forward_pre_hook(self._model_start, prepend=True)
        model.register_forward_hook(self._model_end)
        if self.vision is not None:
            self.vision.register_forward_pre_hook(self._vision_start)
            self.vision.register_forward_hook(self._vision_end)

    def _mark(self) -> Mark:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _elapsed(self, start: Mark, end: Mark) -> float:
        if not self.cuda:
            return end - start
        return start.elapsed_time(end) / 1000.0  # both complete: the step's host read came after them

    def _model_start(self, module: nn.Module, args: tuple) -> None:
        self.micro.append({"start": self._mark()})

    def _vision_start(self, module: nn.Module, args: tuple) -> None:
        self.micro[-1]["vision_start"] = self._mark()
        self.micro[-1]["patches"] = args[0].shape[0]  # a shape: no GPU wait

    def _vision_end(self, module: nn.Module, args: tuple, output: object) -> None:
        marks = self.micro[-1]
        marks["vision_end"] = self._mark()

        def gradient_arrived(grad: torch.Tensor) -> None:  # the last of the outputs' gradients to arrive wins
            marks["vision_backward"] = self._mark()

        for t in torch.utils._pytree.tree_leaves(output):
            if torch.is_tensor(t) and t.requires_grad:
                t.register_hook(gradient_arrived)

    def _model_end(self, module: nn.Module, args: tuple, output: ModelOutput) -> None:
        marks = self.micro[-1]

        def backward_ended() -> None:
            marks["end"] = self._mark()

        out = output.hidden_states if output.hidden_states is not None else output.logits
        if out.requires_grad:  # the first gradient of the backward pass: queue its end
            out.register_hook(lambda grad: Variable._execution_engine.queue_callback(backward_ended))

    def read(self) -> dict:
        """{"vision_time_s", "llm_time_s", "vision_patches"} of the micro-batches since the last
        read (forward-only calls, which have no backward end, are left out); then starts over.
        `vision_patches`: the patches this rank's vision tower took (the cost model's input)."""
        vision = 0.0
        llm = 0.0
        patches = 0
        for m in self.micro:
            if "end" not in m:
                continue
            total = self._elapsed(m["start"], m["end"])
            v = 0.0
            if "vision_start" in m:
                v = self._elapsed(m["vision_start"], m["vision_end"])
                if "vision_backward" in m:
                    v += self._elapsed(m["vision_backward"], m["end"])
            vision += v
            llm += total - v
            patches += m.get("patches", 0)
        self.micro = []
        times = {"llm_time_s": llm}
        if self.vision is not None:
            times |= {"vision_time_s": vision, "vision_patches": patches}
        return times
