"""The PyTorch adapter end to end: torch model -> graph -> live ``sigprop serve`` -> apply -> the
rewritten network's empirical q and c values match the answer (TAT paper Appendix E.1).

One real server for the module (embedded SQLite cache in a temporary folder, no Redis). Every
network is checked on finite width with fixed seeds, so the checks are deterministic:

* q: the mean squared activation after each transformed activation (forward hooks), averaged over
  networks, stays within 10% of 1 on average over the layers;
* c: the cosine similarity of the outputs for input pairs with cosine c0 (equal norms, q = 1 per
  example, per location for feature maps) matches the answer's global C map at c0 within 0.05.
"""

from __future__ import annotations

import math
import re
import subprocess
import sys
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from sigprop.client.http import Client  # noqa: E402
from sigprop.client.torch import ApplyReport, NormalizedSum, TransformedActivation, apply, graph_from_module  # noqa: E402
from sigprop.errors import SigpropError  # noqa: E402
from sigprop.schemas.solve import Solution  # noqa: E402

from ..service_fixtures import running_service  # noqa: E402

C_TOL = 0.05
Q_TOL = 0.10
TIMINGS: dict[str, float] = {}


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    with running_service(tmp_path_factory.mktemp("svc-torch")) as svc:
        yield svc


@pytest.fixture(scope="module")
def sp(service):
    with Client(service.base_url, timeout=60.0) as client:
        yield client


# -- models written the ordinary way ---------------------------------------------------------------


class MLP(nn.Module):
    def __init__(self, depth: int, width: int, d_in: int | None = None, act=nn.ReLU):
        super().__init__()
        d_in = d_in or width
        layers = [nn.Linear(d_in, width), act()]
        for _ in range(depth - 1):
            layers += [nn.Linear(width, width), act()]
        layers.append(nn.Linear(width, width))
        self.net = nn.Sequential(*layers)

    def forward(self, x):
        return self.net(x)


class Block(nn.Module):
    """A pre-activation residual block: out = x + f(x)."""

    def __init__(self, c: int):
        super().__init__()
        self.f = nn.Sequential(nn.ReLU(), nn.Conv2d(c, c, 3, padding=1), nn.ReLU(), nn.Conv2d(c, c, 1))

    def forward(self, x):
        out = x + self.f(x)
        return out


class ResNet(nn.Module):
    def __init__(self, c_in: int = 8, c: int = 64, blocks: int = 6, classes: int = 10):
        super().__init__()
        self.stem = nn.Conv2d(c_in, c, 3, padding=1)
        self.blocks = nn.Sequential(*[Block(c) for _ in range(blocks)])
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(c, classes)

    def forward(self, x):
        x = self.blocks(self.stem(x))
        x = torch.flatten(self.pool(x), 1)
        return self.fc(x)


class DenseNet(nn.Module):
    """DenseNet-style: each layer sees the concatenation of everything before it."""

    def __init__(self, d_in: int = 64, width: int = 128, growth: int = 64, layers: int = 4):
        super().__init__()
        self.stem = nn.Linear(d_in, width)
        self.layers = nn.ModuleList()
        w = width
        for _ in range(layers):
            self.layers.append(nn.Sequential(nn.ReLU(), nn.Linear(w, growth)))
            w += growth
        self.act = nn.ReLU()
        self.head = nn.Linear(w, 128)

    def forward(self, x):
        h = self.stem(x)
        for layer in self.layers:
            h = torch.cat([h, layer(h)], dim=1)
        return self.head(self.act(h))


class WithBatchNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(32, 64)
        self.bn = nn.BatchNorm1d(64)
        self.fc2 = nn.Linear(64, 32)

    def forward(self, x):
        return self.fc2(F.relu(self.bn(self.fc1(x))))


# -- measuring q and c -----------------------------------------------------------------------------


def _pairs(n_pairs: int, channels: int, locations: int, c0: float, gen: torch.Generator) -> torch.Tensor:
    """[2 n_pairs, channels, locations]: at every location, the two inputs of a pair have squared norm
    ``channels`` (q = 1) and cosine exactly ``c0``."""
    a = torch.randn(n_pairs, channels, locations, generator=gen, dtype=torch.float64)
    b = torch.randn(n_pairs, channels, locations, generator=gen, dtype=torch.float64)
    a = a / a.norm(dim=1, keepdim=True)
    b = b - (a * b).sum(1, keepdim=True) * a
    b = b / b.norm(dim=1, keepdim=True)
    x1 = a
    x2 = c0 * a + math.sqrt(1 - c0 * c0) * b
    return torch.stack([x1, x2], 1).reshape(2 * n_pairs, channels, locations) * math.sqrt(channels)


