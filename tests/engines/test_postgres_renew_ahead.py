"""A renewal too big for one transaction travels as one pipeline of transactions on PostgreSQL.

A body of renews past the engine's transaction size (a tick of thousands of leases) is
sent as chunks on one connection, each its own transaction, the next sent before the
semantics check the last. These tests pin what that must keep: every renew still
answered as the semantics answer it, a chunk that fails on the server failing alone
(the others renewed, the error counting exactly what was applied), a chunk failing once
answered again on the ordinary path, and a connection lost mid-way leaving every lease
renewed at the token the answer names.
"""

from __future__ import annotations

import secrets
import time
from typing import Any, Iterator

import pytest
from pg_server import PgServer, require_pg, shared_server

if not require_pg():
    pytest.importorskip("psycopg")
import psycopg
from pg_cuts import record_trips

from queen_sync import EngineError, EngineUnavailableError
from queen_sync._engines.postgres import renew_ahead
from queen_sync._engines.postgres.engine import LOCKS_PER_TRANSACTION, PostgresEngine

pytestmark = pytest.mark.timeout(120)
LEASES = 2 * LOCKS_PER_TRANSACTION + 88  # three chunks, the last a short one


@pytest.fixture(scope="module")
def server() -> Iterator[PgServer]:
    with shared_server() as running:
        yield running


@pytest.fixture
def engine(server: PgServer) -> Iterator[PostgresEngine]:
    made = PostgresEngine.from_url(f"{server.url}?schema=t_ahead_{secrets.token_hex(5)}")
    made.call("locks", {"operations": [{"op": "get", "name": "warm-up"}]})  # schema made
    yield made
    made.close()


@pytest.fixture
def admin(server: PgServer) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(server.url, autocommit=True) as conn:
        yield conn


def _schema(engine: PostgresEngine) -> str:
    return engine.url.rsplit("schema=", 1)[1]


def _locks(engine: PostgresEngine, ops: list[dict[str, Any]]) -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = engine.call("locks", {"operations": ops})["results"]
    return results


def _held(engine: PostgresEngine) -> list[dict[str, Any]]:
    answers = _locks(engine, [{"op": "acquire", "name": f"r-{i:04d}", "ttlSeconds": 60,
                               "owner": f"o{i}"} for i in range(LEASES)])
    assert all(a["acquired"] for a in answers), "every lease should be taken"
    return answers


def _renews(answers: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"op": "renew", "name": f"r-{i:04d}", "token": a["token"], "slot": a["slot"],
             "owner": f"o{i}", "ttlSeconds": 60} for i, a in enumerate(answers)]


def _stored_tokens(admin: psycopg.Connection[Any], engine: PostgresEngine) -> list[int]:
    rows = admin.execute(f'SELECT version FROM "{_schema(engine)}".kv'
                         " WHERE ns = 'queen-locks' AND key LIKE 'r-%%' ORDER BY key").fetchall()
    return [int(row[0]) for row in rows]


def _fail_renewals_of(admin: psycopg.Connection[Any], engine: PostgresEngine, key: str,
                      times: str, action: str = "RAISE EXCEPTION 'refused by a test trigger'"
                      ) -> None:
    """A trigger running ``action`` (failing, by default) in the UPDATE that renews ``key``:
    ``always``, or ``once``."""
    schema = _schema(engine)
    gate = "true" if times == "always" else f"nextval('\"{schema}\".fail_once') = 1"
    admin.execute(f'CREATE SEQUENCE "{schema}".fail_once')
    admin.execute(
        f'CREATE FUNCTION "{schema}".refuse() RETURNS trigger LANGUAGE plpgsql AS $$'
        f" BEGIN IF NEW.key = '{key}' AND {gate} THEN {action}; END IF; RETURN NEW; END $$")
    admin.execute(f'CREATE TRIGGER refuse BEFORE UPDATE ON "{schema}".kv'
                  f' FOR EACH ROW EXECUTE FUNCTION "{schema}".refuse()')


