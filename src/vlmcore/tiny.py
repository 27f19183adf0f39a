"""Tiny random configs of every family, for the demo, the tests and the benchmarks.

Plain dicts of transformers config fields, and functions that make transformers' config objects
of them (returned as `Any`: transformers and torch are imported when a function is called, this
module is torch-free at import); `tiny_snapshot` writes one as a random snapshot and `run_config`
is a short training run on random data. The exactness tests compare models built from these
values: a changed value changes what they compare. A variant that a test needs keeps its own
name here rather than a copy in the test.
"""

from pathlib import Path
from typing import Any

from vlmcore.families import FAMILIES, TINY_FAMILIES, TinyBuild

# The special tokens of the configs without a tokenizer (a 256-token vocabulary's last ids).
IMAGE, VISION_START, VISION_END, VIDEO = 250, 251, 252, 253
SPECIAL = dict(
    image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=VISION_START, vision_end_token_id=VISION_END
)

# The vision tower of every tiny VL config of the tests.
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
PATCH_DIM = 3 * 2 * 16 * 16  # channels x temporal_patch_size x patch_size^2: one pixel patch


# --- The demo's model (`vlmcore download --tiny`) -------------------------------------------------


def tiny_build(name: str) -> TinyBuild:
    if name not in TINY_FAMILIES:
        raise ValueError(f"model.tiny.family: {name!r} is not one of {TINY_FAMILIES}")
    return FAMILIES[name].tiny


def tiny_vl_config(tokenizer_ids: dict, vocab_size: int, family: str = "qwen3_vl", **overrides: dict) -> dict:
    """A Qwen3-VL (or Qwen3-VL-MoE) architecture small enough to train in minutes on a laptop CPU."""
    text = dict(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 1e6,
            "mrope_section": [6, 5, 5],
            "mrope_interleaved": True,
        },
        **tiny_build(family).text_fields,
    )
    vision = dict(
        depth=2,
        hidden_size=64,
        intermediate_size=192,
        num_heads=2,
        patch_size=16,
        spatial_merge_size=2,
        temporal_patch_size=2,
        out_hidden_size=text["hidden_size"],
        num_position_embeddings=64,
        deepstack_visual_indexes=[0],
    )
    text.update(overrides.get("text_config", {}))
    vision.update(overrides.get("vision_config", {}))
    special = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
    return dict(
        text_config=text,
        vision_config=vision,
        **{k: tokenizer_ids[k] for k in special},
        tie_word_embeddings=text["tie_word_embeddings"],
    )


# The demo's model at the tests' widths (the export and eval tests' Qwen3-VL snapshot):
# build_tiny_model(..., overrides=DEMO_AT_TEST_WIDTHS).
DEMO_AT_TEST_WIDTHS = {
    "text_config": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "head_dim": 16,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 1e6,
            "mrope_section": [4, 2, 2],
            "mrope_interleaved": True,
        },
    },
    "vision_config": {"out_hidden_size": 64},
}


# --- The training engine's tests: one config per family (hf_config) -----------------------------

TEXT = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
)
# Mixture-of-experts text settings: 4 experts, 2 per token, a strong load-balancing coefficient
# so that its gradients show in the exactness comparisons.
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, router_aux_loss_coef=0.05)
# Qwen3.5's language model: 4 layers (3 Gated DeltaNet, 1 gated attention), rotary on a quarter of
# the head.
LINEAR_ATTENTION = dict(
    num_hidden_layers=4,
    linear_conv_kernel_dim=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    rope_parameters={
        "rope_type": "default",
        "rope_theta": 1e7,
        "partial_rotary_factor": 0.25,
        "mrope_section": [1, 1, 0],
        "mrope_interleaved": True,
    },
)
VL_ROPE = {"rope_type": "default", "rope_theta": 5e6, "mrope_section": [4, 2, 2], "mrope_interleaved": True}


def hf_config(kind: str) -> Any:
    """The transformers config of the engine tests' tiny model of `kind` (a family name)."""
    import transformers

    if kind == "qwen3":
        return transformers.Qwen3Config(**TEXT, tie_word_embeddings=True)
    if kind == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**TEXT, **MOE, norm_topk_prob=True, tie_word_embeddings=False)
    if kind == "qwen3_vl":
        return transformers.Qwen3VLConfig(
            vision_config=dict(VISION, deepstack_visual_indexes=[0]),
            text_config=dict(TEXT, rope_parameters=VL_ROPE),
            **SPECIAL,
        )
    if kind == "qwen3_vl_moe":
        return transformers.Qwen3VLMoeConfig(
            vision_config=dict(VISION, deepstack_visual_indexes=[0]),
            text_config=dict(TEXT, **MOE, rope_parameters=VL_ROPE),
            **SPECIAL,
        )
    if kind in ("qwen3_5", "qwen3_5_moe"):
        text = dict(TEXT, **LINEAR_ATTENTION)
        if kind == "qwen3_5":
            return transformers.Qwen3_5Config(vision_config=VISION, text_config=text, **SPECIAL)
        text = {k: v for k, v in text.items() if k != "intermediate_size"}  # every layer is sparse
        return transformers.Qwen3_5MoeConfig(
            vision_config=VISION, **SPECIAL, text_config=dict(text, **MOE, shared_expert_intermediate_size=32)
        )
    raise ValueError(kind)


