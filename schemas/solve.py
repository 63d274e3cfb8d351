"""Wire models of ``POST /v1/solve``: the request, the answer, and the error object (contract 2-3).

The answer's contract keys (``key``, the activation parameters, ``sigma_w2``/``sigma_b2``, the
achieved values, ``layers``, ``cached``, ``warnings``) sit at the top level; absent parameters
are omitted rather than sent as zero, so answers are serialized with ``exclude_none``.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, model_validator

from .activations import ActivationName, canonical_name
from .graph import Graph, Template
from .shapings import (
    DEFAULT_FINAL_GAMMA,
    DEFAULT_FINAL_RHO,
    DEFAULT_TEMPERATURE,
    SHAPING_TABLE,
    ScheduleName,
    ShapingName,
)

SOLUTION_SCHEMA = "sigprop.solution/v1"

Method = Literal["tat", "dks", "eoc", "sparse_eoc", "geometric"]
SEQUENCE_METHODS = ("tat", "dks")  # the methods that solve sequence graphs (attention, layer_norm)
# The targets each method reads (contract section 2's table; the engine's registry is built on it).
# Any other target must be absent or null: the validator answers 422 invalid_target otherwise, and
# the JSON Schema says the same (``_targets_by_method``), so a schema-valid request is one it takes.
METHOD_TARGETS: dict[str, tuple[str, ...]] = {
    "tat": ("eta", "tau"),
    "dks": ("zeta", "local_q_slope"),
    "eoc": ("q_star",),
    "sparse_eoc": ("sparsity", "v_slope", "q_star"),
    "geometric": (),
}
# strict like the graph's numbers (schemas/graph.py): "0.9" is refused, 1 is taken for 1.0
FiniteFloat = Annotated[StrictFloat, Field(allow_inf_nan=False, ge=-1e12, le=1e12)]


class Targets(BaseModel):
    """What the solution must achieve; which keys a method needs is in the contract's table."""

    model_config = ConfigDict(extra="forbid")

    eta: FiniteFloat | None = Field(
        default=None, description="TAT Leaky ReLU: maximal C_f(0) over subnetworks, in [0, 1)"
    )
    tau: FiniteFloat | None = Field(default=None, description="TAT smooth: maximal C''_f(1) over subnetworks, > 0")
    zeta: FiniteFloat | None = Field(default=None, description="DKS: maximal C'_f(1) over subnetworks, > 1")
    local_q_slope: FiniteFloat | None = Field(
        default=None,
        description="DKS: per-layer Q'(1), > 0 (default 1; dks's local_q_slope_target, used in the DKS paper's "
        "ablations); ReLU has no degree of freedom for it and ignores it, as dks does",
    )
    sparsity: FiniteFloat | None = Field(default=None, description="sparse EoC: fraction of zeros, in (0, 1)")
    v_slope: FiniteFloat | None = Field(default=None, description="sparse EoC (clipped kinds): V'(q*)")
    q_star: FiniteFloat | None = Field(default=None, description="fixed point of the variance map, > 0 (default 1)")


class TrainableOptions(BaseModel):
    """Parameters the client should make trainable (trainable-TAT and scaled-residuals paper)."""

    model_config = ConfigDict(extra="forbid")

    negative_slope: StrictBool = Field(default=False, description="TReLU with a trainable negative slope (section 2.1)")
    residual_beta: Literal["none", "global", "per_layer"] = Field(
        default="none", description="residual sums as x + beta / sqrt(L) F(x) with a trainable beta (section 2.2)"
    )
    beta: Annotated[StrictFloat, Field(gt=0.0, le=10.0, allow_inf_nan=False)] = Field(
        default=0.5, description="initial beta (the paper's best, 0.5)"
    )
    prune_fraction: Annotated[StrictFloat, Field(ge=0.0, lt=1.0, allow_inf_nan=False)] = Field(
        default=0.1,
        description="blocks whose trained beta falls below this fraction of the largest can be replaced by the "
        "identity (effective depth)",
    )


# the request keys each attention shaping takes besides ``shaping`` (``schemas.shapings``)
SHAPING_KEYS: dict[str, tuple[str, ...]] = {name: s.keys for name, s in SHAPING_TABLE.items()}


