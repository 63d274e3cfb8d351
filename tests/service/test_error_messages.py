"""Errors meet ML engineers where they are: a template typo names the bad template or
parameter and lists the valid ones; numbers on the wire are strict (no "0.9" for 0.9); PyTorch
spellings of activations (LeakyReLU, GELU) get a "did you mean"; ``str(SigpropError)`` carries
the hint; a validation whose dataset cannot feed the graph is refused at submission."""

from __future__ import annotations

import json

import httpx
import pytest

from sigprop.client.http import error_from_response
from sigprop.errors import SigpropError
from sigprop.requests import parse_solve_request
from sigprop.schemas.suggest import closest

from ..inprocess import KEY_ONE, app_client, bearer, mlp
from ..service_fixtures import assert_error


def _refused(body: dict) -> SigpropError:
    with pytest.raises(SigpropError) as info:
        parse_solve_request(body)
    return info.value


def _with_graph(graph: dict) -> dict:
    return {**mlp(), "graph": graph}


# -- 1. template typos ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "graph,bad,meant",
    [
        ({"template": "resnett", "depth": 50}, "'resnett'", "'resnet'"),
        ({"template": "MLP", "depth": 5}, "'MLP'", "'mlp'"),
        ({"template": "densnet"}, "'densnet'", "'densenet'"),
    ],
)
def test_an_unknown_template_is_named_with_the_valid_ones(graph, bad, meant):
    err = _refused(_with_graph(graph))
    assert err.code == "invalid_graph"
    assert bad in err.message and f"did you mean {meant}" in err.message, err.message
    assert "Field required" not in err.message and "Graph.nodes" not in err.message
    for name in ("mlp", "resnet", "densenet", "cnn"):
        assert name in err.hint


@pytest.mark.parametrize("name", [{}, ["mlp"], 3, None])
def test_a_template_name_that_is_not_a_string_is_an_invalid_graph(name):
    err = _refused(_with_graph({"template": name, "depth": 3}))  # never a TypeError (a 500 over HTTP)
    assert err.code == "invalid_graph" and "unknown template" in err.message


def test_null_parameters_are_not_unknown_ones():
    err = _refused(_with_graph({"template": "mlp", "depth": 3, "version": None, "widht": 8}))
    assert "'widht'" in err.message and "'version'" not in err.message


def test_an_unknown_template_parameter_is_named_with_the_parameters_it_takes():
    err = _refused(_with_graph({"template": "mlp", "depth": 5, "widht": 64}))
    assert err.code == "invalid_graph"
    assert "'widht'" in err.message and "did you mean 'width'" in err.message, err.message
    assert "depth, width, input_shape, classes, bias" in err.hint


def test_a_template_value_error_is_located_at_its_parameter():
    err = _refused(_with_graph({"template": "mlp", "depth": -1}))
    assert err.code == "invalid_graph" and err.message.startswith("graph.depth: "), err.message
    assert "GET /v1/templates" in err.hint


def test_a_node_list_error_names_no_template_field():
    err = _refused(_with_graph({"nodes": []}))
    assert err.code == "invalid_graph" and err.message.startswith("graph.nodes: "), err.message
    assert "Template" not in err.message


def test_template_typos_over_http(tmp_path):
    with app_client(tmp_path) as c:
        err = assert_error(c.post("/v1/solve", json=_with_graph({"template": "resnett"})), 422, "invalid_graph")
        assert "did you mean 'resnet'" in err["message"] and "densenet" in err["hint"]


# -- 2. strict numbers --------------------------------------------------------------------------


def test_a_quoted_target_is_an_invalid_target_not_a_number():
    err = _refused({**mlp(), "targets": {"eta": "0.9"}})
    assert err.code == "invalid_target" and err.message.startswith("targets.eta: "), err.message
    assert "'0.9'" in err.message and "JSON number" in err.message