# The transformers model class of each kind of hf_config.
MODEL_CLASSES = {
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen3_vl": "Qwen3VLForConditionalGeneration",
    "qwen3_vl_moe": "Qwen3VLMoeForConditionalGeneration",
    "qwen3_5": "Qwen3_5ForConditionalGeneration",
    "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration",
}


def tiny_snapshot(kind: str, path: Path, seed: int = 0, **text: Any) -> Path:
    """An HF snapshot directory (config.json + model.safetensors) of hf_config(kind)'s random
    model, transformers' initialisation from `seed`; `text`: settings of its language model that
    differ from hf_config's. An existing snapshot is left as it is."""
    import torch
    import transformers

    if (path / "config.json").exists():
        return path
    torch.manual_seed(seed)
    config = hf_config(kind)
    for key, value in text.items():
        setattr(config.get_text_config(), key, value)
    getattr(transformers, MODEL_CLASSES[kind])(config).save_pretrained(path)
    return path


def run_config(model_path: str | Path, output_dir: str | Path, **overrides: Any) -> dict:
    """A short training run on random data (4 steps of one 32-token row, no checkpoints), as the
    tests and the GPU checks run one; `overrides` are top-level keys (sections as dicts, merged)."""
    cfg = {
        "model_path": str(model_path),
        "output_dir": str(output_dir),
        "steps": 4,
        "micro_batch_size": 1,
        "grad_accum_steps": 1,
        "seed": 0,
        "trainable": [],
        "optimizer": {"lr": 1.0e-3, "weight_decay": 0.01},
        "schedule": {"name": "cosine", "warmup_steps": min(2, overrides.get("steps", 4)), "min_lr_ratio": 0.1},
        "checkpoint": {"interval": 0, "keep": 2},
        "metrics": {"tensorboard": False},
        "data": {"kind": "random", "seq_len": 32, "segments": 3, "image_fraction": 0.5},
    }
    for key, value in overrides.items():
        if isinstance(value, dict):
            cfg.setdefault(key, {}).update(value)
        else:
            cfg[key] = value
    return cfg


# The export and eval tests' snapshots carry the demo tokenizer (512 tokens) and transformers'
# default context length; otherwise TEXT.
TOKENIZER_TEXT = dict({k: v for k, v in TEXT.items() if k != "max_position_embeddings"}, vocab_size=512)


# --- The models tests: shapes as arguments ---------------------------------------------------------


def qwen3_config(tied: bool = True, heads: int = 4, kv_heads: int = 2, head_dim: int = 16, layers: int = 2) -> Any:
    from transformers import Qwen3Config

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
    deepstack: tuple[int, ...] = (0, 1),
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 16,
    tied: bool = False,
    layers: int = 3,
    config_class: type | None = None,
    **text: Any,
) -> Any:
    if config_class is None:
        from transformers import Qwen3VLConfig as config_class
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
        tie_word_embeddings=tied,
        **SPECIAL,
    )


def qwen3_vl_moe_config(num_experts: int = 8, top_k: int = 2, **shape: Any) -> Any:
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


def qwen3_5_text_dict(
    layers: int = 4,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 16,
    k_heads: int = 2,
    v_heads: int = 4,
    tied: bool = False,
) -> dict:
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


def qwen3_5_config(tied: bool = False, **text: Any) -> Any:
    from transformers import Qwen3_5Config

    return Qwen3_5Config(
        vision_config=dict(VISION), text_config=qwen3_5_text_dict(**text), tie_word_embeddings=tied, **SPECIAL
    )


def qwen3_5_text_config(**text: Any) -> Any:
    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig(**qwen3_5_text_dict(**text))


# Qwen3.5-MoE: every layer sparse, with a shared expert of another width than the routed ones.
QWEN3_5_MOE = dict(
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=48,
    router_aux_loss_coef=0.02,
)


def qwen3_5_moe_text_dict(moe: dict | None = None, **text: Any) -> dict:
    """qwen3_5_text_dict without the dense MLP width, plus the MoE fields (`moe` overrides them)."""
    fields = {k: v for k, v in qwen3_5_text_dict(**text).items() if k != "intermediate_size"}
    return {**fields, **QWEN3_5_MOE, **(moe or {})}


def qwen3_5_moe_config(tied: bool = False, moe: dict | None = None, **text: Any) -> Any:
    from transformers import Qwen3_5MoeConfig

    return Qwen3_5MoeConfig(
        vision_config=dict(VISION),
        text_config=qwen3_5_moe_text_dict(moe, **text),
        tie_word_embeddings=tied,
        **SPECIAL,
    )


