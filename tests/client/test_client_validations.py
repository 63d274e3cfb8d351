"""The client's validation calls (``Client`` and ``AsyncClient``: submit, read, wait with a
timeout, list, cancel) against a real ``sigprop serve`` on loopback, in the embedded mode (no Redis:
the jobs run in the API process) with the sleep-only trainer of ``tests.fake_training`` (0.1 s per
step), as ``tests/service/test_validations_api.py`` runs it."""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path

import pytest

from sigprop.client import AsyncClient, Client, SigpropError
from sigprop.schemas.validation import ValidationJob, ValidationRequest

from ..fake_training import write_fake_datasets
from ..service_fixtures import running_service

ROOT = Path(__file__).resolve().parents[2]
FAKE_CLI = "tests.fake_sigprop"  # `sigprop` with the sleep-only trainer
KEY = "client-val-key-0123456789"

GRAPH = {"template": "mlp", "depth": 3, "width": 8}


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    env = {
        "SIGPROP_API_KEYS": KEY,
        "PYTHONPATH": str(ROOT),  # the service imports tests.fake_training
        "SIGPROP_DATASETS_DIR": write_fake_datasets(tempfile.mkdtemp(prefix="sigprop-client-datasets-")),
    }
    with running_service(tmp_path_factory.mktemp("svc-client-val"), env, cli=FAKE_CLI) as svc:
        yield svc


def test_submit_wait_read_and_list(service):
    with Client(service.base_url, api_key=KEY) as sp:
        vid = sp.submit_validation(GRAPH, "tat", "leaky_relu", {"eta": 0.5}, dataset="synthetic", steps=3)
        assert isinstance(vid, str) and vid
        job = sp.wait_validation(vid, timeout=30, poll=0.1)
        assert isinstance(job, ValidationJob) and job.status == "finished", job
        assert job.progress["step"] == 3 and job.results["runs"]["solution"]["nan"] is None
        assert job.request["steps"] == 3 and job.request["solve"]["activation"] == "leaky_relu"
        assert sp.validation(vid).model_dump() == job.model_dump()
        # a stored solution by key, and a whole request
        key = sp.solve(GRAPH, "tat", "leaky_relu", {"eta": 0.5}).key
        by_key = sp.submit_validation(key=key, dataset="synthetic", steps=2, baselines=[])
        whole = sp.submit_validation_request(ValidationRequest(key=key, dataset="synthetic", steps=2, baselines=[]))
        assert sp.wait_validation(by_key, timeout=30, poll=0.1).key == key
        page = sp.validations(limit=2)
        assert page["total"] >= 3 and [it["id"] for it in page["items"]] == [whole, by_key]


def test_wait_times_out_naming_the_job_and_cancel_stops_it(service):
    with Client(service.base_url, api_key=KEY) as sp:
        vid = sp.submit_validation(GRAPH, "tat", "leaky_relu", {"eta": 0.5}, dataset="synthetic", steps=300)
        with pytest.raises(TimeoutError, match=f"validation {vid} is still (queued|running).*cancel_validation"):
            sp.wait_validation(vid, timeout=0.5, poll=0.1)
        assert sp.cancel_validation(vid).status in ("cancelled", "running")
        assert sp.wait_validation(vid, timeout=10, poll=0.1).status == "cancelled"
        with pytest.raises(ValueError, match="timeout"):
            sp.wait_validation(vid, timeout=0)


def test_refusals_are_sigprop_errors(service):
    with Client(service.base_url) as anon:
        with pytest.raises(SigpropError) as info:
            anon.submit_validation(GRAPH, "tat", "leaky_relu", {"eta": 0.5}, dataset="synthetic")
        assert info.value.code == "unauthorized" and info.value.status == 401
    with Client(service.base_url, api_key=KEY) as sp:
        with pytest.raises(SigpropError) as info:
            sp.validation("0" * 32)
        assert info.value.code == "not_found"
        with pytest.raises(SigpropError) as info:
            sp.submit_validation(GRAPH, "tat", "leaky_relu", {"eta": 0.5}, dataset="cifar")
        assert info.value.code == "invalid_request"
        with pytest.raises(ValueError, match="not both"):
            sp.submit_validation(GRAPH, "tat", "leaky_relu", key="f" * 64)


def test_the_async_client_does_the_same(service):
    async def scenario():
        async with AsyncClient(service.base_url, api_key=KEY) as sp:
            vid = await sp.submit_validation(GRAPH, "tat", "leaky_relu", {"eta": 0.5}, dataset="synthetic", steps=2)
            job = await sp.wait_validation(vid, timeout=30, poll=0.1)
            assert job.status == "finished" and (await sp.validation(vid)).status == "finished"
            assert (await sp.validations(limit=1))["items"][0]["id"] == vid
            slow = await sp.submit_validation(GRAPH, "tat", "leaky_relu", {"eta": 0.5}, dataset="synthetic", steps=300)
            with pytest.raises(TimeoutError, match=slow):
                await sp.wait_validation(slow, timeout=0.3, poll=0.1)
            await sp.cancel_validation(slow)
            assert (await sp.wait_validation(slow, timeout=10, poll=0.1)).status == "cancelled"

    asyncio.run(scenario())
