"""A leader election's life: start and stop in any order, failures of its thread, a close."""

from __future__ import annotations

import secrets
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any, Optional

import pytest
from counting_engine import CountingEngine

import queen_sync as qs
from queen_sync.recipes.leader_election import Leader, LeaderElection, LeaderObserver
from queen_sync.testing import FaultyEngine


def _fresh_name() -> str:
    return f"election-{secrets.token_hex(4)}"


@contextmanager
def campaign_threads_start_late(seconds: float) -> Iterator[None]:
    """Hold each campaign thread started meanwhile for ``seconds`` before its first call."""

    def hook(frame: FrameType, event: str, arg: Any) -> None:
        sys.settrace(None)  # this thread's first call only
        if threading.current_thread().name.startswith("leader-election-"):
            time.sleep(seconds)

    threading.settrace(hook)
    try:
        yield
    finally:
        threading.settrace(None)


class TestAStopRightAfterStart:
    def test_ends_the_campaign_even_before_its_thread_got_going(self, client: qs.Queen) -> None:
        name = _fresh_name()
        election = LeaderElection(client, name, ttl=30)
        with campaign_threads_start_late(0.1):
            election.start()
            election.stop(timeout=2)
        thread: Optional[threading.Thread] = election._thread
        alive = thread is not None and thread.is_alive()
        holders = client.locks.get(name).get("holders") or []
        election.stop(timeout=5)  # ends it, if the first stop was lost

        assert not alive, "the campaign went on after stop()"
        assert not holders, f"a stopped candidate holds the election: {holders}"

    def test_a_start_after_the_stop_campaigns_again(self, client: qs.Queen) -> None:
        election = LeaderElection(client, _fresh_name(), ttl=3)
        election.start()
        election.stop()
        election.start()
        elected = election.wait_elected(5)  # after the cooldown of one renew interval (1 s)
        election.stop()

        assert elected, "a start() after stop() did not campaign"


class TestACampaignWhoseAcquireRaisesAnErrorQueenSyncDoesNotKnow:
    def test_logs_it_with_its_traceback_keeps_campaigning_and_is_elected_once_it_passes(
            self, sqlite_faults: FaultyEngine, caplog: pytest.LogCaptureFixture) -> None:
        with qs.Queen(engine=sqlite_faults) as q:
            sqlite_faults.fail_next(3, error=RuntimeError("boom"), route="locks", op="acquire")
            election = LeaderElection(q, _fresh_name(), ttl=1).start()
            elected = election.wait_elected(5)
            campaigning = election.health().campaigning
            election.stop()

        told = [r for r in caplog.records if r.name.startswith("queen_sync")
                and "boom" in r.getMessage() + str(r.exc_info and r.exc_info[1])]
        tracebacks = [r for r in told if r.exc_info]
        assert elected and campaigning, "the campaign died on the error instead of retrying"
        assert len(tracebacks) == 1, (
            f"the first failure was not logged once with its traceback: "
            f"{[(r.levelname, r.getMessage()) for r in told]}")
        assert len(told) == 3, f"not each of 3 failures was told: {[r.getMessage() for r in told]}"

    def test_health_reports_it_while_it_lasts(self, sqlite_faults: FaultyEngine) -> None:
        with qs.Queen(engine=sqlite_faults) as q:
            sqlite_faults.fail_next(None, error=RuntimeError("boom"), route="locks",
                                    op="acquire")
            election = LeaderElection(q, _fresh_name(), ttl=1).start()
            deadline = time.monotonic() + 5
            while election.health().last_error is None and time.monotonic() < deadline:
                time.sleep(0.01)
            health = election.health()
            sqlite_faults.clear()
            elected = election.wait_elected(5)
            election.stop()

        assert health.campaigning, "the campaign thread died on the error"
        assert health.last_error is not None and "boom" in health.last_error, (
            f"health does not say what keeps the campaign from winning: {health}")
        assert elected, "the campaign was not elected once the error passed"


class TestWaitingForALeaderWithAStoppedObserver:
    def test_returns_after_one_read_instead_of_polling_until_the_timeout(
            self, sqlite_url: str) -> None:
        engine = CountingEngine(sqlite_url)
        with qs.Queen(engine=engine) as q:
            observer = LeaderObserver(q, _fresh_name(), every=1).start()
            observer.stop()
            started = time.monotonic()
            seen, calls, _ = engine.measure(lambda: observer.wait_for_leader(timeout=5))
            took = time.monotonic() - started

        assert seen is None, f"a leader was seen where there is none: {seen}"
        assert took < 1 and calls <= 1, (
            f"the stopped observer waited {took:.2f}s and read the lock {calls} times")

    def test_a_wait_under_way_when_stop_is_called_returns_at_once(
            self, client: qs.Queen) -> None:
        observer = LeaderObserver(client, _fresh_name(), every=10).start()
        answers: list[Optional[Leader]] = []
        waiter = threading.Thread(target=lambda: answers.append(
            observer.wait_for_leader(timeout=30)))
        waiter.start()
        time.sleep(0.1)
        stopped_at = time.monotonic()
        observer.stop()
        waiter.join(5)
        took = time.monotonic() - stopped_at

        assert not waiter.is_alive() and answers == [None], (
            f"the wait did not end with stop(): {answers}")
        assert took < 1, f"the wait ended {took:.2f}s after stop()"

    def test_still_reports_a_leader_that_is_there(self, client: qs.Queen) -> None:
        name = _fresh_name()
        election = LeaderElection(client, name, ttl=30, identity="node-a").start()
        assert election.wait_elected(5), "never elected"
        observer = LeaderObserver(client, name, every=1).start()
        observer.stop()
        seen = observer.wait_for_leader(timeout=5)
        election.stop()

        assert seen is not None and seen.identity == "node-a", f"the leader was not seen: {seen}"


class TestClosingTheClientOfALeader:
    def test_deposes_it_at_once_for_the_reason_closed_and_ends_the_campaign(
            self, sqlite_url: str) -> None:
        deposed: list[tuple[str, float]] = []
        q = qs.Queen(sqlite_url)
        election = LeaderElection(
            q, _fresh_name(), ttl=30,
            on_deposed=lambda reason: deposed.append((reason, time.monotonic()))).start()
        assert election.wait_elected(5), "never elected"
        closed_at = time.monotonic()
        q.close()
        thread = election._thread
        assert thread is not None
        thread.join(3)  # the lease would have lasted 30 s: anything near that is late
        told = list(deposed)
        election.stop()

        assert [reason for reason, _ in told] == ["closed"], (
            f"on_deposed was told {told} within 3 s of the close")
        late = told[0][1] - closed_at
        assert late < 1, f"on_deposed came {late:.2f}s after the close"
        assert not thread.is_alive(), "the campaign goes on after its client closed"
        assert not election.is_leader and election.health().terms == 1, (
            f"after the close: {election.health()}")
