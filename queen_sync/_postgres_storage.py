"""PostgreSQL storage for the embedded semantics: one schema, one pool, one transaction per body.

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
restart). Expiry is judged by ``clock_timestamp()``, read once per transaction.
A permit row is replaced by DELETE then INSERT (never an UPDATE in place) when a
new holder takes an expired slot, so a caller's ``FOR KEY SHARE`` fence on the
old row makes the takeover wait until the fenced transaction commits, while the
holder's own renewals (UPDATEs of non-key columns) are not blocked by it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import threading
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional, Sequence

import psycopg
import psycopg_pool
from psycopg import ClientCursor

from ._errors import EngineError, EngineUnavailableError, QueenError
from ._ops import LOCKS_NS
from ._postgres_sql import CLOCK, SCHEMA_VERSION, Statement, Statements, signed32
from ._storage import Row, StorageConflict

log = logging.getLogger("queen_sync")

_POOL_WAIT = 0.25
_SWEEP_EVERY = 1000

# Every driver exception type this package catches, each translated by ``translate``.
CAUGHT_DRIVER_ERRORS: tuple[type[Exception], ...] = (
    psycopg.Error,
    psycopg.OperationalError,
    psycopg.errors.UniqueViolation,
    psycopg.errors.DeadlockDetected,
    psycopg.errors.SerializationFailure,
    psycopg.errors.DivisionByZero,
    psycopg.errors.UndefinedTable,
    psycopg_pool.PoolTimeout,
)

# Most specific first: the first matching class decides the queen_sync error.
_TRANSLATIONS: tuple[tuple[type[Exception], type[QueenError], str], ...] = (
    (psycopg_pool.PoolClosed, EngineError, "the engine is closed"),
    (psycopg_pool.PoolTimeout, EngineUnavailableError, "no connection became available"),
    (psycopg_pool.TooManyRequests, EngineUnavailableError, "too many callers are waiting"),
    (psycopg.errors.InsufficientPrivilege, EngineError, "the database user lacks a privilege"),
    (psycopg.OperationalError, EngineUnavailableError, "the database is unavailable"),
    (psycopg.InterfaceError, EngineError, "the driver failed"),
    (psycopg.Error, EngineError, "the database refused the request"),
)


def translate(exc: psycopg.Error, where: str) -> QueenError:
    """The queen_sync error for a driver error (``where`` names the store, without secrets)."""
    for driver_type, queen_type, summary in _TRANSLATIONS:
        if isinstance(exc, driver_type):
            detail = str(exc).strip() or type(exc).__name__
            return queen_type(f"PostgreSQL at {where}: {summary}: {detail}")
    raise TypeError(f"not a driver error: {exc!r}")  # pragma: no cover - psycopg.Error matches


def _entity_key(entity: str) -> int:
    return signed32(int.from_bytes(hashlib.blake2b(entity.encode(), digest_size=4).digest(),
                                    "big"))


def _entity_of(ns: str, key: str) -> str:
    """Permits of one lock name share an entity, so a name's slots are scanned race-free."""
    if ns == LOCKS_NS and "#" in key:
        return "L" + key.rsplit("#", 1)[0]
    return f"K{ns}/{key}"  # a namespace never holds "/", so this is unambiguous


def _prefix_end(prefix: str) -> Optional[str]:
    """The least string above every string starting with ``prefix`` (code point order)."""
    chars = list(prefix)
    while chars:
        last = ord(chars.pop()) + 1
        if last == 0xD800:
            last = 0xE000  # surrogates cannot be stored in text
        if last <= 0x10FFFF:
            return "".join(chars) + chr(last)
    return None


def _row(record: Sequence[Any]) -> Row:
    ns, key, value, version, expires_at, created_at, updated_at, prev = record
    return Row(ns, key, value, version, expires_at, created_at, updated_at, prev)


def _dump(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))


# Lost races that running the body again resolves.
_CONFLICTS = (psycopg.errors.UniqueViolation, psycopg.errors.DeadlockDetected,
              psycopg.errors.SerializationFailure, psycopg.errors.DivisionByZero)
_MINTS = frozenset({"acquire", "renew", "put", "putIfAbsent", "incr"})
_KEYED = frozenset({"get", "put", "putIfAbsent", "delete", "incr", "check"})

