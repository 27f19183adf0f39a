"""Training checkpoint -> Hugging Face directory (`vlmcore export`).

A stage's `final/` is a torch.distributed.checkpoint directory of full logical tensors under
`model.<hf name>`, whatever dp/tp layout wrote it, so one process reads it without a process
group. The export writes those tensors as safetensors shards (+ index) in the dtype of the
snapshot's own weights, copies every other file of the snapshot (config, generation config,
tokenizer, chat template, processor configs) and records where it all came from in
`provenance.json`.

The directory is assembled under a hidden temporary name next to `--out` and renamed into place
last, so a crashed export never leaves a directory that looks complete; the next export removes
what a killed one left.
"""

import argparse
import json
import os
import shutil
import time
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
import yaml
from huggingface_hub import save_torch_state_dict
from safetensors import safe_open
from safetensors.torch import save_file

import vlmcore
from vlmcore.data.pack.format import PACK_MODEL_DIR
from vlmcore.download import remove_path
from vlmcore.families import family
from vlmcore.hashing import sha256_of, sha256_of_digests
from vlmcore.models.expert_storage import stored_format, to_disk
from vlmcore.models.hf import snapshot_tensor_info
from vlmcore.models.lora import peft_state_dict
from vlmcore.provenance import git_commit

PROVENANCE = "provenance.json"
# Snapshot files that describe the source weights, not the exported ones.
NOT_COPIED_SUFFIXES = (".safetensors", ".safetensors.index.json", ".bin", ".pt", ".pth", ".bin.index.json")
NOT_COPIED_NAMES = {"manifest.json"}
VIDEO_PROCESSOR_CONFIG = "video_preprocessor_config.json"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ExportError(ValueError):
    """A checkpoint, snapshot or provenance input that cannot be exported together, found before
    anything is written: `vlmcore export` prints it as one line naming the file (exit code 2)."""


def load_final_state_dict(checkpoint_dir: str | Path, model_dir: str | Path | None = None) -> dict[str, torch.Tensor]:
    """The weights of a `final/` DCP checkpoint as {hf name: tensor}, in one process.

    With `model_dir`, MoE experts are written in the storage format of the snapshot's own weights,
    and the names and shapes are checked against the snapshot's safetensors; a `lm_head.weight`
    the snapshot leaves out (tied embeddings) is dropped.
    """
    checkpoint_dir = Path(checkpoint_dir)
    if not (checkpoint_dir / ".metadata").is_file():
        raise ExportError(f"{checkpoint_dir}: not a torch.distributed.checkpoint directory (no .metadata)")
    metadata = dcp.FileSystemReader(str(checkpoint_dir)).read_metadata()
    state = {}
    for key, item in metadata.state_dict_metadata.items():
        if not key.startswith("model."):
            continue
        if not hasattr(item, "size"):
            raise ExportError(f"{checkpoint_dir}: entry {key} is not a tensor")
        state[key] = torch.empty(item.size, dtype=item.properties.dtype)
    if not state:
        raise ExportError(f"{checkpoint_dir}: no `model.*` tensors in the checkpoint")
    dcp.load(state, checkpoint_id=str(checkpoint_dir), no_dist=True)
    weights = {key.removeprefix("model."): tensor for key, tensor in state.items()}
    if model_dir is not None:
        model_type = json.loads((Path(model_dir) / "config.json").read_text()).get("model_type")
        snapshot = snapshot_tensor_info(model_dir)
        weights = to_disk(weights, model_type, stored_format(model_type, weights, snapshot))
        check_against_snapshot(weights, snapshot, family(model_dir).ignored_prefixes, checkpoint_dir, model_dir)
    return weights


def check_against_snapshot(
    weights: dict[str, torch.Tensor],
    expected: dict[str, tuple],
    untrained: tuple[str, ...],
    checkpoint_dir: str | Path,
    model_dir: str | Path,
) -> None:
    """Drops a tied `lm_head.weight` and raises if names or shapes differ from the snapshot
    (tensors under the `untrained` prefixes may be absent from the checkpoint)."""
    if "lm_head.weight" in weights and "lm_head.weight" not in expected:
        del weights["lm_head.weight"]
    missing = sorted(k for k in set(expected) - set(weights) if not k.startswith(untrained))
    unexpected = sorted(set(weights) - set(expected))
    wrong_shape = [
        f"{k}: {tuple(weights[k].shape)} vs {expected[k][0]}"
        for k in sorted(set(weights) & set(expected))
        if tuple(weights[k].shape) != expected[k][0]
    ]
    if missing or unexpected or wrong_shape:
        raise ExportError(
            f"checkpoint {checkpoint_dir} does not match snapshot {model_dir}: "
            f"{len(missing)} missing {missing[:5]}, {len(unexpected)} unexpected {unexpected[:5]}, "
            f"{len(wrong_shape)} of another shape {wrong_shape[:5]}"
        )


