"""``python -m tests.fake_sigprop serve|worker ...``: sigprop's own command line with the sleep-only
trainer of ``tests/fake_training.py`` in place of the real one, for the tests that run validations
through real processes (``sigprop worker`` on RQ, ``sigprop serve`` running them locally).

The swap is a monkeypatch of ``sigprop.worker.job.train`` in this process before the command
starts: RQ's work horses are forks of the worker, and ``sigprop serve`` with one worker process
serves in this process, so both run the fake. sigprop itself has no switch for it."""

from __future__ import annotations

import sys

from sigprop import cli
from sigprop.worker import job
from tests import fake_training


def install() -> None:
    """Make this process's validation jobs run the fake trainer."""
    job.train = fake_training.run


if __name__ == "__main__":
    install()
    sys.exit(cli.main())
