"""One release of a name wakes one waiting thread of a process, and every waiter gets a turn.

A release frees one permit, so waking every thread of a process that waits on the name
only sends all but one of them to lose a round trip to the winner. These tests run the
engine's LISTEN wake-up against the tests' own server: a second engine releases, the
threads of the first wait.
"""

from __future__ import annotations

import contextlib
import secrets
import threading
import time
from typing import Any, Callable, Iterator

import pytest
from pg_server import PgServer, shared_server

pytest.importorskip("psycopg")

import queen_sync as qs
from queen_sync._engines.postgres.engine import PostgresEngine

pytestmark = pytest.mark.timeout(60)

_LONG_WAIT = 20.0  # far beyond any wake-up here: a thread still waiting was not woken


@pytest.fixture(scope="module")
def server() -> Iterator[PgServer]:
    with shared_server() as running:
        yield running


@pytest.fixture
def url(server: PgServer) -> str:
    """A fresh, empty schema."""
    return f"{server.url}?schema=w_{secrets.token_hex(6)}"


@pytest.fixture
def engine(url: str) -> Iterator[PostgresEngine]:
    eng = PostgresEngine.from_url(url)
    yield eng
    eng.close()


@pytest.fixture
def releaser(url: str) -> Iterator[PostgresEngine]:
    """Another client of the same database: its releases reach the first one by NOTIFY."""
    eng = PostgresEngine.from_url(url)
    yield eng
    eng.close()


def _lock_call(engine: PostgresEngine, op: dict[str, Any]) -> dict[str, Any]:
    result: dict[str, Any] = engine.call("locks", {"operations": [op]})["results"][0]
    return result


def _until(condition: Callable[[], bool], failure: str) -> None:
    deadline = time.monotonic() + 5.0
    while not condition():
        assert time.monotonic() < deadline, failure
        time.sleep(0.005)


def _take_and_release(engine: PostgresEngine, name: str) -> None:
    taken = _lock_call(engine, {"op": "acquire", "name": name, "ttlSeconds": 30,
                                "owner": "releaser"})
    assert taken["acquired"], f"the releaser could not take {name!r}: {taken}"
    freed = _lock_call(engine, {"op": "release", "name": name, "token": taken["token"],
                                "slot": taken["slot"]})
    assert freed == {"released": True}, f"the releaser's release failed: {freed}"


