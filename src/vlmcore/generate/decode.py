"""Generation on vlmcore's own models: a prefill of the prompts, then one cached step per token.

The prefill is the training forward itself: the prompts packed back to back in one row with
`cu_seqlens` (the training batches' layout), their images and videos through the vision tower
once, the positions from `vlmcore.models.position_ids` (M-RoPE restarting at every prompt). So
the prompts' tokens, media placement and positions are those of training by construction, and no
padding is computed. Packing rather than left padding: padding would need a padding mask in
every attention and Gated DeltaNet layer and positions that skip the padding, a second code path
beside training's; packed, the prompts are exactly what a training row holds.

Each prompt's caches go to its own row (n rows for n samples, sharing the one prefill); a
decoding step feeds every unfinished row its last token at the next position: one past the
largest position of its prompt for M-RoPE models (transformers' rope deltas: a generated token's
three axes are equal), its length for text models. Rows that stop leave the batch.
"""

import os
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from vlmcore.families import family
from vlmcore.models import position_ids as model_position_ids

from .cache import GenerationCache, cache_bytes, layer_types
from .parallel import any_going, lockstep_group
from .sampling import (
    GenerationError,
    SamplingSettings,
    check_settings,
    next_tokens,
    policy_log_probs,
    sample_seeds,
    sample_uniforms,
)


@dataclass
class Prompt:
    """One prompt: token ids with the media tokens laid out as the model's processor lays them out,
    and transformers' media tensors (normalised pixel patches and grids), or None."""

    input_ids: torch.Tensor  # (S,) int64
    pixel_values: torch.Tensor | None = None
    image_grid_thw: torch.Tensor | None = None
    pixel_values_videos: torch.Tensor | None = None
    video_grid_thw: torch.Tensor | None = None


@dataclass
class Generation:
    """One sample: the generated token ids (a stop token included), each token's log-probability
    under the distribution it was drawn from, and why it ended. `text`: the decoded tokens without
    special tokens, cut before a stop string (None without a tokenizer). `policy_log_probs`: each
    token's log-probability under log_softmax(logits / temperature) of the whole vocabulary, as
    the training forward computes it (sampling.policy_log_probs): equal to `log_probs` only
    without a top-k / top-p cut and with no blocked token."""

    prompt_index: int
    tokens: list[int]
    log_probs: list[float]
    finish_reason: str  # "stop_token", "stop_string" or "length"
    text: str | None = None
    policy_log_probs: list[float] = field(default_factory=list)


def generate(
    model: nn.Module,
    prompts: list[Prompt],
    settings: SamplingSettings,
    tokenizer: object | None = None,
    memory_limit: int | None = None,
    seeds: Sequence[int] | None = None,
) -> list[Generation]:
    """Generations of `prompts` (settings.n per prompt, prompt-major: prompt i's samples are
    i*n .. i*n + n - 1). `tokenizer` (transformers'): for stop strings and `text`.
    `memory_limit`: bytes the cache may take (default: the device's free memory). `seeds`: one
    per sample, each sample's tokens drawn from its own stream (sampling.py), so the same prompt
    and seed give the same sample in any batch; default: `sample_seeds(settings.seed, ...)`."""
    check_request(model.config, prompts, settings, tokenizer)
    if seeds is None:
        seeds = sample_seeds(settings.seed, len(prompts), settings.n)
    if len(seeds) != len(prompts) * settings.n:
        raise GenerationError(f"{len(seeds)} seeds for {len(prompts)} prompts x n={settings.n} samples: one each")
    check_cache_fits(model, prompts, settings, memory_limit)
    cache, logits, next_position = prefill(model, prompts, settings.max_new_tokens)
    # n samples per prompt share its prefill: its row repeated.
    rows = torch.arange(len(prompts)).repeat_interleave(settings.n)
    if settings.n > 1:
        index = rows.to(logits.device)
        cache.select_rows(index)
        logits, next_position = logits[index], next_position[index]
    samples = [Generation(int(p), [], [], "length") for p in rows]
    uniforms = None if settings.greedy else sample_uniforms(seeds, settings.max_new_tokens, logits.device)
    decode(model, cache, logits, next_position, samples, settings, tokenizer, uniforms)
    if tokenizer is not None:
        for sample in samples:
            sample.text = answer_text(sample, settings.stop_strings, tokenizer)
    return samples


