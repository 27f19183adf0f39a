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
  LEFT_OUT_OF_DRY_RUN; the usage lines of the configs are only parsed (tests/test_slurm_profiles.py
  dry-runs every recipe);
- `vlmcore`, `python -m vlmcore.cli`, `torchrun ... -m vlmcore.cli`: the command exists and every
  flag it names is in its `--help` (most need a cluster, a GPU, a big model or the demo's outputs);
  those of RUN_HERE are run;
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
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
CONFIG_COMMENTS = [
    *sorted((REPO / "config").glob("*.yaml")),
    *sorted((REPO / "config" / "experiments").glob("*.yaml")),
    *sorted((REPO / "profiles").glob("*/config.yaml")),
]
CLUSTER_ENV = {"VLMCORE_ACCOUNT": "ehpc01", "VLMCORE_QOS_ACC": "acc_ehpc", "VLMCORE_QOS_GPP": "gp_ehpc"}

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
    "sbatch": "what the SLURM plugin submits; tests/test_slurm_fake.py checks those lines",
    "sudo": "starts a SLURM cluster as root; tests/test_slurm_real.py runs after it in CI",
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
    "corpus-100m.yaml": "the reader's own corpus file; tests/test_workflow_dag.py dry-runs this plan with one",
}

# Options (with their value) that a dry run leaves out, and why; the rest of the command is dry-run.
LEFT_OUT_OF_DRY_RUN = {
    "--report": "builds the HTML report of a finished run: needs the demo's outputs",
}

# vlmcore commands cheap enough to run here as written.
RUN_HERE = {"vlmcore kernels --gpu-capability 9.0"}

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
        commands += [Command(f"{name}:{number}", text, tuple(w)) for w in shell_words(text)]
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


def all_commands() -> list[Command]:
    commands = [c for path in DOCS for c in doc_commands(path)]
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


@functools.cache
def script_help(script: Path) -> str:
    """`python SCRIPT --help`, in-process: torch is imported once for all of them. The script's
    folder is on the path, as `python benchmarks/X.py` puts it (the benchmarks import their
    neighbours); what a script changes at import (the path, the environment, its neighbours'
    modules) is undone, for the tests that run in this process after this one."""
    path = list(sys.path)
    environ = dict(os.environ)
    modules = set(sys.modules)
    sys.path.insert(0, str(script.parent))
    try:
        with argv_and_stdout([str(script), "--help"]) as out, contextlib.suppress(SystemExit):
            runpy.run_path(str(script), run_name="__main__")
    finally:
        sys.path[:] = path
        os.environ.clear()
        os.environ.update(environ)
        for name in set(sys.modules) - modules:
            if Path(getattr(sys.modules[name], "__file__", None) or "/").parent == script.parent:
                del sys.modules[name]
    return out.getvalue()


def check_vlmcore(command: Command, words: list[str]):
    from vlmcore.cli import COMMANDS as SUBCOMMANDS
    from vlmcore.cli import main

    subcommands = words[1].split("|") if len(words) > 1 else []
    assert subcommands, f"{command.where}: `{command.text}` names no command"
    for subcommand in subcommands:
        assert subcommand in SUBCOMMANDS, f"{command.where}: `{command.text}`: no command {subcommand}"
        check_flags(command, words[2:], vlmcore_help(subcommand))
    if " ".join(words) in RUN_HERE:
        with argv_and_stdout(["vlmcore"]):
            assert main(words[1:]) == 0, f"{command.where}: `{command.text}` failed"


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
    assert {"README.md", "docs/hpc.md", "docs/video.md", "config/demo-video.yaml"} <= where
    assert sum(c.words[0] == "snakemake" for c in COMMANDS) > 20


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c.where)
def test_command_passes_its_check(command):
    words = list(command.words)
    assert words[0] in CHECKS or words[0] in NOT_RUN, (
        f"{command.where}: `{command.text}`: no rule checks {words[0]} commands; add one to "
        "CHECKS in tests/test_docs_commands.py, or to NOT_RUN with the reason"
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
    The usage lines of the configs and profiles are only parsed: tests/test_slurm_profiles.py
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
    proc = subprocess.run(
        [sys.executable, __file__],
        input=json.dumps([list(argv) for argv in runs]),
        cwd=checkout,
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
