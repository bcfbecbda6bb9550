"""The fenced export's SQL sink: a PostgreSQL table of the user's own, fenced in one commit."""

from __future__ import annotations

import secrets
import signal
import time
from pathlib import Path
from typing import Iterator

import pytest
from recipe_workers import Spawn

import queen_sync as qs
from queen_sync.recipes.fenced_export import PROGRESS_NS, FencedTable

psycopg = pytest.importorskip("psycopg")

TTL = 1.0
PARTITIONS = 8


@pytest.fixture
def user_table(pg_url: str) -> Iterator[str]:
    """A table of the user's own, in a schema of its own beside the engine's."""
    schema = f"app_{secrets.token_hex(4)}"
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {schema}")
        conn.execute(f"CREATE TABLE {schema}.export (partition text PRIMARY KEY,"
                     " data jsonb NOT NULL, token bigint NOT NULL)")
    yield f"{schema}.export"
    with psycopg.connect(pg_url, autocommit=True) as conn:
        conn.execute(f"DROP SCHEMA {schema} CASCADE")


@pytest.fixture
def engine_on_pg(pg_url: str) -> str:
    return f"{pg_url}?schema=t_{secrets.token_hex(6)}"


class TestOnEnginesWithoutUserTableFencing:
    @pytest.mark.parametrize("kind", ["sqlite", "http"])
    def test_the_sink_is_refused_at_construction_naming_the_capability(
            self, kind: str, sqlite_url: str, tmp_path: Path) -> None:
        from queen_sync.testing import LocalBroker

        broker = LocalBroker(str(tmp_path / "broker.db")).start() if kind == "http" else None
        try:
            with qs.Queen(broker.url if broker else sqlite_url) as q, pytest.raises(
                    qs.UnsupportedOperationError) as refused:
                FencedTable(q, object(), "export")
        finally:
            if broker is not None:
                broker.close()

        assert refused.value.capability == "user_table_fencing", repr(refused.value)
        assert "user_table_fencing" in str(refused.value), str(refused.value)


class TestWritingUnderTheLock:
    def test_a_replaced_holders_write_commits_nothing_and_a_row_never_goes_back(
            self, engine_on_pg: str, pg_url: str, user_table: str) -> None:
        with qs.Queen(engine_on_pg) as q, psycopg.connect(pg_url) as conn:
            table = FencedTable(q, conn, user_table)
            old = q.lock("sales", ttl=30)
            assert old.acquire(), "could not take the lock"
            old_token = old.token
            assert old_token is not None
            table.write("p0", {"by": "old"}, token=old_token, lock=old)
            q.kv.delete("queen-locks", "sales#0")  # the lease lapses behind the holder's back
            new = q.lock("sales", ttl=30)
            assert new.acquire(), "the new holder could not take the lock"
            with pytest.raises(qs.FencedOutError) as stale:
                table.write("p0", {"by": "old, late"}, token=old_token, lock=old)
            new_token = new.token
            assert new_token is not None
            table.write("p1", {"by": "new"}, token=new_token, lock=new)
            with pytest.raises(qs.FencedOutError) as lower:
                table.write("p1", {"by": "new, older token"}, token=old_token, lock=new)
            rows = table.rows()
            new.release()

        assert (stale.value.presented, stale.value.current) == (old_token, new_token), (
            repr(stale.value))
        assert (lower.value.presented, lower.value.current) == (old_token, new_token), (
            repr(lower.value))
        assert rows == {"p0": (old_token, {"by": "old"}), "p1": (new_token, {"by": "new"})}, (
            f"a refused write reached the table: {rows}")

    def test_bad_names_and_a_missing_lock_are_refused_before_any_write(
            self, engine_on_pg: str, pg_url: str, user_table: str) -> None:
        with qs.Queen(engine_on_pg) as q, psycopg.connect(pg_url) as conn:
            with pytest.raises(TypeError):
                FencedTable(q, conn, 3)  # type: ignore[arg-type]
            with pytest.raises(ValueError):
                FencedTable(q, conn, user_table, key="")
            table = FencedTable(q, conn, user_table)
            with pytest.raises(TypeError, match="lock="):
                table.write("p0", 1, token=1)
            with pytest.raises(ValueError):
                table.write("../p0", 1, token=1, lock=q.lock("x", ttl=5))
            rows = table.rows()

        assert rows == {}, f"a refused call wrote {rows}"


