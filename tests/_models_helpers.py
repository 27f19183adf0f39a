"""Tiny random configs, HF reference models and inputs for the vlmcore.models tests."""

import torch
import torch.nn.functional as F
from transformers import Qwen3Config, Qwen3VLConfig

IMAGE, VISION_START, VISION_END = 250, 251, 252
VISION = dict(
    depth=2,
    hidden_size=32,
    intermediate_size=64,
    num_heads=2,
    patch_size=16,
    spatial_merge_size=2,
    temporal_patch_size=2,
    out_hidden_size=64,
    num_position_embeddings=64,
)
PATCH_DIM = 3 * 2 * 16 * 16


def qwen3_config(tied=True, heads=4, kv_heads=2, head_dim=16, layers=2):
    return Qwen3Config(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        tie_word_embeddings=tied,
    )


def qwen3_vl_config(
    deepstack=(0, 1), heads=4, kv_heads=2, head_dim=16, tied=False, layers=3, config_class=Qwen3VLConfig, **text
):
    half = head_dim // 2
    section = [half - 2 * (half // 4), half // 4, half // 4]
    return config_class(
        vision_config=dict(VISION, deepstack_visual_indexes=list(deepstack)),
        text_config=dict(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 5e6,
                "mrope_section": section,
                "mrope_interleaved": True,
            },
            **text,
        ),
        image_token_id=IMAGE,
        video_token_id=253,
        vision_start_token_id=VISION_START,
        vision_end_token_id=VISION_END,
        tie_word_embeddings=tied,
    )


def qwen3_vl_moe_config(num_experts=8, top_k=2, **shape):
    """Qwen3-VL-MoE: the Qwen3-VL tiny config with sparse MLPs. moe_intermediate_size 48 makes the
    on-disk expert shapes (E, H, 2I) = (E, 64, 96) and (E, I, H) differ from the in-memory ones."""
    from transformers import Qwen3VLMoeConfig

    return qwen3_vl_config(
        config_class=Qwen3VLMoeConfig,
        **{
            **dict(
                num_experts=num_experts, num_experts_per_tok=top_k, moe_intermediate_size=48, router_aux_loss_coef=0.02
            ),
            **shape,
        },
    )


def vl_sample(grids, text_lens, generator, merge=2):
    """input_ids (1-D) of text runs around images, and the images' pixel patches.

    `text_lens` has one more entry than `grids`: text, image, text, image, ..., text.
    """
    ids = [torch.randint(0, 200, (text_lens[0],), generator=generator)]
    pixels = []
    for (t, h, w), n_text in zip(grids, text_lens[1:]):
        n_img = t * h * w // merge**2
        ids += [torch.tensor([VISION_START] + [IMAGE] * n_img + [VISION_END])]
        ids += [torch.randint(0, 200, (n_text,), generator=generator)]
        pixels.append(torch.randn(t * h * w, PATCH_DIM, generator=generator))
    grid = torch.tensor(grids, dtype=torch.long) if grids else None
    return torch.cat(ids), (torch.cat(pixels) if pixels else None), grid


def pack(samples):
    """One row holding (ids, pixels, grid) samples back to back, with cu_seqlens and the images in order."""
    ids = torch.cat([s[0] for s in samples])[None]
    pixels = [s[1] for s in samples if s[1] is not None]
    grids = [s[2] for s in samples if s[2] is not None]
    cu = F.pad(torch.tensor([len(s[0]) for s in samples]).cumsum(0), (1, 0)).to(torch.int32)
    return ids, torch.cat(pixels), torch.cat(grids), cu


def hf_and_native(hf_class, config, path):
    """A random HF reference model (seed 0) and the native model loaded from its saved snapshot."""
    torch.manual_seed(0)
    hf = hf_class(config).eval()
    hf.save_pretrained(path)
    from vlmcore.models import from_pretrained

    return hf, from_pretrained(path).eval()


def packed_and_alone(native, samples):
    """Logits of one row packing the vl_sample()s (cu_seqlens) and of each sample alone, and the
    packed row's token-loss gradients; the samples' own are left in the parameters' .grad."""
    ids, pixels, grid, cu = pack(samples)
    packed = native(ids, pixels, grid, cu_seqlens=cu).logits
    sum(token_loss(packed[:, a:b], ids[:, a:b]) for a, b in zip(cu[:-1], cu[1:])).backward()
    packed_grads = {n: p.grad.clone() for n, p in native.named_parameters()}
    native.zero_grad()
    alone, loss = [], 0
    for s_ids, s_pix, s_grid in samples:
        logits = native(s_ids[None], s_pix, s_grid).logits
        alone.append(logits)
        loss = loss + token_loss(logits, s_ids[None])
    loss.backward()
    return packed, torch.cat(alone, dim=1), packed_grads


def assert_packed_row_equals_samples_alone(native, samples):
    packed, alone, packed_grads = packed_and_alone(native, samples)
    assert max_rel(packed, alone) < 1e-5
    for name, p in native.named_parameters():
        assert max_rel(packed_grads[name], p.grad) < 1e-4, name


def hf_vl_logits(hf_model, ids, pixels, grid):
    """The HF model's logits for one batch (ids (B, S))."""
    return hf_model(
        input_ids=ids, pixel_values=pixels, image_grid_thw=grid, mm_token_type_ids=(ids == IMAGE).int()
    ).logits


def token_loss(logits, ids):
    """Sum of next-token cross-entropies (labels = ids shifted), in fp32."""
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten(), reduction="sum")


