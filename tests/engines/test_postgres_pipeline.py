"""PostgreSQL's one-trip lock calls travel as prepared statements in one pipeline.

A one-trip call's statements (the name's lock, then the statement deciding under it)
must run as one implicit transaction. They are bound to the statements the connection
PREPAREd and sent by the extended protocol, ending in one Sync: no parameter is quoted
into SQL text, and the server parses nothing. These tests pin that the calls go that
way, and that a pipeline is one transaction: it commits at its end or not at all, its
locks and settings last exactly as long, and a connection left mid-way is not reused.
"""

from __future__ import annotations

import contextlib
import secrets
import threading
from typing import Any, Iterator

import pytest
from pg_server import PgServer, require_pg, shared_server

if not require_pg():
    pytest.importorskip("psycopg")
import psycopg

from queen_sync._engines.postgres import pipeline
from queen_sync._engines.postgres.engine import PostgresEngine
from queen_sync._engines.postgres.sql import ASYNC_COMMIT
from queen_sync._engines.postgres.txn import entity_key

pytestmark = pytest.mark.timeout(60)
LOCKS = "queen-locks"


@pytest.fixture(scope="module")
def server() -> Iterator[PgServer]:
    with shared_server() as running:
        yield running


@pytest.fixture
def engine(server: PgServer) -> Iterator[PostgresEngine]:
    made = PostgresEngine.from_url(f"{server.url}?schema=t_pipe_{secrets.token_hex(5)}")
    made.call("locks", {"operations": [{"op": "get", "name": "warm-up"}]})  # schema made
    yield made
    made.close()


@pytest.fixture
def conn(server: PgServer, engine: PostgresEngine) -> Iterator[psycopg.Connection[Any]]:
    """A connection prepared as the engine prepares its own, with one probe of settings."""
    with psycopg.connect(server.url, autocommit=True,
                         cursor_factory=psycopg.ClientCursor) as made:
        made.execute(engine.storage.sql.prepare)
        made.execute("PREPARE probe AS SELECT current_setting('synchronous_commit'),"
                     " (SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'"
                     " AND pid = pg_backend_pid())")
        yield made


