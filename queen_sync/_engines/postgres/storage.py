"""PostgreSQL storage for the embedded semantics: one schema, one transaction per body.

A body is one transaction: in two round trips (see ``txn``), or in one when it
only reads permits the client remembers and deletes (see ``one_trip``), or is one
acquire, renew or get that a single statement answers (see ``scripted``), or
renews only, one statement per transaction (see ``renew_batch``). What to
lock and prefetch comes from the body's ``Footprint``, which the semantics hand
over. A connection lost before COMMIT was sent means nothing committed, so the
body runs once more on a fresh connection; one lost during COMMIT leaves the
outcome unknown, and says so. Driver errors leave this module as queen_sync errors.
"""

from __future__ import annotations

import contextlib
import logging
import select
import time
from typing import Any, Callable, ContextManager, Iterator, Optional, TypeVar, Union

import psycopg

from ..._errors import EngineError, EngineUnavailableError, QueenError
from ..storage import Footprint, StorageTxn
from . import pipeline
from .deadline import Watch
from .errors import CAUGHT_DRIVER_ERRORS as CAUGHT_DRIVER_ERRORS
from .errors import detail_of, translate
from .one_trip import GuardedTxn, SeenRows
from .pool import PgPool, Sessions, lost
from .renew_batch import RenewedTxn, batch_of_renews
from .scripted import NotScripted, ScriptedTxn, scriptable
from .sql import Statements
from .txn import PgTxn, entities_of, entity_key, entity_of

log = logging.getLogger("queen_sync")

T = TypeVar("T")
_SWEEP_EVERY = 1000
_CONFLICT_RETRIES = 5

# Lost races that running the body again resolves.
_CONFLICTS = (psycopg.errors.UniqueViolation, psycopg.errors.DeadlockDetected,
              psycopg.errors.SerializationFailure, psycopg.errors.DivisionByZero)
Txn = Union[PgTxn, GuardedTxn, ScriptedTxn, RenewedTxn]


class Conflict(Exception):
    """An attempt lost a race it cannot wait out, before COMMIT: the body runs again."""


class Call:
    """One body's attempts: its deadline, what it may still try, what it learned on the way.

    Args:
        footprint: what the body touches, as the semantics read it off its operations.
        where: the store's address without secrets, for messages.
        timeout: seconds the whole call may take, every attempt included.
        whole: the deadline and size of the caller's body, when this is one part of it.
    """

    def __init__(self, footprint: Footprint, where: str, timeout: float,
                 whole: Optional[tuple[float, int]] = None) -> None:
        self.footprint = footprint
        self.entities = entities_of(footprint)  # grows by what an attempt had to lock late
        self.where = where
        self.timeout = timeout
        self.deadline = whole[0] if whole else time.monotonic() + timeout
        self.operations = whole[1] if whole else footprint.operations  # as the caller sent
        self.reconnected = False
        self.guarded = False  # one attempt at most runs as a GuardedTxn
        self.scripted = False  # and one as a ScriptedTxn
        self.in_script = False  # a writing ScriptedTxn's statement (it commits as it runs) is out
        self.watch: Optional[Watch] = None  # the connection the current attempt runs on

    def overran(self) -> bool:
        """The deadline has passed (the attempt's connection may have been shut down)."""
        return (self.watch is not None and self.watch.fired) or time.monotonic() >= self.deadline

    def overrun_error(self, during: str = "") -> EngineUnavailableError:
        size = self.operations
        body = f" to a body of {size} operations" if size > 1 else ""
        return EngineUnavailableError(
            f"PostgreSQL at {self.where} did not answer{body} within {self.timeout:g}s "
            f"(the call's timeout){during}; the connection was closed")

    def remaining(self) -> float:
        """Seconds left before the deadline; raises once none are left."""
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            raise self.overrun_error()
        return remaining


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


class PartsOfOneBody:
    """``Storage`` for the parts of one caller's body: one deadline, the caller's size.

    So a body run as several transactions is bounded by one timeout, and an error in
    any part names the body the caller sent, not the part.
    """

    def __init__(self, storage: PostgresStorage, operations: int) -> None:
        self._storage = storage
        self._whole = (time.monotonic() + storage.call_timeout, operations)

    def transaction(self, footprint: Footprint, work: Callable[[StorageTxn], T]) -> T:
        return self._storage.transaction(footprint, work, self._whole)

    def close(self) -> None:
        """Nothing of its own to release: the storage it runs on is the client's."""


