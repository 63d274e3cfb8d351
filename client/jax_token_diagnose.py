"""``diagnose`` for Flax sequence models: the output token kernel, measured against the answer's.

A sequence model's answer predicts ``token_kernel.output``: the ``T x T`` second moments
``E[y_i . y_j] / width`` of the output tokens at infinite width, for orthonormal input tokens with
q = 1 each (the input of "Deep Transformers without Shortcuts: Modifying Self-attention for
Faithful Signal Propagation", He, Martens et al., arXiv:2302.10322, section 3: Sigma_0 = I). The
measurement feeds the network such sequences (each a random orthonormal frame, scaled to q = 1 per
token) and averages ``Y Y^T / width`` over them; the standard error is over the sequences, for this
one network: a finite-width network's own kernel also differs from the limit by O(1/sqrt(width))
per layer, which only averaging several networks (:func:`measure_token_kernel` per seed) shows.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np

from .solution import as_solution

__all__ = ["TokenKernelDiagnosis", "orthonormal_tokens", "measure_token_kernel", "diagnose_tokens"]

# the input draw is offset from the caller's seed, so it is never the stream of the weights
TOKEN_SEED_OFFSET = 0x70C3


def orthonormal_tokens(batch: int, seq_len: int, width: int, *, seed: int = 0) -> np.ndarray:
    """``[batch, seq_len, width]`` float32: each sequence's tokens orthonormal, scaled so q = 1
    (``X X^T = width I``), a fresh uniformly random frame per sequence. Needs ``seq_len <= width``."""
    if seq_len > width:
        raise ValueError(f"{seq_len} orthonormal tokens need a width of at least {seq_len}, got {width}")
    rng = np.random.default_rng(TOKEN_SEED_OFFSET + int(seed))
    out = np.empty((batch, seq_len, width), np.float32)
    for b in range(batch):
        q, r = np.linalg.qr(rng.standard_normal((width, seq_len)))
        out[b] = (q * np.sign(np.diag(r))).T * math.sqrt(width)
    return out


def token_kernels(y) -> np.ndarray:
    """Per-sequence kernels ``Y Y^T / width`` of outputs ``[B, T, width]``: ``[B, T, T]`` float64."""
    y = np.asarray(y, np.float64)
    return np.einsum("btd,bsd->bts", y, y) / y.shape[-1]


@functools.lru_cache(maxsize=16)
def _jitted_apply(module):
    """``jax.jit(module.apply)``, once per module (Flax modules are frozen dataclasses, hashable)."""
    return jax.jit(module.apply)


def measure_token_kernel(module, variables, x) -> tuple[np.ndarray, np.ndarray]:
    """(mean, standard error over the sequences) of the output token kernel of ``module.apply(variables, x)``."""
    k = token_kernels(_jitted_apply(module)(variables, jnp.asarray(x)))
    se = k.std(axis=0, ddof=1) / math.sqrt(k.shape[0]) if k.shape[0] > 1 else np.full(k.shape[1:], np.nan)
    return k.mean(axis=0), se


@dataclass
class TokenKernelDiagnosis:
    """The output token kernel of one network, measured (mean over ``examples`` sequences) and predicted."""

    measured: np.ndarray  # T x T
    standard_error: np.ndarray  # T x T, over the sequences (this network's weights fixed)
    predicted: np.ndarray | None  # T x T, the answer's token_kernel.output (None: not in the answer)
    examples: int
    notes: list[str] = field(default_factory=list)

    @property
    def error(self) -> np.ndarray | None:
        return None if self.predicted is None else self.measured - self.predicted

    def max_abs_error(self) -> float | None:
        return None if self.predicted is None else float(np.max(np.abs(self.error)))

    def max_error_over_se(self) -> float | None:
        if self.predicted is None:
            return None
        return float(np.max(np.abs(self.error) / np.maximum(self.standard_error, 1e-12)))

    def __str__(self) -> str:
        t = self.measured.shape[0]
        lines = [f"output token kernel, {t} tokens, {self.examples} sequences of orthonormal tokens (q = 1)"]
        if self.predicted is None:
            lines.append("  the answer predicts no output token kernel")
        else:
            err, ratio = self.max_abs_error(), self.max_error_over_se()
            lines.append(f"  max |measured - predicted| {err:.4f}, max |error| / SE {ratio:.2f}")
            diag_m, diag_p = np.diag(self.measured), np.diag(self.predicted)
            lines.append(f"  q per token: measured {diag_m.min():.4f}..{diag_m.max():.4f}, "
                         f"predicted {diag_p.min():.4f}..{diag_p.max():.4f}")  # fmt: skip
            lines.append(f"  last token's row: measured {np.round(self.measured[-1], 3).tolist()}")
            lines.append(f"                   predicted {np.round(self.predicted[-1], 3).tolist()}")
        lines.extend(f"  note: {n}" for n in self.notes)
        return "\n".join(lines)


def predicted_token_kernel(sol) -> tuple[np.ndarray | None, str]:
    """The answer's ``token_kernel.output`` as an array (None, why, when it has none); past the
    service's limit, its ``leading`` block (the kernel of the first tokens, exact: at init no token
    reads later ones), with the note ``"leading"``."""
    tk = getattr(sol, "token_kernel", None)
    if tk is None:
        return None, "the answer has no token_kernel (not a sequence model's answer?)"
    get = tk.get if isinstance(tk, dict) else lambda name: getattr(tk, name, None)
    if get("output") is not None:
        return np.asarray(get("output"), np.float64), ""
    if get("leading") is not None:
        return np.asarray(get("leading"), np.float64), "leading"
    return None, "the answer omits token_kernel.output (its sequence is longer than the service returns)"


def diagnose_tokens(model, solution, example_input, *, seed: int = 0) -> TokenKernelDiagnosis:
    """The output token kernel of a Flax sequence model against the answer's ``token_kernel.output``.

    ``model``: a bound module or a ``(module, variables)`` pair (the variables with the answer
    applied: ``apply_to_params`` on the whole variables dict). ``example_input``: ``[B, T, D]``;
    only its shape is used: B sequences of T orthonormal tokens of width D (q = 1 per token) are
    fed instead (:func:`orthonormal_tokens`)."""
    module, variables = model if isinstance(model, tuple) else model.unbind()
    sol = as_solution(solution)
    b, t, d = (int(s) for s in np.shape(example_input))
    x = orthonormal_tokens(b, t, d, seed=seed)
    mean, se = measure_token_kernel(module, variables, x)
    predicted, why = predicted_token_kernel(sol)
    notes = [why] if why and why != "leading" else []
    if why == "leading" and predicted is not None and predicted.shape[0] <= t:
        n = predicted.shape[0]
        notes.append(f"the answer predicts the first {n} tokens' kernel only (T over its limit): compared there")
        mean, se = mean[:n, :n], se[:n, :n]
    if predicted is not None and predicted.shape != mean.shape:
        notes.append(f"the answer's token kernel is for {predicted.shape[0]} tokens, the input has {t}")
        predicted = None
    notes.append(
        "the standard error is over the input sequences for this network's weights; a finite-width "
        "network's kernel differs from the limit by O(1/sqrt(width)) per layer besides: average networks"
    )
    return TokenKernelDiagnosis(mean, se, predicted, b, notes)
