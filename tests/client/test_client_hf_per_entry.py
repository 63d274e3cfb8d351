"""Issue 36's per-entry check at the issue's size (slow: 2-5 minutes a case on a 2-core CPU).

A 6-block GPT-2 or Llama (4 heads; Llama with 2 key-value heads; T = 64) at width 1024 with GPT-2's
vocabulary, read, solved (dks), applied with 8 seeds: every entry of the output token kernel within
3 standard errors of the mean over the 8 networks + 0.02 of the answer's ``token_kernel.output``.
docs/transformers.md has the table for every recipe and shaping, and why width 256 misses a few of
the 4,096 entries (noise: the largest of some 2,000 Student t's with 7 degrees of freedom).
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

import sigprop  # noqa: E402
from sigprop.client.torch import apply, diagnose_tokens, graph_from_module, normalization_free  # noqa: E402

pytestmark = pytest.mark.slow

T, WIDTH, VOCAB, NETWORKS = 64, 1024, 50257, 8


def _model(family: str, seed: int):
    torch.manual_seed(seed)
    if family == "gpt2":
        cfg = transformers.GPT2Config(n_layer=6, n_embd=WIDTH, n_head=4, vocab_size=VOCAB, n_positions=T)
        return transformers.GPT2LMHeadModel(cfg).eval()
    cfg = transformers.LlamaConfig(
        num_hidden_layers=6, hidden_size=WIDTH, intermediate_size=2 * WIDTH, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=T,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(cfg).eval()


# (family, recipe, shaping, activation, zeta): Llama's zeta 15 % above the floor its gated MLPs set (2.387)
CASES = [
    ("gpt2", "keep", "e-spa", "gelu_tanh", 1.5),
    ("gpt2", "normalization_free", "u-spa", "gelu_tanh", 1.5),
    ("llama", "keep", "u-spa", "swish", 2.745),
]


@pytest.mark.parametrize("family,recipe,shaping,act,zeta", CASES, ids=[f"{c[0]}-{c[1]}-{c[2]}" for c in CASES])
def test_every_entry_of_the_output_token_kernel_within_3_se_plus_0_02(family, recipe, shaping, act, zeta):
    ids = torch.randint(0, 100, (2, T), generator=torch.Generator().manual_seed(0))
    nets, sol = [], None
    for seed in range(NETWORKS):
        model = _model(family, seed)
        if recipe == "normalization_free":
            model = normalization_free(model).model
        if sol is None:
            sol = sigprop.solve(
                graph_from_module(model, ids), "dks", act, {"zeta": zeta}, attention={"shaping": shaping}
            )
        nets.append(apply(model, sol, example_input=ids, seed=seed).model)
    diag = diagnose_tokens(nets, sol)
    err, se = np.abs(diag.error), diag.noise
    beyond = int((err > 3 * se + 0.02).sum())
    print(f"{family} {recipe} {shaping}: max |error| {err.max():.4f}, median SE {np.median(se):.4f}, {beyond} beyond")
    assert beyond == 0 and diag.ok, str(diag)
