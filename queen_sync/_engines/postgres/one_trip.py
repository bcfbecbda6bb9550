"""Bodies answered from rows the client remembers, and sent as ONE round trip with guards.

A body runs on ``PgTxn`` in two round trips: one to lock and read, one to write and
commit. Yet a release usually reads back the very row this client wrote moments
before (its acquire, its last renewal). So the storage remembers, per client, the
lock permits its committed transactions left behind and the database clock they
saw. A body that only reads remembered permits and deletes (a release, a guarded
delete) runs at once on that memory, with the clock estimated from the
last reading; the whole transaction then travels as one script: the entities'
locks, one guard per row the body read, its deletes.

Each guard fails the transaction unless its row is still exactly as remembered
and is judged live or expired alike at the estimate and at ``clock_timestamp()``.
So whatever the body saw is what the database holds, expiry included, at a
moment when the body's locks are held: its answer is the one the two-trip path
would give. A failed guard, a forgotten row, or a body that needs more (a prefix
scan, a new version, a write that carries the clock) sends nothing, or rolls back,
and runs again on the two-trip path.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from typing import Any, Iterable, Optional, Sequence

from ..._ops import LOCKS_NS
from ..storage import Row
from .sql import ASYNC_COMMIT, Statement, Statements
from .txn import entity_of, lock_statements, notify_statement

_REMEMBERED_ROWS = 4096


class NotGuardable(Exception):
    """The body needs the database before it can go on: it runs again on the two-trip path."""


class SeenRows:
    """The permits this client's committed transactions left behind, and the database's clock.

    Only a hint: guards check every remembered row a body relies on, so a row another
    client changed since costs a second attempt, never a wrong answer.
    """

    def __init__(self, capacity: int = _REMEMBERED_ROWS) -> None:
        self._rows: OrderedDict[tuple[str, str], Optional[Row]] = OrderedDict()
        self._capacity = capacity
        self._clock: Optional[tuple[int, float]] = None
        self._mutex = threading.Lock()

    def lookup(self, ns: str, key: str) -> Optional[Row]:
        """The remembered row (``None``: remembered absent); ``NotGuardable`` if forgotten."""
        with self._mutex:
            try:
                return self._rows[(ns, key)]
            except KeyError:
                raise NotGuardable(f"{ns}/{key} is not remembered") from None

    def remember(self, rows: dict[tuple[str, str], Optional[Row]]) -> None:
        """Keep the lock permits among ``rows``: small, and what a release reads back.

        Key/value rows are not kept, as their values may be large.
        """
        with self._mutex:
            for address, row in rows.items():
                if address[0] != LOCKS_NS:
                    continue
                self._rows[address] = row
                self._rows.move_to_end(address)
            while len(self._rows) > self._capacity:
                self._rows.popitem(last=False)

    def forget(self, addresses: set[tuple[str, str]]) -> None:
        with self._mutex:
            for address in addresses:
                self._rows.pop(address, None)

    def saw_clock(self, clock: tuple[int, float]) -> None:
        """The database's clock in ms, and the ``time.monotonic()`` just before it was read."""
        with self._mutex:
            self._clock = clock

    def estimated_now(self) -> Optional[int]:
        """The database's clock now, extrapolated from the last reading (None: never read)."""
        with self._mutex:
            clock = self._clock
        if clock is None:
            return None
        database_ms, asked_at = clock
        return database_ms + int((time.monotonic() - asked_at) * 1000)


class GuardedTxn:
    """``StorageTxn`` answered from ``SeenRows``; ``commit_script`` is the whole transaction."""

    def __init__(self, sql: Statements, entities: Iterable[str], seen: SeenRows,
                 now_ms: int) -> None:
        self._sql = sql
        self._seen = seen
        self._now = now_ms
        self._entities = set(entities)
        self._rows: dict[tuple[str, str], Optional[Row]] = {}
        self._guards: dict[tuple[str, str], Statement] = {}
        self._writes: list[Statement] = []
        self.unplanned: set[str] = set()

    def now_ms(self) -> int:
        return self._now

    def read(self, ns: str, key: str, *, now_ms: int) -> Optional[Row]:
        row = self._remembered(ns, key)
        return row if row is not None and row.live_at(now_ms) else None

    def _remembered(self, ns: str, key: str) -> Optional[Row]:
        """The row as remembered, guarded so the transaction fails unless it still is."""
        if (ns, key) in self._rows:
            return self._rows[(ns, key)]
        row = self._seen.lookup(ns, key)
        self._entities.add(entity_of(ns, key))
        self._guards[(ns, key)] = (
            (self._sql.guard_absent, (ns, key)) if row is None else
            (self._sql.guard_row, (ns, key, row.version, row.expires_at, row.created_at,
                                   row.updated_at, row.prev_version, self._now)))
        self._rows[(ns, key)] = row
        return row

    def read_prefix(self, ns: str, prefix: str, *, after: Optional[str], limit: int,
                    now_ms: int) -> list[Row]:
        raise NotGuardable("a prefix scan needs the database")

    def write(self, row: Row) -> None:
        raise NotGuardable("a written row carries the clock, so it needs the database's")

    def next_version(self) -> int:
        raise NotGuardable("a new version comes from the database")

    def delete(self, ns: str, key: str) -> None:
        self._entities.add(entity_of(ns, key))
        self._writes.append((self._sql.delete, (ns, key)))
        self._rows[(ns, key)] = None

    def freed(self, name: str) -> None:
        self._writes.append(notify_statement(self._sql, name))

    def rows(self) -> dict[tuple[str, str], Optional[Row]]:
        """Every row whose state this transaction knows (``None``: known absent)."""
        return self._rows

    def commit_script(self) -> list[Statement]:
        """The locks in the one fixed order, the guards, the deletes and NOTIFYs.

        Sent as one pipeline with no BEGIN: PostgreSQL runs it as one implicit
        transaction, which commits at its end, and which a failed guard rolls back
        without a ROLLBACK costing another round trip. A deleted row's guard goes with
        its delete, and a NOTIFY right after it with both: the server's cost is mostly
        per statement, and every row a body deletes it has read.
        """
        sql = self._sql
        locks = lock_statements(sql, self._entities)
        # Only a body of releases runs here, so its commit need not wait for the disk.
        script: list[Statement] = (
            [(sql.lock_no_wait, locks[0][1])] if len(locks) == 1 and locks[0][0] == sql.lock
            else [(ASYNC_COMMIT, ()), *locks])
        guards = dict(self._guards)
        fused: dict[tuple[Any, ...], Sequence[Any]] = {}
        for query, params in self._writes:
            guard = guards.get((params[0], params[1])) if query == sql.delete else None
            if guard is not None and guard[0] == sql.guard_row:
                fused[tuple(params)] = guard[1]
                del guards[(params[0], params[1])]
        script += guards.values()
        for query, params in self._writes:
            if query == sql.delete and tuple(params) in fused:
                script.append((sql.guarded_delete, fused.pop(tuple(params))))
            elif query == sql.notify and script[-1][0] == sql.guarded_delete:
                script[-1] = (sql.guarded_delete_notify, (*script[-1][1], *params))
            else:
                script.append((query, params))
        return script
