"""`vlmcore stage-benchmark`: a public benchmark's data, staged for evaluation on offline nodes.

Compute nodes have no internet, so the workflow stages each benchmark that `eval.tasks` names on
the login node (rule `download_benchmark`) into results/<experiment>/benchmarks/<name>/: the files
of its Hugging Face dataset repository as they are (the parquet or json files of the configs and
split the benchmark reads, and its media archives), pinned to one commit, with a `manifest.json`
(repository, commit, configs, split, size and sha256 of every file) written last. Evaluation
checks the copy against its manifest before it loads the model (`check_staged`).

Files come into a Hugging Face cache shared by the benchmarks (`--cache-dir`), and the staged
directory links to them: Video-MME with and without subtitles reads the same videos once. A copy
staged elsewhere (MareNostrum 5's login nodes have no internet) is verified and linked with
`--staged`, as `vlmcore download --staged` does for weights.
"""

import argparse
import fnmatch
import json
import os
import shutil
from pathlib import Path

import yaml

from vlmcore.download import MANIFEST, file_problems, remove_path, snapshot_files, write_manifest
from vlmcore.eval.benchmarks.registry import BENCHMARKS, Benchmark

# What stages a benchmark, named in every error about missing or damaged staged data.
STAGING_RULE = "download_benchmark"


class StagingError(ValueError):
    """A staged copy that is absent, damaged or of another benchmark, or a repository that does not
    hold what the registry names: `vlmcore stage-benchmark` prints it as one line (exit code 2)."""


def benchmark_record(name: str) -> Benchmark:
    if name not in BENCHMARKS:
        raise ValueError(f"{name!r} is not a staged benchmark (known: {', '.join(BENCHMARKS)})")
    return BENCHMARKS[name]


def readme_configs(readme: str) -> list[dict]:
    """The `configs` list of a dataset card's YAML header (empty when it has none)."""
    if not readme.startswith("---"):
        return []
    header = readme.split("---", 2)[1]
    return yaml.safe_load(header).get("configs") or []


def split_paths(data_files: str | list | dict) -> dict[str, list[str]]:
    """A config's `data_files` in any of the dataset card's forms as {split: [path patterns]}; a
    bare path or list of paths is the train split."""
    if isinstance(data_files, str):
        return {"train": [data_files]}
    if isinstance(data_files, dict):
        return {split: [paths] if isinstance(paths, str) else list(paths) for split, paths in data_files.items()}
    splits = {}
    for entry in data_files:
        if isinstance(entry, str):
            splits.setdefault("train", []).append(entry)
            continue
        paths = entry["path"]
        splits.setdefault(entry["split"], []).extend([paths] if isinstance(paths, str) else paths)
    return splits


def data_patterns(benchmark: Benchmark, readme: str) -> list[str]:
    """The repository files of the benchmark's configs and split, as glob patterns, from the
    dataset card; raises StagingError naming a config or split the card does not have."""
    configs = {c["config_name"]: c for c in readme_configs(readme)}
    if not configs:
        # No configs in the card: the hub's default layout, data files named after their split.
        return [f"*{benchmark.split}*"]
    default = next((name for name, c in configs.items() if c.get("default")), None)
    wanted = benchmark.configs or (default or ("default" if "default" in configs else next(iter(configs))),)
    unknown = [name for name in wanted if name not in configs]
    if unknown:
        raise StagingError(
            f"{benchmark.name}: configs {unknown} are not in {benchmark.hf_repo} (it has {', '.join(configs)})"
        )
    patterns = []
    for name in wanted:
        splits = split_paths(configs[name].get("data_files", []))
        if benchmark.split not in splits:
            raise StagingError(
                f"{benchmark.name}: config {name!r} of {benchmark.hf_repo} has no split {benchmark.split!r} "
                f"(it has {', '.join(splits) or 'none'})"
            )
        patterns += splits[benchmark.split]
    return patterns


def link_files(source: Path, files: list[Path], out: Path) -> None:
    """`out` as a real directory of per-file links to `source`'s files (resolved: the hub cache's
    snapshot entries are links themselves), so that removing `out` never touches the files."""
    for rel in files:
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        (out / rel).symlink_to((source / rel).resolve())


def stage_snapshot(
    snapshot: str | Path, out: str | Path, benchmark: Benchmark, revision: str, patterns: list[str]
) -> dict:
    """Links the files of a downloaded repository snapshot that `patterns` select into `out` and
    writes its manifest; raises StagingError naming a pattern that selects nothing (the registry and
    the repository disagree)."""
    snapshot = Path(snapshot)
    out = Path(out)
    files = snapshot_files(snapshot)
    unmatched = [p for p in patterns if not any(fnmatch.fnmatch(str(rel), p) for rel in files)]
    if unmatched:
        raise StagingError(
            f"{benchmark.name}: no file of {benchmark.hf_repo}@{revision} matches {unmatched} "
            f"(vlmcore/eval/benchmarks/{benchmark.name}.py and the repository disagree)"
        )
    selected = [rel for rel in files if any(fnmatch.fnmatch(str(rel), p) for p in patterns)]
    tmp = out.with_name(out.name + ".tmp")
    remove_path(tmp)
    tmp.mkdir(parents=True)
    link_files(snapshot, selected, tmp)
    extra = {"benchmark": benchmark.name, "split": benchmark.split, "configs": list(benchmark.configs)}
    manifest = write_manifest(tmp, benchmark.hf_repo, revision, extra=extra | {"patterns": patterns})
    remove_path(out)
    os.replace(tmp, out)
    return manifest


