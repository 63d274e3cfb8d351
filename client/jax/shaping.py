"""Attention state for Flax models, without Flax: the mixing function :class:`ShapedAttention` runs
(``sigprop.client.jax.attention``), and an answer's attention initializations written into a
variables tree.

An answer shapes each ``attention`` node with a generator (contract, ``attention.layers``);
``sigprop.schemas.attention_init.expand_attention`` expands it to the matrix at initialization

    A = identity * I + diag(scale) softmax(bias) - centre * softmax(mask)

(E-SPA / U-SPA / Value-SkipInit: "Deep Transformers without Shortcuts: Modifying Self-attention
for Faithful Signal Propagation", He, Martens et al., arXiv:2302.10322, sections 3-4; shaped
attention: "The Shaped Transformer", Noci et al., arXiv:2306.17759), which :func:`install_init`
writes into one module's ``"shaping"`` collection as the torch module's ``load_init`` does.

The mixing runs in one jitted function named ``sigprop_attention_<heads>_<causal>``
(:func:`core_name`), so that ``graph_from_flax`` finds it in the jaxpr as a single call and reads
``heads`` and ``causal`` off its name (``extraction``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ...schemas.attention_init import AttentionInit, expand_attention, mask_bias

__all__ = [
    "COLLECTION",
    "core_name",
    "parse_core_name",
    "mixing_function",
    "install_init",
    "attention_matrix",
    "answer_attention",
    "install_answer_attention",
]

CORE_PREFIX = "sigprop_attention_"

COLLECTION = "shaping"


def core_name(heads: int, causal: bool) -> str:
    """The name of the jitted mixing function, which the jaxpr keeps: ``sigprop_attention_8_1``."""
    return f"{CORE_PREFIX}{int(heads)}_{int(bool(causal))}"


def parse_core_name(name: str) -> tuple[int, bool] | None:
    """``(heads, causal)`` from a :func:`core_name`, or None for any other name."""
    if not name.startswith(CORE_PREFIX):
        return None
    parts = name[len(CORE_PREFIX) :].split("_")
    if len(parts) != 2 or not all(p.isdigit() for p in parts):
        return None
    return int(parts[0]), parts[1] == "1"


def _split_heads(x, heads: int):
    """``(B, T, H * d) -> (B, H, T, d)``."""
    b, t, width = x.shape
    return x.reshape(b, t, heads, width // heads).transpose(0, 2, 1, 3)


def _merge_heads(x):
    """``(B, H, T, d) -> (B, T, H * d)``."""
    b, h, t, d = x.shape
    return x.transpose(0, 2, 1, 3).reshape(b, t, h * d)


def _plain_mean(v, causal: bool):
    """softmax(mask) v over the token axis (-2): the running mean for causal attention, the mean
    otherwise."""
    if causal:
        count = jnp.arange(1, v.shape[-2] + 1, dtype=v.dtype)
        return jnp.cumsum(v, axis=-2) / count[:, None]
    return jnp.broadcast_to(v.mean(axis=-2, keepdims=True), v.shape)


@functools.cache
def mixing_function(heads: int, causal: bool, d_model: int | None):
    """The jitted mixing function of one (heads, causal, d_model), named by :func:`core_name`."""

    def mix(q, k, v, bias, scale, identity, centre, temperature, shaped, alpha, beta):
        t, width = q.shape[1], q.shape[2]
        d_head = width // heads
        qh, kh, vh = (_split_heads(x, heads) for x in (q, k, v))
        dm = d_model if d_model is not None else width
        plain = 1.0 / math.sqrt(d_head)
        factor = jnp.where(shaped, 1.0 / (temperature * math.sqrt(dm * d_head)), plain).astype(q.dtype)
        logits = jnp.einsum("bhqd,bhkd->bhqk", qh, kh) * factor + bias[:t, :t].astype(q.dtype)
        mixed = jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(logits, axis=-1), vh)
        out = ((beta * scale[:t]).astype(q.dtype))[:, None] * mixed
        out = out + (alpha * identity).astype(q.dtype) * vh
        out = out - centre.astype(q.dtype) * _plain_mean(vh, causal)
        return _merge_heads(out)

    mix.__name__ = core_name(heads, causal)
    return jax.jit(mix)


def _f32(value) -> jax.Array:
    """A float32 device array, converted on the host (no compiled conversion per leaf)."""
    return jnp.asarray(np.asarray(value, np.float32))


def _is_value_skipinit(init: AttentionInit) -> bool:
    """The torch module's rule: no centring, a uniform scale and the plain mask as bias."""
    plain = mask_bias(init.bias.shape[0], init.causal)
    return init.centre == 0.0 and bool(np.all(init.scale == init.scale[0])) and np.array_equal(init.bias, plain)


