"""The network program: every network-level quantity the methods need, behind one interface.

TAT, DKS and the Edge of Chaos methods see a network only through the maps of "Deep Learning
without Shortcuts: Shaping the Kernel with Tailored Rectifiers" (Zhang et al., arXiv:2203.08120),
Appendix B: the global C map C_f = U_{f,C} and the subnetwork maximizing function
M_{f,r}(x) = max_g U_{g,r}(x) (``subnetworks``). ``NetworkProgram`` owns them and what the methods
build from them:

- ``max_c0(a)``, ``max_c0_and_derivative(a)``: mu_f^0(a) = M_{f,C_a}(0) for the Tailored Rectifier
  of negative slope a, C_a its closed-form local C map (equation 9), and d mu_f^0 / da (Algorithm 1);
- ``max_slope(s)``, ``max_slope_and_derivative(s)``: the maximal slope function
  mu_f^1(s) = M_{f,r_1}(1), r_1(y) = s y (Appendix B.1, DKS), and its derivative in s;
- ``max_slope_and_curvature(slopes, curvs)``: the pair (max_g C'_g(1), max_g C''_g(1)), and
  ``curvature_multiplier()``: kappa with mu_f^2(C''(1)) = kappa C''(1) (Appendix B.4);
- ``global_map(x, r, repeat)``: U_{f,r}(x), C_f itself when r is the local C map;
- ``c0_maximizer``, ``slope_maximizer``, ``curvature_maximizer``: the subnetwork that attains each
  maximum, which an answer names when it is not the whole network (the maximizer note).

Two implementations stand behind it, the way stax's ``repeat`` is its own combinator, documented
and tested as equal to ``serial``: ``GeneralProgram`` for any DAG (the dominator analysis of
``subnetworks``), and ``ChainProgram`` for a chain (node k reads node k - 1: an MLP, a plain CNN),
which runs a running value instead of a table of node values and answers the maximizations in
closed form where a monotonicity argument allows, each argument written once next to its shortcut.
``compile_program`` picks one; no method asks which it has. ``tests/engine/test_program_contract.py``
compares whole answers over both.

Kernels that are not a scalar per input pair (next: T x T token kernels for attention) fit the
same seam. Every pass here is generic in the value it carries: numbers, complex numbers (the
complex step) and numpy arrays evaluated elementwise (c_map samples, the EoC pass's (q c, q)
vector); sums and concatenations are real linear maps (``subnetworks._step``) and act on any
such value. A kernel-valued implementation would carry an array of shape (..., T, T) per node and
provide: ``global_map`` with local maps r(K, slot) that take and return such kernels (attention
mixes tokens, so a layer is no longer entrywise); the linear steps unchanged, applied to whole
kernels; a reduction that turns a kernel into the scalar M_{f,r} maximizes (the largest
off-diagonal correlation, say), stated by the implementation, so that ``candidate_values`` and
``argmax`` compare scalars; and the quantities above defined through that reduction (C(0) would be
the largest correlation a pair of orthogonal tokens reaches). The shortcuts of ``ChainProgram``
hold for it only where the same monotonicity holds for the reduced value.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence

import numpy as np

from ...errors import SigpropError
from ...schemas.ops import ACT, MAX_PAIR, SOURCE
from ...schemas.structure import StructureReport
from ..graph.build import NetworkGraph
from ..maps.qc_maps import leaky_relu_c_map_scalar, rectifier_k, tailored_c_map_complex
from ..methods.roots import complex_step
from .subnetworks import (
    LocalMap,
    Product,
    SubnetworkProgram,
    compile_subnetworks,
    jet_product,
    max_pair_jet,
    slope_product,
    value_product,
)

# repeat(x, n): r applied n times, for an r that is the same at every slot (a faster or more
# accurate form of the n-fold composition: ``HermiteCMap.iterate``, ``rectifier_chain_map``)
Repeat = Callable[[object, int], object]

WHOLE_NETWORK = "the whole network"


class NetworkProgram(ABC):
    """The network-level quantities of one network (module docstring). Implementations provide
    the passes (``global_map``, ``candidate_values``, ``argmax``) and may answer any quantity
    faster, never differently beyond rounding."""

    regions: int  # the number of largest subnetworks, one per endpoint
    # whether some node is a product (``mul``): the slope passes carry it by the product rule
    # (``subnetworks.slope_product``, ``jet_product``), and mu_f^2 is no longer linear in C''(1)
    has_products: bool = False
    # whether some node is a max pair (``max_pool`` of feature pairs): every pass carries it by its own rule
    # (``subnetworks.PAIR_RULES``: the C map, C'(1) = 1, and no curvature: C''(1) is infinite)
    has_max_pairs: bool = False

    @property
    def per_pass(self) -> bool:
        """Whether the passes need their own rule at some node (a product or a max pair)."""
        return self.has_products or self.has_max_pairs

    depth: int  # the most nonlinear layers on a path from an input to the output
    output: int
    user_ids: tuple[str, ...]

    @abstractmethod
    def global_map(self, x, r: LocalMap, repeat: Repeat | None = None):
        """U_{f,r}(x) for the whole network f (with r the local C map: the global C map C_f).
        ``repeat``: r's n-fold composition, when r is the same at every slot (an implementation
        may use it in place of n calls of r)."""

    @abstractmethod
    def candidate_values(self, x, r: LocalMap, product: Product = value_product) -> list:
        """The values M_{f,r}(x) is the maximum of (U_{g,r}(x) of the largest subnetworks g, less
        any that an implementation knows repeat another)."""

    @abstractmethod
    def argmax(self, x: float, r: LocalMap, product: Product = value_product) -> str:
        """A readable name of the subnetwork that attains M_{f,r}(x)."""

    def maximize(self, x, r: LocalMap, product: Product = value_product):
        """M_{f,r}(x); x may be a float, a complex number or a numpy array (elementwise). ``product``:
        how a ``mul`` node combines its factors' values in this pass (the C map's own product by default)."""
        # only a graph with products needs the rule (implementations without products take two arguments)
        found = self.candidate_values(x, r, product) if self.per_pass else self.candidate_values(x, r)
        if len(found) == 1:
            return found[0]
        # one reduction instead of a numpy call per endpoint (thousands on a ladder)
        return np.maximum.reduce(np.asarray(found))

    def max_c0(self, a: float) -> float:
        """mu_f^0(a) = M_{f,C_a}(0): the maximal C_g(0) over subnetworks g for the Tailored
        Rectifier of negative slope a (Appendix B.1, equation 9)."""
        return self.maximize(0.0, lambda c, _slot: leaky_relu_c_map_scalar(c, a))

    def max_c0_and_derivative(self, a: float) -> tuple[float, float]:
        """(mu_f^0(a), d mu_f^0 / da), by the complex step (``roots``) through the pass."""

        def mu0(z: complex) -> complex:
            k = rectifier_k(z)
            return complex(self.maximize(0.0, lambda c, _slot: tailored_c_map_complex(c, k)))

        return complex_step(mu0, a)

    def max_slope(self, s: float) -> float:
        """mu_f^1(s) = M_{f,r_1}(1), r_1(y) = s y: the maximal C'_g(1) over subnetworks g when every
        layer has C'(1) = s (Appendix B.1)."""
        return float(self.maximize(1.0, lambda y, _slot: s * y, slope_product))

    def max_slope_and_derivative(self, s: float) -> tuple[float, float]:
        """(mu_f^1(s), d mu_f^1 / ds), by the complex step through the pass."""
        return complex_step(lambda z: self.maximize(1.0, lambda y, _slot: z * y, slope_product), s)

    def curvature_multiplier(self) -> float:
        """kappa with mu_f^2(C''(1)) = kappa C''(1): M_{f,r_2}(0) with r_2(y) = 1 + y (Appendix
        B.4 with C''(1) = 1 and C'(1) = 1). Refused for a graph with a product: there a product of
        two factors of slope 1 has C'(1) = 2 and C''(1) = C_u'' + 2 + C_v'', so mu_f^2 is not kappa C''(1)."""
        self._no_products("TAT for smooth activations (target tau)")
        self._no_max_pairs()
        return float(self.maximize(0.0, lambda y, _slot: 1.0 + y))

    def _no_products(self, what: str) -> None:
        if self.has_products:
            raise SigpropError(
                "unsupported_structure",
                f"{what} assumes C'(1) = 1 at every node, but the graph has a mul node: a product of two streams "
                "has C'(1) = C_u'(1) + C_v'(1) (2 for two factors of slope 1), so the curvature recipe of TAT "
                "Appendix B.4 does not apply",
                "use method 'dks' (target zeta; its slope and curvature passes carry products exactly), TAT with "
                "'leaky_relu' (target eta), or 'eoc'",
            )

    def _no_max_pairs(self) -> None:
        if self.has_max_pairs:
            max_pair_jet(1.0)  # raises: C''(1) of a max pair is infinite

    def max_slope_and_curvature(self, local_slope, local_curv) -> np.ndarray:
        """(max_g C'_g(1), max_g C''_g(1)) over subnetworks g, for any local C'(1) and C''(1).

        The pair (C'(1), C''(1)) of a composition follows the chain rule at the fixed point 1:
        (s y1, C''(1) y1^2 + s y2) for a layer after a subnetwork with (y1, y2); normalized sums
        and concatenations average both linearly. With C'(1) = 1 (TAT) the second component is
        the B.4 recipe; DKS needs the general form because its layers have C'(1) = zeta^(1/L) != 1.
        ``local_slope`` and ``local_curv`` are numbers, or one per activation function slot."""
        slopes, curvs = _per_slot(local_slope), _per_slot(local_curv)

        # the pair (y1, y2) travels as the complex number y1 + i y2: sums and concatenations are
        # real linear maps, which act on both parts alike, and a layer is s y + i k y1^2
        def layer(y, slot):
            s, k = slopes(slot), curvs(slot)
            return s * y + 1j * (k * y.real * y.real)

        extra = (jet_product,) if self.per_pass else ()
        found = [complex(v) for v in self.candidate_values(complex(1.0, 0.0), layer, *extra)]
        return np.array([max(v.real for v in found), max(v.imag for v in found)])

    def c0_maximizer(self, a: float) -> str:
        """The subnetwork that attains mu_f^0(a) (``argmax``)."""
        return self.argmax(0.0, lambda c, _slot: leaky_relu_c_map_scalar(c, a))

    def slope_maximizer(self, slopes: Sequence[float]) -> str:
        """The subnetwork that attains mu_f^1 with C'(1) = slopes[slot] per function slot."""
        extra = (slope_product,) if self.per_pass else ()
        return self.argmax(1.0, lambda y, slot: slopes[slot] * y, *extra)

    def curvature_maximizer(self, curvs: Sequence[float]) -> str:
        """The subnetwork that attains mu_f^2 with C''(1) = curvs[slot] per function slot (C'(1) = 1)."""
        self._no_products("TAT for smooth activations (target tau)")
        self._no_max_pairs()
        return self.argmax(0.0, lambda y, slot: curvs[slot] + y)


