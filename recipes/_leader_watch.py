"""Who leads an election, read from the lock's permit: for candidates and for observers.

An observer never campaigns: it reads the election's lock (``client.locks.get``) every
``every`` seconds and reports each new term it sees. A term is one holding of the lock:
its holder and the engine's ``since`` (when that holding was acquired) stay the same
while the leader renews, although the token rises at every renewal.

Both the campaign and the watch are a ``BackgroundLoop``: a loop on a daemon thread that
any thread may start and stop, with a stop flag of its own for each run. A ``start()``
while a stopped run is still finishing (a ``stop()`` whose wait timed out, a slow
callback) never undoes that stop and is never lost: the next run starts on a new thread
that first waits for the last one to end, so two runs never overlap.

A user's callback that raises anything on a loop's thread is logged with its traceback,
and the loop goes on: a ``SystemExit`` from ``sys.exit()`` there would only end the
thread, unheard. On a caller's own thread (``run()``, ``poll()``), an exception that is
not an ``Exception`` (Ctrl-C, ``sys.exit()``) goes on to the caller.
"""

from __future__ import annotations

import logging
import re
import secrets
import threading
import time
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Callable, Optional

import queen_sync as qs
from queen_sync import Duration

from ._callables import check_function
from ._client_arg import check_client
from ._engine_time import utc
from ._live_state import NotCopied

log = logging.getLogger("queen_sync.recipes")

#: The longest poll interval an observer accepts, so it learns of a new term in bounded time.
MAX_OBSERVE_EVERY = 3600.0
#: How long a new run waits for a stopped one quietly before it warns that it still waits.
_PATIENCE = 1.0

_loop_thread = threading.local()  # ``.loop``: the BackgroundLoop whose thread this is

# A candidate's lease owner is its identity plus a suffix of its own: two candidates given
# one identity (a restarted node whose predecessor still runs) are then two holders, and
# the engine lets only one of them lead.
_CANDIDATE_OWNER = re.compile(r"(.+)/([0-9a-f]{8})", re.DOTALL)
_SUFFIX_BYTES = 9


def candidate_owner(identity: str) -> str:
    """The lease owner of one candidate shown as ``identity``."""
    return f"{identity}/{secrets.token_hex(4)}"


def identity_of(owner: Optional[str]) -> Optional[str]:
    """The identity a candidate's lease owner shows (an owner of another form as it is)."""
    if owner is None:
        return None
    match = _CANDIDATE_OWNER.fullmatch(owner)
    return match.group(1) if match else owner


def check_identity(identity: Any, max_owner_bytes: int) -> str:
    """A candidate's identity, with room left for its owner suffix; raised before any I/O."""
    if not isinstance(identity, str):
        raise TypeError(f"identity must be a str, got {type(identity).__name__}")
    room = max_owner_bytes - _SUFFIX_BYTES
    if not identity or len(identity.encode("utf-8", "surrogatepass")) > room:
        raise ValueError(f"identity must be 1..{room} UTF-8 bytes, got {identity!r}")
    return identity


def on_a_loop_thread() -> bool:
    """True on a thread a ``BackgroundLoop`` started (not on a caller's own thread)."""
    return getattr(_loop_thread, "loop", None) is not None


def call_back(fn: Callable[[Any], Any], arg: Any, what: str,
              goes_on: str) -> Optional[BaseException]:
    """Call a user's callback; what it raises is logged with its traceback and returned.

    Raises:
        BaseException: one that is not an ``Exception``, raised on a caller's own thread.
    """
    try:
        fn(arg)
    except BaseException as exc:
        if not isinstance(exc, Exception) and not on_a_loop_thread():
            raise  # the caller's Ctrl-C or sys.exit(): the caller's to handle
        log.error("%s raised %r; %s", what, exc, goes_on, exc_info=exc)
        return exc
    return None