class TestAConnectionWithATransactionOpen:
    """A write inside the caller's open transaction would be checkpointed as finished
    before that transaction commits, and its fence would hold the lock's row (blocking
    renewals and the release) until it ends: a rollback then loses the partitions."""

    def test_an_export_is_refused_before_anything_is_written_and_loses_nothing(
            self, engine_on_pg: str, pg_url: str, user_table: str) -> None:
        from queen_sync.recipes.fenced_export import FencedExport

        with qs.Queen(engine_on_pg) as q, psycopg.connect(pg_url) as conn:
            conn.execute("SELECT 1")  # psycopg's default: this opened the caller's transaction
            table = FencedTable(q, conn, user_table)
            export = FencedExport(q, "nightly", table, ttl=30)
            started = time.monotonic()
            with pytest.raises(ValueError, match="transaction"):
                export.run(["d1", "d2"], lambda part: {"part": part})
            assert time.monotonic() - started < 5, "the refusal waited on the fence's lock"
            conn.rollback()
            assert export.finished() == [], "a partition was checkpointed, never written"
            assert not q.locks.get("nightly"), "the refused export kept the lock"
            assert table.rows() == {}
            report = export.run(["d1", "d2"], lambda part: {"part": part})
            assert report.written == ["d1", "d2"], report
            assert set(table.rows()) == {"d1", "d2"} and export.finished() == ["d1", "d2"]


class TestAnExporterStalledMidExportAndReplaced:
    @pytest.mark.realtime
    def test_its_late_write_is_refused_and_every_partition_ends_up_once_with_the_newest_token(
            self, spawn: Spawn, engine_on_pg: str, pg_url: str, user_table: str) -> None:
        common = {"url": engine_on_pg, "dsn": pg_url, "table": user_table, "name": "sales",
                  "ttl": TTL, "partitions": PARTITIONS}
        old = spawn("exporter", me="old", delay=0.15, stall_at="p03", **common)
        paused_on = old.wait_for("producing", where=lambda e: e["partition"] == "p03")
        time.sleep(TTL + 0.2)  # past the old holder's lease, by the engine's clock too

        new = spawn("exporter", me="new", delay=0.01, wait=10, **common)
        finished = new.wait_for("finished")
        resumed_at = old.signal(signal.SIGCONT)
        fenced = old.wait_for("fenced", where=lambda e: e["at"] > resumed_at)
        with qs.Queen(engine_on_pg) as q, psycopg.connect(pg_url) as conn:
            rows = FencedTable(q, conn, user_table).rows()
            progress = {row["key"].split("/", 1)[1]: row["value"]["token"]
                        for row in q.kv.list_all(PROGRESS_NS, "sales/")}

        assert finished["skipped"] == ["p00", "p01", "p02"], f"no resume: {finished}"
        assert fenced["presented"] == paused_on["token"], f"refusal names another token: {fenced}"
        assert fenced["current"] > fenced["presented"], f"not refused by a newer token: {fenced}"
        assert sorted(rows) == [f"p{n:02d}" for n in range(PARTITIONS)], f"rows: {sorted(rows)}"
        for name, (token, data) in rows.items():
            expected = "old" if name in finished["skipped"] else "new"
            assert data["by"] == expected, f"{name} holds {data}, expected {expected}'s"
            assert token == progress[name], (
                f"{name} holds token {token}, but its checkpointed writer had {progress[name]}")
        assert rows["p03"][0] > paused_on["token"], "the stalled holder's write of p03 landed"
