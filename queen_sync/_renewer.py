"""The renewer: ONE daemon thread per client, renewing every due lease in ONE batched call.

Each tick it marks lost every lease past its local deadline (``expired``), then
sends one ``locks`` call renewing every lease that is due, together with those
due within 60% of their renew period: leases taken at scattered moments then fall
into one batch instead of one call each. A call that fails is not a loss: those
leases are retried sooner, until their deadline. The thread exits when nothing
has been held for a moment (so a tight acquire/release loop does not start one
thread per acquire) and comes back when something is.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from ._client import Queen
    from ._lock import Lock

log = logging.getLogger("queen_sync")

_IDLE_CHECK = 60.0
_LINGER = 0.5  # seconds the thread stays with nothing held before it exits
_TAKE_ALONG = 0.6  # a due call also renews leases due within this share of their period


class Renewer:
    """Keeps a client's held leases alive; ``tick()`` is one pass, the thread loops it."""

    def __init__(self, client: Queen) -> None:
        self._client = client
        self._reset()

    def _reset(self) -> None:
        self._mutex = threading.Lock()
        self._locks: dict[int, Lock] = {}
        self._thread: Optional[threading.Thread] = None
        self._wake = threading.Event()
        self._stopping = False
        self._planned = 0.0  # when the thread means to tick next; 0 while it is ticking
        self.ticks = 0
        self.calls = 0

    def register(self, lock: Lock) -> None:
        with self._mutex:
            self._locks[id(lock)] = lock
            if self._thread is None and not self._stopping and self._client._threaded:
                self._thread = threading.Thread(target=self._loop, name="queen_sync-renewer",
                                                daemon=True)
                self._thread.start()
            planned = self._planned
        # Wake the thread only when this lease needs it before it means to look anyway.
        if planned <= 0.0 or min(lock._next_renew, lock._deadline) < planned:
            self._wake.set()

    def unregister(self, lock: Lock) -> None:
        with self._mutex:
            self._locks.pop(id(lock), None)
            idle = not self._locks
            planned = self._planned
        if idle and (planned <= 0.0 or planned > self._client._clock.monotonic() + _LINGER):
            self._wake.set()  # let the thread see it has nothing left, linger, then exit

    def held(self) -> list[Lock]:
        with self._mutex:
            return list(self._locks.values())

    @property
    def thread(self) -> Optional[threading.Thread]:
        return self._thread

    def tick(self) -> float:
        """One pass: expire, then renew what is due in one call. Returns seconds to the next."""
        clock = self._client._clock
        now = clock.monotonic()
        self.ticks += 1
        live = []
        for lock in self.held():
            if now >= lock._deadline:
                lock._lose("expired")
            else:
                live.append(lock)
        due = [lock for lock in live if lock._next_renew <= now]
        if due:
            # The call goes out anyway: take along what falls due soon, so batches merge.
            # Past half a period, two batches always meet: one of them takes the other along.
            due += [lock for lock in live
                    if now < lock._next_renew <= now + lock.renew_every * _TAKE_ALONG]
            self._renew(due)
        return self._next_wake(clock.monotonic())

    def _renew(self, due: list[Lock]) -> None:
        batch = [lock for lock in due if lock._io.acquire(blocking=False)]
        try:
            pairs = [(lock, op) for lock in batch if (op := lock._renew_op()) is not None]
            if not pairs:
                return
            clock = self._client._clock
            sent_at = clock.monotonic()
            self.calls += 1
            try:
                answers = self._client._call_locks([op for _, op in pairs])
            except Exception as exc:
                log.warning("renewing %d lease(s) failed, retrying before their deadlines: %s",
                            len(pairs), exc)
                self._client.metrics.count("renew_error")
                now = clock.monotonic()
                for lock, _ in pairs:
                    lock._renew_failed(now)
                return
            self._client.metrics.observe("renew_rtt_seconds", clock.monotonic() - sent_at)
            for (lock, _), answer in zip(pairs, answers):
                lock._renewed(answer, sent_at)
        finally:
            for lock in batch:
                lock._io.release()

    def _next_wake(self, now: float) -> float:
        times = [min(lock._next_renew, lock._deadline) for lock in self.held()]
        return max(0.0, min(times, default=now + _IDLE_CHECK) - now)

    def _loop(self) -> None:
        clock = self._client._clock
        idle_since: Optional[float] = None
        while True:
            self._wake.clear()  # before looking, so a register from now on is never missed
            with self._mutex:
                self._planned = 0.0
                now = clock.monotonic()
                if self._locks:
                    idle_since = None
                elif idle_since is None:
                    idle_since = now
                if self._stopping or (idle_since is not None and now >= idle_since + _LINGER):
                    self._thread = None
                    return
                if idle_since is not None:
                    self._planned = idle_since + _LINGER
            if idle_since is not None:
                clock.wait(self._wake, self._planned - now)
                continue
            try:
                delay = self.tick()
            except Exception:
                # Never die silently: log, and keep renewing the others.
                log.exception("queen_sync renewer tick failed; continuing")
                delay = 0.1
            self._planned = clock.monotonic() + delay
            clock.wait(self._wake, delay)

    def stop(self, timeout: float = 2.0) -> None:
        with self._mutex:
            self._stopping = True
            thread = self._thread
        self._wake.set()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def after_fork(self) -> None:
        self._reset()
