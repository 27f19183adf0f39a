"""Token log-probabilities through the LM head in chunks of tokens: the one path every objective's
loss takes from the model's hidden states (SFT's cross-entropy, DPO's sequence log-probabilities).

The logits of a whole packed batch (tokens x vocabulary, fp32) would dominate memory for
Qwen vocabularies (152k-248k), so the head runs chunk by chunk and no chunk's logits outlive it.
With a vocabulary-parallel (tensor-parallel) LM head every rank works on its vocabulary slice and
the log-softmax's max and sum (and the label's logit) are all-reduced over the TP group, so the
full-vocabulary logits never exist on any rank. Two forms, one autograd function:

- `chunked_cross_entropy`: the *sum* of token losses (-log p(label)), for a loss that is a sum
  over tokens (SFT). Each chunk's gradients (hidden and LM-head weight) are computed right there
  in the forward pass, while its logits exist, instead of recomputing the logits in backward:
  backward only scales them by the incoming scalar gradient. That saves one of the four LM-head
  matmuls; the price is the fp32 weight gradient held from the loss to the backward, which the
  backward would allocate anyway. The training loop divides by the global number of label tokens.
- `chunked_token_logps`: each token's log p(label), for a loss that weighs tokens by what is known
  only once all of them are (DPO's sigmoid of a pair's summed log-ratios, an RL objective's
  clipped ratio). The forward keeps each token's log-sum-exp; the backward computes each chunk's
  logits again and turns them into their gradient with the same kernel as the cross-entropy's,
  weighted by the incoming per-token gradients.
"""

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.autograd.function import FunctionCtx
from torch.distributed.tensor import DTensor, Replicate, Shard

from vlmcore.data import IGNORE_INDEX


def _all_reduce(tensor: torch.Tensor, op: dist.ReduceOp, group: dist.ProcessGroup | None) -> torch.Tensor:
    if group is not None:
        dist.all_reduce(tensor, op=op, group=group)
    return tensor


