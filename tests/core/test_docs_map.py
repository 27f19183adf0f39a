"""docs/internals.md's map names files that exist: every path in a cell of the map's tables (the
packages, and where a new thing goes), source paths relative to src/vlmcore/, the others to the
repository root, tests by their file name (unique under tests/), `<name>` standing for any name
(at least one file must match it)."""

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "src/vlmcore"
PATH_SUFFIXES = (".py", ".smk", ".yaml", ".md", ".json", ".sh")


def map_section() -> str:
    doc = (REPO / "docs/internals.md").read_text()
    return doc.split("## The map (start here)")[1].split("\n## ")[0]


def table_cells(text: str) -> list[str]:
    """The cells of every table row in `text`, header and separator rows left out."""
    cells = []
    for line in text.splitlines():
        if line.startswith("|") and not re.fullmatch(r"\|[-| ]+\|", line):
            cells += [cell.strip() for cell in line.strip("|").split("|")]
    return [cell for cell in cells if cell not in ("package", "what it owns", "a new ...", "goes in")]


def named_paths(cell: str) -> list[str]:
    """The code spans of a cell that are paths: with a folder, or a file name with its suffix."""
    spans = re.findall(r"`([^`]+)`", cell)
    return [span for span in spans if " " not in span and ("/" in span or span.endswith(PATH_SUFFIXES))]


def exists(path: str) -> bool:
    pattern = re.sub(r"<[^>]+>", "*", path.rstrip("/"))
    if "/" not in pattern and pattern.startswith("test"):  # a test, by its file name
        return any((REPO / "tests").rglob(pattern))
    roots = [PACKAGE, REPO]
    return any(any(root.glob(pattern)) if "*" in pattern else (root / pattern).exists() for root in roots)


def test_the_map_names_only_paths_that_exist():
    paths = [path for cell in table_cells(map_section()) for path in named_paths(cell)]
    assert len(paths) > 80  # both tables read (the packages, where a new thing goes)
    missing = sorted({path for path in paths if not exists(path)})
    assert not missing, f"docs/internals.md's map names paths that do not exist: {missing}"


def test_a_path_that_does_not_exist_is_found():
    cells = table_cells(
        "| a new ... | goes in |\n|---|---|\n| x | `train/no_such.py`, `config.py`, `test_nothing_x.py` |"
    )
    assert named_paths(cells[-1]) == ["train/no_such.py", "config.py", "test_nothing_x.py"]
    assert [exists(path) for path in named_paths(cells[-1])] == [False, True, False]