_Pool = psycopg_pool.ConnectionPool[psycopg.Connection[Any]]


@dataclass
class Plan:
    """What a body will touch, read off it before it runs: locked and fetched up front.

    Attributes:
        entities: the entities (lock names, keys) its operations name.
        versions: how many versions it may mint (drawn in advance; unused ones are skipped).
        durable: False for a body that only releases locks: its commit need not wait for
            the disk, since a release lost in a crash only lets the lease run out, and any
            later durable commit flushes it anyway.
    """

    entities: set[str] = field(default_factory=set)
    versions: int = 0
    durable: bool = True


def plan_for(route: str, body: Any) -> Plan:
    """The plan of a wire body; anything malformed is left for the semantics to refuse."""
    plan = Plan()
    ops = body.get("kv") if route == "transaction" else body.get("operations")
    for op in ops if isinstance(ops, list) else ():
        kind = op.get("op") if isinstance(op, dict) else None
        if route == "locks" and isinstance(op.get("name"), str):
            plan.entities.add("L" + op["name"])
        elif kind in _KEYED and isinstance(op.get("ns"), str) and isinstance(op.get("key"), str):
            plan.entities.add(_entity_of(op["ns"], op["key"]))
        elif kind == "getMany" and isinstance(op.get("ns"), str) and isinstance(op.get("keys"),
                                                                                list):
            plan.entities.update(_entity_of(op["ns"], k) for k in op["keys"] if isinstance(k, str))
        plan.versions += kind in _MINTS
        plan.durable = plan.durable and not (route == "locks" and kind == "release")
    return plan


class _CallState(threading.local):
    """Per-thread memory across the attempts of one call."""

    def __init__(self) -> None:
        self.plan = Plan()
        self.reconnected = False


