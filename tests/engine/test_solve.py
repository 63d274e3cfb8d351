"""The solve entry point and the CLI (contract sections 2, 3 and 5): every method the engine supports,
achieved values recomputed independently (closed forms, scipy quad), errors, layer initializations,
and templates against hand-written graphs."""

from __future__ import annotations

import json
import math
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from scipy import integrate
from scipy.special import expit

from sigprop.engine.solve import prepare, solve
from sigprop.errors import SigpropError
from sigprop.requests import parse_solve_request

SCHEMA = "sigprop.graph/v1"
SIGPROP = Path(sys.executable).with_name("sigprop")


def mlp(depth, width=32):
    return {"template": "mlp", "depth": depth, "width": width}


def req(graph, method, activation, targets=None, **kw):
    return {"graph": graph, "method": method, "activation": activation, "targets": targets or {}, **kw}


def run_solve(data):
    return solve(parse_solve_request(data))


def solve_json(data) -> str:
    return run_solve(data).to_json()


def pdf(z):
    return np.exp(-0.5 * z * z) / math.sqrt(2 * math.pi)


def E(f):
    return sum(
        integrate.quad(lambda z: f(z) * pdf(z), a, b, epsabs=1e-14, epsrel=1e-13, limit=400)[0]
        for a, b in ((-np.inf, 0.0), (0.0, np.inf))
    )


def relu_like_c(c, a):
    """Normalized Leaky ReLU C map from the arc-cosine kernel (independent of the engine's eq 9)."""
    k = (math.sqrt(max(0.0, 1 - c * c)) + (math.pi - math.acos(max(-1.0, min(1.0, c)))) * c) / (2 * math.pi)
    return (a * a * c + a * (1 - a) * c + (1 - a) ** 2 * k) * 2 / (1 + a * a)


# Smooth activations with derivatives written out here: (phi, phi', phi'').
SMOOTH = {
    "softplus": (lambda x: np.logaddexp(0.0, x), expit, lambda x: expit(x) * (1 - expit(x))),
    "tanh": (np.tanh, lambda x: 1 - np.tanh(x) ** 2, lambda x: -2 * np.tanh(x) * (1 - np.tanh(x) ** 2)),
}


def local_moments(name, ans):
    """Q(1), Q'(1), C'(1), C''(1), E[phi_hat] of the answer's transformed activation, by quad."""
    f, d1, d2 = SMOOTH[name]
    a, b, g, d = ans["input_scale"], ans["input_shift"], ans["output_scale"], ans["output_shift"]
    ph = lambda z: g * (f(a * z + b) + d)  # noqa: E731
    ph1 = lambda z: g * a * d1(a * z + b)  # noqa: E731
    ph2 = lambda z: g * a * a * d2(a * z + b)  # noqa: E731
    q1 = E(lambda z: ph(z) ** 2)
    return dict(
        q_1=q1,
        q_slope_1=E(lambda z: ph(z) * ph1(z) * z),
        c_slope_1=E(lambda z: ph1(z) ** 2) / q1,
        c_curv_1=E(lambda z: ph2(z) ** 2) / q1,
        mean=E(ph),
    )


# ------------------------------------------------------------------ methods and achieved values


