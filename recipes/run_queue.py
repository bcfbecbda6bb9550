"""Claimed run queues: many workers drain one queue, each run done exactly once.

```python
import queen_sync as qs
from queen_sync.recipes.run_queue import RunQueue

with qs.Queen() as q:
    runs = RunQueue(q, "thumbnails", max_attempts=3)
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
      exclusively, under the guard, in the step that takes the run off the queue.
    * Every claim of a run counts as an attempt (``claim.attempt``). With
      ``max_attempts``, the claim that would exceed it moves the run to the dead
      letters instead (``dead_letters()``, ``requeue()``): a run that keeps killing
      its workers stops being retaken.
    * ``release()`` returns a run to the queue at once (no waiting for expiry).
    * ``list()`` judges every claim's expiry by the engine's clock, once per page;
      an expired claim counts as unclaimed.

What a claim costs: the pending runs are records of their own (a completed or
dead-lettered run leaves them), and a claim reads one page of them, with the live
claims of that page, in ONE call, from a cursor that moves on past each run this
queue object claims and wraps around at the end. So its cost depends on neither
how many runs the queue has completed nor how many are pending, only on how many
runs in its way are held by others. Completion and dead-letter records are kept
for ``retention`` (7 days by default) and never read by a claim; a run id can be
submitted again once its records have expired.

What it does not do: fence side effects outside the queue's own records. Make a
run's external effects idempotent, or fence them with ``claim.fence``. Keep
payloads small: a claim and each checkpoint rewrite the run's record whole.

Holder identities are unique per process by default (``host:pid:random``), and
each claim's lock owner adds a fresh suffix, so two workers that share a holder
name still never take a live claim from each other.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
import time
from typing import (
    Any,
    Callable,
    Iterable,
    List,
    Mapping,
    Optional,
    Union,
    overload,
)

from typing_extensions import deprecated

import queen_sync as qs
from queen_sync import Duration

from ._arbitration import require_arbitration
from ._callables import check_function
from ._client_arg import the_client
from ._run_claim import Claim
from ._run_records import RUNS_NS as RUNS_NS  # where users find the records' namespace
from ._run_records import (
    ClaimInfo,
    Completion,
    DeadLetter,
    Page,
    PageRead,
    ResultPage,
    RunEntry,
    check_after,
    check_count,
    check_id,
    completion_of,
    dead_letter_of,
    from_anywhere,
    live_claims,
    under,
)

__all__ = ["Claim", "ClaimInfo", "Completion", "DeadLetter", "Page", "ResultPage", "RunEntry",
           "RunQueue"]

log = logging.getLogger("queen_sync.recipes")

#: How long completion and dead-letter records are kept unless the queue says otherwise.
DEFAULT_RETENTION = "7d"
#: Pending runs a claim reads per call; the live claims among them come in the same call.
PAGE_SIZE = 32
#: The namespace the engines keep lock permits in (``<lock name>#<slot>``, version = token).
#: Reading it lets one call list the claims with the runs. queen_sync exports no public
#: name for it (nor for a permit's key), so this copy of the wire rule must follow the
#: wire if it ever changes.
_PERMITS_NS = "queen-locks"
_LOCK_PREFIX = "queen-sync.run-queue/"
_MAX_PAGE = 1000  # the wire's largest getPrefix page
_TAKE_TRIES = 3
_SUBMIT_CHUNK = 100
_MAX_POLL = 3600.0  # the longest wait between looks for a free run
_MAX_RUN_ID_BYTES = 180
_MAX_LOCK_NAME_BYTES = 256  # the longest lock name every engine accepts
_PROCESS_HOLDER: dict[int, str] = {}


def default_holder() -> str:
    """This process's holder identity, ``host:pid:random`` (a new one after a fork)."""
    pid = os.getpid()
    if pid not in _PROCESS_HOLDER:
        _PROCESS_HOLDER[pid] = f"{socket.gethostname()}:{pid}:{secrets.token_hex(3)}"
    return _PROCESS_HOLDER[pid]