class PgTxn:
    """One body's transaction: ``StorageTxn`` over a connection, BEGIN sent on creation.

    The first round trip sends BEGIN, takes the planned entities' locks in a fixed order,
    reads the clock, draws the planned versions and fetches every row of the planned
    entities; the body's reads are then answered from memory. Writes travel with the
    next statement that needs an answer, or with COMMIT. A body that strays beyond its
    plan still works: that entity is locked and read when reached.
    """

    def __init__(self, cur: psycopg.Cursor[Any], sql: Statements, plan: Plan) -> None:
        self._cur = cur
        self._sql = sql
        self._pending: list[Statement] = []
        self._rows: dict[tuple[str, str], Optional[Row]] = {}
        self._complete: set[str] = set()
        self.unplanned: set[str] = set()
        ordered = sorted(plan.entities, key=_entity_key)
        begin = "BEGIN" if plan.durable else "BEGIN; SET LOCAL synchronous_commit = off"
        script: list[Statement] = [(begin, ())]
        script += [(sql.lock, (sql.lock_class, _entity_key(e))) for e in ordered]
        script.append(sql.draw(plan.versions))
        fetches = sql.fetch(ordered) if ordered else []
        results = self._roundtrip([*script, *fetches])
        self._held = set(ordered)
        clock_row = results[len(results) - len(fetches) - 1][1][0]
        self._now = int(clock_row[0])
        self._spares = sorted(int(v) for v in clock_row[1])
        if ordered:
            fetched = results[len(results) - len(fetches):]
            self._remember(ordered, [record for _, records in fetched for record in records])

    def _remember(self, entities: Sequence[str], records: Sequence[Any]) -> None:
        wanted = set(entities)
        self._complete |= wanted
        for record in records:
            row = _row(record)
            if _entity_of(row.ns, row.key) in wanted:
                self._rows[(row.ns, row.key)] = row

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
        script, self._pending = self._pending, []
        if entity is not None and entity not in self._held:
            script.append((self._sql.lock, (self._sql.lock_class, _entity_key(entity))))
            self._held.add(entity)
            self.unplanned.add(entity)
            self._spares = []  # drawn before this lock, so not above what its holders minted
        script.append(query)
        return self._roundtrip(script)[-1][1]

    def now_ms(self) -> int:
        return self._now

    def read(self, ns: str, key: str) -> Optional[Row]:
        entity = _entity_of(ns, key)
        if (ns, key) in self._rows or entity in self._complete:
            return self._rows.get((ns, key))
        records = self._ask(entity, (self._sql.read, (ns, key)))
        row = _row(records[0]) if records else None
        self._rows[(ns, key)] = row
        return row

    def read_prefix(
        self, ns: str, prefix: str, *, after: Optional[str], limit: int, now_ms: int
    ) -> Sequence[Row]:
        entity = _entity_of(ns, prefix + "0") if ns == LOCKS_NS and prefix.endswith("#") else None
        if entity is not None and entity in self._complete:
            return self._cached_prefix(prefix, after or "", limit, now_ms)
        end = _prefix_end(prefix)
        query: Statement = (
            (self._sql.read_prefix, (ns, prefix, end, after or "", now_ms, limit)) if end else
            (self._sql.read_prefix_unbounded, (ns, prefix, after or "", prefix, now_ms, limit)))
        records = self._ask(entity, query)
        rows = [_row(record) for record in records]
        for row in rows:
            self._rows[(row.ns, row.key)] = row
        return rows

    def _cached_prefix(self, prefix: str, after: str, limit: int, now_ms: int) -> list[Row]:
        rows = [row for (ns, key), row in self._rows.items()
                if row is not None and ns == LOCKS_NS and key.startswith(prefix) and key > after
                and row.live_at(now_ms)]
        return sorted(rows, key=lambda row: row.key)[:limit]

    def _queue(self, entity: str, statements: Sequence[Statement]) -> None:
        if entity not in self._held:
            self._ask(entity, ("SELECT 1", ()))  # take the entity's lock before writing to it
        self._pending.extend(statements)

    def write(self, row: Row) -> None:
        values: tuple[Any, ...] = (_dump(row.value), row.version, row.expires_at,
                                   row.created_at, row.updated_at, row.prev_version)
        statements: list[Statement]
        entity = _entity_of(row.ns, row.key)
        known = self._rows.get((row.ns, row.key))
        if known is not None and known.live_at(self._now):
            statements = [(self._sql.update, (row.ns, row.key, *values))]
        elif known is None and ((row.ns, row.key) in self._rows or entity in self._complete):
            statements = [(self._sql.insert, (row.ns, row.key, *values))]  # known to be absent
        else:
            # DELETE then INSERT, so a caller's fence on an expired row makes this wait for
            # its commit; a live row in the way fails the INSERT (answered as contended).
            statements = [(self._sql.delete_expired, (row.ns, row.key, self._now)),
                          (self._sql.insert, (row.ns, row.key, *values))]
        self._queue(entity, statements)
        self._rows[(row.ns, row.key)] = row

    def delete(self, ns: str, key: str) -> None:
        statements: list[Statement] = [(self._sql.delete, (ns, key))]
        if ns == LOCKS_NS and "#" in key:
            # Notified inside the transaction: waiters wake exactly when the release commits.
            statements.append((self._sql.notify, (self._sql.channel, key.rsplit("#", 1)[0])))
        self._queue(_entity_of(ns, key), statements)
        self._rows[(ns, key)] = None

    def next_version(self) -> int:
        if self._spares:
            return self._spares.pop(0)
        records = self._ask(None, (self._sql.next_version, ()))
        return int(records[0][0])

    def commit_script(self) -> list[Statement]:
        """What is left to send: the pending writes, then COMMIT."""
        script, self._pending = self._pending, []
        return [*script, ("COMMIT", ())]


def _lost(conn: psycopg.Connection[Any]) -> bool:
    """The connection is gone (closed, or its socket broke): no statement can run on it."""
    return conn.closed or conn.pgconn.status == psycopg.pq.ConnStatus.BAD


def _fetch_one(cur: psycopg.Cursor[Any]) -> Any:
    record = cur.fetchone()
    if record is None:  # pragma: no cover - these queries always return one row
        raise EngineError("PostgreSQL returned no row where one was expected")
    return record


