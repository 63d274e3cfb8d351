"""Admission before work: what a request will cost, known from its size before anything is built,
and a body memo bounded in bytes.

The cost of a solve is near-linear in the nodes plus the edges of the graph for every method (the
engine's passes are; see ``engine.network.subnetworks``, ``engine.network.jacobian`` and
``engine.methods.geometric``, and ``bench/cost_bench.py`` for each method on graphs built to
break that), so that sum is the estimate: counted on the parsed JSON for a node-by-node graph,
computed exactly from a template's parameters (``TemplateSize``) for a template, in microseconds
either way (``sigprop.preparation``, which admits every request); here, what the API checks before
it parses a body at all.
"""

from __future__ import annotations

import re
import sys
import threading
from collections import OrderedDict

from ..errors import SigpropError

# the cost of a parsed request's graph and its check: one module prepares every request
from ..preparation import COST_HINT, check_cost, graph_cost  # noqa: F401 - the admission API, re-exported

_INPUTS = re.compile(rb'"inputs": ?\[([^\]]*)\]')


def body_cost_bound(body: bytes) -> tuple[int, int]:
    """(nodes, edges) a request body holds at least, from its bytes alone (C-speed scans, about
    15 ms for 2 MB where parsing it takes several times that): each node object has one ``"op"``
    key, and an ``"inputs"`` list holds one quoted id per edge. Ids contain no quote, so these
    byte patterns occur in no string; spellings with other spacing are not counted and an id
    holding a ``]`` ends its list's count early, so the result stays a lower bound. A body that
    is not a valid request may count keys no node holds: it is refused as too large, not invalid."""
    nodes, edges, _ = _body_counts(body)
    return nodes, edges


def _body_counts(body: bytes) -> tuple[int, int, int]:
    """``body_cost_bound``'s (nodes, edges), and the most inputs one ``"inputs"`` list holds."""
    nodes = body.count(b'"op":') + body.count(b'"op" :')
    if not nodes:
        return 0, 0, 0
    lists = [x.count(b'"') // 2 for x in _INPUTS.findall(body)]
    return nodes, sum(lists), max(lists, default=0)


def check_body_cost(body: bytes, budget: int, max_fan_in: int | None = None) -> None:
    """``check_cost`` on a lower bound counted on the bytes, before they are parsed; and a node
    with more inputs than ``max_fan_in`` (only sums and concats take several), refused as well
    before the parse and validation that would take longer than the refusal should."""
    nodes, edges, widest = _body_counts(body)
    if nodes + edges > budget:
        raise SigpropError(
            "graph_too_large",
            f"the graph has at least {nodes} nodes and {edges} edges, a cost of {nodes + edges}: "
            f"more than this service's budget of {budget} per solve",
            COST_HINT,
        )
    if max_fan_in is not None and widest > max_fan_in:
        raise SigpropError(
            "graph_too_large",
            f"a node of the graph has at least {widest} inputs, more than this service's limit of {max_fan_in}",
            "join the inputs in a tree of smaller sums or concats, or raise SIGPROP_MAX_FAN_IN on your own deployment",
        )


class BodyMemo:
    """body digest -> parsed request (``solutions._Parsed``), least recently used first out, holding
    at most ``max_bytes`` (the entries' estimated size, mostly their node ids)."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.bytes = 0
        self._items: OrderedDict[bytes, tuple[object, int]] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._items)

    def get(self, digest: bytes):
        with self._lock:
            item = self._items.get(digest)
            if item is None:
                return None
            self._items.move_to_end(digest)
            return item[0]

    def put(self, digest: bytes, parsed, body_len: int = 0) -> None:
        size = _size(parsed)
        if size > self.max_bytes:
            return
        with self._lock:
            old = self._items.pop(digest, None)
            if old is not None:
                self.bytes -= old[1]
            self._items[digest] = (parsed, size)
            self.bytes += size
            while self.bytes > self.max_bytes and self._items:
                _, (_, freed) = self._items.popitem(last=False)
                self.bytes -= freed


def _size(parsed) -> int:
    """Bytes an entry holds, near enough: its strings and their tuples."""
    total = 200 + len(getattr(parsed, "key", ""))
    for field in ("ids", "graph_warnings"):
        items = getattr(parsed, field, ())
        total += sys.getsizeof(items) + sum(sys.getsizeof(x) for x in items)
    return total
