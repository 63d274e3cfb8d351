"""Kernel and bias initializers of an answer's layers, with the Flax / Haiku /
``jax.nn.initializers`` signature ``init(key, shape, dtype)`` (see ``sigprop.client.jax``, which
re-exports them): scale-corrected uniform orthogonal, Orthogonal Delta for convolutions, Gaussian.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from sigprop.schemas import LayerInit

Initializer = Callable[..., jax.Array]  # init(key, shape, dtype=jnp.float32) -> jax.Array


def _uniform_orthogonal(key, n_rows: int, n_cols: int, dtype) -> jax.Array:
    """An ``n_rows x n_cols`` matrix from the uniform (Haar) distribution on matrices with
    orthonormal rows (``n_rows <= n_cols``) or columns (``n_rows > n_cols``).

    The construction of ``dks.jax.parameter_sampling_functions._uniform_orthogonal``: QR of a
    Gaussian matrix, column signs fixed by ``diag(R)``; equal to ``(X X^T)^{-1/2} X`` in
    distribution (TAT paper, Appendix D).
    """
    big, small = max(n_rows, n_cols), min(n_rows, n_cols)
    x = jax.random.normal(key, (big, small), dtype)
    q, r = jnp.linalg.qr(x)
    q = q * jnp.sign(jnp.diag(r))
    return q.T if n_rows < n_cols else q


# The samplers are jitted once per (shape, dtype) with the gain traced, so re-initializing a
# model eagerly costs one compiled call per layer shape rather than a dozen dispatches per layer
# (and a new gain never recompiles). Under an outer jit / vmap they are simply inlined.
@functools.partial(jax.jit, static_argnames=("shape", "dtype", "n_spatial"))
def _suo_sample(key, gain, *, shape: tuple[int, ...], dtype, n_spatial: int) -> jax.Array:
    spatial = shape[:n_spatial]
    n_out = shape[-1]
    n_in = math.prod(shape[n_spatial:-1])
    # half-precision kernels are sampled in float32 (LAPACK has no bf16 / f16 QR) and rounded once
    work = dtype if jnp.dtype(dtype).itemsize >= 4 else jnp.float32
    w = _uniform_orthogonal(key, n_out, n_in, work)  # out x in
    mat = (gain.astype(work) * w.T).astype(dtype)  # in x out
    if not spatial:
        return mat.reshape(shape)
    centre = tuple((s - 1) // 2 for s in spatial)
    return jnp.zeros(shape, dtype).at[centre].set(mat)


@functools.partial(jax.jit, static_argnames=("shape", "dtype"))
def _gaussian_sample(key, std, *, shape: tuple[int, ...], dtype) -> jax.Array:
    return std.astype(dtype) * jax.random.normal(key, shape, dtype)


def scaled_uniform_orthogonal(gain: float = 1.0, delta: bool = True, *, scale_corrected: bool = False) -> Initializer:
    """Scaled uniform orthogonal (SUO) weights, Orthogonal Delta for conv kernels.

    ``init(key, shape, dtype=jnp.float32)`` returns ``gain`` times a uniformly random matrix
    with orthonormal rows or columns, in JAX's kernel layout:

    - dense ``[in, out]``: with ``W = kernel.T`` (``out x in``), ``W W^T = gain^2 I`` when
      ``in >= out`` and ``W^T W = gain^2 I`` when ``in < out``;
    - conv ``[*spatial, in, out]`` with ``delta=True`` (Orthogonal Delta): every tap is zero
      except the centre one, which is an ``[in, out]`` SUO matrix (spatial sizes must be odd);
      with ``delta=False`` the whole kernel is one ``[prod(spatial) * in, out]`` SUO matrix.

    ``gain`` is the multiplier on the orthonormal matrix, exactly an answer's ``layers[].gain``,
    which already holds the scale correction ``max(sqrt(fan_out / fan_in), 1)`` times
    ``sqrt(sigma_w2)``. With ``scale_corrected=True`` the correction is computed from the shape
    and applied on top of ``gain`` (then ``gain`` plays the role of dks's ``scale`` and the
    result equals ``dks.jax.parameter_sampling_functions.scaled_uniform_orthogonal``, bit for bit).
    """
    gain = float(gain)

    def init(key, shape, dtype=jnp.float32) -> jax.Array:
        shape = tuple(int(s) for s in shape)
        dtype = jnp.dtype(dtype)
        if len(shape) < 2:
            raise ValueError(f"scaled_uniform_orthogonal needs a kernel of rank >= 2, got shape {shape}")
        n_spatial = len(shape) - 2 if delta else 0
        if any(s % 2 != 1 for s in shape[:n_spatial]):
            raise ValueError(f"Orthogonal Delta needs odd spatial sizes, got kernel shape {shape}")
        n_out, n_in = shape[-1], math.prod(shape[n_spatial:-1])
        # the product in float64, cast once (as dks does)
        g = gain * (max(math.sqrt(n_out / n_in), 1.0) if scale_corrected else 1.0)
        return _suo_sample(
            key,
            np.asarray(g, np.float32 if dtype.itemsize <= 4 else dtype),
            shape=shape,
            dtype=dtype,
            n_spatial=n_spatial,
        )

    return init


def gaussian(std: float) -> Initializer:
    """``N(0, std^2)`` entries: ``init(key, shape, dtype=jnp.float32)``. An answer's gaussian
    ``layers[].gain`` is this ``std`` (``sqrt(sigma_w2 / fan_in)``)."""
    std = float(std)

    def init(key, shape, dtype=jnp.float32) -> jax.Array:
        dtype = jnp.dtype(dtype)
        return _gaussian_sample(
            key,
            np.asarray(std, np.float32 if dtype.itemsize <= 4 else dtype),
            shape=tuple(int(s) for s in shape),
            dtype=dtype,
        )

    return init


def zeros(key, shape, dtype=jnp.float32) -> jax.Array:
    """All zeros, with the initializer signature (the key is ignored)."""
    return jnp.zeros(tuple(shape), dtype)


def _layer(layer) -> LayerInit:
    if isinstance(layer, LayerInit):
        return layer
    if isinstance(layer, Mapping):
        return LayerInit.model_validate(dict(layer))
    raise TypeError(f"expected a sigprop LayerInit (or its dict), got {type(layer).__name__}")


def initializer_for(layer) -> Initializer:
    """The kernel initializer an answer's ``layers[]`` entry asks for, with its ``gain``:
    ``scaled_uniform_orthogonal`` -> :func:`scaled_uniform_orthogonal` ``(gain, delta=False)``,
    ``orthogonal_delta`` -> ``(gain, delta=True)``, ``gaussian`` -> :func:`gaussian` ``(gain)``."""
    layer = _layer(layer)
    if layer.distribution == "scaled_uniform_orthogonal":
        return scaled_uniform_orthogonal(layer.gain, delta=False)
    if layer.distribution == "orthogonal_delta":
        return scaled_uniform_orthogonal(layer.gain, delta=True)
    if layer.distribution == "gaussian":
        return gaussian(layer.gain)
    raise ValueError(f"unknown distribution {layer.distribution!r} of layer {layer.id!r}")  # pragma: no cover


def bias_initializer_for(layer) -> Initializer:
    """The bias initializer of an answer's layer: zeros (also for ``bias == "none"``, should the
    model have a bias anyway), or ``N(0, bias_variance)`` for ``gaussian``."""
    layer = _layer(layer)
    if layer.bias == "gaussian" and layer.bias_variance > 0:
        return gaussian(math.sqrt(layer.bias_variance))
    return zeros


def _expected_fans(layer: LayerInit, shape: tuple[int, ...]) -> tuple[int, int] | None:
    """(fan_in, fan_out) the answer's layer would have on a kernel of this shape (JAX layout)."""
    if len(shape) < 2:
        return None
    if layer.distribution == "orthogonal_delta" and len(shape) > 2:
        return shape[-2], shape[-1]
    return math.prod(shape[:-1]), shape[-1]
