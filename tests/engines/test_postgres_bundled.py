"""The PostgreSQL binaries from the ``pgserver`` wheel (the test extra) run the engine.

The suite prefers a system PostgreSQL; these binaries are what the README's test
command falls back on when the machine has none, so they are checked here too.
"""

from __future__ import annotations

import sys
from typing import Iterator

import pytest
from pg_server import PgServer, bundled_bin_dir, missing

import queen_sync as qs

psycopg = pytest.importorskip("psycopg")


@pytest.fixture(scope="module")
def bundled() -> Iterator[PgServer]:
    bin_dir = bundled_bin_dir()
    if bin_dir is None and sys.version_info >= (3, 13):
        pytest.skip("pgserver has no wheel for this Python, so the test extra leaves it out")
    if bin_dir is None:
        missing("pgserver's binaries are not installed, though the test extra lists it")
    assert bin_dir is not None
    server = PgServer.start_new(bin_dir=bin_dir)
    yield server
    server.destroy()


def test_a_server_from_the_bundled_binaries_runs_locks_and_fences(bundled: PgServer) -> None:
    assert bundled.bin_dir == bundled_bin_dir(), "the system binaries were used instead"
    with qs.Queen(bundled.url) as q, psycopg.connect(bundled.url) as conn:
        first = q.lock("bundled", ttl="30s")
        assert first.acquire()
        first.release()
        second = q.lock("bundled", ttl="30s")
        assert second.acquire()
        assert second.token is not None and first.token is None
        with conn.transaction():
            second.fence(conn)
        version = conn.execute("SHOW server_version").fetchone()
    assert version is not None and version[0].split(".")[0].isdigit(), version