def _keys_by_shaping(schema: dict) -> None:
    """JSON Schema of ``AttentionRequest``: which parameters each shaping takes, as ``SHAPING_KEYS``
    says (one branch per shaping; a parameter the shaping does not take may only be null)."""
    names = ("final_gamma", "final_rho", "temperature")
    schema["oneOf"] = [
        {
            "properties": {
                "shaping": {"const": shaping},
                **{k: {"type": "null"} for k in names if k not in allowed},
                "schedule": (
                    {"anyOf": [{"enum": list(SHAPING_TABLE[shaping].schedules)}, {"type": "null"}]}
                    if SHAPING_TABLE[shaping].schedules
                    else {"type": "null"}
                ),
            }
        }
        for shaping, allowed in SHAPING_KEYS.items()
    ]


class AttentionRequest(BaseModel):
    """How to shape every ``attention`` node (required iff the graph has one; contract section 2)."""

    model_config = ConfigDict(extra="forbid", json_schema_extra=_keys_by_shaping)

    shaping: ShapingName = Field(
        description="e-spa: exponential target kernels exp(-gamma_l |i-j|) (He et al. section 3); u-spa: uniform "
        "targets (1 - rho_l) I + rho_l 11^T; value-skipinit: A = alpha I + beta softmax, alpha 1 and beta 0 at init "
        "(section 4); shaped: A = I + softmax(logits / tau) - softmax(mask) (Noci et al.)"
    )
    final_gamma: Annotated[StrictFloat, Field(gt=0.0, le=50.0, allow_inf_nan=False)] | None = Field(
        default=None,
        description="e-spa: gamma_L of the last attention layer's target kernel (default 0.005, the default of a "
        "public re-implementation of the paper)",
    )
    final_rho: Annotated[StrictFloat, Field(ge=0.0, lt=1.0, allow_inf_nan=False)] | None = Field(
        default=None, description="u-spa: rho_L of the last attention layer's target kernel (default 0.8, ours)"
    )
    temperature: Annotated[StrictFloat, Field(gt=0.0, le=1e6, allow_inf_nan=False)] | None = Field(
        default=None, description="shaped: tau_0 in tau = tau_0 sqrt(d_model d_head) (default 1)"
    )
    schedule: ScheduleName | None = Field(
        default=None,
        description="e-spa, u-spa: 'joint' (the default) chooses each attention's target with the MLP blocks' C maps "
        "so that the output kernel keeps q = 1 and has the requested kernel's mean correlation (u-spa: is the "
        "requested kernel); 'paper' moves the kernel by attention alone (He et al. section 3)",
    )

    @model_validator(mode="after")
    def _keys_of_the_shaping(self):
        allowed = SHAPING_KEYS[self.shaping]
        extra = [k for k in ("final_gamma", "final_rho", "temperature") if getattr(self, k) is not None]
        extra = [k for k in extra if k not in allowed]
        if extra:
            raise ValueError(
                f"shaping {self.shaping!r} does not take {', '.join(extra)} "
                f"(it takes {', '.join(allowed) or 'nothing'})"
            )
        shaping = SHAPING_TABLE[self.shaping]
        if self.schedule is not None and self.schedule not in shaping.schedules:
            if not shaping.schedules:
                raise ValueError(f"shaping {self.shaping!r} takes no schedule (its attention is the identity at init)")
            raise ValueError(f"shaping {self.shaping!r} has no {self.schedule!r} schedule")
        return self

    def schedule_name(self) -> str | None:
        """The schedule solved for: the request's, or the shaping's default (None: no schedule)."""
        return self.schedule or SHAPING_TABLE[self.shaping].default_schedule

    def parameters(self) -> dict[str, float]:
        """The shaping's parameters with their defaults: what the answer is solved for (and keyed on)."""
        defaults = {
            "final_gamma": DEFAULT_FINAL_GAMMA,
            "final_rho": DEFAULT_FINAL_RHO,
            "temperature": DEFAULT_TEMPERATURE,
        }
        return {
            k: float(getattr(self, k) if getattr(self, k) is not None else defaults[k])
            for k in SHAPING_KEYS[self.shaping]
        }


def _targets_by_method(schema: dict) -> None:
    """JSON Schema of ``SolveRequest``: which targets each method takes, as ``METHOD_TARGETS`` says
    (one branch per method; a target the method does not read may only be null)."""
    names = list(Targets.model_fields)
    schema["oneOf"] = [
        {
            "properties": {
                "method": {"const": method},
                "targets": {"properties": {t: {"type": "null"} for t in names if t not in used}},
            }
        }
        for method, used in METHOD_TARGETS.items()
    ]
    schema["allOf"] = _sequence_rules()


