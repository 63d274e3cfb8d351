"""Datasets are confined and bounded, and refused at submission (``POST /v1/validations``, 4xx with a
hint) before anything is solved, queued or allocated: .npz names resolve only inside
``SIGPROP_DATASETS_DIR`` (no absolute paths, ``..`` or symlinks leading out; unset: .npz is off),
files and their unpacked arrays are capped, and input shapes (synthetic too) are bounded. Errors
name no array beyond the four required ones and say nothing about files outside the folder.
A validation's record is its submitter's; read without a key it hides error text and dataset names."""

from __future__ import annotations

import time
import tracemalloc

import numpy as np
import pytest

from sigprop.errors import SigpropError
from sigprop.worker import job
from sigprop.worker.dataset_policy import DatasetPolicy

from ..inprocess import KEY_ONE, KEY_TWO, app_client, basic, bearer, mlp
from ..service_fixtures import assert_error

MAX_BYTES = 200_000
MAX_VALUES = 4096


def _npz(path, n=40, features=(8,), compressed=False, **extra):
    rng = np.random.default_rng(0)
    arrays = {
        "x_train": rng.standard_normal((n, *features)).astype(np.float32),
        # ten classes, as the MLP template's default head (submissions check that the two agree)
        "y_train": np.arange(n) % 10,
        "x_test": rng.standard_normal((8, *features)).astype(np.float32),
        "y_test": (np.arange(8) * 9) % 10,
    }
    arrays.update(extra)
    arrays = {k: v for k, v in arrays.items() if v is not None}
    (np.savez_compressed if compressed else np.savez)(path, **arrays)
    return path


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    base = tmp_path_factory.mktemp("datasets")
    inside, outside = base / "inside", base / "outside"
    (inside / "sub").mkdir(parents=True)
    outside.mkdir()
    _npz(inside / "good.npz")
    _npz(inside / "sub" / "nested.npz")
    _npz(outside / "secret.npz")
    (inside / "link.npz").symlink_to(outside / "secret.npz")  # leads out, target exists
    (inside / "dangling.npz").symlink_to(outside / "nothing.npz")  # leads out, target missing
    (inside / "subdir-link").symlink_to(outside, target_is_directory=True)
    (inside / "big.npz").write_bytes(b"\0" * (MAX_BYTES + 1))  # over the cap on disk
    _npz(
        inside / "bomb.npz",
        compressed=True,
        x_train=np.zeros((60_000, 8), np.float32),
        y_train=np.zeros(60_000, np.int64),
    )  # small file, 2.4 MB unpacked
    _npz(inside / "wide.npz", n=4, features=(MAX_VALUES + 1,))  # too many values per example
    _npz(inside / "nokey.npz", y_test=None, secret_array_name=np.zeros(3))
    assert (inside / "bomb.npz").stat().st_size < MAX_BYTES
    return inside, outside


@pytest.fixture(scope="module")
def client(folders, tmp_path_factory):
    with app_client(
        tmp_path_factory.mktemp("confined"),
        datasets_dir=folders[0],
        max_dataset_bytes=MAX_BYTES,
        max_input_values=MAX_VALUES,
    ) as c:
        yield c


def submit(c, dataset: str, solve: dict | None = None, **kw):
    if solve is None:  # an MLP whose input fits the dataset (digits: 64 features; the .npz files here: 8)
        solve = mlp()
        if dataset == "digits":
            solve["graph"]["input_shape"] = [64]
    return c.post(
        "/v1/validations",
        headers=bearer(KEY_ONE),
        json={"solve": solve, "dataset": dataset, "steps": 2, "batch_size": 8, **kw},
    )


def test_names_inside_the_folder_are_accepted(client):
    for name in ("good.npz", "sub/nested.npz", "synthetic", "digits"):
        r = submit(client, name)
        assert r.status_code == 202, (name, r.text)


