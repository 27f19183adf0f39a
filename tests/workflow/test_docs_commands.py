"""The commands the docs give run as written: each is checked by the rule of its program.

The commands are read from README.md and docs/*.md: the lines of shell code blocks (fenced
bash/sh/console/unlabelled ones and indented ones, whose first line is a command; `\\`
continuations, `&&` chains, comments and `$ ` prompts as the shell reads them) and the inline code
spans that start with `snakemake`, `vlmcore`, `python`, `bash` or `sbatch`; and the usage lines in
the comments of config/*.yaml, config/experiments/*.yaml and the profiles. Each command is checked
by the rule of its program (CHECKS), so a command added to the docs is picked up, and one whose
program no rule covers fails:

- `snakemake`: its words parse with Snakemake's own parser and name a target (`--configfile`, `-R`
  and `--until` take several values, so a target written after them is read as one more value),
  and it dry-runs (`-n`) in a copy of the checkout, the reader's placeholders replaced
  (PLACEHOLDERS). Left out: the commands of NOT_DRY_RUN, only parsed, and the options of
  LEFT_OUT_OF_DRY_RUN; the usage lines of the configs are only parsed (tests/slurm/test_slurm_profiles.py
  dry-runs every recipe);
- `vlmcore`, `python -m vlmcore.cli`, `torchrun ... -m vlmcore.cli`: the command exists and every
  flag it names is in its `--help`. Each command line then runs, those of RUN_HERE here and those
  of RUN_ON_DEMO beside the demo's run (tests/workflow/test_pipeline_demo.py, the placeholders replaced by
  the demo's paths: DEMO_PLACEHOLDERS), and writes or prints what the docs say; those of HELP_ONLY
  need a cluster, a GPU or a big model, for the reason given there. A span in a heading, or one in
  a sentence without the arguments its command requires (`vlmcore pack --workers 1`), names the
  command or an option of it and is only checked against `--help`; every other vlmcore command
  must be in one of the three;
- `python benchmarks/X.py`: the script exists and every flag is in its `--help`; `python -m M`:
  the module exists; `python -c CODE`: the code compiles;
- `bash SCRIPT`: the script exists and parses (`bash -n`);
- `pip`: not run, but the project's extras it names exist;
- the programs of NOT_RUN are not run, for the reason given there.

Every repository path a command names must exist.
"""

import argparse
import contextlib
import fnmatch
import functools
import importlib.util
import io
import json
import os
import re
import runpy
import shlex
import subprocess
import sys
import tempfile
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from helpers import CLUSTER_ENV, RUN_ON_DEMO

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
CONFIG_COMMENTS = [
    *sorted((REPO / "config").glob("*.yaml")),
    *sorted((REPO / "config" / "experiments").glob("*.yaml")),
    *sorted((REPO / "profiles").glob("*/config.yaml")),
]
# Inline code spans that are commands start with one of these.
INLINE_PROGRAMS = {"snakemake", "vlmcore", "python", "bash", "sbatch"}
SHELL_LANGUAGES = {"bash", "sh", "shell", "console", ""}

# Programs the test does not run, and why. Their repository paths are still checked.
NOT_RUN = {
    "python3.11": "builds a virtual environment (`-m venv`)",
    "git": "clones the project",
    "cd": "changes to a cluster's project directory",
    "module": "loads a cluster's software modules",
    "source": "activates a virtual environment",
    ".": "activates a virtual environment",
    "export": "sets a cluster's environment variables",
    "ln": "links a cluster's project storage",
    "rsync": "copies to a cluster",
    "tmux": "opens a terminal session on a login node",
    "squeue": "lists SLURM jobs: needs a cluster",
    "sbatch": "what the SLURM plugin submits; tests/slurm/test_slurm_fake.py checks those lines",
    "sudo": "starts a SLURM cluster as root; tests/slurm/test_slurm_real.py runs after it in CI",
    "tail": "follows a training run's log",
    "tensorboard": "serves a training run's metrics",
    "wandb": "uploads runs: needs the network and a key",
    "pytest": "runs tests (the test files named must exist)",
}