@pytest.mark.parametrize("depth,eta", [(50, 0.9), (20, 0.5), (100, 0.95)])
def test_tat_leaky_relu(depth, eta):
    ans = json.loads(run_solve(req(mlp(depth), "tat", "leaky_relu", {"eta": eta})).to_json())
    a = ans["negative_slope"]
    assert 0.0 < a < 1.0
    assert abs(ans["c_f_0"] - eta) < 1e-12
    assert abs(ans["network_c_f_0"] - eta) < 1e-12  # an MLP's maximizing subnetwork is itself
    c = 0.0
    for _ in range(depth):
        c = relu_like_c(c, a)
    assert abs(c - eta) < 1e-12  # recomputed from the returned slope alone
    assert abs(ans["output_scale"] - math.sqrt(2 / (1 + a * a))) < 1e-15
    assert "input_scale" not in ans and "input_shift" not in ans and "output_shift" not in ans
    assert abs(ans["q_1"] - 1) < 1e-9 and abs(ans["q_slope_1"] - 1) < 1e-9 and abs(ans["chi_1"] - 1) < 1e-9
    assert abs(ans["local_c_0"] - (1 - a) ** 2 / (math.pi * (1 + a * a))) < 1e-12
    assert (ans["sigma_w2"], ans["sigma_b2"]) == (1.0, 0.0)
    cm = ans["c_map"]
    assert len(cm["c"]) == 33 and cm["c"][16] == 0.0
    assert abs(cm["global"][16] - eta) < 1e-12
    assert abs(cm["global"][-1] - 1.0) < 1e-12
    r = 0.0
    for _ in range(depth):
        r = relu_like_c(r, 0.0)
    assert abs(cm["untransformed"][16] - r) < 1e-12
    assert ans["warnings"] == [] and ans["cached"] is False
    assert ans["graph_summary"]["depth"] == depth


@pytest.mark.parametrize("name,depth,tau", [("softplus", 20, 0.3), ("tanh", 20, 0.3), ("softplus", 50, 0.5)])
def test_tat_smooth(name, depth, tau):
    ans = json.loads(run_solve(req(mlp(depth), "tat", name, {"tau": tau})).to_json())
    assert abs(ans["c_curv_1"] - tau) < 1e-9
    assert abs(ans["c_slope_1"] - 1) < 1e-9
    assert abs(ans["q_1"] - 1) < 1e-9 and abs(ans["q_slope_1"] - 1) < 1e-9
    m = local_moments(name, ans)
    assert abs(m["q_1"] - 1) < 1e-9
    assert abs(m["q_slope_1"] - 1) < 1e-9
    assert abs(m["c_slope_1"] - 1) < 1e-9
    assert abs(depth * m["c_curv_1"] - tau) < 1e-9  # C''_f(1) = L C''(1) for an L-layer MLP
    assert abs(ans["local_c_curv_1"] - tau / depth) < 1e-9
    assert ans["input_scale"] * ans["output_scale"] < 2.0
    assert ans["root"]["attempt"] >= 0 and len(ans["root"]["starting_point"]) == 3


@pytest.mark.parametrize("name,depth,zeta", [("softplus", 20, 1.5), ("tanh", 30, 10.0)])
def test_dks(name, depth, zeta):
    ans = json.loads(run_solve(req(mlp(depth), "dks", name, {"zeta": zeta})).to_json())
    assert abs(ans["c_slope_1"] - zeta) < 1e-9
    assert abs(ans["q_1"] - 1) < 1e-9 and abs(ans["q_slope_1"] - 1) < 1e-9
    m = local_moments(name, ans)
    assert abs(m["c_slope_1"] ** depth - zeta) < 1e-9  # C'_f(1) = C'(1)^L
    assert abs(m["mean"]) < 1e-10  # C(0) = 0
    assert abs(m["q_1"] - 1) < 1e-9 and abs(m["q_slope_1"] - 1) < 1e-9
    assert abs(ans["network_c_f_0"]) < 1e-9


def test_dks_reports_the_true_network_curvature():
    depth = 20
    ans = json.loads(run_solve(req(mlp(depth), "dks", "softplus", {"zeta": 1.5})).to_json())
    m = local_moments("softplus", ans)
    s, c2 = m["c_slope_1"], m["c_curv_1"]
    g1, g2 = 1.0, 0.0  # (C_g'(1), C_g''(1)) through the layers: (C o g)'' = C'' g'^2 + C' g''
    for _ in range(depth):
        g1, g2 = s * g1, c2 * g1 * g1 + s * g2
    assert abs(g1 - 1.5) < 1e-9
    assert abs(ans["c_curv_1"] - g2) < 1e-6