class TestATickTooBigForOneTransactionTravelsAsOnePipeline:
    def test_renewing_leases_in_several_transactions_sends_no_query_text_one_by_one(
            self, engine: PostgresEngine, monkeypatch: pytest.MonkeyPatch) -> None:
        answers = _held(engine)
        trips = record_trips(monkeypatch)
        renewed = _locks(engine, _renews(answers))
        assert all(r["renewed"] and r["token"] > a["token"]
                   for r, a in zip(renewed, answers)), "every lease renews to a higher token"
        sent = [trip for trip in trips if "qs_renew" in trip]
        assert sent == [], (
            f"the chunks should travel as one pipeline of prepared statements, not as "
            f"{len(sent)} query texts sent one after the other")

    def test_every_chunk_is_answered_in_the_order_of_the_body(
            self, engine: PostgresEngine, admin: psycopg.Connection[Any]) -> None:
        answers = _held(engine)
        renewed = _locks(engine, _renews(answers))
        assert [r["slot"] for r in renewed] == [a["slot"] for a in answers], renewed[:3]
        assert [r["token"] for r in renewed] == _stored_tokens(admin, engine), (
            "each answer should name the token its own lease's row now holds")
        again = _locks(engine, _renews(renewed))
        assert all(r["renewed"] for r in again), "the new tokens renew on the next tick"


    def test_a_chunk_naming_a_lock_twice_runs_alone_and_the_others_still_travel_as_one(
            self, engine: PostgresEngine, monkeypatch: pytest.MonkeyPatch) -> None:
        """Two permits of one semaphore in a tick: their chunk is not one statement's."""
        pair = _locks(engine, [{"op": "acquire", "name": "pair", "ttlSeconds": 60,
                                "owner": owner, "limit": 2} for owner in ("p0", "p1")])
        assert all(a["acquired"] for a in pair), f"both permits of the semaphore: {pair}"
        body = [{"op": "renew", "name": "pair", "token": a["token"], "slot": a["slot"],
                 "owner": owner, "ttlSeconds": 60} for a, owner in zip(pair, ("p0", "p1"))]
        body += _renews(_held(engine))
        pipelined: list[int] = []
        real_statements = renew_ahead._Pipeline._statements

        def counted(pipeline: Any, ops: Any, keys: Any) -> Any:
            pipelined.append(len(ops))
            return real_statements(pipeline, ops, keys)

        monkeypatch.setattr(renew_ahead._Pipeline, "_statements", counted)
        renewed = _locks(engine, body)
        assert all(r["renewed"] for r in renewed), (
            f"every lease renews: {[i for i, r in enumerate(renewed) if not r['renewed']]}")
        assert pipelined == [LOCKS_PER_TRANSACTION, len(body) - 2 * LOCKS_PER_TRANSACTION], (
            f"the two chunks naming each lock once should travel as one pipeline: {pipelined}")


    def test_each_chunks_renewals_run_while_its_names_locks_are_held(
            self, engine: PostgresEngine, admin: psycopg.Connection[Any]) -> None:
        """The locks and the renewal are one transaction: its locks last until its Sync."""
        answers = _held(engine)
        schema = _schema(engine)
        admin.execute(f'CREATE TABLE "{schema}".seen (key text, locks bigint)')
        admin.execute(
            f'CREATE FUNCTION "{schema}".count_locks() RETURNS trigger LANGUAGE plpgsql AS $$'
            f' BEGIN INSERT INTO "{schema}".seen SELECT NEW.key, count(*) FROM pg_locks'
            " WHERE locktype = 'advisory' AND pid = pg_backend_pid() AND granted;"
            " RETURN NEW; END $$")
        admin.execute(f'CREATE TRIGGER count_locks BEFORE UPDATE ON "{schema}".kv FOR EACH ROW'
                      " WHEN (NEW.key IN ('r-0003#0', 'r-0300#0', 'r-0590#0'))"
                      f' EXECUTE FUNCTION "{schema}".count_locks()')
        assert all(r["renewed"] for r in _locks(engine, _renews(answers))), "all renew"
        seen = dict(admin.execute(f'SELECT key, locks FROM "{schema}".seen').fetchall())
        sizes = {"r-0003#0": LOCKS_PER_TRANSACTION, "r-0300#0": LOCKS_PER_TRANSACTION,
                 "r-0590#0": LEASES - 2 * LOCKS_PER_TRANSACTION}
        assert seen == sizes, (
            f"each renewal should run holding its chunk's advisory locks, one per name: {seen}")