def grad_diffs(model_a, model_b):
    """Per parameter name, |grad_a - grad_b|.max() / (|grad_b|.max() + 1e-3 * largest |grad_b| of the model)
    (inf when only one has a grad). The absolute floor keeps gradients that are tiny because of
    cancellation (Qwen3.5's decay parameters, ~1e-8) from turning fp32 rounding into large ratios."""
    grads_b = {n: p.grad for n, p in model_b.named_parameters()}
    floor = 1e-3 * max(g.abs().max().item() for g in grads_b.values() if g is not None)
    out = {}
    for name, p in model_a.named_parameters():
        ref = grads_b[name]
        if p.grad is None or ref is None:
            out[name] = 0.0 if p.grad is None and ref is None else float("inf")
            continue
        out[name] = ((p.grad - ref).abs().max() / (ref.abs().max() + floor)).item()
    return out


def meta_parameter_count(config, hf_class) -> int:
    """Builds the native model and `hf_class` of `config` on the meta device, checks that they
    have the same parameter names and shapes, and returns the parameter count."""
    import vlmcore.models as models

    native = models.build_model(config)
    with torch.device("meta"):
        hf = hf_class(config)
    assert all(p.is_meta for p in native.parameters())
    hf_shapes = {n: p.shape for n, p in hf.named_parameters()}
    assert {n: p.shape for n, p in native.named_parameters()} == hf_shapes
    return sum(p.numel() for p in native.parameters())


def max_rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def qwen3_5_text_dict(layers=4, heads=4, kv_heads=2, head_dim=16, k_heads=2, v_heads=4, tied=False):
    rot = head_dim // 4  # partial_rotary_factor 0.25
    half = rot // 2
    return dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=16,
        linear_value_head_dim=8,
        linear_num_key_heads=k_heads,
        linear_num_value_heads=v_heads,
        tie_word_embeddings=tied,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 1e7,
            "partial_rotary_factor": 0.25,
            "mrope_section": [half - 2 * (half // 3), half // 3, half // 3],
            "mrope_interleaved": True,
        },
    )


def qwen3_5_config(tied=False, **text):
    from transformers import Qwen3_5Config

    return Qwen3_5Config(
        vision_config=dict(VISION),
        text_config=qwen3_5_text_dict(**text),
        image_token_id=IMAGE,
        video_token_id=253,
        vision_start_token_id=VISION_START,
        vision_end_token_id=VISION_END,
        tie_word_embeddings=tied,
    )