def snapshot_tensors(model_dir: Path) -> dict[str, tuple]:
    """The snapshot's tensors (name -> shape, dtype, file), checked to be an HF snapshot that
    vlmcore reads: a config.json of a known family and safetensors weights."""
    if not (model_dir / "config.json").is_file():
        raise ExportError(f"--model {model_dir}: no config.json; not an HF snapshot")
    try:
        family(model_dir)
    except ValueError as error:
        raise ExportError(f"--model {model_dir}: {error}") from None
    try:
        return snapshot_tensor_info(model_dir)
    except FileNotFoundError as error:
        raise ExportError(f"--model {error}") from None


def untrained_tensors(model_dir: str | Path, names: Collection[str]) -> dict[str, torch.Tensor]:
    """The snapshot's own tensors `names` (carried over unchanged)."""
    out = {}
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            out.update({name: f.get_tensor(name) for name in f.keys() if name in names})  # noqa: SIM118 (a safetensors safe_open is not iterable: keys() lists its tensors)
    return out


def data_fingerprint(stats_paths: Iterable[str | Path]) -> dict:
    """Per packed dataset: the sha256 of its stats.json plus its scalar figures; one combined hash."""
    datasets = {}
    for path in map(Path, stats_paths):
        if not path.is_file():
            raise ExportError(f"--data-stats {path}: no such file")
        stats = json.loads(path.read_text())
        scalars = {k: v for k, v in stats.items() if isinstance(v, (str, int, float, bool))}
        datasets[path.parent.name] = {"path": str(path), "sha256": sha256_of(path), **scalars}
    combined = sha256_of_digests(d["sha256"] for _, d in sorted(datasets.items()))
    return {"fingerprint": combined if datasets else None, "datasets": datasets}


