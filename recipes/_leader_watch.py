"""Who leads an election, read from the lock's permit: for candidates and for observers.

An observer never campaigns: it reads the election's lock (``client.locks.get``) every
``every`` seconds and reports each new term it sees. A term is one holding of the lock:
its holder and the engine's ``since`` (when that holding was acquired) stay the same
while the leader renews, although the token rises at every renewal.
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
            thread that polled: the observer's own once ``start()``-ed).
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
        self._stopping = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._starting = threading.Lock()
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
                try:
                    self._on_new_leader(now)
                except Exception:
                    log.exception("on_new_leader for %r raised; observing goes on", self.name)
            return now

    def wait_for_leader(self, *, newer_than: Optional[int] = None,
                        timeout: Optional[float] = None) -> Optional[Leader]:
        """Poll until a leader is seen (with a token above ``newer_than``), or None at timeout.

        Once the observer is stopped, it reads the lock once more and answers at once: a
        wait under way when ``stop()`` is called returns then, and one begun after the
        stop waits no longer (``start()`` again to wait).
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            stopped = self._stopping.is_set()  # before the read: a stop during it is seen next
            now = self._poll_quietly()
            if now is not None and (newer_than is None or now.token > newer_than):
                return now
            left = None if deadline is None else deadline - time.monotonic()
            if stopped or (left is not None and left <= 0):
                return None
            self._stopping.wait(self.every if left is None else min(self.every, left))

    def start(self) -> LeaderObserver:
        """Observe on a daemon thread (``on_new_leader`` runs there); returns self."""
        with self._starting:  # starts racing on threads start one watch
            if self._thread is not None and self._thread.is_alive():
                return self
            self._stopping.clear()
            self._thread = threading.Thread(target=self._watch,
                                            name=f"leader-observer-{self.name}", daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout: Optional[float] = 5.0) -> None:
        """Stop the background thread and wait for it."""
        self._stopping.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    @property
    def observing(self) -> bool:
        """True while the background thread runs."""
        return self._thread is not None and self._thread.is_alive()

    def _watch(self) -> None:
        while not self._stopping.is_set():
            try:
                self._poll_quietly()
            except qs.QueenError as exc:  # a closed client: no later poll can succeed
                log.warning("observer of %r stops: %s", self.name, exc)
                return
            self._stopping.wait(self.every)

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
