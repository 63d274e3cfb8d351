"""What a character-level LM validation (``"task": "charlm"``) will train, and its cost bounded
before anything is allocated: checked by the API when the validation is submitted (a 4xx answer)
and again by the worker before it trains. Torch-free (the API imports it).

The validated graph must be the ``transformer`` template's (design of issue 28: node ids ``x``,
``b{i}.q``/``k``/``v``/``attn``/``proj``/``fc1``/``act``/``fc2``, optional ``b{i}.res1``/``res2``
sums and ``b{i}.ln1``/``ln2`` layer norms), because the comparison arms are the same template with
other ``shortcuts``/``norms`` settings: :func:`transformer_params` reads the template parameters
back from the expanded graph, so a solution given by key (whose request may hold an expanded
graph) plans the same way as one given by template.

Bounds (module constants, like the other validation limits): steps, batch size, sequence length,
width, depth, and the training work ``6 x parameters x tokens`` summed over the arms (each arm's
own parameters: the HuggingFace GPT-2 arms have position embeddings and norms too) (the usual
estimate of a transformer's training FLOPs: forward and backward, "Scaling Laws for Neural
Language Models", Kaplan et al., arXiv:2001.08361, section 2.1).
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass

from ..errors import SigpropError
from ..schemas.ops import AFFINE, ATTENTION, NORM, SOURCE, SUM, kind_of
from .charlm_corpus import VOCAB_SIZE

__all__ = ["HF_ARMS", "TransformerParams", "CharLMPlan", "transformer_params", "plan_charlm", "LIMITS"]

MAX_STEPS = 20_000
MAX_BATCH = 256
MAX_SEQ_LEN = 512
MAX_WIDTH = 1024
MAX_DEPTH = 64
MAX_TRAIN_FLOPS = 2e15  # 6 x parameters x tokens, all arms together
LIMITS = {
    "steps": MAX_STEPS,
    "batch_size": MAX_BATCH,
    "seq_len": MAX_SEQ_LEN,
    "width": MAX_WIDTH,
    "depth": MAX_DEPTH,
    "train_flops": MAX_TRAIN_FLOPS,
}
# the HuggingFace GPT-2 arms (sigprop.worker.charlm_hf): stock, recipe 1 (keep), recipe 2
HF_ARMS = ("hf_gpt2", "hf_gpt2_keep", "hf_gpt2_norm_free")
_BLOCK = re.compile(r"^b(\d+)\.attn$")
_HINT = (
    'validate a solution of the transformer template, e.g. {"template": "transformer", "depth": 8, '
    '"seq_len": 64, "width": 128, "heads": 4} with "attention": {"shaping": "e-spa"}'
)


def _bad(message: str, hint: str = _HINT) -> SigpropError:
    return SigpropError("invalid_request", f"charlm: {message}", hint)


def _too_large(message: str, hint: str) -> SigpropError:
    return SigpropError("validation_too_large", f"charlm: {message}", hint, 413)


@dataclass(frozen=True)
class TransformerParams:
    """The ``transformer`` template's parameters (design of issue 28)."""

    depth: int
    seq_len: int
    width: int
    heads: int
    mlp_ratio: int
    causal: bool
    shortcuts: bool
    norms: bool

    def template(self, **changes) -> dict:
        """The template request of these parameters, with ``changes`` (e.g. ``shortcuts=True``)."""
        return {"template": "transformer", **asdict(self), **changes}

    def parameters(self, vocab: int = VOCAB_SIZE) -> int:
        """Weights and biases of the language model: embedding, the blocks' dense layers, the head."""
        d, hidden = self.width, self.width * self.mlp_ratio
        block = 4 * (d * d + d) + (d * hidden + hidden) + (hidden * d + d)
        return vocab * d + self.depth * block + d * vocab + vocab

    def hf_gpt2_parameters(self, vocab: int = VOCAB_SIZE) -> int:
        """Of the HuggingFace GPT-2 arms (``charlm_hf``): the same blocks, plus position embeddings
        and LayerNorms, an untied head without bias (the stock one is tied but costs as much)."""
        d = self.width
        return self.parameters(vocab) - vocab + self.seq_len * d + self.depth * 4 * d + 2 * d

    def arm_parameters(self, arm: str, vocab: int = VOCAB_SIZE) -> int:
        return self.hf_gpt2_parameters(vocab) if arm in HF_ARMS else self.parameters(vocab)