class PostgresStorage:
    """``Storage`` over one PostgreSQL schema, through sessions shared by every thread of a client.

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
        self.where = where
        self.secrets = secrets
        self.sessions = Sessions(conninfo, self.sql, where=where, timeout=timeout,
                                 sizes=(min_size, max_size), secrets=secrets)
        self._seen = SeenRows()
        self._commits = 0

    def connect(self, **overrides: Any) -> psycopg.Connection[Any]:
        """A new connection outside the pool (LISTEN); driver errors propagate, redacted."""
        return self.sessions.connect(**overrides)

    @property
    def connections(self) -> list[psycopg.Connection[Any]]:
        """Every connection this client opened and has not seen closed (pooled or not)."""
        return self.sessions.connections

    def bounded(self, conn: psycopg.Connection[Any]) -> ContextManager[Any]:
        """Bound what runs on ``conn`` inside this context by the call timeout, from now."""
        return self.sessions.bounded(conn, self.call_timeout)

    def remember(self, txn: RenewedTxn) -> None:
        """Keep what a renewal committed outside ``transaction()`` (``renew_ahead``) left
        behind, and the clock it saw, as ``transaction()`` keeps its own."""
        self._seen.remember(txn.rows())
        self._seen.saw_clock(txn.clock)

    def _translate(self, call: Call, exc: psycopg.Error) -> QueenError:
        if call.overran():
            return call.overrun_error()
        return translate(exc, self.where, self.secrets, call.operations)

    def _checkout(self, call: Call) -> tuple[psycopg.Connection[Any], Optional[PgPool]]:
        try:
            return self.sessions.checkout(call)
        except psycopg.Error as exc:
            raise self._translate(call, exc) from exc

    # ---- transactions --------------------------------------------------------------------

    def transaction(self, footprint: Footprint, work: Callable[[StorageTxn], T],
                    whole: Optional[tuple[float, int]] = None) -> T:
        """Run ``work`` in one transaction, again on a lost race, all within the call timeout.

        ``whole``: the deadline and size of the caller's body when this is one part of it.
        """
        call = Call(footprint, self.where, self.call_timeout, whole)
        for _attempt in range(_CONFLICT_RETRIES):
            try:
                return self._attempt(call, work)
            except Conflict:
                continue
        raise EngineUnavailableError("the store stayed contended; try again")

    def _attempt(self, call: Call, work: Callable[[StorageTxn], T]) -> T:
        call.remaining()  # a call past its deadline starts no new attempt
        conn, pool = self._checkout(call)
        watch = call.watch = self.sessions.watchdog.watch(conn, call.deadline)
        box: list[Txn] = []
        try:
            cur = conn.cursor()
            with self._body_failures(call, conn, box):
                box.append(self._guarded(call, conn) or self._scripted(call, conn, cur)
                           or self._renewed(call, conn, cur)
                           or PgTxn(cur, self.sql, call.entities, call.footprint))
                answer = work(box[0])
            self._commit(call, conn, cur, box[0])
        except BaseException:
            if box:  # what it read may have changed: remember it afresh next time
                self._seen.forget(set(box[0].rows()))
            raise
        finally:
            self.sessions.checkin(conn, pool, watch)
        self._seen.remember(box[0].rows())
        if isinstance(box[0], (PgTxn, ScriptedTxn, RenewedTxn)):
            self._seen.saw_clock(box[0].clock)
        self._commits += 1
        if self._commits % _SWEEP_EVERY == 0:
            self._sweep(call)
        return answer

    def _guarded(self, call: Call, conn: psycopg.Connection[Any]) -> Optional[GuardedTxn]:
        """A one-trip transaction, for a body of releases on its first attempt.

        Releases are what reads back remembered permits; other bodies need a prefix
        scan, a new version or a key/value row, so they would only stop short.
        """
        if call.guarded or not call.footprint.only_releases:
            return None
        now = self._seen.estimated_now()
        if now is None or _has_input(conn):
            return None
        call.guarded = True
        return GuardedTxn(self.sql, call.entities, self._seen, now)

    def _scripted(self, call: Call, conn: psycopg.Connection[Any],
                  cur: psycopg.Cursor[Any]) -> Optional[ScriptedTxn]:
        """A one-statement transaction, for a lone acquire, renew or get on its first attempt."""
        if call.scripted or not scriptable(call.footprint.lone_lock_op) or _has_input(conn):
            return None
        op = call.footprint.lone_lock_op
        assert op is not None  # scriptable() said so
        call.scripted, call.in_script = True, op["op"] != "get"  # a get writes nothing
        txn = ScriptedTxn(cur, self.sql, op)
        call.in_script = False
        return txn

    def _renewed(self, call: Call, conn: psycopg.Connection[Any],
                 cur: psycopg.Cursor[Any]) -> Optional[RenewedTxn]:
        """A one-statement transaction, for a body of renews on its first attempt."""
        if call.scripted or not batch_of_renews(call.footprint.lock_ops) or _has_input(conn):
            return None
        call.scripted, call.in_script = True, True
        txn = RenewedTxn(cur, self.sql, call.footprint.lock_ops)
        call.in_script = False
        return txn

    @contextlib.contextmanager
    def _body_failures(self, call: Call, conn: psycopg.Connection[Any],
                       box: list[Txn]) -> Iterator[None]:
        """Errors before COMMIT was sent: nothing committed, so some are worth a new attempt."""
        try:
            yield
        except Exception as exc:
            if box and isinstance(box[0], GuardedTxn):
                # Whatever a body on remembered rows concluded short of its guards (a
                # rollback's answer, an error) is unchecked: the two-trip path decides.
                raise Conflict(f"runs again on the two-trip path: {exc!r}") from exc
            if isinstance(exc, NotScripted):
                raise Conflict(f"runs again on the two-trip path: {exc}") from exc
            made = box[0] if box and isinstance(box[0], (ScriptedTxn, RenewedTxn)) else None
            if made is not None and made.wrote and not isinstance(
                    exc, (EngineError, psycopg.Error)):
                raise made.disagree(f"raised {exc!r}") from exc
            if not isinstance(exc, psycopg.Error):
                raise
            raise self._before_commit(call, conn, box, exc) from exc

    def _before_commit(self, call: Call, conn: psycopg.Connection[Any], box: list[Txn],
                       exc: psycopg.Error) -> Exception:
        """What a driver error raised before COMMIT becomes: a new attempt, or an error."""
        if call.overran():
            # Resending an owned acquire is safe, but a deadline leaves no time to.
            return call.overrun_error(" while its one-statement transaction ran, so whether "
                                      "the call took effect is unknown" if call.in_script else "")
        if isinstance(exc, _CONFLICTS):
            if box:  # the next attempt locks up front what this one had to lock on the way
                call.entities |= box[0].unplanned
            return Conflict(str(exc))
        if isinstance(exc, psycopg.OperationalError) and lost(conn) and not call.reconnected:
            # The connection died before COMMIT was sent: run the body once more afresh.
            call.reconnected = True
            log.info("PostgreSQL connection to %s lost (%s); retrying once", self.where,
                     type(exc).__name__)
            self.sessions.discard_dead()
            return Conflict("connection lost before commit")
        return self._translate(call, exc)

    def _commit(self, call: Call, conn: psycopg.Connection[Any], cur: psycopg.Cursor[Any],
                txn: Txn) -> None:
        """Send the pending writes and COMMIT in one script; a lost connection is ambiguous."""
        script = txn.commit_script()
        if not script:
            return  # it committed as it ran
        try:
            pipeline.send(cur, script)  # prepared statements only: one pipeline; else text
        except psycopg.Error as exc:
            if call.overran():
                raise call.overrun_error(
                    " while committing, so whether the call took effect is unknown") from exc
            if lost(conn):
                raise EngineUnavailableError(
                    f"PostgreSQL at {self.where}: the connection was lost during COMMIT, so "
                    "whether the call took effect is unknown: "
                    f"{detail_of(exc, self.secrets)}") from exc
            # A server error stops the script before its COMMIT: nothing was committed.
            if isinstance(exc, _CONFLICTS):
                call.entities |= txn.unplanned
                raise Conflict(str(exc)) from exc
            raise self._translate(call, exc) from exc

    def _sweep(self, call: Call) -> None:
        """Delete a batch of expired rows; skips rows someone holds (a fence, a body)."""
        if call.overran():
            return  # the call that triggered it has no time left to lend
        try:
            conn, pool = self._checkout(call)
        except QueenError as exc:
            log.debug("sweeping expired rows at %s failed: %s", self.where, exc)
            return
        watch = self.sessions.watchdog.watch(conn, call.deadline)
        try:
            records = conn.execute(self.sql.expired).fetchall()
            expired = [(ns, key) for _, ns, key in records if key is not None]
            if expired:
                keys = [entity_key(entity_of(ns, key)) for ns, key in expired]
                conn.execute(*self.sql.sweep_of(records[0][0], expired, keys))
        except psycopg.Error as exc:
            log.debug("sweeping expired rows at %s failed: %s", self.where,
                      detail_of(exc, self.secrets))
        finally:
            self.sessions.checkin(conn, pool, watch)

    # ---- lifecycle -----------------------------------------------------------------------

    def after_fork(self) -> None:
        """In a forked child: detach from the parent's sockets, forget the parent's rows."""
        self.sessions.after_fork()
        self._seen = SeenRows()

    def close(self) -> None:
        self.sessions.close()
