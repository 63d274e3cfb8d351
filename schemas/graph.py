"""Wire models of the architecture graph, ``sigprop.graph/v1`` (contract section 1).

Pydantic checks each node on its own (its op, attributes and their ranges); whether the nodes
form a valid DAG (cycles, dangling inputs, arity, one output, shapes) is checked by
``sigprop.engine.graph.build.build_graph``, which needs the whole graph at once.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, field_validator, model_validator

from .activations import ActivationName
from .ops import OP_TABLE

GRAPH_SCHEMA = "sigprop.graph/v1"

# Ids appear in answers, logs and the dashboard: a conservative character set (covers the
# dotted names torch.fx gives, like "layer1.0.conv1") keeps them safe to echo anywhere.
NodeId = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.:\-/\[\]]+$")]
# Numbers and booleans on the wire are strict: "0.9" is not 0.9, 2.0 is not 2, and 1 is not true,
# so a request means what its JSON says (a quoted number is usually a bug upstream). An integer is
# still a number where a float is expected (StrictFloat accepts 1 for 1.0), as JSON intends.
PositiveInt = Annotated[StrictInt, Field(ge=1, le=1_000_000)]
KernelSize = (
    Annotated[StrictInt, Field(ge=1, le=1024)]
    | Annotated[list[Annotated[StrictInt, Field(ge=1, le=1024)]], Field(min_length=2, max_length=2)]
)
WireFloat = Annotated[StrictFloat, Field(allow_inf_nan=False)]


class _Node(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: NodeId
    inputs: list[NodeId] = Field(default_factory=list, max_length=4096)


class InputNode(_Node):
    op: Literal["input"]
    shape: list[PositiveInt] = Field(
        min_length=1,
        max_length=3,
        description="[features], [channels, height, width], or [tokens, features] (sequence)",
    )
    sequence: StrictBool = Field(
        default=False, description="a token stream of shape [tokens, features]: dense layers act per token"
    )

    @model_validator(mode="after")
    def _sequence_shape(self):
        if self.sequence and len(self.shape) != 2:
            raise ValueError("a sequence input has shape [tokens, features]")
        if not self.sequence and len(self.shape) == 2:
            raise ValueError('a [tokens, features] input needs "sequence": true (or give [features])')
        return self


class DenseNode(_Node):
    op: Literal["dense"]
    units: PositiveInt
    bias: StrictBool = True


class ConvNode(_Node):
    op: Literal["conv"]
    channels: PositiveInt
    kernel: KernelSize = 3
    stride: KernelSize = 1
    padding: Literal["same", "valid"] | Annotated[StrictInt, Field(ge=0, le=1024)] = "same"
    bias: StrictBool = True


class ActivationNode(_Node):
    op: Literal["activation"]
    fn: ActivationName | None = Field(default=None, description="defaults to the request's activation")


class SumNode(_Node):
    op: Literal["sum"]
    weights: list[WireFloat] | None = Field(
        default=None, max_length=4096, description="sum of squares 1; omitted: 1/sqrt(n) each"
    )

    @field_validator("weights")
    @classmethod
    def _finite(cls, weights):
        if weights is not None:
            for w in weights:
                if not (-1e6 < w < 1e6):  # also rejects NaN and infinities
                    raise ValueError("sum weights must be finite numbers")
        return weights


class AttentionNode(_Node):
    """Self-attention's token mixing: ``inputs`` are the query, key and value dense nodes (reading
    the same node, equal units divisible by ``heads``); the output projection is a following dense."""

    op: Literal["attention"]
    heads: PositiveInt = 1
    causal: StrictBool = True


class LayerNormNode(_Node):
    """Per-token normalization over the features (affine identity at initialization)."""

    op: Literal["layer_norm"]


class RMSNormNode(_Node):
    """Division by the root mean square over the features (RMSNorm, scale 1 at initialization): per
    token on a token stream, per example on [features]."""

    op: Literal["rms_norm"]


class MulNode(_Node):
    """The elementwise product of its two inputs, of one shape (the gate of SwiGLU/GeGLU)."""

    op: Literal["mul"]


class ConcatNode(_Node):
    op: Literal["concat"]


class PoolNode(_Node):
    op: Literal["avg_pool", "max_pool"]
    kernel: KernelSize = 2
    stride: KernelSize | None = None
    padding: StrictInt = Field(
        default=0, ge=0, le=64, description="zero padding on each side (PyTorch's padding); at most half the kernel"
    )


class GlobalPoolNode(_Node):
    op: Literal["global_avg_pool"]


class DropoutNode(_Node):
    op: Literal["dropout"]
    rate: WireFloat = Field(default=0.0, ge=0.0, lt=1.0)


class PassThroughNode(_Node):
    op: Literal["flatten", "output"]


# What an adapter writes in an identity's ``unsupported``: one line of printable text (it is echoed
# in the answer's warnings), no longer than a log line should be.
UNSUPPORTED_NOTE_MAX = 300
UnsupportedNote = Annotated[str, Field(min_length=1, max_length=UNSUPPORTED_NOTE_MAX, pattern=r"^[^\x00-\x1f\x7f]+$")]


def unsupported_note(text: str) -> str:
    """``text`` as an identity's ``unsupported`` note: one line, cut to the wire's length."""
    line = " ".join(text.split()) or "an op the adapter could not express"
    return line if len(line) <= UNSUPPORTED_NOTE_MAX else line[: UNSUPPORTED_NOTE_MAX - 3] + "..."


class IdentityNode(_Node):
    op: Literal["identity"]
    unsupported: UnsupportedNote | None = Field(
        default=None,
        description="set by an adapter that put this identity in place of an op it could not express "
        "(allow_unsupported): what that op was; each answer for the graph warns of it",
    )


Node = Annotated[
    InputNode
    | DenseNode
    | ConvNode
    | ActivationNode
    | SumNode
    | ConcatNode
    | PoolNode
    | GlobalPoolNode
    | DropoutNode
    | AttentionNode
    | LayerNormNode
    | RMSNormNode
    | MulNode
    | IdentityNode
    | PassThroughNode,
    Field(discriminator="op"),
]

# the wire ops, in the order of the op table (``schemas.ops``), which defines each (less the rows a wire
# op resolves to by what it reads: ``OpRule.features``)
OPS = tuple(op for op, row in OP_TABLE.items() if row.wire)


class Graph(BaseModel):
    """A DAG of nodes in any order; edges are the ``inputs`` lists."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    schema_: Literal["sigprop.graph/v1"] = Field(default=GRAPH_SCHEMA, alias="schema")
    nodes: list[Node] = Field(min_length=1)