@pytest.mark.parametrize(
    "name",
    [
        "../outside/secret.npz",
        "sub/../../outside/secret.npz",
        "link.npz",
        "dangling.npz",
        "subdir-link/secret.npz",
        "subdir-link/nothing.npz",
    ],
)
def test_paths_leading_out_are_refused_alike(client, folders, name):
    err = assert_error(submit(client, name), 422, "invalid_request")
    # the same answer whether or not the file outside exists: nothing about it leaks
    assert err["message"] == f"dataset: {name!r} is not a file name inside the datasets folder", err
    assert "SIGPROP_DATASETS_DIR" in err["hint"] and str(folders[1]) not in err["message"]


def test_absolute_paths_are_refused(client, folders):
    for name in (
        str(folders[1] / "secret.npz"),
        str(folders[0] / "good.npz"),
        "/proc/self/root/etc/x.npz",
        "/nowhere/x.npz",
    ):
        err = assert_error(submit(client, name), 422, "invalid_request")
        assert "is not a file name inside the datasets folder" in err["message"], err


def test_oversize_files_and_arrays_are_refused(client):
    err = assert_error(submit(client, "big.npz"), 413, "dataset_too_large")
    assert f"over this server's bound of {MAX_BYTES}" in err["message"] and "SIGPROP_MAX_DATASET_BYTES" in err["hint"]
    err = assert_error(submit(client, "bomb.npz"), 413, "dataset_too_large")
    assert "unpacked" in err["message"], err
    err = assert_error(submit(client, "wide.npz"), 413, "dataset_too_large")
    assert "SIGPROP_MAX_INPUT_VALUES" in err["hint"], err


def test_missing_files_and_arrays_name_nothing_else(client):
    err = assert_error(submit(client, "missing.npz"), 422, "invalid_request")
    assert "no file 'missing.npz' in the datasets folder" in err["message"]
    err = assert_error(submit(client, "nokey.npz"), 422, "invalid_request")
    assert "y_test" in err["message"] and "secret_array_name" not in str(err), err


def test_synthetic_input_shape_over_the_bound_is_refused_before_allocating(client, monkeypatch):
    def never(*a, **k):  # nothing may be drawn or queued for a refused request
        raise AssertionError("allocated or queued for a refused request")

    monkeypatch.setattr("sigprop.worker.datasets._synthetic", never)
    monkeypatch.setattr(client.app.state.validations.queue, "submit", never)
    solve = mlp()
    solve["graph"] = {**solve["graph"], "input_shape": [1_000_000]}
    tracemalloc.start()
    t0 = time.perf_counter()
    err = assert_error(submit(client, "synthetic", solve), 413, "dataset_too_large")
    elapsed = time.perf_counter() - t0
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert "1000000 values per example" in err["message"] and str(MAX_VALUES) in err["message"], err
    assert peak < 50_000_000 and elapsed < 5, (peak, elapsed)


# a graph the worker's cost bounds accept (a job's graph is the solved, valid one)
TINY = {"nodes": [{"id": "x", "op": "input", "shape": [4]}, {"id": "out", "op": "output", "inputs": ["x"]}]}


def test_the_worker_checks_again_before_training(folders):
    policy = DatasetPolicy(folders[0], MAX_BYTES, MAX_VALUES)
    graph = {"nodes": [{"id": "input", "op": "input", "shape": [1_000_000], "inputs": []}]}
    with pytest.raises(SigpropError) as exc:
        job.confine_dataset({"request": {"dataset": "synthetic"}, "graph": graph}, policy)
    assert exc.value.code == "dataset_too_large"
    with pytest.raises(SigpropError, match="not a file name inside"):
        job.confine_dataset({"request": {"dataset": "link.npz"}, "graph": TINY}, policy)
    with pytest.raises(SigpropError, match="SIGPROP_DATASETS_DIR is not set"):
        job.confine_dataset(
            {"request": {"dataset": "good.npz"}, "graph": TINY}, DatasetPolicy(None, MAX_BYTES, MAX_VALUES)
        )
    ok = job.confine_dataset({"request": {"dataset": "sub/nested.npz"}, "graph": TINY}, policy)
    assert ok["dataset"] == str((folders[0] / "sub" / "nested.npz").resolve())


