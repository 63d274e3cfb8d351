"""The exported JSON Schemas in schemas/json/ are what the pydantic models say (regenerate with
`sigprop schema NAME > schemas/json/NAME.schema.json`)."""

import json
from pathlib import Path

import pytest

from sigprop.schemas import Graph, Solution, SolveRequest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name,model", [("graph", Graph), ("request", SolveRequest), ("solution", Solution)])
def test_exported_schema_is_current(name, model):
    on_disk = json.loads((ROOT / "schemas" / "json" / f"{name}.schema.json").read_text())
    assert on_disk == model.model_json_schema(by_alias=True), f"regenerate schemas/json/{name}.schema.json"


def test_contract_keys_are_in_the_solution_schema():
    props = Solution.model_json_schema(by_alias=True)["properties"]
    for key in (
        "key",
        "negative_slope",
        "input_scale",
        "input_shift",
        "output_scale",
        "output_shift",
        "tau",
        "m",
        "sigma_w2",
        "sigma_b2",
        "v_slope",
        "v_curvature",
        "chi_1",
        "c_f_0",
        "c_curv_1",
        "layers",
        "cached",
        "warnings",
    ):
        assert key in props, key
