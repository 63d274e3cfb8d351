"""What ``/readyz`` and the memory gauges of ``/metrics`` report, refreshed by a thread of its own.

``/readyz`` used to ask the store on each call from the I/O thread pool that request parsing and
cache reads share: under 50 concurrent cold solves and hit loops it took up to 1.29 s (issue 26),
past a typical 1 s probe timeout, so a busy but healthy replica looked dead. A thread of this
module asks the store every ``INTERVAL_S`` and keeps the answer; ``/readyz`` reads it on the event
loop, with no I/O and no queue to wait in. A refresh that has not completed for ``STALE_S`` (a
store call hanging past its socket timeout) reads as unreachable, so a stuck store is still seen.

The same thread samples what this process holds in memory: the hot answers, the body memo, the
solver processes' and its own resident memory (``sigprop_memory_bytes``), so a slow creep shows up
in the metrics by part instead of as one process's growing RSS.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, replace

from ..storage import CacheUnavailable
from .observability import MEMORY_BYTES, MEMORY_ENTRIES, OPEN_CONNECTIONS, SOLVER_PROCESSES

log = logging.getLogger("sigprop")

INTERVAL_S = 0.5
STALE_S = 5.0
CONFIG_EVERY_S = 5.0  # how often Redis' settings are read again (storage/redis_config.py)
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


@dataclass(frozen=True)
class StoreState:
    reachable: bool
    storage: str  # ok, degraded (refuses writes), unreachable
    at: float  # time.monotonic() of the check
    # Redis only: whether its settings can drop accepted work (ok, degraded, unsafe, unknown) and why
    config: str | None = None
    config_note: str = ""


def check_store(cache) -> StoreState:
    """One look at the store: reachable, and whether it takes a write."""
    reachable = bool(cache.ping())
    storage = "unreachable"
    if reachable:
        try:
            storage = "ok" if cache.writable() else "degraded"
        except CacheUnavailable:
            reachable = False
    return StoreState(reachable, storage, time.monotonic())


def rss_bytes(pid: int | str = "self") -> int:
    """Resident memory of a process (Linux /proc; 0 where it cannot be read)."""
    try:
        with open(f"/proc/{pid}/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return 0


def sample_memory(solutions) -> dict[str, int]:
    """Set the memory gauges from this process's parts; returns the byte sizes (tests, logs)."""
    sizes = solutions.memory()
    pids = solutions.solver.pids() if solutions.solver is not None else []
    sizes["solver_processes"] = sum(rss_bytes(pid) for pid in pids)
    sizes["api_process"] = rss_bytes()
    for part in ("hot_answers", "body_memo", "solver_processes", "api_process"):
        MEMORY_BYTES.labels(part).set(sizes[part])
    MEMORY_ENTRIES.labels("hot_answers").set(sizes["hot_answers_entries"])
    MEMORY_ENTRIES.labels("body_memo").set(sizes["body_memo_entries"])
    SOLVER_PROCESSES.set(len(pids))
    from .connections import current_guard

    guard = current_guard()
    OPEN_CONNECTIONS.set(len(guard.open) if guard is not None else 0)
    return sizes


class ProbeState:
    """The store's last known state and the memory gauges, refreshed every ``INTERVAL_S``."""

    def __init__(self, cache, solutions, interval_s: float = INTERVAL_S, stale_s: float = STALE_S):
        self.cache, self.solutions = cache, solutions
        self.interval_s, self.stale_s = interval_s, stale_s
        self.store = StoreState(False, "unreachable", 0.0)
        self._config: tuple[str, str] | None = None  # Redis' settings as last read: (state, note)
        self._config_at = -CONFIG_EVERY_S
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def refresh(self) -> None:
        try:
            store = check_store(self.cache)
            if store.reachable:
                self._check_config()
            if self._config is not None:
                store = replace(store, config=self._config[0], config_note=self._config[1])
            self.store = store
        except Exception as exc:  # noqa: BLE001 - a probe must report, never die
            log.warning("readiness check failed: %s", exc)
            self.store = StoreState(False, "unreachable", time.monotonic())
        try:
            sample_memory(self.solutions)
        except Exception as exc:  # noqa: BLE001 - the gauges are best effort, the probe is not
            log.warning("memory sample failed: %s", exc)

    def _check_config(self) -> None:
        """Read Redis' settings again every ``CONFIG_EVERY_S`` (they can change at run time)."""
        read = getattr(self.cache, "config_state", None)
        if read is None or time.monotonic() - self._config_at < CONFIG_EVERY_S:
            return
        self._config_at = time.monotonic()
        try:
            found = read()
        except CacheUnavailable:
            return  # kept from the last read; the store's own state says unreachable
        if self._config is not None and found.state != self._config[0] and found.state != "ok":
            log.warning("Redis settings now %s: %s", found.state, found.note)
        self._config = (found.state, found.note)

    def current(self) -> StoreState:
        """The last check, or unreachable when none completed for ``stale_s``."""
        store = self.store
        if time.monotonic() - store.at > self.stale_s:
            return StoreState(False, "unreachable", store.at)
        return store

    def start(self) -> None:
        self.refresh()
        self._thread = threading.Thread(target=self._loop, name="sigprop-probes", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.refresh()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