@pytest.mark.parametrize(
    "body,code",
    [
        (_with_graph({"template": "mlp", "depth": "5"}), "invalid_graph"),
        (_with_graph({"template": "mlp", "depth": 5.0}), "invalid_graph"),
        (_with_graph({"template": "mlp", "depth": 5, "bias": 1}), "invalid_graph"),
        (_with_graph({"template": "resnet", "depth": 50, "version": 2.0}), "invalid_graph"),
        (_with_graph({"template": "resnet", "depth": 50, "shortcut_weight": "0.5"}), "invalid_graph"),
        (
            _with_graph(
                {
                    "nodes": [
                        {"id": "x", "op": "input", "shape": ["4"]},
                        {"id": "d", "op": "dense", "inputs": ["x"], "units": 4},
                        {"id": "o", "op": "output", "inputs": ["d"]},
                    ]
                }
            ),
            "invalid_graph",
        ),
        ({**mlp(), "c_map_points": "33"}, "invalid_request"),
        ({**mlp(), "trainable": {"negative_slope": "true"}}, "invalid_request"),
    ],
)
def test_numbers_and_booleans_are_not_coerced_from_other_types(body, code):
    assert _refused(body).code == code


def test_integers_are_numbers_where_floats_are_expected():
    req = parse_solve_request({**mlp(), "method": "eoc", "targets": {"q_star": 1}})
    assert req.targets.q_star == 1.0 and isinstance(req.targets.q_star, float)
    req = parse_solve_request(_with_graph({"template": "resnet", "depth": 18, "shortcut_weight": 1}))
    assert req.graph.shortcut_weight == 1.0


def test_validation_fields_are_strict_too(tmp_path):
    body = {"solve": mlp(), "dataset": "synthetic", "steps": "200"}
    with app_client(tmp_path) as c:
        err = assert_error(c.post("/v1/validations", json=body, headers=bearer(KEY_ONE)), 422, "invalid_request")
        assert err["message"].startswith("steps: ")
        quoted = {"solve": {**mlp(), "targets": {"eta": "0.5"}}, "dataset": "synthetic"}
        assert_error(c.post("/v1/validations", json=quoted, headers=bearer(KEY_ONE)), 422, "invalid_target")


# -- 3. activation names in PyTorch's spelling -------------------------------------------------


@pytest.mark.parametrize(
    "typed,meant",
    [("LeakyReLU", "leaky_relu"), ("Tanh", "tanh"), ("SiLU", "silu"), ("GELU", "gelu"), ("leaky_rleu", "leaky_relu")],
)
def test_pytorch_spellings_are_refused_with_the_catalogue_name(typed, meant):
    """Suggested, not accepted (docs/contract.md section 3): one spelling per function."""
    from sigprop.engine.solve import solve

    with pytest.raises(SigpropError) as info:
        solve(parse_solve_request({**mlp(), "activation": typed}))
    err = info.value
    assert err.code == "unsupported_activation"
    assert f"did you mean '{meant}'" in err.message, err.message
    assert "leaky_relu" in err.hint


def test_a_name_close_to_nothing_gets_no_suggestion():
    assert closest("Mish", ["tanh", "relu", "gelu"]) is None
    assert closest("", ["tanh"]) is None


# -- 4. str(SigpropError) -----------------------------------------------------------------------


def test_str_of_an_error_carries_its_hint():
    err = SigpropError("invalid_target", "eta must be in [0, 1)", "give eta between 0 and 1")
    assert str(err) == "invalid_target: eta must be in [0, 1) (hint: give eta between 0 and 1)"
    assert str(SigpropError("not_found", "no such key")) == "not_found: no such key"


def test_str_of_an_error_the_client_raises_carries_its_hint():
    body = {"error": {"code": "unreachable_target", "message": "eta 0.99 at depth 2", "hint": "use a deeper net"}}
    response = httpx.Response(422, content=json.dumps(body).encode(), headers={"content-type": "application/json"})
    err = error_from_response(response)
    assert isinstance(err, SigpropError) and "use a deeper net" in str(err)


# -- 5. datasets that cannot feed the graph ----------------------------------------------------

README_MLP = {
    "graph": {"template": "mlp", "depth": 50, "width": 512},
    "method": "tat",
    "activation": "leaky_relu",
    "targets": {"eta": 0.9},
}


def _submit(c, solve: dict, dataset: str = "digits"):
    body = {"solve": solve, "dataset": dataset, "steps": 2, "batch_size": 8}
    return c.post("/v1/validations", json=body, headers=bearer(KEY_ONE))


def test_a_dataset_whose_inputs_do_not_fit_the_graph_is_refused_at_submission(tmp_path):
    with app_client(tmp_path) as c:
        err = assert_error(_submit(c, README_MLP), 422, "invalid_request")
        assert "64 values" in err["message"] and "[512]" in err["message"], err
        assert '"input_shape": [64]' in err["hint"]
        assert c.get("/v1/validations", headers=bearer(KEY_ONE)).json()["total"] == 0  # nothing queued


