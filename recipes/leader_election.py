"""Leader election: one candidate at a time leads, and its writes carry a fencing token.

```python
import queen_sync as qs
from queen_sync.recipes.leader_election import LeaderElection, observe

with qs.Queen() as q:
    election = LeaderElection(q, "nightly-scheduler", ttl="30s",
                              on_elected=lambda token: print("leading with token", token))
    election.start()                     # campaigns on a background thread
    if election.wait_elected(timeout=5):
        print(election.leader())         # who leads, since when, until when (engine's clock)
        print(election.health().seconds_left)  # this process's own belief, no engine call
    with observe(q, "nightly-scheduler", every="1s") as watcher:  # never campaigns
        print(watcher.wait_for_leader(timeout=5).identity == election.identity)  # True
    election.stop()                      # resigns if leading
```

Processes that only need to know who leads (a dashboard, a router sending work
to the leader) ``observe(client, name, on_new_leader=...)`` instead of
campaigning: they read the lock every ``every`` seconds and hear of each new
term, with its leader and token. ``election.health()`` answers, from this
process's own state, whether it believes it leads, with which token, for how
many more seconds, and how long ago its lease was last renewed.

Every candidate holds a handle on the same lock. The one that acquires it leads
for as long as the background renewer keeps the lease; the others keep trying
every renew interval (a third of ``ttl``), and one of them takes over within
``ttl`` plus one retry interval after the leader dies.

What it guarantees:
    * At most one candidate believes it leads at any instant *by its own clock*,
      and every term has a token higher than any earlier term's.
    * ``on_elected(token)`` and ``on_deposed(reason)`` run once per term, on the
      campaign thread (never on the renewer thread). ``reason`` is ``"renew"``,
      ``"expired"`` or ``"guard"`` when the lease was lost, ``"closed"`` when its
      client was closed (``q.close()`` gives the lease back, and the term ends then),
      ``"resigned"`` when this candidate gave it up (``resign()``, ``stop()``, the end
      of ``run()``).
    * A won lease is re-read from the engine (``lock.verify()``) before its term
      starts: a permit taken away meanwhile starts no term and calls no callback.
    * After a term ends, the candidate does not campaign again for one renew
      interval, so a candidate that was just deposed cannot snatch the lease back
      from the one that replaced it (no thrashing).
    * The campaign thread outlives a failure: an engine error, or one queen_sync does
      not know (logged with its traceback once per streak, on the ``queen_sync.recipes``
      logger), is reported in ``health().last_error`` and retried every renew interval.
      A callback that raises anything, ``SystemExit`` and ``KeyboardInterrupt`` included,
      is logged with its traceback on that logger and reported in ``health().last_error``;
      its term and the campaign go on. Only a closed client ends the campaign.
    * ``start()`` after a ``stop()`` whose wait timed out campaigns again, once the stopped
      campaign has resigned and its ``on_deposed`` has returned.
    * In a forked child, a copy of the election holds nothing and reports nothing of the
      parent's term: it is a candidate that has not started (its lease handle belongs to
      the parent, so a ``start()`` there ends at once, saying so in ``last_error``).

What it does not do:
    * Make two leaders impossible. A leader paused longer than ``ttl`` (a GC
      pause, a suspended VM) wakes up still believing it leads. Only the token
      makes its late writes harmless: write through
      ``q.transaction().guard(election.lock)``, or hand ``election.token`` to a
      sink that refuses a token lower than one it has already accepted.
    * Pick a particular candidate: whoever asks first after the lease frees wins.
    * Keep ``run()`` going through a callback's ``SystemExit`` or ``KeyboardInterrupt``:
      on the caller's own thread, those end ``run()`` (it resigns on the way out).
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Optional, overload

from typing_extensions import deprecated

import queen_sync as qs
from queen_sync import Duration

from ._arbitration import require_arbitration
from ._callables import check_function
from ._client_arg import the_client
from ._leader_watch import (
    BackgroundLoop,
    Leader,
    LeaderObserver,
    call_back,
    candidate_owner,
    check_identity,
    read_leader,
)
from ._live_state import NotCopied

__all__ = ["Leader", "LeaderElection", "LeaderHealth", "LeaderObserver", "observe"]

log = logging.getLogger("queen_sync.recipes")

#: Longest single wait on the lock, so ``stop()`` is noticed promptly.
_MAX_CAMPAIGN_WAIT = 1.0
_MAX_OWNER_BYTES = 256  # the longest lock owner every engine accepts


@dataclass(frozen=True)
class LeaderHealth:
    """What this candidate believes about its own leadership, by this machine's clock.

    Attributes:
        leading: it holds the lease now (a belief with a deadline, as ``is_leader``).
        token: the fence for its writes now; None when not leading.
        seconds_left: until the lease lapses unless renewed (0 when not leading).
        renewed_ago: seconds since the acquire or renewal that keeps the lease was sent
            (None when not leading); past one renew interval, renewals are failing.
        renew_every: the renew interval, to judge ``renewed_ago`` by.
        campaigning: the campaign thread is alive (``start()`` and not yet stopped),
            including while a restarted campaign waits for the stopped one to end.
        terms: how many terms this candidate has led.
        last_error: the last failure the campaign met (the engine's, an error queen_sync
            does not know, or a callback's), cleared by the engine's next answer.
    """

    leading: bool
    token: Optional[int]
    seconds_left: float
    renewed_ago: Optional[float]
    renew_every: float
    campaigning: bool
    terms: int
    last_error: Optional[str]

    @property
    def renewing(self) -> bool:
        """True while leading and the last renewal is at most two renew intervals old."""
        return self.leading and self.renewed_ago is not None and (
            self.renewed_ago <= 2 * self.renew_every)


class LeaderElection(NotCopied):
    """Campaign for leadership of ``name`` among every candidate using that name.

    Args:
        client: the client whose engine arbitrates (``q=`` is a deprecated spelling of
            this keyword).
        name: the election's name (a lock name: shared by every candidate).
        ttl: how long a leader's lease lasts without renewal (seconds, timedelta or
            ``"30s"``); a dead leader is replaced within ``ttl`` plus one renew
            interval (a third of ``ttl``).
        on_elected: called with the term's first token when this candidate starts leading.
        on_deposed: called with the reason when its term ends (see the module docstring).
        identity: how this candidate appears in ``leader()`` (at most 247 UTF-8 bytes).
            Default: ``host:pid:random``. Its lease's owner is the identity plus a suffix
            of its own, so candidates that share an identity (a restarted node whose
            predecessor still runs) never lead at once.

    Raises:
        TypeError, ValueError: for a bad client, ``ttl``, ``name``, ``identity`` or
            callback (not callable, or a generator or async function), before any I/O.
        UnsupportedOperationError: the client's engine lacks ``fencing`` or
            ``engine_clock_expiry`` (``capability`` names which).
    """

    _remake = ("make another LeaderElection(client, name, ...); in another process, with a "
               "client of its own")

    @overload
    def __init__(self, client: qs.Queen, name: str, *, ttl: Duration,
                 on_elected: Optional[Callable[[int], Any]] = None,
                 on_deposed: Optional[Callable[[str], Any]] = None,
                 identity: Optional[str] = None) -> None: ...

    @overload
    @deprecated("LeaderElection(q=...) is deprecated: pass client=...")
    def __init__(self, *, q: qs.Queen, name: str, ttl: Duration,
                 on_elected: Optional[Callable[[int], Any]] = None,
                 on_deposed: Optional[Callable[[str], Any]] = None,
                 identity: Optional[str] = None) -> None: ...

    def __init__(
        self,
        client: Optional[qs.Queen] = None,
        name: Optional[str] = None,
        *,
        ttl: Duration,
        on_elected: Optional[Callable[[int], Any]] = None,
        on_deposed: Optional[Callable[[str], Any]] = None,
        identity: Optional[str] = None,
        q: Optional[qs.Queen] = None,
    ) -> None:
        self._q = the_client(client, q, "LeaderElection")
        require_arbitration(self._q, "LeaderElection")
        if not isinstance(name, str):
            raise TypeError(f"name must be a str, got {type(name).__name__}")
        for what, fn in (("on_elected", on_elected), ("on_deposed", on_deposed)):
            if fn is not None:
                check_function(fn, what)
        self.identity = (_mint_identity() if identity is None
                         else check_identity(identity, _MAX_OWNER_BYTES))
        # The handle's own wait is each campaign try's (``lock.run`` takes it): a renew
        # interval, at most a second, so that stop() is noticed promptly.
        retry_every = self._q.lock(name, ttl=ttl).renew_every
        self.lock = self._q.lock(name, ttl=ttl, owner=candidate_owner(self.identity),
                                 wait=min(retry_every, _MAX_CAMPAIGN_WAIT))
        self.name = name
        self.retry_every = self.lock.renew_every
        self._on_elected = on_elected
        self._on_deposed = on_deposed
        self._loops = BackgroundLoop(f"leader-election-{name}", self._campaign,
                                     on_stop=lambda: self._wake.set())
        self._forget_terms()
        self.lock.on_lost(lambda _reason: self._wake.set())
        _ELECTIONS.add(self)

    def _forget_terms(self) -> None:
        """The state of a candidate that has not campaigned yet (its thread's events too)."""
        self._wake = threading.Event()
        self._elected = threading.Event()
        self._resigning = False
        self._cooldown_until = 0.0
        self.terms = 0
        self._last_error: Optional[str] = None
        self._unexpected: Optional[Exception] = None  # the last of a streak of unknown errors

    def _forget_after_fork(self) -> None:
        # The client's own hook has emptied the lease handle; the parent's term, thread
        # and events are not this process's either.
        self._loops.forget_after_fork()
        self._forget_terms()

    # ---- what callers read ---------------------------------------------------------------

    @property
    def is_leader(self) -> bool:
        """True while this candidate holds the lease by its own clock (a belief: see token)."""
        return self.lock.held

    @property
    def token(self) -> Optional[int]:
        """The fence for this leader's writes, read at use time; None when not leading."""
        return self.lock.token

    def leader(self) -> Optional[Leader]:
        """Who leads now, since when and until when, asked of the engine; None if nobody."""
        return read_leader(self._q, self.name)

    def health(self) -> LeaderHealth:
        """Whether this process believes it leads, with which token and for how much longer.

        Reads only this process's own state (no engine call), so a liveness probe may
        call it as often as it likes.
        """
        lock = self.lock
        token, left = lock.token, lock.remaining
        leading = token is not None
        return LeaderHealth(
            leading=leading, token=token, seconds_left=left if leading else 0.0,
            renewed_ago=max(0.0, lock.ttl - left) if leading else None,
            renew_every=self.retry_every, campaigning=self._loops.alive,
            terms=self.terms, last_error=self._last_error)

    def wait_elected(self, timeout: Optional[float] = None) -> bool:
        """Block until this candidate leads (True) or ``timeout`` seconds pass (False)."""
        return self._elected.wait(timeout)

    # ---- campaigning ---------------------------------------------------------------------

    def run(self) -> None:
        """Campaign until ``stop()``: lead whenever the lease is free. Resigns on the way out.

        A ``stop()`` that came before this call is not counted: ``run()`` campaigns again.
        A callback's ``SystemExit`` or ``KeyboardInterrupt`` ends it, after it resigns.
        """
        self._loops.run_here()

    def _campaign(self, stopping: threading.Event) -> None:
        try:
            while not stopping.is_set():
                pause = self._cooldown_until - time.monotonic()
                if pause > 0:
                    stopping.wait(pause)
                else:
                    self._campaign_once(stopping)
        finally:
            if self.lock.held or self._elected.is_set():
                self._resigning = True
                self._release_quietly()
                self._end_term()

    def _release_quietly(self) -> None:
        try:
            self.lock.release()
        except Exception as exc:  # on the way out: the lease expires by itself within its ttl
            log.warning("%s could not resign %r (%s); the lease expires within its ttl",
                        self.identity, self.name, exc)

    def start(self) -> LeaderElection:
        """Campaign on a daemon thread; returns self.

        Starts racing on threads start one campaign on the handle. After a ``stop()``
        whose wait timed out (its ``on_deposed`` still running, say), that stop still
        happens, resignation and ``on_deposed`` included, and the campaign goes on right
        after, on a new thread; ``health().campaigning`` is True from this call on.
        """
        self._loops.start()
        return self

    def stop(self, timeout: Optional[float] = 5.0) -> None:
        """Stop campaigning and resign if leading; waits up to ``timeout`` for the thread.

        A stop whose wait timed out still happens: the campaign resigns when its
        current step (a callback, say) returns.
        """
        self._loops.stop(timeout)

    def resign(self) -> bool:
        """Give up leadership now (others may take it); False when not leading.

        The campaign goes on: this candidate may lead again after one renew interval.
        """
        if not self.lock.held:
            return False
        self._resigning = True
        released = self.lock.release()
        self._wake.set()
        return released

    def _campaign_once(self, stopping: threading.Event) -> None:
        """One try for the lease; a term, when won, served to its end inside ``lock.run``.

        In the block: ``q.close()`` then marks the lease lost (``"closed"``) as it gives it
        back, which wakes the term at once; outside one, close() would only drop the token
        and the term would notice at the lease's deadline, as ``"expired"``.
        """
        try:
            won = self.lock.run(self._term, stopping).acquired
        except qs.EngineError as exc:
            # The engine is unreachable: nobody can be elected through it; try again later.
            log.warning("campaign for %r failed, retrying: %s", self.name, exc)
            self._failed(exc, stopping)
            return
        except qs.QueenError as exc:
            # Not the engine's: a closed client, which no retry mends. The campaign ends.
            log.warning("campaign for %r stops: %s", self.name, exc)
            self._last_error = str(exc)
            stopping.set()
            return
        except Exception as exc:
            # No error queen_sync knows (a custom engine's bug, say): the campaign thread must
            # not die of it unheard. Its traceback is told once a streak; then it retries.
            if self._unexpected is None:
                log.error("campaign for %r failed unexpectedly; retrying every %gs",
                          self.name, self.retry_every, exc_info=exc)
            else:
                log.warning("campaign for %r failed again, retrying: %r", self.name, exc)
            self._unexpected = exc
            self._failed(exc, stopping)
            return
        if not won:
            self._answered()  # busy: the engine answered, so no failure lasts

    def _term(self, stopping: threading.Event) -> None:
        """Under the lease just won: start a term if the engine agrees it is ours."""
        self._answered()
        if not self.lock.verify():
            # The permit was taken away between the win and now (a break-glass release,
            # then another candidate): no term starts, and the cooldown keeps out of its way.
            log.warning("%s won %r but the permit is no longer its own; no term starts",
                        self.identity, self.name)
            self._cooldown_until = time.monotonic() + self.retry_every
            return
        self._serve_term(stopping)

    def _answered(self) -> None:
        if self._unexpected is not None:
            log.info("campaign for %r goes on after %r", self.name, self._unexpected)
        self._last_error, self._unexpected = None, None

    def _failed(self, exc: Exception, stopping: threading.Event) -> None:
        self._last_error = str(exc) or repr(exc)
        stopping.wait(self.retry_every)

    def _serve_term(self, stopping: threading.Event) -> None:
        token = self.lock.token
        self.terms += 1
        self._resigning = False
        self._elected.set()
        log.info("%s leads %r with token %s", self.identity, self.name, token)
        if self._on_elected is not None and token is not None:
            self._call("on_elected", self._on_elected, token)
        while self.lock.held and not stopping.is_set():
            self._wake.wait(max(0.001, self.lock.remaining))
            self._wake.clear()
        if not stopping.is_set():
            self._end_term()

    def _end_term(self) -> None:
        if self.lock.lost.is_set():
            reason = self.lock.lost_reason or "expired"
        else:
            reason = "resigned" if self._resigning else "expired"
        # Anti-thrash: a candidate that just lost the lease stays out for one renew interval.
        # Not after a close: its next try finds the client closed and ends the campaign.
        if reason != "closed":
            self._cooldown_until = time.monotonic() + self.retry_every
        self._elected.clear()
        log.info("%s no longer leads %r (%s)", self.identity, self.name, reason)
        if self._on_deposed is not None:
            self._call("on_deposed", self._on_deposed, reason)

    def _call(self, what: str, fn: Callable[[Any], Any], arg: Any) -> None:
        raised = call_back(fn, arg, f"{what} of the election {self.name!r}",
                           "campaigning goes on")
        if raised is not None:
            self._last_error = f"{what} raised {raised!r}"

    def __enter__(self) -> LeaderElection:
        return self.start()

    def __exit__(self, *exc_info: Any) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = f"leading token={self.token}" if self.is_leader else "following"
        return f"<LeaderElection {self.name!r} {state} identity={self.identity!r}>"


def _mint_identity() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"


_ELECTIONS: weakref.WeakSet[LeaderElection] = weakref.WeakSet()  # to reset after a fork


def _forget_parents_terms() -> None:
    for election in list(_ELECTIONS):
        try:
            election._forget_after_fork()
        except BaseException:  # the next election must still forget its parent's term
            log.error("resetting %r in a forked child failed; do not use it in this process",
                      election, exc_info=True)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_parents_terms)


def observe(client: qs.Queen, name: str, *,
            on_new_leader: Optional[Callable[[Leader], Any]] = None,
            every: Duration = 1.0) -> LeaderObserver:
    """Follow the election ``name`` without campaigning; returns the started observer.

    ``on_new_leader(leader)`` runs on the observer's thread once per term it sees, in
    order, each term's token higher than the last; whatever it raises (``SystemExit``
    and ``KeyboardInterrupt`` included) is logged with its traceback, and observing goes
    on. A term that starts and ends between two reads (``every`` apart) is not seen.
    ``observer.stop()`` (or ``with``) ends it, and a ``wait_for_leader`` under way then
    returns after one more read.
    """
    return LeaderObserver(client, name, on_new_leader=on_new_leader, every=every).start()
