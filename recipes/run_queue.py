"""Claimed run queues: many workers drain one queue, each run done exactly once.

```python
import queen_sync as qs
from queen_sync.recipes.run_queue import RunQueue

with qs.Queen() as q:
    runs = RunQueue(q, "thumbnails")
    for n in range(3):
        runs.submit(f"image-{n}", {"size": 128 * (n + 1)})
    claim = runs.claim(ttl="30s")                    # the next unclaimed run, or None
    claim.checkpoint({"step": "resized"})             # fenced: refused once superseded
    claim.complete({"bytes": claim.payload["size"]})  # fenced, and the run leaves the queue
    runs.work(lambda c: c.payload["size"], ttl="30s")  # drain the rest; returns the count
    print(runs.results()["image-1"].result)          # 256
```

A **claim** is a lease on one run (a lock named after it, renewed in the
background while the worker lives) and its **fence** is the lock's token. Every
durable write of a claim (``checkpoint``, ``complete``, ``release``) goes through
``q.transaction().guard(lock)``: it commits only while the claim is the current
holding of that run, in the same atomic step as the write.

What it guarantees:
    * A worker that dies (SIGKILL, power cut) loses its claims when their lease
      expires; the runs are then listed as unclaimed and retaken with a higher fence.
    * A worker that stalls past its lease and wakes up finds out at its next write:
      ``checkpoint``/``complete`` raise ``FencedOutError`` (presented and current
      fence). That is the moment a stalled worker learns it lost the run.
    * Each run is completed at most once: the completion record is created
      exclusively, under the guard.
    * ``release()`` returns a run to the queue at once (no waiting for expiry).
    * ``list()`` judges every claim's expiry by the engine's clock, once per
      listing; an expired claim counts as unclaimed.

What it does not do: fence side effects outside the queue's own records. Make a
run's external effects idempotent, or fence them with ``claim.fence``.

Holder identities are unique per process by default (``host:pid:random``), and
each claim's lock owner adds a fresh suffix, so two workers that share a holder
name still never take a live claim from each other.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import socket
import threading
import time
import warnings
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any, Callable, List, Optional, Union, overload

from typing_extensions import deprecated

import queen_sync as qs

__all__ = ["Claim", "ClaimInfo", "Completion", "RunEntry", "RunQueue"]

log = logging.getLogger("queen_sync.recipes")

#: Seconds, a ``timedelta`` or a string such as ``"30s"`` (as everywhere in queen_sync).
Duration = Union[float, timedelta, str]

#: The namespace of every queue's records: ``<queue>/run|claim|state|done/<run id>``.
RUNS_NS = "queen-sync.runs"
#: The namespace the engines keep lock permits in (``<lock name>#<slot>``, version = token).
#: Reading it lets one batch list every claim with the runs. queen_sync exports no public
#: name for it (nor for splitting a permit key), so this copy of the wire rule must follow
#: the wire if it ever changes.
_PERMITS_NS = "queen-locks"
_LOCK_PREFIX = "queen-sync.run-queue/"
_PROCESS_HOLDER: dict[int, str] = {}


def default_holder() -> str:
    """This process's holder identity, ``host:pid:random`` (a new one after a fork)."""
    pid = os.getpid()
    if pid not in _PROCESS_HOLDER:
        _PROCESS_HOLDER[pid] = f"{socket.gethostname()}:{pid}:{secrets.token_hex(3)}"
    return _PROCESS_HOLDER[pid]


def _utc(epoch_ms: Optional[int]) -> Optional[datetime]:
    return None if epoch_ms is None else datetime.fromtimestamp(epoch_ms / 1000, tz=timezone.utc)


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


def _check_id(value: Any, what: str, max_bytes: int) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{what} must be a str, got {type(value).__name__}")
    if not value or len(value.encode("utf-8")) > max_bytes or "#" in value:
        raise ValueError(f"{what} {value!r} must be 1..{max_bytes} bytes without '#'")
    if any(ord(ch) < 32 or ord(ch) == 127 for ch in value):
        raise ValueError(f"{what} {value!r} contains a control character")
    return value


@dataclass(frozen=True)
class ClaimInfo:
    """A run's claim as a listing saw it (``expired`` judged by the engine's clock).

    ``expires_at`` is the engine's expiry for a live claim; for an expired one, the
    expiry its holder estimated at its last checkpoint (later renewals are not recorded).
    """

    holder: str
    fence: int
    expires_at: Optional[datetime]
    expired: bool