def test_a_dataset_whose_classes_do_not_fit_the_output_is_refused_at_submission(tmp_path):
    solve = {**mlp(), "graph": {"template": "mlp", "depth": 3, "width": 8, "input_shape": [64], "classes": 5}}
    with app_client(tmp_path) as c:
        err = assert_error(_submit(c, solve), 422, "invalid_request")
        assert "10 classes" in err["message"] and '"classes": 10' in err["hint"], err


@pytest.mark.parametrize("shape", [[64], [1, 8, 8]])
def test_a_graph_that_fits_digits_is_accepted(tmp_path, shape):
    solve = {**mlp(), "graph": {"template": "mlp", "depth": 3, "width": 8, "input_shape": shape}}
    with app_client(tmp_path) as c:
        assert _submit(c, solve).status_code == 202


def test_digits_facts_match_the_loaded_dataset():
    """The policy's table of what digits feeds is the trainer's dataset (no drift)."""
    pytest.importorskip("sklearn")
    from sigprop.worker.dataset_policy import BUILTIN_FACTS
    from sigprop.worker.datasets import load_dataset

    ds = load_dataset("digits", 0)
    assert BUILTIN_FACTS["digits"] == (ds.input_shape, ds.n_classes)


# -- 6. "did you mean" over HTTP, for methods, top-level keys, targets and ops -------------------


def _node_graph(op: str) -> dict:
    return {
        "nodes": [
            {"id": "x", "op": "input", "shape": [4]},
            {"id": "d", "op": op, "inputs": ["x"], "units": 4},
            {"id": "o", "op": "output", "inputs": ["d"]},
        ]
    }


@pytest.mark.parametrize(
    "body,code,says",
    [
        ({**mlp(), "method": "tta"}, "unsupported_method", "did you mean 'tat'?"),
        ({**mlp(), "method": "dsk"}, "unsupported_method", "did you mean 'dks'?"),
        ({**{k: v for k, v in mlp().items() if k != "targets"}, "target": {"eta": 0.9}}, "invalid_request",
         "target: unknown key 'target'; did you mean 'targets'?"),
        ({**mlp(), "targets": {"etaa": 0.9}}, "invalid_target", "targets.etaa: unknown target; did you mean 'eta'?"),
        (_with_graph(_node_graph("linear")), "unsupported_op", "'linear'"),
        (_with_graph(_node_graph("Conv2d")), "unsupported_op", "did you mean 'conv'?"),
        (_with_graph(_node_graph("dnese")), "unsupported_op", "did you mean 'dense'?"),
    ],
)  # fmt: skip
def test_did_you_mean_over_http(tmp_path, body, code, says):
    with app_client(tmp_path) as c:
        err = assert_error(c.post("/v1/solve", json=body), 422, code)
    assert says in err["message"], err
    if body.get("graph", {}).get("nodes", [{}, {}])[1].get("op") == "linear":
        assert "did you mean 'dense'?" in err["message"], err
    if code == "invalid_request":
        assert "graph, method, activation, targets" in err["hint"]


def test_did_you_mean_is_not_offered_for_a_name_close_to_nothing():
    err = _refused({**mlp(), "method": "adam"})
    assert err.code == "unsupported_method" and "did you mean" not in err.message
    assert closest("tta", ["tat", "dks"]) == "tat" and closest("tta", ["att", "tat"]) is None  # ambiguous


# -- 7. degenerate targets ----------------------------------------------------------------------


def test_eta_zero_warns_that_the_network_is_linear():
    from sigprop.engine.solve import solve

    sol = solve(parse_solve_request({**mlp(), "targets": {"eta": 0.0}}))
    assert sol.negative_slope == 1.0
    (warning,) = [w for w in sol.warnings if "linear network" in w]
    assert warning.startswith("eta = 0 makes the transformed activation the identity (negative slope 1)")
    assert "ask for eta > 0" in warning
    assert not [w for w in solve(parse_solve_request(mlp())).warnings if "linear network" in w]


@pytest.mark.parametrize(
    "method,activation,targets,fix",
    # per-layer targets near 1.5e-5, 4x above where the acceptance tolerance meets double precision's floor
    # (transform.ABSOLUTE_FLOOR), so whether they solve does not depend on the machine's rounding
    [("tat", "softplus", {"tau": 3e-4}, "a larger tau"), ("dks", "tanh", {"zeta": 1.0003}, "a larger zeta")],
)
def test_targets_next_to_the_identity_warn_too(method, activation, targets, fix):
    from sigprop.engine.solve import solve

    body = {"graph": {"template": "mlp", "depth": 20}, "method": method, "activation": activation, "targets": targets}
    warning = next(w for w in solve(parse_solve_request(body)).warnings if "linear network" in w)
    assert "makes the transformed activation linear" in warning and fix in warning, warning


