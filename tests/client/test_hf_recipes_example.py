"""examples/hf_gpt2_recipes.py (issue 36's training comparison) run with tiny flags, so it cannot rot:
every arm builds, trains on the same batches and reports a finite loss at every step count."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "hf_gpt2_recipes.py"


def test_the_recipes_example_trains_every_arm(capsys):
    spec = importlib.util.spec_from_file_location("hf_gpt2_recipes", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    flags = "--steps 4 --points 2 --batch 2 --layers 2 --width 32 --heads 2 --seq-len 16 --eval-windows 4"
    out = mod.main([*flags.split(), "--lrs", "1e-3,3e-3"])
    assert out["steps"] == [0, 2, 4]
    assert set(out["losses"]) == {(lr, arm) for lr in (1e-3, 3e-3) for arm in mod.ARMS}
    for row in out["losses"].values():
        assert sorted(row) == [0, 2, 4] and all(math.isfinite(v) for v in row.values())
        assert row[0] == pytest.approx(math.log(256), abs=1.0)  # about uniform over bytes at the start
    # the same init and batches for one arm at two learning rates: the same loss at step 0
    assert out["losses"][(1e-3, "keep")][0] == out["losses"][(3e-3, "keep")][0]
    table = capsys.readouterr().out
    assert "| lr | arm | step 0 | step 2 | step 4 |" in table and "| 0.003 | norm-free |" in table
