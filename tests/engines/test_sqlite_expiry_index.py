"""The SQLite store's expiry index covers values only, so a lock call writes no index page.

Every acquire, renew and release rewrites its permit's ``expires_at``: an index over the
permits' expiry was one more page written by each of them, for a sweep that runs once
in hundreds of calls. Values keep their index; expired permits are swept by walking the
locks' own keys a window at a time. A store made with the old index is moved to the new
one at its first opening, keeping every row and the token counter.
"""

from __future__ import annotations

import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any, Iterator

import pytest

import queen_sync as qs
from queen_sync._engines import sqlite as _sqlite
from queen_sync._engines.sqlite import SqliteEngine

pytestmark = pytest.mark.timeout(60)

# The schema of the releases before this one, as their first client wrote it.
_OLD_SCHEMA = """
CREATE TABLE queen_kv (
    ns TEXT NOT NULL,
    key TEXT NOT NULL,
    value TEXT NOT NULL,
    version INTEGER NOT NULL,
    expires_at INTEGER,
    created_at INTEGER NOT NULL,
    updated_at INTEGER NOT NULL,
    prev_version INTEGER,
    PRIMARY KEY (ns, key)
) WITHOUT ROWID;
CREATE INDEX queen_kv_expiry ON queen_kv (expires_at) WHERE expires_at IS NOT NULL;
CREATE TABLE queen_meta (name TEXT PRIMARY KEY, value INTEGER NOT NULL);
INSERT INTO queen_meta (name, value) VALUES ('version', 41);
INSERT INTO queen_kv VALUES ('reports', 'today', '{"rows": 42}', 40, NULL, 1, 1, NULL);
"""


def _old_store(path: Path) -> None:
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        conn.execute("PRAGMA journal_mode=WAL")
        conn.executescript(_OLD_SCHEMA)
    finally:
        conn.close()


def _indexes(path: Path) -> dict[str, str]:
    conn = sqlite3.connect(path)
    try:
        return dict(conn.execute(
            "SELECT name, sql FROM sqlite_master WHERE type = 'index' AND sql IS NOT NULL"))
    finally:
        conn.close()


def _rows(path: Path) -> list[tuple[Any, ...]]:
    conn = sqlite3.connect(path)
    try:
        return list(conn.execute("SELECT ns, key FROM queen_kv ORDER BY ns, key"))
    finally:
        conn.close()


def _covers_permits(sql: str) -> bool:
    return "queen-locks" not in sql


class TestTheIndexes:
    def test_a_new_store_has_no_index_over_the_permits_expiry(self, tmp_path: Path) -> None:
        with qs.Queen(f"sqlite://{tmp_path}/new.db") as q:
            assert q.lock("job", ttl=30).acquire()
        found = _indexes(tmp_path / "new.db")
        assert found, "the values' expiry index is missing"
        assert not [name for name, sql in found.items() if _covers_permits(sql)], (
            f"an index over every row's expiry makes each lock call write one more page: "
            f"{found}")

    def test_the_sweep_of_values_reads_through_their_index(self, tmp_path: Path) -> None:
        with qs.Queen(f"sqlite://{tmp_path}/plan.db") as q:
            q.kv.put("n", "k", 1, forever=True)
        conn = sqlite3.connect(tmp_path / "plan.db")
        try:
            plan = " ".join(str(row[-1]) for row in conn.execute(
                "EXPLAIN QUERY PLAN " + _sqlite.SWEEP_VALUES, (0,)))
        finally:
            conn.close()
        assert "USING INDEX" in plan or "USING COVERING INDEX" in plan, (
            f"the sweep of expired values scans the whole table: {plan}")


