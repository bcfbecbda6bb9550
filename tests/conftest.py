"""Fixtures shared by every test: engine URLs, clients, and a manual clock."""

from __future__ import annotations

from typing import Iterator

import pytest
from engine_factories import ENGINE_FACTORIES
from manual_clock import ManualClock
from pg_server import pg_server, pg_url  # noqa: F401  (session fixtures for the postgres engine)

import queen_sync as qs


@pytest.fixture(params=sorted(ENGINE_FACTORIES))
def engine_url(request: pytest.FixtureRequest) -> str:
    """A URL to a fresh, empty store, once per engine."""
    return ENGINE_FACTORIES[request.param](request)


@pytest.fixture
def sqlite_url(tmp_path) -> str:  # type: ignore[no-untyped-def]
    return "sqlite://" + str(tmp_path / "queen.db")


@pytest.fixture
def q(engine_url: str) -> Iterator[qs.Queen]:
    if engine_url.startswith("postgresql"):
        # The pool would otherwise open connections in the background, and their jittered
        # lifetimes draw from `random` while hypothesis generates data (a flaky example).
        client = qs.Queen(engine_url, pool_min_size=0)
        client.kv.get("warm", "up")
    else:
        client = qs.Queen(engine_url)
    yield client
    client.close()


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()
