"""The renewer: ONE daemon thread per client, renewing every due lease in ONE batched call.

Each tick it marks lost every lease past its local deadline (``expired``), then
sends one ``locks`` call renewing every lease that is due, together with those
due within 60% of their renew period: leases taken at scattered moments then fall
into one batch instead of one call each. A call that fails is not a loss: those
leases are retried sooner, until their deadline; a store that was replaced
(``StoreReplacedError``) ends them at once. The thread exits when nothing has
been held for a moment (so a tight acquire/release loop does not start one
thread per acquire) and comes back when something is.

The renewer never blocks in an engine call itself: the call runs on a
short-lived thread while the renewer waits for it no longer than the nearest
local deadline, marking leases lost as their deadlines pass, so ``lost`` and the
``on_lost`` handlers fire on time however long the engine takes. An answer that
comes after a lease's deadline does not revive it; the permit it renewed is
given back.

It also gives the leases it keeps back in batches when the client closes or calls
``release_all()`` (``give_back``): a few calls for thousands of leases, none started
past the caller's deadline, failures counted for one summary line, not logged each.
"""

from __future__ import annotations

import logging
import math
import threading
import time
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional

from .._clock import WakeFlag
from .._errors import ProtocolError, StoreReplacedError
from .interrupts import interrupts_held
from .lock import late_release_op

if TYPE_CHECKING:
    from .caller import Caller
    from .lock import Lock

log = logging.getLogger("queen_sync")

_IDLE_CHECK = 60.0
_LINGER = 0.5  # seconds the thread stays with nothing held before it exits
_TAKE_ALONG = 0.6  # a due call also renews leases due within this share of their period
_BUSY_RETRY = 0.1  # seconds before looking again at a lease a manual renew/release is using
# Releases sent in one call by ``give_back``: few calls for thousands of leases, while one
# call stays far inside any engine's timeout (PostgreSQL runs it as one transaction).
RELEASES_PER_CALL = 256


@dataclass
class GiveBack:
    """What ``Renewer.give_back`` did so far (read while it may still be running).

    Attributes:
        leases: the handles it was given.
        done: those given back, or found no longer held (nothing left to give back).
        error: the last failure of a call, for the summary line.
    """

    leases: int
    done: int = 0
    error: Optional[BaseException] = None

    @property
    def left(self) -> int:
        """Handles whose permits may still be held: they expire by themselves."""
        return self.leases - self.done

    def summary(self, what: str) -> str:
        """One line on what is left (secrets never reach it: engine errors are redacted)."""
        why = f" ({type(self.error).__name__}: {self.error})" if self.error else ""
        return (f"{what}: {self.left} of {self.leases} lease(s) were not given back{why}; "
                "they expire by themselves within their TTL")


class _Call:
    """One engine call on a short-lived thread, so that its caller can wait for it bounded."""

    def __init__(self, work: Callable[[], Any]) -> None:
        self._work = work
        self.done = threading.Event()
        self.value: Any = None
        self.error: Optional[BaseException] = None

    def start(self) -> _Call:
        try:
            threading.Thread(target=self._run, name="queen_sync-call", daemon=True).start()
        except RuntimeError:
            self._run()  # no new threads at interpreter exit: call here, bounded by the engine
        return self

    def _run(self) -> None:
        try:
            self.value = self._work()
        except BaseException as exc:  # handed to the waiting renewer, which logs it
            self.error = exc
        finally:
            self.done.set()


