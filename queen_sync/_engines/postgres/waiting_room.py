"""Waiters of one lock name in many processes take turns in the database, not all at once.

A release NOTIFYs every listening process and each wakes one of its waiters, so with
waiters in N processes N-1 of them lose a round trip (and the name's lock) to the
winner on every release. A waiter therefore first takes the name's place in line: a
session-level advisory lock, in a key space of its own, on a connection of its own.
Only the waiter holding it sleeps on LISTEN and retries on a release; the others sleep
inside ``pg_advisory_lock``, which the server queues in order at no cost to anyone.
Threads of one client waiting on one name line up in the process first, so a client
waits on at most one connection per name, and on no more than ``_MAX_LINES`` in all: a
waiter that finds them taken waits as if there were no line.

The place is a hint, never a permit: holding it grants nothing, and every wait in line
is bounded by the waiter's own timeout (``lock_timeout``), after which it tries the
permit as it would have anyway, so an expiry, a stalled holder of the place or a lost
server delays nobody past the wait they asked for. A connection in doubt is closed,
which ends its session and with it the place.
"""

from __future__ import annotations

import contextlib
import logging
import select
import threading
import time
import zlib
from typing import Any, Callable, Iterator, Optional

import psycopg

from ..base import Waiter
from .pool import detach
from .sql import signed32
from .txn import entity_key

log = logging.getLogger("queen_sync")

# Idle connections kept for the next waiter: opening one costs more than a wait in line.
_KEPT_IDLE = 2
# Connections one client may wait on at once (each is a server session).
_MAX_LINES = 8
# How long giving up a place may take to be sent, and its answer to be read.
_ANSWER_GRACE = 0.25
# Past its wait's timeout, how long a wait in line may take to end (a frozen server never
# fires ``lock_timeout``): the waiter then polls as it would have with no line.
_WAIT_SLACK = 0.25
_LOCK_NOT_AVAILABLE = "55P03"


class Late(Exception):
    """The server did not answer a line statement in time: its connection is in doubt."""


