"""How each MoE family stores its experts in a snapshot (its storage format), and the conversion both ways.

In memory every family holds transformers 5's fused tensors, per MoE layer:
    mlp.experts.gate_up_proj (E, 2I, H)     rows [gate | up]
    mlp.experts.down_proj    (E, H, I)
On disk, one of three storage formats, what the released checkpoints (and transformers'
`save_pretrained`) use:
    per_expert        mlp.experts.{e}.gate_proj.weight (I, H), .up_proj.weight (I, H), .down_proj.weight (H, I)
                      (Qwen3-MoE; transformers' conversion "qwen2_moe")
    fused_transposed  mlp.experts.gate_up_proj (E, H, 2I), mlp.experts.down_proj (E, I, H)
                      (Qwen3-VL-MoE's released checkpoints; transformers' conversion "qwen3_vl_moe")
    fused             as in memory
                      (Qwen3.5-MoE's released checkpoints)
A sharded model reads only its own block of each expert tensor (`read_block`), so no rank ever
holds a whole layer's experts. A snapshot's format is read off its tensors (`stored_format`) and
an export writes back the one its source snapshot used. Each family's released format is its
record's `expert_storage` (vlmcore.families).

Qwen3-VL-MoE snapshots come in both fused formats, under the same names:
  - released checkpoints store them transposed: Qwen/Qwen3-VL-30B-A3B-Instruct has, per layer,
    `model.language_model.layers.{i}.mlp.experts.gate_up_proj` (128, 2048, 1536) = (E, H, 2I) and
    `.down_proj` (128, 768, 2048) = (E, I, H), H 2048, I 768: the format of transformers <= 4.57's
    Qwen3VLMoeTextExperts (ByteDance-Seed/VeOmni docs/transformers_v5/transformers_v5_moe_weight_loading.md,
    "qwen3_vl_moe ... [num_experts, H, 2 * I] / [num_experts, I, H]"; public reads of the
    safetensors headers give the same shapes).
  - transformers 5 loads them with conversion_mapping.py's "qwen3_vl_moe":
    `Transpose(1, 2, check_dims=True)`, which transposes only a tensor whose shape differs from the
    parameter's. On save its reverse compares the in-memory tensor with the parameter, so it never
    transposes: transformers 5's `save_pretrained` writes qwen3_vl_moe experts fused as in memory
    (checked in tests/models/test_models_qwen3_vl_moe.py).
  So for the fused families the shapes decide (the family's format first): never ambiguous, as
  gate_up is square only when 2I = H and down only when I = H.

Qwen3.5-MoE snapshots come in two formats, told apart by the tensor names:
  - released checkpoints store the language model's experts fused as in memory, no `.weight`
    suffix: `model.language_model.layers.{i}.mlp.experts.gate_up_proj` (E, 2I, H) and `.down_proj`
    (E, H, I); Qwen/Qwen3.5-35B-A3B (256, 1024, 2048) and (256, 2048, 512) (its
    model.safetensors.index.json as checked in sgl-project/sglang-jax issue 1251, shapes in
    paiml/realizar issue 134), Qwen/Qwen3.5-397B-A17B gate_up_proj (512, 2048, 4096)
    (THUDM/slime PR 1799); vLLM's qwen3_5_moe.py loader splits `gate_up_proj` on dim -2. Only
    the unused MTP head (`mtp.*`) of Qwen3.5 keeps per-expert tensors (ISEEKYAN/mbridge PR 145).
  - transformers 5 has no conversion for "qwen3_5_moe", but the text model inside it
    ("qwen3_5_moe_text") gets qwen2_moe's per-expert merge (conversion_mapping.py), scoped to
    `model.language_model`: it loads both formats, and its `save_pretrained` writes per-expert
    tensors for both Qwen3_5MoeForConditionalGeneration and Qwen3_5MoeForCausalLM (checked with
    transformers 5 in tests/models/test_models_qwen3_5_moe.py).
Without a source snapshot, Qwen3.5-MoE writes the released (fused) format and its text-only
variant what transformers writes (per expert).
"""

import re
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from safetensors import safe_open

from vlmcore.families import FAMILIES

_FUSED = re.compile(r"(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")


def format_of(model_type: str) -> str:
    """The family's released storage format (plain fused for a family without experts)."""
    return FAMILIES[model_type].expert_storage if model_type in FAMILIES else "fused"


def is_expert_tensor(name: str) -> bool:
    return _FUSED.match(name) is not None


