"""The code every validation attempt runs, in an RQ work horse (``queue.rq_job``) or in the API's
local pool (``local.LocalRunner``): mark the attempt started, train, pass progress to the store,
honour a cancel, store the results.

Nothing here imports torch at module level: the API imports this module too.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from ..schemas.solve import Solution
from ..settings import get_settings
from ..storage import ValidationStore
from .charlm_plan import plan_charlm
from .classify_plan import plan_classify
from .dataset_policy import DatasetPolicy, graph_input_shape

log = logging.getLogger("sigprop")

_PROGRESS_EVERY_S = 0.25  # at most this often a job's progress is written to the store
_CANCEL_POLL_S = 0.25  # at most this often cancelled() reads the store


def pick_device() -> str:
    """``cuda`` when torch sees a GPU, else ``cpu``: what the job trains on and reports."""
    try:
        import torch
    except ImportError:
        return "cpu"
    return "cuda" if torch.cuda.is_available() else "cpu"


def train(
    request: dict,
    graph: dict,
    solution: Solution,
    *,
    progress: Callable[[dict], None],
    cancelled: Callable[[], bool],
    device: str,
) -> dict:
    """What a job trains: ``sigprop.worker.training.run_validation``, imported on first use (it
    needs torch, which the API does not). :func:`execute` looks this name up at each call."""
    if request.get("task") == "charlm":
        from .charlm import run_charlm_validation

        return run_charlm_validation(request, graph, solution, progress=progress, cancelled=cancelled, device=device)
    from .training import run_validation

    return run_validation(request, graph, solution, progress=progress, cancelled=cancelled, device=device)


class _Hooks:
    """The ``progress`` and ``cancelled`` callbacks a job gets, throttled so a job may call them
    every step without hammering the store."""

    def __init__(self, store: ValidationStore, vid: str, deadline: float | None, stopping: Callable[[], bool] | None):
        self.store, self.vid, self.deadline, self.stopping = store, vid, deadline, stopping
        self._pending: dict | None = None
        self._last_write = 0.0
        self._last_poll = 0.0
        self.stopped = False
        self.timed_out = False

    def progress(self, info: dict) -> None:
        self._pending = dict(info)
        now = time.monotonic()
        if now - self._last_write >= _PROGRESS_EVERY_S:
            self.flush(now)

    def flush(self, now: float | None = None) -> None:
        if self._pending is not None:
            try:
                self.store.set_progress(self.vid, self._pending)
            except Exception as exc:  # noqa: BLE001 - a store blip must not kill an hour of training
                log.warning("validation %s: progress not stored (%s)", self.vid, exc)
                return
            self._pending = None
            self._last_write = now if now is not None else time.monotonic()

    def cancelled(self) -> bool:
        if self.stopped:
            return True
        now = time.monotonic()
        if self.deadline is not None and now > self.deadline:
            self.timed_out = self.stopped = True
        elif self.stopping is not None and self.stopping():
            self.stopped = True
        elif now - self._last_poll >= _CANCEL_POLL_S:
            self._last_poll = now
            try:
                self.stopped = self.store.cancel_requested(self.vid) is not None
            except Exception as exc:  # noqa: BLE001 - asked again at the next poll
                log.warning("validation %s: cancel flag not readable (%s)", self.vid, exc)
        return self.stopped


class Interrupted(Exception):
    """A local job stopped by its deadline or by the service shutting down (not by a user)."""


def confine_dataset(payload: dict, policy: DatasetPolicy | None) -> dict:
    """The job's request with its dataset checked by ``policy`` (the worker's own settings when
    None) and an .npz name replaced by the file's path inside the datasets folder; raises
    ``SigpropError`` for a dataset this worker must not load (the API checked it already)."""
    policy = policy or DatasetPolicy.from_settings(get_settings())
    request = dict(payload["request"])
    request["dataset"] = policy.check(str(request.get("dataset", "digits")), graph_input_shape(payload["graph"]))
    # the cost bounds, again on the worker
    if request.get("task") == "charlm":
        plan_charlm(request, payload["graph"])
        if payload.get("solve_request") is not None:  # the shortcuts arm solves with the same fields
            request["solve_request"] = payload["solve_request"]
    else:
        plan_classify(request, payload["graph"])
    return request


def execute(
    store: ValidationStore,
    vid: str,
    payload: dict,
    *,
    deadline: float | None = None,
    stopping: Callable[[], bool] | None = None,
    policy: DatasetPolicy | None = None,
) -> str:
    """Run one attempt of validation ``vid``: the code every job runs, in an RQ work horse or in
    the API's local pool. Returns the status it ended in; an exception from the training function
    propagates (the caller records the failure and decides about a retry) unless a cancel was
    requested, in which case the job ends ``cancelled``."""
    device = pick_device()
    attempt = store.start(vid, device)
    if attempt == 0:
        log.info("validation %s not started: cancelled or already final", vid)
        return "skipped"
    hooks = _Hooks(store, vid, deadline, stopping)
    try:
        request = confine_dataset(payload, policy)
        results = train(
            request,
            payload["graph"],
            Solution.model_validate(payload["solution"]),
            progress=hooks.progress,
            cancelled=hooks.cancelled,
            device=device,
        )
    except BaseException:
        hooks.flush()
        if store.cancel_requested(vid) is not None:
            store.mark_cancelled(vid, "cancelled on request while running")
            return "cancelled"
        if hooks.timed_out:
            raise Interrupted("timed out: the job ran longer than SIGPROP_VALIDATION_TIMEOUT_S") from None
        if hooks.stopped:
            raise Interrupted("interrupted: the service shut down while it ran; submit it again") from None
        raise
    hooks.flush()
    if not isinstance(results, dict):
        results = {"value": results}
    if store.finish(vid, results):
        return "finished"
    return "skipped"