# Words the docs use for what the reader fills in, and what the dry run uses instead ({cluster}:
# the profile's). `snakemake ... TARGET` (the command of that section with another target) is
# dry-run on the demo.
PLACEHOLDERS = {
    "config/experiments/NAME.yaml": "config/experiments/qwen3vl-2b-jupiter.yaml",
    "config/experiments/<recipe>-{cluster}.yaml": "config/experiments/qwen3vl-8b-{cluster}.yaml",
    "<recipe>": "config/experiments/qwen3vl-8b-{cluster}.yaml",
    "--configfile ...": "--configfile config/experiments/qwen3vl-8b-{cluster}.yaml",
}

# Snakemake commands (by a word of theirs) that are parsed but not dry-run, and why.
NOT_DRY_RUN = {
    "corpus-100m.yaml": "the reader's own corpus file; tests/workflow/test_workflow_dag.py dry-runs this plan with one",
}

# Options (with their value) that a dry run leaves out, and why; the rest of the command is dry-run.
LEFT_OUT_OF_DRY_RUN = {
    "--report": "builds the HTML report of a finished run: needs the demo's outputs",
}

# ---- what the vlmcore commands of the docs write or print ----


def prints_each_help(workdir: Path, output: str):
    for subcommand in ("download", "synth", "prepare", "pack", "train", "export", "stage-benchmark", "eval", "report"):
        assert f"usage: vlmcore {subcommand} " in output, subcommand


def prints_kernel_report(workdir: Path, output: str):
    """The kernels' versions and the backend each part uses (docs/hpc.md section 2)."""
    for line in ("GPU: ", "torch: ", "attention: ", "linear_attention: "):
        assert line in output, output


def writes_tiny_moe_model(workdir: Path, output: str):
    """docs/moe.md section 6: a tiny Qwen3-VL-MoE, 4 experts, top-2, in every layer."""
    from vlmcore.download import verify_snapshot

    model = workdir / "results/demo-moe/model"
    verify_snapshot(model)
    config = json.loads((model / "config.json").read_text())
    text = config["text_config"]
    assert config["model_type"] == "qwen3_vl_moe"
    assert (text["num_local_experts"], text["num_experts_per_tok"]) == (4, 2)
    assert text["decoder_sparse_step"] == 1 and not text["mlp_only_layers"]