# The templates and the Template fields each one takes, in the order GET /v1/templates lists them.
# The request parser names them in its errors and the engine's expanders (engine.templates.expand) take
# exactly these, so both read them here rather than the parser reaching into the engine.
TEMPLATE_FIELDS: dict[str, tuple[str, ...]] = {
    "mlp": ("depth", "width", "input_shape", "classes", "bias"),
    "resnet": ("depth", "version", "shortcut_weight", "input_shape", "classes", "bias"),
    "densenet": ("depth", "growth_rate", "input_shape", "classes", "bias"),
    "cnn": ("depth", "width", "input_shape", "classes", "bias"),
    "transformer": (
        "depth",
        "seq_len",
        "width",
        "heads",
        "mlp_ratio",
        "causal",
        "shortcuts",
        "norms",
        "shortcut_weight",
    ),
}
TEMPLATE_NAMES: tuple[str, ...] = tuple(TEMPLATE_FIELDS)


class Template(BaseModel):
    """A named network that expands server-side to a graph (``GET /v1/templates`` lists them)."""

    model_config = ConfigDict(extra="forbid")

    # TEMPLATE_NAMES (tests/engine/test_templates.py)
    template: Literal["mlp", "resnet", "densenet", "cnn", "transformer"]
    depth: Annotated[StrictInt, Field(ge=1, le=100_000)] | None = None
    width: PositiveInt | None = None
    input_shape: list[PositiveInt] | None = Field(default=None, min_length=1, max_length=3)
    # resnet
    version: Literal[1, 2] | None = None
    shortcut_weight: Annotated[WireFloat, Field(ge=0.0, le=1.0)] | None = None
    # densenet
    growth_rate: PositiveInt | None = None
    # transformer
    seq_len: PositiveInt | None = None
    heads: PositiveInt | None = None
    mlp_ratio: Annotated[StrictInt, Field(ge=1, le=64)] | None = None
    causal: StrictBool | None = None
    shortcuts: StrictBool | None = None
    norms: StrictBool | None = None
    # cnn / densenet / resnet input and head
    classes: PositiveInt | None = None
    bias: StrictBool | None = None

    @field_validator("version", mode="before")
    @classmethod
    def _strict_version(cls, value):
        # a Literal takes 2.0 and true for 2 in lax mode; the wire is strict (see PositiveInt)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise ValueError("version is the integer 1 or 2")
        return value
