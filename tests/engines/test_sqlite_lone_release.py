"""A handle's release on SQLite: one DELETE that commits by itself, checked against the file.

The release of one named slot is a single guarded DELETE, so it needs no transaction around
it. The file's identity is still checked before that statement runs, as before every commit:
a store deleted, or replaced by another file, between two calls (or between the statements
of one call) is noticed before anything is written to the wrong file.
"""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path
from typing import Any, Iterator

import pytest
from sqlite_trace import statements_sent

import queen_sync as qs
from queen_sync._engines import sqlite as _sqlite
from queen_sync._engines.sqlite import SqliteEngine

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[SqliteEngine]:
    opened = SqliteEngine(str(tmp_path / "release.db"))
    yield opened
    opened.close()


def _acquire(engine: SqliteEngine, name: str = "job") -> int:
    taken = engine.call("locks", {"operations": [
        {"op": "acquire", "name": name, "ttlSeconds": 30, "owner": "me"}]})["results"][0]
    assert taken["acquired"], taken
    return int(taken["token"])


def _release(engine: SqliteEngine, token: int, name: str = "job") -> dict[str, Any]:
    answer: dict[str, Any] = engine.call("locks", {"operations": [
        {"op": "release", "name": name, "token": token, "slot": 0}]})["results"][0]
    return answer


class TestALoneReleaseIsOneStatement:
    def test_a_release_sends_its_guarded_delete_and_nothing_else(
        self, engine: SqliteEngine
    ) -> None:
        token = _acquire(engine)
        answers: list[dict[str, Any]] = []
        sent = statements_sent(engine, lambda: answers.append(_release(engine, token)))
        assert answers == [{"released": True}], answers
        assert [s.split()[0].upper() for s in sent] == ["DELETE"], (
            f"a lone release sent {sent}; its one DELETE commits by itself")
        assert not engine.call("locks", {"operations": [{"op": "get", "name": "job"}]}
                               )["results"][0]["held"], "the permit is gone"

    def test_a_stale_release_deletes_nothing_and_says_lost(self, engine: SqliteEngine) -> None:
        token = _acquire(engine)
        assert _release(engine, token + 100) == {"released": False, "reason": "lost"}
        assert _release(engine, token) == {"released": True}, "the holder's release still works"

    def test_the_release_on_the_sweeps_turn_still_sweeps_expired_rows(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        now = [1_000_000.0]
        engine = SqliteEngine(str(tmp_path / "sweep.db"), clock=lambda: now[0])
        try:
            _acquire(engine, "stale")
            now[0] += 3600  # "stale" has long expired: the next sweep removes its row
            token = _acquire(engine)
            monkeypatch.setattr(_sqlite, "_SWEEP_EVERY", engine.storage._calls + 1)
            assert _release(engine, token) == {"released": True}
        finally:
            engine.close()
        conn = sqlite3.connect(str(tmp_path / "sweep.db"))
        try:
            keys = [k for (k,) in conn.execute("SELECT key FROM queen_kv")]
        finally:
            conn.close()
        assert keys == [], f"the release whose turn it was did not sweep: {keys} remain"


class _ReplaceAt:
    """A connection that renames ``other`` over the store just before ``verb`` runs, once."""

    def __init__(self, conn: sqlite3.Connection, verb: str, other: Path, path: Path) -> None:
        self.conn, self.verb, self.other, self.path = conn, verb, other, path
        self.sent: list[str] = []

    def execute(self, sql: str, *args: Any) -> Any:
        if self.verb and sql.upper().startswith(self.verb):
            self.verb = ""
            os.rename(self.other, self.path)
        self.sent.append(sql)
        return self.conn.execute(sql, *args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.conn, name)


class TestAReleaseIntoAReplacedFileIsRefused:
    @pytest.mark.parametrize("how", ["deleted", "replaced"])
    def test_a_release_after_the_store_changed_between_calls_raises_and_runs_no_delete(
        self, engine: SqliteEngine, tmp_path: Path, how: str
    ) -> None:
        token = _acquire(engine)
        path = Path(engine.path)
        if how == "deleted":
            os.unlink(path)
        else:
            other = tmp_path / "other.db"
            SqliteEngine(str(other)).close()
            os.rename(other, path)
        sent: list[str] = []
        with pytest.raises(qs.StoreReplacedError, match=how):
            statements_sent(engine, lambda: _release(engine, token), sent)
        assert not [s for s in sent if s.upper().startswith("DELETE")], (
            f"the release ran on a {how} store: {sent}")

    def test_an_acquire_whose_store_is_replaced_between_its_statements_commits_nothing(
        self, engine: SqliteEngine, tmp_path: Path
    ) -> None:
        other = tmp_path / "other.db"
        SqliteEngine(str(other)).close()
        storage = engine.storage
        real = storage._conn
        assert real is not None, "the engine connects when it opens"
        spy = _ReplaceAt(real, "INSERT", other, Path(engine.path))
        storage._conn = spy  # type: ignore[assignment]
        try:
            with pytest.raises(qs.StoreReplacedError, match="replaced"):
                _acquire(engine)
        finally:
            storage._conn = real
        assert "COMMIT" not in spy.sent, f"the acquire committed into the old file: {spy.sent}"
        assert not real.in_transaction, "its transaction was rolled back"