def test_eta_zero_warns_over_http(tmp_path):
    with app_client(tmp_path) as c:
        r = c.post("/v1/solve", json={**mlp(), "targets": {"eta": 0.0}})
    assert r.status_code == 200 and any("linear network" in w for w in r.json()["warnings"])


# -- 8. the torch adapter's refusals name the fix -------------------------------------------------


def test_a_batchnorm_refusal_names_normalization_free():
    torch = pytest.importorskip("torch")
    from sigprop.client.torch import graph_from_module

    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.ReLU())
    with pytest.raises(SigpropError) as info:
        graph_from_module(model, torch.randn(2, 3, 8, 8))
    err = info.value
    assert err.code == "unsupported_op" and "BatchNorm2d is a normalization layer" in err.message
    assert "for a torchvision-style ResNet, sigprop.client.torch.normalization_free(model, preactivation=True)" in (
        err.hint
    )
    # the hint's call for any other model works on this one (preactivation=True refuses non-ResNets)
    assert "for any other model, normalization_free(model) drops them" in err.hint
    from sigprop.client.torch import normalization_free

    with pytest.raises(ValueError, match="torchvision-style ResNets"):
        normalization_free(model, preactivation=True)
    graph = graph_from_module(normalization_free(model).model, torch.randn(2, 3, 8, 8))
    assert [nd["op"] for nd in graph["nodes"]] == ["input", "conv", "identity", "activation", "output"]


def test_a_post_activation_residual_block_is_refused_with_the_preactivation_fix():
    torch = pytest.importorskip("torch")
    from sigprop.client.torch import graph_from_module

    nn = torch.nn

    class PostActivation(nn.Module):  # torchvision's BasicBlock layout, BatchNorm already removed
        def __init__(self):
            super().__init__()
            self.stem, self.c1, self.c2 = (nn.Conv2d(3 if i == 0 else 8, 8, 3, padding=1) for i in range(3))
            self.fc = nn.Linear(8, 10)

        def forward(self, x):
            x = torch.relu(self.stem(x))
            x = torch.relu(x + self.c2(torch.relu(self.c1(x))))
            return self.fc(x.mean((2, 3)))

    with pytest.raises(SigpropError) as info:
        graph_from_module(PostActivation(), torch.randn(2, 3, 8, 8))
    err = info.value
    assert err.code == "unsupported_structure" and "activation 'relu_2' reads sum 'add'" in err.message, err
    assert "a post-activation residual block" in err.message
    assert "pre-activation layout" in err.hint and "for a torchvision-style PyTorch ResNet, " in err.hint
    assert "normalization_free(model, preactivation=True) rewrites it so" in err.hint
    assert '"assumptions": "warn"' in err.hint


@pytest.mark.parametrize("case", ["Mish", "Hardswish", "ReLU6", "F.mish", "F.hardswish"])
def test_an_activation_outside_the_catalogue_is_named_with_the_supported_ones(case):
    """Not "treat it as the identity" (that drops a nonlinearity): the catalogue's names, and a way
    to write one of them; allow_unsupported still makes it the identity, which the answer names."""
    torch = pytest.importorskip("torch")
    import sigprop
    from sigprop.client.torch import TransformedActivation, graph_from_module
    from sigprop.schemas.activations import ACTIVATION_NAMES

    nn, F = torch.nn, torch.nn.functional

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(4, 8), nn.Linear(8, 2)
            self.act = getattr(nn, case)() if not case.startswith("F.") else getattr(F, case[2:])

        def forward(self, x):
            return self.fc2(self.act(self.fc1(x)))

    x = torch.randn(3, 4)
    with pytest.raises(SigpropError) as info:
        graph_from_module(Net(), x)
    err = info.value
    name = f"nn.{case}" if not case.startswith("F.") else case
    assert err.code == "unsupported_op" and f"{name} is not a supported activation; supported: " in err.message
    assert err.message.endswith(", ".join(ACTIVATION_NAMES)), err.message  # the catalogue's list, all of it
    assert "allow_unsupported" not in err.hint and "identity" not in err.hint, err.hint
    assert "nn.SiLU (swish)" in err.hint and "TransformedActivation(name)" in err.hint
    graph_from_module(nn.Sequential(nn.Linear(4, 8), TransformedActivation("swish"), nn.Linear(8, 2)), x)

    with pytest.warns(UserWarning, match="treated as the identity"):
        graph = graph_from_module(Net(), x, allow_unsupported=True)
    sol = sigprop.solve(graph, "eoc", "tanh")
    assert any(f"{name} is not a supported activation" in w for w in sol.warnings), sol.warnings