def _chunk_loss_and_grad(
    logits: torch.Tensor, target: torch.Tensor, valid: torch.Tensor, vocab_local: int, group: dist.ProcessGroup | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum of the chunk's token losses and d(sum)/d logits (softmax - one-hot on label tokens), in
    the logits' dtype; statistics in fp32. `valid`: the label tokens (bool), or each token's weight
    (float: the loss and gradient of sum(weight x token loss), the per-token form's backward). `target` is the label minus this rank's first vocabulary
    row: outside [0, vocab_local) under a vocabulary-parallel head when another rank holds it.
    No host reads, so it runs on the GPU without a sync and compiles into two fused kernels.
    Eager, it works in the logits' own buffer (fp32 logits are consumed) with one exponential:
    every pass over a (tokens x vocabulary) tensor, and every new one, costs as much as a matmul."""
    acc = logits.to(torch.promote_types(logits.dtype, torch.float32))
    mine = (target >= 0) & (target < vocab_local)
    index = target.clamp(0, vocab_local - 1)[:, None]
    target_logit = acc.gather(1, index)[:, 0] * mine
    top = _all_reduce(acc.amax(dim=-1), dist.ReduceOp.MAX, group)
    probs = acc.sub_(top[:, None]).exp_()  # exp(logit - max), softmax times its sum
    sumexp = _all_reduce(probs.sum(dim=-1), dist.ReduceOp.SUM, group)
    lse = top + sumexp.log()
    target_logit = _all_reduce(target_logit, dist.ReduceOp.SUM, group)
    loss = ((lse - target_logit) * valid).sum()
    grad = probs.mul_((valid / sumexp)[:, None]).scatter_add_(1, index, -(mine * valid)[:, None].to(acc.dtype))
    return loss, grad.to(logits.dtype)


# The chunk's (loss, d loss / d logits) from (logits, target, valid, vocab_local, group).
ChunkLossAndGrad = Callable[..., tuple[torch.Tensor, torch.Tensor]]

_compiled_chunk_loss_and_grad = None


def _fused(group: dist.ProcessGroup | None) -> ChunkLossAndGrad:
    """The chunk computation compiled (one fused pass over the logits instead of half a dozen), for
    a whole-vocabulary head; eager under a vocabulary-parallel one, whose all-reduces sit in between."""
    global _compiled_chunk_loss_and_grad
    if group is not None:
        return _chunk_loss_and_grad
    if _compiled_chunk_loss_and_grad is None:
        _compiled_chunk_loss_and_grad = torch.compile(_chunk_loss_and_grad, dynamic=True)
    return _compiled_chunk_loss_and_grad


def _chunk_label_logps(
    logits: torch.Tensor, target: torch.Tensor, valid: torch.Tensor, vocab_local: int, group: dist.ProcessGroup | None
) -> torch.Tensor:
    """Each token's log-probability of its label, label logit - log-sum-exp (fp32 at least), 0 where
    no label; the statistics over the vocabulary slices as `_chunk_loss_and_grad` combines them."""
    acc = logits.to(torch.promote_types(logits.dtype, torch.float32))
    mine = (target >= 0) & (target < vocab_local)
    target_logit = acc.gather(1, target.clamp(0, vocab_local - 1)[:, None])[:, 0] * mine
    top = _all_reduce(acc.amax(dim=-1), dist.ReduceOp.MAX, group)
    sumexp = _all_reduce(acc.sub_(top[:, None]).exp_().sum(dim=-1), dist.ReduceOp.SUM, group)
    target_logit = _all_reduce(target_logit, dist.ReduceOp.SUM, group)
    return (target_logit - top - sumexp.log()) * valid


class _ChunkedLabelLogps(torch.autograd.Function):
    """The LM head and its log-softmax at the labels, chunk by chunk (module docstring). `per_token`
    False: the sum of token losses, gradients made in the forward; True: each token's log-probability,
    gradients made in the backward from the logits computed again."""

    @staticmethod
    def forward(
        ctx: FunctionCtx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        chunk_tokens: int,
        group: dist.ProcessGroup | None,
        vocab_start: int,
        compiled: bool,
        per_token: bool,
    ) -> torch.Tensor:
        ctx.group = group
        ctx.weight_dtype = weight.dtype
        ctx.per_token = per_token
        if per_token:
            ctx.save_for_backward(hidden, weight, labels)
            ctx.chunking = (chunk_tokens, vocab_start, compiled)
            logps = torch.empty(
                hidden.shape[0], dtype=torch.promote_types(weight.dtype, torch.float32), device=hidden.device
            )
            for start in range(0, hidden.shape[0], chunk_tokens):
                end = min(start + chunk_tokens, hidden.shape[0])
                labels_chunk = labels[start:end]
                logps[start:end] = _chunk_label_logps(
                    hidden[start:end] @ weight.t(),
                    labels_chunk - vocab_start,
                    labels_chunk != IGNORE_INDEX,
                    weight.shape[0],
                    group,
                )
            return logps
        ctx.grads = _head_gradients(
            hidden, weight, labels, None, chunk_tokens, group, vocab_start, compiled, ctx.needs_input_grad[:2]
        )
        return ctx.grads[2]

    @staticmethod
    def backward(ctx: FunctionCtx, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        if ctx.per_token:
            hidden, weight, labels = ctx.saved_tensors
            chunk_tokens, vocab_start, compiled = ctx.chunking
            # d log p / d logits = -(d token loss / d logits): the cross-entropy's gradient, weighted by -grad.
            grad_hidden, grad_weight, _ = _head_gradients(
                hidden,
                weight,
                labels,
                -grad_output,
                chunk_tokens,
                ctx.group,
                vocab_start,
                compiled,
                ctx.needs_input_grad[:2],
            )
        else:
            grad_hidden, grad_weight, _ = ctx.grads
            ctx.grads = None
            if grad_hidden is not None:
                grad_hidden.mul_(grad_output.to(grad_hidden.dtype))
            if grad_weight is not None:
                grad_weight.mul_(grad_output)
        if grad_hidden is not None:
            grad_hidden = _all_reduce(grad_hidden, dist.ReduceOp.SUM, ctx.group)
        if grad_weight is not None:
            grad_weight = grad_weight.to(ctx.weight_dtype)
        return grad_hidden, grad_weight, None, None, None, None, None, None


def _head_gradients(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    token_weights: torch.Tensor | None,
    chunk_tokens: int,
    group: dist.ProcessGroup | None,
    vocab_start: int,
    compiled: bool,
    needs_grad: tuple[bool, bool],
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    """(d/d hidden, d/d weight, the value) of sum(token_weights x token losses) over the label
    tokens, chunk by chunk; `token_weights` None: 1 on every label token (the cross-entropy sum).
    The hidden gradient is this rank's part under a vocabulary-parallel head (summed by the caller)."""
    need_hidden_grad, need_weight_grad = needs_grad
    chunk_fn = _fused(group) if compiled else _chunk_loss_and_grad
    acc = torch.promote_types(weight.dtype, torch.float32)  # loss and weight gradient in fp32 at least
    total = torch.zeros((), dtype=acc, device=hidden.device)
    grad_hidden = torch.empty_like(hidden) if need_hidden_grad else None
    grad_weight = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_weight_grad else None
    for start in range(0, hidden.shape[0], chunk_tokens):
        end = min(start + chunk_tokens, hidden.shape[0])
        h, labels_chunk = hidden[start:end], labels[start:end]
        valid = labels_chunk != IGNORE_INDEX
        if token_weights is not None:
            valid = token_weights[start:end] * valid
        loss, grad_logits = chunk_fn(h @ weight.t(), labels_chunk - vocab_start, valid, weight.shape[0], group)
        total += loss
        # Matmuls in the compute dtype (bf16 on GPU, accumulating in fp32 inside the GEMM).
        grad_logits = grad_logits.to(hidden.dtype)
        if grad_hidden is not None:
            grad_hidden[start:end] = grad_logits @ weight
        if grad_weight is not None:
            grad_weight += grad_logits.t() @ h
    return grad_hidden, grad_weight, total


def _local_head(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dist.ProcessGroup | None, int]:
    """(hidden (tokens, H), this rank's head weight, labels (tokens,), the vocabulary-parallel group
    or None, this rank's first vocabulary row). `weight` may be a DTensor sharded on the vocabulary
    (tensor parallel): then `hidden` must be replicated over the same mesh (a plain tensor or a
    DTensor, which is made Replicate)."""
    group = None  # the vocabulary-parallel head's ranks
    vocab_start = 0
    if isinstance(weight, DTensor):
        if weight.placements != (Shard(0),) and weight.placements != (Replicate(),):
            raise ValueError(f"lm_head weight: unsupported placements {weight.placements}")
        if weight.placements == (Shard(0),):
            rows = weight.shape[0]
            mesh = weight.device_mesh
            group = mesh.get_group()
            # The first vocabulary row this rank holds (Shard(0) splits as torch.chunk does).
            vocab_start = min(rows, -(-rows // mesh.size()) * mesh.get_local_rank())
        weight = weight.to_local()
    if isinstance(hidden, DTensor):
        hidden = hidden.redistribute(placements=[Replicate()] * hidden.device_mesh.ndim).to_local()
    hidden = hidden.reshape(-1, hidden.shape[-1])
    labels = labels.reshape(-1).to(hidden.device)
    return hidden, weight, labels, group, vocab_start


def chunked_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_tokens: int = 1024, compiled: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of token losses in fp32, number of label tokens) for `hidden` (..., H) through the
    LM head `weight` (V, H); labels (...) are already shifted, IGNORE_INDEX where no loss.

    `weight` may be a DTensor sharded on the vocabulary (tensor parallel): then `hidden` must be
    replicated over the same mesh (a plain tensor or a DTensor, which is made Replicate).
    `compiled` runs each chunk's softmax and gradient as one compiled kernel (whole-vocabulary heads).
    """
    hidden, weight, labels, group, vocab_start = _local_head(hidden, weight, labels)
    loss_sum = _ChunkedLabelLogps.apply(hidden, weight, labels, chunk_tokens, group, vocab_start, compiled, False)
    return loss_sum, (labels != IGNORE_INDEX).sum()


def chunked_token_logps(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_tokens: int = 1024, compiled: bool = False
) -> torch.Tensor:
    """(tokens,) log-probability of each token's label (fp32 at least), 0 where no label, for
    `hidden` (..., H) through the LM head `weight` (V, H), flattened; as `chunked_cross_entropy`
    takes them (a vocabulary-sharded head included). Differentiable: the backward computes each
    chunk's logits again, so no (tokens x vocabulary) tensor lives from the forward to the backward."""
    hidden, weight, labels, group, vocab_start = _local_head(hidden, weight, labels)
    return _ChunkedLabelLogps.apply(hidden, weight, labels, chunk_tokens, group, vocab_start, compiled, True)
