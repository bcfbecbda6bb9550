"""A lease that ``close()`` gives back while a body still runs under it is lost to that body.

Once the permit is given back, another process may take it: the body running in a
``with`` block, ``run()`` or a ``@singleton_job`` must learn it as it would learn of
an expiry (``lost`` set, ``on_lost`` handlers called, ``check()`` raising, the job's
interrupt), not carry on as the holder. A lease held outside any block is given back
as the caller's own intent, and called lost by nobody.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from polling import wait_for

import queen_sync as qs


def held_by_anyone(url: str, name: str) -> bool:
    with qs.Queen(url) as observer:
        return bool(observer.locks.get(name)["held"])


def close_soon(client: qs.Queen, after: float) -> threading.Thread:
    def close_later() -> None:
        time.sleep(after)
        client.close()

    closer = threading.Thread(target=close_later, daemon=True)
    closer.start()
    return closer


def lock_telling_its_losses(url: str, name: str) -> tuple[qs.Queen, qs.Lock, list[str]]:
    """A new client, its lock ``name`` (ttl 30 s), and the reasons its on_lost handler gets."""
    client = qs.Queen(url)
    lock = client.lock(name, ttl=30)
    reasons: list[str] = []
    lock.on_lost(reasons.append)
    return client, lock, reasons


class TestABlockRunningWhenCloseGivesItsLeaseBack:
    def test_the_block_sees_its_lease_lost_as_closed_before_anyone_else_can_take_it(
            self, engine_url: str) -> None:
        client, lock, reasons = lock_telling_its_losses(engine_url, "closed-under-a-block")
        inside, leave = threading.Event(), threading.Event()
        seen_when_free: list[bool] = []

        def body() -> None:
            with lock:
                inside.set()
                leave.wait(10)

        runner = threading.Thread(target=body, daemon=True)
        runner.start()
        assert inside.wait(10), "the block never started"
        client.close()
        seen_when_free.append(lock.lost.is_set())
        assert not held_by_anyone(engine_url, lock.name), "close() did not give the lease back"
        assert seen_when_free == [True], "the block was not told before close() returned"
        assert lock.lost_reason == "closed"
        wait_for(lambda: reasons == ["closed"], what="the on_lost handler to be called")
        with pytest.raises(qs.LockLostError) as raised:
            lock.check()
        assert raised.value.reason == "closed"
        leave.set()
        runner.join(10)
        assert not runner.is_alive()

    def test_a_run_body_checking_its_lease_stops_with_lock_lost_error(
            self, engine_url: str) -> None:
        client = qs.Queen(engine_url)
        lock = client.lock("closed-under-run", ttl=30)
        steps: list[int] = []

        def work() -> None:
            for step in range(500):
                lock.check()
                steps.append(step)
                time.sleep(0.01)

        closer = close_soon(client, 0.2)
        with pytest.raises(qs.LockLostError):
            lock.run(work)
        closer.join(10)
        assert 0 < len(steps) < 500, f"the body ran {len(steps)} steps"

    def test_a_lease_held_outside_any_block_is_given_back_without_being_called_lost(
            self, engine_url: str) -> None:
        client, lock, reasons = lock_telling_its_losses(engine_url, "closed-outside-a-block")
        assert lock.acquire()
        client.close()
        assert not held_by_anyone(engine_url, lock.name)
        assert not lock.lost.is_set() and reasons == []


class TestASingletonJobRunningWhenItsClientCloses:
    def test_the_job_is_interrupted_with_lock_lost_error(self, sqlite_url: str) -> None:
        client = qs.Queen(sqlite_url)
        ran: list[Any] = []

        @qs.singleton_job("closed-under-a-job", ttl="30s", client=client)
        def job() -> str:
            for step in range(500):
                ran.append(step)
                time.sleep(0.01)
            return "finished as if it held the lease"

        closer = close_soon(client, 0.2)
        with pytest.raises(qs.LockLostError):
            job()
        closer.join(10)
        assert 0 < len(ran) < 500, f"the job ran {len(ran)} steps"
