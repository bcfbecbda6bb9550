"""Leader election: one candidate at a time leads, and its writes carry a fencing token.

```python
import queen_sync as qs
from queen_sync.recipes.leader_election import LeaderElection

with qs.Queen() as q:
    election = LeaderElection(q, "nightly-scheduler", ttl="30s",
                              on_elected=lambda token: print("leading with token", token))
    election.start()                     # campaigns on a background thread
    if election.wait_elected(timeout=5):
        print(election.leader())         # who leads, since when, until when (engine's clock)
    election.stop()                      # resigns if leading
```

Every candidate holds a handle on the same lock. The one that acquires it leads
for as long as the background renewer keeps the lease; the others keep trying
every renew interval (a third of ``ttl``), and one of them takes over within
``ttl`` plus one retry interval after the leader dies.

What it guarantees:
    * At most one candidate believes it leads at any instant *by its own clock*,
      and every term has a token higher than any earlier term's.
    * ``on_elected(token)`` and ``on_deposed(reason)`` run once per term, on the
      campaign thread (never on the renewer thread). ``reason`` is ``"renew"``,
      ``"expired"`` or ``"guard"`` when the lease was lost, ``"resigned"`` when this
      candidate gave it up (``resign()``, ``stop()``, the end of ``run()``).
    * After a term ends, the candidate does not campaign again for one renew
      interval, so a candidate that was just deposed cannot snatch the lease back
      from the one that replaced it (no thrashing).

What it does not do:
    * Make two leaders impossible. A leader paused longer than ``ttl`` (a GC
      pause, a suspended VM) wakes up still believing it leads. Only the token
      makes its late writes harmless: write through
      ``q.transaction().guard(election.lock)``, or hand ``election.token`` to a
      sink that refuses a token lower than one it has already accepted.
    * Pick a particular candidate: whoever asks first after the lease frees wins.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
import time
import warnings
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any, Callable, Optional, Union, overload

from typing_extensions import deprecated

import queen_sync as qs

__all__ = ["Leader", "LeaderElection"]

log = logging.getLogger("queen_sync.recipes")

#: Seconds, a ``timedelta`` or a string such as ``"30s"`` (as everywhere in queen_sync).
Duration = Union[float, timedelta, str]

#: Longest single wait on the lock, so ``stop()`` is noticed promptly.
_MAX_CAMPAIGN_WAIT = 1.0


@dataclass(frozen=True)
class Leader:
    """The current leader as the engine reports it (times by the engine's clock, UTC)."""

    identity: Optional[str]
    token: int
    since: datetime
    until: Optional[datetime]


class LeaderElection:
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
        identity: how this candidate appears in ``leader()``; unique per candidate.
            Default: ``host:pid:random``.

    Raises:
        TypeError, ValueError: for a bad ``ttl``, ``name`` or ``identity`` (before any I/O).
    """

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
        self._q = _the_client(client, q, "LeaderElection")
        if not isinstance(name, str):
            raise TypeError(f"name must be a str, got {type(name).__name__}")
        for what, fn in (("on_elected", on_elected), ("on_deposed", on_deposed)):
            if fn is not None and not callable(fn):
                raise TypeError(f"{what} must be callable")
        owner = identity if identity is not None else _mint_identity()
        self.lock = self._q.lock(name, ttl=ttl, owner=owner)
        self.name = name
        self.identity = self.lock.owner
        self.retry_every = self.lock.renew_every
        self._on_elected = on_elected
        self._on_deposed = on_deposed
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._elected = threading.Event()
        self._resigning = False
        self._cooldown_until = 0.0
        self._thread: Optional[threading.Thread] = None
        self.terms = 0
        self.lock.on_lost(lambda _reason: self._wake.set())

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
        holders = self._q.locks.get(self.name).get("holders") or []
        if not holders:
            return None
        top = holders[0]
        until = top.get("expiresAt")
        return Leader(identity=top.get("owner"), token=int(top["token"]),
                      since=_utc(top["since"]), until=_utc(until) if until is not None else None)

    def wait_elected(self, timeout: Optional[float] = None) -> bool:
        """Block until this candidate leads (True) or ``timeout`` seconds pass (False)."""
        return self._elected.wait(timeout)

    # ---- campaigning ---------------------------------------------------------------------

    def run(self) -> None:
        """Campaign until ``stop()``: lead whenever the lease is free. Resigns on the way out."""
        self._stopping.clear()
        try:
            while not self._stopping.is_set():
                pause = self._cooldown_until - time.monotonic()
                if pause > 0:
                    self._stopping.wait(pause)
                elif self._campaign_once():
                    self._serve_term()
        finally:
            if self.lock.held or self._elected.is_set():
                self._resigning = True
                self.lock.release()
                self._end_term()

    def start(self) -> LeaderElection:
        """Campaign on a daemon thread; returns self."""
        if self._thread is not None and self._thread.is_alive():
            return self
        self._stopping.clear()
        self._thread = threading.Thread(target=self.run, name=f"leader-election-{self.name}",
                                        daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: Optional[float] = 5.0) -> None:
        """Stop campaigning and resign if leading; waits for the campaign thread."""
        self._stopping.set()
        self._wake.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

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

    def _campaign_once(self) -> bool:
        try:
            return self.lock.acquire(wait=min(self.retry_every, _MAX_CAMPAIGN_WAIT))
        except qs.EngineError as exc:
            # The engine is unreachable: nobody can be elected through it; try again later.
            log.warning("campaign for %r failed, retrying: %s", self.name, exc)
            self._stopping.wait(self.retry_every)
            return False

    def _serve_term(self) -> None:
        token = self.lock.token
        self.terms += 1
        self._resigning = False
        self._elected.set()
        log.info("%s leads %r with token %s", self.identity, self.name, token)
        if self._on_elected is not None and token is not None:
            self._call(self._on_elected, token)
        while self.lock.held and not self._stopping.is_set():
            self._wake.wait(max(0.001, self.lock.remaining))
            self._wake.clear()
        if not self._stopping.is_set():
            self._end_term()

    def _end_term(self) -> None:
        if self.lock.lost.is_set():
            reason = self.lock.lost_reason or "expired"
        else:
            reason = "resigned" if self._resigning else "expired"
        # Anti-thrash: a candidate that just lost the lease stays out for one renew interval.
        self._cooldown_until = time.monotonic() + self.retry_every
        self._elected.clear()
        log.info("%s no longer leads %r (%s)", self.identity, self.name, reason)
        if self._on_deposed is not None:
            self._call(self._on_deposed, reason)

    def _call(self, fn: Callable[[Any], Any], arg: Any) -> None:
        try:
            fn(arg)
        except Exception:
            log.exception("a leader-election callback for %r raised; campaigning goes on",
                          self.name)

    def __enter__(self) -> LeaderElection:
        return self.start()

    def __exit__(self, *exc_info: Any) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = f"leading token={self.token}" if self.is_leader else "following"
        return f"<LeaderElection {self.name!r} {state} identity={self.identity!r}>"


def _the_client(client: Optional[qs.Queen], q: Optional[qs.Queen], where: str) -> qs.Queen:
    """The client given first or as ``client=``, or by the deprecated keyword ``q=``."""
    if q is None:
        if client is None:
            raise TypeError(f"{where}() needs the client as its first argument (client=)")
        return client
    if client is not None:
        raise TypeError(f"{where}() got both client and q=; pass only client")
    # Two frames up: the caller of the recipe's constructor, which is what needs changing.
    warnings.warn(f"{where}(q=...) is deprecated: pass client=... (or the client first)",
                  DeprecationWarning, stacklevel=3)
    return q


def _mint_identity() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"


def _utc(epoch_ms: int) -> datetime:
    return datetime.fromtimestamp(epoch_ms / 1000, tz=timezone.utc)