# a graph with token streams: the transformer template, or nodes with attention / layer_norm / a sequence input
_SEQUENCE_OPS = {"properties": {"op": {"enum": ["attention", "layer_norm"]}}, "required": ["op"]}
_SEQUENCE_INPUT = {"properties": {"sequence": {"const": True}}, "required": ["sequence"]}
_ATTENTION_NODE = {"properties": {"op": {"const": "attention"}}, "required": ["op"]}
_TRANSFORMER = {"properties": {"template": {"const": "transformer"}}, "required": ["template"]}


def _graph_with(nodes: dict, template: bool) -> dict:
    """A request whose graph is the transformer template (``template``) or has a node matching ``nodes``."""
    graphs = [{"properties": {"nodes": {"contains": nodes}}, "required": ["nodes"]}]
    if template:
        graphs.append(_TRANSFORMER)
    return {"properties": {"graph": {"anyOf": graphs}}, "required": ["graph"]}


def _sequence_rules() -> list[dict]:
    """JSON Schema of the sequence rules (contract section 2, ``attention``): a graph with attention
    nodes needs ``attention``, any other graph takes none; a sequence graph is solved by tat or dks."""
    has_attention = _graph_with(_ATTENTION_NODE, template=True)
    return [
        {
            "if": has_attention,
            "then": {"required": ["attention"], "properties": {"attention": {"type": "object"}}},
            "else": {"properties": {"attention": {"type": "null"}}},
        },
        {
            "if": _graph_with({"anyOf": [_SEQUENCE_OPS, _SEQUENCE_INPUT]}, template=True),
            "then": {"properties": {"method": {"enum": list(SEQUENCE_METHODS)}}},
        },
    ]


class SolveRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", json_schema_extra=_targets_by_method)

    graph: Graph | Template
    method: Method
    activation: ActivationName
    targets: Targets = Field(default_factory=Targets)
    init: Literal["orthogonal", "gaussian"] = Field(
        default="orthogonal",
        description="weight distribution: scale-corrected uniform orthogonal (Orthogonal Delta for convs) or Gaussian "
        "fan-in",
    )
    c_map_points: StrictInt = Field(default=33, ge=3, le=257, description="samples of the global C map on [-1, 1]")
    trainable: TrainableOptions | None = None
    roots: Literal["first", "all"] = Field(
        default="first",
        description="first: the root the search takes (contract: root selection); all: also look for the other "
        "roots of the same conditions (tat and dks with smooth functions) and list them in other_roots",
    )
    attention: AttentionRequest | None = Field(
        default=None,
        description="how to shape the graph's attention nodes; required iff the graph has one (methods tat and dks)",
    )
    assumptions: Literal["strict", "warn"] = Field(
        default="strict",
        description="strict: a graph outside the kernel theory (an activation whose input holds post-activation "
        "features, such as post-activation residual blocks) is refused with unsupported_structure; "
        "warn: solve anyway, the answer's warnings naming the predictions that do not hold",
    )


class LayerInit(BaseModel):
    """How to initialize one weighted node (TAT paper Appendix D; DKS paper section 'Parameter distributions')."""

    id: str
    node: int = Field(description="canonical index of the node (post-order from the output)")
    op: Literal["dense", "conv"]
    fan_in: int
    fan_out: int
    kernel: list[int] | None = None
    distribution: Literal["scaled_uniform_orthogonal", "orthogonal_delta", "gaussian"]
    gain: float = Field(
        description="multiplier on an orthonormal matrix (SUO: max(sqrt(fan_out/fan_in), 1) * sqrt(sigma_w2)); for "
        "gaussian the standard deviation"
    )
    weight_variance: float = Field(
        description="per-entry variance of the weights, sigma_w2 / fan_in (effective fan-in for Delta)"
    )
    bias: Literal["zeros", "gaussian", "none"]
    bias_variance: float = 0.0
    q: float | None = Field(
        default=None,
        description="eoc: the mean square per feature of the layer's output for network inputs of q = 1 (q_star)",
    )
    # geometric (GR scaling paper): the layer output is multiplied by alpha; gamma is its
    # predicted GR scaling (equation 1), equal across layers when the scaling is balanced
    alpha: float | None = Field(
        default=None, description="conditioning multiplier on the layer output (GR paper section 5, Appendix E)"
    )
    weight_second_moment: float | None = Field(
        default=None, description="E[(alpha W)^2] = c / sqrt(fan_in fan_out) (GR equation 7; / k^2 for convs, Remark 6)"
    )
    gamma: float | None = Field(
        default=None, description="predicted GR scaling of the layer (GR Proposition 3, equation 1)"
    )


