"""A renewer's tick of thousands of leases: each transaction sent before the last is checked.

A body of renews too big for one transaction (the engine's ``LOCKS_PER_TRANSACTION``)
runs as one transaction per chunk, each answered by one statement (``renew_batch``).
Sent one after the other, the server idles while the semantics check a chunk's rows,
and the semantics idle while the server runs the next chunk; with two cores each can
run while the other does. So the chunks travel on one connection in pipeline mode, each
its own implicit transaction ending in a Sync (its names' advisory locks, then the
prepared ``renew_many``, parameters as text), and the next chunk goes out before the
semantics check the one that came back. A chunk is answered exactly as a lone body of
renews is: ``RenewedTxn`` over the rows its statement returned, checked by the semantics.

A chunk that failed on the server committed nothing (its Sync rolled it back), and the
chunks after it still run, being transactions of their own. A chunk whose answer the
semantics could not reach from its rows wrote nothing. Either is left unanswered here,
and the engine runs it again on the ordinary path once the pipeline is done, so an
error there is raised with exact counts of what the others applied. A connection lost
mid-way leaves the chunks in flight unknown: they, and the chunks not yet sent, are
left to the ordinary path too, where a renew resent by its owner is safe (the token it
presented still renews). The watchdog that shuts a late call's socket ends the waits here.
"""

from __future__ import annotations

import logging
import select
import time
from collections import deque
from typing import Any, Callable, Mapping, Optional, Sequence, TypeVar

import psycopg
from psycopg import pq
from psycopg.adapt import Transformer
from psycopg.errors import error_from_result
from psycopg.pq.abc import PGresult

from ..._errors import EngineError, EngineUnavailableError, QueenError
from ..embedded import CheckedLockOps, EmbeddedSemantics, lock_footprint
from ..storage import Footprint, StorageTxn
from .errors import detail_of
from .renew_batch import RenewedTxn, renewal_parameters, renews_of_own_names, slot_keys
from .scripted import NotScripted
from .storage import Call, PostgresStorage
from .txn import entity_key

log = logging.getLogger("queen_sync")

T = TypeVar("T")
Answers = list[Optional[list[dict[str, Any]]]]  # per chunk: its results, or None (not answered)
_AHEAD = 2  # chunks queued on the server beyond the one whose answer is awaited


_LOCK_KEYS: dict[str, int] = {}  # lock name -> its advisory lock key (``entity_key``)
_LOCK_KEYS_KEPT = 32_768  # more than a tick of 10,000 leases names, so each pass finds them


def _lock_key(name: str) -> int:
    """The advisory lock key of a lock name: each tick locks the same names again."""
    key = _LOCK_KEYS.get(name)
    if key is None:
        if len(_LOCK_KEYS) >= _LOCK_KEYS_KEPT:
            _LOCK_KEYS.clear()
        key = _LOCK_KEYS[name] = entity_key("L" + name)
    return key


def _numbered(query: str) -> bytes:
    """A ``%s`` statement in the ``$1, $2, ...`` form the extended protocol binds."""
    parts = query.split("%s")
    return "".join(f"{part}${i}" for i, part in enumerate(parts[:-1], 1)).encode() + (
        parts[-1].encode())


class _Committed:
    """``Storage`` for one chunk the pipeline committed: the semantics run on its rows."""

    def __init__(self, txn: RenewedTxn) -> None:
        self.txn = txn

    def transaction(self, footprint: Footprint, work: Callable[[StorageTxn], T]) -> T:
        try:
            answer = work(self.txn)
        except (NotScripted, EngineError):
            raise
        except Exception as exc:
            if self.txn.wrote:  # as the storage has it: a committed write they did not make
                raise self.txn.disagree(f"raised {exc!r}") from exc
            raise
        self.txn.commit_script()  # raises unless they made every write the statement did
        return answer

    def close(self) -> None:
        """Nothing to release: the pipeline's connection belongs to its call."""


