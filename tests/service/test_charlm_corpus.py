"""The charlm validation's corpus (Python's standard-library sources) and its request fields: a
deterministic corpus and split, confinement to the stdlib folder, the request's defaults and
refusals, and the cost bounds checked before anything trains."""

from __future__ import annotations

import hashlib
import os

import pytest
from pydantic import ValidationError

from sigprop.errors import SigpropError
from sigprop.schemas.validation import ValidationRequest
from sigprop.worker import charlm_corpus as cc
from sigprop.worker.charlm_plan import LIMITS, TransformerParams, plan_charlm, transformer_params
from sigprop.worker.dataset_policy import DatasetPolicy

KEY = "0" * 64


def test_corpus_is_the_fixed_stdlib_files_split_90_10_with_a_stable_digest():
    corpus = cc.load_corpus()
    assert corpus.files and not set(corpus.files) - set(cc.CORPUS_FILES)
    root = cc.stdlib_dir()
    # recomputed from the files independently: names, bytes and order give the digest
    digest = hashlib.sha256()
    total = 0
    for name in corpus.files:
        data = (root / name).read_bytes()
        total += len(data)
        digest.update(name.encode() + b"\0" + len(data).to_bytes(8, "little") + data)
    assert corpus.digest == digest.hexdigest()
    assert 500_000 < total <= cc.MAX_CORPUS_BYTES
    # every file contributes its first 90% and its last 10%, plus a newline each
    assert corpus.train.size + corpus.validation.size == total + 2 * len(corpus.files)
    assert 0.08 < corpus.validation.size / total < 0.12
    first = (root / corpus.files[0]).read_bytes()
    cut = int(round(len(first) * 0.9))
    assert corpus.train[:cut].tobytes() == first[:cut]
    assert corpus.validation[: len(first) - cut].tobytes() == first[cut:]
    # reading again gives the same arrays (the cache aside)
    again_files, missing = cc.read_corpus_files(root)
    tr, va, dg = cc.split_corpus(again_files)
    assert dg == corpus.digest and (tr == corpus.train).all() and (va == corpus.validation).all()
    assert list(missing) == list(corpus.missing)
    facts = corpus.describe()
    assert facts["digest"] == corpus.digest and facts["vocab_size"] == 256 and facts["name"] == "stdlib"


def test_corpus_reads_nothing_outside_the_stdlib_folder(tmp_path):
    root = tmp_path / "lib"
    root.mkdir()
    (root / "inside.py").write_bytes(b"x = 1\n" * 10)
    secret = tmp_path / "secret.py"
    secret.write_bytes(b"password = 'hunter2'\n")
    os.symlink(secret, root / "link.py")  # a link leading out of the folder
    (root / "dir.py").mkdir()  # not a regular file
    names = ("inside.py", "link.py", "../secret.py", "/etc/hostname", "dir.py", "absent.py")
    found, missing = cc.read_corpus_files(root, names)
    assert [n for n, _ in found] == ["inside.py"]
    assert missing == ["link.py", "../secret.py", "/etc/hostname", "dir.py", "absent.py"]


def test_corpus_over_its_byte_bound_is_refused(tmp_path, monkeypatch):
    (tmp_path / "a.py").write_bytes(b"#" * 100)
    monkeypatch.setattr(cc, "MAX_CORPUS_BYTES", 50)
    with pytest.raises(SigpropError) as exc:
        cc.read_corpus_files(tmp_path, ("a.py",))
    assert exc.value.code == "dataset_too_large"


