"""Waiters of one lock in many clients line up in the database: only the front one retries.

A release NOTIFYs every client, and each used to send a waiter to try: with waiters in N
clients, N-1 lost a round trip to the winner on every release (4 contending processes
made 4.4 attempts per acquisition). These tests run real clients of the tests' own
pg_server, each with its own engine, as separate processes would be; one test stops a
real process at the front of the line.
"""

from __future__ import annotations

import contextlib
import dis
import multiprocessing
import os
import secrets
import signal
import sys
import threading
import time
from typing import Any, Callable, Iterator

import pytest
from pg_server import PgServer, frozen, stopped

pytest.importorskip("psycopg")

import psycopg

import queen_sync as qs
from queen_sync._engines.postgres.engine import PostgresEngine
from queen_sync.testing import FaultyEngine

pytestmark = pytest.mark.timeout(90)

_RELEASES = 20  # wake-ups sent while the others wait


@pytest.fixture
def url(pg_server: PgServer) -> str:
    """A fresh, empty schema."""
    return f"{pg_server.url}?schema=line_{secrets.token_hex(6)}"


def _line_class(url: str) -> int:
    """The advisory-lock class of the schema's lines, as pg_locks shows it (an oid)."""
    engine = PostgresEngine.from_url(url)
    try:
        return engine._room.line_class & 0xFFFFFFFF
    finally:
        engine.close()


def _places(pg_server: PgServer, url: str, granted: bool | None = None) -> int:
    """Sessions in a line of ``url``'s schema now (at its front when ``granted``)."""
    query = ("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND objsubid = 2"
             " AND classid = %s::oid")
    params: list[Any] = [_line_class(url)]
    if granted is not None:
        query += " AND granted = %s"
        params.append(granted)
    with psycopg.connect(pg_server.url, autocommit=True) as conn:
        row = conn.execute(query, params).fetchone()
    return int(row[0]) if row else 0


