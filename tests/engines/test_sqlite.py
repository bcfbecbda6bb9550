"""What is particular to the embedded SQLite engine: the file, its place, its limits."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

import queen_sync as qs
from queen_sync._engines import sqlite as _sqlite


class TestTheFile:
    def test_no_url_means_queen_url_else_a_file_in_the_state_directory(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.delenv("QUEEN_URL", raising=False)
        monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
        with qs.Queen() as q:
            expected = tmp_path / "state" / "queen_sync" / "queen.db"
            assert q.url == f"sqlite://{expected}", q.url
            assert stat.S_IMODE(expected.stat().st_mode) == 0o600, "the file must be private"
            assert stat.S_IMODE(expected.parent.stat().st_mode) == 0o700
        monkeypatch.setenv("QUEEN_URL", f"sqlite://{tmp_path / 'env.db'}")
        with qs.Queen() as q:
            assert q.url.endswith("env.db"), q.url

    def test_a_relative_path_and_a_home_path_are_accepted(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.chdir(tmp_path)
        with qs.Queen("sqlite:rel.db") as q:
            assert q.url == f"sqlite://{tmp_path / 'rel.db'}"
        monkeypatch.setenv("HOME", str(tmp_path))
        with qs.Queen("sqlite:~/home.db") as q:
            assert (tmp_path / "home.db").exists(), q.url

    def test_a_path_that_cannot_be_created_is_an_engine_unavailable_error(
        self, tmp_path: Path
    ) -> None:
        blocker = tmp_path / "file"
        blocker.write_text("not a folder")
        with pytest.raises(qs.EngineUnavailableError, match="cannot open") as caught:
            qs.Queen(f"sqlite://{blocker / 'sub' / 'q.db'}")
        assert isinstance(caught.value.__cause__, OSError)

    def test_a_url_naming_a_host_is_refused(self) -> None:
        with pytest.raises(qs.RequestError, match="host"):
            qs.Queen("sqlite://server/share/x.db")

    def test_an_unknown_scheme_is_refused_with_the_choices(self) -> None:
        with pytest.raises(qs.RequestError, match="postgresql://"):
            qs.Queen("redis://localhost")

    def test_options_of_other_engines_are_refused(self, sqlite_url: str) -> None:
        with pytest.raises(TypeError, match="headers"):
            qs.Queen(sqlite_url, headers={"x": "y"})

    def test_synchronous_can_be_chosen_in_the_url(self, tmp_path: Path) -> None:
        with qs.Queen(f"sqlite://{tmp_path / 'x.db'}?synchronous=full") as q:
            conn = q.engine.storage._conn  # type: ignore[attr-defined]
            assert conn.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL


class TestUrlOptions:
    @pytest.mark.parametrize("query", [
        "synchronus=full", "busy_timeout=nan", "busy_timeout=inf", "busy_timeout=-5",
        "busy_timeout=0", "busy_timeout=", "busy_timeout=soon", "synchronous=", "synchronous=fast",
        "synchronous=full&synchronous=off", "busy_timeout=1&busy_timeout=2", "timeout=3",
    ])
    def test_a_url_option_that_is_misspelt_given_twice_or_out_of_range_is_refused_as_bad_url(
        self, tmp_path: Path, query: str
    ) -> None:
        path = tmp_path / "x.db"
        with pytest.raises(qs.RequestError) as caught:
            qs.Queen(f"sqlite://{path}?{query}")
        assert caught.value.code == "bad_url", caught.value
        assert not path.exists(), "a refused URL must not create the file"

    @pytest.mark.parametrize("where", ["/", "{tmp}", "{tmp}/", "{tmp}/new/", "{tmp}/.",
                                       "{tmp}/.."])
    def test_a_url_that_names_a_folder_is_refused_as_bad_url_and_creates_nothing(
        self, tmp_path: Path, where: str
    ) -> None:
        before = sorted(tmp_path.iterdir())
        with pytest.raises(qs.RequestError, match="names no database file") as caught:
            qs.Queen("sqlite://" + where.format(tmp=tmp_path))
        assert caught.value.code == "bad_url", caught.value
        assert sorted(tmp_path.iterdir()) == before, "a refused URL created something"

    def test_an_unknown_option_is_named_only_when_it_is_a_near_miss_of_an_option(
        self, tmp_path: Path
    ) -> None:
        with pytest.raises(qs.RequestError, match=r"'synchronus' \(did you mean synchronous"):
            qs.Queen(f"sqlite://{tmp_path / 'x.db'}?synchronus=full")
        with pytest.raises(qs.RequestError) as caught:
            qs.Queen(f"sqlite://{tmp_path / 'x.db'}?Zq9s3cr3tT0k3n")
        assert "Zq9s3cr3tT0k3n" not in str(caught.value), "a query key may be a secret"

    @pytest.mark.parametrize("seconds", [float("nan"), float("inf"), -5.0, 0.0, True, "1"])
    def test_a_busy_timeout_option_out_of_range_is_refused_at_the_call(
        self, sqlite_url: str, seconds: object
    ) -> None:
        with pytest.raises((TypeError, ValueError), match="busy_timeout"):
            qs.Queen(sqlite_url, busy_timeout=seconds)

    def test_a_busy_timeout_in_the_url_bounds_the_wait_for_another_write(
        self, tmp_path: Path
    ) -> None:
        with qs.Queen(f"sqlite://{tmp_path / 'x.db'}?busy_timeout=0.25&synchronous=FULL") as q:
            assert q.engine.storage._busy_timeout == 0.25  # type: ignore[attr-defined]


class TestNetworkFilesystems:
    def test_a_database_on_nfs_is_refused_with_what_to_use_instead(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setattr(_sqlite, "filesystem_type", lambda path: "nfs4")
        with pytest.raises(qs.UnsupportedOperationError) as caught:
            qs.Queen(f"sqlite://{tmp_path / 'x.db'}")
        message = str(caught.value)
        assert "nfs4" in message and "postgresql://" in message, message
        assert caught.value.capability == "local_filesystem"
        assert not (tmp_path / "x.db").exists(), "nothing may be created on a refused path"

    def test_the_filesystem_type_is_read_from_the_longest_mount_point(
        self, tmp_path: Path
    ) -> None:
        mounts = tmp_path / "mounts"
        mounts.write_text("/dev/sda1 / ext4 rw 0 0\nserver:/x /mnt/share nfs4 rw 0 0\n")
        assert _sqlite.filesystem_type("/mnt/share/db/q.db", str(mounts)) == "nfs4"
        assert _sqlite.filesystem_type("/mnt/shared", str(mounts)) == "ext4"
        assert _sqlite.filesystem_type("/x", str(tmp_path / "missing")) is None


class TestCapabilities:
    def test_the_sqlite_engine_declares_what_it_can_and_cannot_do(self, sqlite_url: str) -> None:
        with qs.Queen(sqlite_url) as q:
            caps = q.capabilities
            assert caps.fencing and caps.engine_clock_expiry and caps.wake_on_release
            assert not caps.queue_operations and not caps.multi_host
            caps.require("fencing", "wake_on_release")
            with pytest.raises(qs.UnsupportedOperationError) as caught:
                caps.require("multi_host", engine=q.engine.kind)
            assert caught.value.capability == "multi_host"
            with pytest.raises(ValueError, match="unknown capability"):
                caps.require("teleport")

    def test_queue_operations_in_a_bundle_are_refused_naming_the_broker(
        self, sqlite_url: str
    ) -> None:
        with qs.Queen(sqlite_url) as q:
            body = {"operations": [{"type": "push", "items": [{"queue": "q", "payload": {},
                                                               "transactionId": "t"}]}],
                    "requiredLeases": [], "kv": [q.kv.op.put("a", "b", 1, forever=True)]}
            with pytest.raises(qs.UnsupportedOperationError, match="Queen broker"):
                q.engine.call("transaction", body)
            assert not q.kv.get("a", "b"), "nothing of a refused bundle may land"

    def test_lock_fence_is_refused_on_an_engine_without_user_table_fencing(
        self, sqlite_url: str
    ) -> None:
        with qs.Queen(sqlite_url) as q:
            lock = q.lock("job", ttl=30)
            assert lock.acquire()
            with pytest.raises(qs.UnsupportedOperationError, match="guard"):
                lock.fence(object())


class TestEngineErrors:
    def test_a_database_locked_too_long_is_an_engine_unavailable_error(
        self, tmp_path: Path
    ) -> None:
        import sqlite3

        path = tmp_path / "busy.db"
        with qs.Queen(f"sqlite://{path}?busy_timeout=0.2") as q:
            blocker = sqlite3.connect(str(path), isolation_level=None)
            blocker.execute("BEGIN IMMEDIATE")
            try:
                with pytest.raises(qs.EngineUnavailableError, match="locked") as caught:
                    q.kv.put("app", "k", 1, forever=True)
                assert isinstance(caught.value.__cause__, sqlite3.OperationalError)
            finally:
                blocker.execute("ROLLBACK")
                blocker.close()
            assert q.kv.put("app", "k", 1, forever=True), "the engine recovers afterwards"

    def test_a_second_opener_told_locked_while_the_file_turns_wal_retries(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        import sqlite3

        real = _sqlite.SqliteStorage._open
        refusals = iter([True, True])

        def racing(self: _sqlite.SqliteStorage) -> sqlite3.Connection:
            if next(refusals, False):
                raise sqlite3.OperationalError("database is locked")
            return real(self)

        monkeypatch.setattr(_sqlite.SqliteStorage, "_open", racing)
        with qs.Queen(f"sqlite://{tmp_path / 'x.db'}") as q:
            assert q.kv.put("app", "k", 1, forever=True), "the third open must work"
        assert next(refusals, None) is None, "both refusals were retried"

    def test_a_file_that_is_not_a_database_is_an_engine_error(self, tmp_path: Path) -> None:
        path = tmp_path / "junk.db"
        path.write_bytes(os.urandom(4096))
        with pytest.raises(qs.EngineError):
            qs.Queen(f"sqlite://{path}")


class TestAWriteThatSQLiteRefusedWhole:
    """SQLite answers busy, full and read-only before anything is written: its error says
    so (``applied is False``), and a transaction it refused may be committed again."""

    def test_a_busy_file_refuses_the_bundle_and_it_may_be_committed_again(
            self, tmp_path: Path) -> None:
        import sqlite3

        path = tmp_path / "queen.db"
        with qs.Queen(f"sqlite://{path}?busy_timeout=0.3") as q:
            q.kv.put("n", "k", 0, forever=True)
            blocker = sqlite3.connect(path, isolation_level=None)
            try:
                blocker.execute("BEGIN IMMEDIATE")  # another process mid-write
                txn = q.transaction().kv.incr("n", "k", forever=True)
                with pytest.raises(qs.EngineUnavailableError) as busy:
                    txn.commit()
                assert busy.value.applied is False, busy.value
                blocker.execute("ROLLBACK")
            finally:
                blocker.close()
            assert txn.commit(), "the refused bundle could not be committed again"
            assert q.kv.get("n", "k")["value"] == 1