class BackgroundLoop:
    """``loop(stopping)`` on a daemon thread, started and stopped from any thread.

    Each run has a stop flag of its own (see the module docstring). ``on_stop`` is
    called after ``stop()`` sets the flags and before it waits, to wake a run that
    sleeps on something else.
    """

    def __init__(self, thread_name: str, loop: Callable[[threading.Event], None],
                 on_stop: Optional[Callable[[], None]] = None) -> None:
        self._thread_name = thread_name
        self._loop = loop
        self._on_stop = on_stop
        self.forget_after_fork()

    def forget_after_fork(self) -> None:
        """Start afresh: no thread, no run (in a forked child, the parent's are not here)."""
        # New primitives too: a parent's thread may have held one at the fork.
        self._mutex = threading.Lock()  # start() and stop() on racing threads: one at a time
        self._thread: Optional[threading.Thread] = None
        self._thread_stopping = threading.Event()
        self.stopping = threading.Event()  # the newest run's flag, set by any stop()
        self._runs: set[threading.Event] = set()  # the flags of the runs not yet ended

    @property
    def thread(self) -> Optional[threading.Thread]:
        """The newest background run's thread (None before the first start)."""
        return self._thread

    @property
    def alive(self) -> bool:
        """True while the newest background run's thread runs (or waits to)."""
        thread = self._thread
        return thread is not None and thread.is_alive()

    def start(self) -> None:
        """Run on a new daemon thread, unless a run not asked to stop is already on one."""
        with self._mutex:
            before = self._thread
            if before is not None and before.is_alive() and not self._thread_stopping.is_set():
                return
            stopping = self._begin()
            self._thread_stopping = stopping
            self._thread = threading.Thread(target=self._run_after, args=(before, stopping),
                                            name=self._thread_name, daemon=True)
            self._thread.start()  # under the mutex: a stop() never sees it unstarted

    def run_here(self) -> None:
        """Run on the calling thread until stopped; an earlier stop() is not counted."""
        with self._mutex:
            stopping = self._begin()
        self._run(stopping)

    def stop(self, timeout: Optional[float]) -> None:
        """Ask every run to stop, then wait up to ``timeout`` for the background one."""
        with self._mutex:
            for stopping in (*self._runs, self.stopping):
                stopping.set()
            thread = self._thread
        if self._on_stop is not None:
            self._on_stop()
        # Not from one of its own runs (a callback): a stopped run joining its successor,
        # which waits for that run to end, would only wait out the timeout.
        if thread is not None and getattr(_loop_thread, "loop", None) is not self:
            thread.join(timeout)

    def _begin(self) -> threading.Event:
        stopping = threading.Event()
        self.stopping = stopping
        self._runs.add(stopping)
        return stopping

    def _run_after(self, before: Optional[threading.Thread], stopping: threading.Event) -> None:
        _loop_thread.loop = self
        if before is not None:
            before.join(_PATIENCE)
            if before.is_alive():
                log.warning("%s waits for its stopped run to end (in a callback?) before it "
                            "goes on", self._thread_name)
                before.join()
        self._run(stopping)

    def _run(self, stopping: threading.Event) -> None:
        try:
            self._loop(stopping)
        finally:
            # A run that ended by itself (a closed client) is stopped too: a start() racing
            # its last steps then starts the next run instead of taking it for a live one.
            stopping.set()
            with self._mutex:
                self._runs.discard(stopping)


@dataclass(frozen=True)
class Leader:
    """The current leader as the engine reports it (times by the engine's clock, UTC).

    ``token`` is the leader's token when it was read; it rises at each renewal, and
    every later term's tokens are higher.
    """

    identity: Optional[str]
    token: int
    since: datetime
    until: Optional[datetime]


def read_leader(client: qs.Queen, name: str) -> Optional[Leader]:
    """Who holds the election's lock now, asked of the engine; None if nobody."""
    holders = client.locks.get(name).get("holders") or []
    if not holders:
        return None
    top = holders[0]
    return Leader(identity=identity_of(top.get("owner")), token=int(top["token"]),
                  since=utc(top["since"]),
                  until=utc(top.get("expiresAt")))


def _same_term(a: Optional[Leader], b: Optional[Leader]) -> bool:
    return a is not None and b is not None and (a.identity, a.since) == (b.identity, b.since)


