"""The network program's contract: every implementation gives the same whole answers.

Each implementation of ``engine.network.program.NetworkProgram`` (``IMPLEMENTATIONS``: the general
dominator analysis and the chain shortcuts) is forced into ``solve`` in turn, and its answer,
every numeric field recursively (parameters, achieved values, the sampled C maps, the layers'
initializations, warnings and names exactly), is compared with the answer of a reference program
written here from the definition alone: every prefix of the chain is a largest subnetwork
(TAT paper, arXiv:2203.08120, Appendix B.2), each evaluated node by node, no shortcut, every
derivative by the complex step.

Tolerance: |a - b| <= 1e-12 max(|a|, |b|) + 1e-14 (the floor for values that are 0 up to rounding,
such as C(0) = 1e-17 after a DKS solve). Where the last bits differ, and why (measured on these
graphs; ``test_where_the_last_bits_differ`` pins it):

- the chain's global map runs a smooth phi_hat's short C map series through C o C o C o C
  (``HermiteCMap.iterate``) from 16 layers on, a quarter of the layers at about the same rounding
  (``test_solver_fast_paths.test_composed_global_map_is_as_accurate_as_layer_by_layer``):
  ``network_c_f_0`` and ``c_map.global`` of TAT softplus and DKS swish on MLP-30 and MLP-100
  differ from the layer-by-layer reference by up to 2.5e-14 relative (about 100 ulps after 100
  layers). DKS relu's series is long, so it is run layer by layer, bit for bit.
- everything else is bit for bit the reference's, under both implementations: the chain's closed
  forms (s^L for the maximal slope, forward derivatives for TReLU, the whole chain as the
  maximizer) round differently inside the root searches, but each search stops at the same
  float; EoC, the layers, every string and every refusal are the same.
"""

from __future__ import annotations

import math

import pytest

from sigprop.engine import solve as solve_module
from sigprop.engine.graph.build import NetworkGraph
from sigprop.engine.maps.qc_maps import clear_caches
from sigprop.engine.network.program import IMPLEMENTATIONS, WHOLE_NETWORK, NetworkProgram
from sigprop.errors import SigpropError
from sigprop.schemas.ops import ACT
from sigprop.schemas.solve import SolveRequest

REL, ABS = 1e-12, 1e-14

CASES = {
    # eta = 0.8 is out of reach of the shallow chains: their refusals (which name the reachable
    # value) are compared too
    "tat-leaky_relu": ("tat", "leaky_relu", {"eta": 0.8}),
    "tat-softplus": ("tat", "softplus", {"tau": 0.3}),
    "dks-swish": ("dks", "swish", {"zeta": 1.5}),
    "dks-relu": ("dks", "relu", {"zeta": 1.5}),
    "eoc-tanh": ("eoc", "tanh", {}),
}
GRAPHS = {
    "mlp-1": {"template": "mlp", "depth": 1},
    "mlp-3": {"template": "mlp", "depth": 3},
    "mlp-30": {"template": "mlp", "depth": 30},
    "mlp-100": {"template": "mlp", "depth": 100},
    "cnn-8": {"template": "cnn", "depth": 8},
}


class ReferenceProgram(NetworkProgram):
    """M_{f,r} of a chain from the definition: U_{g,r}(x) of every subnetwork g from the input to
    a node, each computed from scratch, node by node. No shortcut: every quantity is the base
    class's pass (and complex step) over these values."""

    def __init__(self, graph: NetworkGraph, report=None):
        assert all(nd.inputs == ((nd.index - 1,) if nd.index else ()) for nd in graph.nodes)
        slot = {fn: i for i, fn in enumerate(graph.activation_fns())}
        self.layers = [slot[nd.attrs["fn"]] if nd.kind == ACT else None for nd in graph.nodes]
        self.regions, self.depth = graph.n - 1, sum(s is not None for s in self.layers)
        self.output, self.user_ids = graph.output, tuple(nd.user_id for nd in graph.nodes)

    def _through(self, x, r, end: int):
        for s in self.layers[1 : end + 1]:
            if s is not None:
                x = r(x, s)
        return x

    def global_map(self, x, r, repeat=None):
        return self._through(x, r, self.output)

    def candidate_values(self, x, r) -> list:
        return [self._through(x, r, t) for t in range(1, len(self.layers))]

    def argmax(self, x, r) -> str:
        values = self.candidate_values(x, r)
        best, name = float(values[-1]), WHOLE_NETWORK
        for t, v in enumerate(values, 1):
            if v > best * (1 + 1e-12) + 1e-15:
                best, name = v, (WHOLE_NETWORK if t == self.output else f"from the input to {self.user_ids[t]!r}")
        return name