def test_a_softmax_is_not_called_an_activation():
    torch = pytest.importorskip("torch")
    from sigprop.client.torch import graph_from_module

    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Softmax(dim=1), torch.nn.Linear(8, 2))
    with pytest.raises(SigpropError) as info:
        graph_from_module(model, torch.randn(3, 4))
    assert "Softmax is not an op of the sigprop graph" in info.value.message, info.value.message


# -- 9. sequence models: what a sequence graph cannot hold is refused plainly, naming it ---------


@pytest.mark.parametrize("case", ["attention", "sdpa", "layernorm", "encoder"])
@pytest.mark.parametrize("allow", [False, True])
def test_sequence_constructs_outside_the_sequence_graph_are_refused(case, allow):
    """Not "flatten first" (wrong advice for a sequence model), not a bare fx control-flow error,
    and not treated as the identity under allow_unsupported (that answer would be for another
    network); the hint says what a sequence graph holds."""
    torch = pytest.importorskip("torch")
    from sigprop.client.torch import graph_from_module

    from ..sequence_standins import sequence_models

    model, names, says = sequence_models()[case]
    with pytest.raises(SigpropError) as info:
        graph_from_module(model, torch.randn(2, 8, 16), allow_unsupported=allow, assumptions="warn")
    err = info.value
    assert err.code == "unsupported_op" and names in err.message and says in err.message, err.message
    assert "flatten first" not in err.hint and "self-attention" in err.hint, err.hint


def test_a_token_mlp_is_a_sequence_graph():
    torch = pytest.importorskip("torch")
    from sigprop.client.torch import graph_from_module

    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16))
    graph = graph_from_module(model, torch.randn(2, 8, 16))
    assert graph["nodes"][0]["shape"] == [8, 16] and graph["nodes"][0]["sequence"] is True
    assert [nd["op"] for nd in graph["nodes"]] == ["input", "dense", "activation", "dense", "output"]


