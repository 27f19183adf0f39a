"""The package's structure (docs/internals.md "Code structure"): its import layers, read from the
source with an AST walk. A module imports only from its own layer or below, the bottom two layers
are torch-free at import (they run on a login node, in the workflow's planning), the module-level
imports have no cycle, and every function stays within ruff's complexity bounds."""

import ast
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"

# Bottom to top, as docs/internals.md lists them; a module's layer is that of its longest prefix here.
LAYERS = [
    (
        "vlmcore",
        "vlmcore.config",
        "vlmcore.families",
        "vlmcore.hashing",
        "vlmcore.provenance",
        "vlmcore.tiny",
        "vlmcore.cli",
    ),
    ("vlmcore.parallel.layout", "vlmcore.parallel.checks", "vlmcore.kernels", "vlmcore.workflow"),
    ("vlmcore.models",),
    # The data stages, each above what it reads: shared shards and bad-sample accounting, media
    # (images, videos, text encoding), then sources -> shards, shards -> packs, packs -> batches.
    ("vlmcore.data", "vlmcore.data.quality", "vlmcore.data.shards"),
    ("vlmcore.data.media",),
    ("vlmcore.data.prepare", "vlmcore.data.synthetic"),
    ("vlmcore.data.pack",),
    ("vlmcore.data.load",),
    ("vlmcore.parallel",),
    ("vlmcore.generate",),  # below train: online RL rolls out through it
    ("vlmcore.train",),
    (
        "vlmcore.download",
        "vlmcore.generate.command",
        "vlmcore.export",
        "vlmcore.eval",
        "vlmcore.rewards",  # beside eval: it reads the benchmarks' answer extractors
        "vlmcore.report",
        "vlmcore.train.loop",
        "vlmcore.train.memory",
        "vlmcore.config_docs",
    ),
]
TORCH_FREE_LAYERS = 2
# Imports made inside a function on purpose, from a layer above: `vlmcore kernels` reads the
# attention module only when asked about a GPU's varlen kernel.
LAZY_UPWARD = {("vlmcore.kernels", "vlmcore.models.attention")}


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(module: str) -> int:
    best = None
    for index, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and (best is None or len(prefix) > len(best[1])):
                best = (index, prefix)
    assert best is not None, f"{module} is in no layer of tests/core/test_structure.py"
    return best[0]


def imports(path: Path):
    """(imported module, at module level?) for every import in the file, relative ones resolved;
    `from a import b` counts as a.b when a.b is a module of the package."""
    module = module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    tree = ast.parse(path.read_text())
    top_level = {id(node) for node in tree.body} | {
        id(n) for node in tree.body if isinstance(node, ast.If) for n in node.body
    }
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            names = [f"{base}.{alias.name}" if is_module(f"{base}.{alias.name}") else base for alias in node.names]
        else:
            continue
        for name in names:
            yield name, id(node) in top_level


def is_module(name: str) -> bool:
    path = SRC / Path(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def package_modules():
    return {module_name(p): p for p in sorted((SRC / "vlmcore").rglob("*.py"))}


def test_every_import_goes_to_the_same_layer_or_below():
    upward = []
    for module, path in package_modules().items():
        for name, _ in imports(path):
            if name.startswith("vlmcore") and layer_of(name) > layer_of(module) and (module, name) not in LAZY_UPWARD:
                upward.append(f"{module} (layer {layer_of(module) + 1}) imports {name} (layer {layer_of(name) + 1})")
    assert not upward, "\n".join(upward)


def test_the_bottom_layers_import_no_torch_at_module_level():
    found = [
        f"{module} imports {name}"
        for module, path in package_modules().items()
        if layer_of(module) < TORCH_FREE_LAYERS
        for name, top in imports(path)
        if top and name.split(".")[0] in ("torch", "transformers", "vlmcore.models")
    ]
    assert not found, "\n".join(found)


def test_the_trainer_imports_no_processor_or_modeling_code():
    """A training process reads packed uint8 patches and needs no image processor: importing
    transformers' processor stack (processing_utils -> modeling_utils -> its quantizers) costs about
    1 s of every trainer's start-up, in every rank of every launch."""
    heavy = ["transformers.processing_utils", "transformers.modeling_utils", "vlmcore.data.media.processor"]
    probe = f"import sys, vlmcore.train.loop; print([m for m in {heavy!r} if m in sys.modules])"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]", result.stdout


def test_imports_have_no_cycle():
    """Module-level and function-level imports alike: a lazy import hides a cycle from Python's
    import, not from the reader."""
    modules = package_modules()
    graph = {m: {n for n, _ in imports(p) if n in modules and n != m} for m, p in modules.items()}
    # A package's __init__ importing its own submodules is how a package exports; leave those edges out.
    graph = {m: {n for n in deps if not n.startswith(m + ".")} for m, deps in graph.items()}
    state, stack = {}, []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == "open":
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(n) :] + [n]))
            if n not in state:
                visit(n)
        stack.pop()
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_every_function_stays_within_the_complexity_bounds():
    # The bounds are ruff's (pyproject.toml: McCabe complexity, branches, statements per function);
    # a function past them is split into named steps. A file's length is no bound.
    rules = "C901,PLR0912,PLR0915"
    result = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--select", rules, "--output-format", "concise", str(SRC)],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_layers_cover_every_module_and_the_walk_sees_imports():
    modules = package_modules()
    assert all(layer_of(m) >= 0 for m in modules)
    # The walk itself: a known import at each level and a relative one resolved.
    assert ("vlmcore.families", True) in set(imports(modules["vlmcore.models.hf"]))
    assert any(name == "vlmcore.models.attention" and not top for name, top in imports(modules["vlmcore.kernels"]))


def test_no_module_imports_a_command_module():
    """A stage's command module (argparse and `run`) is reached through `vlmcore.cli`'s dispatch
    only; the library modules below it never import it, nor the CLI's argument helpers."""
    found = []
    for module, path in package_modules().items():
        is_command = module.endswith(".command")
        for name, _ in imports(path):
            if name.endswith(".command") and name.startswith("vlmcore.data"):
                found.append(f"{module} imports the command module {name}")
            if module.startswith("vlmcore.data") and not is_command and name == "vlmcore.cli":
                found.append(f"{module} (a library module) imports vlmcore.cli")
    assert not found, "\n".join(found)
