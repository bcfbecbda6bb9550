"""What travels on the engine's PostgreSQL connections: recording each trip, cutting one.

Cutting the connection just after a statement ran, before its answer arrives, is the
moment whose outcome the client cannot know (the one-statement calls commit as they
end): the tests check what the engine answers on its retry.
"""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from queen_sync._engines.postgres import pipeline


def cut_after_first(monkeypatch: pytest.MonkeyPatch, *markers: str) -> list[str]:
    """Close the connection after the first statement containing one of ``markers`` has run.

    Returns the list the cut query is appended to, so a test can check it happened.
    """
    real_execute = psycopg.ClientCursor.execute
    cut: list[str] = []

    def run_then_cut(cursor: Any, query: Any, params: Any = None, **kw: Any) -> Any:
        result = real_execute(cursor, query, params, **kw)
        if any(m in str(query) for m in markers) and not cut:
            cut.append(str(query))
            cursor.connection.close()
            raise psycopg.OperationalError("server closed the connection unexpectedly")
        return result

    monkeypatch.setattr(psycopg.ClientCursor, "execute", run_then_cut)
    real_exchange = pipeline.exchange

    def exchange_then_cut(conn: Any, statements: Any) -> Any:
        result = real_exchange(conn, statements)
        if any(m in _pipelined(statements) for m in markers) and not cut:
            cut.append(_pipelined(statements))
            conn.close()
            raise psycopg.OperationalError("server closed the connection unexpectedly")
        return result

    monkeypatch.setattr(pipeline, "exchange", exchange_then_cut)
    return cut


def _pipelined(statements: Any) -> str:
    """A pipeline of prepared statements as the script it stands for."""
    return "; ".join(f"EXECUTE {name.decode()}" for name, _ in statements)


def record_trips(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every script the engines send from now on, one entry per round trip.

    A pool's new connection PREPAREs its statements in the pool's own thread at any
    moment; that is not a body's trip, so it is left out.
    """
    sent: list[str] = []
    real_execute = psycopg.ClientCursor.execute

    def recording(cursor: Any, query: Any, params: Any = None, **kwargs: Any) -> Any:
        if not str(query).startswith("PREPARE"):
            sent.append(str(query))
        return real_execute(cursor, query, params, **kwargs)

    monkeypatch.setattr(psycopg.ClientCursor, "execute", recording)
    real_exchange = pipeline.exchange

    def recording_pipeline(conn: Any, statements: Any) -> Any:
        sent.append(_pipelined(statements))
        return real_exchange(conn, statements)

    monkeypatch.setattr(pipeline, "exchange", recording_pipeline)
    return sent
