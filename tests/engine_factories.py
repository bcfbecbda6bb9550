"""Engines the conformance suite runs over: kind -> a function returning a URL to a FRESH store.

Each function takes the pytest ``request`` (to reach fixtures such as ``tmp_path``).
"""

from __future__ import annotations

from typing import Callable

import pytest

EngineFactory = Callable[[pytest.FixtureRequest], str]


def _sqlite(request: pytest.FixtureRequest) -> str:
    return "sqlite://" + str(request.getfixturevalue("tmp_path") / "queen.db")


def _http(request: pytest.FixtureRequest) -> str:
    """A LocalBroker on a fresh SQLite file, stopped when the test ends."""
    from queen_sync.testing import LocalBroker

    broker = LocalBroker(str(request.getfixturevalue("tmp_path") / "broker.db")).start()
    request.addfinalizer(broker.close)
    return broker.url


def _postgres(request: pytest.FixtureRequest) -> str:
    """A fresh schema on the session's PostgreSQL server."""
    import secrets

    return str(request.getfixturevalue("pg_url")) + "?schema=t_" + secrets.token_hex(6)


ENGINE_FACTORIES: dict[str, EngineFactory] = {
    "sqlite": _sqlite,
    "http": _http,
    "postgres": _postgres,
}