def write_preference_pairs(workdir: Path):
    """docs/post-training.md's input: raw/pairs.jsonl, three text preference pairs (a prompt, the
    chosen and the rejected answer) in the layouts the doc names."""
    raw = workdir / "raw"
    raw.mkdir()
    rows = [
        {"prompt": "What color is the sky?", "chosen": "Blue.", "rejected": "Green."},
        {
            "chosen": [{"role": "user", "content": "Two plus two?"}, {"role": "assistant", "content": "Four."}],
            "rejected": [{"role": "user", "content": "Two plus two?"}, {"role": "assistant", "content": "Five."}],
        },
        {
            "prompt": [{"role": "user", "content": "Name a shape."}],
            "chosen": [{"role": "assistant", "content": "A circle."}],
            "rejected": [{"role": "assistant", "content": "Red."}],
        },
    ]
    (raw / "pairs.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))


def prepares_preference_pairs(workdir: Path, output: str):
    """docs/post-training.md: the three pairs prepared, none rejected."""
    from vlmcore.data.shards import iter_shard_samples, shard_paths

    samples = [s for path in shard_paths(workdir / "data/pairs") for s in iter_shard_samples(path)]
    assert len(samples) == 3, samples


def write_prepared_pairs_and_model(workdir: Path):
    """docs/post-training.md's pack input: the prepared pairs and a tiny model with its tokenizer."""
    from helpers import make_demo_model_dir

    from vlmcore.data.prepare.dataset import prepare

    write_preference_pairs(workdir)
    prepare([workdir / "raw/pairs.jsonl"], workdir / "data/pairs")
    make_demo_model_dir(workdir / "model")


def packs_preference_pairs(workdir: Path, output: str):
    """docs/post-training.md: the three pairs packed whole (pack's stats.json counts them)."""
    stats = json.loads((workdir / "packed/pairs/stats.json").read_text())
    assert stats["pairs"] == 3, stats


# What a RUN_HERE command needs in its scratch folder before it runs: {command: setup}.
SETUP_HERE = {
    "vlmcore prepare --source preference:raw/pairs.jsonl --out data/pairs": write_preference_pairs,
    "vlmcore pack --data data/pairs --model model --out packed/pairs --seq-len 4096 --max-patches 16384": write_prepared_pairs_and_model,
}


# vlmcore commands that need nothing but the checkout: run here, in a scratch folder, as
# written: {command: what it writes or prints}.
RUN_HERE = {
    "vlmcore download|synth|prepare|pack|train|export|stage-benchmark|eval|report --help": prints_each_help,
    "vlmcore kernels --gpu-capability 9.0": prints_kernel_report,
    "vlmcore kernels": prints_kernel_report,
    "vlmcore download --tiny --tiny-family qwen3_vl_moe --out results/demo-moe/model": writes_tiny_moe_model,
    "vlmcore prepare --source preference:raw/pairs.jsonl --out data/pairs": prepares_preference_pairs,
    "vlmcore pack --data data/pairs --model model --out packed/pairs --seq-len 4096 --max-patches 16384": packs_preference_pairs,
}

# vlmcore commands checked only against their --help, and why they cannot run here.
HELP_ONLY = {
    "vlmcore generate --model results/demo/hf/stage2 --prompt What is in the picture? --image photo.png "
    "--max-new-tokens 32": (
        "a reader's image on the demo's export; tests/generate/test_generate_command.py runs the command on the "
        "tiny demo model with an image, a video and a stage's final/ weights"
    ),
    "vlmcore download --repo-id Qwen/Qwen3-VL-8B-Instruct --revision 0c351dd01ed87e9c1b53cbc748cba10e6187ff3b "
    "--out Qwen3-VL-8B-Instruct": "downloads the 8B model from the Hugging Face Hub: the network and 17 GB",
    "vlmcore download --verify staged/models/Qwen3-VL-8B-Instruct --revision 0c351dd01ed87e9c1b53cbc748cba10e6187ff3b": (
        "verifies a cluster's staged copy of the 8B model"
    ),
    "vlmcore eval --model results/demo/hf/stage2 --tasks mmmu_val,videomme --benchmark-data results/demo/benchmarks "
    "--out results/demo/eval-benchmarks": (
        "reads MMMU and Video-MME as staged from the Hugging Face hub (the network; Video-MME's videos are about "
        "100 GB); tests/eval/test_eval_benchmarks_e2e.py runs the same command on local data in their formats"
    ),
    "vlmcore stage-benchmark chartqa --out chartqa": (
        "downloads ChartQA from the Hugging Face hub (the network); tests/eval/test_eval_staging.py stages a local "
        "repository snapshot through the same code"
    ),
    "vlmcore stage-benchmark chartqa --verify results/<experiment>/benchmarks/chartqa": (
        "verifies a cluster's staged copy of ChartQA (tests/eval/test_eval_staging.py verifies local ones)"
    ),
    "vlmcore memory results/qwen3vl-8b-jupiter/train/stage2/stage_config.yaml --world-size 16": (
        "the 8B recipe's stage config, which the workflow writes on the cluster from the staged model"
    ),
}


# Inline spans that start like a command but quote a message or name a thing.
NOT_COMMANDS = [
    r"\S+ \S+: error: .*",  # an error message, e.g. `vlmcore pack: error: argument ...`
    r"(snakemake|vlmcore|sbatch|bash|python)",  # the program itself
    r"vlmcore <command>",  # any command
]


@dataclass(frozen=True)
class Command:
    where: str  # file:line
    text: str  # as written, one line
    words: tuple[str, ...]  # shell words, the leading VAR=value assignments left out
    place: str = (
        "block"  # "block": a line of a code block or a config's comment; "sentence" or "heading": an inline span
    )


def shell_words(line: str) -> list[list[str]]:
    """The commands of one shell line, comments left out: its words split at `&&`, `||`, `;` and
    `|` written as words of their own (a `|` inside a word is the docs' "one of")."""
    commands = [[]]
    for word in shlex.split(line, comments=True):
        if word in ("&&", "||", ";", "|"):
            commands.append([])
        else:
            commands[-1].append(word)
    return [drop_assignments(words) for words in commands if words]


def drop_assignments(words: list[str]) -> list[str]:
    start = 0
    while start < len(words) - 1 and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[start]):
        start += 1
    return words[start:]


