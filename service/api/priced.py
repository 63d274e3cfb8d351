"""Admission for the routes that do work without solving (issue 35): ``GET /v1/templates/{name}``
(a graph built from parameters) and ``GET /v1/solutions/{key}`` (a stored answer, up to megabytes)
are priced before the work, as a solve is, and a large one is kept off the API's threads.

- A template's price is its nodes plus edges, known exactly from its parameters
  (``preparation.check_template``, which refuses one over the limits with 413). Up to
  ``small_cost`` it is expanded in a thread, as before; past it, it counts against the client's
  cold-solve budget (429 over it) and is expanded in a solver process, scheduled with the cold
  solves (``coldlanes.Lanes``: in turn by client, every anonymous client in one share). Eight
  concurrent 10,000-layer expansions in the API's threads held the GIL that every other request
  needs: another client's small cold solve went from 11 ms to 1.3 s.
- A stored answer's price is its size, known once its record is read (the read itself is I/O).
  Past ``LARGE_READ_BYTES`` it counts against the client's cold-solve budget and is checked and
  rendered in a solver process, scheduled with the cold solves (without a solver pool: in a thread
  of its own, one at a time); either way it is rendered without serializing the whole answer
  again (the stored texts are spliced, each checked to parse). Eight concurrent reads of a 1.8 MB
  answer in the shared threads took ``/healthz`` p99 from 7 to 309 ms.
"""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor

from ..answers import personalize_json
from ..engine.templates.expand import expand_template
from ..errors import SigpropError
from ..preparation import check_template
from ..schemas.graph import Template
from ..storage.records import summary_part, summary_row
from .coldpool import timeout_error
from .deps import Offload, thread_result
from .solutions import SolutionService

LARGE_READ_BYTES = 256 << 10  # a stored answer (with its request) past this is a large read


def expand_json(t: Template, max_nodes: int) -> str:
    """The expanded template's graph JSON (runs in a solver process for a large one)."""
    return expand_template(t, max_nodes=max_nodes).model_dump_json(by_alias=True)


def stored_text(rec) -> str:
    """``GET /v1/solutions/{key}``'s body from a verified record: its summary, request and answer,
    the stored texts spliced rather than parsed and serialized again (each is checked to parse)."""
    answer = personalize_json(rec.answer, rec.ids, cached=True)
    try:
        json.loads(answer)
    except ValueError:  # checksummed but not JSON: nothing sigprop wrote; shown as missing
        raise SigpropError(
            "not_found",
            f"the stored solution {rec.key} is unreadable",
            "POST its request to /v1/solve to store it again",
        ) from None
    try:
        json.loads(rec.request)
        request = rec.request
    except (ValueError, TypeError):  # the answer is intact: show it, without the request it came from
        request = "null"
    head = json.dumps(_summary(rec), separators=(",", ":"), ensure_ascii=False)
    return f'{head[:-1]},"request":{request},"answer":{answer}}}'


def _summary(rec) -> dict:
    """``rec.summary()`` without parsing the whole answer a second time (``records.summary_part``)."""
    targets, graph = summary_part(rec.answer, "targets"), summary_part(rec.answer, "graph_summary")
    row = summary_row(rec.key, rec.created, rec.version, rec.method, rec.activation, rec.hits, targets, graph)
    return row if row is not None else rec.summary()


class Priced:
    """The two routes' admission, for one API process (``priced(app.state)``)."""

    def __init__(self, service: SolutionService, offload: Offload, limit=None):
        self.service, self.offload = service, offload
        self.limit = limit  # the cold-solve budget (``ratelimit.RateLimit``): large work counts in it
        self.reads = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sigprop-large-read")

    async def _count(self, client: str | None) -> None:
        if self.limit is not None and getattr(self.limit, "enabled", True):
            await self.offload(self.limit, client)  # may talk to Redis: off the event loop

    async def template(self, t: Template, client: str | None) -> str:
        """The expanded template's JSON, priced first (413 over the limits)."""
        service = self.service
        size = check_template(t, service.limits)  # from the parameters, before building anything
        price = 0 if size is None else size.nodes + size.edges
        max_nodes = service.limits.max_nodes
        if price <= service.small_cost:
            return await self.offload(expand_json, t, max_nodes)
        await self._count(client)
        if service.solver is None:
            return await self.offload(expand_json, t, max_nodes)
        timeout = service.solve_timeout_s
        work = self.offload.cold.submit(
            service.solver.call, expand_json, (t, max_nodes), timeout, what="expanding the template", client=client
        )
        return await self._await(work, timeout + 1.0)

    async def stored(self, key: str, client: str | None) -> str:
        """A stored solution's JSON: read (I/O) in the shared threads, rendered there when small,
        counted and rendered in the large-read thread when large."""
        rec = await self.offload(self.service.stored, key)
        if len(rec.answer) + len(rec.request or "") <= LARGE_READ_BYTES:
            return await self.offload(stored_text, rec)
        await self._count(client)
        service, timeout = self.service, self.offload.timeout_s
        if service.solver is None:
            return await self._await(self.reads.submit(stored_text, rec), timeout)
        # parsed and rendered in a solver process, in turn with the cold solves: its GIL is not the API's
        work = self.offload.cold.submit(
            service.solver.call, stored_text, (rec,), timeout, what="reading the solution", client=client
        )
        return await self._await(work, timeout + 1.0)

    async def _await(self, work, timeout_s: float) -> str:
        try:
            return await thread_result(work, timeout_s)
        except asyncio.TimeoutError:
            raise timeout_error(self.offload.timeout_s, "the request") from None
        except asyncio.CancelledError:
            work.cancel()
            raise


def priced(state) -> Priced:
    """This app's ``Priced``, made at first use from its services and its cold-solve budget."""
    found = getattr(state, "priced", None)
    if found is None:
        limits = getattr(state, "limits", None)
        found = state.priced = Priced(state.solutions, state.offload, getattr(limits, "cold_solves", None))
    return found