class RootInfo(BaseModel):
    """Which root of the nonlinear system was taken, when several exist."""

    starting_point: list[float]
    attempt: int = Field(description="index of the starting point in the deterministic search order")
    rejected: int = Field(description="converged roots rejected as unstable (input_scale * output_scale >= 2)")


class OtherRoot(BaseModel):
    """Another root of the same conditions (request ``"roots": "all"``): a different network that meets
    every condition as the chosen root does, with what tells them apart."""

    input_scale: float
    input_shift: float
    output_scale: float
    output_shift: float
    local_c_0: float = Field(description="C(0) of one layer with this root")
    network_c_f_0: float = Field(description="the whole network's global C map at 0 with this root")
    network_c_f_0_5: float = Field(description="the whole network's global C map at 0.5 with this root")


class ResidualBeta(BaseModel):
    mode: Literal["global", "per_layer"]
    init: float
    blocks: int = Field(description="L: residual sums in the graph")
    scale: float = Field(description="beta / sqrt(L): the initial factor on each residual branch")
    sums: list[str] = Field(description="ids of the sum nodes to rewrite as x + beta / sqrt(L) F(x)")
    prune_fraction: float


class TrainableAnswer(BaseModel):
    negative_slope: bool = False
    residual_beta: ResidualBeta | None = None


class CMapSample(BaseModel):
    c: list[float]
    global_: list[float] = Field(alias="global")
    local: list[float]
    untransformed: list[float] | None = None
    activation: list[float] | None = Field(
        default=None,
        description="eoc, sparse_eoc: the activation's own C map at q*, E[phi(u) phi(v)] / E[phi(u)^2] for u, v of "
        "variance q* and correlation c (``local`` composes it with the weighted layer reading it): what the network "
        "does at an activation node",
    )
    scope: Literal["example", "location"] | None = Field(
        default=None,
        description="example: the map of two whole inputs (dense networks); location: the map of two inputs at one "
        "spatial location (Delta-initialized convolutions act on each location independently), with "
        "pooling across locations treated as the identity",
    )

    model_config = ConfigDict(populate_by_name=True)


class AssumptionReport(BaseModel):
    """Whether the graph is inside the kernel theory's family (TAT paper section 2.3)."""

    mode: Literal["strict", "warn"]
    holds: bool = Field(
        description="every activation reads a Gaussian input (a combination of independent affine outputs), and "
        "no sum adds a post-activation feature to something correlated with it"
    )
    violations: list[str] = Field(
        default_factory=list,
        description="ids of the activations whose input is not Gaussian, then of the sums with no exact Gaussian "
        "description",
    )


class FixedPoint(BaseModel):
    q: float
    stable: bool


class VMapSample(BaseModel):
    """The variance map V(q) sampled on (0, 3 q*] (sparsity paper Figures 2 and 4)."""

    q: list[float]
    v: list[float]


class JacobianSummary(BaseModel):
    """Finite-width statistics of the per-layer Jacobian norm ||J^k||^2 for ReLU-family graphs
    (per-layer Jacobian paper, Theorems 1-3, Lemma 2), at the first layer/block (k = 1)."""

    kind: Literal["vanilla", "residual", "dense"]
    depth: int = Field(description="layers (vanilla, dense) or residual blocks")
    width: int
    m: int = Field(description="layers per residual branch")
    alpha: float = Field(description="weight-variance multiplier of the theorem (1 = He)")
    mean: float = Field(description="E||J^k||^2")
    var_upper: float = Field(description="upper bound of var||J^k||^2 (Theorem 1)")
    var_exact: float | None = Field(default=None, description="exact var||J^k||^2 (vanilla networks)")
    growth_law: str
    recommended: dict[str, float] | None = Field(
        default=None,
        description="residual: branch scale keeping L rho^(m/2) bounded for this depth and width; dense: alpha = 1",
    )


class GraphSummary(BaseModel):
    nodes: int
    depth: int = Field(description="nonlinear layers on the longest path")
    activations: int
    sums: int
    concats: int
    weighted: int
    subnetworks_considered: int