def test_charlm_request_defaults_and_refusals():
    req = ValidationRequest.model_validate({"key": KEY, "task": "charlm"})
    assert (req.dataset, req.optimizer, req.baselines, req.arms) == (
        "stdlib",
        "adam",
        [],
        [
            "solved",
            "shortcuts",
            "standard",
        ],
    )
    req = ValidationRequest.model_validate({"key": KEY, "task": "charlm", "arms": ["standard", "solved"]})
    assert req.arms == ["solved", "standard"]
    assert ValidationRequest.model_validate({"key": KEY, "task": "charlm", "optimizer": "sgd"}).optimizer == "sgd"
    # a classification request is unchanged
    plain = ValidationRequest.model_validate({"key": KEY})
    assert (plain.task, plain.arms, plain.dataset, plain.baselines) == (None, None, "digits", ["he"])
    bad = [
        {"task": "charlm", "arms": ["shortcuts"]},  # no 'solved'
        {"task": "charlm", "arms": ["solved", "solved"]},
        {"task": "charlm", "dataset": "digits"},
        {"task": "charlm", "baselines": ["he"]},
        {"arms": ["solved"]},  # arms without charlm
        {"dataset": "stdlib"},  # text for a classification
        {"task": "poetry"},
    ]
    for extra in bad:
        with pytest.raises(ValidationError):
            ValidationRequest.model_validate({"key": KEY, **extra})


def _graph(depth=2, seq_len=8, width=16, heads=2, ratio=4, shortcuts=False, norms=False) -> dict:
    """A transformer-template-shaped wire graph (design of issue 28's ids), written out here."""
    nodes = [{"id": "x", "op": "input", "shape": [seq_len, width], "sequence": True}]
    h = "x"
    for i in range(depth):
        p = f"b{i}."
        a = h
        if norms:
            nodes.append({"id": p + "ln1", "op": "layer_norm", "inputs": [h]})
            a = p + "ln1"
        for n in "qkv":
            nodes.append({"id": p + n, "op": "dense", "inputs": [a], "units": width})
        nodes.append({"id": p + "attn", "op": "attention", "inputs": [p + "q", p + "k", p + "v"], "heads": heads})
        nodes.append({"id": p + "proj", "op": "dense", "inputs": [p + "attn"], "units": width})
        x = p + "proj"
        if shortcuts:
            nodes.append({"id": p + "res1", "op": "sum", "inputs": [h, x]})
            x = p + "res1"
        nodes.append({"id": p + "fc1", "op": "dense", "inputs": [x], "units": ratio * width})
        nodes.append({"id": p + "act", "op": "activation", "inputs": [p + "fc1"]})
        nodes.append({"id": p + "fc2", "op": "dense", "inputs": [p + "act"], "units": width})
        h = p + "fc2"
    nodes.append({"id": "out", "op": "output", "inputs": [h]})
    return {"nodes": nodes}


def test_transformer_params_are_read_back_from_the_graph():
    p = transformer_params(_graph(depth=3, seq_len=32, width=64, heads=4, ratio=2, shortcuts=True))
    assert p == TransformerParams(3, 32, 64, 4, 2, True, True, False)
    assert p.template(norms=True)["norms"] is True and p.template()["template"] == "transformer"
    with pytest.raises(SigpropError) as exc:
        transformer_params({"nodes": [{"id": "x", "op": "input", "shape": [64]}]})
    assert exc.value.code == "invalid_request" and "transformer" in exc.value.hint


def test_charlm_cost_is_bounded_before_training():
    graph = _graph(depth=2, seq_len=64, width=128)
    plan = plan_charlm({"steps": 300, "batch_size": 32, "arms": ["solved", "standard"]}, graph)
    assert plan.arms == ("solved", "standard") and plan.train_flops == 6 * plan.model_parameters * 300 * 32 * 64 * 2
    over = [
        ({"steps": LIMITS["steps"] + 1}, graph),
        ({"batch_size": LIMITS["batch_size"] + 1}, graph),
        ({}, _graph(seq_len=LIMITS["seq_len"] + 1)),
        ({}, _graph(width=LIMITS["width"] + 2)),
        ({}, _graph(depth=LIMITS["depth"] + 1)),
        ({"steps": 20_000, "batch_size": 256}, _graph(depth=48, seq_len=512, width=1024, heads=8)),
    ]
    for request, g in over:
        with pytest.raises(SigpropError) as exc:
            plan_charlm({"steps": 10, "batch_size": 8, **request}, g)
        assert exc.value.code == "validation_too_large" and exc.value.status == 413, request


def test_stdlib_dataset_is_built_in_for_the_policy():
    policy = DatasetPolicy(None, 1000, 10)
    assert policy.check("stdlib", (8, 16)) == "stdlib"
    policy.check_fit("stdlib", _graph())  # no class count to compare: the plan checks the graph
