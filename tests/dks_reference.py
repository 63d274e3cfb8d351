"""The reference model of dks (``dks/examples/haiku/modified_resnet.py``) without haiku or jax.

That file imports haiku at the top, but its ``CONFIGS`` and ``subnet_max_func`` are plain Python:
they are taken from the file's syntax tree. Shared by the tests and ``bench/solve_bench.py``.
"""

from __future__ import annotations

import ast
import importlib.util
import types
from pathlib import Path


def modified_resnet_path() -> Path | None:
    spec = importlib.util.find_spec("dks")
    if spec is None or not spec.origin:
        return None
    path = Path(spec.origin).parent / "examples" / "haiku" / "modified_resnet.py"
    return path if path.is_file() else None


def load_modified_resnet():
    """(CONFIGS, subnet_max_func) of the reference, or None where dks is not installed."""
    path = modified_resnet_path()
    if path is None:
        return None
    tree = ast.parse(path.read_text())
    configs = func = None
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == "ModifiedResNet":
            for stmt in node.body:
                if isinstance(stmt, ast.Assign) and getattr(stmt.targets[0], "id", None) == "CONFIGS":
                    configs = ast.literal_eval(stmt.value)
        if isinstance(node, ast.FunctionDef) and node.name == "subnet_max_func":
            func = node
    if configs is None or func is None:
        return None
    ns = {"ModifiedResNet": types.SimpleNamespace(CONFIGS=configs)}
    exec(compile(ast.Module(body=[func], type_ignores=[]), str(path), "exec"), ns)
    return configs, ns["subnet_max_func"]


def mlp_subnet_max_func(depth: int):
    """The M_{f,r} a dks user writes for an MLP: r applied depth times."""

    def smf(x, r_fn):
        for _ in range(depth):
            x = r_fn(x)
        return x

    return smf
