"""Shape a hand-written Flax GPT-style model without shortcuts or norms (issue 28): extract its graph,
solve it in this process (E-SPA attention, TAT Leaky ReLU MLPs), apply the answer to its variables and
compare the output token kernel with the answer's prediction. Run: python examples/flax_gpt_shaping.py"""

from collections.abc import Callable

import flax.linen as nn
import jax

import sigprop
from sigprop.client import jax as sjax
from sigprop.client.jax.attention import ShapedAttention


class Block(nn.Module):
    width: int
    heads: int
    max_len: int
    act: Callable = nn.relu

    @nn.compact
    def __call__(self, x):
        q, k, v = (nn.Dense(self.width, name=n)(x) for n in ("q", "k", "v"))  # three Dense: zero queries
        y = ShapedAttention(self.heads, self.max_len, causal=True, name="attn")(q, k, v)  # plain attention
        y = nn.Dense(self.width, name="proj")(y)
        return nn.Dense(self.width, name="fc2")(self.act(nn.Dense(4 * self.width, name="fc1")(y)))


class GPT(nn.Module):
    depth: int
    width: int
    heads: int
    max_len: int
    act: Callable = nn.relu

    @nn.compact
    def __call__(self, x):
        for i in range(self.depth):
            x = Block(self.width, self.heads, self.max_len, self.act, name=f"b{i}")(x)
        return x


def main(depth: int = 4, seq_len: int = 16, width: int = 128, heads: int = 4, eta: float = 0.5) -> None:
    x = jax.random.normal(jax.random.PRNGKey(0), (4, seq_len, width))  # [batch, tokens, features]
    graph, mapping = sjax.graph_from_flax(GPT(depth, width, heads, seq_len), x)
    sol = sigprop.solve(graph, "tat", "leaky_relu", {"eta": eta}, attention={"shaping": "e-spa"})
    model = GPT(depth, width, heads, seq_len, act=sjax.transformed_activation(sol))  # the answer's activation
    variables = model.init(jax.random.PRNGKey(1), x)  # the whole dict: "params" and "shaping"
    variables, report = sjax.apply_to_params(variables, sol, mapping, jax.random.PRNGKey(2))
    print(report)
    print(sjax.diagnose(model.bind(variables), sol, x))  # train model with these variables


if __name__ == "__main__":
    main()
