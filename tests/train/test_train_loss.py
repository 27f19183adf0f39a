import pytest
import torch
import torch.nn.functional as F

from vlmcore.train.loss import IGNORE_INDEX, chunked_cross_entropy


@pytest.mark.parametrize("chunk", [1, 5, 64])
def test_chunked_matches_full_cross_entropy(chunk):
    torch.manual_seed(0)
    hidden = torch.randn(2, 9, 16, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(40, 16, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 40, (2, 9))
    labels[0, :4] = IGNORE_INDEX
    labels[1, -1] = IGNORE_INDEX
    loss_sum, count = chunked_cross_entropy(hidden, weight, labels, chunk_tokens=chunk)
    loss_sum.backward()
    grads = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    ref = F.cross_entropy((hidden @ weight.t()).reshape(-1, 40), labels.reshape(-1), reduction="sum")
    ref.backward()
    assert count.item() == 13
    torch.testing.assert_close(loss_sum, ref)
    torch.testing.assert_close(grads[0], hidden.grad)
    torch.testing.assert_close(grads[1], weight.grad)


def test_bf16_inputs_give_fp32_loss_close_to_reference():
    torch.manual_seed(0)
    hidden = torch.randn(64, 32)
    weight = torch.randn(1000, 32) * 0.1
    labels = torch.randint(0, 1000, (64,))
    loss_sum, _ = chunked_cross_entropy(hidden.bfloat16(), weight.bfloat16(), labels, chunk_tokens=16)
    ref = F.cross_entropy(hidden.bfloat16().float() @ weight.bfloat16().float().t(), labels, reduction="sum")
    assert loss_sum.dtype == torch.float32
    torch.testing.assert_close(loss_sum, ref, rtol=2e-2, atol=0)


def test_global_normalisation_is_independent_of_the_split():
    """Sum of token losses / global label count: splitting a batch into uneven micro-batches
    gives the same loss and gradient as the whole batch."""
    torch.manual_seed(0)
    hidden = torch.randn(12, 8, requires_grad=True)
    weight = torch.randn(20, 8, requires_grad=True)
    labels = torch.randint(0, 20, (12,))
    labels[:7] = IGNORE_INDEX  # the first micro-batch has far fewer label tokens
    total, count = chunked_cross_entropy(hidden, weight, labels)
    (total / count).backward()
    whole = weight.grad.clone()
    weight.grad = None
    for part in (slice(0, 8), slice(8, 12)):
        part_sum, _ = chunked_cross_entropy(hidden[part], weight, labels[part])
        (part_sum / count).backward()
    torch.testing.assert_close(weight.grad, whole)


@pytest.mark.slow
def test_compiled_chunks_match_the_eager_loss():
    """parallel.compile runs each chunk's softmax and gradient as one compiled kernel."""
    torch.manual_seed(0)
    hidden = torch.randn(2, 19, 16, requires_grad=True)
    weight = torch.randn(40, 16, requires_grad=True)
    labels = torch.randint(0, 40, (2, 19))
    labels[0, :5] = IGNORE_INDEX
    results = []
    for compiled in (False, True):
        loss_sum, _ = chunked_cross_entropy(hidden, weight, labels, chunk_tokens=8, compiled=compiled)
        loss_sum.backward()
        results.append((loss_sum.detach(), hidden.grad.clone(), weight.grad.clone()))
        hidden.grad = weight.grad = None
    for eager, compiled in zip(*results):
        torch.testing.assert_close(compiled, eager)
