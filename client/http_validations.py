"""The validation calls of ``Client`` and ``AsyncClient`` (contract section 4, ``/v1/validations``).

A validation trains the solved network (and baselines) on a dataset in the service's workers and
reports how the theory held. The calls, in the blocking client (the async one has the same as
coroutines)::

    vid = sp.submit_validation({"template": "mlp", "depth": 20, "width": 64, "input_shape": [64]},
                               "tat", "leaky_relu", {"eta": 0.9}, dataset="digits", steps=300)
    job = sp.wait_validation(vid, timeout=600)   # a ValidationJob once finished, failed or cancelled
    job.results["runs"]["solution"]

``submit_validation`` takes the same graph, method, activation and targets as ``solve`` (or a
stored solution's ``key=``, or a whole ``ValidationRequest`` through ``submit_validation_request``),
needs an API key and returns the job id. ``validation(id)`` reads a job once, ``validations()``
lists them newest first, ``cancel_validation(id)`` cancels one. ``wait_validation`` polls until the
job is final and raises ``TimeoutError`` (naming its last status and progress) when ``timeout``
seconds pass first; the job keeps running in the service.

Kept out of ``http.py`` so each module stays about one resource; the mixins need only the
client's ``_send`` / ``_json``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from typing import Any

from ..schemas.validation import ValidationJob, ValidationRequest

__all__ = ["FINAL_STATUSES", "ValidationCalls", "AsyncValidationCalls"]

FINAL_STATUSES = ("finished", "failed", "cancelled")
# the shortest pause between two reads of a job: a poll loop never hammers the service
MIN_POLL_S = 0.05

# Indirections so tests can observe the waits without sleeping (as http._sleep).
_monotonic = time.monotonic


def _validation_body(request: ValidationRequest | Mapping[str, Any]) -> dict:
    if isinstance(request, ValidationRequest):
        return request.model_dump(mode="json", by_alias=True, exclude_none=True)
    if isinstance(request, Mapping):
        return dict(request)
    raise TypeError(f"request must be a dict or a ValidationRequest, not {type(request).__name__}")


def _submission(client, solve: tuple, key: str | None, solve_options: dict, options: dict) -> dict:
    """The body of ``submit_validation``: the solve request (as ``solve`` builds it) or the key,
    and the training options given."""
    graph, method, activation, targets = solve
    if (key is None) == (graph is None):
        raise ValueError("give either a solve request (graph, method, activation, targets) or key=, not both")
    body = {k: v for k, v in options.items() if v is not None}
    if key is not None:
        body["key"] = key
        return body
    if method is None or activation is None:
        raise ValueError("a validation of a solve request needs its method and activation")
    body["solve"] = client._solve_body(graph, method, activation, targets, **_solve_options(solve_options))
    return body


def _solve_options(given: dict) -> dict:
    known = ("init", "trainable", "c_map_points", "assumptions", "attention")
    unknown = sorted(set(given) - set(known))
    if unknown:
        raise TypeError(f"submit_validation() got unexpected keyword arguments: {', '.join(unknown)}")
    return {k: given.get(k) for k in known}


def _check_wait(timeout: float | None, poll: float) -> float:
    if timeout is not None and not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds or None, got {timeout!r}")
    if not poll > 0:
        raise ValueError(f"poll must be a positive number of seconds, got {poll!r}")
    return max(float(poll), MIN_POLL_S)


def _timed_out(job: ValidationJob, timeout: float) -> TimeoutError:
    progress = job.progress or {}
    where = f" at step {progress['step']} of {progress.get('total', '?')}" if "step" in progress else ""
    return TimeoutError(
        f"validation {job.id} is still {job.status}{where} after {timeout:g} s; it keeps running in the "
        f"service: wait again, or cancel it with cancel_validation({job.id!r})"
    )


class ValidationCalls:
    """``/v1/validations`` calls of the blocking ``Client``."""

    def submit_validation(
        self,
        graph: Any = None,
        method: str | None = None,
        activation: str | None = None,
        targets: Any = None,
        *,
        key: str | None = None,
        dataset: str | None = None,
        steps: int | None = None,
        batch_size: int | None = None,
        optimizer: str | None = None,
        lr: float | None = None,
        seed: int | None = None,
        baselines: list[str] | None = None,
        task: str | None = None,
        arms: list[str] | None = None,
        **solve_options: Any,
    ) -> str:
        """``POST /v1/validations`` (API key required): validate the answer to the solve request
        ``graph, method, activation, targets`` (``solve_options``: ``init``, ``trainable``,
        ``c_map_points``, ``assumptions``), or the stored solution ``key``. ``task="charlm"`` (with
        ``arms``) trains a transformer answer as a byte-level language model (docs/service.md).
        Returns the job id."""
        options = {"dataset": dataset, "steps": steps, "batch_size": batch_size, "optimizer": optimizer,
                   "lr": lr, "seed": seed, "baselines": baselines, "task": task, "arms": arms}  # fmt: skip
        body = _submission(self, (graph, method, activation, targets), key, solve_options, options)
        return self.submit_validation_request(body)

    def submit_validation_request(self, request: ValidationRequest | Mapping[str, Any]) -> str:
        """``POST /v1/validations`` with a whole request (a ``ValidationRequest`` or its JSON as a dict)."""
        return self._json("POST", "/v1/validations", json=_validation_body(request), idempotent=False)["id"]

    def validation(self, vid: str) -> ValidationJob:
        """``GET /v1/validations/{id}``: status, progress and, once finished, results."""
        return ValidationJob.model_validate(self._json("GET", f"/v1/validations/{_quote(vid)}"))

    def validations(self, offset: int = 0, limit: int = 50) -> dict:
        """``GET /v1/validations``: ``{"total", "offset", "limit", "items"}``, newest first."""
        return self._json("GET", "/v1/validations", params={"offset": offset, "limit": limit})

    def cancel_validation(self, vid: str) -> ValidationJob:
        """``DELETE /v1/validations/{id}`` (API key required): a queued job is cancelled at once, a
        running one when it notices (its status is still ``running`` in the answer)."""
        path = f"/v1/validations/{_quote(vid)}"
        return ValidationJob.model_validate(self._json("DELETE", path, idempotent=False))

    def wait_validation(self, vid: str, timeout: float | None = 600.0, poll: float = 1.0) -> ValidationJob:
        """Read the job every ``poll`` seconds until it is finished, failed or cancelled, and return
        it; ``TimeoutError`` after ``timeout`` seconds (None: no limit)."""
        pause = _check_wait(timeout, poll)
        deadline = None if timeout is None else _monotonic() + timeout
        while True:
            job = self.validation(vid)
            if job.status in FINAL_STATUSES:
                return job
            if deadline is not None and _monotonic() + pause > deadline:
                raise _timed_out(job, timeout)
            self._pause(pause)


class AsyncValidationCalls:
    """The same calls for ``AsyncClient``, as coroutines."""

    async def submit_validation(
        self,
        graph: Any = None,
        method: str | None = None,
        activation: str | None = None,
        targets: Any = None,
        *,
        key: str | None = None,
        dataset: str | None = None,
        steps: int | None = None,
        batch_size: int | None = None,
        optimizer: str | None = None,
        lr: float | None = None,
        seed: int | None = None,
        baselines: list[str] | None = None,
        task: str | None = None,
        arms: list[str] | None = None,
        **solve_options: Any,
    ) -> str:
        """``POST /v1/validations`` (see ``Client.submit_validation``)."""
        options = {"dataset": dataset, "steps": steps, "batch_size": batch_size, "optimizer": optimizer,
                   "lr": lr, "seed": seed, "baselines": baselines, "task": task, "arms": arms}  # fmt: skip
        body = _submission(self, (graph, method, activation, targets), key, solve_options, options)
        return await self.submit_validation_request(body)

    async def submit_validation_request(self, request: ValidationRequest | Mapping[str, Any]) -> str:
        body = _validation_body(request)
        return (await self._json("POST", "/v1/validations", json=body, idempotent=False))["id"]

    async def validation(self, vid: str) -> ValidationJob:
        return ValidationJob.model_validate(await self._json("GET", f"/v1/validations/{_quote(vid)}"))

    async def validations(self, offset: int = 0, limit: int = 50) -> dict:
        return await self._json("GET", "/v1/validations", params={"offset": offset, "limit": limit})

    async def cancel_validation(self, vid: str) -> ValidationJob:
        path = f"/v1/validations/{_quote(vid)}"
        return ValidationJob.model_validate(await self._json("DELETE", path, idempotent=False))

    async def wait_validation(self, vid: str, timeout: float | None = 600.0, poll: float = 1.0) -> ValidationJob:
        """As ``Client.wait_validation``; the event loop is free between two reads."""
        pause = _check_wait(timeout, poll)
        deadline = None if timeout is None else _monotonic() + timeout
        while True:
            job = await self.validation(vid)
            if job.status in FINAL_STATUSES:
                return job
            if deadline is not None and _monotonic() + pause > deadline:
                raise _timed_out(job, timeout)
            await asyncio.sleep(pause)


def _quote(segment: str) -> str:
    from urllib.parse import quote

    return quote(str(segment), safe="")