def _answer(monkeypatch, make, case: str, graph: str) -> dict:
    method, activation, targets = CASES[case]
    request = SolveRequest.model_validate(
        {"graph": GRAPHS[graph], "method": method, "activation": activation, "targets": targets}
    )
    used = []
    monkeypatch.setattr(solve_module, "compile_program", lambda g, report=None: used.append(make(g, report)) or used[0])
    clear_caches()  # each answer computes its own tables
    try:
        answer = solve_module.solve(request).model_dump(by_alias=True)
    except SigpropError as err:
        answer = {"error": err.to_dict()}
    assert len(used) == 1 and isinstance(used[0], NetworkProgram)
    return answer


def _differences(got, want, path: str = "") -> list[tuple[str, float]]:
    """(path, relative difference) of every number that is not bit for bit the same; raises for
    a structural difference or a number past the tolerance."""
    if isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys(), path
        return sum((_differences(got[k], want[k], f"{path}.{k}") for k in want), [])
    if isinstance(want, list | tuple):
        assert isinstance(got, list | tuple) and len(got) == len(want), path
        return sum((_differences(g, w, f"{path}[{i}]") for i, (g, w) in enumerate(zip(got, want, strict=True))), [])
    if isinstance(want, float) and not isinstance(want, bool):
        assert isinstance(got, float), path
        if got == want or (math.isnan(got) and math.isnan(want)):
            return []
        assert abs(got - want) <= REL * max(abs(got), abs(want)) + ABS, (path, got, want)
        return [(path, abs(got - want) / max(abs(got), abs(want)))]
    assert got == want, (path, got, want)
    return []


@pytest.mark.parametrize("graph", sorted(GRAPHS))
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("implementation", sorted(IMPLEMENTATIONS))
def test_every_implementation_gives_the_reference_answer(monkeypatch, implementation, case, graph):
    want = _answer(monkeypatch, ReferenceProgram, case, graph)
    got = _answer(monkeypatch, IMPLEMENTATIONS[implementation], case, graph)
    _differences(got, want)


def test_the_default_program_is_the_chain_implementation(monkeypatch):
    """``compile_program`` picks the chain implementation for a chain: the service's answers are
    the chain's, bit for bit."""
    request = SolveRequest.model_validate(
        {"graph": GRAPHS["mlp-100"], "method": "dks", "activation": "swish", "targets": {"zeta": 1.5}}
    )
    clear_caches()
    default = solve_module.solve(request).model_dump(by_alias=True)
    assert _differences(_answer(monkeypatch, IMPLEMENTATIONS["chain"], "dks-swish", "mlp-100"), default) == []


def test_where_the_last_bits_differ(monkeypatch):
    """The module docstring's account of the last bits, on MLP-100: only the chain's composed
    global map of a smooth phi_hat differs from the reference, and only in the fields it makes."""
    for case in sorted(CASES):
        want = _answer(monkeypatch, ReferenceProgram, case, "mlp-100")
        assert _differences(_answer(monkeypatch, IMPLEMENTATIONS["general"], case, "mlp-100"), want) == [], case
        chain = _differences(_answer(monkeypatch, IMPLEMENTATIONS["chain"], case, "mlp-100"), want)
        if case not in ("tat-softplus", "dks-swish"):
            assert chain == [], case
            continue
        assert {path.split("[")[0] for path, _ in chain} == {".network_c_f_0", ".c_map.global"}, case
        assert max(d for _, d in chain) <= 1e-13, case
