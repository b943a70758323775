"""No function in the application layers runs past about 80 lines: a longer one is doing several
jobs, and each job should have a name. An entry in ALLOWED needs its reason beside it."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAYERS = ("training", "tasks", "flows", "retrain_cli")
LIMIT = 80
ALLOWED: dict[str, int] = {
    # "path/to/module.py::function": its length, with the reason it cannot be split on the line above.
}


def _functions() -> dict[str, int]:
    lengths = {}
    for layer in LAYERS:
        for path in sorted((ROOT / layer).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    key = f"{path.relative_to(ROOT)}::{node.name}"
                    lengths[key] = max(lengths.get(key, 0), node.end_lineno - node.lineno + 1)  # type: ignore[operator]
    return lengths


def test_no_function_is_longer_than_the_limit() -> None:
    lengths = _functions()
    assert len(lengths) > 200  # the walk found the code
    too_long = {name: n for name, n in lengths.items() if n > ALLOWED.get(name, LIMIT)}
    assert not too_long, f"functions over {LIMIT} lines (split them, or allow one with a reason): {too_long}"


def test_the_allow_list_holds_only_functions_that_need_it() -> None:
    lengths = _functions()
    stale = {name for name in ALLOWED if lengths.get(name, 0) <= LIMIT}
    assert not stale, f"no longer over {LIMIT} lines, remove from ALLOWED: {stale}"
