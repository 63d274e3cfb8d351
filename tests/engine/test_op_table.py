"""The op table is the one place an op is defined (issue 34): every wire op has a row, and no walk
outside the table and the framework adapters branches on an op's name; a module that needs an
op-specific fact reads its row (``OP_TABLE[op].kind``, ``.window``, ``.coverage``, ``.pool``, ...)."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import get_args

import pytest

from sigprop.schemas import graph as wire
from sigprop.schemas.ops import KINDS, OP_TABLE

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ("service", "schemas", "client")

# where naming ops is the point: the table and its shape rules, the template builders that emit ops,
# and the framework adapters that map a framework's modules to ops and back
EXEMPT = (
    "schemas/ops.py",
    "schemas/shape_rules.py",
    "service/engine/templates/",
    "service/worker/models.py",
    "client/torch/",
    "client/keras/",
    "client/jax/",
    "client/onnx",  # onnx.py and its onnx_*.py modules
)
# no structural literal is allowed either: the output is the row with ``sink``
STRUCTURAL: set[str] = set()


def _wire_ops() -> list[str]:
    union = get_args(wire.Node)[0]
    ops = []
    for cls in get_args(union):
        ops.extend(get_args(cls.model_fields["op"].annotation))
    return ops


def test_every_wire_op_has_a_row_and_every_row_a_wire_op():
    ops = _wire_ops()
    assert len(ops) == len(set(ops))
    wire_rows = [op for op, row in OP_TABLE.items() if row.wire]
    assert set(ops) == set(wire_rows)
    assert wire.OPS == tuple(wire_rows)
    assert all(row.op == op and row.kind in KINDS for op, row in OP_TABLE.items())
    # a row that is not a wire op is the ``features`` row of one
    assert {op for op, row in OP_TABLE.items() if not row.wire} <= {row.features for row in OP_TABLE.values()}


def _named_op(node: ast.AST) -> bool:
    """Whether ``node`` reads an op's name: ``op``, ``nd.op``, ``nd["op"]``, ``nd.get("op")``, ``ops[i]``."""
    if isinstance(node, ast.Name):
        return node.id == "op"
    if isinstance(node, ast.Attribute):
        return node.attr == "op"
    if isinstance(node, ast.Subscript):
        key = node.slice
        if isinstance(key, ast.Constant):
            return key.value == "op"
        return isinstance(node.value, ast.Name | ast.Attribute) and _name(node.value) == "ops"
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get":
        return bool(node.args) and isinstance(node.args[0], ast.Constant) and node.args[0].value == "op"
    return False


def _name(node: ast.AST) -> str:
    return node.id if isinstance(node, ast.Name) else node.attr


def _op_literals(node: ast.AST) -> set[str]:
    """The op names a literal spells (a string, or a tuple/list/set of strings), less the structural ones."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        values = {node.value}
    elif isinstance(node, ast.Tuple | ast.List | ast.Set):
        values = {e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)}
    else:
        return set()
    named = values & set(OP_TABLE)
    return set() if named <= STRUCTURAL and len(values) == 1 else named


def op_branches(source: str) -> list[tuple[int, str]]:
    """(line, code) of every comparison of an op's name with op literals, and every ``match`` on one."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            for a in sides:
                if _named_op(a) and any(_op_literals(b) for b in sides if b is not a):
                    found.append((node.lineno, ast.unparse(node)))
                    break
        elif isinstance(node, ast.Match) and _named_op(node.subject):
            for case in node.cases:
                for pat in ast.walk(case.pattern):
                    if isinstance(pat, ast.MatchValue) and _op_literals(pat.value):
                        found.append((pat.lineno, f"match {ast.unparse(node.subject)}: case {ast.unparse(pat)}"))
    return found


def _scanned_files() -> list[str]:
    out = []
    for top in SCANNED:
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if not rel.startswith(EXEMPT):
                out.append(rel)
    return out


def test_the_scan_sees_the_spellings_of_a_branch_on_an_op():
    code = """
if nd.op == "conv": pass
if op in ("avg_pool", "max_pool"): pass
if nd["op"] != "activation": pass
if report.ops[i] == "input": pass
if d.get("op") == "sum": pass
if "dense" == row.op: pass
match nd.op:
    case "concat": pass
"""
    assert len(op_branches(code + 'if nd.op == "output": pass\n')) == 8
    allowed = """
if nd.kind == "act": pass
if op in _POOLS: pass
if node.op == "call_module": pass
if OP_TABLE[nd.op].kind == SUM: pass
"""
    assert op_branches(allowed) == []


def test_no_walk_outside_the_table_branches_on_an_op_name():
    files = _scanned_files()
    assert "service/engine/solve.py" in files and "schemas/atoms.py" in files
    bad = [f"{rel}:{line}: {code}" for rel in files for line, code in op_branches((ROOT / rel).read_text())]
    assert not bad, "read the op's row (schemas.ops.OP_TABLE) instead of naming ops:\n" + "\n".join(bad)


def test_the_worker_builds_a_module_for_every_op():
    models = pytest.importorskip("sigprop.worker.models")
    assert set(models.MODULE_BUILDERS) == set(OP_TABLE)


def _kind_dispatches() -> dict[str, dict]:
    from sigprop.engine.network.eoc_network import NODE_KIND_RULES
    from sigprop.engine.network.q_map import Q_SLOPE_RULES
    from sigprop.engine.network.subnetworks import STEP_RULES
    from sigprop.engine.sequence.token_program import TOKEN_RULES

    return {
        "engine.network.eoc_network.NODE_KIND_RULES": NODE_KIND_RULES,
        "engine.network.q_map.Q_SLOPE_RULES": Q_SLOPE_RULES,
        "engine.network.subnetworks.STEP_RULES": STEP_RULES,
        "engine.sequence.token_program.TOKEN_RULES": TOKEN_RULES,
    }


@pytest.mark.parametrize("name", sorted(_kind_dispatches()))
def test_every_kind_of_the_table_has_a_handler_in_each_per_kind_dispatch(name):
    handlers = _kind_dispatches()[name]
    used = {row.kind for row in OP_TABLE.values()}
    assert used <= set(handlers), f"{name} lacks a handler for {sorted(used - set(handlers))}"
    assert set(handlers) <= set(KINDS)


def test_the_client_prediction_rules_every_kind():
    from sigprop.client.prediction import _Predictor

    used = {row.kind for row in OP_TABLE.values()}
    assert used <= set(_Predictor.RULES) | _Predictor.PASSED, sorted(used - set(_Predictor.RULES) - _Predictor.PASSED)
    assert not set(_Predictor.RULES) & _Predictor.PASSED