def test_npz_is_off_without_a_datasets_folder(tmp_path):
    with app_client(tmp_path) as c:
        err = assert_error(submit(c, "good.npz"), 422, "invalid_request")
        assert "SIGPROP_DATASETS_DIR is not set" in err["message"] and "'digits' or 'synthetic'" in err["hint"]
        assert submit(c, "digits").status_code == 202


def _wait_final(c, vid: str, headers: dict | None = None) -> dict:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        rec = c.get(f"/v1/validations/{vid}", headers=headers or {}).json()
        if rec["status"] in ("finished", "failed", "cancelled"):
            return rec
        time.sleep(0.1)
    raise AssertionError(f"validation {vid} did not end: {rec}")


def test_records_are_their_submitters_and_hide_errors_and_dataset_names_from_others(folders, tmp_path):
    """A validation's error text and dataset name are its submitter's: with keys configured no
    request without a key reads it (401), another key finds nothing (404, the dashboard too); a
    record read without a key (a server whose keys were since removed) is shown redacted."""
    (folders[0] / "rejected.npz").write_bytes((folders[0] / "good.npz").read_bytes())
    limits = {"datasets_dir": folders[0], "max_dataset_bytes": MAX_BYTES, "max_input_values": MAX_VALUES}
    with app_client(tmp_path, **limits) as client:
        r = submit(client, "rejected.npz")  # the fake trainer rejects it, its error naming the file's path
        assert r.status_code == 202, r.text
        vid = r.json()["id"]
        full = _wait_final(client, vid, bearer(KEY_ONE))
        assert full["status"] == "failed" and "rejected.npz" in full["error"] and str(folders[0]) in full["error"]
        assert full["request"]["dataset"] == "rejected.npz"
        keyed = client.get("/v1/validations", params={"limit": 500}, headers=bearer(KEY_ONE)).json()["items"]
        assert "rejected.npz" in [i for i in keyed if i["id"] == vid][0]["error"]
        key = full["key"]

        for path in (f"/v1/validations/{vid}", "/v1/validations", f"/dashboard/validations/{vid}"):
            assert_error(client.get(path), 401, "unauthorized")
        other = bearer(KEY_TWO)
        assert_error(client.get(f"/v1/validations/{vid}", headers=other), 404, "not_found")
        listed = client.get("/v1/validations", params={"limit": 500}, headers=other).json()["items"]
        assert vid not in [i["id"] for i in listed]
        page = client.get(f"/dashboard/validations/{vid}", headers=basic(KEY_TWO))
        assert page.status_code == 404 and "rejected.npz" not in page.text and str(folders[0]) not in page.text
        progress = client.get(f"/dashboard/validations/{vid}.json", headers=basic(KEY_TWO))
        assert progress.status_code == 404 and "rejected.npz" not in progress.text
        solution_page = client.get(f"/dashboard/solutions/{key}", headers=basic(KEY_TWO))
        assert solution_page.status_code == 200 and str(folders[0]) not in solution_page.text
        assert vid not in solution_page.text  # the solution is shared, its validations are not

    with app_client(tmp_path, api_keys="", **limits) as client:  # the same records, no keys any more
        shown = client.get(f"/v1/validations/{vid}").json()
        assert (
            shown["status"] == "failed" and "rejected" not in shown["error"] and str(folders[0]) not in shown["error"]
        )
        assert shown["request"]["dataset"] == "(an .npz file)" and "submitted_by" not in shown["request"]
        listed = client.get("/v1/validations", params={"limit": 500}).json()["items"]
        mine = [i for i in listed if i["id"] == vid]
        assert mine and "rejected" not in mine[0]["error"]
        page = client.get(f"/dashboard/validations/{vid}")
        assert page.status_code == 200 and "rejected.npz" not in page.text and str(folders[0]) not in page.text
        progress = client.get(f"/dashboard/validations/{vid}.json").text
        assert "rejected.npz" not in progress and str(folders[0]) not in progress
        solution_page = client.get(f"/dashboard/solutions/{key}")
        assert solution_page.status_code == 200 and str(folders[0]) not in solution_page.text
