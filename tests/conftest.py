"""Shared test setup.

OpenBLAS's thread pool oversubscribes small or busy machines badly: a 512 x 512 QR in the Monte
Carlo tests takes ~10x longer with two contending threads than with one. Pin BLAS to one thread
unless the environment says otherwise (this must run before numpy is imported).
"""

import os
import sys

import pytest

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

# XLA compiles every jitted function and every eagerly run op (a Flax model's initializers one by one)
# on first use, and the JAX tests are mostly such first uses of small models: at its default
# optimization level the CPU backend spent 9.3 s of a 10.5 s extraction of a small ResNet compiling,
# 2.9 s at level 0. The tests compare statistics, not speed, so they compile without optimization
# (the environment, and subprocesses the tests start, may still say otherwise).
os.environ.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=0")

# The docs, the dashboard and /metrics are off by default on the API port (api/exposure.py); the
# tests that use them build apps in this process, whose settings read these. tests/service/test_exposure.py
# checks the defaults with explicit settings.
for _surface in ("DOCS", "DASHBOARD", "METRICS"):
    os.environ.setdefault(f"SIGPROP_EXPOSE_{_surface}", "true")


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which turns "no" into "load"
def pytest_cmdline_main(config):
    """Under pytest-xdist (``-n N``), one worker runs each file's tests (``--dist loadfile``): the
    files' module fixtures start servers, and a file split over two workers would start them twice.
    Set here rather than in ``addopts`` so that ``pytest -p no:xdist`` still parses its options
    (``--dist`` is xdist's own flag)."""
    if getattr(config.option, "numprocesses", None) and getattr(config.option, "dist", "no") == "no":
        config.option.dist = "loadfile"


@pytest.fixture(scope="module", autouse=True)
def _torch_on_one_thread():
    """PyTorch on one intra-op thread in the modules that use it: small matrices on a 2-core
    machine that the suite's two workers share, where one thread is fastest and deterministic. A
    module that never imported torch is left alone, so this costs the others no torch import."""
    torch = sys.modules.get("torch")
    if torch is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def pytest_sessionfinish(session, exitstatus):
    """Leave the tests' Redis database (SIGPROP_TEST_REDIS_URL, db 14 by default) empty, as found.

    Only that database is flushed (FLUSHDB, never FLUSHALL); without a Redis there is nothing to do.
    """
    try:
        import redis

        from .service_fixtures import SHARED_REDIS_URL
    except ImportError:
        return
    try:
        client = redis.Redis.from_url(SHARED_REDIS_URL, socket_timeout=1, socket_connect_timeout=1)
        client.flushdb()
        client.close()
    except redis.RedisError:
        pass
