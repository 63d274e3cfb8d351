"""Shape a hand-written GPT-style model without shortcuts or norms (issue 28): extract its graph,
solve it in this process (E-SPA attention, TAT Leaky ReLU MLPs), apply the answer and compare the
output token kernel with the answer's prediction. Run: python examples/gpt_shaping.py"""

import torch
import torch.nn.functional as F
from torch import nn

import sigprop
from sigprop.client.torch import apply, diagnose, graph_from_module


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads, self.qkv, self.proj = heads, nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.qkv(x).split(C, dim=2)  # one fused Linear: three dense nodes in the graph
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C)
        return self.fc2(F.relu(self.fc1(self.proj(y))))


def main(depth: int = 4, seq_len: int = 16, width: int = 128, heads: int = 4, eta: float = 0.5) -> None:
    model = nn.Sequential(*[Block(width, heads) for _ in range(depth)])
    x = torch.randn(4, seq_len, width)  # [batch, tokens, features]: the embeddings' output
    graph = graph_from_module(model, x)
    sol = sigprop.solve(graph, "tat", "leaky_relu", {"eta": eta}, attention={"shaping": "e-spa"})
    report = apply(model, sol, graph=graph, example_input=x, seed=0)
    print(report.summary())
    print(diagnose(report.model, sol, x))  # train report.model


if __name__ == "__main__":
    main()