def _cosines(y: torch.Tensor) -> torch.Tensor:
    """Cosine between consecutive examples (pairs), per location for feature maps."""
    y = y.reshape(y.shape[0] // 2, 2, y.shape[1], -1)
    return F.cosine_similarity(y[:, 0], y[:, 1], dim=1).flatten()


def measure(
    make_model,
    sol: Solution,
    graph: dict,
    x_shape: tuple[int, ...],
    *,
    seeds: int,
    pairs: int,
    c0s=(0.0, 0.5),
    site: str | None = None,
) -> dict:
    """Apply ``sol`` to ``seeds`` freshly built models; per seed feed ``pairs`` input pairs per c0.

    Returns the mean q after every transformed activation and normalized sum (averaged over seeds
    and inputs) and, per c0, the
    mean empirical output c against the answer's global C map (interpolated at c0)."""
    qs, cs = [], {c0: [] for c0 in c0s}
    channels = x_shape[0]
    locations = int(np.prod(x_shape[1:])) if len(x_shape) > 1 else 1
    for s in range(seeds):
        torch.manual_seed(s)
        model = make_model()
        report = apply(model, sol, graph=graph, example_input=torch.randn(2, *x_shape), seed=s)
        net = report.model.double()
        q_layer: list[float] = []
        hooks = [
            m.register_forward_hook(lambda _m, _i, out: q_layer.append(out.pow(2).mean().item()))
            for m in net.modules()
            if isinstance(m, (TransformedActivation, NormalizedSum))
        ]
        seen = {}
        if site is not None:  # c measured on the input of this module (e.g. before global pooling)
            hooks.append(net.get_submodule(site).register_forward_pre_hook(lambda _m, args: seen.update(y=args[0])))
        gen = torch.Generator().manual_seed(10_000 + s)
        xs = [_pairs(pairs, channels, locations, c0, gen).reshape(2 * pairs, *x_shape) for c0 in c0s]
        with torch.no_grad():
            y = net(torch.cat(xs))
        y = seen["y"] if site is not None else y
        for k, c0 in enumerate(c0s):
            cs[c0].append(_cosines(y[2 * pairs * k : 2 * pairs * (k + 1)]).mean().item())
        qs.append(q_layer)
        for h in hooks:
            h.remove()
    q = np.mean(np.array(qs), axis=0)
    out = {
        "q_mean_abs_dev": float(np.mean(np.abs(q - 1))),
        "q_max_abs_dev": float(np.max(np.abs(q - 1))),
        "layers": len(q),
    }
    for c0 in c0s:
        pred = float(np.interp(c0, sol.c_map.c, sol.c_map.global_))
        emp = float(np.mean(cs[c0]))
        out[c0] = {
            "empirical": emp,
            "predicted": pred,
            "deviation": emp - pred,
            "std_over_seeds": float(np.std(cs[c0])),
        }
    return out


def check(result: dict, name: str) -> None:
    print(
        f"\n{name}: q mean |dev| {result['q_mean_abs_dev']:.4f} (max {result['q_max_abs_dev']:.4f}) over "
        f"{result['layers']} activations/sums; "
        + "; ".join(
            f"c0={c0}: empirical {r['empirical']:.4f} predicted {r['predicted']:.4f} dev {r['deviation']:+.4f}"
            for c0, r in result.items()
            if isinstance(c0, float)
        )
    )
    assert result["q_mean_abs_dev"] < Q_TOL, result
    for c0, r in result.items():
        if isinstance(c0, float):
            assert abs(r["deviation"]) < C_TOL, (c0, r)


def _ops(graph: dict) -> dict[str, int]:
    out: dict[str, int] = {}
    for nd in graph["nodes"]:
        out[nd["op"]] = out.get(nd["op"], 0) + 1
    return out


# -- (1) deep MLP, TAT leaky_relu eta 0.9 -------------------------------------------------------------


def test_mlp_depth_50_tat_leaky_relu(sp):
    t0 = time.perf_counter()
    model = MLP(50, 256)
    x = torch.randn(4, 256)
    graph = graph_from_module(model, x)
    ops = _ops(graph)
    assert ops == {"input": 1, "dense": 51, "activation": 50, "output": 1}, ops
    assert graph["nodes"][1] == {"id": "net.0", "op": "dense", "inputs": ["x"], "units": 256, "bias": True}
    assert all("fn" not in nd for nd in graph["nodes"])  # the solve's activation replaces ReLU

    sol = sp.solve(graph, "tat", "leaky_relu", {"eta": 0.9})
    assert sol.network_c_f_0 == pytest.approx(0.9, abs=1e-6)
    assert len(sol.layers) == 51 and {lay.id for lay in sol.layers} == {f"net.{2 * i}" for i in range(51)}

    report = apply(model, sol, graph=graph, example_input=x, seed=0)
    assert isinstance(report, ApplyReport) and report.complete, report.summary()
    assert len(report.activations) == 50 and len(report.layers) == 51 and not report.sums
    assert all(ch.distribution == "scaled_uniform_orthogonal" and ch.bias == "zeros" for ch in report.layers)
    net = report.model
    act = net.get_submodule("net.1")
    assert isinstance(act, TransformedActivation) and act.name == "leaky_relu"
    assert act.params["negative_slope"] == pytest.approx(sol.negative_slope)
    assert act.output_scale == pytest.approx(math.sqrt(2 / (1 + sol.negative_slope**2)))
    w = net.get_submodule("net.10").weight.detach().double()
    assert torch.allclose(w @ w.T, torch.eye(256, dtype=torch.float64), atol=1e-5)  # orthogonal, gain 1
    assert torch.count_nonzero(net.get_submodule("net.10").bias) == 0
    assert isinstance(model.net[1], nn.ReLU)  # the original model is left alone (inplace=False)
    TIMINGS["mlp extract+solve+apply"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    result = measure(lambda: MLP(50, 256), sol, graph, (256,), seeds=16, pairs=16)
    TIMINGS["mlp measure (16 nets)"] = time.perf_counter() - t0
    check(result, "MLP depth 50 width 256, TAT leaky_relu eta 0.9")


# -- (2) ResNet with x + f(x) blocks ----------------------------------------------------------------


def test_resnet_sums_tat_leaky_relu(sp):
    t0 = time.perf_counter()
    x = torch.randn(2, 8, 8, 8)
    model = ResNet()
    graph = graph_from_module(model, x)
    ops = _ops(graph)
    assert ops["sum"] == 6 and ops["conv"] == 13 and ops["activation"] == 12 and ops["global_avg_pool"] == 1, ops
    sums = [nd for nd in graph["nodes"] if nd["op"] == "sum"]
    assert sums[0]["inputs"] == ["stem", "blocks.0.f.3"]
    assert sums[0]["weights"] == pytest.approx([2**-0.5, 2**-0.5])
    conv = next(nd for nd in graph["nodes"] if nd["id"] == "blocks.0.f.1")
    assert conv["kernel"] == [3, 3] and conv["padding"] == "same" and conv["channels"] == 64

    # eta = 0.9 is out of reach for 12 nonlinear layers: the error's hint says how far one can go
    with pytest.raises(SigpropError) as info:
        sp.solve(graph, "tat", "leaky_relu", {"eta": 0.9})
    assert info.value.code == "unreachable_target"
    bound = float(re.search(r"eta <= ([0-9.]+)", info.value.hint).group(1))
    eta = round(0.8 * bound, 2)
    sol = sp.solve(graph, "tat", "leaky_relu", {"eta": eta})
    assert 0 < sol.negative_slope < 1

    report = apply(model, sol, graph=graph, example_input=x, seed=0)
    assert report.complete, report.summary()
    assert len(report.sums) == 6 and len(report.activations) == 12 and len(report.layers) == 14
    assert {ch.distribution for ch in report.layers if ch.op == "conv"} == {"orthogonal_delta"}
    net = report.model
    adds = [m for m in net.modules() if isinstance(m, NormalizedSum)]
    assert len(adds) == 6 and all(m.weights == pytest.approx([2**-0.5] * 2) for m in adds)
    # the adds now compute the normalized sum
    blk = net.get_submodule("sigprop_sum_add")
    a, b = torch.randn(3, 64, 8, 8), torch.randn(3, 64, 8, 8)
    assert torch.allclose(blk(a, b), (a + b) / math.sqrt(2), atol=1e-6)
    # Orthogonal Delta: only the centre tap is non-zero, and it is orthogonal
    w = net.get_submodule("blocks.0.f.1").weight.detach()
    assert torch.count_nonzero(w[:, :, [0, 2], :]) == 0 and torch.count_nonzero(w[:, :, :, [0, 2]]) == 0
    centre = w[:, :, 1, 1].double()
    assert torch.allclose(centre @ centre.T, torch.eye(64, dtype=torch.float64), atol=1e-5)
    stem = net.get_submodule("stem").weight.detach()[:, :, 1, 1].double()  # 8 -> 64: gain sqrt(8)
    assert torch.allclose(stem.T @ stem, 8 * torch.eye(8, dtype=torch.float64), atol=1e-5)
    with torch.no_grad():
        assert net(x).shape == (2, 10)
    TIMINGS["resnet extract+solve+apply"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    # c on the last feature map (the input of the global pooling; pooling and the head are
    # identities on the C map), per location: Delta initialization makes each location a dense net
    result = measure(ResNet, sol, graph, (8, 8, 8), seeds=12, pairs=8, site="pool")
    TIMINGS["resnet measure (12 nets)"] = time.perf_counter() - t0
    check(result, f"ResNet 6 blocks, 64 channels, TAT leaky_relu eta {eta}")


def test_trainable_residual_beta_and_slope(sp):
    x = torch.randn(2, 8, 8, 8)
    model = ResNet(c=16, blocks=3)
    graph = graph_from_module(model, x)
    sol = sp.solve(
        graph,
        "tat",
        "leaky_relu",
        {"eta": 0.4},
        trainable={"negative_slope": True, "residual_beta": "global", "beta": 0.5},
    )
    assert sol.trainable.residual_beta.sums == ["add", "add_1", "add_2"]
    report = apply(model, sol, graph=graph, example_input=x, seed=0)
    sums = {c.id: c for c in report.sums}
    assert sums["add_1"].residual_beta.startswith("add + beta / sqrt(3) * blocks.1.f.3"), sums["add_1"]
    net = report.model
    betas = [n for n, _ in net.named_parameters() if n.endswith(".beta")]
    slopes = [n for n, _ in net.named_parameters() if n.endswith(".negative_slope")]
    assert len(betas) == 1 and len(slopes) == 6, (betas, slopes)  # one global beta, a slope per activation
    s = net.get_submodule("sigprop_sum_add_2")
    a, b = torch.randn(4, 16, 8, 8), torch.randn(4, 16, 8, 8)
    assert torch.allclose(s(a, b), a + 0.5 / math.sqrt(3) * b)
    net(x).sum().backward()
    assert all(p.grad is not None for n, p in net.named_parameters() if n in betas + slopes)


# -- (3) DenseNet-style concatenation -------------------------------------------------------------


def test_densenet_concat_end_to_end(sp):
    t0 = time.perf_counter()
    x = torch.randn(2, 64)
    model = DenseNet()
    graph = graph_from_module(model, x)
    ops = _ops(graph)
    assert ops["concat"] == 4 and ops["dense"] == 6 and ops["activation"] == 5, ops
    cat = next(nd for nd in graph["nodes"] if nd["op"] == "concat")
    assert cat["inputs"] == ["stem", "layers.0.1"]
    sol = sp.solve(graph, "tat", "leaky_relu", {"eta": 0.4})
    report = apply(model, sol, graph=graph, example_input=x, seed=0)
    assert report.complete and len(report.layers) == 6, report.summary()
    with torch.no_grad():
        assert report.model(x).shape == (2, 128)
    TIMINGS["densenet extract+solve+apply"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    result = measure(DenseNet, sol, graph, (64,), seeds=12, pairs=16)
    TIMINGS["densenet measure (12 nets)"] = time.perf_counter() - t0
    check(result, "DenseNet-style, 4 concatenations, TAT leaky_relu eta 0.4")


# -- (4) unsupported ops -------------------------------------------------------------------------


def test_batchnorm_is_unsupported_unless_allowed(sp):
    model = WithBatchNorm()
    x = torch.randn(4, 32)
    with pytest.raises(SigpropError) as info:
        graph_from_module(model, x)
    err = info.value
    assert err.code == "unsupported_op"
    assert "'bn'" in err.message and "BatchNorm1d" in err.message, err.message
    assert "allow_unsupported" in err.hint

    with pytest.warns(UserWarning, match=r"node 'bn' \(BatchNorm1d module 'bn'\).*identity"):
        graph = graph_from_module(model, x, allow_unsupported=True)
    bn = dict(next(nd for nd in graph["nodes"] if nd["id"] == "bn"))
    assert bn.pop("unsupported").startswith("BatchNorm1d module 'bn': ")  # the answer warns of it
    assert bn == {"id": "bn", "op": "identity", "inputs": ["fc1"]}

    sol = sp.solve(graph, "tat", "leaky_relu", {"eta": 0.3})
    assert any("'bn'" in w and "BatchNorm1d" in w for w in sol.warnings), sol.warnings  # over HTTP too
    report = apply(model, sol, graph=graph, example_input=x, seed=0)
    # honest: the BatchNorm is still there and its parameters were not touched
    assert not report.complete
    assert any(u.startswith("bn (BatchNorm1d)") for u in report.uninitialized), report.uninitialized
    assert any("'bn'" in w for w in report.warnings), report.warnings
    assert isinstance(report.model.get_submodule("bn"), nn.BatchNorm1d)


def test_ops_treated_as_the_identity_are_warned_of_in_the_answer():
    """allow_unsupported puts the fact on the graph: the answer's warnings name it (in-process)."""
    import sigprop

    x = torch.randn(4, 32)
    with pytest.warns(UserWarning, match="treated as the identity"):
        graph = graph_from_module(WithBatchNorm(), x, allow_unsupported=True)
    sol = sigprop.solve(graph, "tat", "leaky_relu", {"eta": 0.3})
    warned = [w for w in sol.warnings if "'bn'" in w]
    assert len(warned) == 1 and "BatchNorm1d" in warned[0] and "normalization" in warned[0], sol.warnings
    plain = graph_from_module(MLP(2, 32), x)  # nothing treated as the identity: no such warning
    assert not any("identity" in w for w in sigprop.solve(plain, "tat", "leaky_relu", {"eta": 0.3}).warnings)


def test_report_is_honest_about_unmatched_layers(sp):
    model = MLP(3, 32)
    x = torch.randn(4, 32)
    graph = graph_from_module(model, x)
    sol = sp.solve(graph, "tat", "leaky_relu", {"eta": 0.5})
    ghost = sol.layers[0].model_copy(update={"id": "ghost.layer"})
    edited = sol.model_copy(update={"layers": [lay for lay in sol.layers if lay.id != "net.2"] + [ghost]})
    report = apply(model, edited, graph=graph, example_input=x, seed=0)
    assert report.missing_layers == ["ghost.layer"]
    assert any(u.startswith("net.2 (Linear)") and "does not list" in u for u in report.uninitialized)
    assert not report.complete
    assert "MISSING" in report.summary() and "NOT INITIALIZED" in report.summary()
    # the one it skipped keeps PyTorch's default initialization, the others are orthogonal
    w = report.model.get_submodule("net.4").weight.detach().double()
    assert torch.allclose(w @ w.T, torch.eye(32, dtype=torch.float64), atol=1e-5)
    w2 = report.model.get_submodule("net.2").weight.detach()
    assert torch.equal(w2, model.net[2].weight.detach())


# -- (5) smooth TAT ------------------------------------------------------------------------------


def test_smooth_tat_softplus(sp):
    t0 = time.perf_counter()
    model = MLP(20, 256, act=nn.Softplus)
    x = torch.randn(4, 256)
    graph = graph_from_module(model, x)
    sol = sp.solve(graph, "tat", "softplus", {"tau": 0.3})
    assert sol.c_curv_1 == pytest.approx(0.3, rel=1e-4)
    report = apply(model, sol, graph=graph, example_input=x, seed=0)
    assert report.complete and len(report.activations) == 20
    act = report.model.get_submodule("net.1")
    assert isinstance(act, TransformedActivation) and act.name == "softplus"

    # the module is the closed form output_scale * (log(1 + exp(a x + b)) + d), exactly
    z = np.linspace(-30, 30, 2001)
    a, b, c, d = sol.input_scale, sol.input_shift, sol.output_scale, sol.output_shift
    expected = c * (np.logaddexp(0.0, a * z + b) + d)
    got = act.double()(torch.from_numpy(z)).numpy()
    np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-12)
    # and it agrees with the engine's definition of the transformed activation
    from sigprop.engine.maps.activations import get_activation, transformed

    engine = transformed(get_activation("softplus"), a, b, c, d)
    np.testing.assert_allclose(got, engine(z), rtol=1e-12, atol=1e-12)
    TIMINGS["softplus extract+solve+apply"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    result = measure(lambda: MLP(20, 256, act=nn.Softplus), sol, graph, (256,), seeds=6, pairs=16)
    TIMINGS["softplus measure (6 nets)"] = time.perf_counter() - t0
    check(result, "MLP depth 20 width 256, TAT softplus tau 0.3")


# -- extraction details (no service) -------------------------------------------------------------


class Functional(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv1d(4, 8, 5, padding=2)
        self.c2 = nn.Conv1d(8, 8, 3)
        self.g = nn.GELU(approximate="tanh")
        self.fc = nn.Linear(8 * 14, 16)
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        h = torch.relu(self.c1(x))
        h = F.silu(self.c2(h)) + torch.tanh(self.c2(h))
        h = self.g(h).view(h.size(0), -1)
        h = self.drop(F.gelu(self.fc(h)))
        return nn.functional.elu(h)


def test_functional_calls_conv1d_and_names():
    # activations in a row and on a sum's branches: outside the kernel theory, so extracted under "warn"
    with pytest.warns(UserWarning, match="assumptions not met"):
        graph = graph_from_module(Functional(), torch.randn(3, 4, 16), keep_fn=True, assumptions="warn")
    nodes = {nd["id"]: nd for nd in graph["nodes"]}
    assert nodes["x"] == {"id": "x", "op": "input", "shape": [4, 16, 1]}
    assert nodes["c1"]["kernel"] == [5, 1] and nodes["c1"]["padding"] == "same"
    assert nodes["c2"]["padding"] == "valid"
    assert nodes["c2:1"]["op"] == "conv"  # the second call of the same module gets its own node
    fns = {nd["id"]: nd.get("fn") for nd in graph["nodes"] if nd["op"] == "activation"}
    assert fns == {"relu": "relu", "silu": "swish", "tanh": "tanh", "g": "gelu_tanh", "gelu": "gelu", "elu": "elu"}
    assert nodes["add"]["op"] == "sum" and nodes["add"]["inputs"] == ["silu", "tanh"]
    assert nodes["view"]["op"] == "flatten" and nodes["drop"] == {
        "id": "drop",
        "op": "dropout",
        "inputs": ["gelu"],
        "rate": 0.1,
    }
    assert nodes["output"] == {"id": "output", "op": "output", "inputs": ["elu"]}


def test_transformed_activation_definitions():
    from sigprop.engine.maps.activations import get_activation, transformed

    z = np.linspace(-6, 6, 1201)
    cases = [
        ("relu_tau", {"tau": 0.7}),
        ("soft_threshold", {"tau": 0.4}),
        ("crelu", {"tau": 0.3, "m": 1.5}),
        ("cst", {"tau": 0.2, "m": 0.8}),
        ("leaky_relu", {"negative_slope": 0.2}),
        ("gelu", {}),
        ("gelu_tanh", {}),
        ("swish", {}),
        ("selu", {}),
        ("elu", {"alpha": 1.3}),
        ("tanh", {}),
        ("erf", {}),
        ("sigmoid", {}),
        ("softsign", {}),
        ("bentid", {}),
        ("asinh", {}),
        ("atan", {}),
    ]
    for name, params in cases:
        mod = TransformedActivation(
            name, input_scale=1.3, input_shift=-0.2, output_scale=0.9, output_shift=0.1, **params
        ).double()
        ref = transformed(get_activation(name, **params), 1.3, -0.2, 0.9, 0.1)
        np.testing.assert_allclose(
            mod(torch.from_numpy(z)).detach().numpy(), ref(z), rtol=1e-10, atol=1e-12, err_msg=name
        )
    trelu = TransformedActivation("leaky_relu", negative_slope=0.3, trainable_slope=True)
    assert isinstance(trelu.negative_slope, nn.Parameter)
    trelu(torch.randn(5)).sum().backward()
    assert trelu.negative_slope.grad is not None


def test_import_without_torch_says_how_to_install():
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "try:\n    import sigprop.client.torch\nexcept ImportError as e:\n    print('IMPORT-ERROR', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "IMPORT-ERROR" in out.stdout and "pip install 'sigprop[torch]'" in out.stdout, out.stdout + out.stderr


def test_zz_timings():
    """Prints the per-step timings gathered above (run with -s to see them)."""
    for k, v in TIMINGS.items():
        print(f"{k}: {v:.2f} s")