def _until(condition: Any, failure: str, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, failure
        time.sleep(0.01)


def _waited_once(q: qs.Queen, waiting: qs.Queen, name: str) -> tuple[qs.Lock, qs.Lock]:
    """``q`` holds ``name``; ``waiting`` waited for it once, in line, and gave up."""
    holder = q.lock(name, ttl=30)
    assert holder.acquire(), "the holder could not take the lock"
    lock = waiting.lock(name, ttl=30)
    assert lock.acquire(wait=0.2) is False, "the lock was free to the waiter"
    return holder, lock


class _Contender:
    """A client of its own waiting on ``name`` in a thread; ``attempts`` counts its tries."""

    def __init__(self, url: str, name: str, wait: float = 20.0) -> None:
        self.engine = FaultyEngine(PostgresEngine.from_url(url))
        self.queen = qs.Queen(engine=self.engine, renew_thread=False)
        self.lock = self.queen.lock(name, ttl=30)
        self.got: list[bool] = []
        self.token: int | None = None
        self._wait = wait
        self.release = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    @property
    def attempts(self) -> int:
        return self.engine.sent["locks"]

    def _run(self) -> None:
        try:
            got = self.lock.acquire(wait=self._wait)
        except qs.QueenError:
            if self.release.is_set():
                return  # closed while it waited: the test is over with it
            raise
        self.token = self.lock.token if got else None
        self.got.append(got)
        if got:
            self.release.wait(30)
            self.lock.release()

    def close(self) -> None:
        # Closed first: close() ends a wait still in line, so a contender left waiting on
        # a lock the test still holds does not sit out the rest of its wait.
        self.release.set()
        self.queen.close()
        self.thread.join(30)


@contextlib.contextmanager
def _contenders(url: str, name: str, count: int, **options: Any) -> Iterator[list[_Contender]]:
    started: list[_Contender] = []
    try:
        for _ in range(count):  # one at a time, so the line's order is the start order
            started.append(_Contender(url, name, **options))
            time.sleep(0.15)
        yield started
    finally:
        for contender in started:
            contender.close()


class TestOnlyTheFrontRetries:
    def test_a_release_sends_only_the_front_waiter_of_all_clients_to_try(
            self, pg_server: PgServer, url: str) -> None:
        # Releases as waiters see them (a NOTIFY of the name) while nothing is freed: each
        # one sent a waiter of every client to try and fail.
        with qs.Queen(url) as q:
            holder = q.lock("held", ttl=30)
            assert holder.acquire(), "the holder could not take the lock"
            channel = q.engine.storage.sql.channel  # type: ignore[attr-defined]
            with _contenders(url, "held", 3) as waiters, \
                    psycopg.connect(pg_server.url, autocommit=True) as notifier:
                _until(lambda: _places(pg_server, url) == 3, "the waiters never lined up")
                before = [w.attempts for w in waiters]
                for _ in range(_RELEASES):
                    notifier.execute("SELECT pg_notify(%s, 'held')", [channel])
                    time.sleep(0.03)
                during = [w.attempts - b for w, b in zip(waiters, before)]
                holder.release()
        assert during[0] >= _RELEASES // 2, f"the front waiter slept through releases: {during}"
        # Behind the front a waiter looks once a second at most: none of these are wakes.
        assert max(during[1:]) <= 3, (
            f"{_RELEASES} releases sent the waiters behind the front to try: {during}")

    def test_every_waiter_in_line_gets_the_lock_in_its_turn_with_a_rising_token(
            self, pg_server: PgServer, url: str) -> None:
        with qs.Queen(url) as q:
            holder = q.lock("turns", ttl=30)
            assert holder.acquire(), "the holder could not take the lock"
            first = holder.token
            with _contenders(url, "turns", 3) as waiters:
                holder.release()
                tokens: list[int] = []
                for waiter in waiters:  # each is let go once it holds: the next one's turn
                    _until(lambda w=waiter: bool(w.got), "a waiter never got its turn")
                    assert waiter.got == [True] and waiter.token is not None, (
                        "a waiter gave up in line")
                    tokens.append(waiter.token)
                    waiter.release.set()
                    waiter.thread.join(10)
        assert first is not None and tokens == sorted(tokens) and tokens[0] > first, (
            f"tokens must rise in the order of the line: first {first}, then {tokens}")
        _until(lambda: _places(pg_server, url) == 0, "a place in line outlived its waiter")


def _stopped_front(url: str, ready: Any) -> None:
    """A process that waits on 'stalled' and says when it is at the front (then is stopped)."""
    with qs.Queen(url, renew_thread=False) as q:
        lock = q.lock("stalled", ttl=30)
        ready.set()
        lock.acquire(wait=60)


class TestALineHoldsUpNobody:
    def test_a_waiter_behind_a_stopped_front_acquires_within_a_second_of_the_release(
            self, pg_server: PgServer, url: str) -> None:
        ctx = multiprocessing.get_context("spawn")
        with qs.Queen(url) as q:
            holder = q.lock("stalled", ttl=30)
            assert holder.acquire(), "the holder could not take the lock"
            ready = ctx.Event()
            front = ctx.Process(target=_stopped_front, args=(url, ready), daemon=True)
            front.start()
            try:
                assert ready.wait(30), "the front process never started"
                _until(lambda: _places(pg_server, url, granted=True) == 1,
                       "the other process never reached the front")
                assert front.pid is not None
                os.kill(front.pid, signal.SIGSTOP)
                with _contenders(url, "stalled", 1) as (behind,):
                    _until(lambda: _places(pg_server, url) == 2, "the waiter never lined up")
                    released = time.monotonic()
                    holder.release()
                    _until(lambda: bool(behind.got), "the waiter behind never acquired", 5.0)
                    took = time.monotonic() - released
                    assert behind.got == [True]
            finally:
                if front.pid is not None:
                    os.kill(front.pid, signal.SIGKILL)
                front.join(10)
        # Behind the front, a waiter looks at least once a second (sooner when its
        # holder's lease is due); the frozen front cannot hold it longer.
        assert took < 1.6, f"the stopped front held the waiter behind it {took:.2f}s"

    def test_a_wait_in_line_ends_at_its_deadline(self, pg_server: PgServer, url: str) -> None:
        with qs.Queen(url) as q:
            holder = q.lock("deadline", ttl=30)
            assert holder.acquire(), "the holder could not take the lock"
            with _contenders(url, "deadline", 1):
                _until(lambda: _places(pg_server, url, granted=True) == 1, "no front waiter")
                with qs.Queen(url) as other:
                    started = time.monotonic()
                    got = other.lock("deadline", ttl=30).acquire(wait=0.4)
                    took = time.monotonic() - started
        assert got is False
        assert 0.35 < took < 1.0, f"a 0.4 s wait in line took {took:.2f}s"

    def test_a_line_connection_cut_by_the_server_leaves_its_waiter_waiting_without_it(
            self, pg_server: PgServer, url: str) -> None:
        with qs.Queen(url) as q:
            holder = q.lock("cut", ttl=30)
            assert holder.acquire(), "the holder could not take the lock"
            with _contenders(url, "cut", 2) as waiters:
                _until(lambda: _places(pg_server, url) == 2, "the waiters never lined up")
                with psycopg.connect(pg_server.url, autocommit=True) as admin:
                    cut = admin.execute(
                        "SELECT count(pg_terminate_backend(pid)) FROM pg_locks"
                        " WHERE locktype = 'advisory' AND objsubid = 2 AND classid = %s::oid",
                        [_line_class(url)]).fetchone()
                assert cut == (2,), f"the line's sessions were not both cut: {cut}"
                holder.release()
                for _ in waiters:  # no line orders them now: whoever holds lets go
                    _until(lambda: any(w.got and not w.release.is_set() for w in waiters),
                           "a waiter whose line was cut never got the lock")
                    winner = next(w for w in waiters if w.got and not w.release.is_set())
                    assert winner.got == [True]
                    winner.release.set()
                    winner.thread.join(10)


class TestNoPlaceOutlivesItsWaiter:
    def test_no_place_in_line_is_left_after_waits_that_won_gave_up_or_were_interrupted(
            self, pg_server: PgServer, url: str) -> None:
        with qs.Queen(url) as q, qs.Queen(url, renew_thread=False) as waiting:
            holder, lock = _waited_once(q, waiting, "left")  # gave up at the front
            assert _places(pg_server, url) == 0, "a wait that gave up kept its place"
            with _contenders(url, "left", 1):
                _until(lambda: _places(pg_server, url, granted=True) == 1, "no front waiter")
                # Interrupted behind the front, inside pg_advisory_lock.
                timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT))
                timer.start()
                with pytest.raises(KeyboardInterrupt):
                    lock.acquire(wait=10)
                timer.join()
                _until(lambda: _places(pg_server, url) == 1,
                       "an interrupted waiter kept its place in line")
                holder.release()
            _until(lambda: _places(pg_server, url) == 0, "a waiter that won kept its place")
            # The client waits in line again, on the connections it kept.
            assert holder.acquire()
            waited = threading.Thread(target=lambda: lock.acquire(wait=10), daemon=True)
            waited.start()
            _until(lambda: _places(pg_server, url, granted=True) == 1, "no wait in line again")
            holder.release()
            waited.join(10)
            assert lock.held, "the waiter did not get the lock after waiting in line again"
            lock.release()
        _until(lambda: _places(pg_server, url) == 0, "a place outlived its client")

    def test_closing_a_client_closes_the_connections_its_waiters_kept(
            self, pg_server: PgServer, url: str) -> None:
        with qs.Queen(url) as q:
            holder = q.lock("kept", ttl=30)
            assert holder.acquire()
            waiting = qs.Queen(url, renew_thread=False)
            assert waiting.lock("kept", ttl=30).acquire(wait=0.2) is False
            engine: Any = waiting.engine
            kept = [conn for conn, _unread in engine._room._idle]
            assert kept, "the waiter kept no connection for the next wait"
            waiting.close()
            assert all(conn.closed for conn in kept), "close() left a line connection open"


