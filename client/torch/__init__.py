"""PyTorch adapter: extract a sigprop graph from a ``torch.nn.Module`` and apply an answer to it.

    import torch
    from sigprop.client import Client
    from sigprop.client.torch import apply, graph_from_module

    graph = graph_from_module(model, torch.randn(8, 784))
    with Client("http://127.0.0.1:8000") as sp:
        sol = sp.solve(graph, "tat", "leaky_relu", {"eta": 0.9})
    report = apply(model, sol, graph=graph, example_input=torch.randn(8, 784))
    net = report.model          # the rewritten torch.fx.GraphModule: train this one
    print(report.summary())

``graph_from_module`` traces ``forward`` with ``torch.fx.symbolic_trace`` (so ``forward`` must be
traceable: no data-dependent Python control flow) and runs shape propagation on
``example_input`` to get every tensor's shape. Node ids are the module qualified names for module
calls (``net.3``, ``layer1.0.conv1``) and the fx node names otherwise (``x``, ``add_1``, ``output``).

``apply`` rewrites a copy of the model (``inplace=False``, the default) with torch.fx; with
``inplace=True`` the model itself becomes the solved network where every change is a module swap at
the module's own path, and otherwise it raises ValueError naming what only the rewritten copy can
change (adds and activations written in ``forward``), leaving the model untouched:

* every activation becomes a :class:`TransformedActivation`
  ``output_scale * (phi(input_scale * x + input_shift) + output_shift)`` of the answer's activation
  (a ReLU network solved with ``tat``/``leaky_relu`` gets Tailored ReLUs);
* every traced ``a + b`` (``+``, ``+=``, ``torch.add``, ``Tensor.add``) becomes a
  :class:`NormalizedSum`: **the add then computes the normalized sum** ``w_a a + w_b b`` with the
  graph's weights (``1/sqrt(2)`` each when the graph gives none), which is what the kernel analysis
  assumes; with a trainable residual beta in the answer it computes ``x + beta / sqrt(L) F(x)``;
* every weighted layer the answer lists is re-initialized as it says (scale-corrected uniform
  orthogonal, Orthogonal Delta for convolutions, or Gaussian; biases zero, Gaussian or none), matched
  by id; a geometric answer's conditioning multiplier ``alpha`` is inserted after its layer and its
  ``logits_scale`` on the output.

Ops the graph cannot express stay in the rewritten model exactly as they were (they were identities
for the solve) and are reported.

Where the theory is silent, ``apply`` measures: with ``example_input`` (and ``calibrate=True``, the
default) it runs the batch and brings the output of every max pool, every activation reading a
max-pooled map, every average pool of locations that differ, every op treated as the identity and
every node the answer names as outside its predictions to the q the answer predicts, by a factor on
the layer that reads (or feeds) it (``sigprop.client.calibration``; ``report.calibrations``).

``apply(..., residual="recommended")`` weights the residual adds with the answer's
``jacobian.recommended`` shortcut and branch weights instead of the graph's.

:func:`diagnose` measures an applied model's per-node q and c on a pair of inputs at a known cosine
and sets them beside the answer's prediction (``sigprop.client.diagnosis``).

The :class:`ApplyReport` lists every change and everything that was *not* done: layers in the
answer with no module in the model, weighted modules the answer does not cover (normalization
layers kept under ``allow_unsupported``, modules never called in ``forward``), and notes.

Sequence models (a ``[batch, tokens, features]`` input with attention or per-token Linear and
LayerNorm layers; issue 28, docs/transformers.md) are read as sequence graphs (``sequence``),
applied with :class:`ShapedAttention` token mixers carrying the answer's attention matrices
(``sequence_apply``) and diagnosed by their output token kernel (``sequence_diagnose``).

The package: ``modules`` (:class:`TransformedActivation`, :class:`NormalizedSum`, which torch
modules compute which catalogue activation), ``attention`` (:class:`ShapedAttention`), ``ops``
(what each traced torch op is in the graph), ``walk`` (the walk of a trace into graph nodes),
``extraction`` (:func:`graph_from_module`), ``sequence`` (its sequence models), ``rewrite``
(the steps of apply), ``sequence_apply``, ``sequence_diagnose``, ``traced`` (the trace a session keeps: the graph
``graph_from_module`` returns carries it to ``apply``, which keeps the rewritten model's for
``diagnose``, so a session traces the model once), ``apply`` (:func:`apply` and its report), ``calibrate``
(the measured ops), ``diagnose``
(:func:`diagnose`), ``convert`` (:func:`normalization_free`), ``huggingface`` and ``huggingface_apply``
(HuggingFace GPT-2 and Llama models read by module, applied keeping their class, and
:func:`load_pretrained`; docs/transformers.md).

Importing this package needs PyTorch: ``pip install 'sigprop[torch]'``. It imports nothing of the
service: what it shares with it (the activation catalogue, the graph's shape rules, the wire
models, ``SigpropError``) comes from ``sigprop.schemas``.
"""

from __future__ import annotations

try:
    import torch  # noqa: F401
    import torch.fx  # noqa: F401
except ImportError as _exc:  # pragma: no cover - exercised in a subprocess by the tests
    raise ImportError(
        "sigprop.client.torch needs PyTorch, which is not installed: pip install 'sigprop[torch]'"
    ) from _exc

from .apply import ActivationChange, ApplyReport, LayerChange, SumChange, apply
from .attention import ShapedAttention, ShapedMultiheadAttention
from .convert import ConvertReport, normalization_free
from .diagnose import diagnose, input_pair
from .extraction import graph_from_module
from .huggingface_apply import load_pretrained
from .modules import ACTIVATION_FUNCTIONS, NormalizedSum, TransformedActivation, activation_function, native_module
from .sequence_diagnose import TokenKernelDiagnosis, diagnose_tokens

__all__ = [
    "graph_from_module",
    "diagnose",
    "input_pair",
    "normalization_free",
    "load_pretrained",
    "ConvertReport",
    "apply",
    "ApplyReport",
    "ActivationChange",
    "LayerChange",
    "SumChange",
    "TransformedActivation",
    "NormalizedSum",
    "activation_function",
    "native_module",
    "ACTIVATION_FUNCTIONS",
    "ShapedAttention",
    "ShapedMultiheadAttention",
    "diagnose_tokens",
    "TokenKernelDiagnosis",
]
