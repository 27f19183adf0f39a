"""The architectures of the models the shipped recipes (config/experiments/*.yaml) train, by
repo_id: the architecture fields of each model's published config.json, as transformers
configs (no weights). For checks that need the real shapes without the hub:
benchmarks/memory_recipes.py and tests/workflow/test_recipe_models.py.
"""


def _qwen3_vl(
    hidden,
    intermediate,
    layers,
    heads,
    tied,
    vision_depth,
    vision_hidden,
    vision_intermediate,
    deepstack,
    vision_heads=16,
):
    from transformers import Qwen3VLConfig

    text = dict(
        vocab_size=151936,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=8,
        head_dim=128,
        tie_word_embeddings=tied,
        max_position_embeddings=262144,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 5e6,
            "mrope_interleaved": True,
            "mrope_section": [24, 20, 20],
        },
    )
    vision = dict(
        depth=vision_depth,
        hidden_size=vision_hidden,
        intermediate_size=vision_intermediate,
        num_heads=vision_heads,
        out_hidden_size=hidden,
        patch_size=16,
        spatial_merge_size=2,
        temporal_patch_size=2,
        num_position_embeddings=2304,
        deepstack_visual_indexes=deepstack,
    )
    return Qwen3VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=tied)


def _qwen3_vl_30b_a3b():
    """Qwen3-VL-30B-A3B-Instruct: 48 layers, all sparse, 128 experts, top-8 renormalised."""
    from transformers import Qwen3VLMoeConfig

    text = dict(
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        tie_word_embeddings=False,
        max_position_embeddings=262144,
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=768,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 5e6,
            "mrope_interleaved": True,
            "mrope_section": [24, 20, 20],
        },
    )
    vision = dict(
        depth=27,
        hidden_size=1152,
        intermediate_size=4304,
        num_heads=16,
        out_hidden_size=2048,
        patch_size=16,
        spatial_merge_size=2,
        temporal_patch_size=2,
        num_position_embeddings=2304,
        deepstack_visual_indexes=[8, 16, 24],
    )
    return Qwen3VLMoeConfig(text_config=text, vision_config=vision, tie_word_embeddings=False)


def _qwen3_5_9b():
    from transformers import Qwen3_5Config

    text = dict(
        vocab_size=248320,
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=32,
        layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 8,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=256,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_num_key_heads=16,
        linear_num_value_heads=32,
        tie_word_embeddings=False,
        max_position_embeddings=262144,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 1e7,
            "partial_rotary_factor": 0.25,
            "mrope_section": [11, 11, 10],
            "mrope_interleaved": True,
        },
    )
    vision = dict(
        depth=27,
        hidden_size=1152,
        intermediate_size=4304,
        num_heads=16,
        out_hidden_size=4096,
        patch_size=16,
        spatial_merge_size=2,
        temporal_patch_size=2,
        num_position_embeddings=2304,
    )
    return Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=False)


def _qwen3_vl_8b_vit6b():
    """Qwen3-VL-8B's language model behind an InternViT-6B-sized vision tower (45 blocks of width
    3200, MLP 12800, 25 heads of 128) in Qwen3-VL's layout without DeepStack: 6.4B vision
    parameters, a user-assembled model (config/experiments/qwen3vl-8b-vit6b-mn5.yaml)."""
    return _qwen3_vl(4096, 12288, 36, 32, False, 45, 3200, 12800, [], vision_heads=25)


MODELS = {
    "Qwen/Qwen3-VL-2B-Instruct": lambda: _qwen3_vl(2048, 6144, 28, 16, True, 24, 1024, 4096, [5, 11, 17]),
    "Qwen/Qwen3-VL-8B-Instruct": lambda: _qwen3_vl(4096, 12288, 36, 32, False, 27, 1152, 4304, [8, 16, 24]),
    "Qwen/Qwen3.5-9B": _qwen3_5_9b,
    "Qwen/Qwen3-VL-30B-A3B-Instruct": _qwen3_vl_30b_a3b,
    "local/qwen3vl-8b-vit6b": _qwen3_vl_8b_vit6b,
}
