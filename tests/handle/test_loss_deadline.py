"""Loss is signalled AT the local deadline, whatever an engine call is doing at the time."""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
import time
from typing import Any

import pytest
from manual_clock import ManualClock

import queen_sync as qs
from queen_sync.testing import FaultyEngine, LocalBroker

TTL = 1.5
MARGIN = 0.35  # how late after the local deadline the loss may be reported


class LossWatch:
    """Records when ``lost`` was set and when the on_lost handler ran, on the real clock."""

    def __init__(self, lock: qs.Lock) -> None:
        self.lock = lock
        self.handled = threading.Event()
        self.handled_at = 0.0
        lock.on_lost(self._handler)

    def _handler(self, reason: str) -> None:
        self.handled_at = time.monotonic()
        self.handled.set()

    def deadline(self) -> float:
        return self.lock.deadline  # the real clock: no clock is injected in these tests

    def assert_on_time(self, deadline: float, still_blocked: threading.Event) -> None:
        assert self.lock.lost.wait(deadline - time.monotonic() + MARGIN), (
            f"lost not set within {MARGIN}s of the deadline: {self.lock!r}")
        assert self.handled.wait(MARGIN), "the on_lost handler did not run on time"
        assert self.handled_at - deadline < MARGIN, (
            f"on_lost ran {self.handled_at - deadline:.3f}s after the deadline")
        assert self.lock.lost_reason == "expired", self.lock.lost_reason
        assert not still_blocked.is_set(), "the engine call returned before the loss: no test"


