"""The package's import graph has no cycle.

Every module of ``sigprop`` (service/, client/ and schemas/, as pyproject's package-dir maps them)
is parsed with ``ast``; each import names an edge, whether it sits at module level, inside a
function (a "late" import that only hides the cycle from the interpreter) or in an
``if TYPE_CHECKING:`` block. A cycle couples modules that could not be understood, tested or
loaded one at a time, and a late import that breaks one at run time breaks again when code moves.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# pyproject.toml [tool.setuptools] package-dir
PACKAGE_DIRS = {"sigprop": ROOT / "service", "sigprop.client": ROOT / "client", "sigprop.schemas": ROOT / "schemas"}


def _modules() -> dict[str, tuple[Path, bool]]:
    """Module name -> (file, whether it is a package's ``__init__``)."""
    out: dict[str, tuple[Path, bool]] = {}
    for pkg, folder in PACKAGE_DIRS.items():
        for path in sorted(folder.rglob("*.py")):
            rel = path.relative_to(folder).with_suffix("")
            parts = list(rel.parts)
            if any(p in PACKAGE_DIRS.values() for p in path.parents if p != folder) or "static" in parts:
                continue
            is_pkg = parts[-1] == "__init__"
            if is_pkg:
                parts = parts[:-1]
            name = ".".join([pkg, *parts])
            if name in out:  # client/ inside service/? no: package-dir keeps them apart
                continue
            out[name] = (path, is_pkg)
    return out


def _resolve(module: str, is_pkg: bool, level: int, target: str | None) -> str:
    """The absolute name of a (possibly relative) import in ``module``."""
    if level == 0:
        return target or ""
    base = module.split(".")
    if not is_pkg:
        base = base[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def _known(name: str, modules: dict) -> str | None:
    """The most specific module of the package that ``name`` is, or lies in."""
    parts = name.split(".")
    while parts:
        cand = ".".join(parts)
        if cand in modules:
            return cand
        parts.pop()
    return None


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, (path, is_pkg) in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):  # every import, at any depth: functions and TYPE_CHECKING blocks too
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(name, is_pkg, node.level, node.module)
                # `from pkg import sub` imports the submodule `pkg.sub` when there is one
                targets = [
                    f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names
                ]
            for t in targets:
                dep = _known(t, modules)
                if dep is not None and dep != name:
                    graph[name].add(dep)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a list of modules (first == last), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    stack: list[str] = []

    def visit(v: str) -> list[str] | None:
        state[v] = 1
        stack.append(v)
        for w in sorted(graph[v]):
            if state.get(w) == 1:
                return stack[stack.index(w) :] + [w]
            if w not in state:
                found = visit(w)
                if found:
                    return found
        stack.pop()
        state[v] = 2
        return None

    for v in sorted(graph):
        if v not in state:
            found = visit(v)
            if found:
                return found
    return None


def test_the_cycle_finder_finds_a_planted_cycle_and_the_graph_sees_late_imports():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None
    graph = import_graph()
    assert len(graph) > 100
    # a function-level import is an edge (diagnose imports the framework-free predictions late)
    assert "sigprop.client.diagnosis" in graph["sigprop.client.torch.diagnose"]
    assert "sigprop.schemas.errors" in graph["sigprop.client.torch.extraction"]


def test_the_package_has_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def _outside(graph: dict[str, set[str]], layer: str, allowed: tuple[str, ...]) -> list[tuple[str, str]]:
    """(module, import) pairs of ``layer``'s modules importing something outside ``allowed``."""

    def within(name: str, roots: tuple[str, ...]) -> bool:
        return any(name == r or name.startswith(r + ".") for r in roots)

    return sorted((m, d) for m, deps in graph.items() if within(m, (layer,)) for d in deps if not within(d, allowed))


def test_imports_follow_the_layers():
    """schemas <- engine <- service; the client depends on schemas only (docs/architecture.md), and
    the request parser validates with the wire's names, not the engine's."""
    graph = import_graph()
    assert _outside(graph, "sigprop.schemas", ("sigprop.schemas",)) == []
    assert _outside(graph, "sigprop.client", ("sigprop.client", "sigprop.schemas", "sigprop.version")) == []
    higher = ("api", "dashboard", "worker", "storage", "client", "requests", "answers", "cli", "inprocess")
    assert not [(m, d) for m, d in _outside(graph, "sigprop.engine", ()) if d.split(".")[1] in higher]
    assert not [d for d in graph["sigprop.requests"] if d.startswith("sigprop.engine")]