class LeaderObserver(NotCopied):
    """Follow the leadership of ``name`` without campaigning.

    Args:
        client: the client whose engine arbitrates the election.
        name: the election's name (what the candidates pass to ``LeaderElection``).
        on_new_leader: called with the ``Leader`` each time a new term is seen (on the
            thread that polled: the observer's own once ``start()``-ed). Whatever it
            raises there, ``SystemExit`` and ``KeyboardInterrupt`` included, is logged with
            its traceback and observing goes on; raised in ``poll()`` or
            ``wait_for_leader()`` on a caller's thread, one that is not an ``Exception``
            reaches the caller.
        every: how often the background thread reads the lock (seconds, timedelta or
            ``"1s"``; at most an hour).

    Raises:
        TypeError, ValueError: for a bad client, ``name``, ``every`` or ``on_new_leader``.
    """

    _remake = "make another with observe(client, name, ...)"

    def __init__(self, client: qs.Queen, name: str, *,
                 on_new_leader: Optional[Callable[[Leader], Any]] = None,
                 every: Duration = 1.0) -> None:
        check_client(client, "LeaderObserver")
        client.lock(name, ttl=1)  # checks the name as every lock name is checked (no I/O)
        self.every = qs.parse_duration(every, what="every")
        if self.every > MAX_OBSERVE_EVERY:
            raise ValueError(f"every must be at most {MAX_OBSERVE_EVERY:.0f}s, got {every!r}")
        if on_new_leader is not None:
            check_function(on_new_leader, "on_new_leader")
        self._q = client
        self.name = name
        self._on_new_leader = on_new_leader
        self._mutex = threading.RLock()  # one poll at a time, so terms are reported in order
        self._last: Optional[Leader] = None
        self.terms_seen = 0
        self._loops = BackgroundLoop(f"leader-observer-{name}", self._watch)
        self._failing = False

    @property
    def last(self) -> Optional[Leader]:
        """The leader of the newest term seen so far (None before any was seen)."""
        return self._last

    def leader(self) -> Optional[Leader]:
        """Who leads now, asked of the engine (reports nothing to ``on_new_leader``)."""
        return read_leader(self._q, self.name)

    def poll(self) -> Optional[Leader]:
        """Read the lock once; report a term not seen before. Returns who leads now.

        Raises:
            EngineError: the engine could not be asked.
        """
        with self._mutex:
            now = read_leader(self._q, self.name)
            if now is None or _same_term(now, self._last):
                if now is not None:
                    self._last = now  # the same term, at its newest token
                return now
            self._last = now
            self.terms_seen += 1
            log.info("observer of %r sees a new leader %s with token %s", self.name,
                     now.identity, now.token)
            if self._on_new_leader is not None:
                call_back(self._on_new_leader, now, f"on_new_leader for {self.name!r}",
                          "observing goes on")
            return now

    def wait_for_leader(self, *, newer_than: Optional[int] = None,
                        timeout: Optional[float] = None) -> Optional[Leader]:
        """Poll until a leader is seen (with a token above ``newer_than``), or None at timeout.

        The token rises at every renewal, so ``newer_than=leader.token`` returns the same
        leader a renew interval later: to wait for another term, compare the answer's
        ``since`` (or ``identity``) with the one you hold, or watch ``terms_seen``.

        Once the observer is stopped, it reads the lock once more and answers at once: a
        wait under way when ``stop()`` is called returns then, and one begun after the
        stop waits no longer (``start()`` again to wait).
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        stopping = self._loops.stopping  # a stop() now sets it, even if a start() follows
        while True:
            stopped = stopping.is_set()  # before the read: a stop during it is seen next
            now = self._poll_quietly()
            if now is not None and (newer_than is None or now.token > newer_than):
                return now
            left = None if deadline is None else deadline - time.monotonic()
            if stopped or (left is not None and left <= 0):
                return None
            stopping.wait(self.every if left is None else min(self.every, left))

    def start(self) -> LeaderObserver:
        """Observe on a daemon thread (``on_new_leader`` runs there); returns self.

        Starts racing on threads start one watch. After a ``stop()`` whose wait timed out
        (``on_new_leader`` still running), the watch goes on on a new thread as soon as the
        stopped one has ended; ``observing`` is True from this call on.
        """
        self._loops.start()
        return self

    def stop(self, timeout: Optional[float] = 5.0) -> None:
        """Stop the background thread and wait up to ``timeout`` seconds for it."""
        self._loops.stop(timeout)

    @property
    def observing(self) -> bool:
        """True while the background thread runs."""
        return self._loops.alive

    def _watch(self, stopping: threading.Event) -> None:
        while not stopping.is_set():
            try:
                self._poll_quietly()
            except qs.QueenError as exc:  # a closed client: no later poll can succeed
                log.warning("observer of %r stops: %s", self.name, exc)
                return
            stopping.wait(self.every)

    def _poll_quietly(self) -> Optional[Leader]:
        try:
            now = self.poll()
        except qs.EngineError as exc:
            if not self._failing:  # once per outage, not once per poll
                log.warning("observer of %r cannot read the lock, retrying: %s", self.name, exc)
            self._failing = True
            return None
        except qs.QueenError:
            raise  # not the engine's: a closed client, which no retry mends
        except Exception:
            log.exception("observer of %r failed to read the lock; observing goes on",
                          self.name)
            return None
        if self._failing:
            log.info("observer of %r reads the lock again", self.name)
        self._failing = False
        return now

    def __enter__(self) -> LeaderObserver:
        return self.start()

    def __exit__(self, *exc_info: Any) -> None:
        self.stop()

    def __repr__(self) -> str:
        last = self._last
        seen = f"last leader {last.identity!r} token={last.token}" if last else "no leader seen"
        return f"<LeaderObserver {self.name!r} {seen} every={self.every}s>"
