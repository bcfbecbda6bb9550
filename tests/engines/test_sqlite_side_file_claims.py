"""A client makes the files SQLite will open by the store's name its own before SQLite
opens them, and keeps a closing neighbour from deleting them in between."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

import queen_sync as qs
import queen_sync._engines.sqlite as sqlite_engine

_NEIGHBOUR = """
import sqlite3, sys
conn = sqlite3.connect(sys.argv[1])
conn.execute("SELECT count(*) FROM queen_kv").fetchone()
print("open", flush=True)
sys.stdin.readline()
conn.close()
print("closed", flush=True)
"""


def _header(path: Path) -> bytes:
    with open(path, "rb") as handle:
        return handle.read(100)


class TestANewStoreFile:
    def test_appears_whole_in_wal_mode_with_its_schema_before_any_client_connects(
        self, tmp_path: Path
    ) -> None:
        path = tmp_path / "q.db"
        sqlite_engine._prepare_file(str(path))
        header = _header(path)
        assert header[:16] == b"SQLite format 3\x00", f"not a SQLite file yet: {header[:16]!r}"
        assert header[18:20] == b"\x02\x02", (
            f"a new file is not in WAL mode ({header[18:20]!r}): its first client must "
            "switch it, under an exclusive lock")
        conn = sqlite3.connect(f"file:{path}?mode=ro&immutable=1", uri=True)
        try:
            assert sqlite_engine._has_schema(conn), "the new file lacks the store's schema"
        finally:
            conn.close()
        assert oct(os.stat(path).st_mode & 0o777) == oct(0o600), "the new file is not 0600"


class TestAReconnection:
    def test_to_a_deleted_file_raises_store_replaced_error_naming_it(
        self, tmp_path: Path
    ) -> None:
        path = tmp_path / "q.db"
        sqlite_engine._prepare_file(str(path))
        storage = sqlite_engine.SqliteStorage(str(path))
        try:
            with storage._mutex:
                storage._disconnect()  # as before a fork: the next call reconnects
            path.unlink()
            with pytest.raises(qs.StoreReplacedError) as caught, storage.atomic():
                pass
            assert "deleted" in str(caught.value) and str(path) in str(caught.value), (
                f"the error must say the file was deleted: {caught.value}")
        finally:
            storage.close()


class TestTheSideFilesAClientOpens:
    @pytest.mark.parametrize("umask", [0o022, 0o277])
    def test_are_its_own_0600_whatever_the_umask_and_stay_while_it_runs(
        self, tmp_path: Path, umask: int
    ) -> None:
        path = tmp_path / "q.db"
        old = os.umask(umask)
        try:
            with qs.Queen(f"sqlite://{path}", renew_thread=False) as q:
                assert q.kv.put("app", "k", 1, forever=True), "the store takes a write"
                for suffix in ("-journal", "-wal", "-shm"):
                    info = os.lstat(f"{path}{suffix}")
                    assert info.st_uid == os.geteuid(), f"{suffix} is not this user's"
                    assert info.st_mode & 0o777 == 0o600, (
                        f"{suffix} has mode {oct(info.st_mode & 0o777)}, not 0600")
        finally:
            os.umask(old)

    def test_are_not_deleted_by_a_neighbour_closing_the_store_last_meanwhile(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        path = tmp_path / "q.db"
        with qs.Queen(f"sqlite://{path}", renew_thread=False) as q:
            assert q.kv.put("app", "k", "kept", forever=True), "the store takes a write"
        found: list[int] = []  # a descriptor of the -wal found: its inode cannot be reused
        with subprocess.Popen([sys.executable, "-c", _NEIGHBOUR, str(path)], text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE) as neighbour:
            stdin, stdout = neighbour.stdin, neighbour.stdout
            assert stdin is not None and stdout is not None
            assert stdout.readline().strip() == "open", "the neighbour did not open"
            real_open = sqlite_engine.SqliteStorage._open

            def neighbour_closes_first(self: sqlite_engine.SqliteStorage) -> sqlite3.Connection:
                # Every check is done and SQLite opens next: the neighbour closes, alone.
                # SQLite takes no lock on a -wal, so this descriptor's close drops none.
                found.append(os.open(f"{path}-wal", os.O_RDONLY | os.O_CLOEXEC))
                stdin.write("close\n")
                stdin.flush()
                assert stdout.readline().strip() == "closed", "the neighbour did not close"
                return real_open(self)

            monkeypatch.setattr(sqlite_engine.SqliteStorage, "_open", neighbour_closes_first)
            try:
                with qs.Queen(f"sqlite://{path}", renew_thread=False) as q:
                    assert q.kv.get("app", "k")["value"] == "kept", "the value is there"
                    kept = os.fstat(found[0])
                    now = os.lstat(f"{path}-wal")
            finally:
                for fd in found:
                    os.close(fd)
        assert kept.st_nlink == 1 and (kept.st_dev, kept.st_ino) == (now.st_dev, now.st_ino), (
            "the neighbour, closing last, deleted the -wal the client had found, and SQLite "
            "opened whatever was at the name next")
