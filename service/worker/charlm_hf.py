"""HuggingFace GPT-2 arms of a charlm validation (issue 36; ``examples/hf_gpt2_recipes.py`` runs the
same comparison on a CPU):

``hf_gpt2``
    ``transformers``' ``GPT2LMHeadModel`` as it builds it: pre-LN blocks with shortcuts, its own
    initialization, learned position embeddings, a tied head;
``hf_gpt2_keep``
    recipe 1: that model's answer (its graph from ``graph_from_module``, solved in-process with the
    validated request's method, targets and attention shaping) applied by
    ``sigprop.client.torch.apply``: shaped attention, the activation transformed, norms at the
    identity, the head untied;
``hf_gpt2_norm_free``
    recipe 2: ``normalization_free(model)`` (no norms, no shortcuts) solved and applied the same way.

The model is built from a config of the validated template's parameters (depth, width, heads, MLP
ratio, ``seq_len`` positions, the 256 byte values as vocabulary) and the answer's activation where
GPT-2 computes it (``gelu_tanh``, ``gelu``, ``relu``, ``swish``, ``tanh``, ``sigmoid``; otherwise GPT-2's
own ``gelu_tanh``, with the request's targets: a TAT ``leaky_relu`` answer's ``eta`` is no
``gelu_tanh`` target, so its recipe arms record the solver's refusal), random weights, dropout off:
nothing is downloaded or read from disk. ``transformers`` is imported only here, when such an arm is
made; a worker without it records the arm as unavailable (``SigpropError``).
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import SigpropError
from .charlm_plan import HF_ARMS, TransformerParams

__all__ = ["HF_ARMS", "HFCharLM", "make_hf_arm", "gpt2_config"]

# the catalogue's activations GPT-2 computes -> its config's activation_function
_GPT2_ACT = {
    "gelu_tanh": "gelu_new", "gelu": "gelu", "relu": "relu", "swish": "silu", "tanh": "tanh", "sigmoid": "sigmoid",
}  # fmt: skip
_RECIPE = {"hf_gpt2": "stock", "hf_gpt2_keep": "keep", "hf_gpt2_norm_free": "normalization-free"}


class HFCharLM(nn.Module):
    """A ``GPT2LMHeadModel`` called as the charlm arms are: byte tokens in, logits out; ``body`` is the
    model (its Conv1D and head weights' gradient norms are recorded)."""

    def __init__(self, net: nn.Module):
        super().__init__()
        self.body = net

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.body(input_ids=tokens).logits


def _transformers():
    try:
        import transformers
    except ImportError as exc:
        raise SigpropError(
            "invalid_request",
            "charlm: the HuggingFace arms need the transformers package on the worker",
            "install sigprop[hf] where the worker runs, or leave the hf_gpt2 arms out",
        ) from exc
    transformers.logging.set_verbosity_error()
    return transformers


def gpt2_config(params: TransformerParams, vocab: int, activation: str = "gelu_tanh"):
    """The ``GPT2Config`` of the template's parameters (dropout off)."""
    return _transformers().GPT2Config(
        activation_function=_GPT2_ACT.get(activation, "gelu_new"),
        n_layer=params.depth, n_embd=params.width, n_head=params.heads, n_inner=params.mlp_ratio * params.width,
        n_positions=params.seq_len, vocab_size=vocab, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        bos_token_id=None, eos_token_id=None,
    )  # fmt: skip


def make_hf_arm(name: str, body: dict, params: TransformerParams, seed: int, vocab: int):
    """``(model, description, made, solution facts, paths, weighted)`` of an HF arm. ``body``: the solve
    request's fields without the graph (method, activation, targets, attention)."""
    tf = _transformers()
    from ..client.torch import apply, graph_from_module, normalization_free
    from ..engine.solve import solve
    from ..schemas.solve import SolveRequest

    torch.manual_seed(seed)
    act = body.get("activation") if body.get("activation") in _GPT2_ACT else "gelu_tanh"
    net = tf.GPT2LMHeadModel(gpt2_config(params, vocab, act))
    made, facts = {}, None
    if name != "hf_gpt2":
        if name == "hf_gpt2_norm_free":
            conv = normalization_free(net)
            net = conv.model
            made["removed"] = {"norms": list(conv.removed), "shortcuts": list(conv.shortcuts_removed)}
        ids = torch.randint(0, vocab, (2, params.seq_len), generator=torch.Generator().manual_seed(seed))
        graph = graph_from_module(net, ids)
        sol = solve(SolveRequest.model_validate({**body, "activation": act, "graph": graph}))
        report = apply(net, sol, example_input=ids, seed=seed)
        net = report.model
        made["apply"] = {"complete": report.complete, "warnings": list(report.warnings), "notes": list(report.notes)}
        facts = {"key": sol.key, "method": sol.method, "activation": sol.activation, "targets": dict(sol.targets)}
    paths = {p: p for p, m in net.named_modules() if type(m).__name__ == "Conv1D" or p == "lm_head"}
    what = "solved and applied" if facts else "as transformers builds it (pre-LN, shortcuts, its init, tied head)"
    description = f"HuggingFace GPT2LMHeadModel, {_RECIPE[name]}, {what}"
    return HFCharLM(net), description, made, facts, paths, list(paths)
