"""The SQLite engine under ordinary use and under faults: the file, its neighbours, its folder."""

from __future__ import annotations

import json
import logging
import os
import pwd
import shutil
import sqlite3
import stat
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import queen_sync as qs

WORKERS = str(Path(__file__).with_name("sqlite_workers.py"))


def run_worker(*args: str) -> dict[str, Any]:
    """Run one command of ``sqlite_workers.py`` in a fresh process; its JSON answer."""
    done = subprocess.run([sys.executable, WORKERS, *args], capture_output=True, text=True,
                          timeout=30)
    assert done.returncode == 0, f"worker {args} failed: {done.stderr}"
    answer: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return answer


def run_holders_cli(url: str, name: str) -> None:
    done = subprocess.run([sys.executable, "-m", "queen_sync", "--url", url, "holders", name],
                          capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, f"queen-sync holders failed: {done.stderr}"


def wait_for_renewals(lock: qs.Lock, count: int, seconds: float) -> None:
    seen = {lock.token}
    deadline = time.monotonic() + seconds
    while len(seen) <= count and time.monotonic() < deadline:
        time.sleep(0.02)
        seen.add(lock.token)
    assert len(seen) > count, f"the renewer renewed {len(seen) - 1} times in {seconds} s"


@pytest.mark.realtime
class TestSeveralClientsOfOneFileInOneProcess:
    @pytest.mark.parametrize("neighbour", ["queen-sync holders", "a plain sqlite3 connection"])
    def test_a_second_client_and_a_neighbour_process_leave_the_first_clients_lease_exclusive(
        self, tmp_path: Path, neighbour: str
    ) -> None:
        path = tmp_path / "shared.db"
        url = f"sqlite://{path}"
        with qs.Queen(url) as first:
            lock = first.lock("job", ttl=1)
            assert lock.acquire(), "the first client takes the free lock"
            second = qs.Queen(url)  # e.g. @singleton_job's default client beside the app's
            try:
                if neighbour == "queen-sync holders":
                    run_holders_cli(url, "job")
                else:
                    run_worker("touch", str(path))
                # Past the TTL of the acquire: only renewals the others can see keep it held.
                wait_for_renewals(lock, 4, seconds=5)
                assert lock.held, "the first client still believes it holds the lease"
                held_token = int(lock.token or 0)
                third = run_worker("acquire", url, "job")
                assert not third["acquired"], (
                    f"a third process took the lease the first client holds: {third}")
                assert min(third["holder_tokens"]) >= held_token, (
                    f"the third process saw tokens {third['holder_tokens']} below the "
                    f"holder's {held_token}: the token went down")
                assert Path(f"{path}-wal").exists(), "the neighbour deleted the live WAL"
            finally:
                second.close()


class TestAStoreReplacedUnderneath:
    def test_a_call_after_the_file_is_deleted_raises_store_replaced_error_naming_it(
        self, tmp_path: Path
    ) -> None:
        path = tmp_path / "q.db"
        with qs.Queen(f"sqlite://{path}") as q:
            lock = q.lock("job", ttl=30)
            assert lock.acquire()
            os.unlink(path)
            with pytest.raises(qs.StoreReplacedError) as caught:
                q.engine.call("locks", {"operations": [
                    {"op": "renew", "name": "job", "token": lock.token, "ttlSeconds": 30,
                     "owner": lock.owner}]})
            assert caught.value.path == str(path), caught.value
            assert str(path) in str(caught.value), "the message names the file"
            with pytest.raises(qs.StoreReplacedError):
                q.kv.put("app", "k", 1, forever=True)  # and every call after it

    def test_a_call_after_another_file_is_renamed_over_it_raises_store_replaced_error(
        self, tmp_path: Path
    ) -> None:
        path, other = tmp_path / "q.db", tmp_path / "other.db"
        with qs.Queen(f"sqlite://{other}") as fresh:
            assert fresh.kv.put("app", "k", "fresh", forever=True)
        with qs.Queen(f"sqlite://{path}") as q:
            assert q.kv.put("app", "k", "original", forever=True)
            os.rename(other, path)
            with pytest.raises(qs.StoreReplacedError) as caught:
                q.kv.get("app", "k")
            assert caught.value.path == str(path), caught.value
            with pytest.raises(qs.StoreReplacedError):
                q.locks.get("job")

    def test_a_child_forked_after_the_file_was_replaced_refuses_the_new_file_too(
        self, tmp_path: Path
    ) -> None:
        path, other = tmp_path / "q.db", tmp_path / "other.db"
        qs.Queen(f"sqlite://{other}").close()
        child = run_worker("fork_after_replace", f"sqlite://{path}", str(path), str(other))
        assert child["child_raised"] == "StoreReplacedError", (
            f"the child reconnected to the file that replaced its parent's: {child}")

    @settings(max_examples=25, deadline=None)
    @given(steps=st.lists(st.sampled_from(["put", "get", "acquire", "release", "checkpoint",
                                           "vacuum", "neighbour"]), min_size=1, max_size=12))
    def test_calls_on_an_intact_file_never_raise_store_replaced_error(
        self, tmp_path_factory: pytest.TempPathFactory, steps: list[str]
    ) -> None:
        path = tmp_path_factory.mktemp("intact") / "q.db"
        with qs.Queen(f"sqlite://{path}") as q:
            lock = q.lock("job", ttl=30)
            for step in steps:
                _intact_step(q, lock, path, step)


def _intact_step(q: qs.Queen, lock: qs.Lock, path: Path, step: str) -> None:
    """One thing that changes the file's content but never its identity."""
    if step == "put":
        assert q.kv.put("app", "k", "v" * 512, forever=True)
    elif step == "get":
        q.kv.get("app", "k")
    elif step == "acquire":
        lock.acquire()
    elif step == "release":
        lock.release()
    elif step in ("checkpoint", "vacuum"):
        other = sqlite3.connect(str(path), isolation_level=None)
        try:
            other.execute("PRAGMA wal_checkpoint(TRUNCATE)" if step == "checkpoint" else "VACUUM")
        finally:
            other.close()
    else:
        qs.Queen(f"sqlite://{path}").close()


class TestAFullDatabase:
    def test_a_full_database_is_a_clear_engine_error_and_the_file_stays_intact(
        self, tmp_path: Path
    ) -> None:
        path = tmp_path / "q.db"
        with qs.Queen(f"sqlite://{path}") as q:
            assert q.kv.put("app", "kept", "small", forever=True)
            conn = q.engine.storage._conn  # type: ignore[attr-defined]
            pages = conn.execute("PRAGMA page_count").fetchone()[0]
            conn.execute(f"PRAGMA max_page_count = {pages}")  # no room to grow: a full disk
            with pytest.raises(qs.EngineError) as caught:
                q.kv.put("app", "big", "x" * 200_000, forever=True)
            message = str(caught.value)
            assert "full" in message and "rollback" not in message, message
            assert isinstance(caught.value.__cause__, sqlite3.OperationalError), caught.value
            conn.execute("PRAGMA max_page_count = 1073741823")
            assert q.kv.get("app", "kept")["value"] == "small", "what was stored is intact"
            assert not q.kv.get("app", "big"), "nothing of the failed call landed"
            assert q.kv.put("app", "after", 1, forever=True), "the engine works with room again"
        check = sqlite3.connect(str(path))
        try:
            assert check.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        finally:
            check.close()


@pytest.mark.realtime
class TestForkWhileAnotherProcessWrites:
    def test_the_forked_child_returns_at_once_and_its_first_call_waits_for_the_writer(
        self, tmp_path: Path
    ) -> None:
        path = tmp_path / "q.db"
        child = run_worker("fork_during_write", f"sqlite://{path}", str(path))
        assert child["fork_seconds"] < 0.5, (
            f"os.fork() took {child['fork_seconds']:.2f} s in the child while another "
            "process wrote: the child must not touch the file until its first call")
        assert child["first_call"] and child["written"], f"the child's first call failed: {child}"
        assert child["first_call_done_after"] > 1.0, (
            f"the child's call ended {child['first_call_done_after']:.2f} s after the fork, "
            "before the writer let go: the test did not hold the write lock")


def _chown_to_nobody(path: Path) -> None:
    nobody = pwd.getpwnam("nobody")
    os.lchown(path, nobody.pw_uid, nobody.pw_gid)


def _hostile_owned_by_nobody(root: Path, folder: Path) -> Path:
    folder.mkdir()
    folder.chmod(0o777)
    _chown_to_nobody(folder)
    return folder


def _hostile_world_writable(root: Path, folder: Path) -> Path:
    folder.mkdir()
    folder.chmod(0o777)
    return folder


def _hostile_symlink(root: Path, folder: Path) -> Path:
    target = _hostile_owned_by_nobody(root, root / "elsewhere")
    folder.symlink_to(target)
    return target


def _hostile_dangling_symlink(root: Path, folder: Path) -> Path:
    folder.symlink_to(root / "nowhere")
    return root


HOSTILE = {"owned by nobody, mode 0777": _hostile_owned_by_nobody,
           "our own but mode 0777": _hostile_world_writable,
           "a symlink to nobody's folder": _hostile_symlink,
           "a dangling symlink": _hostile_dangling_symlink}


def _sockets_under(folder: Path) -> list[str]:
    found = []
    for where, _, names in os.walk(folder):
        for name in names:
            if stat.S_ISSOCK(os.lstat(os.path.join(where, name)).st_mode):
                found.append(os.path.join(where, name))
    return found


@pytest.fixture
def shared_tmp(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A sticky, world-writable temp folder like /tmp, and no XDG_RUNTIME_DIR (as under cron).

    Made directly under /tmp: a socket's path must fit in about 100 bytes.
    """
    shared = Path(tempfile.mkdtemp(prefix="qs-", dir="/tmp"))
    shared.chmod(0o1777)
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setenv("TMPDIR", str(shared))
    monkeypatch.setattr(tempfile, "tempdir", None)  # gettempdir() caches its first answer
    yield shared
    shutil.rmtree(shared, ignore_errors=True)


@pytest.mark.realtime
class TestAHostileWakeUpFolder:
    @pytest.mark.parametrize("hostile", sorted(HOSTILE))
    def test_a_wake_up_folder_planted_by_another_user_is_not_used_and_waiting_still_works(
        self, tmp_path: Path, shared_tmp: Path, hostile: str, caplog: pytest.LogCaptureFixture
    ) -> None:
        caplog.set_level(logging.WARNING, logger="queen_sync")
        planted = HOSTILE[hostile](shared_tmp, shared_tmp / f"queen_sync-{os.getuid()}")
        sockets, waited = _wait_while_released(f"sqlite://{tmp_path / 'q.db'}", planted)
        assert not sockets, f"a waiter bound a socket inside the planted folder: {sockets}"
        assert waited == [True], f"acquire(wait=...) must still work, it gave {waited}"
        assert "poll" in caplog.text, f"a warning must say why waits poll: {caplog.text!r}"

    def test_a_temp_folder_too_deep_for_a_socket_path_falls_back_to_polling(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        deep = tmp_path / ("d" * 60) / ("e" * 60)
        deep.mkdir(parents=True)
        monkeypatch.setenv("XDG_RUNTIME_DIR", str(deep))
        _, waited = _wait_while_released(f"sqlite://{tmp_path / 'q.db'}", deep)
        assert waited == [True], f"acquire(wait=...) must still work, it gave {waited}"

    def test_a_private_folder_still_wakes_a_waiter_through_a_socket(
        self, tmp_path: Path, shared_tmp: Path
    ) -> None:
        sockets, waited = _wait_while_released(f"sqlite://{tmp_path / 'q.db'}", shared_tmp)
        assert sockets, "with a private folder the waiter must bind its wake-up socket there"
        assert waited == [True], f"acquire(wait=...) must work, it gave {waited}"
        folder = shared_tmp / f"queen_sync-{os.getuid()}"
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700, "the folder it made is private"


def _wait_while_released(url: str, watched: Path) -> tuple[list[str], list[object]]:
    """One client waits for a lock the other holds, then releases: the sockets seen under
    ``watched`` during the wait, and what the waiter's ``acquire(wait=10)`` gave."""
    with qs.Queen(url) as holder_client, qs.Queen(url) as waiter_client:
        holder = holder_client.lock("job", ttl=30)
        assert holder.acquire()
        waited: list[object] = []
        waiter = threading.Thread(
            target=lambda: waited.append(_acquire_or_error(waiter_client, "job", 10)))
        waiter.start()
        time.sleep(0.3)
        sockets = _sockets_under(watched)
        holder.release()
        waiter.join(15)
    return sockets, waited


def _acquire_or_error(q: qs.Queen, name: str, wait: float) -> object:
    try:
        return q.lock(name, ttl=30).acquire(wait=wait)
    except Exception as exc:  # the test reports whatever the waiter raised
        return exc
