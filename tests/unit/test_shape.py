"""Every file and function of services/, shared/ and console/ stays small enough to read.

A file over about 400 lines, or a function over about 60, carries more than one idea: split
it along its seams. The bounds here are the hard ones (430 and 60); a function counts from
its `def` line through the last line of its body, decorators excluded, nested functions
and methods each on their own. Tests are not held to this.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("services", "shared", "console")
MAX_FILE_LINES = 430
MAX_FUNCTION_LINES = 60

# Generated code or tables, which read best whole, by path relative to the repository root,
# each with why. Keep it short: anything else over the bounds is to be split.
ALLOWED: dict[str, str] = {}


def sources(root: Path = ROOT) -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (root / pkg).rglob("*.py"))


def long_files(paths: list[Path], root: Path = ROOT) -> list[str]:
    found = []
    for path in paths:
        rel = path.relative_to(root).as_posix()
        lines = len(path.read_text().splitlines())
        if lines > MAX_FILE_LINES and rel not in ALLOWED:
            found.append(f"{rel}: {lines} lines")
    return found


def long_functions(paths: list[Path], root: Path = ROOT) -> list[str]:
    found = []
    for path in paths:
        rel = path.relative_to(root).as_posix()
        if rel in ALLOWED:
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    found.append(f"{rel}:{node.lineno} {node.name}: {lines} lines")
    return found


def test_the_walk_sees_the_tree():
    assert len(sources()) > 100


def test_the_allow_list_names_files_that_exist():
    assert all((ROOT / rel).is_file() for rel in ALLOWED), ALLOWED


def test_no_file_over_the_bound():
    found = long_files(sources())
    assert not found, f"files over {MAX_FILE_LINES} lines:\n" + "\n".join(found)


def test_no_function_over_the_bound():
    found = long_functions(sources())
    assert not found, f"functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(found)


def test_the_bounds_catch_what_they_are_for(tmp_path):
    def function(name: str, lines: int) -> str:  # `lines` from the def through the body
        return f"@decorated\ndef {name}():\n" + "".join(f"    x = {i}\n" for i in range(lines - 1))

    (tmp_path / "shared").mkdir()
    path = tmp_path / "shared" / "m.py"
    path.write_text(function("over", MAX_FUNCTION_LINES + 1) + function("fits", MAX_FUNCTION_LINES))
    assert long_functions([path], tmp_path) == [
        f"shared/m.py:2 over: {MAX_FUNCTION_LINES + 1} lines"
    ]
    assert long_files([path], tmp_path) == []
    path.write_text("\n" * (MAX_FILE_LINES + 1))
    assert long_files([path], tmp_path) == [f"shared/m.py: {MAX_FILE_LINES + 1} lines"]
