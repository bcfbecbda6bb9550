"""Loss handlers: leases do not wait on each other, one lease's run in order, none kills the pool.

The leases are lost the real way (their rows deleted, the manual clock moved past the
renew, the renewer ticked by hand); the handlers block on events the test controls, so
what is asserted is which handler could run while another was stuck, never how fast.
"""

from __future__ import annotations

import logging
import os
import threading
import warnings
from typing import Callable

import pytest
from manual_clock import ManualClock

import queen_sync as qs

STUCK = 5.0  # how long the test waits for something that should happen at once
HANG = 6 * STUCK  # how long a deliberately stuck handler waits for the test to free it


def lose(q: qs.Queen, clock: ManualClock, *locks: qs.Lock) -> None:
    """Lose ``locks`` at the next renew: their permits are gone from the store."""
    for lock in locks:
        q.kv.delete("queen-locks", f"{lock.name}#0")
    clock.advance(10.01)
    q.renewer.tick()
    assert all(lock.lost.is_set() for lock in locks), [repr(lock) for lock in locks]


def stuck_until(free: threading.Event, entered: threading.Event) -> Callable[[str], None]:
    def handler(reason: str) -> None:
        entered.set()
        free.wait(HANG)
    return handler


def held(q: qs.Queen, *names: str) -> list[qs.Lock]:
    locks = [q.lock(name, ttl=30) for name in names]
    assert all(lock.acquire() for lock in locks), "setup: every lease must be granted"
    return locks


class TestLeasesDoNotWaitOnEachOther:
    def test_a_stuck_handler_of_one_lease_does_not_delay_another_leases_handler(
        self, mq: qs.Queen, clock: ManualClock
    ) -> None:
        slow, other = held(mq, "slow", "other")
        free, slow_entered, other_ran = threading.Event(), threading.Event(), threading.Event()
        slow.on_lost(stuck_until(free, slow_entered))
        other.on_lost(lambda reason: other_ran.set())
        try:
            lose(mq, clock, slow)
            assert slow_entered.wait(STUCK), "the slow lease's handler never started"
            lose(mq, clock, other)
            assert other_ran.wait(STUCK), (
                "another lease's handler waited behind a stuck handler of a different lease")
            assert not free.is_set(), "the stuck handler must still be stuck here"
        finally:
            free.set()

    def test_a_jobs_interrupt_does_not_wait_for_stuck_handlers_of_other_leases(
        self, mq: qs.Queen, clock: ManualClock
    ) -> None:
        # More stuck user handlers than any pool is wide: only a lane of its own gets through.
        names = [f"cleanup-{i}" for i in range(40)]
        cleanups = held(mq, *names)
        free, entered = threading.Event(), threading.Event()
        for lock in cleanups:
            lock.on_lost(stuck_until(free, entered))
        reached_the_end = threading.Event()

        @qs.singleton_job("nightly", ttl=30, client=mq)
        def nightly() -> None:
            job = qs.current_lock()
            assert job is not None
            lose(mq, clock, *cleanups, job)
            free.wait(STUCK)  # a blocking wait the interrupt must wake
            reached_the_end.set()

        try:
            with pytest.raises(qs.LockLostError):
                nightly()
            assert not reached_the_end.is_set(), "the job body ran to its end after its loss"
            assert not free.is_set(), "the interrupt came only once the user handlers ended"
        finally:
            free.set()


class TestOneLease:
    def test_the_handlers_of_one_lease_run_one_at_a_time_in_the_order_registered(
        self, mq: qs.Queen, clock: ManualClock
    ) -> None:
        (lock,) = held(mq, "ordered")
        seen: list[int] = []
        running = threading.Lock()
        overlapped = threading.Event()
        done = threading.Event()

        def handler(index: int) -> Callable[[str], None]:
            def record(reason: str) -> None:
                if not running.acquire(blocking=False):
                    overlapped.set()
                    return
                try:
                    seen.append(index)
                finally:
                    running.release()
                if index == 49:
                    done.set()
            return record

        for index in range(50):
            lock.on_lost(handler(index))
        lose(mq, clock, lock)
        assert done.wait(STUCK), f"the last handler did not run: {seen}"
        assert not overlapped.is_set(), "two handlers of one lease ran at the same time"
        assert seen == list(range(50)), f"not in the order registered: {seen}"

    def test_a_handler_registered_after_the_loss_runs_after_the_earlier_ones(
        self, mq: qs.Queen, clock: ManualClock
    ) -> None:
        (lock,) = held(mq, "late")
        free, entered, late_ran = threading.Event(), threading.Event(), threading.Event()
        order: list[str] = []
        def first(reason: str) -> None:
            entered.set()
            free.wait(HANG)
            order.append("first")

        def late(reason: str) -> None:
            order.append("late")
            late_ran.set()

        lock.on_lost(first)
        lose(mq, clock, lock)
        assert entered.wait(STUCK), "the first handler never started"
        lock.on_lost(late)
        free.set()
        assert late_ran.wait(STUCK), "a handler registered after the loss never ran"
        assert order == ["first", "late"], f"one lease's handlers ran out of order: {order}"


