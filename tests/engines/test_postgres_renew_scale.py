"""What a PostgreSQL renewal tick costs the server does not grow with what else is stored.

The one-statement renewal of a tick (``renew_batch``) reads a renewed lease's own
slot row only; the rest of a name is read only for a renew it refuses, which is
answered with the name's holders. Its plan is never compiled by JIT: the planner
judges a name's key range by the store's size, so on a store of 100,000 rows it
would think a batch costly enough to spend a tenth of a second compiling it.
"""

from __future__ import annotations

import secrets
from typing import Any, Iterator

import pytest
from pg_server import PgServer, require_pg, shared_server

if not require_pg():
    pytest.importorskip("psycopg")
import psycopg

from queen_sync._engines.postgres.engine import LOCKS_PER_TRANSACTION, PostgresEngine
from queen_sync._engines.postgres.renew_batch import RenewedTxn
from queen_sync._engines.postgres.sql import array_literal

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def server() -> Iterator[PgServer]:
    with shared_server() as running:
        yield running


@pytest.fixture
def engine(server: PgServer) -> Iterator[PostgresEngine]:
    made = PostgresEngine.from_url(f"{server.url}?schema=t_scale_{secrets.token_hex(5)}")
    made.call("locks", {"operations": [{"op": "get", "name": "warm-up"}]})
    yield made
    made.close()


def _session(server: PgServer, engine: PostgresEngine) -> psycopg.Connection[Any]:
    """A connection prepared as the engine's pooled ones are."""
    conn = psycopg.connect(server.url, autocommit=True, cursor_factory=psycopg.ClientCursor,
                           prepare_threshold=None)
    conn.execute(engine.storage.sql.prepare)
    return conn


def _locks(engine: PostgresEngine, ops: list[dict[str, Any]]) -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = engine.call("locks", {"operations": ops})["results"]
    return results


def _two_holders(engine: PostgresEngine, name: str) -> list[dict[str, Any]]:
    answers = _locks(engine, [{"op": "acquire", "name": name, "ttlSeconds": 60, "limit": 2,
                               "owner": f"{name}-{i}"} for i in range(2)])
    assert all(a["acquired"] for a in answers), f"both permits of {name} should be taken"
    return answers


class TestARenewalBatchReadsWhatItsAnswersNeed:
    def test_a_renewed_lease_reads_only_its_own_slot_and_a_refused_one_reads_its_name(
            self, server: PgServer, engine: PostgresEngine) -> None:
        kept, refused = _two_holders(engine, "kept"), _two_holders(engine, "refused")
        ops = [{"op": "renew", "name": "kept", "slot": kept[0]["slot"], "owner": "kept-0",
                "token": kept[0]["token"], "ttlSeconds": 60},
               {"op": "renew", "name": "refused", "slot": refused[0]["slot"],
                "owner": "refused-0", "token": refused[0]["token"] - 1, "ttlSeconds": 60}]
        with _session(server, engine) as conn:
            txn = RenewedTxn(conn.cursor(), engine.storage.sql, ops)
        read = sorted(key for _, key in txn.rows())
        assert read == ["kept#0", "refused#0", "refused#1"], (
            f"the renewed lease should read its own slot only, the refused one its whole "
            f"name (for the holders it answers with); read {read}")
        assert txn.wrote, "the current token should have renewed"

    def test_a_refused_renew_in_a_batch_still_answers_with_every_holder_of_its_name(
            self, engine: PostgresEngine) -> None:
        kept, refused = _two_holders(engine, "kept"), _two_holders(engine, "refused")
        answers = _locks(engine, [
            {"op": "renew", "name": "kept", "slot": kept[1]["slot"], "owner": "kept-1",
             "token": kept[1]["token"], "ttlSeconds": 60},
            {"op": "renew", "name": "refused", "slot": refused[1]["slot"], "owner": "thief",
             "token": refused[1]["token"], "ttlSeconds": 60}])
        assert answers[0]["renewed"], f"the holder's renew should renew: {answers[0]}"
        holders = sorted((h["slot"], h["owner"]) for h in answers[1].get("holders", []))
        assert not answers[1]["renewed"] and holders == [(0, "refused-0"), (1, "refused-1")], (
            f"a renew by another owner is refused with both holders: {answers[1]}")


def _nodes(plan: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield plan
    for child in plan.get("Plans", []):
        yield from _nodes(child)


@pytest.fixture
def big_store_plan(server: PgServer, engine: PostgresEngine) -> dict[str, Any]:
    """EXPLAIN ANALYZE of a full batch of renews on a store of 100,000 other permits."""
    sql = engine.storage.sql
    with _session(server, engine) as conn:
        conn.execute(
            f'INSERT INTO "{sql.schema}".kv SELECT %s, \'n\' || i || \'#0\','
            ' \'{"owner":"o","limit":1}\', i, 4102444800000, 0, 0, NULL'
            " FROM generate_series(1, 100000) AS i", ("queen-locks",))
        conn.execute(f'ANALYZE "{sql.schema}".kv')
        names = [f"n{i}" for i in range(1, LOCKS_PER_TRANSACTION + 1)]
        record = conn.execute(
            "EXPLAIN (ANALYZE, FORMAT JSON) " + sql.renew_many,
            ("queen-locks", array_literal(names), array_literal(n + "#0" for n in names),
             array_literal(range(1, len(names) + 1)), array_literal("o" for _ in names),
             array_literal(60_000 for _ in names))).fetchone()
    assert record is not None
    plan: dict[str, Any] = record[0][0]
    assert plan["Plan"]["Actual Rows"] == len(names), "every renew should answer one row"
    return plan


class TestARenewalBatchOnABigStore:
    def test_a_full_renewal_batch_is_not_compiled_by_jit_on_a_store_of_100000_rows(
            self, big_store_plan: dict[str, Any]) -> None:
        assert "JIT" not in big_store_plan, (
            f"a batch of {LOCKS_PER_TRANSACTION} renews was JIT-compiled: "
            f"{big_store_plan.get('JIT')}")

    def test_a_full_renewal_batch_reads_the_table_by_key_only(
            self, big_store_plan: dict[str, Any]) -> None:
        scans = sorted({node["Node Type"] for node in _nodes(big_store_plan["Plan"])
                        if "Relation Name" in node and node["Node Type"] != "ModifyTable"})
        assert scans == ["Index Scan"], (
            f"the batch should reach the table through its key only, not by {scans}")
