"""``Queen``: the client facade over one engine, its handles and its renewer."""

from __future__ import annotations

import logging
import os
import threading
import time
from _thread import LockType
from typing import (
    Any,
    Callable,
    Mapping,
    Optional,
    Sequence,
    Union,
    overload,
)

from ._clock import SYSTEM_CLOCK, Clock
from ._durations import Duration, lifetime, wire_seconds
from ._engines import engine_from_url
from ._engines.base import Capabilities, Engine
from ._errors import ProtocolError, QueenError
from ._handle.kv import Kv
from ._handle.lock import Lock
from ._handle.losses import LossDispatcher
from ._handle.renewer import GiveBack, Renewer
from ._handle.transaction import Transaction
from ._metrics import Metrics
from ._ops import MAX_LIMIT, LockOps, check_int
from ._process import EXIT_BUDGET, ProcessBound, forget, track
from ._results import Result

log = logging.getLogger("queen_sync")

# Entries a client keeps for acquires in flight before it forgets those cut off by an
# interrupt: far more than the threads that acquire at once, so pruning is rare.
_FLIGHTS_KEPT = 64
# Seconds close() waits past its budget for the engine to close and the last handlers to
# end, before it leaves the rest to its closing thread.
_CLOSE_GRACE = 1.0


def default_url() -> str:
    """``QUEEN_URL``, else an SQLite file in the user's state directory."""
    url = os.environ.get("QUEEN_URL")
    if url:
        return url
    import platformdirs  # on first use only: most clients name their URL

    # Linux: $XDG_STATE_HOME, else ~/.local/state; macOS: ~/Library/Application Support.
    state = platformdirs.user_state_dir("queen_sync", appauthor=False)
    return "sqlite://" + os.path.join(state, "queen.db")


class Locks:
    """``q.locks``: the lock wire with no state kept; answers are truthy on the verdict."""

    op = LockOps

    def __init__(self, client: Queen) -> None:
        self._client = client

    def acquire(self, name: str, *, ttl_seconds: Optional[int] = None,
                ttl: Optional[Duration] = None, owner: Optional[str] = None,
                limit: Optional[int] = None) -> Result:
        """Ask for a permit of ``name`` once, keeping nothing: no handle, no renewing.

        Give exactly one of ``ttl`` and ``ttl_seconds``; a fractional lifetime is rounded
        up to whole seconds. ``limit`` makes ``name`` a semaphore of that many permits.

        Returns:
            ``{"acquired": True, "slot", "token", "owner", "guard"}``, or
                ``{"acquired": False, "reason": "held" or "contended", "holders"}``.
        """
        seconds = wire_seconds(lifetime(ttl, ttl_seconds))
        return self._one(LockOps.acquire(name, ttl_seconds=seconds, owner=owner, limit=limit))

    def renew(self, name: str, *, token: int, ttl_seconds: Optional[int] = None,
              ttl: Optional[Duration] = None, slot: Optional[int] = None,
              owner: Optional[str] = None) -> Result:
        """Extend the permit held at ``token`` by a new lifetime, once.

        Returns:
            ``{"renewed": True, "slot", "token", "guard"}`` with a NEW token, or
                ``{"renewed": False, "reason": "lost", "holders"}``.
        """
        seconds = wire_seconds(lifetime(ttl, ttl_seconds))
        return self._one(LockOps.renew(name, token=token, ttl_seconds=seconds, slot=slot,
                                       owner=owner))

    def release(self, name: str, *, token: int, slot: Optional[int] = None) -> Result:
        """Give back the permit held at ``token``.

        Returns:
            ``{"released": True}``, or ``{"released": False, "reason": "lost"}`` when
                ``token`` no longer holds it.
        """
        return self._one(LockOps.release(name, token=token, slot=slot))

    def get(self, name: str) -> Result:
        """Read who holds ``name`` now, taking nothing.

        Returns:
            ``{"held": bool, "holders": [...]}``, one entry per live permit (``slot``,
                ``owner``, ``token``, ``since``, ``expiresAt``, ``renewedAt``; epoch ms).
        """
        return self._one(LockOps.get(name))

    def batch(self, operations: Sequence[Mapping[str, Any]]) -> list[Result]:
        """Several ops in one call: one answer per op, in order; each stands on its own."""
        return self._client._call_locks([dict(op) for op in operations])

    def release_all(self) -> int:
        """Give back every permit this client's handles hold, best effort.

        They are given back in batches, a few engine calls for thousands of leases. Those
        that cannot be are told in one warning and expire by themselves within their TTL;
        ``release()`` on such a handle tries again. The handles stay usable: each can
        acquire again.

        Returns:
            How many handles held a permit.
        """
        held = self._client.renewer.held()
        tally = self._client.renewer.give_back(held, GiveBack(len(held)))
        if tally.left:
            log.warning("%s", tally.summary("release_all()"))
        return len(held)

    def _one(self, op: dict[str, Any]) -> Result:
        return self._client._call_locks([op])[0]