class _Pipeline:
    """The chunks' exchange on one connection in pipeline mode, answers filled in order."""

    def __init__(self, storage: PostgresStorage, conn: psycopg.Connection[Any], call: Call,
                 chunks: Sequence[CheckedLockOps]) -> None:
        self._storage = storage
        self._conn = conn
        self._pgconn = conn.pgconn
        self._call = call
        self._chunks = chunks
        # Only a chunk one statement answers travels here (a tick naming a semaphore twice
        # has a chunk that is not); the others are left to the ordinary path.
        self._pipelined = [index for index, chunk in enumerate(chunks)
                           if renews_of_own_names(chunk.ops)]
        self._lock_query = _numbered(storage.sql.lock_many)
        # The statement's ``EXECUTE name(...)`` form names what each connection PREPAREd.
        self._renew_many = storage.sql.renew_many.split("(", 1)[0].split()[-1].encode()
        self._lock_class = str(storage.sql.lock_class).encode()
        self._loader = Transformer(conn)
        self.answers: Answers = [None] * len(chunks)
        self.in_flight = 0  # operations sent whose chunk has not come back

    def run(self) -> None:
        if not self._pipelined:
            return
        pgconn = self._pgconn
        pgconn.enter_pipeline_mode()
        sent: deque[tuple[int, dict[str, Any], float]] = deque()
        upcoming = iter(self._pipelined)
        for index in upcoming:
            sent.append(self._send(index))
            if len(sent) > _AHEAD:
                break
        while sent:
            index, by_key, sent_at = sent.popleft()
            records = self._receive()
            self.in_flight -= len(self._chunks[index].ops)
            following = next(upcoming, None)
            if following is not None:  # out before this chunk is checked: the overlap
                sent.append(self._send(following))
            if records is not None:
                self.answers[index] = self._answer(index, by_key, records, sent_at)
        pgconn.exit_pipeline_mode()

    def _send(self, index: int) -> tuple[int, dict[str, Any], float]:
        ops = self._chunks[index].ops
        by_key = slot_keys(ops)
        pgconn = self._pgconn
        sent_at = time.monotonic()
        for text, prepared, parameters in self._statements(ops, list(by_key)):
            if prepared is None:
                pgconn.send_query_params(text, parameters)
            else:
                pgconn.send_query_prepared(prepared, parameters)
        pgconn.pipeline_sync()
        self._flush()
        self.in_flight += len(ops)
        return index, by_key, sent_at

    def _statements(self, ops: Sequence[Mapping[str, Any]], keys: list[str]
                    ) -> list[tuple[bytes, Optional[bytes], list[Optional[bytes]]]]:
        """One chunk's transaction: its names' locks (in the one fixed order), then the renews.

        Each as (SQL text, prepared statement name or None, parameters as text).
        """
        locks = sorted({_lock_key(op["name"]) for op in ops})
        encoding = self._conn.info.encoding
        return [(self._lock_query, None,
                 [self._lock_class, ("{" + ",".join(map(str, locks)) + "}").encode()]),
                (b"EXECUTE " + self._renew_many, self._renew_many,
                 [p.encode(encoding) for p in renewal_parameters(ops, keys)])]

    def _receive(self) -> Optional[list[Any]]:
        """The renew statement's rows, up to the chunk's Sync; None if the chunk failed."""
        rows: Optional[list[Any]] = None
        failed = False
        while True:
            result = self._next_result()
            if result is None:
                continue  # the end of one statement's results
            status = result.status
            if status == pq.ExecStatus.PIPELINE_SYNC:
                return None if failed else rows
            if status == pq.ExecStatus.FATAL_ERROR:
                failed = True  # rolled back at the Sync; the ordinary path runs it again
                error = error_from_result(result, self._conn.info.encoding)
                log.debug("a renewal transaction failed in a pipeline to %s, so it runs "
                          "again alone: %s", self._storage.where,
                          detail_of(error, self._storage.secrets))
            elif status == pq.ExecStatus.TUPLES_OK and result.nfields > 2:
                self._loader.set_pgresult(result)
                rows = self._loader.load_rows(0, result.ntuples, tuple)

    def _next_result(self) -> Optional[PGresult]:
        pgconn = self._pgconn
        while pgconn.is_busy():
            self._wait(select.POLLIN)
            pgconn.consume_input()
        result = pgconn.get_result()
        if result is None and pgconn.status == pq.ConnStatus.BAD:
            # A lost connection answers nothing more, and would do so forever.
            raise psycopg.OperationalError("the connection was lost in the middle of a pipeline")
        return result

    def _flush(self) -> None:
        pgconn = self._pgconn
        while pgconn.flush():
            # Reading while the server's answers fill its buffer keeps both sides moving.
            if self._wait(select.POLLIN | select.POLLOUT) & select.POLLIN:
                pgconn.consume_input()

    def _wait(self, events: int) -> int:
        """Block until the socket is ready for ``events``, within the call's deadline."""
        poller = select.poll()
        poller.register(self._pgconn.socket, events)
        ready = poller.poll(max(1, int(self._call.remaining() * 1000)))
        if not ready:
            self._call.remaining()  # raises: the deadline passed while waiting
        return ready[0][1] if ready else 0

    def _answer(self, index: int, by_key: dict[str, Any], records: list[Any],
                sent_at: float) -> Optional[list[dict[str, Any]]]:
        txn = RenewedTxn.answering(by_key, records, sent_at)
        try:
            results: list[dict[str, Any]] = EmbeddedSemantics(_Committed(txn)).locks(
                self._chunks[index])["results"]
        except NotScripted:
            return None  # it wrote nothing: the ordinary path answers it
        self._storage.remember(txn)
        return results


