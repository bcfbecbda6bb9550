"""One body's transaction on PostgreSQL: the ``StorageTxn`` the semantics run on.

How a body stays one atomic step without a global lock: every row belongs to an
*entity* (a lock name for its permits, else the key), and a transaction holds a
transaction-scoped advisory lock on every entity it touches, until COMMIT.
Bodies naming the same lock name therefore run one after the other, absent keys
included, while unrelated names run in parallel. The entities a body names are
read off it before it runs and locked in one fixed order, first thing, so two
bodies never wait for each other in a cycle; an entity reached unplanned is
locked when reached, and should that ever deadlock, the database aborts one
body, which runs again with that entity planned.

Tokens come from a SEQUENCE, which never rewinds (not on rollback, not on
restart), drawn after the locks, so above every token their holders minted.
Expiry is judged by ``clock_timestamp()``, read once per transaction. A permit
row is replaced by DELETE then INSERT (never an UPDATE in place) when a new
holder takes an expired slot, so a caller's ``FOR KEY SHARE`` fence on the old
row makes the takeover wait until the fenced transaction commits, while the
holder's own renewals (UPDATEs of non-key columns) are not blocked by it.
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import json
import time
from typing import Any, Iterable, Optional, Sequence

import psycopg

from ..._ops import LOCKS_NS, split_permit_key
from ..storage import Footprint, Row, prefix_end
from .sql import (
    ASYNC_COMMIT,
    FETCH_ONE_BY_ONE,
    UPDATES_PER_STATEMENT,
    Statement,
    Statements,
    array_literal,
    signed32,
)


@functools.lru_cache(maxsize=4096)  # every call of a name hashes it again otherwise
def entity_key(entity: str) -> int:
    return signed32(int.from_bytes(hashlib.blake2b(entity.encode(), digest_size=4).digest(),
                                    "big"))


def entity_of(ns: str, key: str) -> str:
    """Permits of one lock name share an entity, so a name's slots are scanned race-free."""
    permit = split_permit_key(key) if ns == LOCKS_NS else None
    if permit is not None:
        return "L" + permit[0]
    return f"K{ns}/{key}"  # a namespace never holds "/", so this is unambiguous


def entities_of(footprint: Footprint) -> set[str]:
    """The entities a body's footprint names: its lock names, and the entities of its keys."""
    return {"L" + name for name in footprint.names} | {
        entity_of(ns, key) for ns, key in footprint.keys}


def lock_statements(sql: Statements, entities: Iterable[str]) -> list[Statement]:
    """Transaction-scoped locks on these entities, in the one fixed order every body uses."""
    keys = sorted({entity_key(e) for e in entities})
    if len(keys) > FETCH_ONE_BY_ONE:
        # One statement, not one per entity.
        return [(sql.lock_many, (sql.lock_class, array_literal(keys)))]
    return [(sql.lock, (sql.lock_class, key)) for key in keys]


def coalesced(sql: Statements, statements: Sequence[Statement]) -> list[Statement]:
    """``statements`` with each run of single-row UPDATEs sent as one statement over arrays.

    A renewal pass updates hundreds of rows in a transaction: one statement per row would
    have the server plan, and the client quote, each of them. The rows of one run are
    distinct, so the order among them is immaterial; a row updated again starts a new run.
    """
    out: list[Statement] = []
    run: dict[tuple[Any, Any], Sequence[Any]] = {}
    for query, params in statements:
        if query == sql.update and (params[0], params[1]) not in run and (
                len(run) < UPDATES_PER_STATEMENT):
            run[(params[0], params[1])] = params
            continue
        if run:
            out.append(sql.updates(list(run.values())))
            run = {}
        if query == sql.update:
            run[(params[0], params[1])] = params
        else:
            out.append((query, params))
    if run:
        out.append(sql.updates(list(run.values())))
    return out


def notify_statement(sql: Statements, name: str) -> Statement:
    """Sent inside the transaction that frees a permit: waiters wake exactly when it commits."""
    return sql.notify, (sql.channel, name)