class TestConnectionsPerClient:
    def test_threads_of_one_client_wait_on_one_connection_per_name_and_a_few_in_all(
            self, pg_server: PgServer, url: str) -> None:
        names = [f"n{i}" for i in range(12)]
        with qs.Queen(url) as q, qs.Queen(url, renew_thread=False) as waiting:
            holders = [q.lock(name, ttl=30) for name in names]
            assert all(h.acquire() for h in holders)
            got: list[str] = []

            def wait_for(name: str) -> None:
                lock = waiting.lock(name, ttl=30)
                if lock.acquire(wait=20):
                    got.append(name)
                    lock.release()

            threads = [threading.Thread(target=wait_for, args=(name,), daemon=True)
                       for name in [names[0]] * 10 + names[1:]]
            for thread in threads:
                thread.start()
            time.sleep(1.0)
            in_line = _places(pg_server, url)
            for holder in holders:
                holder.release()
            for thread in threads:
                thread.join(30)
        assert 1 <= in_line <= 8, (
            f"21 waiting threads on 12 names held {in_line} sessions in line (at most 8)")
        assert sorted(got) == sorted([names[0]] * 10 + names[1:]), "a waiter never got its lock"


class TestFork:
    def test_a_forked_child_waits_in_line_on_a_connection_of_its_own(
            self, pg_server: PgServer, url: str) -> None:
        with qs.Queen(url) as q, qs.Queen(url, renew_thread=False) as waiting:
            # The client now keeps a line connection.
            holder, lock = _waited_once(q, waiting, "forked")
            pid = os.fork()
            if pid == 0:  # the child: its wait must not use the parent's session
                code = 1
                try:
                    code = 0 if lock.acquire(wait=0.3) is False else 2
                finally:
                    os._exit(code)
            # The parent waits in line at the same time, on its kept connection.
            assert lock.acquire(wait=0.3) is False
            _, status = os.waitpid(pid, 0)
            assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, (
                f"the child's wait in line failed: status {status}")
            holder.release()
            assert lock.acquire(wait=5), "the parent's line broke across the fork"
            lock.release()


