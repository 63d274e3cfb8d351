"""``sigprop.schemas.attention_init``: the attention matrix at initialization from an answer's
compact generator ("Deep Transformers without Shortcuts", He, Martens et al., arXiv:2302.10322,
sections 3-4; "The Shaped Transformer", Noci et al., arXiv:2306.17759).

Reference matrices are built here with numpy's Cholesky and solve, not with the module's closed
forms."""

from __future__ import annotations

import numpy as np
import pytest

from sigprop.schemas.attention_init import (
    AttentionInit,
    cholesky_ratio,
    expand_attention,
    exponential_cholesky,
    kernel_factor,
    kernel_matrix,
    mask_bias,
)

T = 24


def exp_kernel(gamma: float, t: int = T) -> np.ndarray:
    i = np.arange(t)
    return np.exp(-gamma * np.abs(i[:, None] - i[None, :]))


def uniform_kernel(rho: float, t: int = T) -> np.ndarray:
    return (1.0 - rho) * np.eye(t) + rho * np.ones((t, t))


def ratio(generator: dict, t: int = T) -> np.ndarray:
    return expand_attention(generator, t, causal=True).matrix()


@pytest.mark.parametrize("gamma", [1e-3, 0.005, 0.1, 1.0, 5.0])
def test_closed_form_exponential_cholesky_equals_numpys(gamma):
    lower = exponential_cholesky(gamma, T)
    assert np.allclose(lower, np.linalg.cholesky(exp_kernel(gamma)), rtol=0, atol=1e-12)
    assert np.allclose(np.triu(lower, 1), 0.0)
    assert np.array_equal(kernel_factor({"family": "exponential", "gamma": gamma}, T), lower)


@pytest.mark.parametrize(
    "family, dense",
    [
        ({"family": "identity"}, np.eye(T)),
        ({"family": "exponential", "gamma": 0.3}, exp_kernel(0.3)),
        ({"family": "uniform", "rho": 0.6}, uniform_kernel(0.6)),
    ],
)
def test_kernel_families(family, dense):
    assert np.allclose(kernel_matrix(family, T), dense, rtol=0, atol=1e-15)
    lower = kernel_factor(family, T)
    assert np.allclose(lower @ lower.T, dense, rtol=0, atol=1e-12)


SPA_CASES = [
    # E-SPA's first layer (orthonormal tokens in), a middle layer, and U-SPA's
    ({"family": "exponential", "gamma": 0.4}, {"family": "identity"}),
    ({"family": "exponential", "gamma": 0.05}, {"family": "exponential", "gamma": 0.2}),
    ({"family": "exponential", "gamma": 0.005}, {"family": "exponential", "gamma": 0.0051}),
    ({"family": "uniform", "rho": 0.3}, {"family": "identity"}),
    ({"family": "uniform", "rho": 0.8}, {"family": "uniform", "rho": 0.5}),
]


@pytest.mark.parametrize("target, source", SPA_CASES)
def test_cholesky_ratio_maps_source_kernel_to_target_kernel(target, source):
    a = ratio({"form": "cholesky_ratio", "target": target, "source": source})
    sigma_s, sigma_t = kernel_matrix(source, T), kernel_matrix(target, T)
    assert np.allclose(a @ sigma_s @ a.T, sigma_t, rtol=0, atol=1e-11)
    # against numpy: L_t L_s^{-1} by a dense solve
    ls, lt = np.linalg.cholesky(sigma_s), np.linalg.cholesky(sigma_t)
    assert np.allclose(a, lt @ np.linalg.inv(ls), rtol=0, atol=1e-10)
    assert np.allclose(cholesky_ratio(target, source, T), a, rtol=0, atol=1e-12)
    # lower triangular, non-negative (a softmax can produce it), A = D P with P row-stochastic
    assert np.all(np.triu(a, 1) == 0.0)
    assert np.all(a >= 0.0)


