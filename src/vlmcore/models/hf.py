"""Hugging Face snapshot IO: safetensors (single or sharded with an index) in and out.

Parameter names are transformers' own, so a snapshot's state dict maps 1:1 onto the native
models; the only special case is a tied `lm_head.weight`, which is not stored.
"""

import copy
import json
import shutil
from pathlib import Path

import torch
from huggingface_hub import split_torch_state_dict_into_shards
from safetensors import safe_open
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor, distribute_tensor
from transformers import GenerationConfig

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Files of a snapshot that belong to the tokenizer / processor and travel with the weights.
SIDE_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json",
    "preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json",
    "generation_config.json",
)
# Checkpoint tensors a family legitimately carries but the native model does not use
# (Qwen3.5's multi-token-prediction head).
IGNORED_PREFIXES = {"qwen3_5": ("mtp.",), "qwen3_5_text": ("mtp.",)}


def weight_files(path: Path) -> dict[str, Path]:
    """Name -> safetensors file holding it, from the index or the single file."""
    if (path / INDEX_FILE).exists():
        index = json.loads((path / INDEX_FILE).read_text())
        return {name: path / file for name, file in index["weight_map"].items()}
    if (path / SINGLE_FILE).exists():
        with safe_open(path / SINGLE_FILE, framework="pt") as f:
            return {name: path / SINGLE_FILE for name in f.keys()}
    raise FileNotFoundError(f"{path}: no {SINGLE_FILE} or {INDEX_FILE} (only safetensors weights are read)")


def expected_names(model) -> set[str]:
    names = set(model.state_dict())
    if model.config.tie_word_embeddings:
        names.discard("lm_head.weight")
    return names


def load_weights(model, path) -> None:
    """Copy a snapshot's tensors into `model` (materialized, possibly sharded with DTensor).

    Fails, listing them, on missing, unexpected or mis-shaped tensors. Tensors are cast to the
    parameter's dtype; DTensor parameters receive their own shard of the full tensor.
    """
    path = Path(path)
    files = weight_files(path)
    params = model.state_dict()
    expected = expected_names(model)
    ignored = IGNORED_PREFIXES.get(model.config.model_type, ())
    found = {n for n in files if not n.startswith(ignored)}
    if model.config.tie_word_embeddings:
        found.discard("lm_head.weight")
    missing, unexpected = sorted(expected - found), sorted(found - expected)
    if missing or unexpected:
        raise ValueError(f"{path}: weights do not match the {model.config.model_type} model: "
                         f"missing {missing}, unexpected {unexpected}")
    by_file: dict[Path, list[str]] = {}
    for name in sorted(expected):
        by_file.setdefault(files[name], []).append(name)
    mismatched = []
    with torch.no_grad():
        for file, names in by_file.items():
            with safe_open(file, framework="pt") as f:
                for name in names:
                    param = params[name]
                    shape = tuple(f.get_slice(name).get_shape())
                    if shape != tuple(param.shape):
                        mismatched.append(f"{name}: checkpoint {shape} vs model {tuple(param.shape)}")
                        continue
                    tensor = f.get_tensor(name).to(param.dtype)
                    if isinstance(param, DTensor):
                        tensor = distribute_tensor(tensor.to(param.device), param.device_mesh, param.placements)
                    param.copy_(tensor)
    if mismatched:
        raise ValueError(f"{path}: tensors with the wrong shape: {mismatched}")
    model.tie_weights()


def full_state_dict(model, state_dict=None) -> dict[str, torch.Tensor]:
    """CPU tensors to save; DTensors are gathered (a collective: every rank must call this)."""
    state_dict = model.state_dict() if state_dict is None else state_dict
    out = {}
    for name, tensor in state_dict.items():
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        if isinstance(tensor, DTensor):
            tensor = tensor.full_tensor()
        out[name] = tensor.detach().to("cpu").contiguous()
    return out


def save_pretrained(model, path, source_dir=None, max_shard_size="5GB", state_dict=None) -> None:
    """Write an HF directory: sharded safetensors (+ index), config.json, generation config and,
    from `source_dir`, the tokenizer, chat template and processor files."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = full_state_dict(model, state_dict)
    for old in [*path.glob("model*.safetensors"), path / INDEX_FILE]:
        old.unlink(missing_ok=True)
    split = split_torch_state_dict_into_shards(
        tensors, filename_pattern="model{suffix}.safetensors", max_shard_size=max_shard_size
    )
    for file, names in split.filename_to_tensors.items():
        save_file({n: tensors[n] for n in names}, path / file, metadata={"format": "pt"})
    if split.is_sharded:
        index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
                 "weight_map": split.tensor_to_filename}
        (path / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")

    config = copy.deepcopy(model.config)
    config.dtype = next(t.dtype for t in tensors.values() if t.is_floating_point())
    config.save_pretrained(path)
    if source_dir is not None:
        for name in SIDE_FILES:
            if (Path(source_dir) / name).exists():
                shutil.copy2(Path(source_dir) / name, path / name)
    if not (path / "generation_config.json").exists():
        GenerationConfig.from_model_config(config).save_pretrained(path)
