"""The sessions of one PostgreSQL client: a pool shared by its threads, one warm session aside.

The schema is made ready before the pool opens its first connection, and every
pooled connection PREPAREs the body statements once. Driver errors leave this
module as they are: the storage translates them, knowing which call they ended.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import threading
import time
import weakref
from secrets import randbits
from typing import Any, ContextManager, Optional, Protocol, Sequence

import psycopg
import psycopg_pool
from psycopg import ClientCursor

from ..._errors import EngineError
from .deadline import Watch, Watchdog, connect_within
from .errors import detail_of
from .pipeline import prepare_each
from .sql import SCHEMA_VERSION, SESSION_ISOLATION, SESSION_PLANNER, Statements

log = logging.getLogger("queen_sync")

_POOL_WAIT = 0.25
_HOT_USES = 1000
PgPool = psycopg_pool.ConnectionPool[psycopg.Connection[Any]]


class Budget(Protocol):
    """The time one call has: its deadline, and what is left of it (raising once none is)."""

    deadline: float

    def remaining(self) -> float: ...


class _Retired(logging.Filter):
    """Keeps psycopg_pool quiet about the connections this engine closed on purpose.

    A connection shut at its call's deadline must still go back through ``putconn``,
    the pool's one way to count it out and replace it, and the pool warns about every
    closed one it gets back; for ours that warning reports a deadline doing its job.
    """

    def __init__(self) -> None:
        super().__init__()
        self.conns: weakref.WeakSet[psycopg.Connection[Any]] = weakref.WeakSet()

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        return not (isinstance(args, tuple) and args and args[0] in self.conns)


_RETIRED = _Retired()
logging.getLogger("psycopg.pool").addFilter(_RETIRED)


def give_back(pool: PgPool, conn: psycopg.Connection[Any]) -> None:
    """Return a connection to its pool, which replaces it if it is lost (quietly: see above)."""
    if lost(conn):
        _RETIRED.conns.add(conn)
    pool.putconn(conn)


def lost(conn: psycopg.Connection[Any]) -> bool:
    """The connection is gone (closed, or its socket broke): no statement can run on it."""
    return conn.closed or conn.pgconn.status == psycopg.pq.ConnStatus.BAD


class Sessions:
    """Connections to one database for one client, shared by every thread of it.

    Args:
        conninfo: a libpq connection string (it may hold a password: never logged).
        sql: the statements of the client's schema.
        where: the store's address without secrets, for messages.
        timeout: seconds to wait for a pooled connection.
        sizes: the pool's minimum and maximum size.
        secrets: texts never to show in an error or a log line (the password).
    """

    def __init__(self, conninfo: str, sql: Statements, *, where: str, timeout: float,
                 sizes: tuple[int, int], secrets: frozenset[str]) -> None:
        self.sql = sql
        self.where = where
        self.secrets = secrets
        self.watchdog = Watchdog()
        self._conninfo = conninfo
        self._timeout = timeout
        self._sizes = sizes
        self._pool: Optional[PgPool] = None
        self._hot: Optional[psycopg.Connection[Any]] = None
        self.store_id: Optional[str] = None  # read by the first migration check
        self._checkins = 0
        self._mutex = threading.Lock()
        self._closed = False
        self.connections: list[psycopg.Connection[Any]] = []

    def connect(self, deadline: Optional[float] = None,
                **overrides: Any) -> psycopg.Connection[Any]:
        """A new connection outside the pool (migrations, LISTEN); driver errors propagate.

        They propagate redacted, since the LISTEN thread logs them. With a ``deadline``
        the handshake is given up on then, however long libpq would wait.
        """
        if deadline is not None:
            return connect_within(lambda: self.connect(**overrides), deadline)
        try:
            conn = psycopg.Connection.connect(self._conninfo, autocommit=True,
                                              cursor_factory=ClientCursor, **overrides)
        except psycopg.Error as exc:
            detail_of(exc, self.secrets)
            raise
        self._track(conn)
        return conn

    def bounded(self, conn: psycopg.Connection[Any], seconds: float) -> ContextManager[Watch]:
        """Bound what runs on ``conn`` inside this context by ``seconds`` from now."""
        return self.watchdog.watching(conn, time.monotonic() + seconds)

    def _prepare(self, conn: psycopg.Connection[Any]) -> None:
        """Make a connection ready for bodies: remembered, with the statements prepared."""
        self._track(conn)
        self._prepare_statements(conn)

    def _prepare_statements(self, conn: psycopg.Connection[Any]) -> None:
        """The statements PREPAREd and the session's settings made, in one round trip."""
        settings = [*SESSION_PLANNER.split("; "), SESSION_ISOLATION]  # one statement each
        prepare_each(conn, [*self.sql.prepares, *settings])

    def _track(self, conn: psycopg.Connection[Any]) -> None:
        # Remembered so a forked child can detach from them without closing the parent's.
        with self._mutex:
            self.connections = [c for c in self.connections if not c.closed]
            self.connections.append(conn)

    def _open_pool(self, deadline: float) -> PgPool:
        with self._mutex:
            pool = self._pool
        if pool is not None:
            return pool
        if self._closed:  # before the migration: a closed client makes nothing
            raise EngineError(f"PostgreSQL engine at {self.where} is closed")
        self._migrate(deadline)
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

    def ensure_open(self, deadline: float) -> None:
        """The schema made or upgraded and the pool opened, as a first call does."""
        self._open_pool(deadline)

    def _migrate(self, deadline: float) -> None:
        """Create or upgrade the schema; several processes may race here, so it is serialised."""
        with self.connect(deadline) as conn, self.watchdog.watching(conn, deadline):
            conn.execute(SESSION_ISOLATION)  # the DDL's upsert must see a racing migration's row
            current = False
            with contextlib.suppress(psycopg.errors.UndefinedTable), conn.transaction():
                record = conn.execute(self.sql.schema_version).fetchone()
                current = record is not None and record[0] >= SCHEMA_VERSION
            if not current:
                with conn.transaction():
                    conn.execute(self.sql.migration_lock, (self.sql.lock_class,))
                    conn.execute(self.sql.ddl)
                log.info("queen_sync schema %r ready in PostgreSQL at %s", self.sql.schema,
                         self.where)
            self.store_id = self._identify(conn)

    def _identify(self, conn: psycopg.Connection[Any]) -> str:
        """The store's identity: the server's, the database's and the schema's numbers (the
        last drawn by the first client that finds none).

        A role that may not read the server's number names the server by this client's
        address instead: a copy restored on another server may have the same database
        number (``postgres`` is 5 on every cluster), and telling them apart matters more
        than taking every spelling of one URL for one store.
        """
        record = conn.execute(self.sql.store_id).fetchone()
        if record is None:
            # A racing client may draw another: the row that lands first is everyone's.
            conn.execute(self.sql.new_store_id, (randbits(62) + 1,))
            record = conn.execute(self.sql.store_id).fetchone()
        if record is None:  # only a concurrent DELETE of the row could do this
            raise EngineError(f"the queen_sync schema at {self.where} has no store number")
        try:
            server = conn.execute(self.sql.server_id).fetchone()
        except psycopg.errors.InsufficientPrivilege:
            server = None
        return f"{server[0] if server else self.where}:{record[1]}:{record[0]}"

    def checkout(self, budget: Budget) -> tuple[psycopg.Connection[Any], Optional[PgPool]]:
        """A connection, and the pool it came from (None: opened for this call alone)."""
        pool = self._open_pool(budget.deadline)
        hot = self._take_hot()
        if hot is not None:
            return hot, pool
        with contextlib.suppress(psycopg_pool.PoolTimeout):
            # A timeout: the pool is busy, or reconnecting with back-off after an outage.
            return pool.getconn(timeout=min(_POOL_WAIT, budget.remaining())), pool
        hot = self._take_hot()  # set aside by another thread while this one waited
        if hot is not None:
            return hot, pool
        # Connecting here, now, answers at once: a connection, or libpq's reason why not.
        conn = self.connect(budget.deadline, connect_timeout=math.ceil(budget.remaining()))
        try:
            with self.watchdog.watching(conn, budget.deadline):
                self._prepare_statements(conn)
        except psycopg.Error:
            conn.close()
            raise
        return conn, None

    def checkin(self, conn: psycopg.Connection[Any], pool: Optional[PgPool],
                watch: Optional[Watch] = None) -> None:
        """Give a connection back; ``watch`` (its call's deadline) still covers the ROLLBACK."""
        # Read off libpq: ``conn.info`` builds an object on every call, twice a lock call.
        if not lost(conn) and conn.pgconn.transaction_status != psycopg.pq.TransactionStatus.IDLE:
            try:
                conn.execute("ROLLBACK")
            except psycopg.Error:
                conn.close()
        if watch is not None and self.watchdog.unwatch(watch):
            conn.close()  # its socket was shut down: the pool must replace it
        if pool is None or pool.closed:
            conn.close()
            return
        self._checkins += 1
        if (not lost(conn) and self._checkins % _HOT_USES
                and not pool.get_stats().get("requests_waiting")):
            # Kept aside for the next call: the pool hands its idle connections out in
            # turn, and a lone caller served by one warm session gets its answers sooner.
            # Every _HOT_USES calls it goes back, so the pool's lifetime policy applies.
            with self._mutex:
                if self._hot is None and self._pool is pool:
                    self._hot = conn
                    return
        give_back(pool, conn)

    def _take_hot(self) -> Optional[psycopg.Connection[Any]]:
        with self._mutex:
            hot, self._hot = self._hot, None
        return hot

    def _return_hot(self) -> None:
        hot, pool = self._take_hot(), self._pool
        if hot is not None and pool is not None:
            give_back(pool, hot)

    @property
    def has_hot(self) -> bool:
        """A warm session is set aside for the next call."""
        return self._hot is not None

    def discard_dead(self) -> None:
        """After a lost connection: drop the warm one, and have the pool check the others."""
        self._return_hot()
        pool = self._pool
        if pool is not None:
            with contextlib.suppress(psycopg.Error):
                pool.check()

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
        self.watchdog = Watchdog()  # the parent's thread did not cross the fork

    def close(self) -> None:
        self.watchdog.close()
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
