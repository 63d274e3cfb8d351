"""What a ``sigprop worker`` agrees to run: sigprop's validation job and its callbacks, nothing else.

RQ stores a job as the dotted name of a function plus its arguments, and a worker imports and calls
whatever name it finds. Anyone who can write to the queue's Redis could therefore run any function
(``os.system``) on every worker. Two guards close that:

* :class:`SigpropJob` (the worker's ``job_class``): its ``func`` and its callbacks resolve only to
  the names in :data:`ALLOWED_FUNCTIONS` / :data:`ALLOWED_CALLBACKS`. Anything else is never
  imported: ``func`` raises :class:`RefusedJob` and a foreign callback reads as None (RQ also runs
  callbacks outside a job, e.g. the failure callback of a job its maintenance finds abandoned).
* ``worker.SigpropWorker.execute_job`` checks :func:`refusal` before a work horse is forked and
  fails a refused job at once (logged, no retry) without running any of it.
"""

from __future__ import annotations

import logging

from rq.job import Job

from .queue import on_failure, on_stopped, rq_job

log = logging.getLogger("sigprop")


def _dotted(fn) -> str:
    return f"{fn.__module__}.{fn.__qualname__}"


ALLOWED_FUNCTIONS = frozenset({_dotted(rq_job)})
ALLOWED_CALLBACKS = frozenset({_dotted(on_failure), _dotted(on_stopped)})
_CALLBACK_FIELDS = ("_success_callback_name", "_failure_callback_name", "_stopped_callback_name")


class RefusedJob(Exception):
    """A job that is not sigprop's validation job (raised instead of importing its function)."""


def refusal(job: Job) -> str | None:
    """Why ``job`` must not run (a sentence naming what it asked for), or None when it is ours."""
    try:
        name, instance = job.func_name, job.instance
    except Exception as exc:  # noqa: BLE001 - a job whose data does not even decode is not ours
        return f"its data does not decode ({type(exc).__name__})"
    if instance is not None or name not in ALLOWED_FUNCTIONS:
        return f"it asks for the function {name!r}, which is not sigprop's validation job"
    for field in _CALLBACK_FIELDS:
        callback = getattr(job, field, None)
        if callback and callback not in ALLOWED_CALLBACKS:
            return f"it asks for the callback {callback!r}, which is not one of sigprop's"
    return None


class SigpropJob(Job):
    """An RQ job that imports only sigprop's validation function and callbacks."""

    @property
    def func(self):
        reason = refusal(self)
        if reason is not None:
            raise RefusedJob(f"refused job {self.id}: {reason}")
        return super().func

    def _allowed_callback(self, field: str, prop):
        name = getattr(self, field, None)
        if name and name not in ALLOWED_CALLBACKS:
            log.error("job %s: refused its callback %r (not one of sigprop's)", self.id, name)
            return None
        return prop.fget(self)

    @property
    def success_callback(self):
        return self._allowed_callback("_success_callback_name", Job.success_callback)

    @property
    def failure_callback(self):
        return self._allowed_callback("_failure_callback_name", Job.failure_callback)

    @property
    def stopped_callback(self):
        return self._allowed_callback("_stopped_callback_name", Job.stopped_callback)