def code_blocks(lines: list[str]) -> tuple[list[tuple[int, str, list[str]]], set[int]]:
    """The fenced and indented code blocks of a markdown file as (first line number, language,
    lines), and the numbers of all lines inside blocks (the inline spans are read elsewhere)."""
    blocks = []
    inside = set()
    fence = None
    previous = ""
    for number, line in enumerate(lines, 1):
        if fence is not None:
            if line.startswith("```"):
                fence = None
            else:
                blocks[-1][2].append(line)
            inside.add(number)
        elif line.startswith("```"):
            fence = line[3:].strip()
            blocks.append((number + 1, fence, []))
            inside.add(number)
        elif line.startswith("    ") and (not previous.strip() or number - 1 in inside) and line.strip():
            if number - 1 not in inside or blocks[-1][1] != "indented":
                blocks.append((number, "indented", []))
            blocks[-1][2].append(line[4:])
            inside.add(number)
        previous = line
    return blocks, inside


def logical_lines(block: list[str], first: int) -> list[tuple[int, str]]:
    """(line number, line) of a block's shell lines: `\\` continuations joined, `$ ` prompts taken off."""
    joined = []
    start = None
    pending = ""
    for offset, line in enumerate(block):
        if start is None:
            start = first + offset
        if line.endswith("\\"):
            pending += line[:-1]
            continue
        joined.append((start, (pending + line).strip()))
        pending = ""
        start = None
    return [(number, line.removeprefix("$ ")) for number, line in joined]


def doc_commands(path: Path) -> list[Command]:
    name = path.relative_to(REPO).as_posix()
    lines = path.read_text().splitlines()
    blocks, inside = code_blocks(lines)
    commands = []
    for first, language, block in blocks:
        shell = logical_lines(block, first)
        if language not in SHELL_LANGUAGES and language != "indented":
            continue
        if language in ("", "indented"):
            # An unlabelled or indented block is shell when its first line is a command, else
            # output, a file layout or pseudo-code.
            first_words = next((shell_words(line) for _, line in shell if line and not line.startswith("#")), [])
            if not first_words or first_words[0][0] not in {*CHECKS, *NOT_RUN}:
                continue
        for number, line in shell:
            if language == "console" and not block[number - first].startswith("$ "):
                continue  # a console block's output
            commands += [Command(f"{name}:{number}", line, tuple(w)) for w in shell_words(line)]
    # Inline spans, which may wrap to the next line.
    prose = "\n".join("" if number in inside else line for number, line in enumerate(lines, 1))
    for match in re.finditer(r"`([^`]+)`", prose):
        text = " ".join(match.group(1).split())
        words = drop_assignments(text.split())
        if words[0] not in INLINE_PROGRAMS or any(re.fullmatch(p, text) for p in NOT_COMMANDS):
            continue
        number = prose.count("\n", 0, match.start()) + 1
        place = "heading" if lines[number - 1].startswith("#") else "sentence"
        commands += [Command(f"{name}:{number}", text, tuple(w), place) for w in shell_words(text)]
    return commands


def config_comment_commands(path: Path) -> list[Command]:
    """The usage lines (`#   snakemake ...`) in a config's or profile's comments."""
    name = path.relative_to(REPO).as_posix()
    commands = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        text = line.removeprefix("#").strip()
        if line.startswith("#") and re.match(r"([A-Z_]+=\S+ )*snakemake ", text):
            text = text.split("  #")[0].strip()
            commands += [Command(f"{name}:{number}", text, tuple(w)) for w in shell_words(text)]
    return commands