class WaitingRoom:
    """The lines of one engine's waiters, and the connections they wait on.

    Every statement on a line connection is sent and read here, without blocking inside
    the driver, and bounded by its waiter's own deadline: the engine's watchdog is not
    needed (and stops when the engine closes, while a waiter may still be in line).

    Args:
        connect: opens a new autocommit connection, given up on at a deadline
            (``time.monotonic()`` seconds; driver errors propagate).
        schema: the engine's schema, which names the key space of the lines.
    """

    def __init__(self, connect: Callable[[float], psycopg.Connection[Any]], schema: str
                 ) -> None:
        self._connect = connect
        self.line_class = signed32(zlib.crc32(f"queen_sync-line:{schema}".encode()))
        self._idle: list[tuple[psycopg.Connection[Any], bool]] = []  # (conn, answer unread)
        self._lent = 0  # connections waiters hold now
        self._gates: dict[str, tuple[Gate, int]] = {}  # name -> (gate, places)
        self._mutex = threading.Lock()
        self._closed = False

    @contextlib.contextmanager
    def line(self, name: str) -> Iterator[Place]:
        """A waiter's place in the line of lock ``name``, left (and given up) on exit."""
        with self._mutex:
            gate, places = self._gates.get(name, (Gate(), 0))
            self._gates[name] = (gate, places + 1)
        place = Place(self, entity_key(f"L{name}"), gate)
        try:
            yield place
        finally:
            try:
                place.leave()
            finally:
                with self._mutex:
                    gate, places = self._gates[name]
                    if places > 1:
                        self._gates[name] = (gate, places - 1)
                    else:
                        del self._gates[name]

    def lend(self, place: Place, deadline: float) -> Optional[psycopg.Connection[Any]]:
        """Give ``place`` an idle connection holding no place, or a new one; None when
        this client waits on as many as it may (driver errors propagate).

        The connection is recorded on the place as it is counted, so however the caller
        is interrupted, leaving the place gives it back.
        """
        while True:
            with self._mutex:
                if self._closed:
                    raise psycopg.OperationalError("the engine is closed")
                if not self._idle:
                    if self._lent >= _MAX_LINES:
                        return None
                    self._lent += 1
                    break
                conn, unread = self._idle.pop()
                self._lent += 1
                place.conn = conn
            try:
                answered = not unread or self._read_answer(conn, deadline)
            except BaseException:
                place.conn = None
                self.discard(conn)  # an interrupted read leaves the answer in doubt
                raise
            if answered:
                return conn
            place.conn = None
            self._returned()
        try:
            place.conn = self._connect(deadline)
        except BaseException:
            self._returned()
            raise
        return place.conn

    def give_back(self, conn: psycopg.Connection[Any], asked: bool) -> None:
        """Keep ``conn`` for the next waiter, or close it. When a place was ``asked`` for
        on it, it is given up first: sent now and its answer read by the next borrower,
        so the waiter that took the permit is not held up by it.

        Given up even when the ask said it timed out: the server may grant the lock in
        the very moment ``lock_timeout`` fires, keep it, and still answer the error.
        """
        self._returned()
        with self._mutex:
            keep = not self._closed and len(self._idle) < _KEPT_IDLE and not conn.closed
        if keep and asked:
            try:
                # The session's only advisory locks are its place: a line connection
                # never serves anything else.
                send(conn, b"SELECT pg_advisory_unlock_all()", time.monotonic() + _ANSWER_GRACE)
            except (psycopg.Error, Late):
                keep = False
        if keep:
            with self._mutex:
                if not self._closed:
                    self._idle.append((conn, asked))
                    return
        close_quietly(conn)  # the session's end gives up any place it held

    def discard(self, conn: psycopg.Connection[Any]) -> None:
        """Close a connection in doubt; its session's end gives up any place it held."""
        self._returned()
        close_quietly(conn)

    def _returned(self) -> None:
        with self._mutex:
            self._lent -= 1

    @staticmethod
    def _read_answer(conn: psycopg.Connection[Any], deadline: float) -> bool:
        """Read the answer to the statement ``give_back`` sent; False (closed) if it failed
        or is not in by ``deadline`` (a server that stalled must not hold up this wait)."""
        try:
            ok = answer(conn, min(deadline, time.monotonic() + _ANSWER_GRACE)) is None
        except (psycopg.Error, Late):
            ok = False
        if not ok:
            close_quietly(conn)
        return ok

    def close(self) -> None:
        """Close the idle connections; those in use are closed as their waiters leave."""
        with self._mutex:
            self._closed = True
            idle, self._idle = self._idle, []
        for conn, _unread in idle:
            close_quietly(conn)

    def after_fork(self) -> None:
        """In a forked child: the parent's connections are detached with the rest."""
        self._mutex = threading.Lock()
        idle, self._idle = self._idle, []
        self._lent, self._gates = 0, {}
        detach([conn for conn, _unread in idle])


class Gate:
    """Lets one place of a name at a time through to the database, in this process.

    It records which place it let through, rather than the place recording that it
    passed: however a waiter is interrupted, the gate is open again once it leaves.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._through: Optional[Place] = None

    def enter(self, place: Place, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds to let ``place`` through; True once it is."""
        with self._cond:
            if self._through is not place:
                if not self._cond.wait_for(lambda: self._through is None, max(0.0, timeout)):
                    return False
                self._through = place
            return True

    def leave(self, place: Place) -> None:
        with self._cond:
            if self._through is place:
                self._through = None
                self._cond.notify()