@dataclass(frozen=True)
class RunEntry:
    """One pending (not yet completed) run."""

    run_id: str
    payload: Any
    claim: Optional[ClaimInfo]
    state: Any

    @property
    def claimed(self) -> bool:
        """True when a live (unexpired) claim holds the run."""
        return self.claim is not None and not self.claim.expired


@dataclass(frozen=True)
class Completion:
    """The record a completed run leaves: its result, and the holding that wrote it."""

    run_id: str
    result: Any
    holder: str
    fence: int


class Claim:
    """This worker's claim on one run. Its writes are fenced; read ``fence`` at use time."""

    def __init__(self, queue: RunQueue, run_id: str, payload: Any, state: Any,
                 holder: str, lock: qs.Lock) -> None:
        self.run_id = run_id
        self.payload = payload
        self.state = state
        self.holder = holder
        self.lock = lock
        self.done = False
        self._queue = queue
        self._last_fence = lock.token or 0

    @property
    def fence(self) -> int:
        """The claim's current fence (it rises at every renewal); the last one once lost."""
        token = self.lock.token
        if token is not None:
            self._last_fence = token
        return self._last_fence

    @property
    def held(self) -> bool:
        """True while the claim's lease is alive by this machine's clock."""
        return self.lock.held

    def checkpoint(self, state: Any) -> None:
        """Record ``state`` for this run (a later claimer sees it as ``claim.state``).

        Raises:
            FencedOutError: this claim was superseded or has expired.
        """
        queue = self._queue
        txn = self._fenced_txn()
        txn.kv.put(RUNS_NS, queue._key("state", self.run_id), state, forever=True)
        txn.kv.put(RUNS_NS, queue._key("claim", self.run_id), self._record(), forever=True)
        self._commit(txn)
        self.state = state

    def complete(self, result: Any = None) -> None:
        """Record the run's result exactly once and take the run off the queue.

        Raises:
            FencedOutError: this claim was superseded, or the run was already completed.
        """
        queue = self._queue
        record = {"result": result, "holder": self.holder, "fence": self.fence}
        txn = self._fenced_txn()
        txn.kv.put_if_absent(RUNS_NS, queue._key("done", self.run_id), record, forever=True,
                             required=True)
        txn.kv.delete(RUNS_NS, queue._key("claim", self.run_id))
        txn.kv.delete(RUNS_NS, queue._key("state", self.run_id))
        self._commit(txn)
        self.done = True
        self.lock.release()

    def release(self) -> bool:
        """Give the run back to the queue at once; False when the claim was already gone."""
        if self.done or not self.lock.held:
            return self.lock.release()
        txn = self._queue._q.transaction().guard(self.lock)
        txn.kv.delete(RUNS_NS, self._queue._key("claim", self.run_id))
        with contextlib.suppress(qs.LockNotHeldError):  # expired meanwhile: nothing to undo
            txn.commit()
        return self.lock.release()

    def _record(self) -> dict[str, Any]:
        expires_ms = int((time.time() + self.lock.remaining) * 1000)
        return {"holder": self.holder, "fence": self.fence, "expiresAt": expires_ms}

    def _fenced_txn(self) -> qs.Transaction:
        if self.done:
            raise qs.FencedOutError(f"run {self.run_id!r} is already completed by this claim",
                                    presented=self.fence, current=self.fence,
                                    run_id=self.run_id)
        if not self.lock.held:
            raise self._fenced_out(None)
        return self._queue._q.transaction().guard(self.lock)

    def _commit(self, txn: qs.Transaction) -> None:
        try:
            answer = txn.commit()
        except qs.LockNotHeldError as exc:
            raise self._fenced_out(None) from exc
        if answer:
            return
        if answer.get("failedIndex") == 0:
            raise self._fenced_out(answer.get("version") or None)
        value = answer.get("value")
        done_fence = value.get("fence") if isinstance(value, dict) else None
        raise qs.FencedOutError(
            f"run {self.run_id!r} was already completed (fence {done_fence})",
            presented=self.fence, current=done_fence, run_id=self.run_id)

    def _fenced_out(self, current: Optional[int]) -> qs.FencedOutError:
        if current is None:
            current = self._queue._current_fence(self.run_id)
        now = f"claimed at {current}" if current else "no longer claimed by anyone"
        return qs.FencedOutError(
            f"refusing a write for run {self.run_id!r} fenced at {self.fence}: the run is now "
            f"{now}. Another worker took it over, so this one no longer holds it; stop the "
            "run rather than retrying (the claim is gone, not busy).",
            presented=self.fence, current=current, run_id=self.run_id)

    def __enter__(self) -> Claim:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        if not self.done:
            self.release()

    def __repr__(self) -> str:
        state = "completed" if self.done else ("held" if self.held else "lost")
        return f"<Claim {self.run_id!r} fence={self.fence} {state} holder={self.holder!r}>"