class TestAChunkThatFailsOnTheServer:
    def test_fails_alone_with_a_typed_error_that_counts_what_the_others_applied(
            self, engine: PostgresEngine, admin: psycopg.Connection[Any]) -> None:
        answers = _held(engine)
        before = _stored_tokens(admin, engine)
        middle = LOCKS_PER_TRANSACTION + 5  # in the second of three chunks
        _fail_renewals_of(admin, engine, f"r-{middle:04d}#0", "always")
        with pytest.raises(EngineError) as raised:
            _locks(engine, _renews(answers))
        after = _stored_tokens(admin, engine)
        moved = [i for i, (old, new) in enumerate(zip(before, after)) if new != old]
        chunk = range(LOCKS_PER_TRANSACTION, 2 * LOCKS_PER_TRANSACTION)
        assert moved == [i for i in range(LEASES) if i not in chunk], (
            "the failing chunk should renew none of its leases and the chunks around it "
            f"all of theirs; renewed {len(moved)}, from {moved[:1]} to {moved[-1:]}")
        applied = f"{LEASES - LOCKS_PER_TRANSACTION} of {LEASES} operations were applied"
        assert applied in str(raised.value), (
            f"the error should count what the other chunks applied: {raised.value}")

    def test_once_is_answered_again_on_the_ordinary_path(
            self, engine: PostgresEngine, admin: psycopg.Connection[Any]) -> None:
        answers = _held(engine)
        _fail_renewals_of(admin, engine, f"r-{LOCKS_PER_TRANSACTION + 5:04d}#0", "once")
        renewed = _locks(engine, _renews(answers))
        assert all(r["renewed"] for r in renewed), (
            "a chunk that failed once in the pipeline should renew when run again: "
            f"{[i for i, r in enumerate(renewed) if not r['renewed']][:5]}")
        assert [r["token"] for r in renewed] == _stored_tokens(admin, engine), (
            "each answer should name the token its lease's row holds")


class TestAConnectionLostMidPipeline:
    def test_leaves_every_lease_renewed_at_the_token_its_answer_names(
            self, engine: PostgresEngine, admin: psycopg.Connection[Any],
            monkeypatch: pytest.MonkeyPatch) -> None:
        """The backend dies once the first chunk is answered: the next was in flight."""
        answers = _held(engine)
        real_answer = renew_ahead._Pipeline._answer
        killed: list[int] = []

        def answer_then_kill(pipeline: Any, *args: Any) -> Any:
            result = real_answer(pipeline, *args)
            if not killed:
                pid = pipeline._conn.info.backend_pid
                killed.append(pid)
                # The chunk in flight may commit or not: either must come out renewed.
                admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
                time.sleep(0.05)
            return result

        monkeypatch.setattr(renew_ahead._Pipeline, "_answer", answer_then_kill)
        renewed = _locks(engine, _renews(answers))
        assert killed, "the pipeline never answered a chunk"
        assert all(r["renewed"] and r["token"] > a["token"]
                   for r, a in zip(renewed, answers)), (
            "every lease should renew, those in flight when the connection died too")
        assert [r["token"] for r in renewed] == _stored_tokens(admin, engine), (
            "each answer should name the token its lease's row holds")


class TestADeadlinePassingWithChunksInFlight:
    @pytest.mark.realtime
    def test_raises_a_typed_error_saying_their_outcome_is_unknown_and_a_resend_renews_all(
            self, server: PgServer, admin: psycopg.Connection[Any]) -> None:
        made = PostgresEngine.from_url(
            f"{server.url}?schema=t_ahead_{secrets.token_hex(5)}&timeout=1")
        try:
            answers = _held(made)
            _fail_renewals_of(admin, made, f"r-{LOCKS_PER_TRANSACTION + 5:04d}#0", "once",
                              action="PERFORM pg_sleep(3)")
            with pytest.raises(EngineUnavailableError) as raised:
                _locks(made, _renews(answers))  # ended by its deadline, not the trigger's 3 s
            assert "within 1s" in str(raised.value) and "unknown" in str(raised.value), (
                f"the error should say the renewals in flight may have taken effect: "
                f"{raised.value}")
            again = _locks(made, _renews(answers))
            assert all(r["renewed"] for r in again), (
                "resending the body as the same owners should renew every lease")
        finally:
            made.close()
