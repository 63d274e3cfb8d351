"""The geometric method's second moments composed over atoms, where an atom reaches a sum through
several paths (issue 34).

``geometric``'s recursion (GR-scaling paper, "Scaling laws for the principled design,
initialization, and preconditioning of ReLU networks", arXiv:1906.04267, Appendix B) adds the
second moments of a sum's inputs, ``m = sum_i w_i^2 m_i``: right when the inputs are uncorrelated,
which a dense or conv layer with fresh zero-mean weights guarantees. A stream added again into a
later sum (``x3 = sum(x2, x0, F(x2))`` where x2 already holds x0) is correlated with it: x0's
coefficients add before squaring. As in ``schemas.atoms`` (TAT paper, arXiv:2203.08120, section 2.3),
every node is written as coefficients over independent atoms: the outputs of dense and conv layers,
the network input, and (here) every other node that is not a linear copy: an activation (its second
moment is the gain times its input's), a concatenation, a pool over more than one location. Then a
sum's true second moment is ``sum_a (sum_i w_i c_ia)^2 m_a``, and the factor

    s = sqrt(sum_i w_i^2 m_i / sum_a (sum_i w_i c_ia)^2 m_a)

on its weights (the answer's ``sum_scales``) makes it the recursion's value, so every forward second
moment the method states holds. A sum whose atoms cancel (true second moment 0) has no such factor
and is refused.

The gradient pass runs on the graph with those factors, and composes the same way in reverse: a
node read by several consumers adds their gradients, coherently where they are copies of one
gradient (through sums and pass-through ops), incoherently where a weighted layer (W^T Dy, fresh
weights) or an activation (a mask) made a new one. The forward gains of a perturbation from a layer
to the dominator its gamma ratio is read at (Appendix E.1) compose like the forward pass.

Only graphs with such a sum take these passes; elsewhere the recursion is exact and unchanged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ...errors import SigpropError
from ...schemas.ops import PASS, SUM, rule
from ..graph.build import NetworkGraph


@dataclass(frozen=True)
class Composition:
    """Per node: the amplitudes by input slot of a linear copy (forward, backward), or None where the
    node is an atom of its own; the sums' factors (only where not 1); the sums an atom reached twice."""

    fwd: list[list[float] | None]
    bwd: list[list[float] | None]
    private: tuple[bool, ...]
    scales: dict[int, float]
    merged: frozenset[int]


def compose(graph: NetworkGraph, rules, m: list[float], private) -> Composition:
    """The sums' factors, from one forward pass over atoms at the recursion's moments ``m``."""
    fwd: list[list[float] | None] = []
    bwd: list[list[float] | None] = []
    for nd in graph.nodes:
        if nd.kind == SUM:
            ws = [float(w) for w in nd.attrs["weights"]]
            fwd.append(ws)
            bwd.append(list(ws))
        elif nd.kind == PASS and rule(nd.op).window(nd.attrs, graph.nodes[nd.inputs[0]].shape) == 1:
            fwd.append([math.sqrt(f) for f, _ in rules[nd.index]])
            bwd.append([math.sqrt(b) for _, b in rules[nd.index]])
        else:
            fwd.append(None)
            bwd.append(None)
    comp = Composition(fwd, bwd, tuple(private), {}, frozenset())
    merged: set[int] = set()
    _forward(graph, rules, comp, dict(enumerate(m)), 0, graph.n - 1, merged)
    return Composition(fwd, bwd, tuple(private), comp.scales, frozenset(merged))