@pytest.fixture
def texts(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every script sent as SQL text from now on (a pool's PREPAREs left out)."""
    sent: list[str] = []
    real_execute = psycopg.ClientCursor.execute

    def recording(cursor: Any, query: Any, params: Any = None, **kwargs: Any) -> Any:
        if not str(query).startswith("PREPARE"):
            sent.append(str(query))
        return real_execute(cursor, query, params, **kwargs)

    monkeypatch.setattr(psycopg.ClientCursor, "execute", recording)
    return sent


def _lock(engine: PostgresEngine, name: str) -> tuple[bytes, list[Any]]:
    sql = engine.storage.sql
    return b"qs_lock", [sql.lock_class, entity_key("L" + name)]


def _acquire(engine: PostgresEngine, name: str, owner: str = "me") -> dict[str, Any]:
    op = {"op": "acquire", "name": name, "ttlSeconds": 30, "owner": owner}
    answer: dict[str, Any] = engine.call("locks", {"operations": [op]})["results"][0]
    return answer


def _one(engine: PostgresEngine, op: dict[str, Any]) -> dict[str, Any]:
    answer: dict[str, Any] = engine.call("locks", {"operations": [op]})["results"][0]
    return answer


class TestTheOneTripCallsBindTheirParameters:
    def test_a_lone_acquire_and_its_release_send_no_sql_text(
            self, engine: PostgresEngine, texts: list[str]) -> None:
        held = _acquire(engine, "bound")
        assert held["acquired"], held
        released = _one(engine, {"op": "release", "name": "bound", "token": held["token"],
                                 "slot": held["slot"]})
        assert released == {"released": True}, released
        assert texts == [], f"parameters were quoted into SQL text: {texts}"

    def test_a_lone_get_and_a_renew_naming_its_slot_send_no_sql_text(
            self, engine: PostgresEngine, texts: list[str]) -> None:
        held = _acquire(engine, "bound")
        texts.clear()
        renewed = _one(engine, {"op": "renew", "name": "bound", "token": held["token"],
                                "slot": 0, "owner": "me", "ttlSeconds": 30})
        assert renewed["renewed"], renewed
        state = _one(engine, {"op": "get", "name": "bound"})
        assert [h["token"] for h in state["holders"]] == [renewed["token"]], state
        assert texts == [], f"parameters were quoted into SQL text: {texts}"

    def test_an_acquire_left_to_the_two_trip_path_still_answers_as_text(
            self, engine: PostgresEngine, texts: list[str]) -> None:
        """An odd row of the name: the pipelined statement writes nothing, BEGIN follows."""
        engine.call("kv", {"operations": [{"op": "put", "ns": LOCKS, "key": "odd#x",
                                           "value": 1, "ttlSeconds": 30}]})
        texts.clear()
        answer = _acquire(engine, "odd")
        assert answer["acquired"] and answer["slot"] == 0, answer
        assert len(texts) == 2 and texts[0].startswith("BEGIN"), (
            f"the two-trip path runs after the statement: {texts}")


class TestAPipelineIsOneTransaction:
    def test_a_failed_statement_rolls_back_every_statement_before_it(
            self, engine: PostgresEngine, conn: psycopg.Connection[Any]) -> None:
        row = [LOCKS, "gone#0", '{"owner":"x"}', 7, None, 1, 1, None]
        with pytest.raises(psycopg.errors.DivisionByZero):
            # The guard of an absent key divides by zero once the INSERT made it present.
            pipeline.exchange(conn, [_lock(engine, "gone"), (b"qs_insert", row),
                                     (b"qs_guard_absent", [LOCKS, "gone#0"])])
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE, (
            "the connection is left idle after a failed pipeline")
        found = pipeline.exchange(conn, [(b"qs_read", [LOCKS, "gone#0"])])
        assert found == [[]], f"the INSERT before the failure committed: {found}"

    def test_its_lock_and_its_async_commit_last_until_its_end_and_no_longer(
            self, engine: PostgresEngine, conn: psycopg.Connection[Any]) -> None:
        prepared = pipeline.prepared_name(ASYNC_COMMIT)
        assert prepared is not None, "the asynchronous commit has a prepared twin"
        inside = pipeline.exchange(conn, [(prepared, []), _lock(engine, "held"),
                                          (b"probe", [])])
        assert inside[-1] == [(b"off", b"1")], (
            f"within the pipeline: commit asynchronous, the name locked: {inside}")
        after = pipeline.exchange(conn, [(b"probe", [])])
        assert after == [[(b"on", b"0")]], f"both outlived the pipeline: {after}"

    def test_a_parameter_of_another_type_is_refused_before_anything_is_sent(
            self, conn: psycopg.Connection[Any]) -> None:
        with pytest.raises(TypeError, match="float"):
            pipeline.exchange(conn, [(b"qs_read", [LOCKS, 1.5])])
        assert not conn.closed and pipeline.exchange(conn, [(b"probe", [])]), (
            "a refused call must leave its connection usable")

    def test_a_connection_left_mid_exchange_is_closed_and_the_engine_goes_on(
            self, engine: PostgresEngine, conn: psycopg.Connection[Any],
            monkeypatch: pytest.MonkeyPatch) -> None:
        original, caller = pipeline._wait, threading.get_ident()

        def interrupted(pgconn: Any, events: int) -> int:
            # Only on this thread: the pool's worker, preparing the replacement connection
            # meanwhile, would otherwise die of it (a thread exception pytest reports).
            if threading.get_ident() != caller:
                return original(pgconn, events)
            raise KeyboardInterrupt

        with monkeypatch.context() as patch:
            patch.setattr(pipeline, "_wait", interrupted)
            with pytest.raises(KeyboardInterrupt):
                pipeline.exchange(conn, [(b"probe", [])])
            assert conn.closed, "a connection with answers unread must not be reused"
            with contextlib.suppress(KeyboardInterrupt):
                _acquire(engine, "on")  # the engine's own connection is closed the same way
        assert _acquire(engine, "on")["acquired"], "the pool replaces the closed connection"


class TestWithoutPipelineMode:
    def test_a_client_whose_libpq_has_no_pipeline_mode_sends_the_calls_as_text(
            self, server: PgServer, texts: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
        """libpq before 14 has no pipeline mode: the same scripts go as one query string."""
        monkeypatch.setattr(pipeline, "PIPELINES", False)
        made = PostgresEngine.from_url(f"{server.url}?schema=t_pipe_{secrets.token_hex(5)}")
        with contextlib.closing(made) as engine:
            held = _acquire(engine, "text")
            assert held["acquired"], held
            renewed = _one(engine, {"op": "renew", "name": "text", "token": held["token"],
                                    "slot": 0, "owner": "me", "ttlSeconds": 30})
            assert renewed["renewed"], renewed
            state = _one(engine, {"op": "get", "name": "text"})
            assert [h["token"] for h in state["holders"]] == [renewed["token"]], state
            released = _one(engine, {"op": "release", "name": "text",
                                     "token": renewed["token"], "slot": 0})
            assert released == {"released": True}, released
        calls = [t for t in texts if "qs_lock" in t]
        assert len(calls) == 4, f"four calls, each one query string: {texts}"


class _SilentConnection:
    """libpq as it stands when a connection broke with nothing left to read: every read
    of a result answers none, and no Sync ever comes (a state real sockets reach only in
    a race, hence this stand-in)."""

    def __init__(self, status: psycopg.pq.ConnStatus) -> None:
        self.status = status
        self.reads = 0

    def is_busy(self) -> bool:
        return False

    def get_result(self) -> None:
        self.reads += 1
        assert self.reads < 10, "kept waiting for a Sync that never comes"

    def get_error_message(self, encoding: str) -> str:
        return "server closed the connection unexpectedly"


class TestAPipelineNeverWaitsForever:
    @pytest.mark.parametrize("status", [psycopg.pq.ConnStatus.OK, psycopg.pq.ConnStatus.BAD])
    def test_answers_that_stop_short_of_the_sync_raise_a_connection_error(
            self, status: psycopg.pq.ConnStatus) -> None:
        silent = _SilentConnection(status)
        with pytest.raises(psycopg.OperationalError, match="broke"):
            pipeline._answers(silent, "utf-8")  # type: ignore[arg-type]  # a stand-in
        assert silent.reads <= 2, f"read {silent.reads} empty results before giving up"