def build_provenance(
    checkpoint_dir: str | Path,
    model_dir: str | Path,
    stage_configs: Iterable[str | Path] = (),
    data_stats: Iterable[str | Path] = (),
    dtype: torch.dtype | None = None,
) -> dict:
    checkpoint_dir = Path(checkpoint_dir)
    model_dir = Path(model_dir)
    manifest_path = model_dir / "manifest.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.is_file() else {}
    source = {"repo_id": manifest.get("repo_id"), "revision": manifest.get("revision"), "path": str(model_dir)}
    meta_path = checkpoint_dir / "meta.json"
    stages = {}
    for path in map(Path, stage_configs):
        if not path.is_file():
            raise ExportError(f"--stage-config {path}: no such file")
        stages[path.parent.name] = yaml.safe_load(path.read_text())
    return {
        "source": source,
        "checkpoint": {
            "path": str(checkpoint_dir),
            "meta": json.loads(meta_path.read_text()) if meta_path.is_file() else None,
        },
        "stages": stages,
        "data": data_fingerprint(data_stats),
        "code": {"vlmcore_version": vlmcore.__version__, **git_commit()},
        "dtype": str(dtype).removeprefix("torch.") if dtype else "as snapshot",
        "exported_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def export_hf(
    checkpoint_dir: str | Path,
    model_dir: str | Path,
    out: str | Path,
    stage_configs: Iterable[str | Path] = (),
    data_stats: Iterable[str | Path] = (),
    max_shard_size: int | str = "5GB",
    dtype: torch.dtype | None = None,
    packed_dir: str | Path | None = None,
) -> Path:
    """Writes the HF directory `out` from a `final/` checkpoint and the snapshot it was trained from.

    packed_dir: the last stage's packed dataset; the video processor config of its model/ (the
    sampling the clips were packed with, `pack.video`) replaces the snapshot's, so the export
    samples clips as training did.

    dtype: None keeps each tensor's dtype from the snapshot (a bf16 release stays bf16 although
    training kept fp32 master weights); a torch dtype casts every floating tensor to it and
    becomes config.json's `dtype`. Snapshot tensors the native model does not train (Qwen3.5's
    MTP head) are copied unchanged and listed in provenance.json under `copied_from_snapshot`.
    """
    model_dir = Path(model_dir)
    out = Path(out)
    expected = snapshot_tensors(model_dir)
    weights = load_final_state_dict(checkpoint_dir, model_dir)
    carried = untrained_tensors(model_dir, set(expected) - set(weights))
    weights.update(carried)
    for name, tensor in weights.items():
        target = dtype if dtype is not None and tensor.is_floating_point() else expected[name][1]
        weights[name] = tensor.to(target)
    provenance = build_provenance(checkpoint_dir, model_dir, stage_configs, data_stats, dtype)
    provenance["copied_from_snapshot"] = sorted(carried)

    for stale in out.parent.glob(f".{out.name}.tmp-*"):  # left by a killed export
        shutil.rmtree(stale, ignore_errors=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    tmp.mkdir(parents=True)
    try:
        save_torch_state_dict(weights, tmp, max_shard_size=max_shard_size)
        for src in sorted(model_dir.iterdir()):
            if src.is_file() and src.name not in NOT_COPIED_NAMES and not src.name.endswith(NOT_COPIED_SUFFIXES):
                shutil.copy2(src, tmp / src.name)
        packed_video_config = Path(packed_dir or "", PACK_MODEL_DIR, VIDEO_PROCESSOR_CONFIG)
        if packed_dir is not None and packed_video_config.is_file():
            shutil.copy2(packed_video_config, tmp / VIDEO_PROCESSOR_CONFIG)
        if dtype is not None:
            config = json.loads((tmp / "config.json").read_text())
            config["dtype"] = str(dtype).removeprefix("torch.")
            (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        (tmp / PROVENANCE).write_text(json.dumps(provenance, indent=2) + "\n")
        remove_path(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def read_adapters(checkpoint_dir: str | Path) -> dict[str, torch.Tensor]:
    """The LoRA adapters of a LoRA stage's `final/` (`adapters.<name>`), in one process."""
    metadata = dcp.FileSystemReader(str(checkpoint_dir)).read_metadata()
    state = {
        key: torch.empty(item.size, dtype=item.properties.dtype)
        for key, item in metadata.state_dict_metadata.items()
        if key.startswith("adapters.")
    }
    if not state:
        raise ExportError(
            f"{checkpoint_dir}: no LoRA adapters (`adapters.*`): not the final/ of a stage with lora.rank > 0"
        )
    dcp.load(state, checkpoint_id=str(checkpoint_dir), no_dist=True)
    return {key.removeprefix("adapters."): tensor for key, tensor in state.items()}


@dataclass
class PeftAdapter:
    """A peft adapter directory's contents: adapter_config.json and adapter_model.safetensors."""

    config: dict
    tensors: dict[str, torch.Tensor]

    def write(self, out: str | Path) -> Path:
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        save_file(self.tensors, out / "adapter_model.safetensors", metadata={"format": "pt"})
        (out / "adapter_config.json").write_text(json.dumps(self.config, indent=2) + "\n")
        return out


def peft_adapter(checkpoint_dir: str | Path, model_dir: str | Path, base: str | Path | None = None) -> PeftAdapter:
    """The peft adapter of a LoRA stage's `final/`, which `peft.PeftModel.from_pretrained` loads
    onto the transformers model of the weights the stage's adapters were trained on: `model_dir`'s
    snapshot, or for a stage that started from an earlier one (`init_from`) that stage's export,
    `base` (its provenance.json names the checkpoint init_from names). The linear layers' adapters
    are its `target_modules`, the experts' its `target_parameters`; the rank, alpha and dropout
    come from the stage's config in final/meta.json. Raises ExportError before anything is written."""
    checkpoint_dir = Path(checkpoint_dir)
    adapters = read_adapters(checkpoint_dir)
    meta_path = checkpoint_dir / "meta.json"
    if not meta_path.is_file():
        raise ExportError(f"{checkpoint_dir}: no meta.json, which holds the stage's lora settings")
    stage_config = json.loads(meta_path.read_text())["stage_config"]
    lora = stage_config["lora"]
    linears = sorted({name.rpartition(".")[0] for name in adapters if name.endswith(".lora_A")})
    expert_weights = sorted({name.removesuffix("_lora_A") for name in adapters if name.endswith("_lora_A")})
    config = {
        "peft_type": "LORA",
        "base_model_name_or_path": str(adapter_base(checkpoint_dir, stage_config.get("init_from"), model_dir, base)),
        "r": lora["rank"],
        "lora_alpha": lora["alpha"],
        "lora_dropout": lora["dropout"],
        "target_modules": linears or None,
        "target_parameters": expert_weights or None,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
    }
    tensors = {name: tensor.contiguous() for name, tensor in peft_state_dict(adapters).items()}
    return PeftAdapter(config, tensors)


def adapter_base(
    checkpoint_dir: Path, init_from: str | None, model_dir: str | Path, base: str | Path | None
) -> str | Path:
    """The weights a LoRA stage's adapters were trained on: the snapshot `model_dir` for a stage
    that started from it; for one that started from an earlier stage's final/ (`init_from`), the
    export `base` of that checkpoint, checked by the checkpoint its provenance.json names."""
    if not init_from:
        if base is not None:
            raise ExportError(
                f"--peft-base: {checkpoint_dir} is of a stage that started from --model's weights (no init_from); "
                "its adapters' base is --model"
            )
        return model_dir
    if base is None:
        raise ExportError(
            f"--peft-base: {checkpoint_dir} is of a stage that started from {init_from} (init_from), not from "
            "--model's weights: give the export of that stage (its hf/<stage>), the base its adapters were trained on"
        )
    provenance_path = Path(base) / PROVENANCE
    if not provenance_path.is_file():
        raise ExportError(f"--peft-base: {base} has no {PROVENANCE}; not a `vlmcore export` directory")
    exported = json.loads(provenance_path.read_text())["checkpoint"]["path"]
    if exported != init_from and Path(exported).resolve() != Path(init_from).resolve():
        raise ExportError(
            f"--peft-base: {base} is the export of {exported}, but the stage started from {init_from} (init_from)"
        )
    return base


def export_peft_adapter(
    checkpoint_dir: str | Path, model_dir: str | Path, out: str | Path, base: str | Path | None = None
) -> Path:
    """Writes the peft adapter directory (`peft_adapter`) of a LoRA stage's `final/` to `out`."""
    return peft_adapter(checkpoint_dir, model_dir, base).write(out)


def shard_size(text: str) -> str:
    from huggingface_hub.serialization._base import parse_size_to_int

    try:
        ok = parse_size_to_int(text) > 0
    except ValueError:
        ok = False
    if not ok:
        raise argparse.ArgumentTypeError(f"must be a size such as 5GB or 500MB, got {text!r}")
    return text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from vlmcore.cli import existing_dir, existing_file

    parser.add_argument(
        "--checkpoint", required=True, type=existing_dir, help="a stage's final/ directory (DCP, keys model.<hf name>)"
    )
    parser.add_argument(
        "--model",
        required=True,
        type=existing_dir,
        help="the HF snapshot the training started from (config, tokenizer, processor)",
    )
    parser.add_argument("--out", required=True, help="HF directory to write (replaced atomically)")
    parser.add_argument(
        "--stage-config",
        action="append",
        default=[],
        type=existing_file,
        help="train/<stage>/config.yaml of every stage, recorded in provenance.json (repeatable)",
    )
    parser.add_argument(
        "--data-stats",
        action="append",
        default=[],
        type=existing_file,
        help="packed/<dataset>/stats.json of the training data, fingerprinted in provenance.json (repeatable)",
    )
    parser.add_argument(
        "--max-shard-size", default="5GB", type=shard_size, help="largest safetensors shard, e.g. 5GB or 500MB"
    )
    parser.add_argument(
        "--dtype", choices=sorted(DTYPES), help="cast floating weights to this dtype (default: the snapshot's)"
    )
    parser.add_argument(
        "--peft-adapter",
        metavar="DIR",
        help="a LoRA stage: also write its adapters as a peft adapter directory to DIR (--out gets the merged "
        "model; DIR may be inside it)",
    )
    parser.add_argument(
        "--peft-base",
        metavar="DIR",
        help="with --peft-adapter, for a stage that started from an earlier stage (init_from): that stage's "
        "export, the base the adapters were trained on, named as the adapter's base_model_name_or_path "
        "(default: --model, the base of a stage that started from the snapshot)",
    )
    parser.add_argument(
        "--packed-data",
        type=existing_dir,
        help="packed/<dataset> of the last stage: the video sampling it was packed with goes into the export",
    )


def run(args: argparse.Namespace) -> int:
    from vlmcore.cli import UsageError

    if args.peft_base and not args.peft_adapter:
        raise UsageError("--peft-base: only with --peft-adapter")
    dtype = DTYPES[args.dtype] if args.dtype else None
    try:
        # The adapter is read and checked first, so that a stage without LoRA or a wrong base is refused
        # before the merged model is written; it is written after it: --out is replaced as a whole, and the
        # adapter directory may be inside it (the workflow's hf/<stage>/peft_adapter).
        adapter = peft_adapter(args.checkpoint, args.model, args.peft_base) if args.peft_adapter else None
        out = export_hf(
            args.checkpoint,
            args.model,
            args.out,
            args.stage_config,
            args.data_stats,
            args.max_shard_size,
            dtype,
            args.packed_data,
        )
    except ExportError as error:
        raise UsageError(str(error)) from error
    files = sorted(p.name for p in out.iterdir())
    print(f"exported {args.checkpoint} -> {out}: {', '.join(files)}")
    if adapter is not None:
        written = adapter.write(args.peft_adapter)
        print(f"exported the LoRA adapters of {args.checkpoint} -> {written} (peft adapter directory)")
    return 0
