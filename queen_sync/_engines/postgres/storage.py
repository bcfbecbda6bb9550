"""PostgreSQL storage for the embedded semantics: one schema, one pool, one transaction per body.

The pool is shared by every thread of a client (the caller, the renewer). A body
is one transaction: in two round trips (see ``_postgres_txn``), or in one when it
only reads permits the client remembers and deletes (see ``_postgres_guarded``). A
connection lost before COMMIT was sent means nothing committed, so the body runs
once more on a fresh connection; one lost during COMMIT leaves the outcome
unknown, and says so. Driver errors leave this module as queen_sync errors.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import select
import threading
import time
from typing import Any, ContextManager, Iterator, Optional, Sequence, Union

import psycopg
import psycopg_pool
from psycopg import ClientCursor

from ..._errors import EngineError, EngineUnavailableError, QueenError
from ..storage import StorageConflict
from .deadline import Watch, Watchdog
from .errors import CAUGHT_DRIVER_ERRORS as CAUGHT_DRIVER_ERRORS
from .errors import detail_of, translate
from .one_trip import GuardedTxn, SeenRows
from .sql import CLOCK, SCHEMA_VERSION, Statements
from .txn import PgTxn, Plan, plan_for

log = logging.getLogger("queen_sync")

_POOL_WAIT = 0.25
_SWEEP_EVERY = 1000
_HOT_USES = 1000

# Lost races that running the body again resolves.
_CONFLICTS = (psycopg.errors.UniqueViolation, psycopg.errors.DeadlockDetected,
              psycopg.errors.SerializationFailure, psycopg.errors.DivisionByZero)
_Pool = psycopg_pool.ConnectionPool[psycopg.Connection[Any]]
Txn = Union[PgTxn, GuardedTxn]


class _CallState(threading.local):
    """Per-thread memory across the attempts of one call."""

    def __init__(self) -> None:
        self.plan = Plan()
        self.reconnected = False
        self.guarded = False  # one attempt at most runs as a GuardedTxn
        self.deadline = float("inf")  # time.monotonic() by which the call must be answered
        self.watch: Optional[Watch] = None  # the connection the current attempt runs on


def _has_input(conn: psycopg.Connection[Any]) -> bool:
    """Bytes (or end of stream) wait on an idle connection: the server spoke, likely goodbye.

    A one-trip body on such a connection could not tell "never ran" from "unknown"
    when it fails, so it takes the two-trip path, which can.
    """
    try:
        ready, _, _ = select.select([conn.pgconn.socket], [], [], 0)
    except (OSError, ValueError, psycopg.Error):
        return True
    return bool(ready)


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
        call_timeout: seconds a call may take, bounded on this side of the wire.
        min_size: connections the pool keeps open.
        max_size: connections the pool may open.
        secrets: texts never to show in an error or a log line (the password).
    """

    def __init__(self, conninfo: str, *, where: str, schema: str, timeout: float,
                 min_size: int, max_size: int, secrets: frozenset[str] = frozenset(),
                 call_timeout: float = 10.0) -> None:
        self.sql = Statements(schema)
        self.call_timeout = call_timeout
        self._watchdog = Watchdog()
        self.where = where
        self.secrets = secrets
        self._conninfo = conninfo
        self._timeout = timeout
        self._sizes = (min_size, max_size)
        self._pool: Optional[_Pool] = None
        self._hot: Optional[psycopg.Connection[Any]] = None
        self._checkins = 0
        self._mutex = threading.Lock()
        self._state = _CallState()
        self._seen = SeenRows()
        self._commits = 0
        self._closed = False
        self.connections: list[psycopg.Connection[Any]] = []

    # ---- connections ---------------------------------------------------------------------

    def connect(self, **overrides: Any) -> psycopg.Connection[Any]:
        """A new connection outside the pool (migrations, LISTEN); driver errors propagate.

        They propagate redacted, since the LISTEN thread logs them.
        """
        try:
            conn = psycopg.Connection.connect(self._conninfo, autocommit=True,
                                              cursor_factory=ClientCursor, **overrides)
        except psycopg.Error as exc:
            detail_of(exc, self.secrets)
            raise
        self._track(conn)
        return conn

    def bounded(self, conn: psycopg.Connection[Any]) -> ContextManager[Any]:
        """Bound what runs on ``conn`` inside this context by the call timeout, from now."""
        return self._watchdog.watching(conn, time.monotonic() + self.call_timeout)

    def _translate(self, exc: psycopg.Error) -> QueenError:
        if self._overran():
            return self._overrun_error()
        return translate(exc, self.where, self.secrets, self._state.plan.operations)

    def _overran(self) -> bool:
        """The current call's deadline has passed (its connection may have been shut down)."""
        watch = self._state.watch
        return (watch is not None and watch.fired) or time.monotonic() >= self._state.deadline

    def _overrun_error(self, during: str = "") -> EngineUnavailableError:
        size = self._state.plan.operations
        body = f" to a body of {size} operations" if size > 1 else ""
        return EngineUnavailableError(
            f"PostgreSQL at {self.where} did not answer{body} within {self.call_timeout:g}s "
            f"(the call's timeout){during}; the connection was closed")

    def _remaining(self) -> float:
        """Seconds left before the current call's deadline; raises once none are left."""
        remaining = self._state.deadline - time.monotonic()
        if remaining <= 0:
            raise self._overrun_error()
        return remaining

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
                    kwargs={"autocommit": True, "cursor_factory": ClientCursor,
                            "prepare_threshold": None},
                    configure=self._prepare, timeout=self._timeout, name="queen_sync",
                    num_workers=1, open=True)
            return self._pool

    def _migrate(self) -> None:
        """Create or upgrade the schema; several processes may race here, so it is serialised."""
        with self.connect() as conn, self._watchdog.watching(conn, self._state.deadline):
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
        hot = self._take_hot()
        if hot is not None:
            return hot, pool
        try:
            return pool.getconn(timeout=min(_POOL_WAIT, self._remaining())), pool
        except psycopg_pool.PoolTimeout:
            pass  # the pool is busy, or reconnecting with back-off after an outage
        except psycopg.Error as exc:
            raise self._translate(exc) from exc
        hot = self._take_hot()  # set aside by another thread while this one waited
        if hot is not None:
            return hot, pool
        # Connecting here, now, answers at once: a connection, or libpq's reason why not.
        try:
            conn = self.connect(connect_timeout=math.ceil(self._remaining()))
        except psycopg.Error as exc:
            raise self._translate(exc) from exc
        try:
            with self._watchdog.watching(conn, self._state.deadline):
                conn.execute(self.sql.prepare)
        except psycopg.Error as exc:
            conn.close()
            raise self._translate(exc) from exc
        return conn, None

    def _checkin(self, conn: psycopg.Connection[Any], pool: Optional[_Pool],
                 watch: Optional[Watch] = None) -> None:
        """Give a connection back; ``watch`` (its call's deadline) still covers the ROLLBACK."""
        if not _lost(conn) and conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
            try:
                conn.execute("ROLLBACK")
            except psycopg.Error:
                conn.close()
        if watch is not None and self._watchdog.unwatch(watch):
            conn.close()  # its socket was shut down: the pool must replace it
        if pool is None or pool.closed:
            conn.close()
            return
        self._checkins += 1
        if (not _lost(conn) and self._checkins % _HOT_USES
                and not pool.get_stats().get("requests_waiting")):
            # Kept aside for the next call: the pool hands its idle connections out in
            # turn, and a lone caller served by one warm session gets its answers sooner.
            # Every _HOT_USES calls it goes back, so the pool's lifetime policy applies.
            with self._mutex:
                if self._hot is None and self._pool is pool:
                    self._hot = conn
                    return
        pool.putconn(conn)

    def _take_hot(self) -> Optional[psycopg.Connection[Any]]:
        with self._mutex:
            hot, self._hot = self._hot, None
        return hot

    def _return_hot(self) -> None:
        hot, pool = self._take_hot(), self._pool
        if hot is not None and pool is not None:
            pool.putconn(hot)

    # ---- transactions --------------------------------------------------------------------

    def new_call(self, route: str, body: Any) -> None:
        """Plan the coming call's transaction, start its clock, forget the last call's retries."""
        self._state.plan = plan_for(route, body)
        self._state.reconnected = False
        self._state.guarded = False
        self._state.deadline = time.monotonic() + self.call_timeout
        self._state.watch = None

    @contextlib.contextmanager
    def transaction(self) -> Iterator[Txn]:
        self._remaining()  # a call past its deadline starts no new attempt
        conn, pool = self._checkout()
        watch = self._state.watch = self._watchdog.watch(conn, self._state.deadline)
        box: list[Txn] = []
        try:
            cur = conn.cursor()
            with self._body_failures(conn, box):
                box.append(self._guarded(conn) or PgTxn(cur, self.sql, self._state.plan))
                yield box[0]
            self._commit(conn, cur, box[0])
        except BaseException:
            if box:  # what it read may have changed: remember it afresh next time
                self._seen.forget(set(box[0].rows()))
            raise
        finally:
            self._checkin(conn, pool, watch)
        self._seen.remember(box[0].rows())
        if isinstance(box[0], PgTxn):
            self._seen.saw_clock(box[0].clock)
        self._commits += 1
        if self._commits % _SWEEP_EVERY == 0:
            self._sweep()

    def _guarded(self, conn: psycopg.Connection[Any]) -> Optional[GuardedTxn]:
        """A one-trip transaction, for a body of releases on its first attempt.

        Releases are what reads back remembered permits; other bodies need a prefix
        scan, a new version or a key/value row, so they would only stop short.
        """
        state = self._state
        if state.guarded or state.plan.durable or not state.plan.entities:
            return None
        now = self._seen.estimated_now()
        if now is None or _has_input(conn):
            return None
        state.guarded = True
        return GuardedTxn(self.sql, state.plan, self._seen, now)

    @contextlib.contextmanager
    def _body_failures(self, conn: psycopg.Connection[Any], box: list[Txn]) -> Iterator[None]:
        """Errors before COMMIT was sent: nothing committed, so some are worth a new attempt."""
        try:
            yield
        except Exception as exc:
            if box and isinstance(box[0], GuardedTxn):
                # Whatever a body on remembered rows concluded short of its guards (a
                # rollback's answer, an error) is unchecked: the two-trip path decides.
                raise StorageConflict(f"runs again on the two-trip path: {exc!r}") from exc
            if not isinstance(exc, psycopg.Error):
                raise
            raise self._before_commit(conn, box, exc) from exc

    def _before_commit(self, conn: psycopg.Connection[Any], box: list[Txn],
                       exc: psycopg.Error) -> Exception:
        """What a driver error raised before COMMIT becomes: a new attempt, or an error."""
        if self._overran():
            return self._overrun_error()
        if isinstance(exc, _CONFLICTS):
            if box:  # the next attempt locks up front what this one had to lock on the way
                self._state.plan.entities |= box[0].unplanned
            return StorageConflict(str(exc))
        if isinstance(exc, psycopg.OperationalError) and _lost(conn) and (
                not self._state.reconnected):
            # The connection died before COMMIT was sent: run the body once more afresh.
            self._state.reconnected = True
            log.info("PostgreSQL connection to %s lost (%s); retrying once", self.where,
                     type(exc).__name__)
            self._discard_dead()
            return StorageConflict("connection lost before commit")
        return self._translate(exc)

    def _commit(self, conn: psycopg.Connection[Any], cur: psycopg.Cursor[Any], txn: Txn) -> None:
        """Send the pending writes and COMMIT in one script; a lost connection is ambiguous."""
        script = txn.commit_script()
        try:
            cur.execute("; ".join(q for q, _ in script), [p for _, ps in script for p in ps])
        except psycopg.Error as exc:
            if self._overran():
                raise self._overrun_error(
                    " while committing, so whether the call took effect is unknown") from exc
            if _lost(conn):
                raise EngineUnavailableError(
                    f"PostgreSQL at {self.where}: the connection was lost during COMMIT, so "
                    "whether the call took effect is unknown: "
                    f"{detail_of(exc, self.secrets)}") from exc
            # A server error stops the script before its COMMIT: nothing was committed.
            if isinstance(exc, _CONFLICTS):
                self._state.plan.entities |= txn.unplanned
                raise StorageConflict(str(exc)) from exc
            raise self._translate(exc) from exc

    def _discard_dead(self) -> None:
        self._return_hot()
        pool = self._pool
        if pool is not None:
            with contextlib.suppress(psycopg.Error):
                pool.check()

    def _sweep(self) -> None:
        """Delete a batch of expired rows; skips rows someone holds (a fence, a body)."""
        if self._overran():
            return  # the call that triggered it has no time left to lend
        try:
            conn, pool = self._checkout()
        except QueenError as exc:
            log.debug("sweeping expired rows at %s failed: %s", self.where, exc)
            return
        watch = self._watchdog.watch(conn, self._state.deadline)
        try:
            now = _fetch_one(conn.execute(CLOCK))[0]
            conn.execute(self.sql.sweep, (now,))
        except psycopg.Error as exc:
            log.debug("sweeping expired rows at %s failed: %s", self.where,
                      detail_of(exc, self.secrets))
        finally:
            self._checkin(conn, pool, watch)

    def notify_released(self, names: Sequence[str]) -> None:
        """Nothing to do: ``delete`` notified inside the transaction that freed the permit."""

    @contextlib.contextmanager
    def _translated(self) -> Iterator[None]:
        try:
            yield
        except psycopg.Error as exc:
            raise self._translate(exc) from exc

    # ---- lifecycle -----------------------------------------------------------------------

    def after_fork(self) -> None:
        """In a forked child: detach from the parent's sockets, build a new pool when needed."""
        # A parent thread may have held the mutex at the fork: take a fresh one first.
        self._mutex = threading.Lock()
        pool, self._pool = self._pool, None
        self._hot = None  # the parent's session, detached below with the rest
        conns, self.connections = self.connections, []
        detach(conns)
        if pool is not None:
            _ABANDONED.append(pool)
        self._state = _CallState()
        self._seen = SeenRows()
        self._watchdog = Watchdog()  # the parent's thread did not cross the fork

    def close(self) -> None:
        self._watchdog.close()
        self._return_hot()
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