# The GPU session script: a lent GPU has 15 minutes, so a wrong flag or value in one of its
# commands costs a session. Its shell variables take the values of a plain run.
SESSION_SCRIPT = REPO / "benchmarks" / "gpu_session.sh"
SESSION_VARIABLES = {
    '"$out/': '"results/',
    '"$out"': "results",
    '"$preset"': "2b",
    '"$family"': "qwen3_vl",
    '"${2:-lora}"': "lora",
    '"$recipe"': "none",
    "$flag": "",
}


def session_script_commands(path: Path) -> list[Command]:
    """The `python benchmarks/X.py` commands of the GPU session script, continuations joined,
    `exec` and the `part SECONDS NAME` prefix left out."""
    name = path.relative_to(REPO).as_posix()
    commands = []
    lines = path.read_text().splitlines()
    number = 0
    while number < len(lines):
        start = number
        text = lines[number].strip()
        while text.endswith("\\"):
            number += 1
            text = text[:-1] + lines[number].strip()
        number += 1
        text = re.sub(r"^(exec |part \d+ \S+ )", "", text)
        if not text.startswith("python benchmarks/"):
            continue
        for variable, value in SESSION_VARIABLES.items():
            text = text.replace(variable, value)
        commands += [Command(f"{name}:{start + 1}", text, tuple(w)) for w in shell_words(text)]
    return commands


def all_commands() -> list[Command]:
    commands = [c for path in DOCS for c in doc_commands(path)]
    commands += session_script_commands(SESSION_SCRIPT)
    return commands + [c for path in CONFIG_COMMENTS for c in config_comment_commands(path)]


# ---- the checks of each program ----


def check_repo_paths(command: Command):
    """A word that names a file of the repository (its first folder is one of the checkout's)
    names one that exists."""
    tops = {p.name for p in REPO.iterdir()} - {"results", "staged", ".snakemake", ".git"}
    for word in command.words[1:]:
        path = word.split("=", 1)[-1]
        if "/" not in path or path.split("/")[0] not in tops or re.search(r"[<>]|\bNAME\b|RECIPE", path):
            continue
        assert list(REPO.glob(path.rstrip("/"))), (
            f"{command.where}: `{command.text}` names {path}, which does not exist"
        )


def help_flags(help_text: str) -> set[str]:
    return set(re.findall(r"(?<![\w-])(--?[A-Za-z][\w-]*)", help_text))


def check_flags(command: Command, words: list[str], help_text: str):
    known = help_flags(help_text)
    for word in words:
        flag = word.strip("[]").split("=", 1)[0]
        if flag.startswith("-") and len(flag) > 1 and not re.fullmatch(r"-\d.*", flag):
            assert fnmatch.filter(known, flag), f"{command.where}: `{command.text}`: {flag} is not an option of it"


@contextlib.contextmanager
def argv_and_stdout(argv: list[str]):
    saved = sys.argv
    sys.argv = argv
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
            yield out
    finally:
        sys.argv = saved


@functools.cache
def vlmcore_help(subcommand: str) -> str:
    """`vlmcore SUBCOMMAND --help`, in-process."""
    from vlmcore.cli import main

    with argv_and_stdout(["vlmcore"]) as out:
        code = main([subcommand, "--help"])
    assert code == 0, f"vlmcore {subcommand} --help failed"
    return out.getvalue()


@contextlib.contextmanager
def script_in_process(script: Path):
    """Runs a script in this process as `python benchmarks/X.py` would: its folder on the path
    (the benchmarks import their neighbours). What it changes at import (the path, the
    environment, its neighbours' modules) is undone, for the tests that run in this process
    after this one."""
    path = list(sys.path)
    environ = dict(os.environ)
    modules = set(sys.modules)
    sys.path.insert(0, str(script.parent))
    try:
        yield
    finally:
        sys.path[:] = path
        os.environ.clear()
        os.environ.update(environ)
        for name in set(sys.modules) - modules:
            if Path(getattr(sys.modules[name], "__file__", None) or "/").parent == script.parent:
                del sys.modules[name]


