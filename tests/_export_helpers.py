"""Tiny real snapshots of the three families and `final/` checkpoints written the way training does.

Shared by the export and eval tests. Everything is built locally (no hub): the demo tokenizer,
the PIL image processor files, random transformers models.
"""

import json
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from vlmcore.data.media.processor import write_processor_files
from vlmcore.data.media.tokenizer import build_demo_tokenizer, special_token_ids
from vlmcore.data.synthetic.image import corpus_texts
from vlmcore.download import build_tiny_model, write_manifest

TEXT = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
)
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


def tiny_snapshot(family: str, out: Path, seed: int = 0) -> Path:
    """An HF snapshot directory (weights, config, tokenizer, processor, manifest) of `family`:
    "qwen3" (text, tied embeddings), "qwen3_vl" (the demo model) or "qwen3_5" (VL, linear attention)."""
    out = Path(out)
    if family == "qwen3_vl":
        build_tiny_model(
            out,
            seed=seed,
            overrides={
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
            },
        )
        return out
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration, Qwen3Config, Qwen3ForCausalLM

    out.mkdir(parents=True)
    tokenizer = build_demo_tokenizer(out, corpus_texts(seed))
    ids = special_token_ids(tokenizer)
    torch.manual_seed(seed)
    if family == "qwen3":
        config = Qwen3Config(
            **TEXT, tie_word_embeddings=True, eos_token_id=ids["eos_token_id"], pad_token_id=ids["pad_token_id"]
        )
        model = Qwen3ForCausalLM(config)
    elif family == "qwen3_5":
        text = dict(
            TEXT,
            num_hidden_layers=4,
            linear_conv_kernel_dim=4,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            eos_token_id=ids["eos_token_id"],
            pad_token_id=ids["pad_token_id"],
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 1e7,
                "partial_rotary_factor": 0.25,
                "mrope_section": [1, 1, 0],
                "mrope_interleaved": True,
            },
        )
        config = Qwen3_5Config(
            vision_config=VISION,
            text_config=text,
            tie_word_embeddings=False,
            **{k: ids[k] for k in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")},
        )
        model = Qwen3_5ForConditionalGeneration(config)
        write_processor_files(out, patch_size=16, merge_size=2, temporal_patch_size=2)
    else:
        raise ValueError(f"unknown family {family!r}")
    model.save_pretrained(out)
    write_manifest(out, f"test/tiny-{family}", f"seed{seed}")
    return out


def write_final_checkpoint(model: torch.nn.Module, stage_dir: Path, step: int = 7) -> Path:
    """`train/<stage>/final/` as training writes it: DCP of {"model": state dict} + meta.json."""
    final = Path(stage_dir) / "final"
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(final), no_dist=True)
    meta = {
        "model_path": "model",
        "step": step,
        "tokens": 1000 * step,
        "samples": 10 * step,
        "stage_config": "config.yaml",
    }
    (final / "meta.json").write_text(json.dumps(meta))
    (Path(stage_dir) / "config.yaml").write_text(
        f"stage: {Path(stage_dir).name}\nsteps: {step}\noptimizer: {{lr: 0.001}}\n"
    )
    return final


def perturbed(model: torch.nn.Module, seed: int = 1) -> torch.nn.Module:
    """The model with every weight moved, standing in for a trained one."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.02 * torch.randn(param.shape, generator=generator))
    return model