@pytest.mark.parametrize("name,q_star", [("tanh", None), ("tanh", 2.0), ("relu", None), ("relu", 3.0), ("gelu", 1.5)])
def test_eoc(name, q_star):
    targets = {} if q_star is None else {"q_star": q_star}
    ans = json.loads(run_solve(req(mlp(10), "eoc", name, targets)).to_json())
    q = 1.0 if q_star is None else q_star
    assert ans["q_star"] == q
    assert abs(ans["chi_1"] - 1) < 1e-12
    s = math.sqrt(q)
    if name == "relu":
        assert abs(ans["sigma_w2"] - 2) < 1e-12 and abs(ans["sigma_b2"]) < 1e-12
        assert abs(ans["v_slope"] - 1) < 1e-12 and "v_curvature" not in ans
        assert all(layer["bias"] == "zeros" for layer in ans["layers"])
        # the sampled local map is the normalized ReLU C map, to the accuracy the answer warns about
        warn = [w for w in ans["warnings"] if "accurate to about" in w]
        assert len(warn) == 1
        bound = float(re.search(r"accurate to about ([0-9.e-]+)", warn[0]).group(1))
        cs = ans["c_map"]["c"]
        err = max(abs(v - relu_like_c(c, 0.0)) for c, v in zip(cs, ans["c_map"]["local"], strict=False))
        assert 0 < err <= bound < 1e-3
        return
    # an unstable q* (V'(q*) > 1: gelu) is said, with its drift over the depth (issue 34)
    assert [w for w in ans["warnings"] if "unstable fixed point" not in w] == []
    assert (ans["v_slope"] > 1) == any("unstable fixed point" in w for w in ans["warnings"])
    from sigprop.engine.maps.activations import get_activation

    act = get_activation(name)
    d1_sq = E(lambda z: act.d1(s * z) ** 2)
    second = E(lambda z: act.fn(s * z) ** 2)
    assert abs(ans["sigma_w2"] * d1_sq - 1) < 1e-10  # chi_1 = 1, recomputed
    assert abs(ans["sigma_w2"] * second + ans["sigma_b2"] - q) < 1e-10  # V(q*) = q*
    hidden = ans["layers"][1]
    assert hidden["distribution"] == "scaled_uniform_orthogonal"
    assert abs(hidden["gain"] - math.sqrt(ans["sigma_w2"])) < 1e-15
    assert hidden["bias"] == "gaussian" and hidden["bias_variance"] == ans["sigma_b2"]


# ------------------------------------------------------------------ errors


def relu_fold(depth):
    c = 0.0
    for _ in range(depth):
        c = c + (math.sqrt(1 - c * c) - c * math.acos(c)) / math.pi
    return c


def test_unreachable_eta_hint_gives_the_largest_reachable_eta():
    with pytest.raises(SigpropError) as info:
        run_solve(req(mlp(10), "tat", "leaky_relu", {"eta": 0.9}))
    err = info.value
    assert err.code == "unreachable_target" and err.status == 422
    best = relu_fold(10)
    assert 0.8715 < best < 0.8716
    shown = f"{math.floor(best * 1e6) / 1e6:.6f}"
    assert shown in err.hint and f"{best:.6f}" in err.message
    hinted = float(re.search(r"eta <= ([0-9.]+)", err.hint).group(1))
    assert 0 <= best - hinted < 1e-6
    ok = run_solve(req(mlp(10), "tat", "leaky_relu", {"eta": hinted}))  # the hint is reachable
    assert abs(ok.c_f_0 - hinted) < 1e-12 and 0 <= ok.negative_slope < 1e-3


@pytest.mark.parametrize("method,targets", [("tat", {"tau": 0.3}), ("tat", {"eta": 0.5})])
def test_relu_with_tat_is_unsupported_activation(method, targets):
    with pytest.raises(SigpropError) as info:
        run_solve(req(mlp(10), method, "relu", targets))
    assert info.value.code == "unsupported_activation"
    assert "leaky_relu" in info.value.hint and "relu" in info.value.message