def prefill(
    model: nn.Module, prompts: list[Prompt], max_new_tokens: int
) -> tuple[GenerationCache, torch.Tensor, torch.Tensor]:
    """The training forward of the prompts packed into one row -> (the cache, one row per prompt;
    each prompt's next-token logits (P, V); each prompt's next position (P,))."""
    config = model.config
    device = model.lm_head.weight.device
    lengths = torch.tensor([len(p.input_ids) for p in prompts])
    cu_seqlens = F.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)
    input_ids = torch.cat([p.input_ids for p in prompts])[None]
    media = {name: stacked(prompts, name, device) for name in MEDIA}
    positions = model_position_ids(config, input_ids, media["image_grid_thw"], cu_seqlens, media["video_grid_thw"])
    capacity = int(lengths.max()) + max_new_tokens
    cache = GenerationCache(layer_types(config.get_text_config()), lengths.to(device), capacity)
    with torch.no_grad():
        hidden = model(
            input_ids.to(device),
            position_ids=positions.to(device),
            cu_seqlens=cu_seqlens.to(device),
            max_seqlen=int(lengths.max()),
            return_hidden=True,
            cache=cache,
            **media,
        ).hidden_states
        logits = output_logits(model, replicated(hidden)[0, cu_seqlens[1:].long().to(device) - 1])
    # One past each prompt's largest position (over the three M-RoPE axes): transformers' rope deltas.
    largest = positions.reshape(-1, positions.shape[-1]).amax(0)
    next_position = torch.stack([largest[a:b].max() for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:])]) + 1
    return cache, logits, next_position.to(device)


def decode(
    model: nn.Module,
    cache: GenerationCache,
    logits: torch.Tensor,
    next_position: torch.Tensor,
    samples: list[Generation],
    settings: SamplingSettings,
    tokenizer: object | None,
    uniforms: torch.Tensor | None = None,
) -> None:
    """Chooses each sample's tokens (row i of the cache is samples[i]) until it stops or has
    max_new_tokens; a decoding step runs the rows still going, one token each. `uniforms`
    (samples, max_new_tokens): each sample's numbers its tokens are drawn with (`sample_uniforms`;
    None when greedy)."""
    device = logits.device
    stop_tokens = set(settings.stop_token_ids) | set(eos_token_ids(model))
    blocked = media_tokens(model.config, logits.shape[-1], device)
    mrope = family(model.config).positions == "mrope"
    lockstep = lockstep_group(model)  # expert parallelism: the ep group's ranks decode together
    active: list[int | None] = list(range(len(samples)))  # the sample of each row; None: a stand-in row
    cache.start_decoding()
    for step in range(settings.max_new_tokens):
        tokens, log_probs = next_tokens(logits, settings, None if uniforms is None else uniforms[:, step], blocked)
        policy = policy_log_probs(logits, tokens, settings.temperature)
        going = []
        chosen = zip(tokens.tolist(), log_probs.tolist(), policy.tolist())
        for row, (token, log_prob, policy_log_prob) in enumerate(chosen):
            if active[row] is None:  # a stopped rank's stand-in for its peers' steps: nothing kept
                continue
            sample = samples[active[row]]
            sample.tokens.append(token)
            sample.log_probs.append(log_prob)
            sample.policy_log_probs.append(policy_log_prob)
            reason = stop_reason(sample.tokens, stop_tokens, settings.stop_strings, tokenizer)
            if reason is None:
                going.append(row)
            else:
                sample.finish_reason = reason
        if step == settings.max_new_tokens - 1 or not any_going(bool(going), lockstep, device):
            return
        if len(going) < len(active):  # finished rows leave the batch
            # All of this rank's, not its ep peers': one row stays as a stand-in, its tokens not kept.
            index = torch.tensor(going or [0], device=device)
            cache.select_rows(index)
            tokens, next_position = tokens[index], next_position[index]
            if uniforms is not None:
                uniforms = uniforms[index]
            active = [active[row] for row in going] or [None]
        # A generated token's M-RoPE axes are equal (text after the prompt's media).
        positions = next_position[None, :, None].expand(3, -1, 1) if mrope else next_position[:, None]
        with torch.no_grad():
            hidden = model(tokens[:, None], position_ids=positions, return_hidden=True, cache=cache).hidden_states
            logits = output_logits(model, replicated(hidden)[:, -1])
        cache.advance()
        next_position = next_position + 1


def replicated(hidden: torch.Tensor) -> torch.Tensor:
    """The whole hidden states as a plain tensor: under tensor parallelism the decoder's output is
    a DTensor (split on the sequence under sequence parallelism)."""
    if isinstance(hidden, DTensor):
        return hidden.redistribute(placements=[Replicate()] * hidden.device_mesh.ndim).to_local()
    return hidden


