"""The HuggingFace GPT-2 arms of a charlm validation (issue 36): ``hf_gpt2`` (stock),
``hf_gpt2_keep`` and ``hf_gpt2_norm_free`` (the two recipes solved and applied) train on the same
batches as the template's arms, built from the template's parameters; their cost is bounded with
their own parameter count."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from sigprop.engine.solve import solve  # noqa: E402
from sigprop.engine.templates.expand import expand_template  # noqa: E402
from sigprop.errors import SigpropError  # noqa: E402
from sigprop.schemas.graph import Template  # noqa: E402
from sigprop.schemas.solve import SolveRequest  # noqa: E402
from sigprop.schemas.validation import ValidationRequest  # noqa: E402
from sigprop.worker.charlm import run_charlm_validation  # noqa: E402
from sigprop.worker.charlm_plan import HF_ARMS, MAX_TRAIN_FLOPS, plan_charlm, transformer_params  # noqa: E402

TEMPLATE = {"template": "transformer", "depth": 2, "seq_len": 8, "width": 16, "heads": 2}


def _wire(template: dict) -> dict:
    return expand_template(Template.model_validate(template), max_nodes=10_000).model_dump(
        mode="json", by_alias=True, exclude_none=True
    )


def _run(method, activation, targets, arms, steps=3):
    sreq = {"graph": TEMPLATE, "method": method, "activation": activation, "targets": targets}
    sreq["attention"] = {"shaping": "e-spa"}
    sol = solve(SolveRequest.model_validate(sreq))
    body = {"solve": sreq, "task": "charlm", "steps": steps, "batch_size": 4, "seed": 1, "arms": arms}
    request = ValidationRequest.model_validate(body).model_dump(mode="json")
    return run_charlm_validation(request, _wire(TEMPLATE), sol, device="cpu")


def test_hf_gpt2_arms_train_next_to_the_solved_one():
    res = _run("dks", "gelu_tanh", {"zeta": 1.5}, ["solved", *HF_ARMS])
    assert list(res["runs"]) == ["solved", *HF_ARMS]
    for name in HF_ARMS:
        run = res["runs"][name]
        assert "error" not in run, (name, run)
        assert run["steps_done"] == 3 and not run["diverged"]
        assert all(0 < v < 8 for v in run["loss"]["values"]) and math.isfinite(run["final_validation_loss"])
        assert "HuggingFace GPT2LMHeadModel" in run["description"]
        assert run["grad_norms"][0]["norms"]["transformer.h.0.attn.c_attn"] > 0
    stock, keep, free = (res["runs"][a] for a in HF_ARMS)
    assert "solution" not in stock and keep["solution"]["activation"] == free["solution"]["activation"] == "gelu_tanh"
    assert keep["apply"]["complete"] and free["apply"]["complete"]
    assert "transformer.ln_f" in free["removed"]["norms"] and free["removed"]["shortcuts"]
    # stock is tied, the recipes untie the head (one more 256 x 16 matrix); norm-free has no norms
    assert keep["parameters"] - stock["parameters"] >= 256 * 16
    assert keep["parameters"] - free["parameters"] == (2 * 4 + 2) * 16
    assert set(res["summary"]["arms"]) == set(HF_ARMS)


def test_a_leaky_relu_answer_has_no_gpt2_recipe_arms_and_says_why():
    res = _run("tat", "leaky_relu", {"eta": 0.3}, ["solved", "hf_gpt2", "hf_gpt2_keep"], steps=1)
    assert "error" not in res["runs"]["hf_gpt2"]  # the stock model trains whatever the answer
    err = res["runs"]["hf_gpt2_keep"]["error"]
    assert err["code"] == "invalid_target" and "tau" in err["message"] + err["hint"]


def test_hf_arms_are_priced_with_their_own_parameters():
    params = transformer_params(_wire(TEMPLATE))
    d = params.width
    assert params.hf_gpt2_parameters() == params.parameters() - 256 + params.seq_len * d + params.depth * 4 * d + 2 * d
    base = {"task": "charlm", "steps": 10, "batch_size": 4}
    one = plan_charlm({**base, "arms": ["solved"]}, _wire(TEMPLATE)).train_flops
    both = plan_charlm({**base, "arms": ["solved", "hf_gpt2"]}, _wire(TEMPLATE)).train_flops
    assert both - one == pytest.approx(6.0 * params.hf_gpt2_parameters() * 10 * 4 * params.seq_len)
    big = {"template": "transformer", "depth": 48, "seq_len": 512, "width": 1024, "heads": 8}
    steps = int(MAX_TRAIN_FLOPS / (6.0 * transformer_params(_wire(big)).parameters() * 256 * 512))
    assert plan_charlm({**base, "steps": steps, "batch_size": 256, "arms": ["solved"]}, _wire(big))
    with pytest.raises(SigpropError) as exc:  # a second arm, an HF one, passes the bound
        plan_charlm({**base, "steps": steps, "batch_size": 256, "arms": ["solved", "hf_gpt2"]}, _wire(big))
    assert exc.value.code == "validation_too_large"