@pytest.mark.parametrize("act", ["relu", "leaky_relu"])
def test_dks_solves_rectifiers(act):
    # DKS's conditions need no C''(1): dks solves both (tests/engine/test_reference_dks_parity.py compares)
    sol = run_solve(req(mlp(10), "dks", act, {"zeta": 1.5}))
    assert abs(sol.c_slope_1 - 1.5) < 1e-9 and abs(sol.local_c_0) < 1e-12 and abs(sol.q_1 - 1) < 1e-12
    assert (sol.negative_slope is not None) == (act == "leaky_relu")


def test_dks_names_what_it_supports():
    with pytest.raises(SigpropError) as info:
        run_solve(req(mlp(10), "dks", "soft_threshold", {"zeta": 1.5}))
    assert info.value.code == "unsupported_activation"
    assert "smooth" in info.value.message and "relu" in info.value.message and "C''" not in info.value.message


@pytest.mark.parametrize(
    "method,act,targets,code",
    [
        ("tat", "leaky_relu", {}, "invalid_target"),
        ("tat", "leaky_relu", {"eta": 0.5, "tau": 0.3}, "invalid_target"),
        ("tat", "softplus", {"eta": 0.5}, "invalid_target"),
        ("tat", "leaky_relu", {"eta": 1.0}, "invalid_target"),
        ("dks", "softplus", {"zeta": 0.9}, "invalid_target"),
        ("eoc", "tanh", {"eta": 0.5}, "invalid_target"),
        ("eoc", "tanh", {"q_star": -1.0}, "invalid_target"),
        ("tat", "nonsense", {"tau": 0.3}, "unsupported_activation"),
    ],
)
def test_target_errors(method, act, targets, code):
    with pytest.raises(SigpropError) as info:
        run_solve(req(mlp(20), method, act, targets))
    assert info.value.code == code and info.value.message and info.value.hint


# ------------------------------------------------------------------ layers


def test_layers_dense_fan_in_out_and_suo_gain():
    nodes = [
        {"id": "x", "op": "input", "shape": [20]},
        {"id": "fc1", "op": "dense", "inputs": ["x"], "units": 50},
        {"id": "a1", "op": "activation", "inputs": ["fc1"]},
        {"id": "fc2", "op": "dense", "inputs": ["a1"], "units": 30, "bias": False},
        {"id": "a2", "op": "activation", "inputs": ["fc2"]},
        {"id": "fc3", "op": "dense", "inputs": ["a2"], "units": 45},
        {"id": "a3", "op": "activation", "inputs": ["fc3"]},
        {"id": "head", "op": "dense", "inputs": ["a3"], "units": 10},
        {"id": "y", "op": "output", "inputs": ["head"]},
    ]
    g = {"schema": SCHEMA, "nodes": nodes}
    ans = json.loads(run_solve(req(g, "tat", "leaky_relu", {"eta": 0.3})).to_json())
    want = [("fc1", 20, 50), ("fc2", 50, 30), ("fc3", 30, 45), ("head", 45, 10)]
    assert [(x["id"], x["fan_in"], x["fan_out"]) for x in ans["layers"]] == want
    for x, (_, fi, fo) in zip(ans["layers"], want, strict=False):
        assert x["op"] == "dense" and x["distribution"] == "scaled_uniform_orthogonal"
        assert x["gain"] == pytest.approx(max(math.sqrt(fo / fi), 1.0), rel=1e-15)
        assert x["weight_variance"] == pytest.approx(1 / fi, rel=1e-15)
        assert x["bias_variance"] == 0.0
    assert [x["bias"] for x in ans["layers"]] == ["zeros", "none", "zeros", "zeros"]
    node_ids = [x["node"] for x in ans["layers"]]
    assert node_ids == sorted(node_ids) and len(set(node_ids)) == 4

    gauss = json.loads(run_solve(req(g, "tat", "leaky_relu", {"eta": 0.3}, init="gaussian")).to_json())
    for x, (_, fi, fo) in zip(gauss["layers"], want, strict=False):
        assert x["distribution"] == "gaussian" and (x["fan_in"], x["fan_out"]) == (fi, fo)
        assert x["gain"] == pytest.approx(math.sqrt(1 / fi), rel=1e-15)
        assert x["weight_variance"] == pytest.approx(1 / fi, rel=1e-15)