def output_logits(model: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """(rows, V) logits of (rows, H) final hidden states, whole on every rank. Under tensor
    parallelism an untied lm_head is column-parallel with replicated output (its TP plan); a tied
    one shares the embedding's vocabulary shards: each rank's share of the logits, gathered."""
    weight = model.lm_head.weight
    if not isinstance(weight, DTensor) or weight is not model.token_embedding().weight:
        return model.lm_head(hidden)
    local = F.linear(hidden, weight.to_local())
    shape = (*local.shape[:-1], weight.shape[0])
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(
        local, weight.device_mesh, [Shard(local.dim() - 1)], shape=shape, stride=stride
    ).full_tensor()


MEDIA = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")


def stacked(prompts: list[Prompt], name: str, device: torch.device) -> torch.Tensor | None:
    """The prompts' media tensors of one kind in prompt order (the packed row's token order), or None."""
    parts = [getattr(p, name) for p in prompts if getattr(p, name) is not None]
    if not parts:
        return None
    out = torch.cat(parts)
    return out if name.endswith("grid_thw") else out.to(device)


def eos_token_ids(model: nn.Module) -> list[int]:
    """The model's end tokens: its generation config's eos_token_id (else its config's)."""
    generation_config = getattr(model, "generation_config", None)
    eos = getattr(generation_config, "eos_token_id", None)
    if eos is None:
        eos = getattr(model.config.get_text_config(), "eos_token_id", None)
    if eos is None:
        return []
    return [eos] if isinstance(eos, int) else list(eos)


def media_tokens(config: object, vocab: int, device: torch.device) -> torch.Tensor | None:
    """(V,) bool: the image and video placeholder tokens, never generated: the training forward would
    take a generated placeholder for an image's (or video's) place and fail or misplace the media."""
    ids = [getattr(config, name, None) for name in ("image_token_id", "video_token_id")]
    ids = [i for i in ids if i is not None and i < vocab]
    if not ids:
        return None
    blocked = torch.zeros(vocab, dtype=torch.bool, device=device)
    blocked[ids] = True
    return blocked


def stop_reason(tokens: list[int], stop_tokens: set[int], stop_strings: list[str], tokenizer: object) -> str | None:
    if tokens[-1] in stop_tokens:
        return "stop_token"
    if stop_strings:
        # A stop string of c characters lies within the last c tokens (+ a few for merges at the edges).
        window = max(len(s) for s in stop_strings) + 4
        tail = tokenizer.decode(tokens[-window:])
        if any(s in tail for s in stop_strings):
            return "stop_string"
    return None


def answer_text(sample: Generation, stop_strings: list[str], tokenizer: object) -> str:
    text = tokenizer.decode(sample.tokens, skip_special_tokens=True)
    if sample.finish_reason == "stop_string":
        cut = min((text.find(s) for s in stop_strings if s in text), default=len(text))
        text = text[:cut]
    return text


def check_request(config: object, prompts: list[Prompt], settings: SamplingSettings, tokenizer: object | None) -> None:
    """Refuses, by name and before the model runs (or loads: it needs the config alone), a bad
    setting, no prompts or an empty one, a prompt whose tokens and max_new_tokens exceed the
    model's context, stop strings without a tokenizer."""
    check_settings(settings)
    if not prompts:
        raise GenerationError("no prompts to generate from")
    if settings.stop_strings and tokenizer is None:
        raise GenerationError("sampling setting stop_strings needs a tokenizer")
    context = getattr(config.get_text_config(), "max_position_embeddings", None)
    for i, prompt in enumerate(prompts):
        n_tokens = len(prompt.input_ids)
        if n_tokens == 0:
            raise GenerationError(f"prompt {i} has no tokens")
        if context is not None and n_tokens + settings.max_new_tokens > context:
            raise GenerationError(
                f"prompt {i}: {n_tokens} tokens + max_new_tokens {settings.max_new_tokens} exceed the model's "
                f"context (max_position_embeddings {context})"
            )


def check_cache_fits(
    model: nn.Module, prompts: list[Prompt], settings: SamplingSettings, memory_limit: int | None
) -> None:
    """Refuses a batch whose cache (cache_bytes) is larger than `memory_limit` (default: the
    device's free memory), before the prefill."""
    rows = len(prompts) * settings.n
    capacity = max(len(p.input_ids) for p in prompts) + settings.max_new_tokens
    weight = model.lm_head.weight
    need = cache_bytes(model.config.get_text_config(), rows, capacity, weight.dtype, tensor_parallel_degree(model))
    limit = memory_limit if memory_limit is not None else free_memory(weight.device)
    if need > limit:
        raise GenerationError(
            f"a batch of {len(prompts)} prompts x n {settings.n} with max_new_tokens {settings.max_new_tokens} "
            f"needs a {need / 2**20:.1f} MiB cache ({rows} rows of {capacity} tokens); {limit / 2**20:.1f} MiB "
            "are free: fewer prompts, a smaller n or max_new_tokens"
        )


def tensor_parallel_degree(model: nn.Module) -> int:
    """How many ranks share the attention heads (1 unless parallelize applied tensor parallelism)."""
    for param in model.text_model().layers.parameters():
        if isinstance(param, DTensor):
            mesh = param.device_mesh
            names = mesh.mesh_dim_names or ()
            return mesh.size(names.index("tp")) if "tp" in names else 1
    return 1


def free_memory(device: torch.device) -> int:
    """Bytes free on the device (the host's available memory for the CPU)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