class _Heartbeat:
    """A thread that ticks every 20 ms: the longest gap shows the process was held."""

    def __init__(self) -> None:
        self.beats: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.is_set():
            self.beats.append(time.monotonic())
            time.sleep(0.02)

    def longest_gap(self) -> float:
        self._stop.set()
        self._thread.join(5)
        return max((b - a for a, b in zip(self.beats, self.beats[1:])), default=0.0)


class TestAStalledServerHoldsUpNoWaitInLine:
    def test_a_place_given_up_on_a_stalled_session_delays_neither_the_next_wait_nor_the_process(
            self, pg_server: PgServer, url: str) -> None:
        # The front gives up its place without waiting for the answer; the next wait on
        # that connection read the answer inside the driver, holding the GIL: a stopped
        # pg_server process froze the whole client until it resumed (8 s of 8 s in 3 of 3).
        with qs.Queen(url, renew_thread=False) as q, \
                qs.Queen(url, renew_thread=False) as waiting:
            holder = q.lock("stalled-answer", ttl=30)
            assert holder.acquire()
            front = waiting.lock("stalled-answer", ttl=30)
            done: list[bool] = []
            thread = threading.Thread(target=lambda: done.append(front.acquire(wait=20)),
                                      daemon=True)
            thread.start()
            _until(lambda: _places(pg_server, url, granted=True) == 1, "no front waiter")
            with psycopg.connect(pg_server.url, autocommit=True) as admin:
                row = admin.execute(
                    "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND objsubid = 2"
                    " AND classid = %s::oid AND granted", [_line_class(url)]).fetchone()
            assert row is not None
            with stopped([int(row[0])], resume_after=6):
                holder.release()
                thread.join(10)
                assert done == [True], "the front waiter never took the lock"
                front.release()
                assert holder.acquire()
                beat = _Heartbeat()
                started = time.monotonic()
                got = waiting.lock("stalled-answer", ttl=30).acquire(wait=0.5)
                took = time.monotonic() - started
                gap = beat.longest_gap()
        assert got is False
        assert took < 1.2, f"a 0.5 s wait took {took:.2f}s behind a stalled session"
        assert gap < 0.5, f"the whole process stood still for {gap:.2f}s"

    def test_a_client_closed_while_the_server_is_stopped_leaves_no_wait_in_line_past_its_end(
            self, pg_server: PgServer, url: str) -> None:
        # close() stopped the watchdog that bounded a wait inside pg_advisory_lock; on a
        # stopped pg_server lock_timeout never fires, so the wait lasted until it resumed.
        with qs.Queen(url) as q:
            holder = q.lock("closing", ttl=30)
            assert holder.acquire()
            waiting = qs.Queen(f"{url}&timeout=2", renew_thread=False)
            outcomes: list[Any] = []

            def wait() -> None:
                try:
                    outcomes.append(waiting.lock("closing", ttl=30).acquire(wait=4))
                except qs.QueenError as exc:
                    outcomes.append(type(exc).__name__)

            with _contenders(url, "closing", 1):  # another client at the front
                _until(lambda: _places(pg_server, url, granted=True) == 1, "no front waiter")
                threads = [threading.Thread(target=wait, daemon=True) for _ in range(2)]
                for thread in threads:
                    thread.start()
                _until(lambda: _places(pg_server, url) == 2, "no waiter inside pg_advisory_lock")
                time.sleep(0.3)  # the second waits behind the first in the process's gate
                with frozen(pg_server):
                    started = time.monotonic()
                    closer = threading.Thread(target=waiting.close, daemon=True)
                    closer.start()
                    for thread in threads:
                        thread.join(12)
                    took = time.monotonic() - started
                    closer.join(12)
        assert len(outcomes) == 2, f"waiters still stuck after {took:.1f}s: {outcomes}"
        assert took < 5.5, f"waiters of a closed client ran {took:.1f}s past a 4 s wait"



