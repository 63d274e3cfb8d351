"""Fair queues (issue 35): cold solves are scheduled in turn by client, not first come first
served; every anonymous client shares one turn; lanes are chosen by price, not by graph family.
"""

from __future__ import annotations

import threading
import time

from sigprop.api.coldlanes import GENERAL, Lanes


def _acquire_in_thread(lanes: Lanes, client, small: bool, out: list, timeout_s: float = 5.0) -> threading.Thread:
    t = threading.Thread(target=lambda: out.append((client, lanes.acquire(client, small, timeout_s))))
    t.start()
    return t


def _wait_for_waiters(lanes: Lanes, n: int) -> None:
    deadline = time.monotonic() + 5
    while lanes.waiting() < n and time.monotonic() < deadline:
        time.sleep(0.001)
    assert lanes.waiting() == n


def _next_granted(out: list, n: int) -> None:
    deadline = time.monotonic() + 5
    while len(out) < n and time.monotonic() < deadline:
        time.sleep(0.001)
    assert len(out) == n


def test_one_clients_backlog_does_not_delay_another_clients_solve_past_one_running_solve():
    lanes = Lanes(general=1, small=0, per_client=0)
    held = lanes.acquire("key:a", True, 1)
    out: list = []
    threads = [_acquire_in_thread(lanes, "key:a", True, out) for _ in range(5)]
    _wait_for_waiters(lanes, 5)
    threads.append(_acquire_in_thread(lanes, "key:b", True, out))
    _wait_for_waiters(lanes, 6)
    lanes.release(held)  # b's solve starts next, not after a's five queued before it
    _next_granted(out, 1)
    assert out[0][0] == "key:b"
    for i in range(6):
        _next_granted(out, i + 1)
        lanes.release(out[i][1])
    for t in threads:
        t.join(5)
    assert lanes.waiting() == 0 and lanes.free[GENERAL] == 1


def test_turns_alternate_between_clients_with_backlogs():
    lanes = Lanes(general=1, small=0, per_client=0)
    held = lanes.acquire("key:x", True, 1)
    out: list = []
    threads = []
    for client in ["key:a"] * 3 + ["key:b"] * 3:
        threads.append(_acquire_in_thread(lanes, client, True, out))
        _wait_for_waiters(lanes, len(threads))
    lanes.release(held)
    for i in range(6):
        _next_granted(out, i + 1)
        lanes.release(out[i][1])
    for t in threads:
        t.join(5)
    order = [c for c, _ in out]
    assert sorted(order) == ["key:a"] * 3 + ["key:b"] * 3
    assert all(x != y for x, y in zip(order, order[1:], strict=False)), order


def test_every_anonymous_address_shares_one_cap_so_rotating_addresses_gains_nothing():
    from sigprop.api.coldlanes import ANONYMOUS, share_of

    lanes = Lanes(general=3, small=0, per_client=1)
    first = lanes.acquire("addr:10.0.0.1", False, 1)
    assert first is not None
    assert lanes.acquire("addr:10.0.0.2", False, 0.05) is None  # the anonymous share is at its cap
    keyed = lanes.acquire("key:k", False, 0.5)  # a keyed client has a share of its own
    assert keyed is not None
    for t in (first, keyed):
        lanes.release(t)
    assert lanes.waiting() == 0 and lanes.free[GENERAL] == 3
    assert share_of("addr:10.0.0.1") == share_of("addr:10.0.0.2") == ANONYMOUS
    assert share_of("key:abc") == "key:abc" and share_of(None) is None


def test_anonymous_addresses_take_turns_within_their_share():
    lanes = Lanes(general=1, small=0, per_client=0)
    held = lanes.acquire("addr:1", True, 1)
    out: list = []
    threads = []
    for client in ["addr:1"] * 3 + ["addr:2"]:
        threads.append(_acquire_in_thread(lanes, client, True, out))
        _wait_for_waiters(lanes, len(threads))
    lanes.release(held)
    for i in range(4):
        _next_granted(out, i + 1)
        lanes.release(out[i][1])
    for t in threads:
        t.join(5)
    assert [c for c, _ in out][:2] == ["addr:2", "addr:1"]