class ActivationParams(BaseModel):
    """One activation function's transformation in a graph that uses several (``Solution.activations``).

    Every function is solved for the same local targets (dks's convention: they come from the
    network's maximal function), so each gets its own parameters and the same local map values.
    """

    negative_slope: float | None = None
    input_scale: float | None = None
    input_shift: float | None = None
    output_scale: float | None = None
    output_shift: float | None = None
    sigma_w2: float | None = Field(default=None, description="eoc: weight variance scale of the layers it feeds")
    sigma_b2: float | None = Field(default=None, description="eoc: bias variance scale of the layers it feeds")
    q_1: float | None = None
    q_slope_1: float | None = None
    local_c_0: float | None = None
    local_c_slope_1: float | None = None
    local_c_curv_1: float | None = None
    chi_1: float | None = None

    def transform(self) -> dict[str, float]:
        """The parameters of phi_hat that are set (the keys ``Solution`` uses at its top level)."""
        keys = ("negative_slope", "input_scale", "input_shift", "output_scale", "output_shift")
        return {k: getattr(self, k) for k in keys if getattr(self, k) is not None}


class AttentionLayer(BaseModel):
    node: str = Field(description="id of the attention node")
    generator: dict = Field(
        description="the node's matrix at initialization in compact form, as sigprop.schemas.attention_init."
        "expand_attention reads it"
    )


class AttentionAnswer(BaseModel):
    shaping: str
    parameters: dict[str, float] = Field(default_factory=dict, description="the shaping's parameters, defaults filled")
    schedule: str | None = Field(
        default=None,
        description="the schedule the generators follow: 'joint' (u-spa's default) or 'paper'; null for the "
        "identity shapings",
    )
    layers: list[AttentionLayer]


class ScheduleEntry(BaseModel):
    node: str
    gamma: float | None = Field(default=None, description="e-spa: gamma_l of this layer's target kernel")
    rho: float | None = Field(default=None, description="u-spa: rho_l of this layer's target kernel")
    source_floor: float | None = Field(
        default=None,
        description="e-spa joint schedule: the floor f of the source f 11^T + (1 - f) exp(-gamma_(l-1) |i-j|) the "
        "attention's rows are rescaled for (q = 1 at every token)",
    )
    block_mean: float | None = Field(
        default=None,
        description="e-spa joint schedule: the design's mean token correlation after the block (its MLP included)",
    )
    block_rho: float | None = Field(
        default=None,
        description="u-spa joint schedule: the correlation after the block, at the next attention's value input "
        "(the output for the last): rho_l mapped by the MLP block's C map",
    )
    diagonal: float | None = Field(
        default=None, description="e-spa: alpha_l = sqrt(1 - exp(-2 gamma_l)), the target's Cholesky diagonal"
    )


class TokenKernel(BaseModel):
    """The T x T kernel of one sequence at infinite width, for orthonormal input tokens (q = 1 each)."""

    input: Literal["orthonormal"] = "orthonormal"
    tokens: int = Field(description="T, the sequence length")
    output: list[list[float]] | None = Field(
        default=None, description="the predicted output token kernel (T x T), when T <= the engine's limit"
    )
    leading: list[list[float]] | None = Field(
        default=None,
        description="when T is over the limit: the output kernel of the first leading_tokens tokens (exact: at "
        "initialization every attention matrix is lower triangular or the identity, so a prefix of tokens "
        "never reads the tokens after it)",
    )
    leading_tokens: int | None = None
    target: dict | None = Field(default=None, description="the schedule's last target kernel family")
    target_mean: float | None = Field(
        default=None,
        description="e-spa, u-spa: the target family's mean correlation over the token pairs i != j of the T tokens",
    )
    predicted_mean: float | None = Field(
        default=None,
        description="e-spa, u-spa: the predicted output kernel's mean correlation K_ij / sqrt(K_ii K_jj) over its "
        "token pairs i != j (output, or leading)",
    )
    schedule: list[ScheduleEntry] = Field(default_factory=list)