class Queen(ProcessBound):
    """A client: one engine chosen by URL, the handles it makes, and one renewer thread.

    Args:
        url: ``sqlite:///path.db``, ``http(s)://host:6632`` (several: comma-separated or a
            list), ``postgresql://user@host/db``. None: ``QUEEN_URL``, else an SQLite file
            in the user's state directory.
        bearer_token: for a Queen broker (else ``QUEEN_TOKEN``); never logged.
        timeout: seconds per engine call (a number, or ``(connect, read)`` over HTTP; over
            HTTP the whole call, resends included, is bounded by ``call_timeout``, by
            default the larger of the two).
        engine: an engine object to use instead of a URL (tests).
        clock: the monotonic clock handles and the renewer read (tests).
        renew_thread: False to drive ``q.renewer.tick()`` by hand (tests).
        **options: engine options (e.g. ``headers``, ``verify``, ``schema``).
    """

    _remake = "open another with Queen(url)"

    def __init__(
        self,
        url: Union[str, Sequence[str], None] = None,
        *,
        bearer_token: Optional[str] = None,
        timeout: Any = None,
        engine: Optional[Engine] = None,
        clock: Optional[Clock] = None,
        renew_thread: bool = True,
        **options: Any,
    ) -> None:
        if engine is None:
            target = url if url is not None else default_url()
            if not isinstance(target, str):
                target = ",".join(target)
            engine = engine_from_url(target, {"bearer_token": bearer_token, "timeout": timeout,
                                              **options})
        self._engine = engine
        self._clock: Clock = clock or SYSTEM_CLOCK
        self._threaded = renew_thread
        self._closed = False
        self._closing = False  # set first by close(): from then on nothing new is acquired
        self._new_acquire_count()
        self.metrics = Metrics()
        self._caller = _HandleCaller(self)
        self.renewer = Renewer(self._caller)
        self.locks = Locks(self)
        self.kv = Kv(self._caller)
        self._losses = LossDispatcher()
        track(self, close=self.close, after_fork_in_child=self._after_fork_in_child)

    # ---- handles -----------------------------------------------------------------------

    @overload
    def lock(self, name: str, *, ttl: Duration, owner: Optional[str] = None,
             auto_renew: bool = True, renew_every: Optional[Duration] = None,
             wait: Optional[Duration] = 0) -> Lock: ...

    @overload
    def lock(self, name: str, *, ttl_seconds: int, owner: Optional[str] = None,
             auto_renew: bool = True, renew_every: Optional[Duration] = None,
             wait: Optional[Duration] = 0) -> Lock: ...

    def lock(self, name: str, *, ttl: Optional[Duration] = None,
             ttl_seconds: Optional[int] = None, owner: Optional[str] = None,
             auto_renew: bool = True, renew_every: Optional[Duration] = None,
             wait: Optional[Duration] = 0) -> Lock:
        """A handle on lock ``name`` (nothing is sent until ``acquire``).

        Args:
            name: the lock's name (1..256 UTF-8 bytes, no control characters, no ``#``).
            ttl: the lease's lifetime (seconds, a ``timedelta`` or text such as ``"2m"``);
                at least 1 second (``MIN_TTL_SECONDS``), at most 10 years. Required:
                there is no default lifetime.
            ttl_seconds: the lifetime as a whole number of seconds, instead of ``ttl``.
            owner: the identity the engine knows this holder by (default: a fresh
                ``host:pid:random`` per handle). Calls from one owner count as resends, so
                handles sharing an ``owner=`` are ONE holder and hold at the same time, even
                in different processes: give each process its own.
            auto_renew: keep the lease renewed by the client's background thread.
            renew_every: how often to renew (default: a third of the lifetime).
            wait: how long ``acquire``, ``with`` and ``run`` wait by default (0: one try).
        """
        return self._handle(name, 1, ttl, ttl_seconds, owner, auto_renew, renew_every, wait)

    @overload
    def semaphore(self, name: str, limit: int, *, ttl: Duration, owner: Optional[str] = None,
                  auto_renew: bool = True, renew_every: Optional[Duration] = None,
                  wait: Optional[Duration] = 0) -> Lock: ...

    @overload
    def semaphore(self, name: str, limit: int, *, ttl_seconds: int,
                  owner: Optional[str] = None, auto_renew: bool = True,
                  renew_every: Optional[Duration] = None,
                  wait: Optional[Duration] = 0) -> Lock: ...

    def semaphore(self, name: str, limit: int, *, ttl: Optional[Duration] = None,
                  ttl_seconds: Optional[int] = None, owner: Optional[str] = None,
                  auto_renew: bool = True, renew_every: Optional[Duration] = None,
                  wait: Optional[Duration] = 0) -> Lock:
        """A handle on ONE of ``limit`` permits of ``name`` (arguments as for ``lock``)."""
        check_int(limit, "limit", low=1, high=MAX_LIMIT)
        return self._handle(name, limit, ttl, ttl_seconds, owner, auto_renew, renew_every, wait)

    def _handle(self, name: str, limit: int, ttl: Optional[Duration], ttl_seconds: Optional[int],
                owner: Optional[str], auto_renew: bool, renew_every: Optional[Duration],
                wait: Optional[Duration]) -> Lock:
        self._check_accepting()
        return Lock(self._caller, name, ttl=lifetime(ttl, ttl_seconds), limit=limit, owner=owner,
                    auto_renew=auto_renew, renew_every=renew_every, wait=wait)

    def transaction(self) -> Transaction:
        """A bundle of KV writes that commit together; ``.guard(lock)`` fences it."""
        return Transaction(self._caller)

    @property
    def engine(self) -> Engine:
        """The engine this client sends its calls to."""
        return self._engine

    @property
    def url(self) -> str:
        """The engine's URL without credentials."""
        return self._engine.url

    @property
    def capabilities(self) -> Capabilities:
        """What the engine guarantees and offers (fencing, waking waiters, several hosts)."""
        return self._engine.capabilities

    def held(self) -> list[Lock]:
        """The handles of this client that hold a lease now."""
        return [lock for lock in self.renewer.held() if lock.held]

    # ---- calls (the one place answers are checked against the route's promise) ----------

    def _call(self, route: str, body: dict[str, Any]) -> dict[str, Any]:
        if self._closed:
            raise self._closed_error()
        answer = self._engine.call(route, body)
        if not isinstance(answer, dict):
            raise ProtocolError(f"{route} answered {type(answer).__name__}, not an object",
                                route=route)
        return answer

    def _call_ops(self, route: str, ops: list[dict[str, Any]]) -> list[Result]:
        return [Result(result) for result in self._call_checked(route, ops)]

    def _call_checked(self, route: str, ops: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The results of ``ops``, checked to be one object per op, as the engine gave them."""
        results = self._call(route, {"operations": ops}).get("results")
        if not isinstance(results, list) or len(results) != len(ops):
            got = len(results) if isinstance(results, list) else type(results).__name__
            raise ProtocolError(f"{route} sent {len(ops)} op(s) and got results: {got}",
                                route=route)
        for result in results:
            if type(result) is not dict and not isinstance(result, dict):
                raise ProtocolError(f"{route} answered a result that is not an object",
                                    route=route)
        return results

    def _call_locks(self, ops: list[dict[str, Any]]) -> list[Result]:
        return self._call_ops("locks", ops)

    def _call_kv(self, ops: list[dict[str, Any]]) -> list[Result]:
        return self._call_ops("kv", ops)

    def _call_transaction(self, body: dict[str, Any]) -> Result:
        answer = self._call("transaction", body)
        if "success" not in answer:
            raise ProtocolError("transaction answered without 'success'", route="transaction")
        kv = answer.get("kv")
        if isinstance(kv, list):  # each op's answer reads as its verdict, as a batch's does
            answer["kv"] = [Result(one) if isinstance(one, dict) else one for one in kv]
        return Result(answer)

    def _check_accepting(self) -> None:
        if self._closing:
            raise self._closed_error()

    def _closed_error(self) -> QueenError:
        return QueenError(f"this Queen client ({self.url}) is closed")

    def _new_acquire_count(self) -> None:
        # Acquires in flight: each attempt holds a lock of its own while it runs, listed here
        # with its thread. Its ``with`` frees that lock and its ``finally`` unlists it, so an
        # interrupt cutting off one leaves the other: an entry counts only while both stand.
        # No other thread's frames are read: CPython 3.11 can crash walking them.
        self._flights: dict[LockType, int] = {}
        self._prune_flights_at = _FLIGHTS_KEPT  # past this many entries, forget the landed ones
        self._landed = threading.Event()  # set when one lands while closing
        # The thread doing the closing, claimed by one dict step: no lock a signal handler's
        # close() could find held by the very thread it interrupted.
        self._closers: dict[str, threading.Thread] = {}
        self._given_back = threading.Event()  # set once a close() has given the leases back

    def _take_off(self, flight: LockType) -> None:
        """List ``flight``, held by an attempt starting now; refused once the client closes."""
        flights = self._flights
        flights[flight] = threading.get_ident()
        if len(flights) > self._prune_flights_at:
            self._prune_flights()
        # Listed before the check: close() sets _closing before it looks (GIL order).
        if self._closing:
            flights.pop(flight, None)
            raise self._closed_error()

    def _land(self, flight: LockType) -> None:
        """Unlist ``flight``, whose attempt has ended."""
        self._flights.pop(flight, None)
        if self._closing:
            self._landed.set()

    def _prune_flights(self) -> None:
        """Forget the entries whose lock is free (an interrupt cut off their unlisting).

        Run once the table has doubled since the last time, so its cost is spread over that
        many acquires.
        """
        flights = self._flights
        for flight in list(flights):
            if not flight.locked():
                flights.pop(flight, None)
        self._prune_flights_at = max(_FLIGHTS_KEPT, 2 * len(flights))

    @property
    def _acquires(self) -> int:
        """How many acquires are still in flight on other threads than this one."""
        return self._acquires_but(threading.get_ident())

    def _acquires_but(self, caller: int) -> int:
        """How many acquires are in flight on threads other than ``caller`` (which waits in
        ``close()``, so its own attempt cannot land meanwhile)."""
        return sum(1 for flight, thread in list(self._flights.items())
                   if thread != caller and flight.locked())

    def _wait_for_acquires(self, timeout: float, caller: int) -> None:
        # Polled too: a wake-up can be cut off by an interrupt in the acquire's exit.
        deadline = time.monotonic() + timeout
        while True:
            self._landed.clear()  # before counting: a landing after the count ends the wait
            in_flight = self._acquires_but(caller)
            if not in_flight:
                return
            left = deadline - time.monotonic()
            if left <= 0:
                log.warning("closing with %d acquire(s) still in flight; what they take "
                            "expires by itself", in_flight)
                return
            self._landed.wait(min(left, 0.05))

    # ---- loss handlers, off the renewer thread -------------------------------------------

    def _dispatch(self, handler: Callable[[str], Any], reason: str,
                  lease: Optional[object] = None) -> None:
        self._losses.dispatch(handler, reason, lease)

    def _drain_loss_handlers(self, deadline: float, caller: int) -> None:
        # Before the engine closes: a cleanup handler may still need it.
        left = self._losses.drain(deadline - time.monotonic(), caller)
        if left:
            log.warning("closing %s with the loss handlers of %d lease(s) still running; "
                        "they go on in daemon threads, which do not delay exit",
                        self.url, left)

    # ---- process life ------------------------------------------------------------------

    def close(self, timeout: float = EXIT_BUDGET) -> None:
        """Release every lease this client's handles hold (bounded time), then close the engine.

        Leases are released in batches (a few engine calls for thousands), and no batch
        starts after ``timeout`` seconds. What is not given back is told in one warning;
        those permits expire by themselves within their TTL. Then ``on_lost`` handlers
        still queued or running get what is left of ``timeout`` to end (not when called
        from one of them); those that do not are told in one warning and left running.

        An acquire still in flight that is granted after this began gives its permit back
        and raises the "closed" ``QueenError``. A close() called while another runs returns
        once that one has given the leases back (within its own ``timeout``).

        The closing runs on a thread of its own: a Ctrl-C cuts short the wait for it, not
        the closing, and a close() from a signal handler returns within its budget (plus
        a second) even when the thread it interrupted holds what the closing needs; the
        closing then ends in the background. A closing that fails is run again by the
        next close().
        """
        started = time.monotonic()
        attempt = _CloseAttempt(threading.get_ident())
        # The work runs on a thread of its own, which no signal interrupts: a Ctrl-C (or a
        # handler calling close() again) cuts short only this wait, never the closing.
        try:
            threading.Thread(target=self._run_close, args=(attempt, started, timeout),
                             name="queen_sync-close", daemon=True).start()
        except RuntimeError:  # Python 3.12+ starts no thread once the interpreter exits
            self._run_close(attempt, started, timeout)
        limit = started + timeout + _CLOSE_GRACE
        attempt.ended.wait(max(0.0, limit - time.monotonic()))
        if attempt.error is not None:
            raise attempt.error
        if not attempt.ran:
            # Another close() is at work: its give-back is this call's too.
            self._given_back.wait(max(0.0, limit - time.monotonic()))
        elif not attempt.ended.is_set():
            log.warning("closing %s takes longer than its %gs: it goes on in the background "
                        "(what it cannot give back expires by itself)", self.url, timeout)

    def _run_close(self, attempt: _CloseAttempt, started: float, timeout: float) -> None:
        try:
            me = threading.current_thread()
            if self._closed or self._closers.setdefault("closer", me) is not me:
                return
            attempt.ran = True
            try:
                self._close_once(started, timeout, attempt.caller)
            except BaseException as exc:
                attempt.error = exc  # the caller raises it, if it still waits
                log.warning("closing %s failed", self.url, exc_info=True)
            finally:
                if not self._closed:  # a later close() runs it again
                    self._closers.pop("closer", None)
        finally:
            attempt.ended.set()

    def _close_once(self, started: float, timeout: float, caller: int) -> None:
        self._closing = True  # first: an acquire from now on is refused, none is missed
        held = self.renewer.held()
        # Held up before it could start (by a thread a signal handler's close() interrupted,
        # say), the closing goes on in the background, with its budget counted from now.
        ready = time.monotonic()
        deadline = (started if ready - started < _CLOSE_GRACE / 2 else ready) + timeout
        self.renewer.stop(max(0.0, min(2.0, deadline - time.monotonic())))
        if held or self.renewer.watching_strays:
            # Batches stop starting at the deadline; the one in flight then is cut loose.
            tally = GiveBack(len(held))
            _bounded(lambda: self.renewer.give_back(held, tally, deadline, losing="closed"),
                     max(0.0, deadline - time.monotonic()))
            if tally.left:
                log.warning("%s", tally.summary(f"closing {self.url} within {timeout:g}s"))
        self._given_back.set()
        # An acquire landing from now on gives its permit back itself, through the engine,
        # which stays open for that until they land or the budget is spent.
        self._wait_for_acquires(max(0.0, deadline - time.monotonic()), caller)
        self._drain_loss_handlers(deadline, caller)
        self._closed = True
        forget(self)  # at once: a client out of the registry is a closed one
        self._engine.close()

    def _after_fork_in_child(self) -> None:
        self._new_acquire_count()  # the parent's threads in flight are not in this process
        self.renewer.after_fork()
        self._losses = LossDispatcher()  # the parent's handler threads are not in this process
        self.metrics = Metrics()
        self._engine.after_fork()

    def __enter__(self) -> Queen:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self.renewer.held())} held"
        return f"<Queen {self._engine.kind} {self.url} {state}>"


class _HandleCaller:
    """The client as its handles see it (the ``Caller`` protocol), and no more of it."""

    def __init__(self, client: Queen) -> None:
        self._client = client

    @property
    def url(self) -> str:
        return self._client.url

    @property
    def clock(self) -> Clock:
        return self._client._clock

    @property
    def metrics(self) -> Metrics:
        return self._client.metrics  # replaced in a forked child: read it at use time

    @property
    def renewer(self) -> Renewer:
        return self._client.renewer

    @property
    def renew_thread(self) -> bool:
        return self._client._threaded

    @property
    def engine(self) -> Engine:
        return self._client._engine

    @property
    def closing(self) -> bool:
        return self._client._closing

    def closed_error(self) -> QueenError:
        return self._client._closed_error()

    def take_off(self, flight: LockType) -> None:
        self._client._take_off(flight)

    def land(self, flight: LockType) -> None:
        self._client._land(flight)

    def call_locks(self, ops: list[dict[str, Any]]) -> list[dict[str, Any]]:
        # Checked as ``_call_locks`` does, not copied into ``Result``s: handles read them only.
        return self._client._call_checked("locks", ops)

    def call_kv(self, ops: list[dict[str, Any]]) -> list[Result]:
        return self._client._call_kv(ops)

    def call_transaction(self, body: dict[str, Any]) -> Result:
        return self._client._call_transaction(body)

    def dispatch(self, handler: Callable[[str], Any], reason: str,
                 lease: Optional[object] = None) -> None:
        self._client._dispatch(handler, reason, lease)


def connect(url: Union[str, Sequence[str], None] = None, **options: Any) -> Queen:
    """Same as ``Queen(url, **options)``."""
    return Queen(url, **options)


class _CloseAttempt:
    """One ``close()`` call as its closing thread reports back to it."""

    def __init__(self, caller: int) -> None:
        self.caller = caller  # the thread waiting in close()
        self.ended = threading.Event()
        self.ran = False  # False: another close() was already at work (or it was closed)
        self.error: Optional[BaseException] = None


def _bounded(work: Callable[[], object], timeout: float) -> None:
    """Run ``work`` in a helper thread and wait at most ``timeout`` for it."""
    worker = threading.Thread(target=work, name="queen_sync-close", daemon=True)
    try:
        worker.start()
    except RuntimeError:
        # Python 3.12+ starts no thread once the interpreter is shutting down (atexit):
        # run it here, bounded by the engine's own timeouts instead.
        work()
        return
    worker.join(timeout)