def test_layers_conv_orthogonal_delta():
    nodes = [
        {"id": "img", "op": "input", "shape": [3, 16, 16]},
        {"id": "c1", "op": "conv", "inputs": ["img"], "channels": 16, "kernel": 3},
        {"id": "r1", "op": "activation", "inputs": ["c1"]},
        {"id": "c2", "op": "conv", "inputs": ["r1"], "channels": 8, "kernel": [5, 3], "stride": 2},
        {"id": "r2", "op": "activation", "inputs": ["c2"]},
        {"id": "c3", "op": "conv", "inputs": ["r2"], "channels": 24, "kernel": 1},
        {"id": "gap", "op": "global_avg_pool", "inputs": ["c3"]},
        {"id": "fc", "op": "dense", "inputs": ["gap"], "units": 10},
        {"id": "y", "op": "output", "inputs": ["fc"]},
    ]
    g = {"schema": SCHEMA, "nodes": nodes}
    ans = json.loads(run_solve(req(g, "tat", "leaky_relu", {"eta": 0.3})).to_json())
    want = [("c1", 3, 16, [3, 3]), ("c2", 16, 8, [5, 3]), ("c3", 8, 24, [1, 1]), ("fc", 24, 10, None)]
    assert [(x["id"], x["fan_in"], x["fan_out"], x.get("kernel")) for x in ans["layers"]] == want
    for x, (_, fi, fo, k) in zip(ans["layers"], want, strict=False):
        assert x["op"] == ("conv" if k else "dense")
        assert x["distribution"] == ("orthogonal_delta" if k else "scaled_uniform_orthogonal")
        assert x["gain"] == pytest.approx(max(math.sqrt(fo / fi), 1.0), rel=1e-15)
    gauss = json.loads(run_solve(req(g, "tat", "leaky_relu", {"eta": 0.3}, init="gaussian")).to_json())
    for x, (_, fi, fo, k) in zip(gauss["layers"], want, strict=False):
        taps = k[0] * k[1] if k else 1
        assert x["distribution"] == "gaussian" and x["fan_in"] == fi * taps and x["fan_out"] == fo
        assert x["gain"] == pytest.approx(math.sqrt(1 / (fi * taps)), rel=1e-15)


# ------------------------------------------------------------------ determinism


@pytest.mark.parametrize(
    "data",
    [
        req(mlp(20), "eoc", "tanh"),
        req(mlp(20), "tat", "softplus", {"tau": 0.3}),
        req(mlp(20), "dks", "tanh", {"zeta": 1.5}),
    ],
    ids=["eoc", "tat", "dks"],
)
def test_same_request_gives_byte_identical_answers(data):
    """Nothing in a solve may depend on numpy's global RNG."""
    np.random.seed(1)
    first = run_solve(data).to_json()
    np.random.seed(2)
    second = run_solve(data).to_json()
    assert first == second


def test_solve_leaves_the_global_rng_alone():
    np.random.seed(5)
    before = np.random.get_state()
    run_solve(req(mlp(5), "tat", "softplus", {"tau": 0.3}))
    run_solve(req(mlp(5), "eoc", "gelu"))
    after = np.random.get_state()
    assert before[2] == after[2] and np.array_equal(before[1], after[1])


# ------------------------------------------------------------------ CLI

CLI_CASES = {
    "tat-lrelu": req(mlp(50), "tat", "leaky_relu", {"eta": 0.9}),
    "tat-smooth": req(mlp(20), "tat", "softplus", {"tau": 0.3}),
    "dks": req(mlp(20), "dks", "tanh", {"zeta": 1.5}),
    "eoc": req(mlp(20), "eoc", "tanh"),
    "bad-op": req(
        {
            "schema": SCHEMA,
            "nodes": [
                {"id": "x", "op": "input", "shape": [4]},
                {"id": "z", "op": "warp", "inputs": ["x"]},
                {"id": "o", "op": "output", "inputs": ["z"]},
            ],
        },
        "eoc",
        "tanh",
    ),
    "unreachable": req(mlp(10), "tat", "leaky_relu", {"eta": 0.9}),
}