@functools.cache
def script_help(script: Path) -> str:
    """`python SCRIPT --help`, in-process: torch is imported once for all of them."""
    with script_in_process(script), argv_and_stdout([str(script), "--help"]) as out, contextlib.suppress(SystemExit):
        runpy.run_path(str(script), run_name="__main__")
    return out.getvalue()


class _Parsed(Exception):
    """Raised by the script's parse_args once it has parsed: the script's work is not run."""


def script_parse_error(script: Path, arguments: list[str]) -> str | None:
    """Whether `python SCRIPT ARGUMENTS` parses with the script's own parser (its choices and
    types included): None, or argparse's error message. In-process, as script_help; the
    script stops once its arguments are parsed."""
    parse_args = argparse.ArgumentParser.parse_args

    def parse_and_stop(parser, args=None, namespace=None):
        parse_args(parser, args, namespace)
        raise _Parsed

    errors = io.StringIO()
    argparse.ArgumentParser.parse_args = parse_and_stop
    try:
        with script_in_process(script), argv_and_stdout([str(script), *arguments]), contextlib.redirect_stderr(errors):
            runpy.run_path(str(script), run_name="__main__")
    except _Parsed:
        return None
    except SystemExit:
        return errors.getvalue().strip().splitlines()[-1] if errors.getvalue().strip() else "exited"
    finally:
        argparse.ArgumentParser.parse_args = parse_args
    return "the script ran without parsing its arguments"


def gives_required_arguments(words: list[str]) -> bool:
    """Whether `vlmcore COMMAND ...` gives every argument its command requires, as the command's
    parser reads them, its value checks left out (the files the docs' commands name exist only
    beside the demo or on a cluster)."""
    from vlmcore.cli import COMMANDS as SUBCOMMANDS
    from vlmcore.cli import Parser

    for subcommand in words[1].split("|"):
        parser = Parser(prog=f"vlmcore {subcommand}")
        importlib.import_module(SUBCOMMANDS[subcommand][0]).add_arguments(parser)
        for action in parser._actions:
            action.type = None
        try:
            with argv_and_stdout(["vlmcore"]):
                parser.parse_args(words[2:])
        except SystemExit as e:  # --help exits 0
            if e.code != 0:
                return False
    return True


def run_here(command: Command, words: list[str]):
    """A command of RUN_HERE, in-process in a scratch folder: it exits 0 and writes or prints what
    the docs say."""
    from vlmcore.cli import main

    output = ""
    with tempfile.TemporaryDirectory() as scratch, contextlib.chdir(scratch):
        setup = SETUP_HERE.get(" ".join(command.words))
        if setup is not None:
            setup(Path(scratch))
        for subcommand in words[1].split("|"):
            with argv_and_stdout(["vlmcore"]) as out:
                code = main([subcommand, *words[2:]])
            assert code == 0, f"{command.where}: `{command.text}` failed"
            output += out.getvalue()
        RUN_HERE[" ".join(command.words)](Path(scratch), output)


def check_vlmcore(command: Command, words: list[str]):
    from vlmcore.cli import COMMANDS as SUBCOMMANDS

    subcommands = words[1].split("|") if len(words) > 1 else []
    assert subcommands, f"{command.where}: `{command.text}` names no command"
    for subcommand in subcommands:
        assert subcommand in SUBCOMMANDS, f"{command.where}: `{command.text}`: no command {subcommand}"
        check_flags(command, words[2:], vlmcore_help(subcommand))
    line = " ".join(command.words)
    if line in RUN_HERE:
        run_here(command, words)
        return
    names_it = command.place == "heading" or (command.place == "sentence" and not gives_required_arguments(words))
    assert names_it or line in RUN_ON_DEMO or line in HELP_ONLY, (
        f"{command.where}: `{command.text}` is neither run nor named: add it to RUN_HERE or RUN_ON_DEMO "
        "in tests/workflow/test_docs_commands.py with what it writes or prints, or to HELP_ONLY with why it cannot run here"
    )