def stored_format(
    model_type: str,
    model_tensors: Mapping[str, torch.Tensor],
    snapshot: Mapping[str, tuple] | None = None,
) -> str:
    """The storage format of the experts of a `model_type` model (in-memory name -> tensor) in a
    snapshot (disk name -> (shape, ...)): per expert where the snapshot has the first expert
    tensor's per-expert modules; where it has the in-memory names, the fused format (the family's,
    else plain fused) whose shapes every expert tensor matches (a per-expert family: plain fused);
    else, and without a snapshot, the family's."""
    family = format_of(model_type)
    experts = {n: tuple(t.shape) for n, t in model_tensors.items() if is_expert_tensor(n)}
    if not experts or snapshot is None:
        return family
    first = next(iter(experts))
    if first in snapshot:
        if family == "per_expert":
            return "fused"
        for storage in dict.fromkeys((family, "fused")):
            if all(
                n in snapshot and tuple(snapshot[n][0]) == shape
                for name, memory_shape in experts.items()
                for n, shape in disk_tensors(name, memory_shape, storage).items()
            ):
                return storage
        return family
    if f"{_FUSED.match(first).group(1)}.0.down_proj.weight" in snapshot:
        return "per_expert"
    return family


def disk_tensors(name: str, shape: Sequence[int], storage: str) -> dict[str, tuple[int, ...]]:
    """The disk tensors (name -> shape) that hold the fused in-memory tensor `name` of `shape`."""
    prefix, kind = _FUSED.match(name).groups()
    experts, rows, cols = shape
    if storage == "fused":
        return {name: tuple(shape)}
    if storage == "fused_transposed":
        return {name: (experts, cols, rows)}
    if kind == "gate_up_proj":
        return {
            f"{prefix}.{e}.{proj}.weight": (rows // 2, cols)
            for e in range(experts)
            for proj in ("gate_proj", "up_proj")
        }
    return {f"{prefix}.{e}.down_proj.weight": (rows, cols) for e in range(experts)}


def to_disk(weights: dict[str, torch.Tensor], model_type: str, storage: str | None = None) -> dict[str, torch.Tensor]:
    """Whole in-memory tensors -> the `storage` format on disk (by default the family's), for export."""
    storage = storage or format_of(model_type)
    if storage == "fused":
        return weights
    out = {}
    for name, tensor in weights.items():
        match = _FUSED.match(name)
        if match is None:
            out[name] = tensor
        elif storage == "fused_transposed":
            out[name] = tensor.transpose(1, 2).contiguous()
        else:
            prefix, kind = match.groups()
            for e, expert in enumerate(tensor):
                if kind == "gate_up_proj":
                    gate, up = expert.chunk(2)
                    out[f"{prefix}.{e}.gate_proj.weight"] = gate.clone()
                    out[f"{prefix}.{e}.up_proj.weight"] = up.clone()
                else:
                    out[f"{prefix}.{e}.down_proj.weight"] = expert.clone()
    return out


def read_block(
    files: Mapping[str, Path],
    name: str,
    shape: Sequence[int],
    storage: str,
    offset: Sequence[int],
    size: Sequence[int],
) -> torch.Tensor:
    """The block [offset, offset + size) of the in-memory tensor `name` (global `shape`), read
    from the `storage` format on disk. `files`: disk tensor name -> safetensors file."""
    e0, r0, c0 = offset
    ne, nr, nc = size
    prefix, kind = _FUSED.match(name).groups()

    def get(key: str, *slices: slice) -> torch.Tensor:
        with safe_open(files[key], framework="pt") as f:
            return f.get_slice(key)[slices]

    if storage == "fused":
        return get(name, slice(e0, e0 + ne), slice(r0, r0 + nr), slice(c0, c0 + nc))
    if storage == "fused_transposed":
        return get(name, slice(e0, e0 + ne), slice(c0, c0 + nc), slice(r0, r0 + nr)).transpose(1, 2)
    experts = []
    for e in range(e0, e0 + ne):
        if kind == "down_proj":
            experts.append(get(f"{prefix}.{e}.down_proj.weight", slice(r0, r0 + nr), slice(c0, c0 + nc)))
            continue
        half = shape[1] // 2  # rows [gate | up]
        parts = []
        for proj, start, stop in (("gate_proj", 0, half), ("up_proj", half, 2 * half)):
            lo, hi = max(r0, start), min(r0 + nr, stop)
            if lo < hi:
                parts.append(get(f"{prefix}.{e}.{proj}.weight", slice(lo - start, hi - start), slice(c0, c0 + nc)))
        experts.append(torch.cat(parts))
    return torch.stack(experts) if experts else torch.empty(size)
