"""``apply`` options of the PyTorch adapter, with answers from the engine in-process:

* ``inplace=True`` makes the model itself compute the solved network (module swaps at their own
  paths, parameters re-initialized in place) or, where its forward code holds an add or a function
  call that only the rewritten GraphModule can change, raises and leaves the model untouched;
* ``residual="recommended"`` weights the residual adds with the answer's ``jacobian.recommended``
  shortcut and branch weights, and says so; the default keeps the solved graph's weights.
"""

from __future__ import annotations

import copy
import math

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from sigprop.client.torch import NormalizedSum, TransformedActivation, apply, graph_from_module  # noqa: E402

from ..solving import solve_graph  # noqa: E402

_solve = solve_graph


class MLP(nn.Module):
    def __init__(self, depth: int = 4, width: int = 32):
        super().__init__()
        layers: list[nn.Module] = []
        for _ in range(depth):
            layers += [nn.Linear(width, width), nn.ReLU()]
        self.net = nn.Sequential(*layers, nn.Linear(width, 10))

    def forward(self, x):
        return self.net(x)


class PlainAddBlock(nn.Module):
    """x + f(x) written with ``+`` in forward: only the GraphModule can make it a normalized sum."""

    def __init__(self, c: int):
        super().__init__()
        self.f = nn.Sequential(nn.ReLU(), nn.Linear(c, c), nn.ReLU(), nn.Linear(c, c))

    def forward(self, x):
        return x + self.f(x)


class FlippedBlock(PlainAddBlock):
    def forward(self, x):
        return self.f(x) + x


class ModuleAddBlock(nn.Module):
    """The same block with its add as a module of its own, which apply can swap in place."""

    def __init__(self, c: int):
        super().__init__()
        self.f = nn.Sequential(nn.ReLU(), nn.Linear(c, c), nn.ReLU(), nn.Linear(c, c))
        self.add = NormalizedSum(2)

    def forward(self, x):
        return self.add(x, self.f(x))


class ResMLP(nn.Module):
    def __init__(self, block=PlainAddBlock, blocks: int = 4, width: int = 32):
        super().__init__()
        self.stem = nn.Linear(16, width)
        self.blocks = nn.Sequential(*[block(width) for _ in range(blocks)])
        self.head = nn.Linear(width, 10)

    def forward(self, x):
        return self.head(self.blocks(self.stem(x)))


def _state(model: nn.Module) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# -- inplace=True ------------------------------------------------------------------------------------


@pytest.mark.parametrize("make", [MLP, lambda: ResMLP(ModuleAddBlock)], ids=["mlp", "module-adds"])
def test_inplace_makes_the_model_itself_the_solved_network(make):
    torch.manual_seed(0)
    model = make()
    x = torch.randn(8, 32 if isinstance(model, MLP) else 16)
    graph = graph_from_module(model, x)
    sol = _solve(graph)
    twin = copy.deepcopy(model)
    first_weight = next(twin.parameters())
    solved = apply(model, sol, graph=graph, example_input=x, seed=3)  # a rewritten copy
    report = apply(twin, sol, graph=graph, example_input=x, seed=3, inplace=True)
    assert report.model is twin and type(twin) is type(model)
    assert next(twin.parameters()) is first_weight  # the same tensors, re-initialized in place
    assert all(isinstance(m, TransformedActivation) for m in twin.modules() if isinstance(m, nn.ReLU)) is True
    assert not any(type(m) is nn.ReLU for m in twin.modules())
    assert sum(isinstance(m, TransformedActivation) for m in twin.modules()) == len(report.activations)
    with torch.no_grad():
        assert torch.allclose(twin(x), solved.model(x), atol=1e-6)  # computes exactly the solved network
        assert not torch.allclose(model(x), twin(x))  # the original (inplace=False) is untouched
    assert any(type(m) is nn.ReLU for m in model.modules())


def test_inplace_refuses_forward_code_it_cannot_change_and_leaves_the_model_alone():
    torch.manual_seed(0)
    model = ResMLP(PlainAddBlock)
    x = torch.randn(8, 16)
    graph = graph_from_module(model, x)
    sol = _solve(graph)
    before = _state(model)
    with pytest.raises(ValueError, match=r"inplace=True\) cannot.*add \(add\(\) call 'add'\)") as err:
        apply(model, sol, graph=graph, example_input=x, seed=0, inplace=True)
    assert "left unchanged" in str(err.value)
    after = _state(model)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert sum(type(m) is nn.ReLU for m in model.modules()) == 8  # its activations too


# -- residual="recommended" -------------------------------------------------------------------------


def test_residual_recommended_uses_the_jacobian_weights_and_says_so():
    torch.manual_seed(0)
    model = ResMLP(PlainAddBlock, blocks=6, width=64)
    x = torch.randn(4, 16)
    graph = graph_from_module(model, x)
    sol = _solve(graph)
    rec = sol.jacobian.recommended
    ws, wb = rec["shortcut_weight"], rec["branch_weight"]
    assert sol.jacobian.kind == "residual" and ws**2 + wb**2 == pytest.approx(1.0)
    assert abs(ws - 2**-0.5) > 0.05  # the recommendation differs from the graph's equal weights

    default = apply(model, sol, graph=graph, example_input=x, seed=0)
    assert default.residual == "graph" and {s.source for s in default.sums} == {"graph"}
    assert all(s.weights == pytest.approx([2**-0.5] * 2) for s in default.sums)

    report = apply(model, sol, graph=graph, example_input=x, seed=0, residual="recommended")
    assert report.residual == "recommended" and len(report.sums) == 6
    assert all(s.source == "jacobian.recommended" and s.weights == pytest.approx([ws, wb]) for s in report.sums)
    assert any("jacobian.recommended" in n for n in report.notes) and "(jacobian.recommended)" in report.summary()
    add = report.model.get_submodule(report.sums[0].module)
    shortcut, branch = torch.randn(3, 64), torch.randn(3, 64)
    assert torch.allclose(add(shortcut, branch), ws * shortcut + wb * branch)
    # the same weights whichever side of the + the shortcut is written on
    flipped = ResMLP(PlainAddBlock, blocks=2, width=64)
    flipped.blocks[0] = FlippedBlock(64)
    g2 = graph_from_module(flipped, x)
    s2 = _solve(g2, targets={"eta": 0.3})
    r2 = apply(flipped, s2, graph=g2, example_input=x, seed=0, residual="recommended")
    w2 = s2.jacobian.recommended
    assert r2.sums[0].weights == pytest.approx([w2["branch_weight"], w2["shortcut_weight"]])
    assert r2.sums[1].weights == pytest.approx([w2["shortcut_weight"], w2["branch_weight"]])


def test_residual_recommended_needs_a_recommendation():
    model = MLP()
    x = torch.randn(4, 32)
    graph = graph_from_module(model, x)
    sol = _solve(graph)
    with pytest.raises(ValueError, match="jacobian.recommended"):
        apply(model, sol, graph=graph, example_input=x, residual="recommended")
    with pytest.raises(ValueError, match="'graph' or 'recommended'"):
        apply(model, sol, graph=graph, example_input=x, residual="jacobian")
    assert math.isfinite(sol.network_c_f_0)