def check_python(command: Command, words: list[str]):
    if words[1:2] == ["-c"]:
        compile(words[2], command.where, "exec")
    elif words[1:3] == ["-m", "vlmcore.cli"]:
        check_vlmcore(command, ["vlmcore", *words[3:]])
    elif words[1:2] == ["-m"]:
        assert importlib.util.find_spec(words[2]), f"{command.where}: no module {words[2]}"
    else:
        script = REPO / words[1]
        assert script.is_file(), f"{command.where}: `{command.text}`: no script {words[1]}"
        check_flags(command, words[2:], script_help(script))
        if command.where.startswith(SESSION_SCRIPT.relative_to(REPO).as_posix()):
            error = script_parse_error(script, words[2:])
            assert error is None, f"{command.where}: `{command.text}`: {error}"


def check_torchrun(command: Command, words: list[str]):
    assert "-m" in words, f"{command.where}: `{command.text}`: torchrun of what?"
    module = words.index("-m")
    check_python(command, ["python", *words[module:]])


def check_bash(command: Command, words: list[str]):
    script = REPO / words[1]
    assert script.is_file(), f"{command.where}: `{command.text}`: no script {words[1]}"
    proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def check_pip(command: Command, words: list[str]):
    """Not run (it needs the network, and the environment is built): the project's extras it
    names (`-e ".[test]"`) exist; its requirement files are checked with every command's paths."""
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for word in words:
        match = re.fullmatch(r"\.\[([\w,-]+)\]", word)
        for extra in match.group(1).split(",") if match else []:
            assert extra in extras, f"{command.where}: `{command.text}`: the project has no extra {extra}"


def snakemake_argv(command: Command, words: list[str]) -> list[str]:
    """The command's arguments, the placeholders replaced."""
    text = shlex.join(words[1:])
    if text.startswith("... "):
        text = "--profile profiles/local " + text.removeprefix("... ")
    profile = re.search(r"--profile profiles/(\S+)", text)
    cluster = profile.group(1) if profile else "local"
    for placeholder, value in PLACEHOLDERS.items():
        text = text.replace(placeholder.format(cluster=cluster), value.format(cluster=cluster))
    assert not re.search(r"<\w+>|\.\.\.|\bNAME\b", text), f"{command.where}: a placeholder without a value: {text}"
    return shlex.split(text)


@functools.cache
def snakemake_parser() -> argparse.ArgumentParser:
    from snakemake.cli import get_argument_parser

    return get_argument_parser()


def check_snakemake(command: Command, words: list[str]):
    parsed = snakemake_parser().parse_args(snakemake_argv(command, words))
    assert parsed.targets, (
        f"{command.where}: `{command.text}` names no target: --configfile, -R and --until take several values, "
        "so a target after them is read as one of theirs; put the target first"
    )


def dry_run_argv(command: Command) -> list[str] | None:
    """The arguments of a snakemake command's dry run: placeholders replaced, the options of
    LEFT_OUT_OF_DRY_RUN and `-n` (the dry run adds its own) left out; None for NOT_DRY_RUN."""
    argv = snakemake_argv(command, list(command.words))
    if any(word in NOT_DRY_RUN for word in argv):
        return None
    for option in LEFT_OUT_OF_DRY_RUN:
        if option in argv:
            at = argv.index(option)
            argv = argv[:at] + argv[at + 2 :]
    return [word for word in argv if word not in ("-n", "--dry-run")]


CHECKS = {
    "snakemake": check_snakemake,
    "vlmcore": check_vlmcore,
    "python": check_python,
    "torchrun": check_torchrun,
    "bash": check_bash,
    "pip": check_pip,
}

COMMANDS = all_commands()


def test_the_docs_give_commands():
    where = {c.where.split(":")[0] for c in COMMANDS}
    assert {"README.md", "docs/hpc.md", "docs/video.md", "config/demo-video.yaml", "benchmarks/gpu_session.sh"} <= where
    assert sum(c.words[0] == "snakemake" for c in COMMANDS) > 20