def hold_write_lock(path: str, seconds: float) -> subprocess.Popen[str]:
    """Another real process holds the SQLite file's write lock for ``seconds``."""
    script = ("import sqlite3, sys, time\n"
              "c = sqlite3.connect(sys.argv[1], isolation_level=None)\n"
              "c.execute('BEGIN IMMEDIATE'); print('locked', flush=True)\n"
              "time.sleep(float(sys.argv[2])); c.execute('COMMIT')\n")
    proc = subprocess.Popen([sys.executable, "-c", script, path, str(seconds)],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "locked"
    return proc


def finish(proc: subprocess.Popen[str]) -> None:
    proc.wait(10)
    assert proc.stdout is not None
    proc.stdout.close()


class TestAtTheDeadline:
    @pytest.mark.realtime
    def test_a_renew_stalled_at_the_broker_is_reported_lost_at_the_deadline(
        self, broker: LocalBroker
    ) -> None:
        engine = FaultyEngine(broker.url, timeout=10)
        with qs.Queen(engine=engine) as q:
            lock = q.lock("job", ttl=TTL)
            assert lock.acquire()
            watch = LossWatch(lock)
            broker.faults.delay_next(seconds=3.0, route="locks")
            answered = threading.Event()
            engine.hook_next(None, hook=lambda route, body: answered.set(), applied=True)
            watch.assert_on_time(watch.deadline(), answered)
            assert answered.wait(4), "the stalled renew never came back"
            time.sleep(0.1)
            assert lock.lost.is_set() and not lock.held, f"a late answer revived it: {lock!r}"

    @pytest.mark.realtime
    def test_a_renew_waiting_on_a_locked_sqlite_file_is_reported_lost_at_the_deadline(
        self, tmp_path: Any
    ) -> None:
        path = str(tmp_path / "queen.db")
        with qs.Queen("sqlite://" + path) as q:
            lock = q.lock("job", ttl=TTL, renew_every=0.35)
            assert lock.acquire()
            watch = LossWatch(lock)
            deadline = watch.deadline()
            holder = hold_write_lock(path, 3.0)
            try:
                watch.assert_on_time(deadline, threading.Event())
                assert holder.poll() is None, "the writer let go before the loss: no test"
            finally:
                finish(holder)
            time.sleep(0.5)
            assert lock.lost.is_set() and not lock.held, f"a late answer revived it: {lock!r}"

    @pytest.mark.realtime
    def test_a_manual_renew_stalled_in_the_engine_does_not_delay_the_loss_or_spin(
        self, tmp_path: Any
    ) -> None:
        path = str(tmp_path / "queen.db")
        with qs.Queen("sqlite://" + path) as q:
            lock = q.lock("job", ttl=TTL, renew_every=0.35)
            assert lock.acquire()
            watch = LossWatch(lock)
            deadline = watch.deadline()
            holder = hold_write_lock(path, 2.5)
            done = threading.Event()

            def renew_then_done() -> None:
                lock.renew()
                done.set()

            manual = threading.Thread(target=renew_then_done)
            ticks = q.renewer.ticks
            try:
                manual.start()
                watch.assert_on_time(deadline, done)
                ticks = q.renewer.ticks - ticks
            finally:
                finish(holder)
                manual.join(10)
            assert ticks < 40, f"the renewer spun {ticks} ticks while a manual renew waited"
            assert lock.lost.is_set() and not lock.held, f"the manual renew revived it: {lock!r}"

    @pytest.mark.realtime
    def test_a_release_waiting_for_a_stalled_renew_does_not_delay_the_loss(
        self, broker: LocalBroker
    ) -> None:
        with qs.Queen(broker.url, timeout=10) as q:
            lock = q.lock("job", ttl=TTL)
            assert lock.acquire()
            watch = LossWatch(lock)
            deadline = watch.deadline()
            broker.faults.delay_next(seconds=2.5, route="locks")
            time.sleep(TTL / 3 + 0.2)  # the renew is in flight now
            released = threading.Event()

            def release_then_done() -> None:
                lock.release()
                released.set()

            releaser = threading.Thread(target=release_then_done)
            releaser.start()
            watch.assert_on_time(deadline, released)
            releaser.join(5)
            assert released.is_set(), "release never returned"
            assert not q.locks.get("job"), "the permit renewed late was not given back"


class TestManualClock:
    def test_a_late_renew_answer_does_not_revive_a_lease_past_its_deadline(
        self, sqlite_url: str, clock: ManualClock
    ) -> None:
        engine = FaultyEngine(sqlite_url)
        with qs.Queen(engine=engine, clock=clock, renew_thread=False) as q:
            lock = q.lock("job", ttl=30)
            assert lock.acquire()

            def slow(route: str, body: Any) -> None:
                clock.advance(25)  # the call takes past the deadline

            clock.advance(10.01)
            engine.hook_next(None, hook=slow)
            q.renewer.tick()
            assert lock.lost.is_set() and lock.lost_reason == "expired", repr(lock)
            assert not lock.held
            engine.clear()
            assert not q.locks.get("job"), "the late-renewed permit was not given back"


class TestFailuresThatEndIt:
    def test_a_replaced_store_marks_every_lease_of_the_call_lost_at_once(
        self, sqlite_url: str, clock: ManualClock, caplog: pytest.LogCaptureFixture
    ) -> None:
        engine = FaultyEngine(sqlite_url)
        with qs.Queen(engine=engine, clock=clock, renew_thread=False) as q:
            locks = [q.lock(f"job-{i}", ttl=30) for i in range(3)]
            assert all(lock.acquire() for lock in locks)
            engine.fail_next(None, error=qs.StoreReplacedError(
                "the store file was replaced (simulated)", path="x.db"))
            clock.advance(10.01)
            with caplog.at_level(logging.ERROR, logger="queen_sync"):
                q.renewer.tick()
            assert all(lock.lost_reason == "renew" for lock in locks), [repr(x) for x in locks]
            assert any("replaced" in r.getMessage() for r in caplog.records), caplog.text

    def test_an_on_lost_handler_raising_system_exit_does_not_stop_later_handlers(
        self, sqlite_url: str, clock: ManualClock
    ) -> None:
        with qs.Queen(sqlite_url, clock=clock, renew_thread=False) as q:
            first, second = q.lock("first", ttl=30), q.lock("second", ttl=30)
            assert first.acquire() and second.acquire()
            ran = threading.Event()
            first.on_lost(lambda reason: sys.exit(3))
            second.on_lost(lambda reason: ran.set())
            q.kv.delete("queen-locks", "first#0")
            clock.advance(10.01)
            q.renewer.tick()
            time.sleep(0.1)
            q.kv.delete("queen-locks", "second#0")
            clock.advance(10.01)
            q.renewer.tick()
            assert ran.wait(2), "the handler dispatcher died with the SystemExit"

    @pytest.mark.realtime
    def test_the_renewer_survives_a_system_exit_inside_a_tick(
        self, sqlite_url: str, caplog: pytest.LogCaptureFixture
    ) -> None:
        with qs.Queen(sqlite_url) as q:
            lock = q.lock("job", ttl=1, renew_every=0.35)
            assert lock.acquire()
            first = lock.token
            real = lock.renew_op
            failures = iter([True])

            def exits() -> Any:
                if next(failures, False):
                    raise SystemExit(2)
                return real()

            lock.renew_op = exits  # type: ignore[method-assign]
            with caplog.at_level(logging.ERROR, logger="queen_sync"):
                time.sleep(0.9)
            assert any("renewer tick failed" in r.message for r in caplog.records), caplog.text
            assert lock.held and lock.token != first, "the renewer died with the SystemExit"
