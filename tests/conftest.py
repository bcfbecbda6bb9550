"""Fixtures shared by every test: engine URLs, clients, brokers, faults and a manual clock."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import pytest
from engine_factories import ENGINE_FACTORIES
from manual_clock import ManualClock
from pg_server import pg_server, pg_url  # noqa: F401  (session fixtures for the postgres engine)
from stall_guard import (  # noqa: F401  (the run's hooks that feed the stall guard)
    pytest_runtest_logfinish,
    pytest_runtest_logstart,
    pytest_sessionfinish,
    pytest_sessionstart,
)

import queen_sync as qs
from queen_sync.testing import FakeBroker, FaultyEngine, LocalBroker


def _client_options(url: str) -> dict[str, Any]:
    # The pool would otherwise open connections in the background, and their jittered
    # lifetimes draw from `random` while hypothesis generates data (a flaky example).
    return {"pool_min_size": 0} if url.startswith("postgresql") else {}


@pytest.fixture(params=sorted(ENGINE_FACTORIES))
def engine_url(request: pytest.FixtureRequest) -> str:
    """A URL to a fresh, empty store, once per engine."""
    return ENGINE_FACTORIES[request.param](request)


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    """A URL to a fresh SQLite file of this test."""
    return "sqlite://" + str(tmp_path / "queen.db")


@pytest.fixture
def q(engine_url: str) -> Iterator[qs.Queen]:
    """A client of the fresh store, once per engine, with its renewer thread."""
    client = qs.Queen(engine_url, **_client_options(engine_url))
    if engine_url.startswith("postgresql"):
        client.kv.get("warm", "up")
    yield client
    client.close()


@pytest.fixture
def faults(engine_url: str) -> Iterator[FaultyEngine]:
    """The fresh store, once per engine, behind a FaultyEngine (no faults until scripted)."""
    engine = FaultyEngine(engine_url, **_client_options(engine_url))
    yield engine
    engine.close()


@pytest.fixture
def faulty_q(faults: FaultyEngine) -> Iterator[qs.Queen]:
    """A client, with its renewer thread, whose every call goes through ``faults``."""
    with qs.Queen(engine=faults) as client:
        yield client


@pytest.fixture
def sqlite_faults(sqlite_url: str) -> Iterator[FaultyEngine]:
    """The test's SQLite file behind a FaultyEngine (``faulty_mq`` is a client over it)."""
    engine = FaultyEngine(sqlite_url)
    yield engine
    engine.close()


@pytest.fixture
def clock() -> ManualClock:
    """The monotonic clock of ``mq``'s renewer and deadlines, moved by the test."""
    return ManualClock()


@pytest.fixture
def mq(sqlite_url: str, clock: ManualClock) -> Iterator[qs.Queen]:
    """A client on the manual ``clock`` whose renewer the test ticks by hand (``tick()``)."""
    with qs.Queen(sqlite_url, clock=clock, renew_thread=False) as client:
        yield client


@pytest.fixture
def faulty_mq(sqlite_faults: FaultyEngine, clock: ManualClock) -> Iterator[qs.Queen]:
    """``mq``, with every call going through ``sqlite_faults``."""
    with qs.Queen(engine=sqlite_faults, clock=clock, renew_thread=False) as client:
        yield client


@pytest.fixture
def client(sqlite_url: str) -> Iterator[qs.Queen]:
    """A client of the test's SQLite file, with its renewer thread."""
    with qs.Queen(sqlite_url) as q:
        yield q


@pytest.fixture
def other(sqlite_url: str) -> Iterator[qs.Queen]:
    """A second client of the test's SQLite file: another process, as far as owners go."""
    with qs.Queen(sqlite_url) as q:
        yield q


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[LocalBroker]:
    """A LocalBroker on 127.0.0.1 over a fresh SQLite file, on the real clock."""
    with LocalBroker(str(tmp_path / "broker.db")) as local:
        yield local


@pytest.fixture
def fake() -> Iterator[FakeBroker]:
    """An in-process FakeBroker (no socket)."""
    with FakeBroker() as broker:
        yield broker
