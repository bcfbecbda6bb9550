"""Wake-up on release for the PostgreSQL engine: one LISTEN connection per engine.

A release NOTIFYs the schema's channel with the lock name, inside the
transaction that frees the permit, so the notification is delivered exactly
when the release commits. One background thread per engine listens and wakes
the waiters registered for that name. Waiters still time out and retry, so a
notification lost while the listener reconnects only costs latency; every
waiter is woken after a reconnect, since releases may have been missed.

A release frees one permit, so it wakes ONE thread of this process waiting on
the name, the longest waiting: waking them all would send all but one to lose a
round trip to the winner. A waiter that leaves after it was woken (it took the
permit, or it gave up) hands the turn on to the next, so the others get theirs:
a release of several permits of a name in one transaction notifies once.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import threading
from typing import Any, Callable, ContextManager, Iterator, Optional

import psycopg

log = logging.getLogger("queen_sync")

_RECONNECT_MAX = 1.0


class PgWaiter:
    """Woken when a permit of its lock name is released anywhere on the database.

    A wake given while the waiter is not waiting is kept: its next wait returns at once.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._pending = False
        self.waiting = False  # inside wait() now
        self.woken = False  # its last wait ended with a wake

    @property
    def pending(self) -> bool:
        """A wake not yet taken by a wait."""
        return self._pending

    def wake(self) -> None:
        with self._cond:
            self._pending = True
            self._cond.notify()

    def wait(self, timeout: float) -> bool:
        """Block up to ``timeout`` seconds; True when woken by a release."""
        with self._cond:
            if not self._pending:
                self.waiting = True
                try:
                    self._cond.wait(max(0.0, timeout))
                finally:
                    self.waiting = False
            woke, self._pending = self._pending, False
            self.woken = woke
            return woke


class Listener:
    """A LISTEN connection and the thread that dispatches its notifications by lock name.

    Args:
        connect: opens a new autocommit connection (driver errors propagate).
        channel: the channel releases are notified on.
        bounded: a context bounding one statement on a connection (a frozen server
            must not hold the LISTEN forever: the listener reconnects instead).
    """

    def __init__(self, connect: Callable[[], psycopg.Connection[Any]], channel: str,
                 bounded: Optional[Callable[[psycopg.Connection[Any]], ContextManager[Any]]]
                 = None) -> None:
        self._connect = connect
        self._bounded = bounded or (lambda conn: contextlib.nullcontext())
        self._channel = channel
        self._waiters: dict[str, list[PgWaiter]] = {}  # oldest first
        self._mutex = threading.Lock()
        self._listening = threading.Event()
        self._tried = threading.Event()
        self._stopping = threading.Event()
        self._wake_r, self._wake_w = os.pipe()
        self._thread = threading.Thread(target=self._loop, name="queen_sync-pg-listen",
                                        daemon=True)
        self._thread.start()

    def ready(self, timeout: float) -> bool:
        """Wait for the first attempt to LISTEN; True when LISTEN is in effect.

        Waiting once means no release after this call is missed; after a failed attempt
        nobody waits again (waiters poll) until the listener reconnects.
        """
        self._tried.wait(timeout)
        return self._listening.is_set()

    @contextlib.contextmanager
    def subscribe(self, name: str) -> Iterator[PgWaiter]:
        waiter = PgWaiter()
        with self._mutex:
            self._waiters.setdefault(name, []).append(waiter)
        try:
            yield waiter
        finally:
            self._unsubscribe(name, waiter)

    def _unsubscribe(self, name: str, waiter: PgWaiter) -> None:
        """Forget ``waiter``; one that leaves woken hands the turn to the next waiter."""
        with self._mutex:
            group = self._waiters.get(name, [])
            if waiter in group:
                group.remove(waiter)
            if not group:
                self._waiters.pop(name, None)
            elif waiter.pending or waiter.woken:
                self._wake_next(group)

    @staticmethod
    def _wake_next(group: list[PgWaiter]) -> None:
        """Wake the oldest waiter asleep in ``wait``, else the oldest busy one (under the mutex).

        A busy waiter was woken and is trying: a second release is another's turn. When all
        are busy, the kept wake makes one look again as soon as it would sleep.
        """
        idle = [waiter for waiter in group if not waiter.pending]
        for waiter in idle:
            if waiter.waiting:
                waiter.wake()
                return
        if idle:
            idle[0].wake()

    def _wake(self, name: str) -> None:
        """One release of ``name``: one of its waiters tries."""
        with self._mutex:
            group = self._waiters.get(name)
            if group:
                self._wake_next(group)

    def _wake_all(self) -> None:
        with self._mutex:
            for group in self._waiters.values():
                for waiter in group:
                    waiter.wake()

    def _loop(self) -> None:
        delay = 0.05
        while not self._stopping.is_set():
            try:
                with self._connect() as conn:
                    with self._bounded(conn):
                        conn.execute(f'LISTEN "{self._channel}"')
                    self._listening.set()
                    self._tried.set()
                    self._wake_all()
                    delay = 0.05
                    self._pump(conn)
            except psycopg.Error as exc:
                log.debug("queen_sync LISTEN connection failed: %s", exc)
            finally:
                self._listening.clear()
                self._tried.set()
            self._stopping.wait(delay)
            delay = min(delay * 2, _RECONNECT_MAX)

    def _pump(self, conn: psycopg.Connection[Any]) -> None:
        pgconn = conn.pgconn
        while not self._stopping.is_set():
            readable, _, _ = select.select([pgconn.socket, self._wake_r], [], [], 60.0)
            if self._wake_r in readable:
                os.read(self._wake_r, 64)
                continue
            pgconn.consume_input()
            while True:
                note = pgconn.notifies()
                if note is None:
                    break
                self._wake(note.extra.decode("utf-8", "replace"))
            if pgconn.status != psycopg.pq.ConnStatus.OK:
                raise psycopg.OperationalError("the LISTEN connection was lost")

    def close(self) -> None:
        self._stopping.set()
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"!")
        self._thread.join(5.0)
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)

    def abandon(self) -> None:
        """In a forked child: the thread is gone; only the pipe is ours to close."""
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)
