"""A script of prepared statements sent as one pipeline: one round trip, one transaction.

The one-trip calls send a few statements that must run as one implicit transaction (a
name's lock, then the statement that reads and writes under it). As one query string
they travel by the simple protocol: the driver quotes every parameter into the text and
the server parses it again, which costs more than the statements themselves. Here each
goes as a Bind and Execute of the statement the connection PREPAREd, with its parameters
as text, all followed by one Sync: still one round trip, and everything before the Sync
is one implicit transaction, which commits at the Sync or rolls back at the first error.

The wait for the answer polls the socket (the GIL released), so the watchdog that
shuts down a late call's socket ends it here too. A connection left mid-exchange (an
interrupt, a broken socket) is closed: its pool replaces it.
"""

from __future__ import annotations

import functools
import select
from typing import Any, Callable, Optional, Sequence

import psycopg
from psycopg import pq
from psycopg.errors import error_from_result
from psycopg.pq.abc import PGconn, PGresult

from .sql import ASYNC_COMMIT, Statement

Cell = Optional[bytes]
_EXECUTE = "EXECUTE "
# The one text of a script that has a prepared twin: ``SET LOCAL`` is not preparable,
# its function form is (``scripted_sql`` prepares it).
_PREPARED_TWINS = {ASYNC_COMMIT: b"qs_synchronous_commit_off"}
_ANSWERED = (pq.ExecStatus.TUPLES_OK, pq.ExecStatus.COMMAND_OK)
PIPELINES = psycopg.Pipeline.is_supported()


@functools.lru_cache(maxsize=256)  # a script's queries are the schema's few constant texts
def prepared_name(query: str) -> Optional[bytes]:
    """The prepared statement a script's query runs (None: it is plain text)."""
    twin = _PREPARED_TWINS.get(query)
    if twin is not None:
        return twin
    if not query.startswith(_EXECUTE):
        return None
    end = query.find("(")
    return query[len(_EXECUTE):len(query) if end < 0 else end].encode()


def _text(value: Any, encoding: str) -> Cell:
    """A parameter as the text PostgreSQL parses for its declared type."""
    # The exact types: a bool is an int, yet PostgreSQL reads "True" as no integer.
    if type(value) is str:
        return value.encode(encoding)
    if type(value) is int:
        return str(value).encode()
    if value is None:
        return None
    raise TypeError(f"a prepared statement's parameter must be text, an integer or None, "
                    f"not {type(value).__name__}")


def send(cur: psycopg.Cursor[Any], script: Sequence[Statement]) -> list[list[tuple[Cell, ...]]]:
    """Run ``script`` in one round trip; the rows each statement returned, as text.

    A script of prepared statements travels as a pipeline; one holding anything else,
    or any script when the client's libpq has no pipeline mode (before 14), travels as
    one query string by the simple protocol, which answers in text too.
    """
    names = [prepared_name(query) for query, _ in script]
    if PIPELINES and all(names):
        return exchange(cur.connection, [(name, params) for name, (_, params)
                                         in zip(names, script) if name is not None])
    cur.execute("; ".join(q for q, _ in script), [p for _, ps in script for p in ps])
    results = []
    while True:
        result = cur.pgresult
        answered = result is not None and result.status == pq.ExecStatus.TUPLES_OK
        results.append(_rows(result) if answered and result is not None else [])
        if not cur.nextset():
            return results


def _rows(result: PGresult) -> list[tuple[Cell, ...]]:
    width = result.nfields
    return [tuple(result.get_value(i, j) for j in range(width)) for i in range(result.ntuples)]


def exchange(conn: psycopg.Connection[Any], statements: Sequence[tuple[bytes, Sequence[Any]]]
             ) -> list[list[tuple[Cell, ...]]]:
    """Execute prepared statements as one pipeline ending in one Sync; their rows, as text.

    Raises the server's error for the first statement that failed (nothing committed),
    or a driver error when the connection failed (it is then closed).
    """
    encoding = conn.info.encoding
    bound = [(name, [_text(p, encoding) for p in params]) for name, params in statements]

    def send_all(pgconn: PGconn) -> None:
        for name, texts in bound:
            pgconn.send_query_prepared(name, texts)

    return _pipelined(conn, send_all, encoding)


def prepare_each(conn: psycopg.Connection[Any], prepares: Sequence[str]) -> None:
    """Run each PREPARE (or other statement without parameters) as a query of its own,
    all in one round trip.

    So each prepared statement's text (what ``pg_stat_activity`` shows while it runs) is
    its own PREPARE, not a script of them all.
    """
    if not PIPELINES:
        conn.execute(";".join(prepares))
        return
    encoding = conn.info.encoding
    texts = [text.encode(encoding) for text in prepares]

    def send_all(pgconn: PGconn) -> None:
        for text in texts:
            pgconn.send_query_params(text, None)

    _pipelined(conn, send_all, encoding)


def _pipelined(conn: psycopg.Connection[Any], send_all: Callable[[PGconn], None],
               encoding: str) -> list[list[tuple[Cell, ...]]]:
    """What ``send_all`` queues, then one Sync: every statement's rows, or the first error."""
    pgconn = conn.pgconn
    try:
        pgconn.enter_pipeline_mode()
        send_all(pgconn)
        pgconn.pipeline_sync()
        _flush(pgconn)
        rows, failure = _answers(pgconn, encoding)
        pgconn.exit_pipeline_mode()
    except BaseException:
        conn.close()  # whatever it left unread would answer the connection's next call
        raise
    if failure is not None:
        raise failure
    return rows


def _answers(pgconn: PGconn, encoding: str
             ) -> tuple[list[list[tuple[Cell, ...]]], Optional[psycopg.Error]]:
    """Every statement's rows up to the Sync, and the first error among them."""
    rows: list[list[tuple[Cell, ...]]] = []
    failure: Optional[psycopg.Error] = None
    ended = False  # the last result read was the end of one statement's results
    while True:
        while pgconn.is_busy():
            _wait(pgconn, select.POLLIN)
            pgconn.consume_input()
        result = pgconn.get_result()
        if result is None:
            # One end per statement; a second in a row, or a broken connection, means no
            # Sync will ever come, and waiting for it would spin forever.
            if ended or pgconn.status == pq.ConnStatus.BAD:
                raise psycopg.OperationalError(
                    "the connection broke before the pipeline's answers all arrived: "
                    f"{pgconn.get_error_message(encoding)}")
            ended = True
            continue
        ended = False
        status = result.status
        if status == pq.ExecStatus.PIPELINE_SYNC:
            return rows, failure
        if status in _ANSWERED:
            rows.append(_rows(result))
        elif status == pq.ExecStatus.FATAL_ERROR and failure is None:
            failure = error_from_result(result, encoding)
        # PIPELINE_ABORTED: a statement after the failed one, skipped by the server.


def _flush(pgconn: PGconn) -> None:
    while pgconn.flush():
        # Reading while the server's answers fill its buffer keeps both sides moving.
        if _wait(pgconn, select.POLLIN | select.POLLOUT) & select.POLLIN:
            pgconn.consume_input()


def _wait(pgconn: PGconn, events: int) -> int:
    """Block until the socket is ready for ``events`` (or broken); the events it reports."""
    poller = select.poll()
    poller.register(pgconn.socket, events)
    ready = poller.poll()  # no timeout: the watchdog shuts a late call's socket, ending it
    return ready[0][1] if ready else 0