class Place:
    """One waiter's place in one name's line: ``take`` waits for the front.

    It first passes the name's gate in this process (one thread per client and name
    waits in the database), then the name's line in the database.
    """

    def __init__(self, room: WaitingRoom, key: int, gate: Gate) -> None:
        self._room = room
        self._key = key
        self._gate = gate
        self.conn: Optional[psycopg.Connection[Any]] = None  # lent by the room
        self._asked = False  # a place was asked for on the connection: give it up on leaving
        self.front = False  # holds the name's place: it alone retries on a release
        self.unusable = False  # the line could not be reached: wait as if there were none

    def take(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the front of the line; False in any case,
        since reaching it is no release (see ``base.Waiter``): the caller looks next."""
        deadline = time.monotonic() + max(0.0, timeout)
        if not self._gate.enter(self, timeout):
            return False
        try:
            conn = self.conn or self._room.lend(self, deadline + _WAIT_SLACK)
            if conn is None:
                self.unusable = True  # no line to wait in: look now, then wait on releases
                return False
            self._asked = True
            ms = max(1, round((deadline - time.monotonic()) * 1000))
            # The session's statement_timeout is the call timeout, which may be shorter.
            send(conn, f"SET lock_timeout = {ms};"
                       f" SET statement_timeout = {ms + round(_WAIT_SLACK * 1000)};"
                       f" SELECT pg_advisory_lock({self._room.line_class}, {self._key})"
                       .encode(), deadline + _WAIT_SLACK)
            failed = answer(conn, deadline + _WAIT_SLACK)
        except (psycopg.Error, Late) as exc:
            log.debug("queen_sync waiting line unavailable, waiting without it: %s", exc)
            self.unusable = True
            self._drop()
            return False
        except BaseException:
            self._drop()  # an interrupted wait may have reached the front: the session ends it
            raise
        if failed == _LOCK_NOT_AVAILABLE:
            return False
        if failed is not None:
            log.debug("queen_sync waiting line refused (SQLSTATE %s), waiting without it",
                      failed)
            self.unusable = True
            self._drop()
            return False
        self.front = True
        return False

    def leave(self) -> None:
        """Give up the place (if at the front), the connection and the gate."""
        conn, self.conn = self.conn, None
        try:
            if conn is not None:
                self.front = False
                self._room.give_back(conn, self._asked)
        finally:
            self._gate.leave(self)

    def _drop(self) -> None:
        conn, self.conn = self.conn, None
        self.front = self._asked = False
        if conn is not None:
            self._room.discard(conn)


def send(conn: psycopg.Connection[Any], query: bytes, deadline: float) -> None:
    """Send ``query`` (the simple protocol) on ``conn``, all of it by ``deadline``.

    Raises:
        Late: it could not all be sent in time.
        psycopg.OperationalError: the connection failed.
    """
    pgconn = conn.pgconn
    pgconn.send_query(query)
    while pgconn.flush() == 1:  # a connection in non-blocking mode may keep part queued
        _ready(pgconn.socket, deadline, writing=True)


def answer(conn: psycopg.Connection[Any], deadline: float) -> Optional[str]:
    """Read every result of the query last sent on ``conn`` by ``deadline``: None when all
    succeeded, else the SQLSTATE of the failure.

    Raises:
        Late: the answer was not all in by then.
        psycopg.OperationalError: the connection failed.
    """
    pgconn, failed = conn.pgconn, None
    while True:
        while pgconn.is_busy():  # reads only what has arrived: libpq never blocks here
            _ready(pgconn.socket, deadline, writing=False)
            pgconn.consume_input()
        result = pgconn.get_result()
        if result is None:
            return failed
        if result.status == psycopg.pq.ExecStatus.FATAL_ERROR and failed is None:
            failed = (result.error_field(psycopg.pq.DiagnosticField.SQLSTATE) or b"?").decode()
        elif result.status not in (psycopg.pq.ExecStatus.COMMAND_OK,
                                   psycopg.pq.ExecStatus.TUPLES_OK,
                                   psycopg.pq.ExecStatus.FATAL_ERROR):
            failed = failed or "?"


def _ready(fd: int, deadline: float, *, writing: bool) -> None:
    """Wait (releasing the GIL) until ``fd`` may be read or written, until ``deadline``."""
    left = deadline - time.monotonic()
    if left > 0:
        readable, writable, _ = select.select([] if writing else [fd], [fd] if writing else [],
                                              [], left)
        if readable or writable:
            return
    raise Late("the server did not answer the waiting line in time")


def close_quietly(conn: psycopg.Connection[Any]) -> None:
    with contextlib.suppress(Exception):
        conn.close()


class WaiterInLine:
    """A waiter that sleeps on LISTEN once at the front of its name's line, in line before.

    Reaching the front ends a wait: the waiter before it took the permit or gave up, so
    this one looks at once (the caller looks after every wait) and then sleeps on the
    releases.
    """

    def __init__(self, woken: Waiter, place: Place) -> None:
        self._woken = woken
        self._place = place

    @property
    def in_line(self) -> bool:
        """Waiting for the front (see ``base.in_line``)."""
        return not (self._place.front or self._place.unusable)

    def wait(self, timeout: float) -> bool:
        if self.in_line:
            return self._place.take(timeout)
        return self._woken.wait(timeout)
