"""PostgreSQL: a prefix page reads its page, whatever the planner's statistics say.

A run queue reads its pending runs a page at a time. When a table grew faster than
autovacuum's ANALYZE (100,000 runs submitted in seconds), the planner's guess for the
page's key range is one row; a plan built on that guess reads every row after the
cursor and sorts them to return the page. These tests build that state for certain
(autovacuum off, so no ANALYZE can land between the fill and the read) and count what
the engine's own session reads for one page.
"""

from __future__ import annotations

import contextlib
import secrets
from typing import Any, Iterator

import pytest
from pg_server import require_pg

if not require_pg():
    pytest.importorskip("psycopg")
import psycopg

import queen_sync as qs
from queen_sync._engines.postgres.storage import Call, PostgresStorage
from queen_sync._engines.storage import Footprint, prefix_end

pytestmark = pytest.mark.timeout(120)

#: Enough rows that the planner, guessing blind, prefers the plan that reads them all
#: (on PostgreSQL 15 it switches between 30,000 and 100,000 rows of this shape).
ROWS = 100_000
PAGE = 32
NS, PREFIX = "queen-sync.runs", "big/pending/"


@pytest.fixture
def client(pg_url: str) -> Iterator[qs.Queen]:
    with qs.Queen(f"{pg_url}?schema=t_{secrets.token_hex(6)}") as q:
        q.kv.put("warm", "up", 1, forever=True)  # the schema exists from here on
        yield q


@contextlib.contextmanager
def engine_session(q: qs.Queen) -> Iterator[tuple[psycopg.Connection[Any], PostgresStorage]]:
    """One of the engine's own pooled connections, set up as its bodies find it."""
    storage: PostgresStorage = q.engine.storage  # type: ignore[attr-defined]
    conn, pool = storage.sessions.checkout(Call(Footprint(), storage.where, 60.0))
    try:
        yield conn, storage
    finally:
        storage.sessions.checkin(conn, pool)


def fill_never_analyzed(conn: psycopg.Connection[Any], schema: str) -> None:
    """ROWS pending-run rows, written the way the engine writes them, and no statistics."""
    table = f'"{schema}".kv'
    conn.execute(f"ALTER TABLE {table} SET (autovacuum_enabled = false)")
    conn.execute(
        f"INSERT INTO {table} (ns, key, value, version, expires_at, created_at, updated_at,"
        " prev_version) SELECT %s, %s || 'run-' || lpad(n::text, 6, '0'),"
        " json_build_object('payload', json_build_object('n', n), 'attempts', 0,"
        " 'state', NULL, 'claim', NULL),"
        f" nextval('\"{schema}\".version'::regclass), NULL, 0, 0, NULL"
        " FROM generate_series(1, %s) AS n", (NS, PREFIX, ROWS))


def rows_read(plan: dict[str, Any]) -> int:
    """The most rows any node of an EXPLAIN ANALYZE plan produced."""
    children = plan.get("Plans", [])
    return max([int(plan["Actual Rows"]), *(rows_read(child) for child in children)])


class TestAPrefixPageReadsOnlyItsPage:
    def test_a_page_of_a_range_that_grew_since_the_last_analyze_reads_only_the_page(
            self, client: qs.Queen) -> None:
        with engine_session(client) as (conn, storage):
            fill_never_analyzed(conn, storage.sql.schema)
            after = f"{PREFIX}run-000500"
            params = (NS, PREFIX, prefix_end(PREFIX), after, 0, PAGE)
            explained = conn.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + storage.sql.read_prefix,
                                     params).fetchone()
        assert explained is not None
        plan = explained[0][0]["Plan"]
        assert rows_read(plan) <= PAGE, (
            f"one page of {PAGE} rows read {rows_read(plan):,} rows of the {ROWS:,} in the "
            f"table: the plan ({plan['Node Type']} over {plan['Plans'][0]['Node Type']}) "
            "depends on statistics a fast-grown table does not have yet")

    def test_the_page_it_reads_is_the_next_page_in_key_order(self, client: qs.Queen) -> None:
        with engine_session(client) as (conn, storage):
            fill_never_analyzed(conn, storage.sql.schema)
        page = client.kv.get_prefix(NS, PREFIX, after=f"{PREFIX}run-000500", limit=PAGE)
        keys = [row["key"] for row in page["rows"]]
        assert keys == [f"{PREFIX}run-{n:06d}" for n in range(501, 501 + PAGE)], (
            f"the page after run-000500 was {keys[:3]}...{keys[-3:]}")
        assert page["truncated"], "99,468 more rows follow this page: it must say so"
