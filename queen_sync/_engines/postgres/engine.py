"""The PostgreSQL engine: one database shared by many machines, no broker.

```python
import queen_sync as qs

with qs.Queen("postgresql://app@db.internal/app") as q:
    with q.lock("nightly-etl", ttl="5m") as lock, psycopg.connect(DSN) as conn:
        with conn.transaction():
            lock.fence(conn)        # the write below commits only while this lease is held
            conn.execute("UPDATE report SET ...")
```

The lock and key/value semantics are the embedded engines' (``embedded``),
run over ``PostgresStorage``: rows in a schema of their own (``queen_sync`` by
default, ``?schema=name`` to choose), tokens from a sequence, expiry by the
database clock. A release wakes waiters on any machine through LISTEN/NOTIFY.
It needs PostgreSQL 11 or later, a user that may create the schema (or a schema
created beforehand by one that may), and a session of its own per connection:
connect directly or through a session-mode pooler, since it PREPAREs statements
and LISTENs.

URL options besides libpq's own: ``schema``, ``timeout`` (seconds per call and
to connect), ``pool_min_size``, ``pool_max_size``. Everything else in the URL
(hosts, ``sslmode``, ``target_session_attrs``, ...) goes to libpq unchanged.
"""

from __future__ import annotations

import contextlib
import logging
import re
import threading
import time
from typing import Any, Iterator, Mapping, Optional

from ..._errors import LockLostError, QueenError, RequestError
from ..._ops import LOCKS_NS, permit_key
from ..base import Capabilities, Engine, Waiter, parse_timeout
from ..embedded import CheckedLockOps, EmbeddedSemantics, checked_lock_ops

try:
    import psycopg
    from psycopg.pq import TransactionStatus
except ImportError as exc:  # pragma: no cover - depends on the installed extras
    raise ImportError(
        "the PostgreSQL engine needs psycopg 3 and psycopg_pool: "
        "pip install 'queen-sync[postgres]'") from exc

from .errors import secrets_of, translate
from .listen import Listener
from .renew_ahead import renew_ahead
from .storage import PartsOfOneBody, PostgresStorage
from .url import DEFAULT_SCHEMA, build_conninfo, engine_url, split_url
from .waiting_room import WaiterInLine, WaitingRoom

log = logging.getLogger("queen_sync")

DEFAULT_TIMEOUT = (10.0, 10.0)  # seconds to connect, and per call
_SCHEMA_NAME = re.compile(r"[a-z_][a-z0-9_]{0,62}")
_LISTEN_READY_WAIT = 2.0
# Lock operations per transaction: far below the lock table of any server (64 entries per
# connection by default), yet enough that a renewal pass costs few round trips.
LOCKS_PER_TRANSACTION = 256


def _url_options(query: dict[str, str]) -> dict[str, Any]:
    """This engine's options written in a URL's query, as the types they stand for."""
    conversions = {"schema": str, "timeout": float, "pool_min_size": int, "pool_max_size": int}
    options: dict[str, Any] = {}
    for key, value in query.items():
        try:
            options[key] = conversions[key](value)
            if key == "timeout":
                parse_timeout(options[key], DEFAULT_TIMEOUT)  # refused here as the URL's
        except ValueError as exc:
            raise RequestError(f"bad {key}={value!r} in the URL", code="bad_url") from exc
    return options


def _applied(before: int, total: int, exc: QueenError) -> str:
    """What of a big body was applied, for the error that stopped it at one of its parts.

    A part answered by a statement that commits as it runs may fail after its commit;
    such an error says how many of its writes committed (``committed``).
    """
    committed = getattr(exc, "committed", None)
    if isinstance(committed, int):
        return (f"{before + committed} of {total} operations were applied ({committed} by "
                "the part that failed, which committed as it ran); the rest were not")
    return (f"{before} of {total} operations were applied before it (the rest were not, "
            "unless the error says the outcome is unknown)")


