"""The one chunked path from hidden states to token log-probabilities (vlmcore.train.loss):
its per-token form against torch's log-softmax, values and gradients under any per-token upstream
gradient (what DPO's pair losses send back), and the two forms against each other."""

import pytest
import torch

from vlmcore.train.loss import IGNORE_INDEX, chunked_cross_entropy, chunked_token_logps


def inputs(tokens: int = 19, vocab: int = 40, width: int = 16):
    torch.manual_seed(0)
    hidden = torch.randn(tokens, width, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(vocab, width, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, vocab, (tokens,))
    labels[:5] = IGNORE_INDEX
    labels[-1] = IGNORE_INDEX
    return hidden, weight, labels


@pytest.mark.parametrize("chunk", [1, 6, 64])
def test_token_logps_and_their_gradients_equal_log_softmax(chunk):
    hidden, weight, labels = inputs()
    upstream = torch.randn(labels.shape, dtype=torch.float64)
    logps = chunked_token_logps(hidden, weight, labels, chunk_tokens=chunk)
    (logps * upstream).sum().backward()
    grads = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    full = torch.log_softmax(hidden @ weight.t(), dim=-1).gather(1, labels.clamp(min=0)[:, None])[:, 0]
    expected = full * (labels != IGNORE_INDEX)
    (expected * upstream).sum().backward()
    torch.testing.assert_close(logps, expected)
    assert (logps[labels == IGNORE_INDEX] == 0).all()
    torch.testing.assert_close(grads[0], hidden.grad)
    torch.testing.assert_close(grads[1], weight.grad)


def test_the_cross_entropy_sum_is_minus_the_summed_token_logps():
    """SFT's form (gradients made in the forward) and the per-token form (made in the backward)
    give one loss and one gradient for a loss that is a sum over tokens."""
    hidden, weight, labels = inputs()
    loss_sum, _ = chunked_cross_entropy(hidden, weight, labels, chunk_tokens=8)
    loss_sum.backward()
    grads = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    per_token = -chunked_token_logps(hidden, weight, labels, chunk_tokens=8).sum()
    per_token.backward()
    torch.testing.assert_close(per_token, loss_sum)
    torch.testing.assert_close(hidden.grad, grads[0])
    torch.testing.assert_close(weight.grad, grads[1])


def test_without_gradients_nothing_is_kept():
    """The reference's pass: no graph, the same values."""
    hidden, weight, labels = inputs()
    with torch.no_grad():
        logps = chunked_token_logps(hidden, weight, labels, chunk_tokens=4)
    assert logps.grad_fn is None
    torch.testing.assert_close(logps, chunked_token_logps(hidden, weight, labels, chunk_tokens=4).detach())