def _per_slot(values) -> Callable[[int], float]:
    """A number, or one per function slot, as a function of the slot."""
    found = [float(v) for v in np.atleast_1d(values)]
    if len(found) == 1:
        one = found[0]
        return lambda _slot: one
    return found.__getitem__


class GeneralProgram(NetworkProgram):
    """Any DAG: the largest subnetwork ending at each node from the dominator and post-dominator
    trees, and a pass per group of them (``subnetworks.compile_subnetworks``)."""

    def __init__(self, passes: SubnetworkProgram):
        self.passes = passes
        self.has_products, self.has_max_pairs = passes.has_products, passes.has_max_pairs
        self.regions, self.depth = passes.regions, passes.depth
        self.output, self.user_ids = passes.output, passes.user_ids

    def global_map(self, x, r: LocalMap, repeat: Repeat | None = None):
        return self.passes.global_map(x, r)

    def candidate_values(self, x, r: LocalMap, product: Product = value_product) -> list:
        return self.passes.endpoint_values(x, r, product)

    def argmax(self, x: float, r: LocalMap, product: Product = value_product) -> str:
        return self.passes.argmax(x, r, product)


class ChainProgram(NetworkProgram):
    """A chain: node k reads node k - 1 only (an MLP, a plain CNN; the canonical numbering lays out
    any graph without a two-input node this way). Every node is dominated by the one before it and
    post-dominated by the one after it, so the largest subnetwork ending at any node runs from the
    input: one group, the whole network, every node an endpoint (what ``GeneralProgram`` finds the
    long way; the tests compare the two). A pass is a running value, and affine layers, which
    repeat the value before them, are left out of ``candidate_values``."""

    def __init__(self, graph: NetworkGraph):
        """``graph`` is a chain (``is_chain``; ``chain_program`` checks it)."""
        nodes = graph.nodes
        fn_slot = {fn: i for i, fn in enumerate(graph.activation_fns())}
        self.acts = tuple([nd.index for nd in nodes if nd.kind == ACT])
        self.slots = tuple([fn_slot[nodes[v].attrs["fn"]] for v in self.acts])
        # an endpoint ahead of the first activation (the whole chain when it has none) holds the input
        self.keeps_input = not self.acts or self.acts[0] != 1
        self.regions, self.depth = graph.n - 1, len(self.acts)
        self.output, self.user_ids = graph.output, tuple([nd.user_id for nd in nodes])

    def global_map(self, x, r: LocalMap, repeat: Repeat | None = None):
        if repeat is not None and len(set(self.slots)) <= 1:
            return repeat(x, len(self.slots))
        for slot in self.slots:
            x = r(x, slot)
        return x

    def candidate_values(self, x, r: LocalMap, product: Product = value_product) -> list:
        found = [x] if self.keeps_input else []  # a chain has no product: ``product`` is never needed
        for slot in self.slots:
            x = r(x, slot)
            found.append(x)
        return found

    def argmax(self, x: float, r: LocalMap, product: Product = value_product) -> str:
        vals, acts, k = [], dict(zip(self.acts, self.slots, strict=True)), x
        for node in range(1, len(self.user_ids)):
            if node in acts:
                k = r(k, acts[node])
            vals.append(k)
        best, name = float(vals[-1]), WHOLE_NETWORK
        for node, v in enumerate(vals, 1):
            if v > best * (1 + 1e-12) + 1e-15:
                best = v
                name = WHOLE_NETWORK if node == self.output else f"from the input to {self.user_ids[node]!r}"
        return name

    def max_c0(self, a: float) -> float:
        return self.max_c0_and_derivative(a)[0]

    def max_c0_and_derivative(self, a: float) -> tuple[float, float]:
        """Equation 9's C(c) = c + k g(c), g(c) = sqrt(1 - c^2) - c arccos c >= 0, never decreases
        c, so the largest C_g(0) over a chain's subnetworks is the whole chain's, C^(L)(0), and the
        whole chain attains it (``c0_maximizer``). Its derivative follows by forward
        differentiation: dC/dc = 1 - k arccos c and dC/dk = g(c), with k = (1 - a)^2 / (pi (1 + a^2))
        and dk/da = -2 (1 - a)(1 + a) / (pi (1 + a^2)^2). The general pass's numbers with the
        complex step, a few times faster (real arithmetic, no local map call per layer)."""
        k = rectifier_k(a)
        dk = -2.0 * (1.0 - a) * (1.0 + a) / (math.pi * (1.0 + a * a) ** 2)
        c = dc = 0.0
        sqrt, acos = math.sqrt, math.acos
        for _ in range(len(self.slots)):
            t = acos(c)
            g = sqrt(1.0 - c * c) - c * t
            dc = (1.0 - k * t) * dc + dk * g
            c += k * g
            if c > 1.0:  # only by rounding: C(c) <= 1
                c = 1.0
        return c, dc

    def c0_maximizer(self, a: float) -> str:
        return WHOLE_NETWORK  # equation 9 never decreases c (``max_c0_and_derivative``)

    def max_slope(self, s: float) -> float:
        if not _never_lowers([s]):
            return super().max_slope(s)
        return _power(s, len(self.slots))

    def max_slope_and_derivative(self, s: float) -> tuple[float, float]:
        if not _never_lowers([s]):
            return super().max_slope_and_derivative(s)
        layers = len(self.slots)
        return _power(s, layers), layers * _power(s, layers - 1)

    def max_slope_and_curvature(self, local_slope, local_curv) -> np.ndarray:
        slopes, curvs = np.atleast_1d(local_slope), np.atleast_1d(local_curv)
        if not _never_lowers(slopes, curvs):
            return super().max_slope_and_curvature(local_slope, local_curv)
        slope, curv = _per_slot(slopes), _per_slot(curvs)
        y1, y2 = 1.0, 0.0
        for slot in self.slots:
            s, k = slope(slot), curv(slot)
            y1, y2 = s * y1, k * y1 * y1 + s * y2
        return np.array([y1, y2])

    def slope_maximizer(self, slopes: Sequence[float]) -> str:
        return WHOLE_NETWORK if _never_lowers(slopes) else super().slope_maximizer(slopes)

    def curvature_maximizer(self, curvs: Sequence[float]) -> str:
        return WHOLE_NETWORK if _never_lowers([1.0], curvs) else super().curvature_maximizer(curvs)