class TestFailures:
    @pytest.mark.parametrize("failure", [RuntimeError("handler bug"), SystemExit(3),
                                         KeyboardInterrupt()])
    def test_a_handler_that_raises_is_logged_and_the_next_handler_of_its_lease_runs(
        self, mq: qs.Queen, clock: ManualClock, caplog: pytest.LogCaptureFixture,
        failure: BaseException
    ) -> None:
        (lock,) = held(mq, "fragile")
        after = threading.Event()

        def explode(reason: str) -> None:
            raise failure

        lock.on_lost(explode)
        lock.on_lost(lambda reason: after.set())
        with caplog.at_level(logging.ERROR, logger="queen_sync"):
            lose(mq, clock, lock)
            assert after.wait(STUCK), f"the handler after a {failure!r} never ran"
        logged = [r for r in caplog.records if r.name == "queen_sync" and r.exc_info]
        assert logged and logged[0].exc_info and logged[0].exc_info[1] is failure, (
            f"the {failure!r} was not logged under 'queen_sync' with its traceback: "
            f"{caplog.text}")


class TestClose:
    def test_close_returns_within_its_budget_while_a_handler_never_returns(
        self, sqlite_url: str, clock: ManualClock, caplog: pytest.LogCaptureFixture
    ) -> None:
        free, entered = threading.Event(), threading.Event()
        q = qs.Queen(sqlite_url, clock=clock, renew_thread=False)
        try:
            (lock,) = held(q, "forever")
            lock.on_lost(stuck_until(free, entered))
            lose(q, clock, lock)
            assert entered.wait(STUCK), "the handler never started"
            with caplog.at_level(logging.WARNING, logger="queen_sync"):
                q.close(timeout=0.2)  # a hang here is ended by the per-test timeout
            assert any("loss handler" in r.getMessage() for r in caplog.records), (
                f"close() left a handler running without saying so: {caplog.text}")
        finally:
            free.set()
            q.close()

    def test_close_lets_a_running_handler_finish_within_its_budget(
        self, sqlite_url: str, clock: ManualClock
    ) -> None:
        entered, finished = threading.Event(), threading.Event()
        q = qs.Queen(sqlite_url, clock=clock, renew_thread=False)
        (lock,) = held(q, "finishing")
        closing = threading.Event()

        def cleanup(reason: str) -> None:
            entered.set()
            closing.wait(STUCK)  # close() has begun: only its waiting lets us finish
            finished.set()

        lock.on_lost(cleanup)
        lose(q, clock, lock)
        assert entered.wait(STUCK), "the handler never started"
        threading.Timer(0.05, closing.set).start()
        q.close(timeout=STUCK)
        assert finished.is_set(), "close() returned while a loss handler was still finishing"

    def test_close_called_from_a_loss_handler_does_not_wait_for_that_handler(
        self, sqlite_url: str, clock: ManualClock
    ) -> None:
        q = qs.Queen(sqlite_url, clock=clock, renew_thread=False)
        (lock,) = held(q, "self-closing")
        closed = threading.Event()

        def close_from_inside(reason: str) -> None:
            q.close(timeout=HANG)
            closed.set()

        lock.on_lost(close_from_inside)
        lose(q, clock, lock)
        assert closed.wait(STUCK / 2), "close() inside a loss handler waited for itself"


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
class TestFork:
    def test_a_forked_child_runs_its_handlers_though_every_parent_worker_was_stuck(
        self, mq: qs.Queen, clock: ManualClock
    ) -> None:
        stuck = held(mq, *[f"parent-{i}" for i in range(12)])
        free, entered = threading.Event(), threading.Event()
        for lock in stuck:
            lock.on_lost(stuck_until(free, entered))
        try:
            lose(mq, clock, *stuck)
            assert entered.wait(STUCK), "the parent's handlers never started"
            assert child_ran_its_handler(mq, clock), (
                "a forked child's handler waited for the parent's workers, absent in it")
        finally:
            free.set()


def child_ran_its_handler(q: qs.Queen, clock: ManualClock) -> bool:
    """Fork; the child loses a lease of its own and tells whether its handler ran."""
    read_end, write_end = os.pipe()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # forking a multi-threaded process
        pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child
        ran = False
        try:
            (lock,) = held(q, "child")
            seen = threading.Event()
            lock.on_lost(lambda reason: seen.set())
            lose(q, clock, lock)
            ran = seen.wait(STUCK)
        finally:
            os.write(write_end, b"1" if ran else b"0")
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as reader:
        answer = reader.read(1)
    os.waitpid(pid, 0)
    return answer == b"1"