class Renewer:
    """Keeps a client's held leases alive; ``tick()`` is one pass, the thread loops it."""

    def __init__(self, client: Caller) -> None:
        self._client = client
        self._reset()

    def _reset(self) -> None:
        self._mutex = threading.Lock()
        self._locks: dict[int, Lock] = {}
        self._thread: Optional[threading.Thread] = None
        self._wake = WakeFlag()  # set from the main thread, where a signal may land
        self._stopping = False
        self._planned = 0.0  # when the thread means to tick next; 0 while it is ticking
        self._deferred: dict[int, float] = {}  # lease id -> when to try one whose call was busy
        self._told: weakref.WeakSet[Lock] = weakref.WeakSet()  # unreadable answers logged
        self._strays: weakref.WeakSet[Lock] = weakref.WeakSet()  # see ``watch_for_strays``
        self.ticks = 0
        self.calls = 0

    def register(self, lock: Lock) -> None:
        with self._mutex:
            self._locks[id(lock)] = lock
            if self._thread is None and not self._stopping and self._client.renew_thread:
                thread = threading.Thread(target=self._loop, name="queen_sync-renewer",
                                          daemon=True)
                self._thread = thread
                try:
                    # In a hold: a signal's exception out of start() would leave the thread
                    # started but unlisted, and the standard library then kills it.
                    with interrupts_held():
                        thread.start()
                except BaseException:
                    if thread.ident is None:  # never started (a Ctrl-C in start()): the next
                        self._thread = None  # lease starts one; else this one runs
                    raise
            planned = self._planned
        # Wake the thread only when this lease needs it before it means to look anyway.
        if planned <= 0.0 or lock.renew_due < planned or lock.deadline < planned:
            self._wake.set()

    def unregister(self, lock: Lock) -> None:
        with self._mutex:
            self._locks.pop(id(lock), None)
            self._deferred.pop(id(lock), None)
            idle = not self._locks
            planned = self._planned
        if idle and (planned <= 0.0 or planned > self._client.clock.monotonic() + _LINGER):
            self._wake.set()  # let the thread see it has nothing left, linger, then exit

    def held(self) -> list[Lock]:
        with self._mutex:
            return list(self._locks.values())

    @property
    def thread(self) -> Optional[threading.Thread]:
        return self._thread

    def tick(self) -> float:
        """One pass: expire, then renew what is due in one call. Returns seconds to the next."""
        clock = self._client.clock
        now = clock.monotonic()
        self.ticks += 1
        live, nearest = self._expire(now)
        due = self._due(live, now)
        if due:
            self._renew(due, now, nearest)
        return self._next_wake(clock.monotonic())

    def _expire(self, now: float) -> tuple[list[Lock], float]:
        """Mark lost every lease past its local deadline; return the others, and the nearest
        of their deadlines (``now + _IDLE_CHECK`` when there are none)."""
        live = []
        nearest = now + _IDLE_CHECK
        for lock in self.held():
            deadline = lock.deadline
            if now < deadline:
                live.append(lock)
                if deadline < nearest:
                    nearest = deadline
            else:
                # Judged for the lease read here: one taken afresh since then stays held.
                lock.mark_lost("expired", past=now)
        return live, nearest

    def _due(self, live: list[Lock], now: float) -> list[Lock]:
        """The leases of ``live`` due now (none deferred), and those due soon when any is.

        The call goes out anyway: taking along what falls due soon merges batches. Past
        half a period, two batches always meet: one of them takes the other along.
        """
        due: list[Lock] = []
        soon: list[Lock] = []
        deferred = self._deferred
        for lock in live:
            renew_due = lock.renew_due
            if renew_due <= now:
                if not deferred or deferred.get(id(lock), 0.0) <= now:
                    due.append(lock)
            elif renew_due <= now + lock.renew_every * _TAKE_ALONG:
                soon.append(lock)
        return due + soon if due else due

    def _renew(self, due: list[Lock], now: float, nearest: float) -> None:
        """Renew ``due`` in one call; ``nearest`` is the first local deadline of any lease."""
        batch = []
        deferred = self._deferred
        for lock in due:
            if lock.try_begin_call():
                batch.append(lock)
                if deferred:
                    deferred.pop(id(lock), None)
            else:  # a manual renew or release is using it: look again soon, do not spin
                deferred[id(lock)] = now + _BUSY_RETRY
        try:
            sending, ops = self._renew_ops(batch)
            if ops:
                self._send(sending, ops, nearest)
        finally:
            for lock in batch:
                lock.end_call()

    def _renew_ops(self, batch: list[Lock]) -> tuple[list[Lock], list[dict[str, Any]]]:
        """The leases of ``batch`` that hold, and their renew ops in the same order.

        A lease whose op cannot be built (a bug, or a handle set to garbage) fails alone,
        as a failed renew: retried until its deadline while the others are renewed.
        """
        sending: list[Lock] = []
        ops: list[dict[str, Any]] = []
        for lock in batch:
            try:
                op = lock.renew_op()
            except Exception as exc:
                log.error("queen_sync renewer tick failed for lock %r; retrying it before "
                          "its deadline: %r", lock.name, exc)
                self._client.metrics.count("renew_error")
                lock.renewal_failed(self._client.clock.monotonic())
                continue
            if op is not None:
                sending.append(lock)
                ops.append(op)
        return sending, ops

    def _send(self, locks: list[Lock], ops: list[dict[str, Any]], nearest: float) -> None:
        """Send ``ops`` renewing ``locks`` (their calls begun) in one call, without blocking
        past a deadline; ``nearest`` is the first local deadline of any lease."""
        clock = self._client.clock
        sent_at = clock.monotonic()
        self.calls += 1
        call = self._await(_Call(lambda: self._client.call_locks(ops)).start(), nearest)
        if call.error is not None:
            self._failed(locks, call.error, sent_at)
            return
        landed = clock.monotonic()
        self._client.metrics.observe("renew_rtt_seconds", landed - sent_at)
        late = self._apply(locks, call.value, sent_at, landed)
        if late:
            self._give_back(late)

    def _apply(self, locks: list[Lock], answers: list[Any], sent_at: float,
               landed: float) -> list[dict[str, Any]]:
        """Apply each answer to its lease, all judged at ``landed`` (when the call came back).

        The metrics are updated once for the batch. Returns the release ops of permits
        renewed after their leases' deadlines. An answer naming no usable permit fails
        its lease alone, as a renew whose answer was lost.
        """
        renewed, beaten, late, unreadable = 0, math.inf, [], 0
        told = self._told
        for lock, answer in zip(locks, answers):
            try:
                deadline = lock.take_renewal(answer, sent_at, landed)
            except ProtocolError as exc:
                unreadable += 1
                self._unreadable(lock, exc)
                lock.renewal_failed(landed, sent_at)
                continue
            if told:  # read well again: a later unreadable answer is news
                told.discard(lock)
            if deadline is not None:
                renewed += 1
                if deadline < beaten:
                    beaten = deadline
            elif answer.get("renewed"):
                late.append(late_release_op(lock, answer))
        metrics = self._client.metrics
        metrics.renewals(renewed, margin=beaten - sent_at)
        if unreadable:
            metrics.count("renew_error", unreadable)
        return late

    def _unreadable(self, lock: Lock, error: ProtocolError) -> None:
        """Log a lease's unreadable renew answer once until one reads well: it is retried
        every few tenths of a second, and a line each time would bury everything else."""
        if lock in self._told:
            log.debug("renewing lock %r failed again (%s)", lock.name, error)
            return
        self._told.add(lock)
        log.error("renewing lock %r failed (%s); retrying it before its deadline, and not "
                  "logging it again until an answer reads well", lock.name, error)

    def _await(self, call: _Call, nearest: float) -> _Call:
        """Wait for ``call``, waking at each local deadline to mark those leases lost.

        ``nearest`` is the first deadline when the call started: a deadline only moves
        later or goes with its lease, so the first wait needs no pass over every lease.
        """
        clock = self._client.clock
        while not call.done.is_set():
            clock.wait(call.done, nearest - clock.monotonic())
            if not call.done.is_set():
                _, nearest = self._expire(clock.monotonic())
        return call

    def _failed(self, locks: list[Lock], error: BaseException, sent_at: float) -> None:
        if isinstance(error, StoreReplacedError):
            log.error("the store was replaced; %d lease(s) renewed there are lost: %s",
                      len(locks), error)
            for lock in locks:
                lock.mark_lost("renew")
            return
        log.warning("renewing %d lease(s) failed, retrying before their deadlines: %s: %s",
                    len(locks), type(error).__name__, error)
        self._client.metrics.count("renew_error")
        now = self._client.clock.monotonic()
        for lock in locks:
            lock.renewal_failed(now, sent_at)

    def _give_back(self, ops: list[dict[str, Any]]) -> None:
        """Release permits renewed by answers that came after their leases' deadlines."""
        nearest = self._expire(self._client.clock.monotonic())[1]
        call = self._await(_Call(lambda: self._client.call_locks(ops)).start(), nearest)
        if call.error is not None:
            log.warning("could not give back %d permit(s) renewed too late; they expire by "
                        "themselves: %r", len(ops), call.error)

    def watch_for_strays(self, lock: Lock) -> None:
        """``lock``'s acquire was resent after a send that may still land and take a permit
        for it when it no longer holds: ``give_back`` looks for one."""
        self._strays.add(lock)

    @property
    def watching_strays(self) -> bool:
        """Whether ``give_back`` has stray permits to look for, even with nothing held."""
        return bool(self._strays)

    def give_back(self, locks: list[Lock], tally: GiveBack, deadline: float = float("inf"),
                  losing: Optional[str] = None) -> GiveBack:
        """Release ``locks`` in batches of ``RELEASES_PER_CALL``, starting none past ``deadline``.

        ``losing``: the reason a lease still in use by a block is lost (``begin_release``).

        Then, within the same ``deadline``, the permits late first sends of acquires took
        for handles holding nothing (``watch_for_strays``). ``deadline`` is on
        ``time.monotonic()``. Failures are counted in ``tally``, never logged here: the
        caller logs one line for all of them.
        """
        for start in range(0, len(locks), RELEASES_PER_CALL):
            if time.monotonic() >= deadline:
                break
            self._give_back_batch(locks[start:start + RELEASES_PER_CALL], tally, losing)
        self._give_back_strays(deadline)
        return tally

    def _give_back_strays(self, deadline: float) -> None:
        for lock in list(self._strays):
            if time.monotonic() >= deadline:
                return
            if not lock.try_begin_call():
                continue  # an acquire or release of it is in flight: it knows its permit
            try:
                self._strays.discard(lock)
                lock.release_strays()
            except Exception as exc:  # best effort: a stray permit expires by itself
                log.info("could not look for a stray permit of lock %r: %r", lock.name, exc)
            finally:
                lock.end_call()

    def _give_back_batch(self, locks: list[Lock], tally: GiveBack,
                         losing: Optional[str]) -> None:
        claimed: list[Lock] = []
        busy: list[Lock] = []
        for lock in locks:
            (claimed if lock.try_begin_call() else busy).append(lock)
        try:
            pairs = self._release_ops(claimed, tally, losing)
            if pairs:
                self._send_releases(pairs, tally)
        finally:
            for lock in claimed:
                lock.end_call()
        for lock in busy:  # another call of the handle is in flight: release after it lands
            try:
                lock.release()
                tally.done += 1
            except Exception as exc:
                tally.error = exc

    @staticmethod
    def _release_ops(claimed: list[Lock], tally: GiveBack, losing: Optional[str]
                     ) -> list[tuple[Lock, dict[str, Any]]]:
        """The release op of each lease of ``claimed`` that holds, each with its lease.

        A handle whose op cannot be built (set to garbage) is counted in ``tally`` and
        left out, so that the others are still given back.
        """
        pairs = []
        for lock in claimed:
            try:
                op = lock.begin_release(losing=losing)
            except Exception as exc:
                tally.error = exc
                continue
            if op is None:
                tally.done += 1  # held nothing: nothing to give back
            else:
                pairs.append((lock, op))
        return pairs

    def _send_releases(self, pairs: list[tuple[Lock, dict[str, Any]]], tally: GiveBack) -> None:
        try:
            answers = self._client.call_locks([op for _, op in pairs])
        except Exception as exc:
            tally.error = exc  # each handle keeps its token: release() retries it
            return
        for (lock, _), answer in zip(pairs, answers):
            try:
                lock.end_release(answer)
                tally.done += 1
            except Exception as exc:  # a lost-answer renew's permit could not be found
                tally.error = exc

    def _next_wake(self, now: float) -> float:
        """Seconds until the first lease is due or reaches its deadline."""
        deferred = self._deferred
        locks = self.held()
        if not locks:
            return _IDLE_CHECK
        first = math.inf
        for lock in locks:
            at = lock.renew_due
            if deferred:
                at = max(at, deferred.get(id(lock), 0.0))
            deadline = lock.deadline
            if deadline < at:
                at = deadline
            if at < first:
                first = at
        return max(0.0, first - now)

    def _loop(self) -> None:
        clock = self._client.clock
        idle_since: Optional[float] = None
        me = threading.current_thread()
        while True:
            self._wake.clear()  # before looking, so a register from now on is never missed
            with self._mutex:
                if self._thread is not me:
                    # A Ctrl-C cut the start() that made this thread short: register() took
                    # it for never started and may have started another. That one renews.
                    return
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
            except BaseException:  # even SystemExit: this thread must never die silently
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
        """In a forked child: its handles hold nothing, and this renewer starts afresh."""
        # The child has one thread: read the table without the mutex, which a parent
        # thread may have held at the fork and nobody will ever release here.
        for lock in list(self._locks.values()):
            lock.forget_after_fork()
        self._reset()