def transformer_params(graph: dict) -> TransformerParams:
    """The template parameters of an expanded ``transformer`` graph (module docstring), or
    ``SigpropError`` naming what is not the template's."""
    nodes = {n.get("id"): n for n in graph.get("nodes") or () if isinstance(n, dict)}
    x = nodes.get("x")
    if x is None or kind_of(x.get("op")) != SOURCE or not x.get("sequence") or len(x.get("shape") or ()) != 2:
        raise _bad("the graph has no sequence input node 'x' of shape [seq_len, width]")
    seq_len, width = (int(s) for s in x["shape"])
    blocks = sorted(int(m.group(1)) for i in nodes if (m := _BLOCK.match(str(i))))
    if not blocks or blocks != list(range(len(blocks))):
        raise _bad("the graph's attention nodes are not the transformer template's b0.attn, b1.attn, ...")
    first = nodes["b0.attn"]
    fc1 = nodes.get("b0.fc1")
    if kind_of(first.get("op")) != ATTENTION or fc1 is None or kind_of(fc1.get("op")) != AFFINE:
        raise _bad("block b0 lacks the template's attention node 'b0.attn' or dense node 'b0.fc1'")
    heads = int(first.get("heads") or 1)
    units = int(fc1.get("units") or 0)
    if units % width:
        raise _bad(f"b0.fc1 has {units} units, not a multiple of the width {width}")
    return TransformerParams(
        depth=len(blocks),
        seq_len=seq_len,
        width=width,
        heads=heads,
        mlp_ratio=units // width,
        causal=bool(first.get("causal", True)),
        shortcuts=any(kind_of(n.get("op")) == SUM for n in nodes.values()),
        norms=any(kind_of(n.get("op")) == NORM for n in nodes.values()),
    )


@dataclass(frozen=True)
class CharLMPlan:
    """A charlm validation's model and budget, checked."""

    params: TransformerParams
    arms: tuple[str, ...]
    steps: int
    batch_size: int
    model_parameters: int  # of one arm
    train_flops: float  # 6 x parameters x tokens, all arms

    def to_json(self) -> dict:
        return {
            "transformer": asdict(self.params),
            "arms": list(self.arms),
            "steps": self.steps,
            "batch_size": self.batch_size,
            "model_parameters": self.model_parameters,
            "train_flops": self.train_flops,
            "limits": dict(LIMITS),
        }


def _bound(what: str, value: int, limit: int, hint: str) -> None:
    if value > limit:
        raise _too_large(f"{what} {value} is over this server's bound of {limit}", hint)


def plan_charlm(request: dict, graph: dict) -> CharLMPlan:
    """The plan of a charlm validation ``request`` (a validated ``ValidationRequest`` dump) of
    ``graph`` (the expanded graph that was solved), or ``SigpropError`` (422 for a graph that is
    not the template's, 413 ``validation_too_large`` past a bound)."""
    params = transformer_params(graph)
    arms = tuple(request.get("arms") or ("solved", "shortcuts", "standard"))
    steps, batch = int(request.get("steps", 200)), int(request.get("batch_size", 64))
    smaller = "ask for fewer steps, a smaller batch or a smaller transformer"
    _bound("steps", steps, MAX_STEPS, smaller)
    _bound("batch_size", batch, MAX_BATCH, smaller)
    _bound("seq_len", params.seq_len, MAX_SEQ_LEN, "use a shorter seq_len")
    _bound("width", params.width, MAX_WIDTH, "use a narrower transformer")
    _bound("depth", params.depth, MAX_DEPTH, "use fewer blocks")
    n_params = params.parameters()
    all_params = sum(params.arm_parameters(a) for a in arms)
    flops = 6.0 * all_params * steps * batch * params.seq_len
    if not math.isfinite(flops) or flops > MAX_TRAIN_FLOPS:
        raise _too_large(
            f"training {len(arms)} arm(s) of {all_params} parameters in all "
            f"on {steps} x {batch} x {params.seq_len} tokens "
            f"is about {flops:.3g} FLOPs, over this server's bound of {MAX_TRAIN_FLOPS:.3g}",
            smaller,
        )
    return CharLMPlan(params, arms, steps, batch, n_params, flops)
