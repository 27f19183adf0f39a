"""`vlmcore <command>`: every pipeline stage is usable on its own.

Each command lives in the module that does the work; the module defines
`add_arguments(parser)` and `run(args) -> int | None`. This file dispatches, and holds the
argument types that check numbers and paths as they are parsed: a bad value stops the command
before it writes anything, with one line naming the flag and exit code 2. A bad combination of
arguments, found in `run` before any work, raises UsageError to the same effect. `main` returns
the exit code in every case, so tests call it in-process.
"""

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NoReturn


class UsageError(Exception):
    """Arguments that do not go together: `vlmcore` prints the one-line error, exit code 2."""


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        """One line (argparse would add the whole usage): the command, the flag, what is allowed."""
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _number(kind: type[int] | type[float], allowed: str, ok: Callable[[float], bool]) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not ok(value):
            raise argparse.ArgumentTypeError(f"must be {allowed}, got {text!r}")
        return value

    parse.__name__ = allowed  # what argparse names in its own messages
    return parse


positive_int = _number(int, "an integer >= 1", lambda v: v >= 1)
non_negative_int = _number(int, "an integer >= 0", lambda v: v >= 0)
fraction = _number(float, "a fraction in [0, 1]", lambda v: 0 <= v <= 1)


def _existing(what: str, ok: Callable[[Path], bool]) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if not ok(Path(text)):
            raise argparse.ArgumentTypeError(
                f"{text} is not {what}" if Path(text).exists() else f"{text} does not exist"
            )
        return text

    parse.__name__ = what
    return parse


existing_path = _existing("a file or directory", Path.exists)
existing_dir = _existing("a directory", Path.is_dir)
existing_file = _existing("a file", Path.is_file)

COMMANDS = {
    "download": ("vlmcore.download", "download an HF snapshot, verify a staged one, or build the tiny demo model"),
    "synth": ("vlmcore.data.synthetic.command", "generate the synthetic image-text or video-text demo dataset"),
    "prepare": ("vlmcore.data.prepare.command", "raw sources -> webdataset shards -> energon prepare"),
    "pack": ("vlmcore.data.pack.command", "tokenize and pack samples into fixed-budget sequences"),
    "train": ("vlmcore.train.loop", "run one training stage (under torchrun or as one process)"),
    "memory": ("vlmcore.train.memory", "estimate a training stage's peak memory per device, no GPU needed"),
    "kernels": ("vlmcore.kernels", "check the GPU kernels' versions (torch, Triton, fla, tilelang, flash-attn)"),
    "export": ("vlmcore.export", "training checkpoint -> Hugging Face directory"),
    "stage-benchmark": ("vlmcore.eval.staging", "stage a public benchmark's data for offline evaluation"),
    "eval": ("vlmcore.eval.runner", "lm-eval on an exported directory"),
    "generate": ("vlmcore.generate.command", "an answer from an export or a stage's final weights, on stdout"),
    "report": ("vlmcore.report.scaling", "scaling CSV, plots and SCALABILITY.md"),
}


def main(argv: Sequence[str] | None = None) -> int:
    parser = Parser(prog="vlmcore", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    argv = sys.argv[1:] if argv is None else list(argv)
    # Import only the module of the command asked for: torch/transformers imports are slow.
    wanted = argv[0] if argv and argv[0] in COMMANDS else None
    for name, (module_name, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text)
        if name == wanted:
            module = importlib.import_module(module_name)
            module.add_arguments(p)
            p.set_defaults(_run=module.run, _parser=p)
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help, or a bad argument argparse has named: its exit code
        return int(e.code or 0)
    try:
        return int(args._run(args) or 0)
    except UsageError as e:
        print(f"{args._parser.prog}: error: {e} (see --help)", file=sys.stderr)
        return 2


if __name__ == "__main__":
    # `python -m vlmcore.cli` (torchrun starts the commands so) runs this file as the module
    # __main__, and a command's `from vlmcore.cli import UsageError` imports it again as
    # vlmcore.cli: the main of that module is the one that catches the class the commands raise.
    from vlmcore.cli import main as imported_main

    sys.exit(imported_main())
