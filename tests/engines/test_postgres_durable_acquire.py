"""PostgreSQL acknowledges an acquire only once it is durable.

A commit is made to wait here by naming a synchronous standby that never connects:
every durable commit then waits (``SyncRep``) for as long as the test wants, while a
commit with ``synchronous_commit = off`` does not. So "durable" below means what the
server's own setting asks of a commit, and a call that may not answer before its commit
is durable cannot answer at all until the standby is dropped again.
"""

from __future__ import annotations

import contextlib
import secrets
import time
from typing import Any, Iterator

import pytest
from pg_server import PgServer, require_pg

if not require_pg():
    pytest.importorskip("psycopg")
import psycopg

from queen_sync import EngineUnavailableError
from queen_sync._engines.postgres.engine import PostgresEngine

pytestmark = pytest.mark.timeout(120)
NAME = "n"


@pytest.fixture(scope="module")
def server() -> Iterator[PgServer]:
    """A server of this module's own: stalling its commits would stall every other test."""
    made = PgServer.start_new()
    try:
        yield made
    finally:
        made.destroy()


@pytest.fixture
def schema() -> str:
    return "t_durable_" + secrets.token_hex(5)


def _engine(server: PgServer, schema: str, call_timeout: float) -> PostgresEngine:
    engine = PostgresEngine.from_url(f"{server.url}?schema={schema}", timeout=(5, call_timeout))
    engine.call("locks", {"operations": [{"op": "get", "name": "warm-up"}]})
    return engine


@contextlib.contextmanager
def durable_commits_stalled(server: PgServer) -> Iterator[psycopg.Connection[Any]]:
    """Every durable commit waits for a standby that never comes, until the block ends."""
    with psycopg.connect(server.url, autocommit=True) as admin:
        admin.execute("ALTER SYSTEM SET synchronous_standby_names = 'never_connects'")
        admin.execute("SELECT pg_reload_conf()")
        time.sleep(0.2)  # the setting reaches every backend at its next command
        try:
            yield admin
        finally:
            admin.execute("ALTER SYSTEM RESET synchronous_standby_names")
            admin.execute("SELECT pg_reload_conf()")


def _wait_for_a_stalled_commit(admin: psycopg.Connection[Any]) -> None:
    deadline = time.monotonic() + 10
    while not admin.execute("SELECT 1 FROM pg_stat_activity WHERE wait_event = 'SyncRep'"
                            ).fetchall():
        assert time.monotonic() < deadline, "no commit ever waited to be durable"
        time.sleep(0.01)


def _acquire(engine: PostgresEngine, owner: str) -> dict[str, Any]:
    op = {"op": "acquire", "name": NAME, "ttlSeconds": 60, "owner": owner}
    answer: dict[str, Any] = engine.call("locks", {"operations": [op]})["results"][0]
    return answer


def _unanswered(engine: PostgresEngine, owner: str) -> str:
    """The acquire must not answer while its commit is not durable: its error says why."""
    try:
        answer = _acquire(engine, owner)
    except EngineUnavailableError as exc:
        return str(exc)
    raise AssertionError(f"answered {answer} before the commit was durable")


class TestAnAcquireIsAnsweredOnlyOnceDurable:
    def test_an_acquire_waits_for_its_commit_to_be_durable(
            self, server: PgServer, schema: str) -> None:
        holder = _engine(server, schema, call_timeout=1.5)
        try:
            with durable_commits_stalled(server):
                error = _unanswered(holder, "alice")
            assert "unknown" in error, f"the outcome must be called unknown: {error}"
            assert _acquire(holder, "alice").get("already") is True, (
                "once durable, the permit is the owner's")
        finally:
            holder.close()

    def test_a_resent_acquire_answers_already_only_once_the_permit_is_durable(
            self, server: PgServer, schema: str) -> None:
        holder = _engine(server, schema, call_timeout=1.5)
        try:
            with durable_commits_stalled(server):
                _unanswered(holder, "alice")
                error = _unanswered(holder, "alice")  # the owner resends
            assert "unknown" in error, f"the outcome must be called unknown: {error}"
        finally:
            holder.close()