class PostgresEngine(Engine):
    """The wire's lock and KV semantics on a PostgreSQL database, shared by many machines.

    Args:
        url: ``postgresql://user[:password]@host[:port][,host2...]/db[?options]``.
        schema: the schema to keep rows in (created on first use).
        timeout: seconds per call and to connect, or a ``(connect, call)`` pair.

    Options left out (None) come from the URL's query (``?schema=``, ...), else defaults.
        pool_min_size: connections kept open (shared by the caller and the renewer).
        pool_max_size: connections the pool may open.
    """

    kind = "postgres"
    capabilities = Capabilities(multi_host=True, wake_on_release=True, user_table_fencing=True)
    OPTIONS = frozenset({"timeout", "schema", "pool_min_size", "pool_max_size"})

    def __init__(self, url: str, *, schema: Optional[str] = None, timeout: Any = None,
                 pool_min_size: Optional[int] = None,
                 pool_max_size: Optional[int] = None) -> None:
        libpq_url, query = split_url(url)
        # The URL's own options apply whichever way the engine is made; explicit ones win.
        given = {"schema": schema, "timeout": timeout, "pool_min_size": pool_min_size,
                 "pool_max_size": pool_max_size}
        chosen = {**_url_options(query), **{k: v for k, v in given.items() if v is not None}}
        schema = chosen.get("schema", DEFAULT_SCHEMA)
        min_size, max_size = chosen.get("pool_min_size", 1), chosen.get("pool_max_size", 8)
        if not isinstance(schema, str) or not _SCHEMA_NAME.fullmatch(schema):
            raise RequestError(
                f"schema must be 1..63 lowercase letters, digits or '_', not starting with a "
                f"digit; got {schema!r}", code="bad_url")
        if not 0 <= min_size <= max_size or max_size < 1:
            raise ValueError("need 0 <= pool_min_size <= pool_max_size and pool_max_size >= 1")
        connect_timeout, call_timeout = parse_timeout(chosen.get("timeout"), DEFAULT_TIMEOUT)
        self._connect_timeout = connect_timeout
        self._url = engine_url(libpq_url, schema)
        self._secrets = secrets_of(url)
        conninfo = build_conninfo(libpq_url, connect_timeout, call_timeout, self._url,
                                  self._secrets)
        self.storage = PostgresStorage(conninfo, where=self._url, schema=schema,
                                       timeout=connect_timeout + call_timeout,
                                       min_size=min_size, max_size=max_size,
                                       secrets=self._secrets, call_timeout=call_timeout)
        self._semantics = EmbeddedSemantics(self.storage)
        self._listener: Optional[Listener] = None
        sessions = self.storage.sessions
        self._room = WaitingRoom(lambda deadline: sessions.connect(deadline), schema)
        self._mutex = threading.Lock()

    @classmethod
    def from_url(cls, url: str, **options: Any) -> PostgresEngine:
        """The engine for a URL; explicit options win over the URL's query options."""
        return cls(url, **options)

    @property
    def url(self) -> str:
        return self._url

    @property
    def store(self) -> str:
        # The schema's own number, read when the engine first connects: one store under any
        # spelling of its URL (host name, option order), another for every other schema.
        sessions = self.storage.sessions
        if sessions.store_id is None:
            try:
                sessions.ensure_open(time.monotonic() + self._connect_timeout)
            except psycopg.Error as exc:
                raise translate(exc, self._url, self._secrets) from exc
        return f"postgresql-store:{sessions.store_id}"

    def call(self, route: str, body: Mapping[str, Any]) -> dict[str, Any]:
        ops = body.get("operations") if route == "locks" and isinstance(body, Mapping) else None
        if isinstance(ops, list) and len(ops) > LOCKS_PER_TRANSACTION:
            return self._call_in_chunks(ops)
        return self._call_once(route, body)

    def _call_once(self, route: str, body: Mapping[str, Any],
                   semantics: Optional[EmbeddedSemantics] = None) -> dict[str, Any]:
        try:
            return (semantics or self._semantics).call(route, body)
        except psycopg.Error as exc:  # the storage translates; this catches any it missed
            raise translate(exc, self._url, self._secrets) from exc

    def _call_in_chunks(self, ops: list[Any]) -> dict[str, Any]:
        """A big locks body as several transactions of a bounded size, within one deadline.

        One transaction per body would take a lock-table entry per name and outgrow the
        server's lock table. A locks body's ops are independent on the wire, so each chunk
        may commit on its own; every op is checked first, so a bad one commits nothing.
        Should a chunk fail, those before it stay applied (for a tick's renews, sent as one
        pipeline, those after it too), and resending the body by the same owner answers the
        same permits (a resent acquire or renew is safe).
        """
        checked = checked_lock_ops(ops)
        results: list[Any] = []
        parts = EmbeddedSemantics(PartsOfOneBody(self.storage, len(ops)))
        chunks = [checked.part(start, start + LOCKS_PER_TRANSACTION)
                  for start in range(0, len(ops), LOCKS_PER_TRANSACTION)]
        # A tick's renews go as one pipeline; what it left unanswered runs below, one by one.
        answered = renew_ahead(self.storage, chunks,
                               (time.monotonic() + self.storage.call_timeout, len(ops)))
        for index, chunk in enumerate(chunks):
            try:
                done = answered[index]
                results += self._locks_part(chunk, parts) if done is None else done
            except QueenError as exc:
                later = sum(len(done) for done in answered[index + 1:] if done is not None)
                exc.args = (f"{exc}; {_applied(len(results) + later, len(ops), exc)}; resending "
                            "the body as the same owner is safe",)
                raise
        return {"results": results}

    def _locks_part(self, chunk: CheckedLockOps, parts: EmbeddedSemantics) -> list[Any]:
        try:
            results: list[Any] = parts.locks(chunk)["results"]
            return results
        except psycopg.Error as exc:  # the storage translates; this catches any it missed
            raise translate(exc, self._url, self._secrets) from exc

    @contextlib.contextmanager
    def subscribe(self, name: str) -> Iterator[Waiter]:
        """A waiter woken by LISTEN/NOTIFY when a permit of ``name`` is released, once it
        is at the front of the name's line across processes (``waiting_room``)."""
        listener = self._listening()
        with listener.subscribe(name) as waiter, self._room.line(name) as place:
            yield WaiterInLine(waiter, place)

    def _listening(self) -> Listener:
        with self._mutex:
            if self._listener is None:
                self._listener = Listener(self.storage.connect, self.storage.sql.channel,
                                          self.storage.bounded)
            listener = self._listener
        if not listener.ready(min(_LISTEN_READY_WAIT, self.storage.call_timeout)):
            log.debug("LISTEN at %s is not ready; waiters fall back to polling", self._url)
        return listener

    def fence(self, conn: Any, *, name: str, slot: int, token: int) -> None:
        """Inside ``conn``'s open transaction, hold this permit at ``token`` until it commits.

        The permit row is checked live by the database clock at exactly ``token`` and
        locked ``FOR KEY SHARE``: a new holder cannot take the slot, nor the holder release
        it, before this transaction ends, while the holder's own renewals go on. So keep
        fenced transactions short, give ``conn`` an ``idle_in_transaction_session_timeout``
        (a stalled fenced transaction holds everybody else off the lock until it ends), and
        release the lock after the transaction ends, not inside it.

        Args:
            conn: a psycopg 3 connection to the same database, inside a transaction.
            name: the lock name.
            slot: the permit's slot.
            token: the token the caller holds.

        Raises:
            LockLostError: the permit is gone, expired, or at another token (reason ``guard``).
            RequestError: ``conn`` is in autocommit mode outside a transaction block.
        """
        info = getattr(conn, "info", None)
        if getattr(conn, "autocommit", False) and info is not None and (
                info.transaction_status == TransactionStatus.IDLE):
            raise RequestError("lock.fence(conn) needs an open transaction on conn "
                               "(use `with conn.transaction():`)", code="fence_needs_transaction")
        try:
            with conn.cursor() as cur:
                cur.execute(self.storage.sql.fence, (LOCKS_NS, permit_key(name, slot), token))
                live = cur.fetchone() is not None
        except psycopg.Error as exc:
            raise translate(exc, self._url, self._secrets) from exc
        if not live:
            raise LockLostError(
                f"lock {name!r} (slot {slot}) is no longer held at token {token}: the write "
                "was fenced out", name=name, reason="guard", token=token)

    def after_fork(self) -> None:
        # A parent thread may have held the mutex at the fork: the child takes a fresh one.
        self._mutex = threading.Lock()
        listener, self._listener = self._listener, None
        if listener is not None:
            listener.abandon()
        self._room.after_fork()
        self.storage.after_fork()

    def close(self) -> None:
        with self._mutex:
            listener, self._listener = self._listener, None
        if listener is not None:
            listener.close()
        self._room.close()
        self.storage.close()

