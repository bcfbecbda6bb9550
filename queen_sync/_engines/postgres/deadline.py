"""Client-side bounds on PostgreSQL calls: a frozen server cannot hold a caller past its timeout.

A server that is stopped, or whose machine is paused, may still have its kernel
acknowledge every packet, so neither TCP keepalives nor ``tcp_user_timeout``
notice, and ``statement_timeout`` never fires; libpq would wait for the answer
forever. One watchdog thread per engine shuts down the socket of a connection
whose call is past its deadline: the blocked read fails at once, the caller
discards the connection and reports that the server did not answer in time.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from typing import Any, Callable, Iterator, Optional

import psycopg

log = logging.getLogger("queen_sync")


class Watch:
    """One connection watched until a deadline (``time.monotonic()`` seconds)."""

    __slots__ = ("conn", "deadline", "fired")

    def __init__(self, conn: psycopg.Connection[Any], deadline: float) -> None:
        self.conn = conn
        self.deadline = deadline
        self.fired = False


def shut_down(conn: psycopg.Connection[Any]) -> None:
    """End the connection's socket for reading and writing, without closing psycopg's fd.

    ``fromfd`` works on a duplicate of the descriptor; a shutdown acts on the socket
    both share, and closing the duplicate leaves the original for psycopg to close.
    """
    with contextlib.suppress(OSError, ValueError, psycopg.Error):
        duplicate = socket.fromfd(conn.pgconn.socket, socket.AF_INET, socket.SOCK_STREAM)
        try:
            duplicate.shutdown(socket.SHUT_RDWR)
        finally:
            duplicate.close()


class Watchdog:
    """Shuts down the socket of every watched connection still watched at its deadline.

    Firing and unwatching take the same lock, so a connection is never shut down
    after its caller has stopped watching it (and perhaps handed it to another).
    """

    def __init__(self) -> None:
        self._watches: set[Watch] = set()
        self._cond = threading.Condition()
        self._next_look = float("inf")
        self._thread: Optional[threading.Thread] = None
        self._stopping = False

    def watch(self, conn: psycopg.Connection[Any], deadline: float) -> Watch:
        watch = Watch(conn, deadline)
        with self._cond:
            self._watches.add(watch)
            if self._thread is None and not self._stopping:
                self._thread = threading.Thread(target=self._loop, daemon=True,
                                                name="queen_sync-pg-watchdog")
                self._thread.start()
            if deadline < self._next_look:
                self._cond.notify()
        return watch

    def unwatch(self, watch: Watch) -> bool:
        """Stop watching; True when the deadline had already passed and the socket is shut."""
        with self._cond:
            self._watches.discard(watch)
            return watch.fired

    @contextlib.contextmanager
    def watching(self, conn: psycopg.Connection[Any], deadline: float) -> Iterator[Watch]:
        watch = self.watch(conn, deadline)
        try:
            yield watch
        finally:
            self.unwatch(watch)

    def _loop(self) -> None:
        with self._cond:
            while not self._stopping:
                try:
                    self._fire_due()
                except Exception:  # a watchdog that dies would leave every call unbounded
                    log.exception("queen_sync PostgreSQL watchdog failed; continuing")
                    self._next_look = time.monotonic() + 0.1
                wait = self._next_look - time.monotonic()
                self._cond.wait(None if wait == float("inf") else max(0.0, wait))

    def _fire_due(self) -> None:
        now = time.monotonic()
        for watch in [w for w in self._watches if w.deadline <= now]:
            self._watches.discard(watch)
            watch.fired = True
            shut_down(watch.conn)
        self._next_look = min((w.deadline for w in self._watches), default=float("inf"))

    def close(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(5.0)


def connect_within(connect: Callable[[], psycopg.Connection[Any]],
                   deadline: float) -> psycopg.Connection[Any]:
    """``connect()``, given up on at ``deadline`` (``time.monotonic()`` seconds).

    A handshake has no connection to watch yet, and libpq waits at least 2 s for one,
    so the attempt runs in a thread of its own and the caller stops waiting at the
    deadline; a connection that arrives after that is closed by that thread.
    """
    done = threading.Event()
    outcome: list[Any] = []
    mutex = threading.Lock()

    def attempt() -> None:
        try:
            made: Any = connect()
        except Exception as exc:  # handed to the caller, or logged once it has left
            made = exc
        with mutex:
            outcome.append(made)
            abandoned = done.is_set()
            done.set()
        if abandoned:
            _dispose(made)

    threading.Thread(target=attempt, daemon=True, name="queen_sync-pg-connect").start()
    done.wait(max(0.0, deadline - time.monotonic()))
    with mutex:
        if not outcome:
            done.set()  # the attempt sees this and closes whatever it makes
            raise psycopg.errors.ConnectionTimeout(
                "the server did not complete the connection handshake by the call's deadline")
    if isinstance(outcome[0], Exception):
        raise outcome[0]
    conn: psycopg.Connection[Any] = outcome[0]
    return conn


def _dispose(made: Any) -> None:
    """What a connection attempt left after its caller stopped waiting."""
    if isinstance(made, Exception):
        log.debug("a PostgreSQL connection attempt given up on failed: %s",
                  type(made).__name__)
    else:
        made.close()