def install_init(shaping: Mapping, params: Mapping | None, init: AttentionInit) -> tuple[dict, dict | None, list[str]]:
    """One ShapedAttention's ``"shaping"`` variables (and its ``"params"``, where ``alpha`` and
    ``beta`` are trainable) with ``init`` installed, as ``ShapedAttention.load_init`` does in torch;
    returns ``(shaping, params, notes)``. Raises ValueError when ``init`` is for another length or
    causality than the module's."""
    t = init.bias.shape[0]
    n = int(np.shape(shaping["bias"])[0])
    causal = bool(np.asarray(shaping["causal"]))
    if init.bias.shape != (t, t) or init.scale.shape != (t,):
        raise ValueError(f"an AttentionInit of shapes {init.bias.shape} and {init.scale.shape} is not T x T and T")
    if t != n:
        raise ValueError(f"the attention init is for {t} tokens, this ShapedAttention for max_len={n}")
    if bool(init.causal) != causal:
        raise ValueError(f"the attention init has causal={init.causal}, this ShapedAttention causal={causal}")
    notes = []
    vsi = _is_value_skipinit(init)
    new = dict(shaping)
    new["bias"] = _f32(init.bias)
    new["centre"] = _f32(init.centre)
    new["temperature"] = _f32(init.temperature)
    new["shaped"] = jnp.asarray(np.bool_(init.centre != 0.0))
    if vsi:
        new["identity"] = _f32(1.0)
        new["scale"] = _f32(np.ones(n))
        alpha, beta = float(init.identity), float(init.scale[0])
    else:
        new["identity"] = _f32(init.identity)
        new["scale"] = _f32(init.scale)
        alpha = beta = 1.0
    trainable = params is not None and "alpha" in params
    new_params = None if params is None else dict(params)
    if trainable:
        new_params["alpha"], new_params["beta"] = _f32(alpha), _f32(beta)
    else:
        new["alpha"], new["beta"] = _f32(alpha), _f32(beta)
        if vsi:
            notes.append(
                "Value-SkipInit's alpha and beta are installed but frozen (in 'shaping'): build "
                "ShapedAttention(value_skipinit=True) to train them"
            )
    return new, new_params, notes


def attention_matrix(shaping: Mapping, params: Mapping | None = None, seq_len: int | None = None) -> np.ndarray:
    """A at zero logits (zero queries) from one ShapedAttention's variables: what it mixes tokens
    with at initialization (``AttentionInit.matrix()`` once an answer is installed)."""
    bias = np.asarray(shaping["bias"], np.float64)
    t = bias.shape[0] if seq_len is None else int(seq_len)
    src = params if params is not None and "alpha" in params else shaping
    alpha, beta = float(np.asarray(src["alpha"])), float(np.asarray(src["beta"]))
    causal = bool(np.asarray(shaping["causal"]))
    init = AttentionInit(
        alpha * float(np.asarray(shaping["identity"])),
        beta * np.asarray(shaping["scale"], np.float64)[:t],
        bias[:t, :t],
        float(np.asarray(shaping["centre"])),
        causal,
    )
    return init.matrix()


def answer_attention(sol) -> dict[str, dict]:
    """Attention node id -> its generator, from an answer's ``attention.layers`` (empty without one)."""
    att = getattr(sol, "attention", None)
    if att is None:
        return {}
    layers = att.get("layers", []) if isinstance(att, Mapping) else att.layers
    out = {}
    for layer in layers:
        node = layer["node"] if isinstance(layer, Mapping) else layer.node
        gen = layer["generator"] if isinstance(layer, Mapping) else layer.generator
        out[str(node)] = dict(gen)
    return out


def install_answer_attention(tree, generators: Mapping[str, dict], mapping: Mapping) -> tuple[Any, list, list, list]:
    """``tree`` (a Flax variables dict) with each mapped attention node's generator installed in its
    module's ``"shaping"`` variables (and ``"params"``' ``alpha`` / ``beta`` where trainable).

    Returns ``(new_tree, installed, not_found, notes)``: ``installed`` holds ``(node id, module path,
    AttentionInit)``, ``not_found`` ``(node id, path, why)``. The matrices are expanded for the
    module's ``max_len`` (its stored bias): for causal attention their leading ``T x T`` block is the
    answer's matrix for ``T`` tokens (the Cholesky factors of leading blocks are leading blocks)."""
    from .trees import _MISSING, _get, _set

    installed, not_found, notes = [], [], []
    new = tree
    for gid, gen in generators.items():
        if gid not in mapping:
            continue
        raw = mapping[gid]
        path = tuple(p for p in raw.split("/") if p) if isinstance(raw, str) else tuple(raw)
        shaping = _get(tree, (COLLECTION,) + path)
        if shaping is _MISSING or not isinstance(shaping, Mapping) or "bias" not in shaping:
            why = (
                f"no '{COLLECTION}' variables at this path: pass the whole variables dict (params and "
                f"'{COLLECTION}'), and use ShapedAttention there"
            )
            not_found.append((gid, path, why))
            continue
        n = int(np.shape(shaping["bias"])[0])
        causal = bool(np.asarray(shaping["causal"]))
        try:
            init = expand_attention(gen, n, causal)
            params = _get(tree, ("params",) + path)
            params = params if isinstance(params, Mapping) else None
            new_shaping, new_params, more = install_init(shaping, params, init)
        except ValueError as exc:
            not_found.append((gid, path, str(exc)))
            continue
        new = _set(new, (COLLECTION,) + path, new_shaping)
        if new_params is not None and "alpha" in new_params:
            new = _set(new, ("params",) + path, new_params)
        notes.extend(f"attention {gid!r}: {m}" for m in more)
        installed.append((gid, path, init))
    return new, installed, not_found, notes
