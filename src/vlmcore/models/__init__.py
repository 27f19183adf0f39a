"""Native PyTorch Qwen3, Qwen3-VL and Qwen3.5 models (and their mixture-of-experts variants) that read and write HF snapshots.

    model = build_model(path)              # on the meta device, no memory used
    ... parallelize ...
    model.to_empty(device="cuda"); load_hf_weights(model, path)   # or model.init_weights()

`from_pretrained` does all of it on one device. Plain `to_empty` unties a tied `lm_head` from the
embedding (FSDP2-sharded models keep the tie); `init_weights` and `load_hf_weights` tie it again.
"""

from pathlib import Path

import torch
from transformers import AutoConfig, PretrainedConfig

from vlmcore.families import family

from .hf import load_hf_weights, save_pretrained
from .layers import GridThw
from .linear_attention import set_gdn_kernel
from .parts import ModelOutput
from .qwen3 import text_position_ids
from .qwen3_vl import mrope_position_ids

__all__ = [
    "ModelOutput",
    "build_model",
    "from_pretrained",
    "load_hf_config",
    "load_hf_weights",
    "position_ids",
    "save_pretrained",
    "use_backends",
]


def load_hf_config(path: str | Path) -> PretrainedConfig:
    """The transformers config object of a snapshot directory (no remote code)."""
    if not (Path(path) / "config.json").exists():
        raise FileNotFoundError(f"{path}: no config.json")
    return AutoConfig.from_pretrained(path, trust_remote_code=False)


def build_model(path_or_config: str | Path | PretrainedConfig, device: torch.device | str = "meta") -> torch.nn.Module:
    """The model of a snapshot directory or config, without weights (meta device by default)."""
    config = path_or_config if isinstance(path_or_config, PretrainedConfig) else load_hf_config(path_or_config)
    cls = family(config).native_class()
    with torch.device(device):
        return cls(config)


def config_dtype(config: PretrainedConfig) -> torch.dtype:
    dtype = getattr(config, "dtype", None) or torch.float32
    return getattr(torch, dtype) if isinstance(dtype, str) else dtype


def from_pretrained(
    path: str | Path, dtype: torch.dtype | None = None, device: torch.device | str | None = None
) -> torch.nn.Module:
    """Build and load a snapshot directory; dtype defaults to the config's, device to CPU."""
    model = build_model(path, device="meta")
    model.to(dtype or config_dtype(model.config))
    model.to_empty(device=device or "cpu")
    load_hf_weights(model, path)  # ties a tied lm_head again
    return model


def position_ids(
    config: PretrainedConfig,
    input_ids: torch.Tensor,
    image_grid_thw: GridThw | None = None,
    cu_seqlens: torch.Tensor | None = None,
    video_grid_thw: GridThw | None = None,
) -> torch.Tensor:
    """The positions the model computes when given none: (B, S) for text models, (3, B, S) for M-RoPE."""
    if family(config).positions == "text":
        return text_position_ids(input_ids, cu_seqlens)
    return mrope_position_ids(config, input_ids, image_grid_thw, cu_seqlens, video_grid_thw)


def use_backends(backends: dict) -> None:
    """Makes the model code use the GPU kernels `vlmcore.kernels.check` chose for this run."""
    if backends.get("linear_attention") == "torch":
        set_gdn_kernel(None)
