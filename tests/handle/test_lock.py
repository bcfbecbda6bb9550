"""The Lock handle: held as a belief with a deadline, run/with, guard/check, release."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from manual_clock import ManualClock

import queen_sync as qs


class TestHeld:
    def test_creating_a_handle_sends_nothing(self, mq: qs.Queen) -> None:
        lock = mq.lock("job", ttl=30)
        assert not lock.held and lock.token is None and lock.slot is None
        assert not mq.locks.get("job"), "a handle must not acquire by being created"

    def test_held_is_a_belief_with_a_local_deadline(self, mq: qs.Queen,
                                                    clock: ManualClock) -> None:
        lock = mq.lock("job", ttl=30)
        assert lock.acquire()
        clock.advance(12)
        assert lock.held and lock.remaining == pytest.approx(18), repr(lock)
        clock.advance(18.01)  # no renew happened
        assert not lock.held and lock.token is None, "past the deadline it is not held"
        assert lock.remaining == 0
        with pytest.raises(qs.LockLostError) as caught:
            lock.check()
        assert caught.value.reason == "expired", repr(caught.value)
        with pytest.raises(qs.LockNotHeldError):
            lock.guard()

    def test_acquire_on_a_held_handle_is_true_without_a_second_permit(self,
                                                                       mq: qs.Queen) -> None:
        lock = mq.lock("pool", ttl=30)
        assert lock.acquire() and lock.acquire()
        assert len(mq.locks.get("pool")["holders"]) == 1

    def test_a_manual_renew_mints_a_new_token(self, mq: qs.Queen) -> None:
        lock = mq.lock("job", ttl=30, auto_renew=False)
        assert lock.acquire()
        first = lock.token
        assert lock.renew() and lock.token is not None and lock.token > first  # type: ignore[operator]
        mq.kv.delete("queen-locks", "job#0")
        assert not lock.renew(), "renewing a deleted permit must fail"
        assert lock.lost.is_set() and lock.lost_reason == "renew"

    def test_a_release_is_not_a_loss(self, mq: qs.Queen) -> None:
        lock = mq.lock("job", ttl=30)
        called: list[str] = []
        lock.on_lost(called.append)
        assert lock.acquire() and lock.release()
        assert not lock.lost.is_set() and not called, "release must not report a loss"
        assert not lock.release(), "a second release has nothing to give back"

    def test_semaphore_handles_each_take_one_permit(self, mq: qs.Queen) -> None:
        handles = [mq.semaphore("pool", 2, ttl=30) for _ in range(3)]
        took = [h.acquire() for h in handles]
        assert took == [True, True, False], took
        assert sorted(h.slot for h in handles[:2]) == [0, 1]  # type: ignore[type-var]
        assert [h.owner for h in handles[2].holders] == [handles[0].owner, handles[1].owner]


class TestRunAndWith:
    def test_run_acquires_calls_and_releases(self, mq: qs.Queen) -> None:
        lock = mq.lock("job", ttl=30)
        seen: list[Any] = []

        def add(x: int, y: int = 0) -> int:
            seen.append(qs.current_lock())
            return x + y

        result = lock.run(add, 2, y=3)
        assert result.acquired and result.value == 5 and result["acquired"] is True, result
        assert seen == [lock], "current_lock() must be the running lock"
        assert qs.current_lock() is None, "current_lock() must be reset after run"
        assert not lock.held and not mq.locks.get("job"), "run must release"

    def test_run_releases_when_the_function_raises(self, mq: qs.Queen) -> None:
        lock = mq.lock("job", ttl=30)

        def fail() -> None:
            raise KeyError("boom")

        with pytest.raises(KeyError):
            lock.run(fail)
        assert not mq.locks.get("job"), "run must release on an exception"

    def test_run_on_a_busy_lock_does_not_call_and_reports_holders(self, mq: qs.Queen) -> None:
        holder = mq.lock("job", ttl=30)
        assert holder.acquire()
        result = mq.lock("job", ttl=30).run(pytest.fail, "must not run")
        assert not result and not result.acquired and result.value is None, result
        assert [h.owner for h in result.holders] == [holder.owner], result

    def test_with_raises_lock_not_held_carrying_the_holders(self, mq: qs.Queen) -> None:
        holder = mq.lock("job", ttl=30)
        assert holder.acquire()
        with pytest.raises(qs.LockNotHeldError) as caught, mq.lock("job", ttl=30):
            pytest.fail("the block must not run")
        assert caught.value.name == "job"
        assert [h.owner for h in caught.value.holders] == [holder.owner], repr(caught.value)
        assert holder.owner in str(caught.value), str(caught.value)

    def test_with_releases_on_an_exception_and_sets_current_lock(self, mq: qs.Queen) -> None:
        lock = mq.lock("job", ttl=30)
        with pytest.raises(ZeroDivisionError), lock:
            assert qs.current_lock() is lock
            _ = 1 / 0
        assert qs.current_lock() is None and not mq.locks.get("job")


class TestWaiting:
    @pytest.mark.realtime
    def test_a_waiter_is_woken_by_the_release_not_a_poll_period(self, sqlite_url: str) -> None:
        with qs.Queen(sqlite_url) as q:
            holder = q.lock("job", ttl=30)
            assert holder.acquire()
            waiter = q.lock("job", ttl=30)
            for _ in range(8):
                assert not waiter.acquire(wait=0.02)  # grow its backoff towards a second
            got: list[float] = []
            thread = threading.Thread(target=lambda: got.append(
                time.monotonic() if waiter.acquire(wait=5) else -1.0))
            thread.start()
            time.sleep(0.3)
            released = time.monotonic()
            holder.release()
            thread.join(5)
            assert got and got[0] > 0, "the waiter never got the lock"
            assert got[0] - released < 0.15, f"hand-off took {got[0] - released:.3f}s"

    @pytest.mark.realtime
    def test_a_waiter_takes_over_at_the_holders_expiry(self, sqlite_url: str) -> None:
        with qs.Queen(sqlite_url) as q:
            assert q.locks.acquire("job", ttl_seconds=1, owner="crashed")
            started = time.monotonic()
            assert q.lock("job", ttl=30).acquire(wait=3)
            took = time.monotonic() - started
            assert 0.8 < took < 1.3, f"takeover at expiry took {took:.3f}s"

    def test_a_wait_that_runs_out_returns_false(self, sqlite_url: str) -> None:
        with qs.Queen(sqlite_url) as q:
            assert q.lock("job", ttl=30).acquire()
            started = time.monotonic()
            assert not q.lock("job", ttl=30).acquire(wait="150ms")
            assert 0.14 < time.monotonic() - started < 1.0


class TestRepr:
    def test_repr_names_the_lock_state_and_owner(self, mq: qs.Queen) -> None:
        lock = mq.lock("job", ttl=30, owner="me")
        assert "not held" in repr(lock) and "'job'" in repr(lock)
        lock.acquire()
        text = repr(lock)
        assert "held" in text and f"token={lock.token}" in text and "me" in text, text