class Solution(BaseModel):
    model_config = ConfigDict(populate_by_name=True)

    key: str
    schema_: str = Field(default=SOLUTION_SCHEMA, alias="schema")
    engine_version: str
    method: Method
    activation: str
    targets: dict[str, float]
    # the transformed activation: output_scale * (phi(input_scale * x + input_shift) + output_shift)
    negative_slope: float | None = None
    input_scale: float | None = None
    input_shift: float | None = None
    output_scale: float | None = None
    output_shift: float | None = None
    # graphs whose activation nodes use several functions: one entry per function (canonical name);
    # the top-level parameters are then those of the request's ``activation`` where the graph uses it
    activations: dict[str, ActivationParams] | None = None
    # sparsifying activations
    tau: float | None = None
    m: float | None = None
    # weight and bias variance scales
    sigma_w2: float | None = None
    sigma_b2: float | None = None
    # achieved values, recomputed from the answer
    c_f_0: float | None = Field(default=None, description="maximal C_g(0) over subnetworks g")
    c_curv_1: float | None = Field(default=None, description="maximal C''_g(1) over subnetworks g")
    c_slope_1: float | None = Field(default=None, description="maximal C'_g(1) over subnetworks g")
    network_c_f_0: float | None = Field(default=None, description="C_f(0) of the whole network")
    q_1: float | None = None
    q_slope_1: float | None = None
    local_c_0: float | None = None
    local_c_slope_1: float | None = None
    local_c_curv_1: float | None = None
    v_slope: float | None = None
    v_curvature: float | None = None
    chi_1: float | None = None
    q_star: float | None = None
    output_q: float | None = Field(
        default=None,
        description="eoc: the mean square per feature of the network output for inputs of q = 1 (q_star after a "
        "weighted layer, E[phi(sqrt(q*) z)^2] after an activation)",
    )
    sparsity: float | None = Field(default=None, description="expected fraction of zeros, recomputed from tau and q*")
    fixed_points: list[FixedPoint] | None = Field(default=None, description="fixed points of V on (0, 50 q*]")
    only_stable: bool | None = Field(default=None, description="q* is the only stable fixed point")
    jacobian_spectrum_variance: dict[str, float] | None = Field(
        default=None,
        description="predicted variance of the input-output Jacobian's JJ^T spectrum, L (sigma_w2 - 1 - s_1), for "
        "gaussian and orthogonal weights",
    )
    v_map: VMapSample | None = None
    jacobian: JacobianSummary | None = None
    trainable: TrainableAnswer | None = None
    input_second_moment: float | None = Field(
        default=None, description="geometric: recommended E[x0^2] of the network input (GR section 6.3)"
    )
    logits_scale: float | None = Field(
        default=None, description="geometric: multiplier on the network output (GR section 6.4)"
    )
    gamma_ratio: float | None = Field(
        default=None, description="geometric: max / min of the layers' gamma (1 = balanced)"
    )
    root: RootInfo | None = None
    other_roots: list[OtherRoot] | None = Field(
        default=None,
        description="with request roots 'all' (tat and dks, smooth functions, one function per graph): the other "
        "roots the scan along the input shift found, each meeting every condition",
    )
    subnetworks: str | None = Field(
        default=None,
        description="which subnetworks the maxima range over: 'single-entry single-exit' regions of the graph (the "
        "convention of TAT Appendix B.5 and of dks), not every single-input single-output set of layers",
    )
    assumptions: AssumptionReport | None = None
    sum_scales: dict[str, float] | None = Field(
        default=None,
        description="sum node id -> factor on that sum's graph weights: where an atom reaches a sum through several "
        "paths (a copy, a nested sum, a shared stream) its coefficients add before squaring; the rescaled weights "
        "restore the normalized sum (q = 1) the answer's maps assume. Absent: every sum keeps its graph weights",
    )
    graph_summary: GraphSummary | None = None
    c_map: CMapSample | None = None
    attention: AttentionAnswer | None = None
    token_kernel: TokenKernel | None = None
    layers: list[LayerInit] = Field(default_factory=list)
    cached: bool = False
    warnings: list[str] = Field(default_factory=list)

    def for_function(self, fn: str) -> Solution:
        """This answer as the adapters read it for an activation computing ``fn``: with the top-level
        transformation replaced by ``activations[fn]`` when the graph used several functions, else
        the answer itself (a single-function answer's top level describes every activation)."""
        key = canonical_name(fn) or fn
        per = (self.activations or {}).get(key)
        if per is None:
            return self
        keys = ("negative_slope", "input_scale", "input_shift", "output_scale", "output_shift")
        return self.model_copy(update={"activation": key, **{k: getattr(per, k) for k in keys}})

    def to_json(self) -> str:
        """The one serialization every surface (CLI, HTTP, cache) uses, so they are byte-identical."""
        return self.model_dump_json(by_alias=True, exclude_none=True)


class ErrorBody(BaseModel):
    code: str
    message: str
    hint: str = ""


class ErrorResponse(BaseModel):
    error: ErrorBody
