"""Token choice (vlmcore.generate.sampling): each row's draw from its own stream, by inverse-transform
sampling of the distribution whose log-probabilities it returns."""

import torch

from vlmcore.generate import SamplingSettings
from vlmcore.generate.sampling import next_tokens, sample_seeds, sample_uniforms, sampling_log_probs


def test_the_draws_follow_the_distribution_and_never_pick_a_cut_token():
    """20,000 rows of one distribution over 6 tokens, top-k 4 and top-p 0.9 cut, token 2 blocked:
    each token's share of the draws is its probability under the returned log-probabilities (within
    4 standard errors), and a cut or blocked token is never drawn, even for numbers next to 1."""
    logits = torch.tensor([2.0, 1.0, 3.0, 0.5, -1.0, 1.5]).repeat(20_000, 1)
    settings = SamplingSettings(temperature=0.7, top_k=4, top_p=0.9)
    blocked = torch.zeros(6, dtype=torch.bool)
    blocked[2] = True
    uniforms = sample_uniforms(sample_seeds(0, 20_000, 1), 1, torch.device("cpu"))[:, 0]
    uniforms[:3] = torch.tensor([0.0, 1 - 2**-24, 0.999999])  # the ends of [0, 1)
    tokens, log_probs = next_tokens(logits, settings, uniforms, blocked)
    probs = sampling_log_probs(logits[:1], settings, blocked)[0].exp()
    torch.testing.assert_close(log_probs, probs[tokens].log(), rtol=0, atol=1e-6)
    assert (probs > 0).sum() == 3, "the cut keeps three tokens"  # top-4 of five, then 0.9 of the mass
    shares = torch.bincount(tokens, minlength=6).double() / len(tokens)
    assert shares[probs == 0].sum() == 0, "a cut or blocked token drawn"
    for token in (probs > 0).nonzero()[:, 0].tolist():
        p = probs[token].item()
        assert abs(shares[token] - p) < 4 * (p * (1 - p) / len(tokens)) ** 0.5, (token, shares[token].item(), p)


def test_a_rows_draws_depend_on_its_seed_alone():
    """Row i's numbers from seeds[i] whatever the other rows' seeds, in any order."""
    seeds = sample_seeds(3, 4, 2)
    assert len(set(seeds)) == 8
    whole = sample_uniforms(seeds, 5, torch.device("cpu"))
    reversed_rows = sample_uniforms(seeds[::-1], 5, torch.device("cpu"))
    torch.testing.assert_close(reversed_rows, whole.flip(0), rtol=0, atol=0)
    torch.testing.assert_close(sample_uniforms(seeds[5:6], 5, torch.device("cpu"))[0], whole[5], rtol=0, atol=0)