def qwen3_5_text_config(**text):
    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig(**qwen3_5_text_dict(**text))


def logits_loss_then_grad_diffs(native, hf, ids, out, ref) -> dict:
    """Checks logits (relative 1e-4) and loss (1e-5) against transformers, backpropagates both,
    and returns the relative gradient difference of every parameter."""
    assert out.shape == ref.shape
    assert max_rel(out, ref) < 1e-4
    ref_loss, loss = token_loss(ref, ids) / ids.numel(), token_loss(out, ids) / ids.numel()
    assert abs(loss.item() - ref_loss.item()) < 1e-5
    ref_loss.backward()
    loss.backward()
    return grad_diffs(native, hf)


# Qwen3.5-MoE: every layer sparse, with a shared expert of another width than the routed ones.
QWEN3_5_MOE = dict(
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=48,
    router_aux_loss_coef=0.02,
)


def qwen3_5_moe_text_dict(moe=None, **text):
    """qwen3_5_text_dict without the dense MLP width, plus the MoE fields (`moe` overrides them)."""
    fields = {k: v for k, v in qwen3_5_text_dict(**text).items() if k != "intermediate_size"}
    return {**fields, **QWEN3_5_MOE, **(moe or {})}


def qwen3_5_moe_config(tied=False, moe=None, **text):
    from transformers import Qwen3_5MoeConfig

    return Qwen3_5MoeConfig(
        vision_config=dict(VISION),
        text_config=qwen3_5_moe_text_dict(moe, **text),
        image_token_id=IMAGE,
        video_token_id=253,
        vision_start_token_id=VISION_START,
        vision_end_token_id=VISION_END,
        tie_word_embeddings=tied,
    )


def qwen3_5_moe_text_config(tied=False, moe=None, **text):
    from transformers import Qwen3_5MoeTextConfig

    return Qwen3_5MoeTextConfig(**qwen3_5_moe_text_dict(moe, tied=tied, **text))


VIDEO = 253  # the tiny configs' video_token_id


def mm_sample(items, generator, merge=2):
    """input_ids (1-D) and the visual inputs of a sample mixing text, images and videos, laid out
    as Qwen3-VL's processor lays them out: ("text", n) n random tokens; ("image", (1, h, w))
    vision_start, the image tokens, vision_end; ("video", (T, h, w)) for each of its T frame groups
    a 3-token timestamp text ("<1.0 seconds>" stands in), vision_start, the group's video tokens,
    vision_end. -> ids, pixel_values, image_grid_thw, pixel_values_videos, video_grid_thw (None when absent)."""
    ids, images, videos = [], [], []
    for kind, spec in items:
        if kind == "text":
            ids.append(torch.randint(0, 200, (spec,), generator=generator))
            continue
        t, h, w = spec
        group = [VISION_START] + [IMAGE if kind == "image" else VIDEO] * (h * w // merge**2) + [VISION_END]
        if kind == "image":
            ids.append(torch.tensor(group))
        else:
            for _ in range(t):
                ids += [torch.randint(0, 200, (3,), generator=generator), torch.tensor(group)]
        (images if kind == "image" else videos).append((spec, torch.randn(t * h * w, PATCH_DIM, generator=generator)))

    def stacked(parts):
        if not parts:
            return None, None
        return torch.cat([px for _, px in parts]), torch.tensor([spec for spec, _ in parts], dtype=torch.long)

    return (torch.cat(ids), *stacked(images), *stacked(videos))


def mm_token_types(ids):
    """transformers' mm_token_type_ids: 1 at image tokens, 2 at video tokens."""
    return (ids == IMAGE).int() + 2 * (ids == VIDEO).int()


def hf_mm_inputs(ids, pixels, grid, video_pixels, video_grid) -> dict:
    return dict(
        input_ids=ids,
        pixel_values=pixels,
        image_grid_thw=grid,
        pixel_values_videos=video_pixels,
        video_grid_thw=video_grid,
        mm_token_type_ids=mm_token_types(ids),
    )