def _check_poll(poll: Any) -> float:
    seconds = qs.parse_duration(poll, what="poll")
    if seconds > _MAX_POLL:  # a sleep that long never notices the queue (or overflows)
        raise ValueError(f"poll must be at most {_MAX_POLL:.0f}s, got {poll!r}")
    return seconds


def _pairs(runs: Any) -> List[tuple[Any, Any]]:
    """``submit_many``'s runs as (run id, payload) pairs; anything else is refused whole."""
    if isinstance(runs, Mapping):
        return list(runs.items())
    # A str is an iterable of strs, and each id of two characters unpacks into a pair.
    if isinstance(runs, (str, bytes)) or not isinstance(runs, Iterable):
        raise TypeError(f"submit_many takes {{run_id: payload}} or (run_id, payload) pairs, "
                        f"got {type(runs).__name__}")
    pairs = []
    for n, item in enumerate(runs):
        if not isinstance(item, (tuple, list)) or len(item) != 2:
            raise TypeError(
                f"submit_many takes {{run_id: payload}} or (run_id, payload) pairs, but item "
                f"{n} is {item!r}; for ids without payloads pass dict.fromkeys(ids)")
        pairs.append((item[0], item[1]))
    return pairs


class RunQueue:
    """A named queue of runs in the client's engine.

    Args:
        client: the client whose engine keeps the queue (``q=`` is a deprecated
            spelling of this keyword).
        name: the queue's name (1..64 bytes, no ``/`` or ``#``).
        retention: how long completion and dead-letter records are kept (default 7 days).
        max_attempts: claims a run gets before the next one dead-letters it instead
            (default None: retaken for as long as it takes).

    Raises:
        UnsupportedOperationError: the client's engine lacks ``fencing`` or
            ``engine_clock_expiry`` (``capability`` names which).
    """

    @overload
    def __init__(self, client: qs.Queen, name: str, *, retention: Duration = DEFAULT_RETENTION,
                 max_attempts: Optional[int] = None) -> None: ...

    @overload
    @deprecated("RunQueue(q=...) is deprecated: pass client=...")
    def __init__(self, *, q: qs.Queen, name: str, retention: Duration = DEFAULT_RETENTION,
                 max_attempts: Optional[int] = None) -> None: ...

    def __init__(self, client: Optional[qs.Queen] = None, name: Optional[str] = None, *,
                 q: Optional[qs.Queen] = None, retention: Duration = DEFAULT_RETENTION,
                 max_attempts: Optional[int] = None) -> None:
        self._q = the_client(client, q, "RunQueue")
        require_arbitration(self._q, "RunQueue")
        name = check_id(name, "queue name", 64)
        if "/" in name:
            raise ValueError(f"queue name {name!r} must not contain '/'")
        qs.parse_duration(retention, what="retention")
        self.name = name
        self.retention = retention
        self.max_attempts = check_count(max_attempts, "max_attempts")
        self._cursor: Optional[str] = None  # the run this object claimed last

    def _key(self, kind: str, run_id: str) -> str:
        return f"{self.name}/{kind}/{run_id}"

    def _lock_name(self, run_id: str) -> str:
        return f"{_LOCK_PREFIX}{self.name}/{run_id}"

    def _check_run_id(self, run_id: Any) -> str:
        """A run id whose claim's lock name fits the wire's limit, with this queue's name."""
        room = _MAX_LOCK_NAME_BYTES - len(self._lock_name("").encode("utf-8"))
        return check_id(run_id, "run id", min(_MAX_RUN_ID_BYTES, room))

    def submit(self, run_id: str, payload: Any = None) -> bool:
        """Add a run; False (and nothing changes) when ``run_id`` is already known.

        Known means pending, or completed or dead-lettered within the retention.
        A run id is 1..180 UTF-8 bytes without ``#`` or control characters, and less
        with a long queue name: its claim's lock name must fit in 256 bytes.
        """
        self._check_run_id(run_id)
        txn = self._q.transaction()
        self._add_new(txn, run_id, payload)
        return bool(txn.commit())

    def submit_many(self, runs: Union[Mapping[str, Any], Iterable[tuple[str, Any]]]) -> int:
        """Add many runs (``{run_id: payload}`` or pairs), a hundred per call.

        Every id is checked before anything is written. Ids without payloads go in as
        ``dict.fromkeys(ids)``.

        Returns:
            How many of the runs were new.

        Raises:
            TypeError: ``runs`` is not a mapping or an iterable of ``(run_id, payload)``
                tuples or lists (a list of ids, say); nothing is written.
        """
        pairs = _pairs(runs)
        for run_id, _ in pairs:
            self._check_run_id(run_id)
        added = 0
        for start in range(0, len(pairs), _SUBMIT_CHUNK):
            chunk = pairs[start:start + _SUBMIT_CHUNK]
            txn = self._q.transaction()
            for run_id, payload in chunk:
                self._add_new(txn, run_id, payload)
            if txn.commit():
                added += len(chunk)
            else:  # one of them was known: all or nothing, so ask run by run
                added += sum(self.submit(run_id, payload) for run_id, payload in chunk)
        return added

    def _add_new(self, txn: qs.Transaction, run_id: str, payload: Any) -> None:
        txn.kv.check(RUNS_NS, self._key("done", run_id), expect=0)
        txn.kv.check(RUNS_NS, self._key("dead", run_id), expect=0)
        txn.kv.put_if_absent(RUNS_NS, self._key("pending", run_id),
                             {"payload": payload, "attempts": 0, "state": None, "claim": None},
                             forever=True, required=True)

    # ---- reading ---------------------------------------------------------------------------

    def _read_page(self, after: Optional[str], limit: int) -> PageRead:
        """Pending runs after ``after`` and, in the same call, the live claims among them."""
        runs_prefix, lock_prefix = f"{self.name}/pending/", self._lock_name("")
        op = self._q.kv.op
        # A permit key is <lock name>#<slot>: every run after ``after`` has its permits
        # after the lock name of ``after``, so one range read finds the page's claims.
        runs, permits = self._q.kv.batch([
            op.get_prefix(RUNS_NS, runs_prefix, after=under(runs_prefix, after), limit=limit),
            op.get_prefix(_PERMITS_NS, lock_prefix, after=under(lock_prefix, after),
                          limit=limit)])
        rows = [(row["key"][len(runs_prefix):], row["value"], int(row["version"]))
                for row in runs["rows"]]
        live = live_claims(lock_prefix, permits["rows"])
        if permits.get("truncated"):
            # More claims than the page holds runs: fetch the rest of the page's by key.
            bound = str(permits["nextAfter"])
            unknown = [f"{lock_prefix}{run_id}#0" for run_id, _, _ in rows
                       if f"{lock_prefix}{run_id}#0" > bound]
            if unknown:
                live.update(live_claims(lock_prefix,
                                         self._q.kv.get_many(_PERMITS_NS, unknown)["rows"]))
        next_after = rows[-1][0] if runs.get("truncated") and rows else None
        return PageRead(rows, live, next_after)

    def list(self, claimed: Optional[bool] = None, *, limit: Optional[int] = None,
             after: Optional[str] = None) -> Page[RunEntry]:
        """The pending runs in run-id order, each with its claim and last checkpoint.

        Args:
            claimed: None for all; True for runs with a live claim; False for runs
                nobody holds, INCLUDING runs whose claim has expired (a dead
                worker's runs must show up here, or nobody would retake them).
            limit: at most this many runs (None: every one, page by page).
            after: start after this run id (a page's ``next_after``).
        """
        if claimed is not None and not isinstance(claimed, bool):
            raise TypeError("claimed must be None, True or False")
        limit, cursor = check_count(limit, "limit"), check_after(after)
        found: List[RunEntry] = []
        while True:
            page = self._read_page(cursor, _MAX_PAGE if limit is None
                                   else min(_MAX_PAGE, limit - len(found)))
            entries = page.entries()
            for n, entry in enumerate(entries):
                if claimed is None or entry.claimed == claimed:
                    found.append(entry)
                if limit is not None and len(found) == limit:
                    more = n + 1 < len(entries) or page.next_after is not None
                    return Page(found, entry.run_id if more else None)
            if page.next_after is None:
                return Page(found)
            cursor = page.next_after

    def _records(self, kind: str, limit: Optional[int], after: Optional[str]
                 ) -> tuple[List[dict[str, Any]], Optional[str]]:
        """A page of ``kind`` records (keys stripped to run ids) and the cursor after it."""
        limit, cursor = check_count(limit, "limit"), check_after(after)
        prefix = f"{self.name}/{kind}/"
        rows: List[dict[str, Any]] = []
        while limit is None or len(rows) < limit:
            want = _MAX_PAGE if limit is None else min(_MAX_PAGE, limit - len(rows))
            page = self._q.kv.get_prefix(RUNS_NS, prefix, after=under(prefix, cursor),
                                         limit=want)
            rows += [{**row, "key": row["key"][len(prefix):]} for row in page["rows"]]
            if not page.get("truncated") or not rows:
                return rows, None
            cursor = rows[-1]["key"]
        return rows, cursor

    def results(self, *, limit: Optional[int] = None, after: Optional[str] = None
                ) -> ResultPage:
        """Completed runs' records by run id, in run-id order (kept for the retention).

        Args:
            limit: at most this many (None: every one, page by page).
            after: start after this run id (a page's ``next_after``).
        """
        rows, next_after = self._records("done", limit, after)
        return ResultPage(((row["key"], completion_of(row["key"], row["value"])) for row in rows),
                          next_after)

    def dead_letters(self, *, limit: Optional[int] = None, after: Optional[str] = None
                     ) -> Page[DeadLetter]:
        """Runs taken off the queue after ``max_attempts`` claims, in run-id order."""
        rows, next_after = self._records("dead", limit, after)
        return Page((dead_letter_of(row["key"], row["value"]) for row in rows), next_after)

    def requeue(self, run_id: str) -> bool:
        """Put a dead-lettered run back on the queue with its attempts counted from zero.

        Returns:
            False when ``run_id`` is not among the dead letters (any more).
        """
        self._check_run_id(run_id)
        record = self._q.kv.get(RUNS_NS, self._key("dead", run_id))
        if not record:
            return False
        value = record["value"]
        txn = self._q.transaction()
        txn.kv.delete(RUNS_NS, self._key("dead", run_id), expect=record["version"],
                      required=True)
        txn.kv.put_if_absent(RUNS_NS, self._key("pending", run_id),
                             {"payload": value.get("payload"), "attempts": 0,
                              "state": value.get("state"), "claim": None},
                             forever=True, required=True)
        return bool(txn.commit())

    def _current_fence(self, run_id: str) -> Optional[int]:
        holders = self._q.locks.get(self._lock_name(run_id)).get("holders") or []
        return int(holders[0]["token"]) if holders else None

    # ---- claiming --------------------------------------------------------------------------

    def claim(self, run_id: Optional[str] = None, *, holder: Optional[str] = None,
              ttl: Duration) -> Optional[Claim]:
        """Claim the next unclaimed run (expired claims count as unclaimed), or ``run_id``.

        Args:
            run_id: claim this run and no other (None: the next free one after the run
                this queue object claimed last, wrapping around at the end).
            holder: who is claiming (shown in listings). Default: ``default_holder()``.
            ttl: the claim's lease; renewed in the background while this process lives.

        Returns:
            The ``Claim``, or None when no run is free now (with ``run_id``: when that
                run is held, completed, dead-lettered or was never submitted).
        """
        who = check_id(holder, "holder", 200) if holder is not None else default_holder()
        self._q.lock(self._lock_name(""), ttl=ttl)  # checks ttl before any I/O; sends nothing
        if run_id is not None:
            return self._claim_by_id(self._check_run_id(run_id), who, ttl)
        start = self._cursor
        after, wrapped = start, start is None
        while True:
            page = self._read_page(after, PAGE_SIZE)
            free = [row for row in page.rows if row[0] not in page.live
                    and not (wrapped and start is not None and row[0] > start)]
            while free:
                run_id_, value, version = free.pop(0)
                claim = self._try_claim(run_id_, value, version, who, ttl)
                if claim is not None:
                    self._cursor = run_id_
                    return claim
                free = from_anywhere(free)  # lost a race: others read this page too
            if wrapped and start is not None and page.rows and page.rows[-1][0] >= start:
                return None  # around once: the rest was tried on the way out
            if page.next_after is not None:
                after = page.next_after
            elif wrapped:
                return None
            else:
                after, wrapped = None, True

    def _claim_by_id(self, run_id: str, holder: str, ttl: Duration) -> Optional[Claim]:
        record = self._q.kv.get(RUNS_NS, self._key("pending", run_id))
        if not record:
            return None
        return self._try_claim(run_id, record["value"], int(record["version"]), holder, ttl)

    def _try_claim(self, run_id: str, value: dict[str, Any], version: int, holder: str,
                   ttl: Duration) -> Optional[Claim]:
        # A fresh owner per claim: the engine then tells a renewal from a theft even when
        # two workers share a holder name.
        lock = self._q.lock(self._lock_name(run_id), ttl=ttl,
                            owner=f"{holder}/{secrets.token_hex(4)}")
        try:
            if not lock.acquire():
                return None
            claim = self._take(lock, run_id, value, version, holder)
            if claim is None:
                lock.release()
                return None
        except BaseException:
            lock.release()
            raise
        log.info("%s claimed run %r of %r with fence %s (attempt %d)", holder, run_id,
                 self.name, claim.fence, claim.attempt)
        return claim

    def _take(self, lock: qs.Lock, run_id: str, value: dict[str, Any], version: int,
              holder: str) -> Optional[Claim]:
        """Count the attempt on the run's record, holding its lock; None if it is gone."""
        for _ in range(_TAKE_TRIES):
            attempt = int(value.get("attempts", 0)) + 1
            if self.max_attempts is not None and attempt > self.max_attempts:
                self._dead_letter(lock, run_id, value, version)
                return None
            claim = Claim(self, run_id, value.get("payload"), value.get("state"), holder, lock,
                          attempt)
            # Expecting the version read: a claim, checkpoint or release that landed since
            # the page was read must not be overwritten with the older record.
            txn = self._q.transaction().guard(lock)
            mark = claim._record()
            txn.kv.put(RUNS_NS, self._key("pending", run_id),
                       {**value, "attempts": attempt, "claim": mark},
                       forever=True, expect=version, required=True)
            try:
                answer = txn.commit()
            except qs.EngineError as exc:
                if exc.applied is False or not self._counted(run_id, mark, attempt):
                    raise
                return claim  # it landed, only its answer was lost: this attempt is ours
            if answer:
                return claim
            if answer.get("failedIndex") == 0 or answer.get("kvReason") != "version":
                return None  # the lock was lost, or the run completed meanwhile
            value, version = answer["value"], int(answer["version"])
        return None

    def _counted(self, run_id: str, mark: dict[str, Any], attempt: int) -> bool:
        """Whether the run's record carries the claim ``mark`` written for ``attempt`` (its
        commit landed), read again. The mark's fence is the token it was written with: the
        claim's own rises at each renewal.

        An answer lost means the attempt may have been counted: taken for failed, it would
        be spent on a run that never ran (dead-lettered unrun with ``max_attempts=1``).
        """
        try:
            record = self._q.kv.get(RUNS_NS, self._key("pending", run_id))
        except qs.EngineError:
            return False
        value = record.get("value") if record else None
        if not isinstance(value, dict):
            return False
        found = value.get("claim")
        return (isinstance(found, dict) and found.get("fence") == mark["fence"]
                and found.get("holder") == mark["holder"] and value.get("attempts") == attempt)

    def _dead_letter(self, lock: qs.Lock, run_id: str, value: dict[str, Any],
                     version: int) -> None:
        record = {"payload": value.get("payload"), "state": value.get("state"),
                  "attempts": int(value.get("attempts", 0)), "claim": value.get("claim")}
        txn = self._q.transaction().guard(lock)
        txn.kv.put(RUNS_NS, self._key("dead", run_id), record, ttl=self.retention)
        txn.kv.delete(RUNS_NS, self._key("pending", run_id), expect=version, required=True)
        if txn.commit():
            log.warning("run %r of %r was dead-lettered after %d attempts", run_id, self.name,
                        record["attempts"])

    # ---- working ---------------------------------------------------------------------------

    def work(self, fn: Callable[[Claim], Any], *, holder: Optional[str] = None,
             ttl: Duration, stop: Optional[threading.Event] = None,
             poll: Duration = 0.2) -> int:
        """Claim runs and complete each with ``fn(claim)``'s return value.

        Without ``stop`` it returns once no run is pending (runs claimed by others
        are waited for: their claims may expire). With ``stop`` it keeps polling
        for new runs until the event is set. A run whose claim is superseded
        (``FencedOutError``, or ``claim.lock.verify()`` False before ``fn`` starts) is
        dropped unfinished: its new holder finishes it. A run whose ``fn`` raises is
        released and the exception propagates.

        ``poll`` is how long to wait between looks when no run is free (seconds, a
        timedelta or ``"200ms"``; more than 0, at most an hour).

        Returns:
            how many runs this call completed.

        Raises:
            TypeError: ``fn`` is not callable, or is a generator or async function; or
                ``stop`` is not an event (``is_set()`` and ``wait()``). Before any claim,
                so no attempt is spent on it.
            TypeError, ValueError: a bad ``poll``, ``holder`` or ``ttl``, before any claim.
            EngineError: the engine failed a call (``EngineUnavailableError``: out of
                reach); a claim whose commit's answer was lost is read back, and kept
                when it landed, so no attempt is spent on a run that did not start.
        """
        check_function(fn, "work()'s fn")
        poll = _check_poll(poll)
        if stop is not None and not (callable(getattr(stop, "is_set", None))
                                     and callable(getattr(stop, "wait", None))):
            raise TypeError(f"stop must be a threading.Event (or None), got "
                            f"{type(stop).__name__}")
        completed = 0
        while not (stop is not None and stop.is_set()):
            claim = self.claim(holder=holder, ttl=ttl)
            if claim is None:
                if stop is None and not self.list(limit=1):
                    break
                if stop is None:
                    time.sleep(poll)
                else:
                    stop.wait(poll)
                continue
            completed += self._work_one(fn, claim)
        return completed

    def _work_one(self, fn: Callable[[Claim], Any], claim: Claim) -> int:
        # The claim may have been taken away since it was won (an operator's break-glass
        # release, then another worker): only a durable read tells, and fn must not run.
        if not claim.lock.verify():
            log.warning("run %r of %r is no longer this claim's; dropping it unrun",
                        claim.run_id, self.name)
            claim.release()
            return 0
        try:
            result = fn(claim)
            if not claim.done:
                claim.complete(result)
        except qs.FencedOutError as exc:
            log.warning("run %r was taken over; dropping it: %s", claim.run_id, exc)
            claim.lock.release()  # an already completed run's claim is still this one's
            return 0
        except BaseException:
            claim.release()
            raise
        return 1

    def __repr__(self) -> str:
        return f"<RunQueue {self.name!r} on {self._q.url}>"
