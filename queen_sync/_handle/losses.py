"""Where a client's loss handlers run: off the renewer, one lane per lease, a bounded pool.

A lost lease is a safety signal, so one lease's slow handler must not hold back
another's. Each lease gets a lane: its handlers run one at a time, in the order
they were dispatched. Lanes are served by at most ``MAX_WORKERS`` threads, started
on demand and ended after ``IDLE_SECONDS`` without work, so 10,000 leases lost at
once queue up behind a few threads instead of starting 10,000.

queen_sync's own reactions (a ``Reaction``: ``@singleton_job``'s interrupt and exit)
never run in that pool, where user code may be stuck: they have a thread of their
own, which runs nothing else, and start at once even when every worker is busy.
"""

from __future__ import annotations

import collections
import itertools
import logging
import threading
import time
from typing import Any, Callable, Deque, Optional

log = logging.getLogger("queen_sync")

MAX_WORKERS = 8  # threads running user handlers per client (see the module docstring)
IDLE_SECONDS = 0.5  # a worker with nothing to do for this long ends

Handler = Callable[[str], Any]


class Reaction:
    """A loss handler of queen_sync's own that stops work done under a lost lease.

    It must return promptly and never call user code: it runs on the reactions
    thread, ahead of and beside the lease's other handlers.
    """

    __slots__ = ("_fn",)

    def __init__(self, fn: Handler) -> None:
        self._fn = fn

    def __call__(self, reason: str) -> Any:
        return self._fn(reason)


class _Lane:
    """The handlers of one lease still to run; it exists while queued or running."""

    __slots__ = ("handlers", "lease")

    def __init__(self, lease: object) -> None:
        self.lease = lease  # kept alive so that its id() names this lane alone
        self.handlers: Deque[tuple[Handler, str]] = collections.deque()


class _Pool:
    """Lanes served in turn by at most ``width`` threads named ``name``."""

    def __init__(self, name: str, width: int) -> None:
        self._name = name
        self._width = width
        self._state = threading.Condition(threading.Lock())
        self._lanes: dict[int, _Lane] = {}
        self._ready: Deque[int] = collections.deque()  # lanes queued, none of them running
        self._workers = 0
        self._busy = 0
        self._mine: set[int] = set()  # idents of this pool's threads
        self._anonymous = itertools.count()

    def put(self, handler: Handler, reason: str, lease: Optional[object]) -> None:
        with self._state:
            key = id(lease) if lease is not None else -1 - next(self._anonymous)
            lane = self._lanes.get(key)
            if lane is None:  # a lane exists only while queued or running: queue it
                lane = self._lanes[key] = _Lane(lease)
                self._ready.append(key)
            lane.handlers.append((handler, reason))
            self._state.notify()
            if self._workers - self._busy < len(self._ready) and self._workers < self._width:
                self._start_worker()

    def _start_worker(self) -> None:
        worker = threading.Thread(target=self._work, name=self._name, daemon=True)
        try:
            worker.start()
        except RuntimeError:
            # No thread can start (interpreter shutdown, or none left): a worker already
            # running drains the queue; with none, say so rather than drop it silently.
            if self._workers == 0:
                log.error("no thread could be started to run on_lost handlers; "
                          "%d lease(s) wait for one", len(self._lanes))
            return
        self._workers += 1

    def _work(self) -> None:
        self._mine.add(threading.get_ident())
        try:
            while True:
                taken = self._take()
                if taken is None:
                    return
                key, lane, handler, reason = taken
                _run(handler, reason)
                self._finish(key, lane)
        finally:
            self._mine.discard(threading.get_ident())

    def _take(self) -> Optional[tuple[int, _Lane, Handler, str]]:
        with self._state:
            while not self._ready:
                if not self._state.wait(IDLE_SECONDS) and not self._ready:
                    self._workers -= 1
                    return None
            key = self._ready.popleft()
            lane = self._lanes[key]
            handler, reason = lane.handlers.popleft()
            self._busy += 1
            return key, lane, handler, reason

    def _finish(self, key: int, lane: _Lane) -> None:
        with self._state:
            self._busy -= 1
            if lane.handlers:
                self._ready.append(key)  # to the back: other leases get their turn first
                self._state.notify()
            else:
                del self._lanes[key]
                self._state.notify_all()  # wakes drain() too

    def pending(self) -> int:
        """Leases with a handler queued or running."""
        with self._state:
            return len(self._lanes)

    def drain(self, deadline: float, caller: Optional[int] = None) -> int:
        """Wait until no handler is queued or running, or ``deadline``; what is left.

        For one of this pool's own threads (``caller``, else this one) it does not wait:
        that thread's handler would be waiting for itself.
        """
        with self._state:
            if (threading.get_ident() if caller is None else caller) in self._mine:
                return len(self._lanes)
            while self._lanes:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._state.wait(left)
            return len(self._lanes)


def _run(handler: Handler, reason: str) -> None:
    try:
        handler(reason)
    except BaseException:  # even SystemExit: the worker serves other handlers after it
        log.exception("an on_lost handler raised; other handlers and renewal go on")


class LossDispatcher:
    """A client's loss handlers: user handlers per lease in a bounded pool, reactions apart."""

    def __init__(self, workers: int = MAX_WORKERS) -> None:
        self._handlers = _Pool("queen_sync-on-lost", workers)
        # Two threads: a reaction is short, but one may wait briefly on a log handler.
        self._reactions = _Pool("queen_sync-loss-reaction", 2)

    def dispatch(self, handler: Handler, reason: str, lease: Optional[object] = None) -> None:
        """Run ``handler(reason)`` soon on another thread, after ``lease``'s earlier handlers.

        With ``lease`` None the handler is ordered with nothing.
        """
        pool = self._reactions if isinstance(handler, Reaction) else self._handlers
        pool.put(handler, reason, lease)

    def drain(self, timeout: float, caller: Optional[int] = None) -> int:
        """Wait up to ``timeout`` seconds for every queued handler to end; leases left.

        Not for the handler of ``caller`` (else this thread), which waits for this.
        """
        deadline = time.monotonic() + max(0.0, timeout)
        left = self._reactions.drain(deadline, caller)
        return left + self._handlers.drain(deadline, caller)

    def pending(self) -> int:
        """Leases with a handler queued or running."""
        return self._reactions.pending() + self._handlers.pending()
