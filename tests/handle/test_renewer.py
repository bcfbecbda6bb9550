"""The renewer: one thread, one batched call per tick, retries until the deadline, loss reports."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import pytest
from manual_clock import ManualClock

import queen_sync as qs
from queen_sync.testing import FaultyEngine


def lost_event(lock: qs.Lock) -> threading.Event:
    seen = threading.Event()
    lock.on_lost(lambda reason: seen.set())
    return seen


class TestSchedule:
    def test_a_lease_is_renewed_at_a_third_of_its_lifetime(self, mq: qs.Queen,
                                                           clock: ManualClock) -> None:
        lock = mq.lock("job", ttl=30)
        assert lock.acquire()
        first = lock.token
        assert first is not None
        clock.advance(9.9)
        mq.renewer.tick()
        assert lock.token == first, "renewed too early"
        clock.advance(0.2)
        mq.renewer.tick()
        assert lock.token is not None and lock.token > first, "not renewed at ttl/3"
        assert lock.remaining == pytest.approx(30, abs=0.01), "deadline counts from the send"

    def test_renew_every_overrides_the_third(self, mq: qs.Queen, clock: ManualClock) -> None:
        lock = mq.lock("job", ttl=30, renew_every="2s")
        assert lock.acquire()
        first = lock.token
        clock.advance(2.01)
        mq.renewer.tick()
        assert lock.token != first, "renew_every=2s was not honoured"

    def test_every_due_lease_is_renewed_in_one_batched_call(self, mq: qs.Queen,
                                                            clock: ManualClock) -> None:
        locks = [mq.lock(f"job-{i}", ttl=30) for i in range(200)]
        assert all(lock.acquire() for lock in locks)
        before = {lock.name: lock.token for lock in locks}
        calls = mq.renewer.calls
        clock.advance(10.5)
        mq.renewer.tick()
        assert mq.renewer.calls == calls + 1, "200 due leases must take ONE engine call"
        assert all(lock.token != before[lock.name] for lock in locks), "some lease not renewed"

    def test_a_lease_that_is_not_auto_renewed_still_expires_locally(self, mq: qs.Queen,
                                                                     clock: ManualClock) -> None:
        lock = mq.lock("job", ttl=5, auto_renew=False)
        assert lock.acquire()
        first = lock.token
        clock.advance(4)
        mq.renewer.tick()
        assert lock.token == first, "auto_renew=False must not renew"
        clock.advance(1.01)
        mq.renewer.tick()
        assert lock.lost.is_set() and lock.lost_reason == "expired", repr(lock)


class TestFailures:
    def test_a_failed_renew_is_retried_sooner_until_the_deadline_then_expired(
        self, faulty_mq: qs.Queen, sqlite_faults: FaultyEngine, clock: ManualClock
    ) -> None:
        mq = faulty_mq
        lock = mq.lock("job", ttl=30)
        assert lock.acquire()
        seen = lost_event(lock)
        sqlite_faults.fail_next(None)  # the engine is unreachable from now on
        clock.advance(10.01)
        delay = mq.renewer.tick()
        assert not lock.lost.is_set(), "could not ask is not a loss"
        assert 0 < delay < 10, f"a failed renew must be retried sooner, got {delay}s"
        attempts = 0
        while not lock.lost.is_set() and attempts < 50:
            clock.advance(max(delay, 0.05))
            delay = mq.renewer.tick()
            attempts += 1
        assert lock.lost_reason == "expired", f"expected expiry, got {lock!r}"
        assert clock.now - 1000 >= 30, "lost before the local deadline"
        assert attempts > 2, f"expected several retries before the deadline, got {attempts}"
        assert seen.wait(2), "on_lost was not called"
        assert mq.metrics.snapshot()["counts"]["lost_expired"] == 1

    def test_an_outage_shorter_than_the_lifetime_keeps_the_lease(
            self, faulty_mq: qs.Queen, sqlite_faults: FaultyEngine, clock: ManualClock) -> None:
        mq = faulty_mq
        lock = mq.lock("job", ttl=30)
        assert lock.acquire()
        sqlite_faults.fail_next(None)  # the engine is unreachable until clear()
        for _ in range(4):
            clock.advance(5)
            mq.renewer.tick()
        sqlite_faults.clear()
        clock.advance(1)
        mq.renewer.tick()
        assert lock.held and not lock.lost.is_set(), repr(lock)
        assert mq.metrics.snapshot()["counts"]["renew_error"] >= 1

    def test_a_lock_whose_row_is_deleted_behind_its_back_is_reported_lost(
        self, mq: qs.Queen, clock: ManualClock
    ) -> None:
        lock = mq.lock("job", ttl=30)
        assert lock.acquire()
        seen = lost_event(lock)
        assert mq.kv.delete("queen-locks", "job#0")
        clock.advance(10.01)
        mq.renewer.tick()
        assert lock.lost_reason == "renew" and not lock.held, repr(lock)
        assert seen.wait(2), "on_lost was not called"
        with pytest.raises(qs.LockLostError) as caught:
            lock.check()
        assert caught.value.reason == "renew", repr(caught.value)

    def test_an_on_lost_handler_that_raises_does_not_stop_the_others(
        self, mq: qs.Queen, clock: ManualClock, caplog: pytest.LogCaptureFixture
    ) -> None:
        doomed, kept = mq.lock("doomed", ttl=30), mq.lock("kept", ttl=30)
        assert doomed.acquire() and kept.acquire()
        ran = threading.Event()

        def explode(reason: str) -> None:
            ran.set()
            raise RuntimeError("handler bug")

        doomed.on_lost(explode)
        mq.kv.delete("queen-locks", "doomed#0")
        with caplog.at_level(logging.ERROR, logger="queen_sync"):
            clock.advance(10.01)
            mq.renewer.tick()
            assert ran.wait(2), "the handler did not run"
            time.sleep(0.1)
        assert any("on_lost handler raised" in r.message for r in caplog.records), caplog.text
        token = kept.token
        clock.advance(10.01)
        mq.renewer.tick()
        assert kept.held and kept.token != token, "renewal of the others stopped"

    def test_on_lost_handlers_run_off_the_renewing_thread(self, mq: qs.Queen,
                                                          clock: ManualClock) -> None:
        lock = mq.lock("job", ttl=30)
        assert lock.acquire()
        where: list[threading.Thread] = []
        done = threading.Event()

        def note_thread(reason: str) -> None:
            where.append(threading.current_thread())
            done.set()

        lock.on_lost(note_thread)
        mq.kv.delete("queen-locks", "job#0")
        clock.advance(10.01)
        mq.renewer.tick()
        assert done.wait(2), "handler not called"
        assert where[0] is not threading.current_thread(), "handler ran on the renewing thread"


class TestThread:
    def test_one_renewer_thread_serves_200_held_leases(self, sqlite_url: str) -> None:
        before = set(threading.enumerate())  # a set: a thread of an earlier test may end now
        with qs.Queen(sqlite_url) as q:
            locks = [q.lock(f"job-{i}", ttl=30) for i in range(200)]
            assert all(lock.acquire() for lock in locks)
            extra = [t.name for t in set(threading.enumerate()) - before]
            assert extra == ["queen_sync-renewer"], f"expected one renewer thread, found {extra}"
            assert q.renewer.thread is not None and q.renewer.thread.daemon

    def test_the_thread_exits_when_nothing_is_held_and_comes_back(self, sqlite_url: str) -> None:
        with qs.Queen(sqlite_url) as q:
            lock = q.lock("job", ttl=30)
            assert lock.acquire()
            thread = q.renewer.thread
            assert thread is not None and thread.is_alive()
            lock.release()
            thread.join(2)
            assert not thread.is_alive(), "the renewer must exit when nothing is held"
            assert lock.acquire()
            assert q.renewer.thread is not None and q.renewer.thread.is_alive(), "not restarted"

    @pytest.mark.realtime
    def test_the_thread_renews_for_real_and_survives_an_unexpected_error(
        self, sqlite_url: str, caplog: pytest.LogCaptureFixture
    ) -> None:
        with qs.Queen(sqlite_url) as q:
            lock = q.lock("job", ttl=1, renew_every=0.35)
            assert lock.acquire()
            first = lock.token
            real = lock.renew_op
            failures = iter([True])

            def flaky() -> Any:
                if next(failures, False):
                    raise RuntimeError("bug inside a tick")
                return real()

            lock.renew_op = flaky  # type: ignore[method-assign]
            with caplog.at_level(logging.ERROR, logger="queen_sync"):
                time.sleep(0.9)
            assert any("renewer tick failed" in r.message for r in caplog.records), caplog.text
            assert lock.held and lock.token != first, "the thread died or stopped renewing"
