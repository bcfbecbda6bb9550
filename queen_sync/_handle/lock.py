"""``Lock``: one holder's hold on one permit, kept renewed in the background.

``held`` is a belief with a deadline: the handle holds a token AND this machine's
monotonic clock is before ``sent_at + ttl``, where ``sent_at`` is when the last
successful acquire or renew was SENT and ``ttl`` the lifetime that op carried.
Counting from the send keeps the local deadline never later than the engine's; an
acquire answered with a permit granted earlier (``already``) is renewed at once, so
that the deadline counts from a send this handle saw. Past it, the work must be fenced out by
the token, because the engine may already have handed the permit to someone else.
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
import logging
import os
import random
import sys
import threading
import time
from _thread import allocate_lock
from types import AsyncGeneratorType, CoroutineType, FrameType, GeneratorType
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, Optional, TypeVar

from typing_extensions import ParamSpec

from .._durations import Duration, lease_seconds, parse_duration, renew_interval, wire_seconds
from .._engines.base import in_line
from .._errors import (
    EngineError,
    LockError,
    LockLostError,
    LockNotHeldError,
    ProtocolError,
    QueenError,
    StoreReplacedError,
    UnsupportedOperationError,
)
from .._notebook.rerun import cell_number, supersede_earlier
from .._ops import MAX_LIMIT, LockOps, check_int, check_name, check_owner, guard_op, mint_owner
from .._process import ProcessBound, forks
from .._results import Holder, RunResult, granted_permit, holders_from_wire, lock_verdict
from .interrupts import block_closed, block_opened, bookkeeping, interrupts_held

if TYPE_CHECKING:
    from .._engines.base import Capabilities, Engine
    from .caller import Caller

log = logging.getLogger("queen_sync")
P = ParamSpec("P")
T = TypeVar("T")

_current: contextvars.ContextVar[Optional[Lock]] = contextvars.ContextVar(
    "queen_sync_current_lock", default=None
)

_MAX_BACKOFF = 1.0
_RENEW_BY = 2 / 3  # of a lease's lifetime: the latest point its next renew is planned for
_OWNER_CHECK = 0.1  # seconds between looks at whether the thread inside a block still lives
_NEVER = float("inf")


def current_lock() -> Optional[Lock]:
    """The lock whose ``run`` or ``with`` block is running in this context, if any."""
    lock = _current.get()
    # A block exited in another thread (a generator closed there) cannot reset this context.
    return lock if lock is not None and lock.in_block else None


_SUSPENDABLE = (inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR
                | inspect.CO_ITERABLE_COROUTINE)


def _suspendable(frame: Optional[FrameType]) -> Optional[FrameType]:
    """The nearest frame that can be suspended and resumed later (a generator's, a
    coroutine's) among ``frame`` and all its callers.

    Only such a frame can exit a block after the thread that entered it has ended; any
    other frame of an ended thread has returned. A block entered through a wrapper (an
    ``ExitStack``, a class whose ``__enter__`` calls the lock's) is the generator's too.
    The whole stack is walked: a bound would let a wrapper deeper on one side than on
    the other find the generator at the entry and not at the exit, or the reverse.
    """
    while frame is not None and not frame.f_code.co_flags & _SUSPENDABLE:
        frame = frame.f_back
    return frame


def _reset_current(token: contextvars.Token[Optional[Lock]]) -> None:
    """Restore ``current_lock()`` as it was before the block, even from another context."""
    try:
        _current.reset(token)
    except ValueError:  # the block ends in a context other than the one it began in
        old = token.old_value
        _current.set(None if old is contextvars.Token.MISSING else old)


# What a lease needs of its engine, and why: without either, two holders' work overlaps.
_ARBITRATION = {
    "fencing": "tokens that only rise, and guarded writes atomic with their check",
    "engine_clock_expiry": "expiry judged by one clock, not by each client's",
}


def require_arbitration(engine: Engine, what: str) -> None:
    """Refuse an engine that cannot keep two holders apart, naming what it lacks.

    Raises:
        UnsupportedOperationError: ``engine.capabilities`` lacks ``fencing`` or
            ``engine_clock_expiry``.
    """
    for capability, why in _ARBITRATION.items():
        if not getattr(engine.capabilities, capability):
            raise UnsupportedOperationError(
                f"{what}: the {engine.kind} engine ({engine.url}) lacks {capability} ({why}); "
                "a lease on it could not keep two holders' work apart", capability=capability)


def late_release_op(lock: Lock, answer: Mapping[str, Any]) -> dict[str, Any]:
    """The release op for the permit a renew answered after ``lock``'s deadline had passed."""
    token, slot = granted_permit(answer)
    return LockOps.release(lock.name, token=token, slot=slot)


def _interrupted(exc: BaseException) -> bool:
    """Whether ``exc`` cut an engine call short rather than came as the engine's answer.

    The engines raise ``QueenError``s; anything else (``KeyboardInterrupt``, an alarm
    handler's ``TimeoutError``) landed from outside, maybe after the call had applied.
    An unreadable answer (``ProtocolError``) may also hide an applied call.
    """
    return not isinstance(exc, QueenError) or isinstance(exc, ProtocolError)


def check_body(fn: Callable[..., Any], what: str) -> None:
    """Refuse a function whose call returns before its body has run (``what`` calls it).

    Raises:
        TypeError: ``fn`` is a generator, coroutine or async generator function.
    """
    if inspect.isgeneratorfunction(fn) or inspect.iscoroutinefunction(fn) \
            or inspect.isasyncgenfunction(fn):
        raise TypeError(_later_body(what, f"{fn!r} is a generator or async function"))


def check_body_result(value: Any, what: str) -> None:
    """Refuse a call's result that is a body not yet run (closed first: nothing of it runs).

    Raises:
        TypeError: ``value`` is a generator, coroutine or async generator.
    """
    if isinstance(value, (GeneratorType, CoroutineType, AsyncGeneratorType)):
        if isinstance(value, (GeneratorType, CoroutineType)):
            value.close()  # no "never awaited" warning, and no later run unguarded
        raise TypeError(_later_body(what, f"the call returned {type(value).__name__} "
                                          f"{getattr(value, '__qualname__', '')!s}"))


def _later_body(what: str, found: str) -> str:
    return (f"{what} runs its function under the lease and gives the lease back when the "
            f"call returns, but {found}: its body would run after the lease is given back. "
            "Iterate or await it inside `with lock:` instead")


def wait_seconds(wait: Optional[Duration]) -> float:
    """Seconds to wait; ``0``/``None`` means one attempt."""
    if wait is None or (not isinstance(wait, bool) and wait == 0):
        return 0.0
    return parse_duration(wait, what="wait")


class Lock(ProcessBound):
    """A lease on one permit of ``name`` (a semaphore handle has ``limit > 1``).

    Creating it sends nothing. ``acquire`` takes a permit, a background renewer
    keeps it alive at a third of its lifetime, ``release`` gives it back.

    Blocks (``with lock:`` and ``lock.run``) nest: in the thread inside them, a
    block within a block sends nothing and the lease is released when the
    OUTERMOST block exits. An explicit ``release()`` inside blocks releases at
    once; the outer exits then have nothing left to release. A block nested in
    one whose lease was lost raises ``LockLostError`` and takes nothing, so
    that ``lost`` stays set for the outer block. A handle also
    excludes the other threads of this process: while one thread is inside a
    block, another thread's block entry waits for it within the handle's
    ``wait``; with no wait it does not get in (``with`` raises
    ``LockNotHeldError``, ``run`` returns ``acquired=False``). ``acquire()`` and
    ``release()`` outside blocks take no part in this: ``acquire()`` on a held
    handle returns True at once, from any thread.

    In a notebook, re-running a cell never waits on the kernel's own earlier
    handle: acquiring in an IPython cell first releases (with a warning) the
    handles on the same name and limit that this thread took in EARLIER cells,
    that no ``with``/``run`` block is using and that no notebook variable still
    refers to. Outside IPython, handles contend as usual.
    """

    _remake = "make another handle with q.lock(name, ...) or q.semaphore(name, limit, ...)"

    def __init__(
        self,
        client: Caller,
        name: str,
        *,
        ttl: float,
        limit: int = 1,
        owner: Optional[str] = None,
        auto_renew: bool = True,
        renew_every: Optional[Duration] = None,
        wait: Optional[Duration] = 0,
    ) -> None:
        self._name = check_name(name)
        self.limit = check_int(limit, "limit", low=1, high=MAX_LIMIT)
        self._owner = check_owner(owner) if owner is not None else mint_owner()
        self._explicit_owner = owner is not None
        self._pid = os.getpid()  # the process this handle's state and owner belong to
        self._generation = forks.generation  # the same, told apart without a system call
        self._arbitrated: Optional[Capabilities] = None  # the capabilities found to arbitrate
        if not isinstance(auto_renew, bool):
            raise TypeError("auto_renew must be True or False")
        self._ttl = ttl
        self._chosen_renew_every = renew_every  # None: a third of whatever the ttl becomes
        self.auto_renew = auto_renew
        self.renew_every = renew_interval(renew_every, ttl)
        self._default_wait = wait_seconds(wait)
        self._client = client
        self._clock = client.clock  # a client's clock never changes, forked or not
        # Whether the engine resent the last call after a send that may still land (HTTP).
        self._left_strays: Optional[Callable[[], bool]] = getattr(client.engine, "left_strays",
                                                                  None)
        self._reset_state()

    def _reset_state(self) -> None:
        self._io = threading.Lock()  # one engine call at a time: release waits for a renew
        self._state = threading.Lock()  # makes "mark lost" happen once
        self._token: Optional[int] = None
        self._slot: Optional[int] = None
        # When the last acquire or renew that took was sent, plus the lifetime its op
        # carried: one number, so that a reader without the state lock never sees half
        # of an update (a late view would outlive the engine's deadline).
        self._deadline = 0.0
        self._sending_ttl = 0.0  # the lifetime of the last renew op built
        self._next_renew = _NEVER
        # The name, owner and ttl a renew op was checked for, and that op: see ``renew_op``.
        self._renew_base: Optional[tuple[str, str, float, dict[str, Any]]] = None
        # The same for the acquire op (and the limit), and for the release op (the name).
        self._acquire_base: Optional[tuple[str, str, float, int, dict[str, Any]]] = None
        self._release_base: Optional[tuple[str, dict[str, Any]]] = None
        self._last_token: Optional[int] = None
        self._unsure = False  # a renew call failed: it may have applied, minting a token unseen
        # A permit whose release raised: kept only so release() can be retried. It may have
        # been given back already, so the handle never counts as holding it.
        self._unreleased: Optional[tuple[int, Optional[int]]] = None
        self.lost = threading.Event()
        self.lost_reason: Optional[str] = None
        self._handlers: list[Callable[[str], Any]] = getattr(self, "_handlers", [])
        self._holders: tuple[Holder, ...] = ()
        # Blocks nest in one thread at a time (the owner), so these belong to that thread.
        self._gate = threading.Condition(threading.Lock())
        self._owner_thread: Optional[threading.Thread] = None
        # Per open block: its context token, and its frame when that frame can be suspended.
        self._contexts: list[tuple[contextvars.Token[Optional[Lock]], Optional[FrameType]]] = []
        # Suspended frames of blocks a thread left open as it ended: their exits, whenever
        # they come, must not count out the blocks of the thread that took the handle over.
        self._stale_frames: list[FrameType] = []
        self._blocks = 0  # with/run blocks using this handle now (never superseded then)
        self._taken_in: Optional[int] = None  # thread that acquired it
        self._cell: Optional[int] = None  # IPython cell that acquired it

    # ---- state -------------------------------------------------------------------------

    @property
    def token(self) -> Optional[int]:
        """The fencing token while held (it changes at every renew: read it at use time)."""
        return self._token if self.held else None

    @property
    def name(self) -> str:
        """The lock's name. It can be changed only while the handle holds nothing."""
        return self._name

    @name.setter
    def name(self, value: str) -> None:
        name = check_name(value)  # checked here: a renew must not fail on it later
        with self._holding_nothing("name"):
            self._name = name

    @property
    def owner(self) -> str:
        """The holder identity sent with every acquire and renew (see ``Queen.lock``).

        It can be changed only while the handle holds nothing. An owner set here is
        one given, as ``owner=`` is: a forked child's handle keeps it, and refuses.
        """
        return self._owner

    @owner.setter
    def owner(self, value: str) -> None:
        owner = check_owner(value)
        with self._holding_nothing("owner"):
            self._owner = owner
            self._explicit_owner = True

    @contextlib.contextmanager
    def _holding_nothing(self, what: str) -> Iterator[None]:
        """Run a change of ``what`` with no engine call of this handle in flight, or refuse it.

        The permit is the row of the name and owner it was taken with, and a release,
        renew or ``close()`` sends those of the moment: changed under a lease (or a
        block, or a release that may be retried), the row would be left to expire.
        """
        if not self._io.acquire(False):
            raise LockError(f"lock {self._name!r}: this handle is taking or renewing a permit; "
                            f"release it first to change its {what}", name=self._name)
        try:
            if self._token is not None or self._unreleased is not None or self._blocks:
                raise LockError(f"lock {self._name!r}: this handle holds a permit or is in a "
                                f"block; release it first to change its {what}",
                                name=self._name)
            yield
        finally:
            self._io.release()

    @property
    def ttl(self) -> float:
        """The lifetime in seconds that the next acquire or renew asks for.

        Setting it changes no lease held now: its deadline stays the one its engine
        counts. A default ``renew_every`` (a third of the lifetime) follows it.
        """
        return self._ttl

    @ttl.setter
    def ttl(self, value: Duration) -> None:
        seconds = lease_seconds(value)
        every = renew_interval(self._chosen_renew_every, seconds)  # both checked, then set
        self._ttl, self.renew_every = seconds, every

    @property
    def ttl_seconds(self) -> int:
        """The lifetime as the wire carries it: whole seconds, rounded up."""
        return wire_seconds(self.ttl)

    @property
    def slot(self) -> Optional[int]:
        """The permit's slot while held (``0``, or ``0..limit-1`` for a semaphore), else None."""
        return self._slot if self._token is not None else None

    @property
    def held(self) -> bool:
        """True while this handle has a token and its local deadline has not passed."""
        return self._token is not None and self._clock.monotonic() < self._deadline

    @property
    def remaining(self) -> float:
        """Seconds before the local deadline (a lower bound on the engine's), 0 when not held."""
        if self._token is None:
            return 0.0
        return max(0.0, self._deadline - self._clock.monotonic())

    @property
    def holders(self) -> tuple[Holder, ...]:
        """The holders reported by the last acquire that found the lock busy."""
        return self._holders

    @property
    def last_token(self) -> Optional[int]:
        """The token this handle held last, kept after a loss or release (for loss reports)."""
        return self._last_token

    # ---- for the renewer, transactions and notebooks (not exported, not for app code) ----

    @property
    def deadline(self) -> float:
        """The local deadline, on the client's monotonic clock."""
        return self._deadline

    @property
    def renew_due(self) -> float:
        """When the next renew is due, on the client's monotonic clock (inf: never)."""
        return self._next_renew

    def try_begin_call(self) -> bool:
        """Claim this handle's one engine call without waiting; False while another runs.

        A True answer must be followed by ``end_call()``.
        """
        return self._io.acquire(False)  # positional: a tick claims thousands, keywords cost

    def end_call(self) -> None:
        """End the engine call that ``try_begin_call()`` claimed."""
        self._io.release()

    def await_renewal(self) -> None:
        """Wait for a renew (or other engine call of this handle) in flight to land."""
        with self._io:
            pass

    @property
    def engine_url(self) -> str:
        """The URL (without credentials) of the engine this handle's client talks to."""
        return self._client.url

    @property
    def store(self) -> str:
        """What tells this handle's store from others (see ``Engine.store``)."""
        return self._client.engine.store

    @property
    def taken_in(self) -> tuple[Optional[int], Optional[int]]:
        """The thread id and IPython cell (None outside IPython) of the acquire holding now."""
        return self._taken_in, self._cell

    @property
    def in_block(self) -> bool:
        """True while a ``with`` or ``run`` block of this handle is running."""
        return self._blocks > 0

    # ---- acquire -----------------------------------------------------------------------

    def acquire(self, wait: Optional[Duration] = None) -> bool:
        """Take a permit; with ``wait``, retry (woken on release where the engine can) until then.

        Returns:
            True when this handle holds a permit, False when the wait ran out.
        """
        budget = self._default_wait if wait is None else wait_seconds(wait)
        if self._generation != forks.generation:  # looked at here: on every acquire's path
            self._check_process()
        engine = self._client.engine
        if engine.capabilities is not self._arbitrated:  # frozen: once judged, judged for good
            require_arbitration(engine, f"lock {self.name!r}")
            self._arbitrated = engine.capabilities
        if self.held:
            return True
        cell = cell_number()  # once: the acquire records it, and outside IPython it is None
        if cell is not None:
            supersede_earlier(self)  # a re-run notebook cell never waits on its own kernel
        started = time.monotonic()
        if self._attempt(started, cell):
            return True
        if budget <= 0:
            return self._busy()
        return self._wait_for_turn(started, started + budget, cell)

    def _wait_for_turn(self, started: float, deadline: float, cell: Optional[int]) -> bool:
        """Retry until ``deadline``, sleeping on the engine's wake-up between attempts.

        Armed only now that a first attempt failed: a free lock never pays for it.
        """
        backoff = 0.01
        engine = self._client.engine
        with engine.subscribe(self.name) as waiter:
            # A release landing between the failed attempt and the arming woke nobody; a
            # waiter in line looks at once anyway when nobody is ahead of it.
            if (engine.capabilities.wake_on_release and not in_line(waiter)
                    and self._attempt(started, cell)):
                return True
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    self._client.metrics.observe("acquire_gave_up_seconds",
                                                 time.monotonic() - started)
                    return self._busy()
                # Behind another waiter, its turn wakes it: no polling meanwhile.
                pause = _MAX_BACKOFF if in_line(waiter) else backoff * (0.5 + random.random())
                waiter.wait(min(left, pause, self._until_expiry()))
                backoff = min(backoff * 2, _MAX_BACKOFF)
                if self._attempt(started, cell):
                    return True

    def _until_expiry(self) -> float:
        """Seconds until the first current holder's lease runs out (wake then, not later)."""
        ends = [h.expires_at for h in self._holders if h.expires_at is not None]
        if not ends:
            return _MAX_BACKOFF
        return max(0.001, min(ends) / 1000 - time.time() + 0.002)

    def _attempt(self, started: float, cell: Optional[int]) -> bool:
        """One try at the permit; ``cell`` is the IPython cell asking (None outside IPython)."""
        # Counted as in flight while its lock is held, so that a client closing meanwhile
        # waits for it to land. The ``with`` frees the lock and the ``finally`` unlists it:
        # an interrupt at any bytecode leaves at least one of them done.
        client = self._client
        flight = allocate_lock()
        try:
            with flight:
                client.take_off(flight)
                granted = self._attempt_in_flight(started, cell)
                if granted and client.closing:
                    # Its renewer is stopped, and close() may have given back already:
                    # reporting the lease would leave it to expire under its holder.
                    self._give_back_on_close()
                    raise client.closed_error()
                return granted
        finally:
            client.land(flight)

    def _attempt_in_flight(self, started: float, cell: Optional[int]) -> bool:
        ttl = self._ttl
        for _ in range(3):
            with self._io:
                op = self._acquire_op(ttl)  # under the call's lock: a rename waits it out
                sent_at = self._clock.monotonic()
                try:
                    answer = self._client.call_locks([op])[0]
                    if self._left_strays is not None and self._left_strays():
                        self._client.renewer.watch_for_strays(self)
                    if lock_verdict(answer, "acquired"):
                        if "already" in answer and lock_verdict(answer, "already"):
                            return self._took_own(answer, ttl, started, cell)
                        self._took(answer, sent_at, started, ttl, cell)
                        return True
                except BaseException as exc:
                    # Interrupted mid-call (Ctrl-C, or whatever a signal handler raised),
                    # or answered unreadably: the engine may have granted this owner a
                    # permit, which nothing here would ever renew.
                    if _interrupted(exc):
                        self._abandon()
                    elif self._left_strays is not None and self._left_strays():
                        # Every send given up on may still land and take a permit.
                        self._client.renewer.watch_for_strays(self)
                    raise
            self._holders = holders_from_wire(answer.get("holders"))
            if answer.get("reason") != "contended":
                break
        return False

    def _acquire_op(self, ttl: float) -> dict[str, Any]:
        """The acquire op for the name, owner, ``ttl`` and limit of now.

        Checked once for them, then copied: every pair of a handle sends the same op,
        and the engine checks each op it runs.
        """
        base, name, owner, limit = self._acquire_base, self._name, self._owner, self.limit
        if (base is not None and base[0] == name and base[1] == owner and base[2] == ttl
                and base[3] == limit and type(limit) is int):
            return dict(base[4])
        check_int(limit, "limit", low=1, high=MAX_LIMIT)  # a plain attribute: set to anything
        op = LockOps.acquire(name, ttl_seconds=wire_seconds(ttl), owner=owner,
                             limit=limit if limit > 1 else None)
        self._acquire_base = (name, owner, ttl, limit, op)
        return dict(op)

    def _busy(self) -> bool:
        self._client.metrics.count("busy")
        return False

    def _took_own(self, answer: dict[str, Any], ttl: float, started: float,
                  cell: Optional[int]) -> bool:
        """Take this owner's permit granted earlier (``already``) by renewing it now.

        Its engine counts its lifetime from that earlier grant, unknown here: a deadline
        counted from this acquire would outlive it. When the renew is refused (the permit
        expired meanwhile), nothing is held.
        """
        token, slot = granted_permit(answer)
        op = LockOps.renew(self.name, token=token, ttl_seconds=wire_seconds(ttl), slot=slot,
                           owner=self.owner)
        sent_at = self._clock.monotonic()
        renewed = self._client.call_locks([op])[0]
        if not lock_verdict(renewed, "renewed"):
            self._holders = ()
            return False
        self._took(renewed, sent_at, started, ttl, cell)
        return True

    def _took(self, answer: dict[str, Any], sent_at: float, started: float, ttl: float,
              cell: Optional[int]) -> None:
        token, slot = granted_permit(answer)
        # Under the state lock: the renewer's expiry pass cannot mark this fresh lease lost
        # for the deadline of the one before it (``mark_lost`` takes it too).
        with self._state:
            self._deadline = sent_at + ttl  # before the token: never a late view
            self._next_renew = self._renew_planned(sent_at, ttl)
            # Registered before the token is set: a fork from another thread in between
            # leaves a child either no token or a registered handle, which its reset empties.
            self._client.renewer.register(self)
            self._token, self._slot = token, slot
            self._last_token = token
            self._unsure = False
            self._unreleased = None  # a fresh permit supersedes one whose release raised
            if self.lost.is_set():  # reading it takes no lock; clearing it takes one
                # The same Event object: a caller's reference stays current. In a hold: a
                # signal landing in its Python-level lock would leave that lock taken.
                with interrupts_held():
                    self.lost.clear()
            self.lost_reason = None
        self._holders = ()
        self._taken_in, self._cell = threading.get_ident(), cell
        self._client.metrics.acquired(time.monotonic() - started)

    def _give_back_on_close(self) -> None:
        """Release a permit granted once the client had begun to close (best effort)."""
        try:
            self.release()
        except Exception:
            log.warning("could not give back lock %r, granted as its client closed; it "
                        "expires by itself", self.name, exc_info=True)

    @bookkeeping
    def _abandon(self) -> None:
        """Give back whatever the engine granted this owner while the caller was interrupted.

        A hold: a second signal (Ctrl-C pressed twice, a repeating alarm) waits for the
        permit to be given back instead of stranding it until its TTL.
        """
        with interrupts_held():
            with self._state:
                token, self._token = self._token, None
            # Even with no token: an acquire cut short may have registered it, not yet holding.
            self._client.renewer.unregister(self)
            if token is not None:
                self._client.metrics.held(-1)
            try:
                self._release_mine()
            except Exception:
                log.warning("could not give back lock %r after an interrupt; it expires by "
                            "itself", self.name, exc_info=True)

    def release_strays(self) -> bool:
        """Give back what a late first send of an acquire took after this handle let go.

        The caller has claimed the call (``try_begin_call``), so no acquire of this handle
        is in flight: while it holds nothing, a permit of its owner is nobody's. An owner
        given as ``owner=`` may be another handle's too, so its permits are left alone.
        """
        if self._token is not None or self._explicit_owner:
            return False
        return self._release_mine()

    def _release_mine(self) -> bool:
        """Release every permit of ``name`` whose owner is this handle's (owners are unique)."""
        answer = self._client.call_locks([LockOps.get(self.name)])[0]
        mine = [h for h in holders_from_wire(answer.get("holders")) if h.owner == self.owner]
        if not mine:
            return False
        answers = self._client.call_locks(
            [LockOps.release(self.name, token=h.token, slot=h.slot) for h in mine])
        return any([lock_verdict(a, "released") for a in answers])  # each read, each checked

    # ---- renew -------------------------------------------------------------------------

    def renew(self) -> bool:
        """Renew now (a new token); False when the lease is gone (then ``lost`` is set)."""
        with self._io:
            op = self.renew_op()
            if op is None:
                return False
            sent_at = self._clock.monotonic()
            try:
                answer = self._client.call_locks([op])[0]
                if self.apply_renewal(answer, sent_at):
                    return True
            except Exception:  # no answer, or one naming no permit: it may have applied
                self._renew_unanswered(sent_at)
                raise
            if answer.get("renewed"):  # it came after the deadline: give that permit back
                try:
                    self._client.call_locks([late_release_op(self, answer)])
                except Exception:
                    log.warning("could not give back lock %r renewed too late; it expires by "
                                "itself", self.name, exc_info=True)
            return False

    def renew_op(self) -> Optional[dict[str, Any]]:
        """The renew op for the token held now (None when nothing is held)."""
        token = self._token
        if token is None:
            return None
        # Checked once per name, owner and lifetime, then copied with the token and slot of
        # the moment: a tick of thousands of leases does not check each op twice (the
        # engine checks every op it runs).
        base, name, owner, ttl = self._renew_base, self._name, self._owner, self._ttl
        if base is None or base[0] is not name or base[1] is not owner or base[2] is not ttl:
            op = LockOps.renew(name, token=token, ttl_seconds=wire_seconds(ttl),
                               slot=self._slot, owner=owner)
            self._renew_base = (name, owner, ttl, op)
            op = dict(op)
        else:
            op = dict(base[3])
            op["token"] = token
            if self._slot is not None:
                op["slot"] = self._slot
        self._sending_ttl = ttl  # the lifetime the renewed lease's deadline counts
        return op

    def apply_renewal(self, answer: dict[str, Any], sent_at: float) -> bool:
        """Apply a renew answer (the caller has begun the call); False when the lease is gone.

        An answer that arrives after the local deadline never revives the lease: the
        loss may already have been reported, and work stopped because of it.
        """
        deadline = self.take_renewal(answer, sent_at, self._clock.monotonic())
        if deadline is None:
            return False
        self._client.metrics.renewals(1, margin=deadline - sent_at)
        return True

    def take_renewal(self, answer: Mapping[str, Any], sent_at: float,
                     landed: float) -> Optional[float]:
        """Apply the answer to a renew sent at ``sent_at``, judged at ``landed``, when it came.

        For a batch: the caller has begun the call, reads the clock once for all its
        answers and counts the renewals in the metrics (``apply_renewal`` does for one).

        Returns:
            The deadline the renew beat (for the margin), or None when the lease is gone:
                refused (``renew``), or past its deadline when the answer came (``expired``).

        Raises:
            ProtocolError: the answer's verdict is not true or false, or it says renewed
                but names no usable permit. Nothing changed: the caller treats it as a
                renew whose answer was lost.
        """
        permit = granted_permit(answer) if lock_verdict(answer, "renewed") else None
        with self._state:
            deadline = self._deadline
            live = self._token is not None and landed < deadline
            if live and permit is not None:
                ttl = self._sending_ttl
                self._deadline = sent_at + ttl  # before the token: never a late view
                self._next_renew = self._renew_planned(sent_at, ttl)
                self._token, self._slot = permit
                self._last_token = permit[0]
                self._unsure = False
                return deadline
        self.mark_lost("renew" if live else "expired")
        return None

    def _renew_planned(self, sent_at: float, ttl: float) -> float:
        """When to renew a lease sent at ``sent_at`` with the lifetime ``ttl`` its op carried.

        Not from ``renew_every`` alone: ``ttl`` may have been raised while the op was in
        flight, and a default period with it, past this lease's deadline. At least a
        third of the lease is left for the renew to land.
        """
        if not self.auto_renew:
            return _NEVER
        longest = ttl / 3 if self._chosen_renew_every is None else ttl * _RENEW_BY
        every = self.renew_every
        return sent_at + (every if every < longest else longest)  # a tick plans thousands

    def renewal_failed(self, now: float, sent_at: Optional[float] = None) -> None:
        """A renew call got no answer: try again sooner, until the local deadline.

        ``sent_at``: when the op went out (None: it was never sent).
        """
        if sent_at is not None:
            self._renew_unanswered(sent_at)
        self._unsure = True
        self._next_renew = now + min(self.renew_every, max(0.05, (self._deadline - now) / 4))

    def _renew_unanswered(self, sent_at: float) -> None:
        """A renew sent at ``sent_at`` may have applied: hold to the earlier deadline of the two.

        Applied, it counts the lease from then with the lifetime it carried, which may be
        shorter than the one the deadline counts now (``ttl`` was lowered).
        """
        with self._state:
            self._unsure = True
            if self._token is not None and sent_at + self._sending_ttl < self._deadline:
                self._deadline = sent_at + self._sending_ttl

    # ---- release and loss --------------------------------------------------------------

    def release(self) -> bool:
        """Give the permit back (after any renew in flight).

        While it waits for that renew the lease stays watched: reaching its deadline
        first is a loss, reported on time.

        Returns:
            True when the engine gave it back. False when it was no longer held: never
                taken, lost, or (over HTTP) given back by a first attempt whose answer was
                lost before the resent one arrived.

        Raises:
            EngineError: the engine could not be reached. The release may have landed,
                so the handle no longer holds: it stops renewing, and a lease still held
                expires by itself within its TTL. Calling ``release()`` again retries with
                the token; acquiring again asks the engine.
        """
        if self._generation != forks.generation:  # as ``_adopt_process``, a call less
            self.forget_after_fork()
        with self._io:
            token, slot = self._take_token()
            # After the token is gone: a child forked in between has no token, or has a
            # registered handle that the renewer's fork hook empties (as in ``mark_lost``).
            self._client.renewer.unregister(self)
            counted = token is not None
            if token is None:
                if self._unreleased is None:
                    return False
                token, slot = self._unreleased  # retrying a release that raised
            self._unreleased = None
            try:
                released = self._give_back(token, slot)
            except BaseException as exc:
                self._count_out(counted)
                if _interrupted(exc):
                    self._abandon()  # interrupted mid-call: the engine may still have it
                    raise
                # Given back or not, nobody can tell: holding on would let a later block
                # skip the engine while another process holds. Not renewed, it expires
                # within its TTL; the token stays for an explicit retry.
                self._unreleased = (token, slot)
                raise
        self._client.metrics.released(held=counted)
        return released

    def _count_out(self, counted: bool) -> None:
        if counted:
            self._client.metrics.held(-1)

    def begin_release(self, *, losing: Optional[str] = None) -> Optional[dict[str, Any]]:
        """Stop holding, for a release sent in a batch: the op to send (None: nothing held).

        As ``release()``, but the caller has claimed the call (``try_begin_call``) and
        sends the op with others, then hands the answer to ``end_release``. Until it
        does, the permit counts as one whose release raised: ``release()`` retries it.

        With ``losing`` (a reason: ``close()`` gives the leases back), a lease that a
        block or ``run()`` still runs under is marked lost for it, before the op is sent:
        once given back, the permit may be another's while the body goes on.
        """
        handlers: Optional[list[Callable[[str], Any]]] = None
        if losing is not None and self._blocks > 0:
            token, slot, handlers = self._take_token_lost(losing)
        else:
            token, slot = self._take_token()
        self._client.renewer.unregister(self)  # after: as in ``release``, for a fork between
        if token is not None:
            self._client.metrics.held(-1)
        elif self._unreleased is not None:
            token, slot = self._unreleased
        else:
            return None
        self._unreleased = (token, slot)
        if handlers is not None and losing is not None:
            # After the permit is noted for ``release()``: telling of the loss never keeps
            # it from being given back.
            try:
                self._announce_lost(losing, handlers)
            except Exception:
                log.exception("could not tell the handlers of lock %r of its loss", self.name)
        return self._release_op(token, slot)

    def end_release(self, answer: dict[str, Any]) -> bool:
        """Apply the answer to ``begin_release``'s op; True when the engine gave it back.

        Raises:
            ProtocolError: the answer is unreadable; the permit is kept for ``release()``.
        """
        released = lock_verdict(answer, "released")
        sent, self._unreleased = self._unreleased, None
        self._client.metrics.count("released")
        if released or sent is None:
            return released
        return self._release_moved_on(*sent)

    def _release_op(self, token: int, slot: Optional[int]) -> dict[str, Any]:
        """The release op for ``token`` and ``slot``, its name checked once (as ``renew_op``)."""
        base, name = self._release_base, self._name
        if base is None or base[0] != name:
            op = LockOps.release(name, token=token, slot=slot)
            self._release_base = (name, op)
            return dict(op)
        op = dict(base[1])
        op["token"] = token
        if slot is None:
            op.pop("slot", None)
        else:
            op["slot"] = slot
        return op

    def _take_token(self) -> tuple[Optional[int], Optional[int]]:
        """Stop holding: the token and slot held until now (None when nothing was held).

        Under the state lock, as ``mark_lost`` clears it: whichever of the two takes the
        token counts the lease out, the other finds nothing.
        """
        with self._state:
            token, slot = self._token, self._slot
            self._token = None
        return token, slot

    def _take_token_lost(self, reason: str) -> tuple[
            Optional[int], Optional[int], Optional[list[Callable[[str], Any]]]]:
        """``_take_token``, the lease marked lost for ``reason`` in the same step; the
        handlers to tell (None when nothing was held)."""
        with self._state:
            token, slot = self._token, self._slot
            self._token = None
            if token is None:
                return None, None, None
            return token, slot, self._set_lost(reason)

    def _give_back(self, token: int, slot: Optional[int]) -> bool:
        answer = self._client.call_locks([self._release_op(token, slot)])[0]
        if lock_verdict(answer, "released"):
            return True
        return self._release_moved_on(token, slot)

    def _release_moved_on(self, token: int, slot: Optional[int]) -> bool:
        """Release by owner a permit this owner's own renews moved past the token known here.

        A renew whose answer was lost, or a late duplicate of an answered one (a resend
        over HTTP), moves the row on. With a minted owner any permit of it is this
        handle's; an owner given as ``owner=`` may be a later incarnation's too (a
        worker's stable id across a restart), whose permit is not this handle's to free,
        so its permit is first renewed from ``token``: the engine renews only the
        permit its tokens since ``token`` moved, never a later holder's.
        """
        if not self._explicit_owner:
            return self._release_mine()
        renewed = self._client.call_locks([LockOps.renew(
            self.name, token=token, ttl_seconds=1, slot=slot, owner=self.owner)])[0]
        if not lock_verdict(renewed, "renewed"):
            return False
        moved, at = granted_permit(renewed)
        answer = self._client.call_locks([LockOps.release(self.name, token=moved, slot=at)])[0]
        return lock_verdict(answer, "released")

    def mark_lost(self, reason: str, *, past: Optional[float] = None) -> None:
        """Mark the lease lost once, and run the ``on_lost`` handlers off this thread.

        With ``past`` (a time on the client's monotonic clock), only a lease whose
        deadline is not after it: one renewed or taken afresh since it was judged stays.
        """
        with self._state:  # all of it, so that an acquire landing now is not undone
            if self._token is None or (past is not None and self._deadline > past):
                return
            self._token = None
            self._client.renewer.unregister(self)
            handlers = self._set_lost(reason)
        self._client.metrics.held(-1)
        self._announce_lost(reason, handlers)

    def _set_lost(self, reason: str) -> list[Callable[[str], Any]]:
        """Under the state lock: ``lost`` set for ``reason``; the handlers to call for it."""
        self.lost_reason = reason
        self.lost.set()
        # With ``lost``: a handler added after this runs from ``on_lost``, not twice.
        return list(self._handlers)

    def _announce_lost(self, reason: str, handlers: list[Callable[[str], Any]]) -> None:
        self._client.metrics.count(f"lost_{reason}")
        log.warning("lock %r lost (%s); owner %s", self.name, reason, self.owner)
        for handler in handlers:
            self._client.dispatch(handler, reason, self)

    def on_lost(self, fn: Callable[[str], Any]) -> Lock:
        """Call ``fn(reason)`` (off the renewer thread) when the lease is lost; returns self."""
        if not callable(fn):
            raise TypeError("on_lost takes a callable fn(reason)")
        with self._state:  # against mark_lost: either its list has fn, or lost is seen here
            self._handlers.append(fn)
            reason = self.lost_reason if self.lost.is_set() else None
        if reason is not None:
            self._client.dispatch(fn, reason, self)
        return self

    # ---- using it ----------------------------------------------------------------------

    def guard(self) -> dict[str, Any]:
        """The KV check that commits a transaction only while this permit is this token's."""
        token, slot = self._token, self._slot
        if token is None or slot is None or not self.held:
            raise LockNotHeldError(f"lock {self.name!r} is not held by this handle", name=self.name)
        return guard_op(self.name, slot, token)

    def check(self) -> None:
        """Raise ``LockLostError`` unless held now: call it just before a side effect."""
        if self.held:
            return
        reason = self.lost_reason or ("expired" if self._token is not None else None)
        what = f"was lost ({reason})" if reason else "is not held"
        raise LockLostError(f"lock {self.name!r} {what}", name=self.name, reason=reason,
                            token=self._last_token)

    def verify(self) -> bool:
        """Re-read the permit durably: True while the engine has it at this owner and token.

        ``held`` and ``check()`` are a local belief; a permit taken away and re-taken by
        someone else still passes them. Call this once before resuming parked work.

        Returns:
            True when the engine's permit is this handle's. False when this handle holds
                nothing, or when the permit is gone or someone else's: the lease is then
                marked lost (``guard``). When the engine cannot be asked, the local belief
                (``held``), and a warning is logged.
        """
        self._adopt_process()
        with self._io:  # no renew in flight: the token read here is the one the row should have
            token, slot = self._token, self._slot
            if token is None or slot is None or not self.held:
                return False
            try:
                answer = self._client.call_locks([LockOps.get(self.name)])[0]
            except StoreReplacedError:
                raise
            except EngineError as exc:
                log.warning("could not verify lock %r with the engine (%s); going by the "
                            "local belief", self.name, exc)
                return self.held
            return self._verified(answer, token, slot)

    def _verified(self, answer: dict[str, Any], token: int, slot: int) -> bool:
        permit = next((h for h in holders_from_wire(answer.get("holders")) if h.slot == slot),
                      None)
        mine = permit is not None and permit.owner == self.owner
        if mine and permit is not None and permit.token == token:
            return True
        if (mine and permit is not None and self._unsure and permit.token > token
                and not self._explicit_owner):
            # A renew whose answer was lost moved the row; it was sent after the one the
            # local deadline counts from, so that deadline still stands for the new token.
            with self._state:
                if self._token == token:
                    self._token = self._last_token = permit.token
                    self._unsure = False
            return self.held
        if mine and permit is not None and permit.token > token:
            # A late duplicate of an answered renew (a resend over HTTP) moved this owner's
            # row on: renewing from the token held gives a token and a deadline seen here.
            return self._renew_in_call()
        self.mark_lost("guard")
        return False

    def _renew_in_call(self) -> bool:
        """Renew from the token held, in a call already claimed; True while held after it."""
        op = self.renew_op()
        if op is None:
            return False
        sent_at = self._clock.monotonic()
        try:
            return self.apply_renewal(self._client.call_locks([op])[0], sent_at)
        except EngineError as exc:  # unanswered, or unreadable: it may have applied
            self._renew_unanswered(sent_at)
            log.warning("could not renew lock %r to verify it (%s); going by the local belief",
                        self.name, exc)
            return self.held

    def fence(self, conn: Any) -> None:
        """Assert, inside ``conn``'s open transaction, that this permit is still this token's.

        Only engines with the ``user_table_fencing`` capability (PostgreSQL) offer it.
        """
        engine = self._client.engine
        if not engine.capabilities.user_table_fencing:
            raise UnsupportedOperationError(
                f"{engine.kind} cannot fence writes to your own tables; use "
                "transaction().guard(lock) or lock.token", capability="user_table_fencing")
        self.check()
        assert self._slot is not None and self._token is not None
        engine.fence(conn, name=self.name, slot=self._slot, token=self._token)

    def run(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> RunResult[T]:
        """Acquire (with the handle's ``wait``), call ``fn``, release whatever happens.

        Inside a block of this handle it nests (see the class docstring); while another
        thread is inside one, it waits for it within ``wait`` or returns ``acquired=False``.
        """
        check_body(fn, "Lock.run")
        with _RunBlock(self) as entered:  # a with: no point between entry and its cleanup
            if not entered:
                return RunResult(acquired=False, holders=self._holders)
            value = fn(*args, **kwargs)
            check_body_result(value, "Lock.run")
        return RunResult(acquired=True, value=value)

    def __enter__(self) -> Lock:
        entry = self._enter_block(_suspendable(sys._getframe(1)))
        if entry != "in":
            if entry == "thread":
                raise LockNotHeldError(
                    f"lock {self.name!r}: this handle is in use by another thread of this "
                    "process (give the handle a wait= to wait for it)", name=self.name)
            busy = "; ".join(h.describe() for h in self._holders) or "no holder reported"
            raise LockNotHeldError(f"could not acquire lock {self.name!r}: {busy}",
                                   name=self.name, holders=self._holders)
        return self

    @bookkeeping
    def __exit__(self, *exc_info: Any) -> None:
        frame = _suspendable(sys._getframe(1))
        with interrupts_held():
            if frame is not None and not self._opened_in(frame) and self._forget_stale(frame):
                return  # its lease was given back when another thread took the handle over
            if self._blocks > 0 and self._generation == forks.generation:
                # From any thread: a generator suspended in the block may be closed elsewhere.
                self._exit_block(frame)
            else:
                self.release()  # an exit with no block open: the caller's explicit intent

    def _enter_block(self, frame: Optional[FrameType] = None) -> str:
        """Enter a with/run block: re-entrant in the owning thread, others wait their turn.

        ``frame``: the block's own frame, when it can be suspended (a generator's), so that
        its exit is known for a stale one once an ended thread's blocks are taken over.

        Returns:
            ``"in"``; ``"thread"`` when another thread kept it past the wait; ``"busy"``
            when the permit could not be taken.

        Raises:
            LockLostError: a block nested in one whose lease was lost (see
                ``_nested_in_live_lease``).
        """
        self._adopt_process()
        started = time.monotonic()
        steps: list[Any] = []  # what this entry has done, so that an unwind at any point is exact
        try:
            turn = self._take_turn(steps)
            if turn == "thread":
                return turn
            nested_in_lease = False
            if turn == "abandoned":
                self.release()  # the dead thread's lease: a fresh one fences its work out
            elif self._blocks > 1:
                nested_in_lease = self._nested_in_live_lease()
            left = max(0.0, self._default_wait - (time.monotonic() - started))
            took = nested_in_lease or self.acquire(wait=left)
            with interrupts_held():
                if not took:
                    steps.clear()
                    self._leave(release=False)
                    return "busy"
                steps.append(_current.set(self))
                self._contexts.append((steps[-1], frame))
        except BaseException:
            self._unwind_entry(steps)
            raise
        return "in"

    def _nested_in_live_lease(self) -> bool:
        """For a nested entry: True to go in under the lease held now, sending nothing.

        Decided from one reading of the token and the clock: judged held, then expired
        before a second look, the entry would take a new lease and clear ``lost``, and the
        outer block would never learn that a rival may have run in between. Only a lease
        given back by an explicit ``release()`` (no token, nothing lost) is taken afresh.

        Raises:
            LockLostError: the lease the outer blocks run under was lost, or has expired.
        """
        with self._state:
            token, now = self._token, self._clock.monotonic()
            if token is not None and now < self._deadline:
                return True
            lost = token is not None or self.lost.is_set()
        if token is not None:  # expired, not yet seen by the renewer
            self.mark_lost("expired", past=now)
        if not lost:
            return False
        reason = self.lost_reason or "expired"
        raise LockLostError(
            f"lock {self.name!r} was lost ({reason}) under the block this one is nested in; "
            "only an outermost block takes a new lease", name=self.name, reason=reason,
            token=self._last_token)

    def _take_turn(self, steps: list[Any]) -> str:
        """Count this thread in, waiting (within ``wait``) while another thread is inside."""
        me = threading.current_thread()
        deadline = time.monotonic() + self._default_wait
        while True:
            # Held per pass, the gate's exit included: Ctrl-C there would leave it locked.
            # Ctrl-C while waiting is raised when the pass ends, within one owner check.
            with interrupts_held(), self._gate:
                turn = self._claim(me)
                if turn != "wait":
                    steps.append(True)
                    return turn
                left = deadline - time.monotonic()
                if left <= 0:
                    self._holders = ()
                    return "thread"
                # Wake now and then: a thread that died inside a block never notifies.
                self._gate.wait(min(left, _OWNER_CHECK))

    def _claim(self, me: threading.Thread) -> str:
        """Under the gate: ``"in"``, ``"abandoned"`` (a dead thread's blocks), or ``"wait"``."""
        owner = self._owner_thread
        if owner is not None and owner is not me and owner.is_alive():
            return "wait"
        if owner is not me:  # first: a Ctrl-C before SIGINT is ours has changed nothing yet
            block_opened(id(self))
        abandoned = owner is not None and owner is not me
        if abandoned:  # its blocks exit only if a generator suspended in them is closed
            self._blocks = 0
            self._stale_frames.extend(f for _, f in self._contexts if f is not None)
            self._contexts.clear()
        self._owner_thread = me
        self._blocks += 1
        return "abandoned" if abandoned else "in"

    def _forget_stale(self, frame: FrameType) -> bool:
        """Whether ``frame`` is one of a stale block's (then forgotten: it exits once)."""
        with self._gate:
            for index, stale in enumerate(self._stale_frames):
                if stale is frame:
                    del self._stale_frames[index]
                    return True
        return False

    @bookkeeping
    def _unwind_entry(self, steps: list[Any]) -> None:
        """Undo the ``steps`` of an entry cut short (an error, or Ctrl-C anywhere in it)."""
        with interrupts_held():
            self._undo_steps(steps)

    def _undo_steps(self, steps: list[Any]) -> None:
        if len(steps) > 1:
            if self._contexts and self._contexts[-1][0] is steps[1]:
                self._contexts.pop()
            _reset_current(steps[1])
        if not steps:
            return
        try:
            self._leave(release=True)  # an outermost entry gives back what it took
        except Exception:
            log.warning("could not give back lock %r after a failed entry; it expires by "
                        "itself", self.name, exc_info=True)

    @bookkeeping
    def _exit_block(self, frame: Optional[FrameType] = None) -> None:
        """Count out the latest block opened in ``frame`` (blocks of two generators may
        close in any order), and the outermost's lease."""
        with interrupts_held():
            entries = self._contexts
            if entries:
                index = next((i for i in range(len(entries) - 1, -1, -1)
                              if entries[i][1] is frame), len(entries) - 1)
                _reset_current(entries.pop(index)[0])
            self._leave(release=True)

    def _opened_in(self, frame: FrameType) -> bool:
        """Whether a block open now (not a stale one) was entered in ``frame``."""
        return any(opened is frame for _, opened in self._contexts)

    def _leave(self, *, release: bool) -> None:
        """Count one block out; the outermost exit releases and lets the next thread in."""
        with self._gate:
            self._blocks = max(0, self._blocks - 1)
            outermost = self._blocks == 0
        if not outermost:
            return
        try:
            if release:
                self.release()
        finally:
            with self._gate:
                self._owner_thread = None
                self._gate.notify()
            block_closed(id(self))  # after the gate's exit: SIGINT may be Python's again

    # ---- processes ---------------------------------------------------------------------

    def _adopt_process(self) -> None:
        """In a process forked from the one this handle was used in, start afresh."""
        if self._generation != forks.generation:
            self.forget_after_fork()

    def _check_process(self) -> None:
        """In a forked child: start afresh, or refuse a handle given its owner (see below)."""
        self.forget_after_fork()
        if self._generation != forks.generation:  # only one given owner= stays the parent's
            raise LockError(
                f"lock {self.name!r}: this handle was given owner={self.owner!r} in process "
                f"{self._pid}, and this process was forked from it; one owner is one holder, "
                "so the child would share the parent's permit. Make the child its own handle.",
                name=self.name)

    def forget_after_fork(self) -> None:
        """In a forked child: hold nothing (the parent still does), as another holder.

        A minted owner is minted again for this process; an owner given as ``owner=``
        stays, and the handle then refuses to acquire here (see ``_check_process``).
        """
        self._reset_state()
        if not self._explicit_owner:
            self._owner, self._pid = mint_owner(), os.getpid()
            self._generation = forks.generation

    def __repr__(self) -> str:
        if self.held:
            state = (f"held token={self._token} slot={self._slot} "
                     f"expires_in={self.remaining:.1f}s")
        elif self.lost.is_set():
            state = f"lost ({self.lost_reason})"
        else:
            state = "not held"
        kind = f" limit={self.limit}" if self.limit > 1 else ""
        return f"<Lock {self.name!r}{kind} {state} owner={self.owner!r}>"

    def _repr_html_(self) -> str:
        from .._notebook.html import lock_html

        return lock_html(self)


class _RunBlock:
    """``run``'s block as a context manager: its exit is bookkeeping, so Ctrl-C cannot skip it."""

    __slots__ = ("_entered", "_lock")

    def __init__(self, lock: Lock) -> None:
        self._lock = lock
        self._entered = False

    def __enter__(self) -> bool:
        self._entered = self._lock._enter_block() == "in"
        return self._entered

    @bookkeeping
    def __exit__(self, *exc_info: Any) -> None:
        with interrupts_held():
            if self._entered:
                self._lock._exit_block()
