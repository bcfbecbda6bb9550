"""The count of acquires in flight, which ``close()`` waits on, stays exact and wakes it.

Every acquire attempt counts itself in flight so that a client closing meanwhile waits
for it to land and releases what it took. The count is kept on every acquire's path,
so it is cheap there; these tests pin that it still balances and still wakes a waiting
``close()`` the moment the last acquire lands.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
from test_process_life import acquiring_in_thread

import queen_sync as qs
from queen_sync.testing import FaultyEngine


class TestCloseWaitingOnAnAcquireInFlight:
    def test_close_returns_when_the_acquire_lands_long_before_its_own_timeout(
            self, sqlite_url: str) -> None:
        engine = FaultyEngine(sqlite_url)
        granted, release = threading.Event(), threading.Event()

        def hold(route: str, body: Any) -> None:
            granted.set()
            release.wait(5)

        engine.hook_next(None, hook=hold, op="acquire", applied=True)
        q = qs.Queen(engine=engine)
        lock = q.lock("job", ttl=60)
        taking, outcome = acquiring_in_thread(lock)
        assert granted.wait(5), "setup: the acquire did not reach the engine"
        closing = threading.Thread(target=lambda: q.close(timeout=60))
        closing.start()
        closing.join(0.2)
        assert closing.is_alive(), "close() did not wait for the acquire in flight"
        release.set()
        taking.join(5)
        closing.join(10)  # far below the 60 s it would wait if nobody woke it
        assert not closing.is_alive(), "close() was not woken when the acquire landed"
        assert isinstance(outcome[0], qs.QueenError), (
            f"an acquire granted as its client closed reported {outcome[0]!r}, not 'closed'")
        with qs.Queen(sqlite_url) as observer:
            assert not observer.locks.get("job"), "close left the in-flight acquire's permit"


class TestTheCountBalances:
    def test_after_many_acquires_and_refused_ones_close_finds_none_in_flight(
            self, sqlite_url: str, caplog: pytest.LogCaptureFixture) -> None:
        q, other = qs.Queen(sqlite_url), qs.Queen(sqlite_url)
        lock, rival = q.lock("job", ttl=30), other.lock("job", ttl=30)
        for _ in range(50):
            assert lock.acquire(), "a free lock was not taken"
            assert not rival.acquire(), "a held lock was taken by another client"
            lock.release()
        assert (q._acquires, other._acquires) == (0, 0), "an acquire stayed counted in flight"
        q.close(timeout=1)
        other.close(timeout=1)
        assert "still in flight" not in caplog.text, caplog.text
