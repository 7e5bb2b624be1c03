"""The package's layers (docs/architecture.md): no import cycle longer than two files, and the
config at the bottom importing nothing above it. Every `import` and `from ... import` counts,
inside functions and `if TYPE_CHECKING:` blocks too: a cycle hidden in a function is still one
(issue 52: one circle ran through 40 files before the option classes moved to rlvr.options)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "rlvr"


def import_graph() -> dict[str, set[str]]:
    """Module → the rlvr modules it imports (a name imported from a package counts as the
    submodule when one of that name exists, else as the package)."""
    files = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    edges: dict[str, set[str]] = {name: set() for name in files}
    for name, path in files.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                    base = ".".join(here[: len(here) - node.level + 1] + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            for target in targets:
                while target and target not in files:
                    target = target.rpartition(".")[0]
                if target.startswith("rlvr") and target != name:
                    edges[name].add(target)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components (Tarjan), largest first."""
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            out.append(sorted(component))

    for v in edges:
        if v not in index:
            visit(v)
    return sorted(out, key=len, reverse=True)


def test_no_import_cycle_is_longer_than_two_files() -> None:
    longer = [c for c in cycles(import_graph()) if len(c) > 2]
    assert not longer, f"import cycles through more than two files: {longer}"


def test_the_cycle_check_finds_a_cycle() -> None:
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(edges)[0] == ["a", "b", "c"]


def test_the_config_imports_nothing_above_it() -> None:
    """rlvr.config validates with rlvr.algos and rlvr.options (and the leaf parts: the sandbox's
    limits, the log sinks' names, the reward registry); it never imports the parts that run."""
    above = ("rlvr.train", "rlvr.scaleout", "rlvr.agents", "rlvr.eval", "rlvr.serve", "rlvr.cli", "rlvr.rollout")
    edges = import_graph()
    upward = sorted(f"{m} -> {t}" for m in edges if m == "rlvr.config" or m.startswith("rlvr.config.")
                    for t in edges[m] if t.startswith(above))  # rlvr.configs (the examples) is not the config
    assert not upward, upward


def test_each_error_message_is_written_once() -> None:
    """A check written twice drifts apart (issue 52 found validations written two to four times
    with identical messages): each message of a raised error appears once in the package, and a
    check needed in two places is one function or one constant both use."""
    seen: dict[str, list[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and node.exc.args):
                continue
            first = node.exc.args[0]
            if isinstance(first, ast.Constant) and isinstance(first.value, str):
                text = first.value
            elif isinstance(first, ast.JoinedStr):
                text = "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in first.values)
            else:
                continue
            if len(text) > 25:  # short ones ("{}: {}") are formats, not messages
                seen.setdefault(text, []).append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
    repeated = {text: where for text, where in seen.items() if len(where) > 1}
    assert not repeated, repeated