def _never_lowers(slopes, curvs=(0.0,)) -> bool:
    """Whether every layer raises the pair (C'(1), C''(1)) of what it reads, from (1, 0).

    A layer maps the pair (y1, y2) of the subnetwork before it to (s y1, k y1^2 + s y2)
    (``max_slope_and_curvature``). With every s >= 1 and k >= 0, y1 >= 1 and y2 >= 0 hold all
    along a chain and neither component ever decreases, so a chain's subnetworks (each runs from
    the input) reach their largest values at the whole chain: mu_f^1 is s^L (the slope alone,
    r_1(y) = s y from y = 1), the pair is the whole chain's, and with s = 1 the curvature recipe
    r_2(y) = k + y gives mu_f^2 at the whole chain too."""
    return min(float(s) for s in slopes) >= 1.0 and min(float(k) for k in curvs) >= 0.0


def _power(x: float, n: int) -> float:
    """x^n, or inf past the largest float (as the pass's products overflow)."""
    try:
        return float(x**n)
    except OverflowError:
        return math.inf


def is_chain(graph: NetworkGraph) -> bool:
    """Whether node k reads node k - 1 only, from an input at node 0, and every nonlinear node is an
    activation (a max pair has its own rule per pass, which the general passes carry)."""
    return graph.nodes[0].kind == SOURCE and all(
        nd.inputs == (nd.index - 1,) and nd.kind != MAX_PAIR for nd in graph.nodes[1:]
    )


def general_program(graph: NetworkGraph, report: StructureReport | None = None) -> GeneralProgram:
    """The general implementation, whatever the graph (``report``: see ``compile_subnetworks``)."""
    return GeneralProgram(compile_subnetworks(graph, report))


def chain_program(graph: NetworkGraph, report: StructureReport | None = None) -> ChainProgram:
    """The chain implementation; ValueError unless the graph is a chain. A chain has no sum, so
    the structure report changes nothing."""
    if not is_chain(graph):
        raise ValueError("the graph is not a chain: some node does not read exactly the node before it")
    return ChainProgram(graph)


def compile_program(graph: NetworkGraph, report: StructureReport | None = None) -> NetworkProgram:
    """The program of a graph: the chain implementation where it applies, else the general one."""
    return ChainProgram(graph) if is_chain(graph) else general_program(graph, report)


# every implementation, by name, each built by a public constructor (the contract tests run them all)
IMPLEMENTATIONS: dict[str, Callable[..., NetworkProgram]] = {"general": general_program, "chain": chain_program}