def _forward(graph, rules, comp: Composition, seed: dict, lo: int, hi: int, merged: set | None = None):
    """Second moments over atoms on nodes lo..hi. With ``merged`` (the first pass) ``seed`` holds
    every node's recursion moment, which atoms take; the sums an atom reaches twice get their factor
    (written into ``comp``'s amplitudes) and join ``merged``. Otherwise ``seed`` injects unit
    perturbations and every moment is composed."""
    exp: dict[int, dict] = {}
    mom: dict[int, float] = {}
    out = [0.0] * graph.n
    find = merged is not None
    for nd in graph.nodes[lo : hi + 1]:
        v, amps = nd.index, comp.fwd[nd.index]
        if amps is None or (not find and v in seed):
            mv = seed[v] if v in seed else sum(f * out[i] for i, (f, _) in zip(nd.inputs, rules[v], strict=False))
            out[v] = mv
            if mv:
                exp[v], mom[v] = {v: 1.0}, mv
            continue
        acc: dict[int, float] = {}
        twice = False
        for i, w in zip(nd.inputs, amps, strict=True):
            for a, c in exp.get(i, {}).items():
                twice = twice or a in acc
                acc[a] = acc.get(a, 0.0) + w * c
        mv = sum(c * c * mom[a] for a, c in acc.items())
        if find and twice:
            mv = _rescale(graph, comp, nd, acc, mv, seed[v])
            merged.add(v)
        out[v] = mv
        if comp.private and comp.private[v] and mv:
            exp[v], mom[v] = {v: 1.0}, mv  # its atoms reach the rest through it alone
        elif acc:
            exp[v] = acc
    return out


def _rescale(graph, comp: Composition, nd, acc: dict, true: float, target: float) -> float:
    """Set the factor of sum ``nd`` (its amplitudes and ``acc`` in place) so its moment is ``target``."""
    if target <= 0.0:
        return true
    if not true > 1e-12 * target:
        raise SigpropError(
            "unsupported_structure",
            f"sum node '{nd.user_id}' adds the same stream through several paths with weights that cancel: "
            "its second moment is 0, and no factor on its weights gives the GR recursion's value",
            "give the copies weights that do not cancel, or put a dense or conv layer on one of the paths",
        )
    s = math.sqrt(target / true)
    if abs(s - 1.0) > 1e-12:
        comp.scales[nd.index] = s
        for amps in (comp.fwd[nd.index], comp.bwd[nd.index]):
            amps[:] = [a * s for a in amps]
        for a in acc:
            acc[a] *= s
    return target


def backward(graph, rules, comp: Composition, start: int, value: float, lo: int = 0) -> list[float]:
    """Second moments of the gradient pulled back from ``start`` (nodes lo..start), composed over
    gradient atoms: a weighted layer's W^T Dy and an activation's masked gradient are new atoms, and
    sums and pass-through ops copy them with their amplitudes."""
    d = [0.0] * graph.n
    exp: dict[int, dict] = {start: {(start, -1): 1.0}}
    mom: dict[tuple, float] = {(start, -1): value}
    for nd in reversed(graph.nodes[lo : start + 1]):
        v = nd.index
        mine = exp.pop(v, None)
        if not mine:
            continue
        d[v] = sum(c * c * mom[a] for a, c in mine.items())
        amps = comp.bwd[v]
        for slot, i in enumerate(nd.inputs):
            if i < lo:
                continue
            into = exp.setdefault(i, {})
            if amps is None:
                mom[(v, slot)] = rules[v][slot][1] * d[v]
                into[(v, slot)] = 1.0
            else:
                for a, c in mine.items():
                    into[a] = into.get(a, 0.0) + amps[slot] * c
    return d


def segment_gains(graph, rules, comp: Composition, lo: int, z: int, ys) -> tuple[list[float], list[float]]:
    """For each layer y in ``ys`` (in lo..z): the forward gain of a perturbation's second moment from y
    to z and the backward gain from z to y, composed over atoms, indexed y - lo."""
    bwd = backward(graph, rules, comp, z, 1.0, lo)[lo : z + 1]
    fwd = [0.0] * (z - lo + 1)
    for y in ys:
        fwd[y - lo] = _forward(graph, rules, comp, {y: 1.0}, y, z)[z]
    return fwd, bwd
