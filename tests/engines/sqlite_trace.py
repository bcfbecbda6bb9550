"""The statements an embedded SQLite engine runs for a call, as SQLite traces them."""

from __future__ import annotations

from typing import Any, Callable, Optional

from queen_sync._engines.sqlite import SqliteEngine


def statements_sent(engine: SqliteEngine, send: Callable[[], Any],
                    sent: Optional[list[str]] = None) -> list[str]:
    """The statements ``send`` made SQLite run, parameters filled in, noted in ``sent``
    too (so they are kept when ``send`` raises)."""
    sent = [] if sent is None else sent
    conn = engine.storage._conn
    assert conn is not None, "the engine connects when it opens"
    conn.set_trace_callback(sent.append)
    try:
        send()
    finally:
        conn.set_trace_callback(None)
    return sent