class _Waiters:
    """Threads that each subscribe to ``name``, in order, and wait until woken once.

    A woken thread stays subscribed until ``leave`` is set, so the tests see each wake as
    it lands, not the hand-on of a thread that left.
    """

    def __init__(self, engine: PostgresEngine, name: str, count: int) -> None:
        self.woken: list[int] = []  # thread numbers, in the order they were woken
        self.leave = threading.Event()
        self._mutex = threading.Lock()
        self._subscribed = threading.Semaphore(0)
        self._threads = [threading.Thread(target=self._wait, args=(engine, name, i), daemon=True)
                         for i in range(count)]
        for thread in self._threads:  # one at a time: subscription order is thread order
            thread.start()
            assert self._subscribed.acquire(timeout=10), "a waiter never subscribed"

    def _wait(self, engine: PostgresEngine, name: str, number: int) -> None:
        # The listener's own subscription: the engine's puts the waiters of a name in line
        # first (test_postgres_waiting_line.py), and only the front one listens.
        with engine._listening().subscribe(name) as waiter:
            self._subscribed.release()
            if waiter.wait(_LONG_WAIT):
                with self._mutex:
                    self.woken.append(number)
            self.leave.wait(_LONG_WAIT)

    def count_within(self, seconds: float, at_least: int) -> list[int]:
        """The woken threads once ``at_least`` woke, or after ``seconds`` (then settled)."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and len(self.woken) < at_least:
            time.sleep(0.005)
        time.sleep(0.3)  # long enough for any further wake this release would cause
        with self._mutex:
            return list(self.woken)

    def finish(self) -> None:
        self.leave.set()
        for thread in self._threads:
            thread.join(_LONG_WAIT)


class TestOneWakePerRelease:
    def test_a_release_wakes_exactly_one_of_the_threads_waiting_on_its_name(
            self, engine: PostgresEngine, releaser: PostgresEngine) -> None:
        waiters = _Waiters(engine, "one", 3)
        try:
            _take_and_release(releaser, "one")
            woken = waiters.count_within(5.0, at_least=1)
        finally:
            waiters.finish()
        assert len(woken) == 1, (
            f"one release must wake one waiting thread of the process; woke {len(woken)}: "
            f"{woken}")

    def test_the_threads_left_waiting_are_woken_in_turn_by_the_next_releases_oldest_first(
            self, engine: PostgresEngine, releaser: PostgresEngine) -> None:
        waiters = _Waiters(engine, "turns", 3)
        seen: list[list[int]] = []
        try:
            for releases in range(1, 4):
                _take_and_release(releaser, "turns")
                seen.append(waiters.count_within(5.0, at_least=releases))
        finally:
            waiters.finish()
        assert seen == [[0], [0, 1], [0, 1, 2]], (
            f"each release must wake the longest-waiting thread not yet woken: {seen}")

    def test_a_waiter_leaving_with_a_wake_it_never_waited_for_passes_it_to_the_next(
            self, engine: PostgresEngine, releaser: PostgresEngine) -> None:
        # Both waiters are busy (neither in wait) when the release lands on the oldest,
        # which then leaves: the wake it was given must not be lost with it.
        listener = engine._listening()
        leaving = contextlib.ExitStack()
        oldest = leaving.enter_context(listener.subscribe("pass"))
        with leaving, listener.subscribe("pass") as next_one:
            _take_and_release(releaser, "pass")
            _until(lambda: oldest.pending, "the release never woke the oldest waiter")
            assert not next_one.pending, "one release woke both busy waiters"
            leaving.close()  # leaves the subscription without ever waiting
            assert next_one.pending, "the wake left with a waiter that never took it"
            assert next_one.wait(_LONG_WAIT), "the handed-on wake did not end the wait"

    def test_a_wake_landing_while_a_waiter_is_busy_makes_its_next_wait_return_at_once(
            self, engine: PostgresEngine, releaser: PostgresEngine) -> None:
        with engine._listening().subscribe("busy") as waiter:
            _take_and_release(releaser, "busy")
            time.sleep(0.3)  # the NOTIFY lands while nobody waits
            started = time.monotonic()
            assert waiter.wait(_LONG_WAIT), "the wake given while busy was lost"
            assert waiter.wait(0.05) is False, "one release woke the waiter twice"
        assert time.monotonic() - started < _LONG_WAIT / 2, "the kept wake did not end the wait"


class TestHandlesTakingTurns:
    def test_threads_waiting_on_one_lock_each_get_their_turn(self, url: str) -> None:
        with qs.Queen(url) as q, qs.Queen(url) as other:
            holder = other.lock("shared", ttl=30)
            assert holder.acquire(), "the first holder could not take the lock"
            turns: list[int] = []
            failures: list[str] = []

            def take_turn(number: int) -> None:
                lock = q.lock("shared", ttl=30)
                if not lock.acquire(wait=_LONG_WAIT):
                    failures.append(f"thread {number} never got its turn")
                    return
                turns.append(number)
                lock.release()

            threads = [threading.Thread(target=take_turn, args=(i,), daemon=True)
                       for i in range(4)]
            for thread in threads:
                thread.start()
            time.sleep(0.3)  # every thread has failed once and waits
            holder.release()
            for thread in threads:
                thread.join(_LONG_WAIT + 5)
        assert not failures, failures
        assert sorted(turns) == [0, 1, 2, 3], f"every waiting thread takes a turn: {turns}"

    def test_a_waiter_whose_wake_is_lost_still_acquires_within_its_poll_bound(
            self, url: str, monkeypatch: pytest.MonkeyPatch) -> None:
        with qs.Queen(url) as q, qs.Queen(url) as other:
            holder = other.lock("muted", ttl=30)
            assert holder.acquire(), "the first holder could not take the lock"
            engine = q.engine
            assert isinstance(engine, PostgresEngine)
            with engine.subscribe("muted"):
                pass  # the listener runs; now every notification it receives is dropped
            listener = engine._listening()
            monkeypatch.setattr(listener, "_wake", lambda name: None)
            timer = threading.Timer(0.2, holder.release)
            timer.start()
            started = time.monotonic()
            took = q.lock("muted", ttl=30).acquire(wait=10)
            waited = time.monotonic() - started
            timer.join()
        assert took, "a waiter whose wake was lost never took the freed lock"
        assert waited < 5, f"a lost wake cost {waited:.1f}s, beyond the waiter's poll bound"