def test_a_sequence_flattened_first_is_an_mlp_and_is_covered():
    torch = pytest.importorskip("torch")
    from sigprop.client.torch import graph_from_module

    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(128, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    graph = graph_from_module(model, torch.randn(2, 8, 16))
    assert [nd["op"] for nd in graph["nodes"]] == ["input", "flatten", "dense", "activation", "dense", "output"]


def test_huggingface_cross_attention_is_refused_by_its_module():
    """GPT-2 and Llama are read (issue 36, tests/client/test_client_hf.py); what they cannot map is named."""
    pytest.importorskip("transformers")
    import torch
    from transformers import GPT2Config, GPT2Model

    from sigprop.client.torch import graph_from_module

    model = GPT2Model(GPT2Config(n_layer=1, n_embd=16, n_head=2, add_cross_attention=True))
    with pytest.raises(SigpropError, match="'h.0.crossattention' \\(GPT2Attention, cross-attention"):
        graph_from_module(model, torch.zeros(2, 8, dtype=torch.long))


@pytest.mark.parametrize("allow", [False, True])
def test_attention_written_out_by_hand_is_refused_by_its_module(allow):
    """Before: 'view ... only flattening all but the batch dimension is covered' (wrong advice), and
    under allow_unsupported the products were the identity of one factor: a graph of another network."""
    torch = pytest.importorskip("torch")
    from sigprop.client.torch import graph_from_module

    from ..sequence_standins import HandWrittenBlock

    with pytest.raises(SigpropError) as info:
        graph_from_module(HandWrittenBlock(), torch.randn(2, 8, 16), allow_unsupported=allow)
    err = info.value
    assert err.code == "unsupported_op", err
    assert err.message.startswith("node 'matmul' (matmul() call 'matmul') in module 'mixer' (CausalSelfAttention)")
    assert "attention written out by hand" in err.message and "not supported yet" in err.message, err.message
    assert "F.scaled_dot_product_attention(q, k, v, is_causal=...)" in err.message
    assert "flatten" not in err.message and "self-attention" in err.hint, err


def test_a_product_with_a_weight_is_not_attention():
    torch = pytest.importorskip("torch")
    from sigprop.client.torch.extraction import _trace
    from sigprop.client.torch.ops import hand_written_attention

    from ..sequence_standins import HandWrittenBlock

    class Proj(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(16, 16))

        def forward(self, x):
            return x @ self.w  # one factor from the input, the other a parameter

    assert hand_written_attention(_trace(Proj())) is None
    assert "'mixer' (CausalSelfAttention)" in hand_written_attention(_trace(HandWrittenBlock()))


@pytest.mark.parametrize("allow", [False, True])
def test_a_gpt2_shaped_model_is_refused_by_its_attention_module_without_transformers(allow):
    """The nearest case to HuggingFace's GPT-2 without the transformers package (tests/sequence_standins:
    GPT2Model's embeddings, Conv1D = addmm layers, a causal-mask buffer sliced by sizes, optional
    arguments, tuple outputs). It gave "'NoneType' object has no attribute 'get'"; now the attention
    module is named, with fx's own error after it."""
    torch = pytest.importorskip("torch")
    from sigprop.client.torch import graph_from_module

    from ..sequence_standins import GPT2Model

    with pytest.raises(SigpropError) as info:
        graph_from_module(GPT2Model(), torch.zeros(2, 8, dtype=torch.long), allow_unsupported=allow)
    msg = info.value.message
    assert msg.startswith("module 'attn' (GPT2Attention: attention) is not supported yet"), msg
    assert "torch.fx could not trace the model: TypeError" in msg and "NoneType" not in msg, msg
    assert "self-attention" in info.value.hint


# -- 10. diagnose and the Flax adapter say what is wrong ------------------------------------------


def test_a_one_channel_input_pair_is_not_zero():
    """The issue's reproduction: input_pair(torch.randn(4, 1, 28, 28), 0.0) gave q(x2) = 0."""
    torch = pytest.importorskip("torch")
    from sigprop.client.torch import input_pair

    _, x2 = input_pair(torch.randn(4, 1, 28, 28), 0.0)
    assert float((x2 * x2).mean()) == pytest.approx(1.0)


def test_diagnose_names_an_activation_that_was_not_swapped_in():
    torch = pytest.importorskip("torch")
    from sigprop.client.torch import apply, diagnose, graph_from_module
    from sigprop.engine.solve import solve

    nn = torch.nn
    torch.manual_seed(3)
    model = nn.Sequential(
        nn.Flatten(), nn.Linear(784, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10)
    )
    x = torch.randn(32, 1, 28, 28)
    graph = graph_from_module(model, x)
    sol = solve(
        parse_solve_request({"graph": graph, "method": "tat", "activation": "leaky_relu", "targets": {"eta": 0.3}})
    )
    net = apply(model, sol, graph=graph, example_input=x, seed=0).model
    assert diagnose(net, sol, x).ok
    net.set_submodule("2", nn.ReLU())  # the answer's weights, the model's own ReLU
    diag = diagnose(net, sol, x)
    assert not diag.ok and diag.warnings[0].startswith("node '2' (activation) measures q "), diag.warnings
    assert "it runs ReLU module '2', not the answer's transformed activation (their outputs differ" in diag.warnings[0]
    assert "swap it in (apply() does" in diag.warnings[0]


def test_flax_leaky_relu_extracts_and_a_layernorm_is_named_by_its_module():
    jax = pytest.importorskip("jax")
    nn = pytest.importorskip("flax.linen")
    from sigprop.client.jax import graph_from_flax

    class Net(nn.Module):
        norm: bool = False

        @nn.compact
        def __call__(self, x):
            h = nn.Dense(8)(x)
            h = nn.LayerNorm()(h) if self.norm else h
            return nn.Dense(2)(nn.leaky_relu(h, 0.2))

    x = jax.numpy.ones((2, 4))
    graph, _ = graph_from_flax(Net(), x)
    assert [nd["op"] for nd in graph["nodes"]] == ["input", "dense", "activation", "dense", "output"]
    with pytest.raises(SigpropError) as info:
        graph_from_flax(Net(norm=True), x)
    assert "the Flax module 'LayerNorm_0' (LayerNorm) is not supported" in info.value.message
    assert "select_n" not in info.value.message and "normalization-free" in info.value.hint
