"""The run queue's records as listings return them, and the checks on their ids.

The pending, completion and dead-letter records of a queue live in ``RUNS_NS`` under
``<queue>/pending|done|dead/<run id>``; a claim is a lock permit beside them.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Dict, Iterable, List, Optional, TypeVar

from ._engine_time import utc

T = TypeVar("T")

#: The namespace of every queue's records: ``<queue>/pending|done|dead/<run id>``.
RUNS_NS = "queen-sync.runs"


def check_id(value: Any, what: str, max_bytes: int) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{what} must be a str, got {type(value).__name__}")
    if not value or len(value.encode("utf-8")) > max_bytes or "#" in value:
        raise ValueError(f"{what} {value!r} must be 1..{max_bytes} bytes without '#'")
    if any(ord(ch) < 32 or ord(ch) == 127 for ch in value):
        raise ValueError(f"{what} {value!r} contains a control character")
    return value


def check_count(value: Any, what: str, *, optional: bool = True) -> Optional[int]:
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{what} must be an int{' or None' if optional else ''}, "
                        f"got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{what} must be at least 1, got {value}")
    return value


def check_after(after: Any) -> Optional[str]:
    return None if after is None else check_id(after, "after", 180)


@dataclass(frozen=True)
class ClaimInfo:
    """A run's claim as a listing saw it (``expired`` judged by the engine's clock).

    ``expires_at`` is the engine's expiry for a live claim; for an expired one, the
    expiry its holder estimated at its last write (later renewals are not recorded).
    """

    holder: str
    fence: int
    expires_at: Optional[datetime]
    expired: bool


@dataclass(frozen=True)
class RunEntry:
    """One pending (not yet completed) run; ``attempts`` counts its claims so far."""

    run_id: str
    payload: Any
    claim: Optional[ClaimInfo]
    state: Any
    attempts: int = 0

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
    attempts: int = 1


@dataclass(frozen=True)
class DeadLetter:
    """A run taken off the queue after ``attempts`` claims: its payload and last checkpoint.

    ``claim`` is the last claim its record kept: the one that died holding it, or None
    when the last claim gave the run back (``release()``, or ``work()`` after ``fn`` raised).
    """

    run_id: str
    payload: Any
    state: Any
    attempts: int
    claim: Optional[ClaimInfo]


class Page(List[T]):
    """One page of a listing, in run-id order.

    ``next_after`` is the ``after=`` that continues the listing; None once nothing follows.
    """

    def __init__(self, items: Iterable[T] = (), next_after: Optional[str] = None) -> None:
        super().__init__(items)
        self.next_after = next_after


class ResultPage(Dict[str, "Completion"]):
    """One page of completion records by run id; ``next_after`` continues it (None: done)."""

    def __init__(self, items: Iterable[tuple[str, Completion]] = (),
                 next_after: Optional[str] = None) -> None:
        super().__init__(items)
        self.next_after = next_after


def recorded_claim(value: Any) -> Optional[ClaimInfo]:
    """The claim a record remembers; with no live permit behind it, it has expired."""
    if not isinstance(value, dict):
        return None
    return ClaimInfo(value["holder"], int(value["fence"]), utc(value.get("expiresAt")),
                     expired=True)


def pending_entry(run_id: str, value: dict[str, Any], live: Optional[ClaimInfo]) -> RunEntry:
    claim = live or recorded_claim(value.get("claim"))
    return RunEntry(run_id, value.get("payload"), claim, value.get("state"),
                    int(value.get("attempts", 0)))


@dataclass(frozen=True)
class PageRead:
    """One page of pending runs as read: (run id, record value, version), and live claims."""

    rows: List[tuple[str, dict[str, Any], int]]
    live: Dict[str, ClaimInfo]
    next_after: Optional[str]

    def entries(self) -> List[RunEntry]:
        return [pending_entry(run_id, value, self.live.get(run_id))
                for run_id, value, _ in self.rows]


def from_anywhere(rows: List[T]) -> List[T]:
    """``rows`` rotated to start at a random one: workers that lost a race on one page then
    mostly try different runs next, instead of all racing for its next free run."""
    if len(rows) < 2:
        return rows
    start = random.randrange(len(rows))
    return rows[start:] + rows[:start]


def under(prefix: str, run_id: Optional[str]) -> Optional[str]:
    return None if run_id is None else prefix + run_id


def live_claims(lock_prefix: str, permits: List[dict[str, Any]]) -> Dict[str, ClaimInfo]:
    """The live claim of each run whose permit is among ``permits`` (a key is name#slot)."""
    out: Dict[str, ClaimInfo] = {}
    for row in permits:
        run_id = row["key"][len(lock_prefix):].rsplit("#", 1)[0]
        owner = str((row.get("value") or {}).get("owner", ""))
        out[run_id] = ClaimInfo(owner.rsplit("/", 1)[0], int(row["version"]),
                                utc(row.get("expiresAt")), expired=False)
    return out


def completion_of(run_id: str, value: dict[str, Any]) -> Completion:
    return Completion(run_id, value["result"], value["holder"], int(value["fence"]),
                      int(value.get("attempts", 1)))


def dead_letter_of(run_id: str, value: dict[str, Any]) -> DeadLetter:
    return DeadLetter(run_id, value.get("payload"), value.get("state"),
                      int(value.get("attempts", 0)), recorded_claim(value.get("claim")))
