"""One record per model family: what vlmcore knows about a `model_type` beyond its config.json.

Every question about a family is asked here: which native class builds it, whether it has a
vision tower, mixture-of-experts layers or Gated DeltaNet layers, its position scheme, how its
snapshots store the experts, which snapshot tensors the native model leaves out, and the demo's
tiny build. A new family is one record below (and its model file in vlmcore/models/).

No torch: the workflow reads these records on a login node, before any job is queued.
"""

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class TinyBuild:
    """The demo's tiny random model of a family (`vlmcore download --tiny --tiny-family`): the
    transformers classes that write it and the fields the family adds to the dense tiny Qwen3-VL
    text config (vlmcore.tiny.tiny_vl_config)."""

    config_class: str
    model_class: str
    text_fields: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Family:
    model_type: str
    model_class: str  # the native model, "module:Class" under vlmcore.models
    vision: bool  # a vision tower (image inputs)
    positions: str  # "text": (B, S) restarting per segment; "mrope": Qwen3-VL's 3-D (t, h, w)
    experts: bool = False  # mixture-of-experts feed-forward layers
    expert_storage: str = "fused"  # how its released snapshots store the experts (models/expert_storage.py)
    linear_attention: bool = False  # Gated DeltaNet layers (Qwen3.5)
    gated_attention: bool = False  # the full-attention q_proj also gives a sigmoid output gate (Qwen3.5)
    ignored_prefixes: tuple[str, ...] = ()  # snapshot tensors the native model does not use
    tensor_parallel: bool = True  # parallel/tp.py has a plan for it
    tiny: TinyBuild | None = None

    def native_class(self) -> type:
        """The vlmcore model class (imports torch)."""
        import importlib

        module, name = self.model_class.split(":")
        return getattr(importlib.import_module(f"vlmcore.models.{module}"), name)


_MTP = ("mtp.",)  # Qwen3.5's multi-token-prediction head: in the snapshots, not trained here

FAMILIES = {
    f.model_type: f
    for f in (
        Family("qwen3", "qwen3:Qwen3ForCausalLM", vision=False, positions="text"),
        Family(
            "qwen3_moe",
            "qwen3:Qwen3ForCausalLM",
            vision=False,
            positions="text",
            experts=True,
            expert_storage="per_expert",
        ),
        Family(
            "qwen3_vl",
            "qwen3_vl:Qwen3VLForConditionalGeneration",
            vision=True,
            positions="mrope",
            tiny=TinyBuild("Qwen3VLConfig", "Qwen3VLForConditionalGeneration"),
        ),
        # Every layer sparse: 4 experts, top-2, each half the dense MLP, so a token costs what it does
        # in the dense demo model.
        Family(
            "qwen3_vl_moe",
            "qwen3_vl:Qwen3VLForConditionalGeneration",
            vision=True,
            positions="mrope",
            experts=True,
            expert_storage="fused_transposed",
            tiny=TinyBuild(
                "Qwen3VLMoeConfig",
                "Qwen3VLMoeForConditionalGeneration",
                dict(
                    num_experts=4,
                    num_experts_per_tok=2,
                    moe_intermediate_size=192,
                    norm_topk_prob=True,
                    decoder_sparse_step=1,
                    mlp_only_layers=[],
                    router_aux_loss_coef=0.001,
                ),
            ),
        ),
        Family(
            "qwen3_5",
            "qwen3_5:Qwen3_5ForConditionalGeneration",
            vision=True,
            positions="mrope",
            linear_attention=True,
            gated_attention=True,
            ignored_prefixes=_MTP,
        ),
        Family(
            "qwen3_5_text",
            "qwen3_5:Qwen3_5ForCausalLM",
            vision=False,
            positions="text",
            linear_attention=True,
            gated_attention=True,
            ignored_prefixes=_MTP,
        ),
        Family(
            "qwen3_5_moe",
            "qwen3_5:Qwen3_5ForConditionalGeneration",
            vision=True,
            positions="mrope",
            experts=True,
            linear_attention=True,
            gated_attention=True,
            ignored_prefixes=_MTP,
        ),
        Family(
            "qwen3_5_moe_text",
            "qwen3_5:Qwen3_5ForCausalLM",
            vision=False,
            positions="text",
            experts=True,
            expert_storage="per_expert",
            linear_attention=True,
            gated_attention=True,
            ignored_prefixes=_MTP,
        ),
    )
}
TINY_FAMILIES = sorted(name for name, f in FAMILIES.items() if f.tiny is not None)


def family(config: Any) -> Family:
    """The record of a transformers config, a config.json dict, a snapshot directory or a model_type."""
    if isinstance(config, (str, Path)) and Path(config, "config.json").is_file():
        config = json.loads(Path(config, "config.json").read_text())
    if isinstance(config, str):
        model_type = config
    elif isinstance(config, dict):
        model_type = config.get("model_type")
    else:
        model_type = getattr(config, "model_type", None)
    if model_type not in FAMILIES:
        raise ValueError(f"unknown model_type {model_type!r}; supported: {sorted(FAMILIES)}")
    return FAMILIES[model_type]


def family_of_repo(repo_id: str) -> Family | None:
    """A Hub model's family guessed from its name, for checks made before its config.json is here:
    Qwen3.5 (Gated DeltaNet layers), Qwen3-VL, Qwen3; MoE releases name their active size
    (Qwen3-VL-30B-A3B, Qwen3.5-397B-A17B). None for other names."""
    name = repo_id.lower()
    moe = re.search(r"-a\d+(\.\d+)?b\b", name) is not None
    for base, spelling in (("qwen3_5", "qwen3.5"), ("qwen3_vl", "qwen3-vl"), ("qwen3", "qwen3")):
        if base in name or spelling in name:
            return FAMILIES[f"{base}_moe" if moe else base]
    return None
