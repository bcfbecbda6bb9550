"""The PostgreSQL engine against a server that restarts, kills sessions, and holders that stall.

Each test here has a server of its own (a restart must not disturb other tests)
and real processes where processes are the point: four fenced writers, and a
holder frozen with SIGSTOP. Workers report plain data on a queue; the test
process judges everything.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import secrets
import signal
import socket
import threading
import time
from typing import Any, Callable, Iterator

import pytest
from pg_server import PgServer, frozen, require_pg

if not require_pg():
    pytest.importorskip("psycopg")
import psycopg

import queen_sync as qs
from queen_sync._engines.postgres import storage as _postgres_storage

pytestmark = pytest.mark.timeout(60)
CTX = multiprocessing.get_context("spawn")


@pytest.fixture
def server() -> Iterator[PgServer]:
    running = PgServer.start_new()
    yield running
    running.destroy()


def wait_until(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.02)


class TestServerRestarts:
    def test_a_restart_within_the_ttl_keeps_the_lease(self, server: PgServer) -> None:
        with qs.Queen(server.url, timeout=2) as q, qs.Queen(server.url) as other:
            lock = q.lock("through-restart", ttl="6s")
            assert lock.acquire()
            first = lock.token
            server.restart()
            wait_until(lambda: lock.token != first, 5.0, "the lease is renewed after the restart")
            assert lock.held and not lock.lost.is_set(), lock
            holders = other.locks.get("through-restart")["holders"]
            assert [(h["owner"], h["token"]) for h in holders] == [(lock.owner, lock.token)], (
                holders)

    def test_a_restart_longer_than_the_ttl_reports_expiry_and_the_next_token_is_higher(
            self, server: PgServer) -> None:
        reasons: list[str] = []
        with qs.Queen(server.url, timeout=1) as q:
            lock = q.lock("outlived", ttl="2s").on_lost(reasons.append)
            assert lock.acquire()
            first = lock.token
            assert first is not None
            server.stop()
            wait_until(lambda: bool(reasons), 5.0, "the loss is reported")
            server.start()
            assert reasons == ["expired"] and not lock.held, (reasons, lock)
            with qs.Queen(server.url) as other:
                successor = other.lock("outlived", ttl="30s")
                assert successor.acquire(wait=5), successor.holders
                assert successor.token is not None and successor.token > first, (
                    first, successor.token)
                successor.release()

    def test_a_terminated_backend_is_replaced_without_a_second_holder(
            self, server: PgServer) -> None:
        app = "victim_" + secrets.token_hex(4)
        with qs.Queen(f"{server.url}?application_name={app}") as q, qs.Queen(server.url) as b:
            lock = q.lock("terminated", ttl="30s")
            assert lock.acquire()
            assert server.terminate_backends(app) >= 1, "no session of the client to end"
            holders = q.locks.get("terminated")["holders"]
            assert [h["owner"] for h in holders] == [lock.owner], holders
            rival = b.lock("terminated", ttl="30s")
            assert not rival.acquire(), "a second holder while the first still holds"
            assert lock.release(), "the holder could not release after reconnecting"
            assert rival.acquire(), rival.holders
            rival.release()


def fenced_increments(url: str, rounds: int, stall: str, results: Any) -> None:
    """Increment a user-table counter ``rounds`` times under the lock, fenced.

    The read is a plain SELECT, so only the fence keeps a stalled holder's write from
    overwriting a successor's. ``stall`` makes the first round sleep past the TTL
    before (``before``) or after (``after``) fencing. Reports (committed, fenced out).
    """
    committed = fenced = 0
    with qs.Queen(url) as q, psycopg.connect(url.split("?")[0]) as conn:
        lock = q.lock("counter", ttl="1s", auto_renew=False)
        for round_ in range(rounds):
            if not lock.acquire(wait=20):
                continue
            try:
                with conn.transaction():
                    if round_ == 0 and stall == "before":
                        time.sleep(1.3)
                    lock.fence(conn)
                    row = conn.execute("SELECT n FROM counter WHERE id = 1").fetchone()
                    assert row is not None, "the counter row is made before the rounds"
                    if round_ == 0 and stall == "after":
                        time.sleep(1.3)
                    conn.execute("UPDATE counter SET n = %s WHERE id = 1", (row[0] + 1,))
                committed += 1
            except qs.LockError:
                fenced += 1
            finally:
                lock.release()
    results.put((committed, fenced))


def stopped_holder(url: str, go: Any, results: Any) -> None:
    """Hold the lock, report, wait for ``go`` (meanwhile frozen), then try a fenced write."""
    with qs.Queen(url, timeout=2) as q, psycopg.connect(url.split("?")[0]) as conn:
        lock = q.lock("frozen", ttl="1s")
        lock.acquire()
        results.put(("held", lock.token))
        go.wait(30)
        try:
            with conn.transaction():
                lock.fence(conn)
                conn.execute("UPDATE owner SET who = 'stopped holder' WHERE id = 1")
            results.put(("committed", None))
        except qs.LockError as exc:
            results.put(("fenced out", type(exc).__name__))


class TestProcesses:
    def test_four_processes_fencing_updates_of_a_user_table_lose_none(
            self, server: PgServer) -> None:
        with psycopg.connect(server.url, autocommit=True) as admin:
            admin.execute("CREATE TABLE counter (id int PRIMARY KEY, n int NOT NULL)")
            admin.execute("INSERT INTO counter VALUES (1, 0)")
        results = CTX.Queue()
        stalls = ["before", "after", "none", "none"]
        procs = [CTX.Process(target=fenced_increments, args=(server.url, 6, stall, results))
                 for stall in stalls]
        for proc in procs:
            proc.start()
        reports = [results.get(timeout=50) for _ in procs]
        for proc in procs:
            proc.join(10)
        with psycopg.connect(server.url) as conn:
            final = conn.execute("SELECT n FROM counter WHERE id = 1").fetchone()
        committed = sum(c for c, _ in reports)
        assert final is not None and final[0] == committed, (
            f"counter {final} but {committed} increments committed: an update was lost {reports}")
        assert sum(f for _, f in reports) >= 1, "the stall before fencing was not fenced out"
        assert committed >= 4 * 6 - 2, reports

    def test_a_holder_stopped_past_its_ttl_commits_nothing_when_continued(
            self, server: PgServer) -> None:
        with psycopg.connect(server.url, autocommit=True) as admin:
            admin.execute("CREATE TABLE owner (id int PRIMARY KEY, who text NOT NULL)")
            admin.execute("INSERT INTO owner VALUES (1, 'nobody')")
        results, go = CTX.Queue(), CTX.Event()
        child = CTX.Process(target=stopped_holder, args=(server.url, go, results), daemon=True)
        child.start()
        try:
            kind, frozen_token = results.get(timeout=30)
            assert kind == "held" and frozen_token is not None, (kind, frozen_token)
            assert child.pid is not None
            os.kill(child.pid, signal.SIGSTOP)
            with qs.Queen(server.url) as q, psycopg.connect(server.url) as conn:
                successor = q.lock("frozen", ttl="30s")
                assert successor.acquire(wait=10), successor.holders
                assert successor.token is not None and successor.token > frozen_token
                with conn.transaction():
                    successor.fence(conn)
                    conn.execute("UPDATE owner SET who = 'successor' WHERE id = 1")
                os.kill(child.pid, signal.SIGCONT)
                go.set()
                verdict = results.get(timeout=30)
                successor.release()
                who = conn.execute("SELECT who FROM owner WHERE id = 1").fetchone()
        finally:
            if child.is_alive() and child.pid is not None:
                os.kill(child.pid, signal.SIGCONT)
            child.join(10)
        assert verdict[0] == "fenced out", verdict
        assert who == ("successor",), f"the stopped holder's write landed: {who}"


class TestStalledServer:
    """A frozen server: every call gives up within its timeout, then the client recovers."""

    @pytest.mark.parametrize("route", ["kv", "locks"])
    def test_a_call_to_a_frozen_server_gives_up_within_its_timeout_and_works_after(
            self, server: PgServer, route: str) -> None:
        with qs.Queen(server.url, timeout=1, renew_thread=False) as q:
            assert q.kv.put("ns", "k", 1, ttl="1m"), "the warm-up write failed"
            # An acquire commits as its one statement runs, so one cut off by the deadline
            # may have taken effect when the server resumed: as the same owner, the call
            # after answers that permit.
            call: Callable[[], Any] = (
                (lambda: q.kv.put("ns", "k", 2, ttl="1m")) if route == "kv" else
                (lambda: q.locks.acquire("stalled", ttl="1m", owner="stalled-owner")))
            with frozen(server):
                started = time.monotonic()
                with pytest.raises(qs.EngineUnavailableError) as caught:
                    call()
                took = time.monotonic() - started
            assert took < 1.6, f"the call blocked {took:.1f}s against a 1s timeout"
            assert "within 1" in str(caught.value), caught.value
            if route == "locks":
                assert "unknown" in str(caught.value), f"not said to be unknown: {caught.value}"
            answer = call()
            assert answer, f"the client did not recover after the server resumed: {answer}"

    def test_every_call_on_a_frozen_server_is_bounded_even_one_needing_a_connection(
            self, server: PgServer) -> None:
        with qs.Queen(server.url, timeout=1, renew_thread=False) as q:
            assert q.locks.get("x") is not None
            with frozen(server):
                for attempt in range(3):  # the first breaks the pooled session; the rest connect
                    started = time.monotonic()
                    with pytest.raises(qs.EngineUnavailableError):
                        q.locks.get("x")
                    took = time.monotonic() - started
                    # libpq waits at least 2s to connect: that floor bounds a fresh session.
                    assert took < 2.8, f"attempt {attempt} blocked {took:.1f}s"
            assert q.locks.get("x")["held"] is False, "no recovery after the server resumed"


    def test_a_connection_closed_at_its_deadline_goes_back_to_the_pool_without_a_warning(
            self, server: PgServer, caplog: pytest.LogCaptureFixture) -> None:
        with qs.Queen(server.url, timeout=0.5, renew_thread=False) as q:
            assert q.locks.get("x") is not None
            caplog.set_level(logging.INFO)
            with frozen(server), pytest.raises(qs.EngineUnavailableError):
                q.locks.get("x")
            assert q.locks.get("x")["held"] is False, "no recovery after the server resumed"
        # The pool's own reconnect, run as the server resumes, may meet the statement timeout
        # on a loaded machine and say so itself: that is psycopg's line, not this deadline's.
        loud = [f"{r.name}: {r.getMessage()}" for r in caplog.records
                if r.levelno >= logging.WARNING
                and not (r.name == "psycopg.pool" and "error connecting" in r.getMessage())]
        assert not loud, f"a deadline that did its job was logged as a warning: {loud}"

    def test_waiting_for_a_release_on_a_frozen_server_falls_back_to_polling_in_time(
            self, server: PgServer) -> None:
        with qs.Queen(server.url, timeout=1, renew_thread=False) as q, frozen(server):
            started = time.monotonic()
            with q.engine.subscribe("stalled") as waiter:
                took = time.monotonic() - started
                assert waiter.wait(0.05) is False, "woken with nothing released"
        assert took < 1.4, f"subscribing blocked {took:.1f}s against a 1s timeout"


@contextlib.contextmanager
def mute_listener() -> Iterator[int]:
    """A port that accepts connections and never says a word: a handshake that stalls."""
    listener = socket.create_server(("127.0.0.1", 0), backlog=64)
    held: list[socket.socket] = []

    def accept() -> None:
        with contextlib.suppress(OSError):
            while True:
                held.append(listener.accept()[0])

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield listener.getsockname()[1]
    finally:
        listener.close()
        for conn in held:
            conn.close()


class TestStalledHandshake:
    @pytest.mark.parametrize("timeout", [0.3, (0.3, 0.3), (5, 0.3)])
    def test_a_server_that_never_completes_the_handshake_holds_no_call_past_its_timeout(
            self, timeout: Any) -> None:
        with mute_listener() as port, qs.Queen(f"postgresql://u:pw@127.0.0.1:{port}/db",
                                                timeout=timeout, renew_thread=False) as q:
            for attempt in range(3):  # the first migrates; later ones connect around the pool
                started = time.monotonic()
                with pytest.raises(qs.EngineUnavailableError) as caught:
                    q.locks.get("x")
                took = time.monotonic() - started
                assert took < 0.8, f"call {attempt} took {took:.2f}s against a 0.3s timeout"
                assert "0.3s" in str(caught.value), f"the timeout is not named: {caught.value}"


def test_a_lost_connection_is_retried_once_then_reported(server: PgServer) -> None:
    """Two connection losses in one call are not hidden: the second surfaces."""
    app = "twice_" + secrets.token_hex(4)
    engine = qs.Queen(f"{server.url}?application_name={app}").engine
    storage = engine.storage  # type: ignore[attr-defined]
    real_checkout = storage._checkout
    kills = threading.Semaphore(2)

    def checkout_then_kill(call: Any) -> Any:
        conn, pool = real_checkout(call)
        if kills.acquire(blocking=False):
            server.terminate_backends(app)
            deadline = time.monotonic() + 5
            while not _postgres_storage._has_input(conn) and time.monotonic() < deadline:
                time.sleep(0.005)  # until the server's goodbye has reached this end
        return conn, pool

    engine.call("locks", {"operations": [{"op": "get", "name": "warm"}]})
    storage._checkout = checkout_then_kill
    with pytest.raises(qs.EngineUnavailableError):
        engine.call("locks", {"operations": [{"op": "get", "name": "twice"}]})
    answer = engine.call("locks", {"operations": [{"op": "get", "name": "twice"}]})
    assert answer["results"][0]["held"] is False, answer
    engine.close()