def _row(record: Sequence[Any]) -> Row:
    ns, key, value, version, expires_at, created_at, updated_at, prev = record
    return Row(ns, key, value, version, expires_at, created_at, updated_at, prev)


def _dump(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))


class PgTxn:
    """One body's transaction: ``StorageTxn`` over a connection, BEGIN sent on creation.

    The first round trip sends BEGIN, takes the planned entities' locks in a fixed order,
    reads the clock, draws the planned versions and fetches every row of the planned
    entities; the body's reads are then answered from memory. Writes travel with the
    next statement that needs an answer, or with COMMIT. A body that strays beyond its
    plan still works: that entity is locked and read when reached.
    """

    def __init__(self, cur: psycopg.Cursor[Any], sql: Statements, entities: Iterable[str],
                 footprint: Footprint) -> None:
        self._cur = cur
        self._sql = sql
        self._pending: list[Statement] = []
        self._rows: dict[tuple[str, str], Optional[Row]] = {}
        # The permit keys of ``_rows`` in order, so a prefix read answered from memory
        # visits only the keys it returns, not every row the transaction knows.
        self._permit_keys: list[str] = []
        self._complete: set[str] = set()
        self.unplanned: set[str] = set()
        ordered = sorted(entities, key=entity_key)
        script: list[Statement] = [("BEGIN", ())]
        if footprint.only_releases:
            script.append((ASYNC_COMMIT, ()))
        script += lock_statements(sql, ordered)
        script.append(sql.draw(footprint.mints))
        fetches = sql.fetch(ordered) if ordered else []
        sent = time.monotonic()
        results = self._roundtrip([*script, *fetches])
        self._held = set(ordered)
        clock_row = results[len(results) - len(fetches) - 1][1][0]
        self._now = int(clock_row[0])
        self.clock = (self._now, sent)  # the database's clock, and when it was asked
        self._spares = sorted(int(v) for v in clock_row[1])
        if ordered:
            fetched = results[len(results) - len(fetches):]
            self._remember(ordered, [record for _, records in fetched for record in records])

    def _remember(self, entities: Sequence[str], records: Sequence[Any]) -> None:
        # Every fetched row is kept, so a prefix read answered from memory sees what the
        # same read would see in the table.
        self._complete.update(entities)
        for record in records:
            row = _row(record)
            self._keep(row.ns, row.key, row)

    def _keep(self, ns: str, key: str, row: Optional[Row]) -> None:
        """Remember the row at ``(ns, key)`` (``None``: known absent), indexed if a permit."""
        if ns == LOCKS_NS and (ns, key) not in self._rows:
            bisect.insort(self._permit_keys, key)
        self._rows[(ns, key)] = row

    def _roundtrip(self, statements: Sequence[Statement]) -> list[tuple[int, list[Any]]]:
        """Send statements as one script; each one's ``(rowcount, rows)`` in order."""
        cur = self._cur
        cur.execute("; ".join(q for q, _ in statements), [p for _, ps in statements for p in ps])
        results = []
        while True:
            result = cur.pgresult
            returned = result is not None and result.status == psycopg.pq.ExecStatus.TUPLES_OK
            results.append((cur.rowcount, cur.fetchall() if returned else []))
            if not cur.nextset():
                return results

    def _ask(self, entity: Optional[str], query: Statement) -> list[Any]:
        """Pending writes, the lock on ``entity`` if not yet held, then ``query``: one trip."""
        script, self._pending = coalesced(self._sql, self._pending), []
        if entity is not None and entity not in self._held:
            script += lock_statements(self._sql, [entity])
            self._held.add(entity)
            self.unplanned.add(entity)
            self._spares = []  # drawn before this lock, so not above what its holders minted
        script.append(query)
        return self._roundtrip(script)[-1][1]

    def now_ms(self) -> int:
        return self._now

    def read(self, ns: str, key: str, *, now_ms: int) -> Optional[Row]:
        row = self._stored(ns, key)
        return row if row is not None and row.live_at(now_ms) else None

    def _stored(self, ns: str, key: str) -> Optional[Row]:
        """The row as stored, expired or not: a write must know which statement replaces it."""
        entity = entity_of(ns, key)
        if (ns, key) in self._rows or entity in self._complete:
            return self._rows.get((ns, key))
        records = self._ask(entity, (self._sql.read, (ns, key)))
        row = _row(records[0]) if records else None
        self._keep(ns, key, row)
        return row

    def read_prefix(
        self, ns: str, prefix: str, *, after: Optional[str], limit: int, now_ms: int
    ) -> Sequence[Row]:
        entity = entity_of(ns, prefix + "0") if ns == LOCKS_NS and prefix.endswith("#") else None
        if entity is not None and entity in self._complete:
            return self._cached_prefix(prefix, after or "", limit, now_ms)
        end = prefix_end(prefix)
        query: Statement = (
            (self._sql.read_prefix, (ns, prefix, end, after or "", now_ms, limit)) if end else
            (self._sql.read_prefix_unbounded, (ns, prefix, after or "", prefix, now_ms, limit)))
        records = self._ask(entity, query)
        rows = [_row(record) for record in records]
        for row in rows:
            self._keep(row.ns, row.key, row)
        return rows

    def _cached_prefix(self, prefix: str, after: str, limit: int, now_ms: int) -> list[Row]:
        keys = self._permit_keys
        start = bisect.bisect_right(keys, after) if after >= prefix else (
            bisect.bisect_left(keys, prefix))
        rows: list[Row] = []
        for index in range(start, len(keys)):  # not keys[start:]: that copies the tail
            key = keys[index]
            if len(rows) >= limit or not key.startswith(prefix):
                break
            row = self._rows[(LOCKS_NS, key)]
            if row is not None and row.live_at(now_ms):
                rows.append(row)
        return rows

    def _queue(self, entity: str, statements: Sequence[Statement]) -> None:
        if entity not in self._held:
            self._ask(entity, ("SELECT 1", ()))  # take the entity's lock before writing to it
        self._pending.extend(statements)

    def write(self, row: Row) -> None:
        known = self._rows.get((row.ns, row.key))
        live = known is not None and known.live_at(self._now)
        # An update that keeps the very value object (a renewal) sends NULL: encoding it
        # costs more. Identity, not equality: 1 == True == 1.0, yet JSON tells them apart.
        kept = live and known is not None and known.value is row.value
        values: tuple[Any, ...] = (None if kept else _dump(row.value), row.version,
                                   row.expires_at, row.created_at, row.updated_at,
                                   row.prev_version)
        statements: list[Statement]
        entity = entity_of(row.ns, row.key)
        if live:
            statements = [(self._sql.update, (row.ns, row.key, *values))]
        elif known is None and ((row.ns, row.key) in self._rows or entity in self._complete):
            statements = [(self._sql.insert, (row.ns, row.key, *values))]  # known to be absent
        else:
            # DELETE then INSERT, so a caller's fence on an expired row makes this wait for
            # its commit; a live row in the way fails the INSERT (answered as contended).
            statements = [(self._sql.delete_expired, (row.ns, row.key, self._now)),
                          (self._sql.insert, (row.ns, row.key, *values))]
        self._queue(entity, statements)
        self._keep(row.ns, row.key, row)

    def delete(self, ns: str, key: str) -> None:
        self._queue(entity_of(ns, key), [(self._sql.delete, (ns, key))])
        self._keep(ns, key, None)

    def freed(self, name: str) -> None:
        self._pending.append(notify_statement(self._sql, name))

    def next_version(self) -> int:
        if self._spares:
            return self._spares.pop(0)
        records = self._ask(None, (self._sql.next_version, ()))
        return int(records[0][0])

    def rows(self) -> dict[tuple[str, str], Optional[Row]]:
        """Every row whose state this transaction knows (``None``: known absent)."""
        return self._rows

    def commit_script(self) -> list[Statement]:
        """What is left to send: the pending writes, then COMMIT."""
        script, self._pending = coalesced(self._sql, self._pending), []
        return [*script, ("COMMIT", ())]