def qwen3_5_moe_text_config(tied: bool = False, moe: dict | None = None, **text: Any) -> Any:
    from transformers import Qwen3_5MoeTextConfig

    return Qwen3_5MoeTextConfig(**qwen3_5_moe_text_dict(moe, tied=tied, **text))


# Qwen3.5 of the parity tests (tests/models/test_models_qwen3_5.py, test_models_flops.py): five
# layers mixing Gated DeltaNet and gated full attention, another MLP width than qwen3_5_text_dict's.
QWEN3_5_PARITY_LAYERS = ["linear_attention", "full_attention", "linear_attention", "linear_attention", "full_attention"]


def qwen3_5_parity_text_dict(
    head_dim: int = 16,
    k_heads: int = 2,
    v_heads: int = 4,
    tied: bool = False,
    pad: int | None = None,
    layer_types: list[str] = QWEN3_5_PARITY_LAYERS,
) -> dict:
    rot_half = head_dim // 8  # partial_rotary_factor 0.25
    section = [rot_half - 2 * (rot_half // 3), rot_half // 3, rot_half // 3] if rot_half > 2 else [1, 1, 0]
    return dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=len(layer_types),
        layer_types=list(layer_types),
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=16,
        linear_value_head_dim=8,
        linear_num_key_heads=k_heads,
        linear_num_value_heads=v_heads,
        tie_word_embeddings=tied,
        pad_token_id=pad,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 1e7,
            "partial_rotary_factor": 0.25,
            "mrope_section": section,
            "mrope_interleaved": True,
        },
    )


def qwen3_5_parity_config(tied: bool = False, **text: Any) -> Any:
    from transformers import Qwen3_5Config

    return Qwen3_5Config(
        vision_config=VISION, text_config=qwen3_5_parity_text_dict(**text), tie_word_embeddings=tied, **SPECIAL
    )


# --- The data tests' config.json beside a tokenizer (no weights) ------------------------------------


def data_vl_config(token_ids: dict, vocab_size: int) -> dict:
    """The fields of the data tests' Qwen3-VL config (one vision block) for a tokenizer's ids."""
    return dict(
        vision_config=dict(VISION, depth=1, deepstack_visual_indexes=[0]),
        text_config=dict(TOKENIZER_TEXT, vocab_size=vocab_size, rope_parameters=VL_ROPE),
        **{key: token_ids[key] for key in SPECIAL},
    )


# --- The benchmarks' (benchmarks/models.py): wide enough that a CPU's time goes to the matmuls ------

BENCHMARK_TEXT = dict(
    vocab_size=4096,
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
)
# Qwen3.5: 3 Gated DeltaNet layers, then 1 gated full-attention layer; rotary on 16 of 64 channels.
BENCHMARK_LINEAR_ATTENTION = dict(
    linear_conv_kernel_dim=4,
    linear_key_head_dim=32,
    linear_value_head_dim=32,
    linear_num_key_heads=4,
    linear_num_value_heads=8,
)
BENCHMARK_VISION = dict(
    depth=4,
    hidden_size=128,
    intermediate_size=512,
    num_heads=2,
    out_hidden_size=256,
    patch_size=16,
    spatial_merge_size=2,
    temporal_patch_size=2,
    num_position_embeddings=2304,
)
BENCHMARK_SPECIAL = dict(image_token_id=4090, vision_start_token_id=4091, vision_end_token_id=4092, video_token_id=4093)


def benchmark_config(family: str) -> Any:
    """The transformers config of benchmarks/models.py's model of `family` (qwen3, qwen3_vl or
    qwen3_5; Qwen3-VL with DeepStack at 2 vision layers)."""
    import transformers

    if family == "qwen3":
        return transformers.Qwen3Config(**BENCHMARK_TEXT, tie_word_embeddings=True)
    if family == "qwen3_vl":
        rope = {"rope_type": "default", "rope_theta": 5e6, "mrope_section": [12, 10, 10], "mrope_interleaved": True}
        return transformers.Qwen3VLConfig(
            text_config=dict(BENCHMARK_TEXT, rope_parameters=rope),
            vision_config=dict(BENCHMARK_VISION, deepstack_visual_indexes=[1, 2]),
            tie_word_embeddings=False,
            **BENCHMARK_SPECIAL,
        )
    if family == "qwen3_5":
        rope = {
            "rope_type": "default",
            "rope_theta": 1e7,
            "partial_rotary_factor": 0.25,
            "mrope_section": [4, 2, 2],
            "mrope_interleaved": True,
        }
        return transformers.Qwen3_5Config(
            text_config=dict(BENCHMARK_TEXT, **BENCHMARK_LINEAR_ATTENTION, rope_parameters=rope),
            vision_config=BENCHMARK_VISION,
            tie_word_embeddings=False,
            **BENCHMARK_SPECIAL,
        )
    raise ValueError(family)