def renew_ahead(storage: PostgresStorage, chunks: Sequence[CheckedLockOps],
                whole: tuple[float, int]) -> Answers:
    """Each chunk's answers, in order, from one pipeline; None where the ordinary path must run.

    Args:
        storage: the engine's storage.
        chunks: a locks body's ops, one transaction's worth each; those of renews on
            names of their own (``renews_of_own_names``) travel in the pipeline.
        whole: the body's deadline (``time.monotonic()``) and its number of operations.

    Raises:
        EngineUnavailableError: the deadline passed with chunks in flight (their outcome
            is unknown).
    """
    if not psycopg.Pipeline.is_supported() or not any(
            renews_of_own_names(chunk.ops) for chunk in chunks):  # libpq < 14, or no renews
        return [None] * len(chunks)
    call = Call(lock_footprint(()), storage.where, storage.call_timeout, whole)
    try:
        conn, pool = storage.sessions.checkout(call)
    except psycopg.Error:
        return [None] * len(chunks)  # the ordinary path reports the failure
    watch = call.watch = storage.sessions.watchdog.watch(conn, call.deadline)
    exchange = _Pipeline(storage, conn, call, chunks)
    try:
        exchange.run()
    except (psycopg.Error, OSError, EngineUnavailableError) as exc:
        conn.close()  # left mid-exchange: whatever it has unread would answer the next call
        if call.overran():
            raise call.overrun_error(
                f" with {exchange.in_flight} renewals in flight, so whether those took effect "
                f"is unknown; {_answered(chunks, exchange.answers)} of {whole[1]} operations "
                "were applied before it; resending the body as the same owner is safe") from exc
    except QueenError as exc:  # the semantics disagreed with a chunk: a bug, raised loudly
        conn.close()
        committed = getattr(exc, "committed", None)
        committed = committed if isinstance(committed, int) else 0
        exc.args = (f"{exc}; {_answered(chunks, exchange.answers) + committed} of {whole[1]} "
                    f"operations were applied ({committed} by the part that failed, which "
                    f"committed as it ran); {exchange.in_flight} more were in flight, so "
                    "whether those took effect is unknown; resending the body as the same "
                    "owner is safe",)
        raise
    except BaseException:
        conn.close()
        raise
    finally:
        storage.sessions.checkin(conn, pool, watch)
    return exchange.answers


def _answered(chunks: Sequence[CheckedLockOps], answers: Answers) -> int:
    return sum(len(chunk.ops) for chunk, done in zip(chunks, answers) if done is not None)