class TestAPlaceInDoubtIsGivenUp:
    def test_a_place_granted_as_its_wait_timed_out_is_given_up_when_its_waiter_leaves(
            self, pg_server: PgServer, url: str, monkeypatch: pytest.MonkeyPatch) -> None:
        # The pg_server may grant the lock in the moment lock_timeout fires, keep it and still
        # answer 55P03 (2 in 15 s of churn): the waiter, told it timed out, kept the place
        # on an idle connection, and every later hand-off of the name took 0.7 s.
        from queen_sync._engines.postgres import waiting_room

        def granted_yet_timed_out(conn: Any, deadline: float) -> str:
            assert real_answer(conn, deadline) is None, "setup: the place was not granted"
            return "55P03"

        real_answer = waiting_room.answer
        engine = PostgresEngine.from_url(url)
        try:
            with engine._room.line("doubt") as place:
                monkeypatch.setattr(waiting_room, "answer", granted_yet_timed_out)
                place.take(0.5)
                monkeypatch.setattr(waiting_room, "answer", real_answer)
                assert not place.front, "setup: the waiter was not told it timed out"
                assert _places(pg_server, url, granted=True) == 1, "setup: no place held"
            _until(lambda: _places(pg_server, url) == 0,
                   "a place granted as its wait timed out outlived its waiter")
        finally:
            engine.close()

    def test_an_interrupt_while_reading_a_given_up_place_leaves_no_connection_counted_or_open(
            self, url: str, monkeypatch: pytest.MonkeyPatch) -> None:
        # A Ctrl-C in the read of a place given up (its answer late, from a stalled pg_server
        # process) kept the connection open and counted: after eight, the client had no
        # line left to wait in, for good.
        from queen_sync._engines.postgres import waiting_room

        def interrupted(conn: Any, deadline: float) -> str:
            raise KeyboardInterrupt

        with qs.Queen(url, renew_thread=False) as q, \
                qs.Queen(url, renew_thread=False) as waiting:
            holder = q.lock("late", ttl=30)
            assert holder.acquire()
            room: Any = waiting.engine._room  # type: ignore[attr-defined]
            assert waiting.lock("late", ttl=30).acquire(wait=0.2) is False
            ((kept, unread),) = room._idle
            assert unread, "setup: the place given up was not left to be read"
            monkeypatch.setattr(waiting_room, "answer", interrupted)
            with pytest.raises(KeyboardInterrupt):
                waiting.lock("late", ttl=30).acquire(wait=3)
            monkeypatch.undo()
            assert room._lent == 0, f"{room._lent} connections still counted as lent"
            assert kept.closed, "the connection whose answer was in doubt stayed open"


def _interrupting_at(code: Any, offset: int) -> Callable[..., Any]:
    """A trace function raising KeyboardInterrupt at bytecode ``offset`` of ``code``, once."""
    fired: list[bool] = []

    def calls(frame: Any, event: str, arg: Any) -> Any:
        if frame.f_code is not code:
            return None
        frame.f_trace_opcodes = True

        def opcodes(frame: Any, event: str, arg: Any) -> Any:
            if event == "opcode" and frame.f_lasti == offset and not fired:
                fired.append(True)
                raise KeyboardInterrupt
            return opcodes
        return opcodes
    return calls


class TestAnInterruptAnywhereInATake:
    def test_an_interrupt_at_any_bytecode_of_a_take_leaves_the_gate_to_the_next_thread(
            self, url: str) -> None:
        # Between the gate's acquire returning and its being recorded, an interrupt kept the
        # gate shut: the client's other threads on the name stopped lining up.
        from queen_sync._engines.postgres.waiting_room import Place

        code = Place.take.__code__
        offsets = [i.offset for i in dis.get_instructions(code)]
        engine = PostgresEngine.from_url(url)
        shut: list[int] = []
        try:
            room = engine._room
            for offset in offsets:
                with room.line("gate") as other:  # another thread's place on the name
                    with contextlib.suppress(KeyboardInterrupt), room.line("gate") as place:
                        sys.settrace(_interrupting_at(code, offset))
                        try:
                            place.take(0.2)
                        finally:
                            sys.settrace(None)
                    other.take(0.2)
                    if not (other.front or other.unusable):
                        shut.append(offset)
                assert room._lent == 0, f"a connection stayed counted at offset {offset}"
                assert not room._gates, f"a gate outlived its places at offset {offset}"
        finally:
            engine.close()
        assert not shut, (
            f"an interrupt at bytecode {shut} of {len(offsets)} left the name's gate shut")
