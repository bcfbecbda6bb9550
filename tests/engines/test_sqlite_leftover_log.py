"""A database deleted with its log left behind is not rebuilt from that log.

SQLite replays a ``-wal`` (or rolls back a ``-journal``) found beside a database file it
opens, whether or not that file is the one the log was written for. A new store made where
a deleted one stood would start from part of the old one's pages: old holders, and a
version counter that may be behind tokens already handed out.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

import queen_sync as qs

# Writes, then dies without closing: its log is left as a crash leaves it.
_CRASHED_WRITER = textwrap.dedent("""
    import os, sys
    import queen_sync as qs
    q = qs.Queen("sqlite://" + sys.argv[1])
    lock = q.lock("job", ttl=600)
    assert lock.acquire()
    q.kv.put("n", "k", "old", forever=True)
    print(lock.token)
    os._exit(0)
""")


@pytest.fixture
def leftover(tmp_path: Path) -> Path:
    """The path of a database that was deleted after a crash, its ``-wal`` left behind."""
    path = tmp_path / "queen.db"
    done = subprocess.run([sys.executable, "-c", _CRASHED_WRITER, str(path)],
                          capture_output=True, text=True, timeout=60, check=True)
    assert int(done.stdout) >= 1
    assert os.path.getsize(f"{path}-wal") > 0, "the crash left no log to test with"
    os.remove(path)
    return path


class TestADeletedDatabaseWithItsLogLeft:
    def test_is_not_rebuilt_from_the_log_and_the_log_is_kept(self, leftover: Path) -> None:
        wal = Path(f"{leftover}-wal")
        size = wal.stat().st_size
        with pytest.raises(qs.EngineError, match=r"queen\.db-wal") as refused:
            qs.Queen(f"sqlite://{leftover}")
        assert "deleted" in str(refused.value) and "remove" in str(refused.value), refused.value
        assert not leftover.exists(), "a database file was made over the leftover log"
        assert wal.stat().st_size == size, "the leftover log was changed"

    def test_once_the_log_is_removed_a_new_store_starts_empty(self, leftover: Path) -> None:
        for suffix in ("-wal", "-shm", "-journal"):
            Path(f"{leftover}{suffix}").unlink(missing_ok=True)
        with qs.Queen(f"sqlite://{leftover}") as q:
            assert not q.kv.get("n", "k"), "the new store holds the old one's data"
            assert not q.locks.get("job").get("holders")


class TestAStoreMadeByAnotherProcessMeanwhile:
    def test_is_opened_not_taken_for_a_deleted_ones_log(
            self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        path = tmp_path / "queen.db"
        with qs.Queen(f"sqlite://{path}") as first:
            assert first.lock("job", ttl=30).acquire()  # a live store, its -wal in use
            assert os.path.getsize(f"{path}-wal") > 0
            # This client looked for the file just before the other made it.
            real_lexists = os.path.lexists
            missed: list[Any] = []

            def lexists(name: Any) -> bool:
                if os.fspath(name) == str(path) and not missed:
                    missed.append(name)
                    return False
                return real_lexists(name)

            monkeypatch.setattr(os.path, "lexists", lexists)
            with qs.Queen(f"sqlite://{path}") as second:
                monkeypatch.undo()
                assert missed, "the interleaving was not made"
                assert second.locks.get("job").get("holders"), "it opened another store"