@pytest.fixture(scope="module")
def cli_runs(tmp_path_factory):
    """Run every CLI case at once (processes in parallel), keyed by case name: (rc, stdout, stderr)."""
    d = tmp_path_factory.mktemp("cli")
    procs = {}
    env = dict(os.environ, PYTHONHASHSEED="0")
    for name, data in CLI_CASES.items():
        path = d / f"{name}.json"
        path.write_text(json.dumps(data))
        procs[name] = subprocess.Popen(
            [str(SIGPROP), "solve", str(path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
        )
    stdin_proc = subprocess.Popen(
        [str(SIGPROP), "solve", "-"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    out, err = stdin_proc.communicate(json.dumps(CLI_CASES["tat-lrelu"]), timeout=120)
    runs = {"stdin": (stdin_proc.returncode, out, err)}
    for name, p in procs.items():
        o, e = p.communicate(timeout=120)
        runs[name] = (p.returncode, o, e)
    return runs


def test_cli_exists():
    assert SIGPROP.exists(), SIGPROP


def test_cli_tat_leaky_relu_prints_exactly_the_answer(cli_runs):
    rc, out, err = cli_runs["tat-lrelu"]
    assert rc == 0 and err == ""
    assert out == run_solve(CLI_CASES["tat-lrelu"]).to_json() + "\n"
    assert cli_runs["stdin"] == (0, out, "")


@pytest.mark.parametrize("name", ["tat-smooth", "dks", "eoc"])
def test_cli_smooth_methods_print_exactly_the_answer(cli_runs, name):
    rc, out, err = cli_runs[name]
    assert rc == 0 and err == ""
    assert out == run_solve(CLI_CASES[name]).to_json() + "\n"


@pytest.mark.parametrize("name,code", [("bad-op", "unsupported_op"), ("unreachable", "unreachable_target")])
def test_cli_rejected_request_prints_the_error_on_stderr(cli_runs, name, code):
    rc, out, err = cli_runs[name]
    assert rc == 2 and out == ""
    body = json.loads(err)
    assert set(body) == {"error"} and set(body["error"]) == {"code", "message", "hint"}
    assert body["error"]["code"] == code
    with pytest.raises(SigpropError) as info:
        run_solve(CLI_CASES[name])
    assert body == info.value.to_dict()


def test_cli_unreadable_file(tmp_path):
    p = subprocess.run(
        [str(SIGPROP), "solve", str(tmp_path / "missing.json")], capture_output=True, text=True, timeout=60
    )
    assert p.returncode == 2 and p.stdout == ""
    assert json.loads(p.stderr)["error"]["code"] == "invalid_request"


# Run `sigprop` in a process where the `server` extra's packages (and torch, jax) cannot be
# imported, as after a bare `pip install sigprop`.
_WITHOUT_SERVER = """
import json, sys
BLOCKED = set(json.loads(sys.argv[1]))

class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"{name} is blocked in this test")
        return None

sys.meta_path.insert(0, Block())
from sigprop.cli import main
rc = main(sys.argv[2:])
loaded = sorted(BLOCKED & {m.split(".")[0] for m in sys.modules})
assert not loaded, loaded
sys.exit(rc)
"""
_SERVER_AND_FRAMEWORKS = [
    "fastapi",
    "starlette",
    "uvicorn",
    "redis",
    "rq",
    "limits",
    "jinja2",
    "plotly",
    "prometheus_client",
    "torch",
    "jax",
    "sklearn",
]


def _sigprop_without_server(*args, env=None):
    return subprocess.run(
        [sys.executable, "-c", _WITHOUT_SERVER, json.dumps(_SERVER_AND_FRAMEWORKS), *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


def test_cli_solve_and_schema_need_no_server_package(tmp_path):
    path = tmp_path / "request.json"
    path.write_text(json.dumps(CLI_CASES["tat-lrelu"]))
    p = _sigprop_without_server("solve", str(path))
    assert (p.returncode, p.stderr) == (0, "")
    assert p.stdout == run_solve(CLI_CASES["tat-lrelu"]).to_json() + "\n"
    p = _sigprop_without_server("schema", "graph")
    assert p.returncode == 0 and json.loads(p.stdout)["title"] == "Graph", p.stderr


@pytest.mark.parametrize("command,extra", [("serve", "server"), ("worker", "worker")])
def test_cli_serve_and_worker_without_the_extra_say_what_to_install(command, extra):
    env = dict(os.environ, SIGPROP_REDIS_URL="redis://127.0.0.1:1/0")
    p = _sigprop_without_server(command, env=env)
    assert p.returncode == 2 and p.stdout == ""
    assert f"pip install 'sigprop[{extra}]'" in p.stderr and "fastapi" in p.stderr, p.stderr


# ------------------------------------------------------------------ templates vs hand-written graphs


def hand_mlp(depth, width, classes=10, seed=3):
    """The mlp template's network written node by node, with other ids, in shuffled order."""
    nodes = [{"id": "features", "op": "input", "shape": [width]}]
    prev = "features"
    for i in range(depth):
        nodes.append({"id": f"L{i}/W", "op": "dense", "inputs": [prev], "units": width})
        nodes.append({"id": f"L{i}/phi", "op": "activation", "inputs": [f"L{i}/W"]})
        prev = f"L{i}/phi"
    nodes.append({"id": "classifier", "op": "dense", "inputs": [prev], "units": classes})
    nodes.append({"id": "result", "op": "output", "inputs": ["classifier"]})
    random.Random(seed).shuffle(nodes)
    return {"schema": SCHEMA, "nodes": nodes}


def compare_ignoring_layer_ids(a_json: str, b_json: str, id_map=None):
    a, b = json.loads(a_json), json.loads(b_json)
    ida = [x.pop("id") for x in a["layers"]]
    idb = [x.pop("id") for x in b["layers"]]
    if id_map is not None:
        assert [id_map[i] for i in ida] == idb
        b["warnings"] = [_unmap(w, id_map) for w in b["warnings"]]
        if b.get("assumptions"):  # pooling over several locations is named there (issue 34)
            back = {v: k for k, v in id_map.items()}
            b["assumptions"]["violations"] = [back.get(v, v) for v in b["assumptions"]["violations"]]
    assert json.dumps(a) == json.dumps(b)


def _unmap(text, id_map):
    for k, v in id_map.items():
        text = text.replace(f"({v})", f"({k})")
    return text


@pytest.mark.parametrize("method,act,targets", [("tat", "leaky_relu", {"eta": 0.9}), ("tat", "softplus", {"tau": 0.3})])
def test_mlp_template_equals_hand_written(method, act, targets):
    t = req({"template": "mlp", "depth": 30, "width": 24}, method, act, targets)
    h = req(hand_mlp(30, 24), method, act, targets)
    assert prepare(parse_solve_request(t)).key == prepare(parse_solve_request(h)).key
    compare_ignoring_layer_ids(solve_json(t), solve_json(h))


def hand_resnet18_v2(w, residual_first=False, seed=11):
    """ResNet-18 V2 after dks's ModifiedResNet / BlockV2 (examples/haiku/modified_resnet.py), no batch norm,
    written independently of sigprop.engine.templates.expand with its own ids. Returns (graph, template-id -> id)."""
    nodes, id_map = [], {}

    def add(node, template_id=None):
        nodes.append(node)
        if template_id:
            id_map[template_id] = node["id"]
        return node["id"]

    x = add({"id": "img", "op": "input", "shape": [3, 224, 224]}, "input")
    x = add({"id": "stem7x7", "op": "conv", "inputs": [x], "channels": 64, "kernel": 7, "stride": 2}, "initial_conv")
    x = add({"id": "pool3x3", "op": "max_pool", "inputs": [x], "kernel": 3, "stride": 2}, "max_pool")
    rw = math.sqrt(1 - w * w)
    stages = zip((64, 128, 256, 512), (1, 2, 2, 2), (False, True, True, True), strict=False)
    for g, (ch, stride, proj) in enumerate(stages):
        for j in range(2):
            s = stride if j == 0 else 1
            shortcut = x
            convs = [(ch, 3, s), (ch, 3, 1)]  # not bottleneck: stride on conv_0
            for i, (c, k, st) in enumerate(convs):
                x = add({"id": f"g{g}b{j}/relu{i}", "op": "activation", "inputs": [x]})
                if i == 0 and j == 0 and proj and w != 0.0:
                    shortcut = add(
                        {
                            "id": f"g{g}b{j}/proj",
                            "op": "conv",
                            "inputs": [x],
                            "channels": ch,
                            "kernel": 1,
                            "stride": st,
                        },
                        f"block_group_{g}.block_{j}.shortcut_conv",
                    )
                x = add(
                    {"id": f"g{g}b{j}/conv{i}", "op": "conv", "inputs": [x], "channels": c, "kernel": k, "stride": st},
                    f"block_group_{g}.block_{j}.conv_{i}",
                )
            if residual_first:  # sqrt(1 - w^2) * x + w * shortcut, literally as BlockV2 writes it
                x = add({"id": f"g{g}b{j}/add", "op": "sum", "inputs": [x, shortcut], "weights": [rw, w]})
            else:
                x = add({"id": f"g{g}b{j}/add", "op": "sum", "inputs": [shortcut, x], "weights": [w, rw]})
    x = add({"id": "post", "op": "activation", "inputs": [x]})
    x = add({"id": "mean", "op": "global_avg_pool", "inputs": [x]}, "global_avg_pool")
    x = add({"id": "fc1000", "op": "dense", "inputs": [x], "units": 1000}, "logits")
    add({"id": "logits_out", "op": "output", "inputs": [x]})
    random.Random(seed).shuffle(nodes)
    return {"schema": SCHEMA, "nodes": nodes}, id_map


RESNET_T = {"template": "resnet", "depth": 18, "version": 2, "shortcut_weight": 0.5}


@pytest.mark.parametrize(
    "method,act,targets", [("tat", "leaky_relu", {"eta": 0.9}), ("tat", "softplus", {"tau": 0.3}), ("eoc", "relu", {})]
)
def test_resnet_template_equals_hand_written(method, act, targets):
    graph, id_map = hand_resnet18_v2(0.5)
    t = req(RESNET_T, method, act, targets)
    h = req(graph, method, act, targets)
    assert prepare(parse_solve_request(t)).key == prepare(parse_solve_request(h)).key
    jt, jh = solve_json(t), solve_json(h)
    summary = json.loads(jt)["graph_summary"]
    summary.pop("subnetworks_considered")
    assert summary == {"nodes": 50, "depth": 17, "activations": 17, "sums": 8, "concats": 0, "weighted": 21}
    compare_ignoring_layer_ids(jt, jh, id_map)


def test_resnet_hand_copy_differs_from_other_shortcut_weight():
    graph, _ = hand_resnet18_v2(0.6)
    assert (
        prepare(parse_solve_request(req(graph, "tat", "leaky_relu", {"eta": 0.9}))).key
        != prepare(parse_solve_request(req(RESNET_T, "tat", "leaky_relu", {"eta": 0.9}))).key
    )


def test_sum_input_order_does_not_change_the_key():
    graph, _ = hand_resnet18_v2(0.5, residual_first=True)
    assert (
        prepare(parse_solve_request(req(graph, "tat", "leaky_relu", {"eta": 0.9}))).key
        == prepare(parse_solve_request(req(RESNET_T, "tat", "leaky_relu", {"eta": 0.9}))).key
    )