class RunQueue:
    """A named queue of runs in the client's engine.

    Args:
        client: the client whose engine keeps the queue (``q=`` is a deprecated
            spelling of this keyword).
        name: the queue's name (1..64 bytes, no ``/`` or ``#``).
    """

    @overload
    def __init__(self, client: qs.Queen, name: str) -> None: ...

    @overload
    @deprecated("RunQueue(q=...) is deprecated: pass client=...")
    def __init__(self, *, q: qs.Queen, name: str) -> None: ...

    def __init__(self, client: Optional[qs.Queen] = None, name: Optional[str] = None, *,
                 q: Optional[qs.Queen] = None) -> None:
        self._q = _the_client(client, q, "RunQueue")
        name = _check_id(name, "queue name", 64)
        if "/" in name:
            raise ValueError(f"queue name {name!r} must not contain '/'")
        self.name = name

    def _key(self, kind: str, run_id: str) -> str:
        return f"{self.name}/{kind}/{run_id}"

    def _lock_name(self, run_id: str) -> str:
        return f"{_LOCK_PREFIX}{self.name}/{run_id}"

    def submit(self, run_id: str, payload: Any = None) -> bool:
        """Add a run; False (and nothing changes) when ``run_id`` was submitted before."""
        _check_id(run_id, "run id", 180)
        return bool(self._q.kv.put_if_absent(RUNS_NS, self._key("run", run_id),
                                             {"payload": payload}, forever=True))

    def list(self, claimed: Optional[bool] = None) -> List[RunEntry]:
        """The pending runs in run-id order, each with its claim and last checkpoint.

        Args:
            claimed: None for all; True for runs with a live claim; False for runs
                nobody holds, INCLUDING runs whose claim has expired (a dead
                worker's runs must show up here, or nobody would retake them).
        """
        if claimed is not None and not isinstance(claimed, bool):
            raise TypeError("claimed must be None, True or False")
        rows = self._read_all()
        done = {row["key"] for row in rows["done"]}
        claims = _claims(rows["claim"], rows["permits"])
        states = {row["key"]: row["value"] for row in rows["state"]}
        entries = []
        for row in rows["run"]:
            run_id = row["key"]
            if run_id in done:
                continue
            entry = RunEntry(run_id, row["value"]["payload"], claims.get(run_id),
                             states.get(run_id))
            if claimed is None or entry.claimed == claimed:
                entries.append(entry)
        return entries

    def _read_all(self) -> dict[str, List[dict[str, Any]]]:
        """Every record of the queue, keyed by run id; claims and permits in ONE call."""
        kinds = ("run", "claim", "state", "done")
        prefixes = {kind: f"{self.name}/{kind}/" for kind in kinds}
        ops = [self._q.kv.op.get_prefix(RUNS_NS, prefixes[kind], limit=1000) for kind in kinds]
        ops.append(self._q.kv.op.get_prefix(_PERMITS_NS, self._lock_name(""), limit=1000))
        answers = self._q.kv.batch(ops)
        rows: dict[str, List[dict[str, Any]]] = {}
        for kind, answer in zip((*kinds, "permits"), answers):
            ns, prefix = ((_PERMITS_NS, self._lock_name("")) if kind == "permits"
                          else (RUNS_NS, prefixes[kind]))
            found = list(answer["rows"])
            if answer.get("truncated"):
                found += self._q.kv.list_all(ns, prefix)[len(found):]
            rows[kind] = [{**row, "key": row["key"][len(prefix):]} for row in found]
        return rows

    def _current_fence(self, run_id: str) -> Optional[int]:
        holders = self._q.locks.get(self._lock_name(run_id)).get("holders") or []
        return int(holders[0]["token"]) if holders else None

    def claim(self, *, holder: Optional[str] = None, ttl: Duration) -> Optional[Claim]:
        """Claim the next unclaimed run (expired claims count as unclaimed).

        Args:
            holder: who is claiming (shown in listings). Default: ``default_holder()``.
            ttl: the claim's lease; renewed in the background while this process lives.

        Returns:
            the ``Claim``, or None when no run is free now.
        """
        who = _check_id(holder, "holder", 200) if holder is not None else default_holder()
        qs.parse_duration(ttl, what="ttl")
        for entry in self.list(claimed=False):
            claim = self._try_claim(entry, who, ttl)
            if claim is not None:
                return claim
        return None

    def _try_claim(self, entry: RunEntry, holder: str, ttl: Duration) -> Optional[Claim]:
        # A fresh owner per claim: the engine then tells a renewal from a theft even when
        # two workers share a holder name.
        lock = self._q.lock(self._lock_name(entry.run_id), ttl=ttl,
                            owner=f"{holder}/{secrets.token_hex(4)}")
        try:
            if not lock.acquire():
                return None
            claim = Claim(self, entry.run_id, entry.payload, entry.state, holder, lock)
            txn = self._q.transaction().guard(lock)
            txn.kv.check(RUNS_NS, self._key("done", entry.run_id), expect=0)  # not completed
            txn.kv.put(RUNS_NS, self._key("claim", entry.run_id), claim._record(), forever=True)
            if not txn.commit():
                lock.release()
                return None
        except BaseException:
            lock.release()
            raise
        log.info("%s claimed run %r of %r with fence %s", holder, entry.run_id, self.name,
                 claim.fence)
        return claim

    def results(self) -> dict[str, Completion]:
        """Every completed run's record, by run id."""
        prefix = f"{self.name}/done/"
        out = {}
        for row in self._q.kv.list_all(RUNS_NS, prefix):
            run_id, value = row["key"][len(prefix):], row["value"]
            out[run_id] = Completion(run_id, value["result"], value["holder"], value["fence"])
        return out

    def work(self, fn: Callable[[Claim], Any], *, holder: Optional[str] = None,
             ttl: Duration, stop: Optional[threading.Event] = None,
             poll: float = 0.2) -> int:
        """Claim runs and complete each with ``fn(claim)``'s return value.

        Without ``stop`` it returns once no run is pending (runs claimed by others
        are waited for: their claims may expire). With ``stop`` it keeps polling
        for new runs until the event is set. A run whose claim is superseded
        (``FencedOutError``) is dropped: its new holder finishes it. A run whose
        ``fn`` raises is released and the exception propagates.

        Returns:
            how many runs this call completed.
        """
        completed = 0
        while not (stop is not None and stop.is_set()):
            claim = self.claim(holder=holder, ttl=ttl)
            if claim is None:
                if stop is None and not self.list():
                    break
                if stop is None:
                    time.sleep(poll)
                else:
                    stop.wait(poll)
                continue
            completed += self._work_one(fn, claim)
        return completed

    def _work_one(self, fn: Callable[[Claim], Any], claim: Claim) -> int:
        try:
            result = fn(claim)
            if not claim.done:
                claim.complete(result)
        except qs.FencedOutError as exc:
            log.warning("run %r was taken over; dropping it: %s", claim.run_id, exc)
            return 0
        except BaseException:
            claim.release()
            raise
        return 1

    def __repr__(self) -> str:
        return f"<RunQueue {self.name!r} on {self._q.url}>"


def _claims(records: list[dict[str, Any]], permits: list[dict[str, Any]]) -> dict[str, ClaimInfo]:
    """Each run's claim: the live permit if any, else the last record, marked expired."""
    out: dict[str, ClaimInfo] = {}
    for row in records:
        value = row["value"]
        out[row["key"]] = ClaimInfo(value["holder"], int(value["fence"]),
                                    _utc(value.get("expiresAt")), expired=True)
    for row in permits:
        run_id = row["key"].rsplit("#", 1)[0]  # a permit key is <lock name>#<slot>
        owner = str((row.get("value") or {}).get("owner", ""))
        out[run_id] = ClaimInfo(owner.rsplit("/", 1)[0], int(row["version"]),
                                _utc(row.get("expiresAt")), expired=False)
    return out
