"""torchvision's ResNet-18 and ResNet-50 (num_classes=10, 3x32x32 inputs) end to end through the torch
adapter: ``normalization_free(..., preactivation=True)``, extract, solve (the engine in-process), apply,
and ``diagnose``: every node's empirical q and c within the answer's prediction.

torchvision itself cannot be installed beside this machine's pinned CPU torch (its PyPI wheel fails
to import against it), so the models are ``tests/torchvision_style.py``, a re-implementation of
``torchvision.models.resnet`` with its module names and structure: BasicBlock (3x3, 3x3) and
Bottleneck (1x1, 3x3 with the stride, 1x1 x4), post-activation blocks with BatchNorm, 1x1 strided
projection shortcuts with BatchNorm where the shape changes, the 7x7 stride-2 stem with BatchNorm,
ReLU and a 3x3 stride-2 padding-1 max pool, stages of 64/128/256/512 planes with strides 1/2/2/2,
adaptive average pooling to 1x1, flatten and the fc head. (torchvision's own weight init is replaced
by ``apply`` anyway.)

The inputs are a pair at cosine 0 (the TAT target is C_f(0) = eta) whose locations all hold the same
vector (``same_locations=True``): Orthogonal Delta convolutions act per location and max/average
pooling of identical locations is the identity, so the answer predicts every node, the logits
included.

Tolerances (fixed seeds, so deterministic): the figures are averaged over independently initialized
networks (16 ResNet-18s, 6 ResNet-50s). Per network, q at the last stages fluctuates by about 0.2
(64-512 channels, 16-48 activations deep) and c by about 0.05; measured over 12 ResNet-18s the
standard errors of the means were <= 0.06 (q) and <= 0.018 (c), and c carried a finite-width bias
of about -0.03 in layer3-layer4. Hence every hidden node: |q - q_pred| < 0.15 and |c - c_pred| <
0.06. The logits are 10 numbers per input (fc has 10 outputs), much noisier: |q - 1| < 0.5 and
|c - c_pred| < 0.2. A network the answer does not describe fails by far: the unapplied model's q
collapses (checked below), and the post-activation layout reaches q = 5-180 at the logits
(tests/client/test_client_torch_convert.py).
"""

from __future__ import annotations

import statistics

import pytest

torch = pytest.importorskip("torch")

from sigprop.client.diagnosis import Diagnosis, LayerDiagnosis  # noqa: E402
from sigprop.client.torch import apply, diagnose, graph_from_module, normalization_free  # noqa: E402
from sigprop.engine.solve import solve  # noqa: E402
from sigprop.schemas.solve import SolveRequest  # noqa: E402

from ..torchvision_style import resnet18, resnet50  # noqa: E402

Q_TOL, C_TOL = 0.15, 0.06
LOGITS_Q_TOL, LOGITS_C_TOL = 0.5, 0.2
PAIRS = 32


def _averaged(runs: list[Diagnosis]) -> Diagnosis:
    """The first run's predictions with the empirical figures averaged over all runs."""
    first = runs[0]
    rows = [
        LayerDiagnosis(
            r.id,
            r.op,
            r.q_predicted,
            statistics.fmean(run.layers[i].q_empirical for run in runs),
            r.c_predicted,
            statistics.fmean(run.layers[i].c_empirical for run in runs),
            r.note,
        )
        for i, r in enumerate(first.layers)
    ]
    out = Diagnosis(first.method, first.activation, first.input_c, first.input_q, first.scope, first.examples, rows)
    out.c_global = first.c_global
    out.notes.append(f"empirical figures: mean over {len(runs)} networks")
    return out


# resnet50 (bottleneck blocks, 47 s on a busy 2-core machine) runs with -m slow; resnet18 covers the path
@pytest.mark.parametrize(
    "build,networks",
    [pytest.param(resnet18, 16, id="resnet18"), pytest.param(resnet50, 6, id="resnet50", marks=pytest.mark.slow)],
)
def test_torchvision_resnet_end_to_end_matches_the_answer_layer_by_layer(build, networks):
    torch.manual_seed(0)
    converted = normalization_free(build(num_classes=10), preactivation=True)
    x = torch.randn(PAIRS, 3, 32, 32)
    graph = graph_from_module(converted.model, x[:2])
    sol = solve(SolveRequest(graph=graph, method="tat", activation="leaky_relu", targets={"eta": 0.5}))
    # the stem's max pool is named (its locations are not known to be identical) and apply calibrates it
    assert sol.assumptions.violations == ["maxpool"] and sol.c_f_0 == pytest.approx(0.5, abs=1e-9)

    runs = []
    for seed in range(networks):
        # pooling is the identity on these inputs: no calibration on a batch whose locations differ
        net = apply(converted.model, sol, graph=graph, example_input=x[:2], seed=seed, calibrate=False).model
        # one input pair for every network (diagnose's seed 0): the networks are what varies, and the
        # noise each row states is then computed once (diagnosis.stated_noise keeps it)
        runs.append(diagnose(net, sol, x, input_c=0.0, same_locations=True))
    diag = _averaged(runs)
    print(f"\n{build.__name__}:\n{diag}")

    rows = {r.id: r for r in diag.layers}
    assert rows["output"].c_predicted == pytest.approx(diag.c_global, abs=2e-3)  # the answer's own C_f(0)
    assert all(r.note == "" and r.q_predicted is not None and r.c_predicted is not None for r in diag.layers)
    blocks = 8 if build is resnet18 else 16
    assert sum(r.op == "sum" for r in diag.layers) == blocks
    hidden = [r for r in diag.layers if r.id not in ("fc", "output")]
    worst_q = max(hidden, key=lambda r: abs(r.q_error))
    worst_c = max(hidden, key=lambda r: abs(r.c_error))
    assert abs(worst_q.q_error) < Q_TOL, worst_q
    assert abs(worst_c.c_error) < C_TOL, worst_c
    assert abs(rows["output"].q_error) < LOGITS_Q_TOL and abs(rows["output"].c_error) < LOGITS_C_TOL, rows["output"]

    # the same check fails by far on the converted network before apply (PyTorch's default init)
    untouched = diagnose(converted.model, sol, x, input_c=0.0, same_locations=True)
    assert untouched.max_q_error(("activation", "sum")) > 0.5
