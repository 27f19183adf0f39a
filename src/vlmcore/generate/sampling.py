"""Choosing the next token: greedy, or a draw from the temperature-scaled distribution, cut to its
top-k tokens and its top-p mass, each sample from a seeded stream of its own.

Each sample (a row) draws its tokens by inverse-transform sampling: one uniform number a token
from the row's own generator (`sample_uniforms`, seeded by the row's seed alone), the token where
it falls in the cumulative distribution. So a sample's tokens depend on its prompt, its seed and
the model only: not on the other prompts of the batch, their order or which rank generates them
(an RL stage's rollouts are the same at any world size). One batched draw from a shared generator
(torch.multinomial) would give a row the numbers of whatever rows came before it.

`next_tokens` returns each chosen token's log-probability under the distribution it was drawn
from: the one after the temperature, the blocked tokens and the top-k / top-p cut (renormalised);
for greedy decoding, the model's distribution at temperature 1. `policy_log_probs` gives the
chosen tokens' log-probability under the policy a training forward computes, log_softmax(logits /
temperature) over the whole vocabulary: what an RL objective's ratio compares against. The two
differ by the cut's renormalisation (with top_p < 1 or top_k > 0) and by the blocked tokens' mass.
"""

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch


class GenerationError(ValueError):
    """A request refused before any work: it names the prompt or the setting."""


@dataclass
class SamplingSettings:
    """How each token is chosen. temperature 0: greedy (top_p, top_k and seed unused)."""

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0  # keep the most likely tokens whose probabilities sum to at least top_p
    top_k: int = 0  # keep the k most likely tokens; 0: all
    n: int = 1  # samples per prompt, sharing the prompt's prefill
    seed: int = 0
    stop_token_ids: list[int] = field(default_factory=list)  # the model's eos tokens are added by `generate`
    stop_strings: list[str] = field(default_factory=list)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


SETTINGS = tuple(SamplingSettings.__dataclass_fields__)


def sampling_settings(**given: object) -> SamplingSettings:
    """SamplingSettings from keyword values, each checked by name (the refusal names the setting)."""
    unknown = sorted(set(given) - set(SETTINGS))
    if unknown:
        raise GenerationError(f"unknown sampling setting(s) {unknown}; known: {list(SETTINGS)}")
    settings = SamplingSettings(**given)
    check_settings(settings)
    return settings


def check_settings(s: SamplingSettings) -> None:
    checks = [
        ("max_new_tokens", isinstance(s.max_new_tokens, int) and s.max_new_tokens >= 1, "an int >= 1"),
        ("temperature", s.temperature >= 0, ">= 0 (0: greedy)"),
        ("top_p", 0 < s.top_p <= 1, "in (0, 1]"),
        ("top_k", isinstance(s.top_k, int) and s.top_k >= 0, "an int >= 0 (0: all tokens)"),
        ("n", isinstance(s.n, int) and s.n >= 1, "an int >= 1"),
        ("n", s.n == 1 or not s.greedy, "1 with greedy decoding (temperature 0): its samples would be equal"),
    ]
    for name, ok, what in checks:
        if not ok:
            raise GenerationError(f"sampling setting {name}={getattr(s, name)!r} must be {what}")


def sampling_log_probs(logits: torch.Tensor, settings: SamplingSettings, blocked: torch.Tensor | None) -> torch.Tensor:
    """(rows, V) logits -> the log-probabilities of the distribution the next token is drawn from (fp32)."""
    logits = logits.float()
    if blocked is not None:
        logits = logits.masked_fill(blocked, float("-inf"))
    if settings.greedy:
        return logits.log_softmax(-1)
    logits = logits / settings.temperature
    if settings.top_k and settings.top_k < logits.shape[-1]:
        kth = logits.topk(settings.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if settings.top_p < 1:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        mass_before = probs.cumsum(-1) - probs  # of the tokens more likely than each one
        drop_sorted = mass_before >= settings.top_p  # the most likely token is always kept
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)  # back to vocabulary order
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.log_softmax(-1)


def sample_seeds(seed: int, prompts: int, n: int) -> list[int]:
    """The default seed of each of `prompts` x `n` samples (prompt-major), from the run's `seed`, the
    prompt's index and the sample's: a call's samples are independent streams."""
    return [int(np.random.SeedSequence([seed, p, j]).generate_state(1)[0]) for p in range(prompts) for j in range(n)]


def sample_uniforms(seeds: Sequence[int], steps: int, device: torch.device) -> torch.Tensor:
    """(rows, steps) float32 numbers in [0, 1): row i's from a CPU generator seeded with seeds[i]
    alone, the number its token of each step is drawn with (one host-to-device copy a call)."""
    rows = [torch.rand(steps, generator=torch.Generator().manual_seed(int(s))) for s in seeds]
    return torch.stack(rows).to(device)


def next_tokens(
    logits: torch.Tensor,
    settings: SamplingSettings,
    uniforms: torch.Tensor | None,
    blocked: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, V) logits -> (tokens (rows,), their log-probabilities (rows,)). `uniforms` (rows,):
    each row's number in [0, 1) for this token (unused when greedy). `blocked` (V,) bool: tokens
    never chosen (the media placeholders)."""
    log_probs = sampling_log_probs(logits, settings, blocked)
    if settings.greedy:
        tokens = log_probs.argmax(-1)
    else:
        # The first token whose cumulative probability passes the row's number times the row's total
        # (1 up to rounding); a token of probability 0 adds nothing to the sum, so is never chosen.
        cumulative = log_probs.exp().cumsum(-1)
        target = uniforms[:, None] * cumulative[:, -1:]
        tokens = torch.searchsorted(cumulative, target, right=True)[:, 0].clamp(max=logits.shape[-1] - 1)
        # A number that rounds up to the total lands past the last possible token: its row's most likely.
        impossible = log_probs.gather(-1, tokens[:, None])[:, 0] == float("-inf")
        tokens = torch.where(impossible, log_probs.argmax(-1), tokens)
    return tokens, log_probs.gather(-1, tokens[:, None])[:, 0]


def policy_log_probs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """(rows, V) logits, the chosen (rows,) tokens -> their log-probabilities (rows,) under
    log_softmax(logits / temperature) of the whole vocabulary (temperature 0: 1), fp32: the policy's
    distribution as the training forward computes it (`chunked_token_logps(hidden / temperature, ...)`),
    with no top-k / top-p cut and no token blocked (the media placeholders keep their mass)."""
    scaled = logits.float() / (temperature if temperature > 0 else 1.0)
    return scaled.log_softmax(-1).gather(-1, tokens[:, None])[:, 0]
