"""Input pairs at a known cosine for channels-last batches (JAX/Flax and Keras), in numpy.

``diagnose`` feeds a network two inputs with q = 1 and cosine ``input_c`` per example (per location
of a feature map: the channel vector, the last axis) and compares each node's measured q and c with
the answer's prediction. The torch adapter builds the same pairs channels-first
(``sigprop.client.torch.input_pair``).
"""

from __future__ import annotations

import math

import numpy as np

from .diagnosis import pair_c

# the partner draw is offset from the caller's seed, so it is never the stream apply(seed=s) drew
# the first layer's weights from (which would correlate the pair with those weights)
PAIR_SEED_OFFSET = 0x51D1A6


def channels_last_pair(example_input, input_c: float, *, same_locations: bool = False, seed: int = 0):
    """``(x1, x2)``, float64 numpy arrays with q = 1 and cosine exactly ``input_c`` per example
    (``[B, F]``) or per location (the channel vectors of ``[B, ..., C]``).

    ``x1`` is ``example_input`` with each vector rescaled to mean square 1; ``x2 = input_c * x1 +
    sqrt(1 - input_c^2) * z`` with ``z`` a seeded Gaussian draw orthogonal to ``x1``, of the same
    norm. ``same_locations=True`` first replaces each example by its spatial mean at every location,
    so pooling leaves the maps unchanged. A map with one channel (``[B, H, W, 1]``) has no second
    direction at a location: there ``x1`` is +-1 everywhere and ``x2`` is ``x1`` with the signs of a
    seeded share ``(1 - input_c) / 2`` of each example's locations flipped (q = 1, cosine
    ``input_c`` per example to within 1 / locations)."""
    input_c = pair_c(input_c)
    x = np.asarray(example_input, dtype=np.float64)
    if x.ndim < 2:
        raise ValueError(f"example_input must be batched, got shape {list(x.shape)}")
    n = x.shape[-1]
    rng = np.random.default_rng(PAIR_SEED_OFFSET + int(seed))
    if n == 1 and x.ndim > 2:
        if same_locations:
            raise ValueError(
                "same_locations=True needs two or more input channels: one channel, the same at every "
                "location, gives two inputs whose cosine is +-1"
            )
        x1 = np.where(x >= 0, 1.0, -1.0)
        flat = x1.reshape(x1.shape[0], -1)
        flips = round((1.0 - input_c) / 2.0 * flat.shape[1])
        order = rng.random(flat.shape).argsort(axis=1)[:, :flips]
        x2 = flat.copy()
        np.put_along_axis(x2, order, -np.take_along_axis(flat, order, axis=1), axis=1)
        return x1, x2.reshape(x1.shape)
    if n < 2:
        raise ValueError(
            f"example_input has {n} feature(s) (shape {list(x.shape)}): a pair at a cosine needs at least 2"
        )
    z = rng.standard_normal(x.shape)
    spatial = tuple(range(1, x.ndim - 1))
    if same_locations and spatial:
        x = np.broadcast_to(x.mean(axis=spatial, keepdims=True), x.shape).copy()
        z = np.broadcast_to(z.mean(axis=spatial, keepdims=True), z.shape).copy()
    x1 = x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), 1e-30) * math.sqrt(n)
    z = z - (z * x1).sum(-1, keepdims=True) / n * x1
    z = z / np.maximum(np.linalg.norm(z, axis=-1, keepdims=True), 1e-30) * math.sqrt(n)
    return x1, input_c * x1 + math.sqrt(1.0 - input_c * input_c) * z


def q_and_c(y, half: int) -> tuple[float, float]:
    """Mean square over both halves of a pair's batch; mean cosine of the halves along the last axis."""
    y = np.asarray(y, np.float64)
    a, b = y[:half], y[half:]
    cos = (a * b).sum(-1) / np.maximum(np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1), 1e-300)
    return float((y * y).mean()), float(cos.mean())