class TestAStoreMadeByAnEarlierRelease:
    def test_is_moved_to_the_new_index_at_its_first_opening_keeping_rows_and_tokens(
        self, tmp_path: Path
    ) -> None:
        path = tmp_path / "old.db"
        _old_store(path)
        with qs.Queen(f"sqlite://{path}") as q:
            assert q.kv.get("reports", "today")["value"] == {"rows": 42}
            lock = q.lock("job", ttl=30)
            assert lock.acquire()
            assert lock.token is not None and lock.token > 41, (
                f"the token counter went back: {lock.token}")
        found = _indexes(path)
        assert "queen_kv_expiry" not in found, f"the old index is still written: {found}"
        assert not [name for name, sql in found.items() if _covers_permits(sql)], found

    def test_a_second_client_of_it_finds_it_moved_and_keeps_going(
        self, tmp_path: Path
    ) -> None:
        path = tmp_path / "old.db"
        _old_store(path)
        with qs.Queen(f"sqlite://{path}") as first, qs.Queen(f"sqlite://{path}") as second:
            held = first.lock("job", ttl=30)
            assert held.acquire()
            rival = second.lock("job", ttl=30)
            assert not rival.acquire(), "two holders of one lock across the migration"
            held.release()
            assert rival.acquire() and rival.token is not None and held.token is None
            assert rival.token > 41

    def test_one_its_process_may_only_read_still_answers_reads(self) -> None:
        folder = Path(tempfile.mkdtemp(prefix="queen-ro-old-", dir="/tmp"))
        try:
            path = folder / "old.db"
            _old_store(path)
            os.chmod(path, 0o400)  # its own user may read it, and make its -shm beside it
            if os.geteuid() == 0:
                for made in (folder, path):
                    os.chown(made, 65534, 65534)
            # Everything imported and used once before dropping to nobody, who may not read
            # root's interpreter.
            child = textwrap.dedent("""
                import os, sys, tempfile
                import queen_sync as qs
                with qs.Queen(f"sqlite://{tempfile.mkdtemp()}/warm.db") as warm:
                    warm.kv.get("reports", "today")
                if os.geteuid() == 0:
                    os.setgid(65534)
                    os.setuid(65534)
                with qs.Queen("sqlite://" + sys.argv[1]) as q:
                    print(q.kv.get("reports", "today")["value"]["rows"])
            """)
            done = subprocess.run([sys.executable, "-c", child, str(path)],
                                  capture_output=True, text=True, timeout=60, check=False,
                                  env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
            assert (done.returncode, done.stdout.strip()) == (0, "42"), done.stderr
        finally:
            shutil.rmtree(folder, ignore_errors=True)


class TestTheSweep:
    @pytest.fixture
    def clocked(self, tmp_path: Path) -> Iterator[tuple[SqliteEngine, list[float]]]:
        now = [1_000_000.0]
        engine = SqliteEngine(str(tmp_path / "sweep.db"), clock=lambda: now[0])
        yield engine, now
        engine.close()

    def test_expired_permits_of_names_never_used_again_leave_the_file_window_by_window(
        self, clocked: tuple[SqliteEngine, list[float]], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch
    ) -> None:
        engine, now = clocked
        names = [f"job-{i:04d}" for i in range(700)]  # more than two windows of permits
        for chunk in range(0, len(names), 100):
            engine.call("locks", {"operations": [
                {"op": "acquire", "name": name, "ttlSeconds": 5 if i % 3 else 3600,
                 "owner": "me"} for i, name in enumerate(names[chunk:chunk + 100], chunk)]})
        now[0] += 60  # two in three have expired; the others are held for an hour
        monkeypatch.setattr(_sqlite, "_SWEEP_EVERY", 1)
        for _ in range(4):  # each call's commit sweeps one window
            engine.call("kv", {"operations": [{"op": "put", "ns": "n", "key": "k",
                                               "value": 1, "forever": True}]})
        left = {key.split("#")[0] for ns, key in _rows(tmp_path / "sweep.db")
                if ns == "queen-locks"}
        assert left == {name for i, name in enumerate(names) if i % 3 == 0}, (
            f"{len(left)} permits left; expected only the {len(names[::3])} live ones")

    def test_expired_values_leave_the_file_and_live_ones_stay(
        self, clocked: tuple[SqliteEngine, list[float]], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch
    ) -> None:
        engine, now = clocked
        engine.call("kv", {"operations": [
            {"op": "put", "ns": "n", "key": f"k{i}", "value": i, "ttlSeconds": 5 if i % 2
             else 3600} for i in range(100)]})
        now[0] += 60
        monkeypatch.setattr(_sqlite, "_SWEEP_EVERY", 1)
        engine.call("kv", {"operations": [{"op": "put", "ns": "other", "key": "k",
                                           "value": 1, "forever": True}]})
        left = {key for ns, key in _rows(tmp_path / "sweep.db") if ns == "n"}
        assert left == {f"k{i}" for i in range(0, 100, 2)}, sorted(left)
