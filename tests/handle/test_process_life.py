"""Process life: close and interpreter exit release leases; interrupts leave nothing held."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Callable

import pytest

import queen_sync as qs
from queen_sync.testing import FaultyEngine, LocalBroker


def owners(q: qs.Queen, name: str) -> list[str]:
    return [h["owner"] for h in q.locks.get(name)["holders"]]


class TestRelease:
    def test_close_releases_every_lease_the_clients_handles_hold(self, sqlite_url: str) -> None:
        q = qs.Queen(sqlite_url)
        for i in range(3):
            assert q.lock(f"job-{i}", ttl=60).acquire()
        q.close()
        with qs.Queen(sqlite_url) as observer:
            assert all(not observer.locks.get(f"job-{i}") for i in range(3)), "close leaked"

    def test_interpreter_exit_releases_held_leases(self, engine_url: str) -> None:
        # On every engine: Python 3.12+ refuses new threads at exit, and a release path
        # that needed one would leave the lease to expire.
        script = (
            "import queen_sync as qs\n"
            f"q = qs.Queen({engine_url!r})\n"
            "lock = q.lock('job', ttl=60)\n"
            "assert lock.acquire()\n"
            "print(lock.owner, flush=True)\n"
        )
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                              timeout=60)
        assert done.returncode == 0, done.stderr
        with qs.Queen(engine_url) as observer:
            assert owners(observer, "job") == [], "a lease outlived its interpreter"


class TestInterrupts:
    def test_keyboard_interrupt_during_a_wait_propagates_promptly_and_holds_nothing(
        self, sqlite_url: str
    ) -> None:
        with qs.Queen(sqlite_url) as q:
            holder = q.lock("job", ttl=60)
            assert holder.acquire()
            waiter = q.lock("job", ttl=60)
            timer = threading.Timer(0.3, lambda: os.kill(os.getpid(), signal.SIGINT))
            started = time.monotonic()
            timer.start()
            with pytest.raises(KeyboardInterrupt):
                waiter.acquire(wait=20)
            took = time.monotonic() - started
            assert took < 1.5, f"the interrupt took {took:.2f}s to surface"
            holder.release()
            assert waiter.owner not in owners(q, "job") and not waiter.held

    def test_an_interrupt_after_the_engine_granted_gives_the_permit_back(
        self, sqlite_url: str
    ) -> None:
        engine = FaultyEngine(sqlite_url)
        with qs.Queen(engine=engine) as q:
            engine.fail_next(error=KeyboardInterrupt, op="acquire", applied=True)
            lock = q.lock("job", ttl=60)
            with pytest.raises(KeyboardInterrupt):
                lock.acquire()
            engine.clear()
            assert engine.injected["fail"] == 1 and not lock.held
            assert owners(q, "job") == [], "the granted permit was not given back"

    def test_an_interrupt_inside_a_locked_block_releases(self, sqlite_url: str) -> None:
        with qs.Queen(sqlite_url) as q:
            with pytest.raises(KeyboardInterrupt), q.lock("job", ttl=60):
                raise KeyboardInterrupt
            assert owners(q, "job") == []


class TestReleaseDuringRenew:
    def test_release_waits_for_an_in_flight_renew_and_frees_the_new_token(
        self, sqlite_url: str
    ) -> None:
        engine = FaultyEngine(sqlite_url)
        with qs.Queen(engine=engine) as q:
            lock = q.lock("job", ttl=60, auto_renew=False)
            assert lock.acquire()
            renewing = threading.Event()

            def slow(route: str, body: Any) -> None:
                renewing.set()
                time.sleep(0.2)

            engine.hook_next(None, hook=slow, op="renew")
            renew = threading.Thread(target=lock.renew)
            renew.start()
            assert renewing.wait(2)
            assert lock.release(), "release must free the token the renew minted"
            renew.join(2)
            assert owners(q, "job") == [], "a renewed permit was left behind"


class TestReleaseFailure:
    def test_a_release_that_could_not_reach_the_engine_stops_renewing_and_can_be_retried(
        self, sqlite_url: str
    ) -> None:
        engine = FaultyEngine(sqlite_url)
        with qs.Queen(engine=engine) as q:
            lock = q.lock("job", ttl=60)
            assert lock.acquire()
            engine.fail_next(None, error=qs.EngineUnavailableError("down (simulated)"))
            with pytest.raises(qs.EngineUnavailableError):
                lock.release()
            engine.clear()
            assert lock not in q.renewer.held(), "a failed release must stop renewing"
            assert not lock.held, "a release of unknown outcome must not leave the handle holding"
            assert lock.release() and owners(q, "job") == [], "the retry must give it back"

    def test_a_release_applied_but_unanswered_leaves_no_second_holder(
        self, sqlite_url: str
    ) -> None:
        engine = FaultyEngine(sqlite_url)
        with qs.Queen(engine=engine) as q, qs.Queen(sqlite_url) as other:
            lock = q.lock("job", ttl=60)
            assert lock.acquire()
            # The release commits; its answer never arrives.
            engine.fail_next(None, applied=True, error=qs.EngineUnavailableError(
                "connection lost during COMMIT (simulated)"))
            with pytest.raises(qs.EngineUnavailableError):
                lock.release()
            engine.clear()
            rival = other.lock("job", ttl=60)
            assert rival.acquire(), "setup: the release did commit, so the permit is free"
            assert not lock.acquire(), (
                "the first handle believed it still held after a release of unknown outcome: "
                "two holders")
            assert not lock.held and rival.held

    @pytest.mark.realtime
    def test_a_failed_exit_release_lets_the_lease_expire_by_itself(self) -> None:
        with LocalBroker() as broker:
            q, other = broker.client(), broker.client()
            lock = q.lock("report", ttl=1)
            with pytest.raises(qs.EngineError), lock:
                broker.faults.fail_next(20, status=503, route="locks")
            broker.faults.clear()
            assert lock not in q.renewer.held(), "nobody retries an exit: it must stop renewing"
            assert other.lock("report", ttl=1).acquire(wait=3), (
                "the lease outlived its TTL: it is still renewed after the failed exit")
            q.close()
            other.close()


def gated_client(url: str) -> tuple[qs.Queen, threading.Event, threading.Event]:
    """A client whose acquire calls, once granted, are held until ``release`` is set."""
    engine = FaultyEngine(url)
    granted, release = threading.Event(), threading.Event()

    def hold(route: str, body: Any) -> None:
        granted.set()
        release.wait(5)

    engine.hook_next(None, hook=hold, op="acquire", applied=True)
    return qs.Queen(engine=engine), granted, release


class TestCloseRace:
    def test_close_releases_a_lease_whose_acquire_was_in_flight(self, sqlite_url: str) -> None:
        q, granted, release = gated_client(sqlite_url)
        lock = q.lock("job", ttl=60)
        taking, outcome = acquiring_in_thread(lock)
        assert granted.wait(5), "setup: the acquire did not reach the engine"
        closing = threading.Thread(target=q.close)
        closing.start()
        time.sleep(0.1)  # close has begun while the acquire is still in flight
        release.set()
        closing.join(5)
        taking.join(5)
        with qs.Queen(sqlite_url) as observer:
            assert owners(observer, "job") == [], "close left an in-flight acquire's permit held"
        assert not lock.held, f"the handle still believes it holds: {lock!r}"
        assert outcome and isinstance(outcome[0], qs.QueenError), (
            f"an acquire granted as its client closed reported {outcome!r}, not 'closed'")

    def test_a_closing_client_refuses_new_acquires(self, sqlite_url: str) -> None:
        q, granted, release = gated_client(sqlite_url)
        first, second = q.lock("a", ttl=60), q.lock("b", ttl=60)
        taking = threading.Thread(target=lambda: _refused_or(first.acquire))
        taking.start()
        assert granted.wait(5)
        closing = threading.Thread(target=q.close)
        closing.start()
        time.sleep(0.1)
        with pytest.raises(qs.QueenError, match="closed"):
            second.acquire()
        release.set()
        closing.join(5)
        taking.join(5)

    @pytest.mark.realtime
    def test_close_racing_blocks_in_other_threads_leaves_nothing_held(
        self, sqlite_url: str
    ) -> None:
        probe = qs.Queen(sqlite_url)
        leaks: list[str] = []
        for run in range(8):
            q = qs.Queen(sqlite_url)
            names: list[str] = []
            threads = [threading.Thread(target=enter_until_closed, args=(q, f"{run}-{k}", names))
                       for k in range(4)]
            for thread in threads:
                thread.start()
            time.sleep(0.01 + 0.03 * run / 8)
            q.close()
            for thread in threads:
                thread.join(5)
            leaks += [name for name in names if probe.locks.get(name)["held"]]
        probe.close()
        assert not leaks, f"permits held after close() returned: {leaks[:5]}"


def acquiring_in_thread(lock: qs.Lock) -> tuple[threading.Thread, list[object]]:
    """``lock.acquire()`` started on a thread of its own; what it returned, or the
    ``QueenError`` it raised, lands in the list."""
    outcome: list[object] = []

    def take() -> None:
        try:
            outcome.append(lock.acquire())
        except qs.QueenError as exc:
            outcome.append(exc)

    thread = threading.Thread(target=take, daemon=True)
    thread.start()
    return thread, outcome


def _refused_or(acquire: Callable[[], bool]) -> None:
    """Run ``acquire`` on a client that may close meanwhile (which refuses it)."""
    with contextlib.suppress(qs.QueenError):
        acquire()


def enter_until_closed(q: qs.Queen, prefix: str, names: list[str]) -> None:
    i = 0
    while True:
        try:
            lock = q.lock(f"{prefix}-{i}", ttl=30)
            names.append(lock.name)
            i += 1
            with lock:
                time.sleep(0.001)
        except qs.QueenError:
            return