@pytest.mark.parametrize("target, source", SPA_CASES)
def test_expansion_is_a_rescaled_softmax_of_the_bias(target, source):
    init = expand_attention({"form": "cholesky_ratio", "target": target, "source": source}, T, causal=True)
    p = init.softmax()
    assert np.allclose(p.sum(axis=1), 1.0)
    assert np.all(np.isneginf(init.bias[np.triu_indices(T, 1)]))
    a = ratio({"form": "cholesky_ratio", "target": target, "source": source})
    assert np.allclose(init.scale, a.sum(axis=1))
    assert np.allclose(init.scale[:, None] * p, a, rtol=0, atol=1e-14)
    assert init.identity == 0.0 and init.centre == 0.0 and init.causal


def test_a_target_less_correlated_than_its_source_is_refused():
    gen = {
        "form": "cholesky_ratio",
        "target": {"family": "exponential", "gamma": 0.5},
        "source": {"family": "exponential", "gamma": 0.1},
    }
    with pytest.raises(ValueError, match="negative entry"):
        expand_attention(gen, T, causal=True)
    gen = {
        "form": "cholesky_ratio",
        "target": {"family": "uniform", "rho": 0.2},
        "source": {"family": "uniform", "rho": 0.5},
    }
    with pytest.raises(ValueError, match="negative entry"):
        expand_attention(gen, T, causal=True)


@pytest.mark.parametrize("causal", [True, False])
def test_value_skipinit_and_shaped_attention_are_the_identity_at_init(causal):
    for gen in ({"form": "value_skipinit", "alpha": 1.0, "beta": 0.0}, {"form": "shaped", "temperature": 1.0}):
        init = expand_attention(gen, T, causal=causal)
        assert np.allclose(init.matrix(), np.eye(T), rtol=0, atol=1e-15)
        assert init.causal is causal
    assert expand_attention({"form": "shaped", "temperature": 2.5}, T, causal).temperature == 2.5


def test_value_skipinit_mixes_identity_and_plain_attention():
    init = expand_attention({"form": "value_skipinit", "alpha": 0.7, "beta": 0.4}, 5, causal=True)
    uniform_causal = np.tril(np.ones((5, 5))) / np.arange(1, 6)[:, None]
    assert np.allclose(init.matrix(), 0.7 * np.eye(5) + 0.4 * uniform_causal)
    full = expand_attention({"form": "value_skipinit", "alpha": 0.0, "beta": 1.0}, 4, causal=False)
    assert np.allclose(full.matrix(), np.full((4, 4), 0.25))


def test_mask_bias():
    assert np.array_equal(mask_bias(3, False), np.zeros((3, 3)))
    causal = mask_bias(3, True)
    assert np.all(np.isneginf(causal[np.triu_indices(3, 1)])) and np.all(causal[np.tril_indices(3)] == 0.0)


@pytest.mark.parametrize(
    "generator, match",
    [
        ({"form": "linear"}, "unknown attention generator form"),
        (
            {"form": "cholesky_ratio", "target": {"family": "cosine"}, "source": {"family": "identity"}},
            "unknown kernel",
        ),
        (
            {
                "form": "cholesky_ratio",
                "target": {"family": "exponential", "gamma": 0.0},
                "source": {"family": "identity"},
            },
            "gamma > 0",
        ),
        (
            {"form": "cholesky_ratio", "target": {"family": "uniform", "rho": 1.0}, "source": {"family": "identity"}},
            "0 <= rho < 1",
        ),
    ],
)
def test_bad_generators_are_refused(generator, match):
    with pytest.raises(ValueError, match=match):
        expand_attention(generator, 6, causal=True)


def test_attention_init_is_an_immutable_record():
    init = expand_attention({"form": "shaped"}, 3, causal=True)
    assert isinstance(init, AttentionInit)
    with pytest.raises(AttributeError):
        init.identity = 0.0  # type: ignore[misc]
