"""`vlmcore <command>`: every pipeline stage is usable on its own.

Each command lives in the module that does the work; the module defines
`add_arguments(parser)` and `run(args) -> int | None`. This file only dispatches.
"""

import argparse
import importlib
import sys

COMMANDS = {
    "download": ("vlmcore.download", "download an HF snapshot, verify a staged one, or build the tiny demo model"),
    "synth": ("vlmcore.data.synthetic", "generate the synthetic image-text demo dataset"),
    "prepare": ("vlmcore.data.prepare", "raw sources -> webdataset shards -> energon prepare"),
    "pack": ("vlmcore.data.pack", "tokenize and pack samples into fixed-budget sequences"),
    "train": ("vlmcore.train.loop", "run one training stage (under torchrun or as one process)"),
    "memory": ("vlmcore.train.memory", "estimate a training stage's peak memory per device, no GPU needed"),
    "kernels": ("vlmcore.kernels", "check the GPU kernels' versions (torch, Triton, fla, tilelang, flash-attn)"),
    "export": ("vlmcore.export", "training checkpoint -> Hugging Face directory"),
    "eval": ("vlmcore.eval.runner", "lm-eval on an exported directory"),
    "report": ("vlmcore.report.scaling", "scaling CSV, plots and SCALABILITY.md"),
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="vlmcore", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    argv = sys.argv[1:] if argv is None else list(argv)
    # Import only the module of the command asked for: torch/transformers imports are slow.
    wanted = argv[0] if argv and argv[0] in COMMANDS else None
    for name, (module_name, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text)
        if name == wanted:
            module = importlib.import_module(module_name)
            module.add_arguments(p)
            p.set_defaults(_run=module.run)
    args = parser.parse_args(argv)
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