class PostgresStorage:
    """``Storage`` over one PostgreSQL schema, through a pool shared by every thread of a client.

    Args:
        conninfo: a libpq connection string (it may hold a password: never logged).
        where: the store's address without secrets, for messages.
        schema: the schema holding the tables (created on first use).
        timeout: seconds to wait for a connection.
        min_size: connections the pool keeps open.
        max_size: connections the pool may open.
    """

    def __init__(self, conninfo: str, *, where: str, schema: str, timeout: float,
                 min_size: int, max_size: int) -> None:
        self.sql = Statements(schema)
        self.where = where
        self._conninfo = conninfo
        self._timeout = timeout
        self._sizes = (min_size, max_size)
        self._pool: Optional[_Pool] = None
        self._mutex = threading.Lock()
        self._state = _CallState()
        self._commits = 0
        self._closed = False
        self.connections: list[psycopg.Connection[Any]] = []

    # ---- connections ---------------------------------------------------------------------

    def connect(self, **overrides: Any) -> psycopg.Connection[Any]:
        """A new connection outside the pool (migrations, LISTEN); driver errors propagate."""
        conn = psycopg.Connection.connect(self._conninfo, autocommit=True,
                                          cursor_factory=ClientCursor, **overrides)
        self._track(conn)
        return conn

    def _prepare(self, conn: psycopg.Connection[Any]) -> None:
        """Make a connection ready for bodies: remembered, with the statements prepared."""
        self._track(conn)
        conn.execute(self.sql.prepare)

    def _track(self, conn: psycopg.Connection[Any]) -> None:
        # Remembered so a forked child can detach from them without closing the parent's.
        with self._mutex:
            self.connections = [c for c in self.connections if not c.closed]
            self.connections.append(conn)

    def _open_pool(self) -> _Pool:
        with self._mutex:
            pool = self._pool
        if pool is not None:
            return pool
        with self._translated():
            self._migrate()
        with self._mutex:
            if self._closed:
                raise EngineError(f"PostgreSQL engine at {self.where} is closed")
            if self._pool is None:
                self._pool = psycopg_pool.ConnectionPool(
                    self._conninfo, min_size=self._sizes[0], max_size=self._sizes[1],
                    kwargs={"autocommit": True, "cursor_factory": ClientCursor},
                    configure=self._prepare, timeout=self._timeout, name="queen_sync",
                    num_workers=1, open=True)
            return self._pool

    def _migrate(self) -> None:
        """Create or upgrade the schema; several processes may race here, so it is serialised."""
        with self.connect() as conn:
            with contextlib.suppress(psycopg.errors.UndefinedTable), conn.transaction():
                record = conn.execute(self.sql.schema_version).fetchone()
                if record is not None and record[0] >= SCHEMA_VERSION:
                    return
            with conn.transaction():
                conn.execute(self.sql.migration_lock, (self.sql.lock_class,))
                conn.execute(self.sql.ddl)
        log.info("queen_sync schema %r ready in PostgreSQL at %s", self.sql.schema, self.where)

    def _checkout(self) -> tuple[psycopg.Connection[Any], Optional[_Pool]]:
        """A connection, and the pool it came from (None: opened for this call alone)."""
        pool = self._open_pool()
        try:
            return pool.getconn(timeout=_POOL_WAIT), pool
        except psycopg_pool.PoolTimeout:
            pass  # the pool is busy, or reconnecting with back-off after an outage
        except psycopg.Error as exc:
            raise translate(exc, self.where) from exc
        # Connecting here, now, answers at once: a connection, or libpq's reason why not.
        try:
            conn = self.connect()
        except psycopg.Error as exc:
            raise translate(exc, self.where) from exc
        try:
            conn.execute(self.sql.prepare)
        except psycopg.Error as exc:
            conn.close()
            raise translate(exc, self.where) from exc
        return conn, None

    def _checkin(self, conn: psycopg.Connection[Any], pool: Optional[_Pool]) -> None:
        if not _lost(conn) and conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
            try:
                conn.execute("ROLLBACK")
            except psycopg.Error:
                conn.close()
        if pool is not None and not pool.closed:
            pool.putconn(conn)
        else:
            conn.close()

    # ---- transactions --------------------------------------------------------------------

    def new_call(self, route: str, body: Any) -> None:
        """Plan the coming call's transaction and forget the previous call's retries."""
        self._state.plan = plan_for(route, body)
        self._state.reconnected = False

    @contextlib.contextmanager
    def transaction(self) -> Iterator[PgTxn]:
        conn, pool = self._checkout()
        try:
            with self._body_failures(conn) as box:
                box.append(PgTxn(conn.cursor(), self.sql, self._state.plan))
                yield box[0]
            self._commit(conn, box[0])
        finally:
            self._checkin(conn, pool)
        self._commits += 1
        if self._commits % _SWEEP_EVERY == 0:
            self._sweep()

    @contextlib.contextmanager
    def _body_failures(self, conn: psycopg.Connection[Any]) -> Iterator[list[PgTxn]]:
        """Errors before COMMIT was sent: nothing committed, so some are worth a new attempt."""
        box: list[PgTxn] = []
        try:
            yield box
        except _CONFLICTS as exc:
            if box:  # the next attempt locks up front what this one had to lock on the way
                self._state.plan.entities |= box[0].unplanned
            raise StorageConflict(str(exc)) from exc
        except psycopg.OperationalError as exc:
            if _lost(conn) and not self._state.reconnected:
                # The connection died before COMMIT was sent: run the body once more afresh.
                self._state.reconnected = True
                log.info("PostgreSQL connection to %s lost (%s); retrying once", self.where,
                         type(exc).__name__)
                self._discard_dead()
                raise StorageConflict("connection lost before commit") from exc
            raise translate(exc, self.where) from exc
        except psycopg.Error as exc:
            raise translate(exc, self.where) from exc

    def _commit(self, conn: psycopg.Connection[Any], txn: PgTxn) -> None:
        """Send the pending writes and COMMIT in one script; a lost connection is ambiguous."""
        script = txn.commit_script()
        try:
            conn.execute("; ".join(q for q, _ in script), [p for _, ps in script for p in ps])
        except psycopg.Error as exc:
            if _lost(conn):
                raise EngineUnavailableError(
                    f"PostgreSQL at {self.where}: the connection was lost during COMMIT, so "
                    f"whether the call took effect is unknown: {exc}") from exc
            # A server error stops the script before its COMMIT: nothing was committed.
            if isinstance(exc, _CONFLICTS):
                self._state.plan.entities |= txn.unplanned
                raise StorageConflict(str(exc)) from exc
            raise translate(exc, self.where) from exc

    def _discard_dead(self) -> None:
        pool = self._pool
        if pool is not None:
            with contextlib.suppress(psycopg.Error):
                pool.check()

    def _sweep(self) -> None:
        """Delete a batch of expired rows; skips rows someone holds (a fence, a body)."""
        try:
            with self._open_pool().connection(timeout=_POOL_WAIT) as conn:
                now = _fetch_one(conn.execute(CLOCK))[0]
                conn.execute(self.sql.sweep, (now,))
        except psycopg.Error as exc:
            log.debug("sweeping expired rows at %s failed: %s", self.where, exc)

    def notify_released(self, names: Sequence[str]) -> None:
        """Nothing to do: ``delete`` notified inside the transaction that freed the permit."""

    @contextlib.contextmanager
    def _translated(self) -> Iterator[None]:
        try:
            yield
        except psycopg.Error as exc:
            raise translate(exc, self.where) from exc

    # ---- lifecycle -----------------------------------------------------------------------

    def after_fork(self) -> None:
        """In a forked child: detach from the parent's sockets, build a new pool when needed."""
        with self._mutex:
            pool, self._pool = self._pool, None
            conns, self.connections = self.connections, []
        detach(conns)
        if pool is not None:
            _ABANDONED.append(pool)
        self._mutex = threading.Lock()
        self._state = _CallState()

    def close(self) -> None:
        with self._mutex:
            self._closed = True
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.close(timeout=5.0)


# Pools inherited across fork: never closed or collected in the child, as that would end the
# parent's sessions.
_ABANDONED: list[Any] = []


def detach(conns: Sequence[psycopg.Connection[Any]]) -> None:
    """Point a child's copies of the parent's sockets at /dev/null.

    Whatever then closes them (garbage collection, interpreter exit) says goodbye to
    /dev/null, not to the server, so the parent's sessions live on.
    """
    devnull = os.open(os.devnull, os.O_RDWR)
    try:
        for conn in conns:
            with contextlib.suppress(psycopg.Error, OSError):
                if not conn.closed:
                    os.dup2(devnull, conn.pgconn.socket)
    finally:
        os.close(devnull)
