"""A torchvision-style ResNet through the client: the structure check refuses its post-activation
blocks as the service does, and ``normalization_free(..., preactivation=True)`` gives a network the
theory covers, whose logits keep q = 1 once the answer is applied (real PyTorch, a live service)."""

from __future__ import annotations

import math
import warnings

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from sigprop.client.http import Client  # noqa: E402
from sigprop.client.torch import apply, graph_from_module, normalization_free  # noqa: E402
from sigprop.errors import SigpropError  # noqa: E402

from ..service_fixtures import start_service  # noqa: E402
from ..torchvision_style import resnet18, resnet50  # noqa: E402

SIZE = 32


@pytest.fixture(scope="module")
def sp(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("svc-convert")
    svc = start_service(tmp, {"SIGPROP_REDIS_URL": None, "SIGPROP_DATA_DIR": str(tmp / "data")})
    with Client(svc.base_url, timeout=120.0) as client:
        yield client
    svc.stop()


def example():
    return torch.randn(2, 3, SIZE, SIZE)


def test_batchnorm_is_named_and_removed_with_a_report():
    with pytest.raises(SigpropError) as err:
        graph_from_module(resnet18(num_classes=10), example())
    assert err.value.code == "unsupported_op" and "bn1" in err.value.message
    model = resnet18(num_classes=10)
    report = normalization_free(model)
    assert len(report.removed) == 20 and "layer1.0.bn1" in report.removed  # 1 stem + 2 x 8 blocks + 3 downsample
    assert isinstance(model.bn1, nn.BatchNorm2d)  # the original is untouched
    assert not any(isinstance(m, nn.BatchNorm2d) for m in report.model.modules())


def test_post_activation_blocks_get_the_services_structure_error(sp):
    net = normalization_free(resnet18(num_classes=10)).model
    with pytest.raises(SigpropError) as err:
        graph_from_module(net, example())
    assert err.value.code == "unsupported_structure" and "pre-activation" in err.value.hint
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        graph = graph_from_module(net, example(), assumptions="warn")
    assert any("assumptions not met" in str(w.message) for w in caught)
    with pytest.raises(SigpropError) as served:  # the service says the same
        sp.solve(graph, "tat", "leaky_relu", {"eta": 0.5})
    assert served.value.code == "unsupported_structure"
    assert set(_named(served.value.message)) & set(_named(err.value.message))


def _named(message: str) -> list[str]:
    inside = message.split("(", 1)[1].split(")", 1)[0]
    return [part.strip(" '") for part in inside.split(",")]


def _q_and_c_at_logits(model, nets_seed: int, inputs: int = 16):
    """Mean square of the logits and cosine of input pairs at c0 = 0, for images whose locations all
    hold the same vector (where pooling is the identity on the kernel maps)."""
    g = torch.Generator().manual_seed(nets_seed)
    base = torch.linalg.qr(torch.randn(3, 3, generator=g))[0].T[:2] * math.sqrt(3)  # two orthogonal pixels
    pairs = []
    for _ in range(inputs // 2):
        rot = torch.linalg.qr(torch.randn(3, 3, generator=g))[0]
        pairs += [(rot @ base[0]), (rot @ base[1])]
    x = torch.stack(pairs)[:, :, None, None].expand(-1, -1, SIZE, SIZE).contiguous()
    with torch.no_grad():
        out = model(x)
    q = float((out**2).mean())
    a, b = out[0::2], out[1::2]
    c = float((torch.nn.functional.cosine_similarity(a, b, dim=1)).mean())
    return q, c


@pytest.mark.parametrize(
    "build,eta",
    [(resnet18, 0.5), pytest.param(resnet50, 0.5, marks=pytest.mark.slow)],  # ResNet-50: -m slow
    ids=["resnet18", "resnet50"],
)
def test_preactivation_rewrite_keeps_q_at_the_logits(sp, build, eta):
    """q at the logits is 1 within Monte Carlo error. Tolerance: over 6 networks of 10 logits and 16
    inputs, the mean square's standard error is about 0.1 (fc has only 10 outputs and the last feature
    map 512-2048 channels), so |q - 1| < 0.3; before the rewrite it is 5-180."""
    torch.manual_seed(0)
    report = normalization_free(build(num_classes=10), preactivation=True)
    assert len(report.rewritten) == (8 if build is resnet18 else 16)
    graph = graph_from_module(report.model, example())
    sol = sp.solve(graph, "tat", "leaky_relu", {"eta": eta})
    # only the pools are outside the answer (their locations are not known to agree); here they do
    pools = {nd["id"] for nd in graph["nodes"] if nd["op"] in ("max_pool", "avg_pool", "global_avg_pool")}
    assert sol.assumptions.violations and set(sol.assumptions.violations) <= pools
    qs, cs = [], []
    for seed in range(6):
        torch.manual_seed(seed)
        # measured on inputs whose locations agree (pooling is the identity): no calibration
        net = apply(report.model, sol, graph=graph, example_input=example(), calibrate=False).model
        q, c = _q_and_c_at_logits(net, seed)
        qs.append(q)
        cs.append(c)
    q_mean, c_mean = sum(qs) / len(qs), sum(cs) / len(cs)
    print(
        f"{build.__name__}: q at logits {q_mean:.3f} (per network {[round(v, 2) for v in qs]}), "
        f"c(0) at logits {c_mean:.3f} vs predicted {sol.c_map.global_[len(sol.c_map.c) // 2]:.3f}"
    )
    assert abs(q_mean - 1) < 0.3
    assert abs(c_mean - sol.c_map.global_[len(sol.c_map.c) // 2]) < 0.15


def test_without_the_rewrite_q_drifts(sp):
    """The same solve applied to the post-activation network (under "assumptions": "warn"): q at
    the logits is far from 1, which is what the structure error prevents."""
    net = normalization_free(resnet18(num_classes=10)).model
    with pytest.warns(UserWarning, match="assumptions not met"):
        graph = graph_from_module(net, example(), assumptions="warn")
    sol = sp.solve(graph, "tat", "leaky_relu", {"eta": 0.9}, assumptions="warn")
    assert not sol.assumptions.holds
    qs = []
    for seed in range(3):
        torch.manual_seed(seed)
        applied = apply(net, sol, graph=graph, example_input=example(), calibrate=False).model  # as solved
        qs.append(_q_and_c_at_logits(applied, seed)[0])
    print(f"post-activation resnet18: q at logits {[round(q, 2) for q in qs]}")
    assert min(qs) > 3.0
