"""Model snapshots: download at a pinned revision, verify a pre-staged copy, or build the demo model.

Every snapshot directory ends with a `manifest.json` (repo id, revision, and size + sha256 of
every file). It is written last, so a directory without one is an incomplete download, and the
same manifest lets a copy staged by hand (MareNostrum 5 login nodes have no internet) be verified
before anything trains on it.
"""

import argparse
import json
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from vlmcore.families import TINY_FAMILIES
from vlmcore.hashing import sha256_of
from vlmcore.tiny import tiny_build, tiny_vl_config

MANIFEST = "manifest.json"
# Files a snapshot needs besides the weights; tokenizer and processor files vary by model.
DEFAULT_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model", "*.tiktoken"]


def snapshot_files(directory: Path) -> list[Path]:
    return sorted(
        p.relative_to(directory)
        for p in directory.rglob("*")
        if p.is_file() and p.name != MANIFEST and ".cache" not in p.relative_to(directory).parts
    )


def remove_path(path: Path) -> None:
    """Removes what is at `path`, if anything: a directory tree, or a file or link."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def write_manifest(directory: str | Path, repo_id: str, revision: str, extra: dict | None = None) -> dict:
    """Writes `directory`/manifest.json: the source, `extra` fields, and size and sha256 of every file."""
    directory = Path(directory)
    files = {
        str(rel): {"size": (directory / rel).stat().st_size, "sha256": sha256_of(directory / rel)}
        for rel in snapshot_files(directory)
    }
    manifest = {
        "repo_id": repo_id,
        "revision": revision,
        **(extra or {}),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "files": files,
    }
    tmp = directory / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=2) + "\n")
    os.replace(tmp, directory / MANIFEST)
    return manifest


def file_problems(directory: Path, manifest: dict, checksums: bool = True) -> list[str]:
    """Every file of the manifest that is missing, of another size or (with `checksums`) of another
    sha256 in `directory`. The files are hashed in parallel threads: a benchmark's videos are
    hundreds of GB, and hashlib releases the GIL."""
    problems = []
    to_hash = []
    for rel, info in manifest["files"].items():
        path = directory / rel
        if not path.is_file():
            problems.append(f"missing file {rel}")
        elif path.stat().st_size != info["size"]:
            problems.append(f"{rel}: size {path.stat().st_size}, manifest says {info['size']}")
        elif checksums:
            to_hash.append(rel)
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        digests = pool.map(sha256_of, [directory / rel for rel in to_hash])
        for rel, digest in zip(to_hash, digests):
            if digest != manifest["files"][rel]["sha256"]:
                problems.append(f"{rel}: sha256 differs from the manifest")
    return problems


def verify_snapshot(directory: str | Path, revision: str | None = None, checksums: bool = True) -> dict:
    """Check a snapshot against its manifest; raise ValueError listing every problem."""
    directory = Path(directory)
    manifest_path = directory / MANIFEST
    if not manifest_path.is_file():
        raise ValueError(f"{directory}: no {MANIFEST}; the snapshot is incomplete or was not staged with one")
    manifest = json.loads(manifest_path.read_text())
    problems = []
    if revision and manifest.get("revision") != revision:
        problems.append(f"revision is {manifest.get('revision')!r}, the config pins {revision!r}")
    problems += file_problems(directory, manifest, checksums)
    if not any(rel.endswith(".safetensors") for rel in manifest["files"]):
        problems.append("no *.safetensors weights listed")
    if problems:
        raise ValueError(f"snapshot {directory} failed verification:\n  " + "\n  ".join(problems))
    return manifest


def download_snapshot(repo_id: str, revision: str, out: str | Path, allow_patterns: list[str] | None = None) -> dict:
    """`huggingface_hub.snapshot_download` into `out`; the token comes from HF_TOKEN if set."""
    from huggingface_hub import snapshot_download

    if not revision:
        raise ValueError(f"model.revision must pin a revision (commit hash or tag) for {repo_id}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / MANIFEST).unlink(missing_ok=True)
    snapshot_download(
        repo_id=repo_id, revision=revision, local_dir=out, allow_patterns=allow_patterns or DEFAULT_PATTERNS
    )
    if any(out.glob("*.bin")) and not any(out.glob("*.safetensors")):
        raise ValueError(f"{repo_id}@{revision} has no safetensors weights; vlmcore never loads pickle (*.bin)")
    return write_manifest(out, repo_id, revision)


def use_staged_snapshot(staged: str | Path, out: str | Path, revision: str | None = None) -> dict:
    """Verify a copied-in snapshot and link its files into `out` (no network needed).

    `out` is a real directory of per-file links plus its own copy of the manifest, so that
    Snakemake deleting or rerunning `out` never touches the staged copy.
    """
    staged = Path(staged).resolve()
    manifest = verify_snapshot(staged, revision=revision)
    out = Path(out)
    remove_path(out)
    for rel in manifest["files"]:
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        (out / rel).symlink_to(staged / rel)
    shutil.copyfile(staged / MANIFEST, out / MANIFEST)
    return manifest


def build_tiny_model(out: str | Path, seed: int = 0, overrides: dict | None = None, family: str = "qwen3_vl") -> dict:
    """Tokenizer + processor trained/written for the synthetic data, and a random Qwen3-VL
    (`family` qwen3_vl) or Qwen3-VL-MoE (qwen3_vl_moe).

    Written like any downloaded snapshot so that every later stage treats it as a real model.
    The random initialisation is transformers' own, so the demo starts where a user's
    from-scratch run would.
    """
    import torch
    import transformers

    from vlmcore.data.media.processor import write_processor_files
    from vlmcore.data.media.tokenizer import build_demo_tokenizer, special_token_ids
    from vlmcore.data.synthetic.image import corpus_texts

    build = tiny_build(family)
    out = Path(out)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tokenizer = build_demo_tokenizer(tmp, corpus_texts(seed))
    ids = special_token_ids(tokenizer)
    vocab_size = -(-len(tokenizer) // 64) * 64  # rounded up to a multiple of 64
    config_class = getattr(transformers, build.config_class)
    config = config_class(**tiny_vl_config(ids, vocab_size, family, **(overrides or {})))
    config.text_config.eos_token_id = ids["eos_token_id"]
    config.text_config.pad_token_id = ids["pad_token_id"]
    torch.manual_seed(seed)
    model = getattr(transformers, build.model_class)(config)
    model.generation_config.eos_token_id = [ids["eos_token_id"], ids["pad_token_id"]]
    model.generation_config.pad_token_id = ids["pad_token_id"]
    model.save_pretrained(tmp)
    write_processor_files(
        tmp,
        patch_size=config.vision_config.patch_size,
        merge_size=config.vision_config.spatial_merge_size,
        temporal_patch_size=config.vision_config.temporal_patch_size,
    )
    manifest = write_manifest(tmp, f"vlmcore/tiny-{family.replace('_', '-')}-demo", f"generated-seed{seed}")
    remove_path(out)
    os.replace(tmp, out)
    return manifest


def json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from vlmcore.cli import existing_dir, non_negative_int

    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--repo-id", help="Hugging Face repo id, downloaded at --revision")
    source.add_argument(
        "--staged",
        type=existing_dir,
        help="a snapshot copied in by hand: verify it against its manifest.json and use it",
    )
    source.add_argument("--tiny", action="store_true", help="build the tiny random demo model (no network)")
    source.add_argument(
        "--verify", type=existing_dir, help="only verify an existing snapshot directory against its manifest"
    )
    parser.add_argument("--revision", help="commit hash or tag to pin (required with --repo-id)")
    parser.add_argument("--out", help="snapshot directory to write")
    parser.add_argument(
        "--seed", type=non_negative_int, default=0, help="seed of the tiny model's weights and tokenizer corpus"
    )
    parser.add_argument(
        "--tiny-family",
        default="qwen3_vl",
        choices=TINY_FAMILIES,
        help="architecture of the tiny model: dense Qwen3-VL or Qwen3-VL-MoE (4 experts, top-2)",
    )
    parser.add_argument(
        "--tiny-config",
        default={},
        type=json_object,
        help='JSON overrides of the tiny model, e.g. \'{"text_config": {"num_hidden_layers": 2}}\'',
    )


def run(args: argparse.Namespace) -> int:
    if args.verify:
        manifest = verify_snapshot(args.verify, revision=args.revision)
        print(
            f"{args.verify}: {len(manifest['files'])} files match the manifest ({manifest['repo_id']}@{manifest['revision']})"
        )
        return 0
    from vlmcore.cli import UsageError

    if not args.out:
        raise UsageError("--out is required unless --verify")
    if args.repo_id and not args.revision:
        raise UsageError("--revision: required with --repo-id (a commit hash or tag)")
    if args.tiny:
        manifest = build_tiny_model(args.out, seed=args.seed, overrides=args.tiny_config, family=args.tiny_family)
    elif args.staged:
        manifest = use_staged_snapshot(args.staged, args.out, revision=args.revision)
    else:
        manifest = download_snapshot(args.repo_id, args.revision, args.out)
    print(f"{args.out}: {manifest['repo_id']}@{manifest['revision']}, {len(manifest['files'])} files")
    return 0
