"""Hugging Face snapshot IO, the one way in and out for training, export, tests and benchmarks:
weights are read with `load_hf_weights` (safetensors only, through torch.distributed.checkpoint, so
a sharded model reads only its own slices) and written with huggingface_hub's
`save_torch_state_dict` (here in `save_pretrained`, and in `vlmcore export`).

Parameter names are transformers' own (in-memory) names, so a snapshot's state dict maps 1:1 onto
the native models, except a tied `lm_head.weight`, which is not stored, and MoE experts, which
some families store per expert or transposed (models/expert_storage.py).
"""

import copy
import shutil
from collections.abc import Mapping
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from huggingface_hub import save_torch_state_dict
from safetensors import safe_open
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from transformers import GenerationConfig

from vlmcore.families import family

from .expert_storage import disk_tensors, is_expert_tensor, read_block, stored_format, to_disk
from .lora import is_adapter

# Files of a snapshot that belong to the tokenizer / processor and travel with the weights.
SIDE_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "preprocessor_config.json",
    "processor_config.json",
    "video_preprocessor_config.json",
    "generation_config.json",
)
SAFETENSORS_DTYPES = {
    "F32": "float32",
    "BF16": "bfloat16",
    "F16": "float16",
    "F64": "float64",
    "I64": "int64",
    "I32": "int32",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
}


def snapshot_tensor_info(path: str | Path) -> dict[str, tuple[tuple[int, ...], torch.dtype, Path]]:
    """name -> (shape, dtype, file) of every tensor in a snapshot's safetensors files (headers only)."""
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors weights (only safetensors weights are read)")
    info = {}
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (a safetensors safe_open is not iterable: keys() lists its tensors)
                tensor_slice = f.get_slice(name)
                dtype = getattr(torch, SAFETENSORS_DTYPES[tensor_slice.get_dtype()])
                info[name] = (tuple(tensor_slice.get_shape()), dtype, file)
    return info


def load_hf_weights(model: nn.Module, path: str | Path) -> None:
    """Copy a snapshot's tensors into `model` (materialized, possibly sharded with FSDP2 / TP / EP):
    each rank reads only the slices of its own shards, cast to the parameter's dtype.

    Fails, listing them, on missing, unexpected or mis-shaped tensors; tensors the family carries
    but the model does not use (the family's `ignored_prefixes`) are skipped. A tied `lm_head` is tied again.
    MoE experts stored in another format than the model's (models/expert_storage.py, recognised by
    the snapshot's tensor names) are read block by block from the safetensors files; everything
    else through DCP's HF reader."""
    path = Path(path)
    tied = model.config.tie_word_embeddings
    headers = snapshot_tensor_info(path)
    state = {n: t for n, t in get_model_state_dict(model).items() if not is_adapter(n)}  # LoRA's start fresh
    if tied:
        state.pop("lm_head.weight")  # stored once, as the input embedding
    storage = stored_format(model.config.model_type, state, headers)
    experts = {n: state.pop(n) for n in list(state) if storage != "fused" and is_expert_tensor(n)}
    expected = {n: tuple(t.shape) for n, t in state.items()}
    for name, tensor in experts.items():
        expected.update(disk_tensors(name, tensor.shape, storage))
    ignored = family(model.config).ignored_prefixes + model.dropped_prefixes
    names = {n for n in headers if not n.startswith(ignored) and not (tied and n == "lm_head.weight")}
    missing, unexpected = sorted(set(expected) - names), sorted(names - set(expected))
    if missing or unexpected:
        raise ValueError(
            f"{path}: weights do not match the {model.config.model_type} model: "
            f"missing {missing}, unexpected {unexpected}"
        )
    mismatched = [
        f"{n}: checkpoint {headers[n][0]} vs model {shape}"
        for n, shape in sorted(expected.items())
        if headers[n][0] != shape
    ]
    if mismatched:
        raise ValueError(f"{path}: tensors with the wrong shape: {mismatched}")
    if state:
        dcp.load(state, storage_reader=dcp.HuggingFaceStorageReader(str(path)), no_dist=not dist.is_initialized())
    files = {n: file for n, (_, _, file) in headers.items()}
    for name, tensor in experts.items():
        _read_expert_block(files, name, tensor, storage)
    set_model_state_dict(model, {**state, **experts}, options=StateDictOptions(strict=False))
    model.tie_weights()


def _read_expert_block(files: Mapping[str, Path], name: str, tensor: torch.Tensor, storage: str) -> None:
    """Fills this rank's block of the (possibly sharded) expert tensor from the snapshot."""
    if isinstance(tensor, DTensor):
        size, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
        local = tensor.to_local()
    else:
        size = tuple(tensor.shape)
        offset = (0,) * tensor.dim()
        local = tensor
    if local.numel():
        with torch.no_grad():
            local.copy_(read_block(files, name, tuple(tensor.shape), storage, offset, size))


def full_state_dict(model: nn.Module, state_dict: Mapping[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
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


def save_pretrained(
    model: nn.Module,
    path: str | Path,
    source_dir: str | Path | None = None,
    max_shard_size: int | str = "5GB",
    state_dict: Mapping[str, torch.Tensor] | None = None,
) -> None:
    """Write an HF directory: safetensors shards (+ index, replacing earlier ones), config.json,
    generation config and, from `source_dir`, the tokenizer, chat template and processor files;
    MoE experts in the storage format of `source_dir`'s weights, if it has any (models/expert_storage.py)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = full_state_dict(model, state_dict)
    # The experts are written in the storage format of the source snapshot's weights, if it has any.
    source = None
    if source_dir and any(Path(source_dir).glob("*.safetensors")):
        source = snapshot_tensor_info(source_dir)
    tensors = to_disk(tensors, model.config.model_type, stored_format(model.config.model_type, tensors, source))
    save_torch_state_dict(tensors, path, max_shard_size=max_shard_size)
    config = copy.deepcopy(model.config)
    config.dtype = next(t.dtype for t in tensors.values() if t.is_floating_point())
    config.save_pretrained(path)
    if source_dir is not None:
        for name in SIDE_FILES:
            if (Path(source_dir) / name).exists():
                shutil.copy2(Path(source_dir) / name, path / name)
    if not (path / "generation_config.json").exists():
        GenerationConfig.from_model_config(config).save_pretrained(path)