def test_the_vlmcore_commands_listed_are_in_the_docs():
    """RUN_HERE, RUN_ON_DEMO and HELP_ONLY hold only commands the docs give (a changed doc line
    drops out of them, and the check of the new line asks where it goes)."""
    lines = {" ".join(c.words) for c in COMMANDS}
    for listed in (*RUN_HERE, *RUN_ON_DEMO, *HELP_ONLY):
        assert listed in lines, f"`{listed}` is not a command of the docs"


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c.where)
def test_command_passes_its_check(command):
    words = list(command.words)
    assert words[0] in CHECKS or words[0] in NOT_RUN, (
        f"{command.where}: `{command.text}`: no rule checks {words[0]} commands; add one to "
        "CHECKS in tests/workflow/test_docs_commands.py, or to NOT_RUN with the reason"
    )
    check_repo_paths(command)
    if words[0] in CHECKS:
        CHECKS[words[0]](command, words)


@pytest.fixture(scope="module")
def checkout(tmp_path_factory):
    """A copy of the checkout for the dry runs to write in: the workflow, configs and profiles
    linked, empty stand-ins for the staged inputs of every recipe."""
    root = tmp_path_factory.mktemp("checkout")
    for name in ("Snakefile", "workflow", "config", "profiles"):
        (root / name).symlink_to(REPO / name)
    for recipe in (REPO / "config" / "experiments").glob("*.yaml"):
        for dataset in yaml.safe_load(recipe.read_text())["data"]["datasets"].values():
            for source in dataset["sources"]:
                path = root / source.split(":", 1)[1]
                path.parent.mkdir(parents=True, exist_ok=True)
                path.touch()
    return root


def dry_runs() -> dict[tuple[str, ...], list[Command]]:
    """{arguments: the commands} of the dry runs: one per distinct snakemake command of the docs.
    The usage lines of the configs and profiles are only parsed: tests/slurm/test_slurm_profiles.py
    dry-runs every recipe with its cluster's profile."""
    runs = {}
    for command in COMMANDS:
        if command.words[0] != "snakemake" or command.where.startswith(("config/", "profiles/")):
            continue
        argv = dry_run_argv(command)
        if argv is not None:
            runs.setdefault(tuple(argv), []).append(command)
    return runs


@pytest.mark.workflow
def test_snakemake_commands_dry_run(checkout):
    """Each snakemake command of the docs plans its jobs. The dry runs run one after the other in
    one child process (this file as a script): most of a dry run's time in a process of its own
    is Snakemake's import."""
    runs = dry_runs()
    # The child imports tests/helpers.py, as pytest's children of tests/conftest.py's folder do.
    tests = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=f"{tests}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    proc = subprocess.run(
        [sys.executable, __file__],
        input=json.dumps([list(argv) for argv in runs]),
        cwd=checkout,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-5000:]
    results = json.loads(proc.stdout.splitlines()[-1])
    failures = [
        f"{commands[0].where}: `{commands[0].text}`:\n{output}"
        for commands, (ok, output) in zip(runs.values(), results, strict=True)
        if not ok
    ]
    assert not failures, "\n\n".join(failures)


def dry_run_here(argvs: list[list[str]]) -> list[tuple[bool, str]]:
    """Each `snakemake -n ARGV` in this process and directory, as Snakemake's main does it:
    (whether it succeeded, the end of its output)."""
    from snakemake.cli import args_to_api, parse_args

    results = []
    for argv in argvs:
        # A cluster profile's account and QoS come from the environment (docs/hpc.md section 1).
        cluster = re.search(r"profiles/(mn5|jupiter)\b", " ".join(argv))
        os.environ.pop("VLMCORE_CLUSTER", None)
        if cluster:
            os.environ.update(CLUSTER_ENV, VLMCORE_CLUSTER=cluster.group(1))
        output = io.StringIO()
        with contextlib.redirect_stdout(output), contextlib.redirect_stderr(output):
            try:
                parser, args = parse_args(["-n", *argv])
                ok = bool(args_to_api(args, parser))
            except Exception as e:  # what Snakemake's main prints and exits 1 for
                print(f"{type(e).__name__}: {e}")
                ok = False
        results.append((ok, output.getvalue()[-3000:]))
    return results


if __name__ == "__main__":
    print(json.dumps(dry_run_here(json.load(sys.stdin))))