def download_benchmark(
    name: str, out: str | Path, revision: str | None = None, cache_dir: str | Path | None = None
) -> dict:
    """Downloads benchmark `name`'s files at one commit (`revision`, default the registry's pinned
    revision, else the newest) into the hub cache `cache_dir` and stages them into `out`; the token
    comes from HF_TOKEN if set."""
    from huggingface_hub import HfApi, hf_hub_download, snapshot_download

    benchmark = benchmark_record(name)
    revision = revision or benchmark.revision
    commit = HfApi().dataset_info(benchmark.hf_repo, revision=revision).sha
    card = hf_hub_download(benchmark.hf_repo, "README.md", repo_type="dataset", revision=commit, cache_dir=cache_dir)
    patterns = ["README.md", *data_patterns(benchmark, Path(card).read_text()), *benchmark.media_files]
    snapshot = snapshot_download(
        benchmark.hf_repo, repo_type="dataset", revision=commit, allow_patterns=patterns, cache_dir=cache_dir
    )
    return stage_snapshot(snapshot, out, benchmark, commit, patterns)


def read_manifest(path: Path, name: str, how: str) -> dict:
    """A staged benchmark's manifest.json, checked to be one (a mapping with its `files`)."""
    try:
        manifest = json.loads(path.read_text())
    except ValueError as error:
        raise StagingError(f"benchmark {name}: {path} is not valid JSON ({error}); {how}") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        raise StagingError(f"benchmark {name}: {path} is not a staging manifest (no `files` mapping); {how}")
    return manifest


def verify_benchmark(directory: str | Path, name: str, checksums: bool = True) -> dict:
    """Checks a staged benchmark against its manifest; raises StagingError naming the benchmark,
    every problem, and what stages it."""
    directory = Path(directory)
    manifest_path = directory / MANIFEST
    how = (
        f"stage it on a node with internet: the `{STAGING_RULE}` rule of the workflow, "
        f"or `vlmcore stage-benchmark {name} --out {directory}`"
    )
    if not manifest_path.is_file():
        raise StagingError(f"benchmark {name}: no staged data at {directory} (no {MANIFEST}); {how}")
    manifest = read_manifest(manifest_path, name, how)
    problems = []
    if manifest.get("benchmark") != name:
        problems.append(f"{MANIFEST} is of benchmark {manifest.get('benchmark')!r}")
    problems += file_problems(directory, manifest, checksums)
    if problems:
        raise StagingError(
            f"benchmark {name}: the staged data at {directory} failed verification ({how}): " + "; ".join(problems)
        )
    return manifest


def use_staged_benchmark(staged: str | Path, out: str | Path, name: str) -> dict:
    """Verifies a copy staged elsewhere and links its files into `out` (no network needed)."""
    staged = Path(staged).resolve()
    manifest = verify_benchmark(staged, name)
    out = Path(out)
    remove_path(out)
    link_files(staged, [Path(rel) for rel in manifest["files"]], out)
    shutil.copyfile(staged / MANIFEST, out / MANIFEST)
    return manifest


def check_staged(tasks: list[str], benchmark_data: str | Path | None, checksums: bool = True) -> None:
    """Before evaluation loads a model: every public benchmark among `tasks` is staged under
    `benchmark_data`/<task> and matches its manifest (files and sizes, and with `checksums` their
    sha256); raises StagingError naming the task."""
    for task in tasks:
        if task not in BENCHMARKS:
            continue
        if benchmark_data is None:
            raise StagingError(
                f"task {task} reads staged data: give --benchmark-data DIR, the directory holding {task}/ "
                f"(staged by the `{STAGING_RULE}` rule or `vlmcore stage-benchmark {task} --out DIR/{task}`)"
            )
        verify_benchmark(Path(benchmark_data) / task, task, checksums=checksums)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from vlmcore.cli import existing_dir

    parser.add_argument("benchmark", choices=list(BENCHMARKS), help="benchmark name, as in eval.tasks")
    source = parser.add_mutually_exclusive_group()
    source.add_argument(
        "--staged", type=existing_dir, help="a copy staged elsewhere: verify it against its manifest.json and use it"
    )
    source.add_argument(
        "--verify", type=existing_dir, help="only verify an existing staged directory against its manifest"
    )
    parser.add_argument("--out", help="staged directory to write (results/<experiment>/benchmarks/<name>)")
    parser.add_argument(
        "--revision",
        help="commit or tag of the dataset repository (default: the registry's pinned one, else the newest commit)",
    )
    parser.add_argument(
        "--cache-dir", help="Hugging Face cache the files are downloaded into (default: the user's HF cache)"
    )


def run(args: argparse.Namespace) -> int:
    from vlmcore.cli import UsageError

    if not args.verify and not args.out:
        raise UsageError("--out is required unless --verify")
    try:
        if args.verify:
            manifest = verify_benchmark(args.verify, args.benchmark)
        elif args.staged:
            manifest = use_staged_benchmark(args.staged, args.out, args.benchmark)
        else:
            manifest = download_benchmark(args.benchmark, args.out, revision=args.revision, cache_dir=args.cache_dir)
    except StagingError as error:
        raise UsageError(str(error)) from error
    if args.verify:
        print(
            f"{args.verify}: {len(manifest['files'])} files match the manifest ({manifest['repo_id']}@{manifest['revision']})"
        )
        return 0
    print(
        f"{args.out}: {args.benchmark} from {manifest['repo_id']}@{manifest['revision']}, {len(manifest['files'])} files"
    )
    return 0
