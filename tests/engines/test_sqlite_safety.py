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


@pytest.mark.realtime
class TestAForkedHolderWhoseLauncherLeaves:
    @pytest.mark.parametrize("how", ["close", "exit", "kill"])
    def test_a_third_process_is_refused_while_the_child_forked_from_a_client_holds(
        self, tmp_path: Path, how: str
    ) -> None:
        path = tmp_path / "q.db"
        url = f"sqlite://{path}"
        with subprocess.Popen([sys.executable, WORKERS, "fork_holder_then_leave", url, how],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) as launcher:
            assert launcher.stdin is not None and launcher.stdout is not None
            try:
                holding = json.loads(launcher.stdout.readline())["holding"]
                assert holding, "the forked child takes the free lock"
                launcher.wait(10)  # the launcher has closed its client, exited, or been killed
                if how == "kill":
                    run_holders_cli(url, "L")  # an operator looks; it must delete nothing live
                time.sleep(1.3)  # past the acquire's TTL: only renewals others see keep it held
                third = run_worker("acquire", url, "L")
            finally:
                launcher.stdin.close()  # tells the child to report and exit
                lines = [json.loads(line) for line in launcher.stdout.read().splitlines()]
        child = next(line for line in lines if "held" in line)
        assert child["held"] and not child["lost"], f"the child lost its lease: {child}"
        assert not third["acquired"], (
            f"a third process took L (token {third['token']}) while the forked child held it "
            f"at token {child['token']}: the launcher's {how} broke the child's file locks")
        assert min(third["holder_tokens"]) >= holding, (
            f"the third process saw tokens {third['holder_tokens']}, below {holding}")
        assert Path(f"{path}-wal").exists(), "the live WAL was deleted"


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
                                           "vacuum", "neighbour", "fork"]),
                          min_size=1, max_size=12))
    def test_calls_on_an_intact_file_never_raise_store_replaced_error(
        self, tmp_path_factory: pytest.TempPathFactory, steps: list[str]
    ) -> None:
        path = tmp_path_factory.mktemp("intact") / "q.db"
        with qs.Queen(f"sqlite://{path}", renew_thread=False) as q:  # no thread: forks are safe
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
    elif step == "fork":  # closes the connection, so SQLite may make a new -wal and -shm
        pid = os.fork()
        if pid == 0:
            failed = 1
            try:
                q.kv.get("app", "k")
                failed = 0
            finally:
                os._exit(failed)
        assert os.waitpid(pid, 0)[1] == 0, "the forked child's call failed"
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


class _InterruptAfterBegin:
    """A connection whose BEGIN IMMEDIATE succeeds and then Ctrl-C lands, once."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn
        self.armed = True

    def execute(self, sql: str, *args: Any) -> Any:
        cursor = self.conn.execute(sql, *args)
        if self.armed and sql == "BEGIN IMMEDIATE":
            self.armed = False
            raise KeyboardInterrupt
        return cursor

    def __getattr__(self, name: str) -> Any:
        return getattr(self.conn, name)


class TestAnInterruptInsideACall:
    def test_ctrl_c_just_after_the_write_lock_is_taken_leaves_no_transaction_open(
        self, tmp_path: Path
    ) -> None:
        path = tmp_path / "q.db"
        with qs.Queen(f"sqlite://{path}") as q:
            assert q.kv.put("app", "kept", 1, forever=True)
            storage = q.engine.storage  # type: ignore[attr-defined]
            real = storage._conn
            storage._conn = _InterruptAfterBegin(real)
            with pytest.raises(KeyboardInterrupt):
                q.kv.put("app", "lost", 2, forever=True)
            storage._conn = real
            assert not real.in_transaction, "the interrupted call left its transaction open"
            other = sqlite3.connect(str(path), timeout=0.2)
            try:
                other.execute("BEGIN IMMEDIATE")  # "database is locked" if the lock was kept
                other.execute("ROLLBACK")
            finally:
                other.close()
            assert q.kv.put("app", "after", 3, forever=True), "the client's next call works"
            assert not q.kv.get("app", "lost"), "nothing of the interrupted call landed"


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


    def test_a_fork_while_another_thread_waits_out_the_writer_returns_before_it_lets_go(
        self, tmp_path: Path
    ) -> None:
        path = tmp_path / "q.db"
        report = run_worker("fork_during_a_busy_wait", f"sqlite://{path}", str(path))
        assert report["writer_released"] == "told", (
            "os.fork() waited out another process's write, which another thread's call was "
            f"waiting for: {report}")
        assert report["waiter_wrote"] and report["child_wrote"], f"a call failed: {report}"
        assert report["stored"] == ["before", "child", "waiter"], report


class TestForkFromInsideACall:
    def test_the_parent_goes_on_and_the_child_is_refused_the_file_instead_of_a_deadlock(
        self, tmp_path: Path
    ) -> None:
        report = run_worker("fork_inside_a_call", f"sqlite://{tmp_path / 'q.db'}")
        assert report["parent_resumed"] == "nothing (answered True)", report
        assert report["parent_after"] and report["integrity"] == "ok", report
        assert not report["resumed"].startswith("nothing"), (
            f"the call the fork cut short went on in the child, on the parent's locks: {report}")
        for side in ("inherited", "fresh"):
            assert report[side].startswith("EngineError") and "fork" in report[side], (
                f"the child's {side} client must refuse the file it cannot lock: {report}")
        assert report["stored"] == ["after", "before", "parent"], report

    def test_a_fork_from_inside_a_reconnection_leaves_the_parent_working_and_the_child_refused(
        self, tmp_path: Path
    ) -> None:
        report = run_worker("fork_inside_a_reconnect", f"sqlite://{tmp_path / 'q.db'}")
        assert report["parent_resumed"] == "nothing (answered True)", report
        assert report["stored"] == ["before", "parent"], report
        assert not report["resumed"].startswith("nothing"), (
            f"the call the fork cut short went on in the child, on the parent's locks: {report}")
        assert report["fresh"].startswith("EngineError") and "fork" in report["fresh"], report


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


class TestItsWalOrShmRemovedUnderneath:
    @pytest.mark.parametrize("removed", [("-wal",), ("-shm",), ("-wal", "-shm")])
    @pytest.mark.parametrize("then", ["nothing", "another process opens the file"])
    def test_a_call_after_an_operator_removes_them_raises_store_replaced_error(
        self, tmp_path: Path, removed: tuple[str, ...], then: str
    ) -> None:
        path = tmp_path / "q.db"
        with qs.Queen(f"sqlite://{path}", renew_thread=False) as q:
            lock = q.lock("job", ttl=30)
            assert lock.acquire(), "the client takes the free lock"
            for suffix in removed:  # "stale leftovers", as an operator may believe
                os.unlink(f"{path}{suffix}")
            if then == "another process opens the file":
                run_worker("try_touch", str(path))  # may make new ones where the old ones were
            with pytest.raises(qs.StoreReplacedError) as caught:
                q.locks.get("job")
            assert f"{path}{removed[0]}" in str(caught.value), (
                f"the message must name the removed file: {caught.value}")
            with pytest.raises(qs.StoreReplacedError):
                q.kv.put("app", "k", 1, forever=True)  # and every call after it


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="only root may give files away")
NOBODY = pwd.getpwnam("nobody")
FOLDERS = {"private 0700": (0o700, False), "sticky 1777": (0o1777, False),
           "others may write 0777": (0o777, False), "group may write 0770": (0o770, False),
           "nobody's 0755": (0o755, True)}
SAFE_FOLDERS = {"private 0700", "sticky 1777"}


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


@needs_root
class TestAFileOthersCouldChange:
    @settings(max_examples=40, deadline=None)
    @given(which=st.sampled_from(["", "-wal", "-shm"]), nobodys=st.booleans(),
           mode=st.sampled_from([0o600, 0o644, 0o640, 0o660, 0o606, 0o666, 0o620, 0o602]),
           folder_kind=st.sampled_from(sorted(FOLDERS)))
    def test_a_client_is_refused_exactly_when_another_user_could_change_the_store(
        self, tmp_path_factory: pytest.TempPathFactory, which: str, nobodys: bool, mode: int,
        folder_kind: str
    ) -> None:
        folder = tmp_path_factory.mktemp("planted") / "store"
        folder.mkdir()
        path = folder / "q.db"
        with qs.Queen(f"sqlite://{path}") as q:
            assert q.kv.put("app", "k", "kept", forever=True)
        planted = Path(f"{path}{which}")
        planted.touch()  # an empty -wal or -shm is a valid one
        planted.chmod(mode)
        if nobodys:
            os.chown(planted, NOBODY.pw_uid, NOBODY.pw_gid)
        folder_mode, folder_nobodys = FOLDERS[folder_kind]
        folder.chmod(folder_mode)
        if folder_nobodys:
            os.chown(folder, NOBODY.pw_uid, NOBODY.pw_gid)
        unsafe = nobodys or bool(mode & 0o022) or folder_kind not in SAFE_FOLDERS
        before = _snapshot(folder)
        try:
            client = qs.Queen(f"sqlite://{path}")
        except qs.UnsupportedOperationError as exc:
            assert unsafe, f"a store only we can change was refused: {exc}"
            culprit = str(planted) if folder_kind in SAFE_FOLDERS else str(folder)
            assert culprit in str(exc), f"the error must name {culprit}: {exc}"
            assert _snapshot(folder) == before, "refusing the store changed its files"
            return
        with client:
            assert not unsafe, (f"a store {'nobody' if nobodys else 'we'} own with mode "
                                f"{oct(mode)} on {which or 'the file'} in a folder "
                                f"'{folder_kind}' was used")
            assert client.kv.get("app", "k")["value"] == "kept"

    def test_a_file_planted_by_another_user_in_the_temp_folder_is_refused_saying_how_to_fix(
        self, shared_tmp: Path
    ) -> None:
        path = shared_tmp / "nightly.db"
        path.touch()
        path.chmod(0o666)
        os.chown(path, NOBODY.pw_uid, NOBODY.pw_gid)
        with pytest.raises(qs.UnsupportedOperationError) as caught:
            qs.Queen(f"sqlite://{path}")
        message = str(caught.value)
        assert str(path) in message and "owned by" in message, message
        assert "chown" in message or "remove" in message, f"it must say how to fix it: {message}"
        assert not Path(f"{path}-wal").exists(), "a refused store must not be opened"

    @pytest.mark.parametrize("link_owner", ["ours", "nobody's"])
    def test_a_symlink_is_followed_only_when_nobody_else_could_repoint_it(
        self, shared_tmp: Path, tmp_path: Path, link_owner: str
    ) -> None:
        target = tmp_path / "q.db"
        with qs.Queen(f"sqlite://{target}") as q:
            assert q.kv.put("app", "k", "kept", forever=True)
        link = shared_tmp / "q.db"  # in a sticky folder: only its owner may replace it
        link.symlink_to(target)
        if link_owner == "nobody's":
            os.lchown(link, NOBODY.pw_uid, NOBODY.pw_gid)
            with pytest.raises(qs.UnsupportedOperationError) as caught:
                qs.Queen(f"sqlite://{link}")
            assert str(link) in str(caught.value), caught.value
            return
        with qs.Queen(f"sqlite://{link}") as q:
            assert q.kv.get("app", "k")["value"] == "kept", "our link reaches our store"

    def test_a_symlink_to_another_users_file_is_refused(self, tmp_path: Path) -> None:
        target = tmp_path / "theirs.db"
        target.touch()
        os.chown(target, NOBODY.pw_uid, NOBODY.pw_gid)
        (tmp_path / "q.db").symlink_to(target)
        with pytest.raises(qs.UnsupportedOperationError) as caught:
            qs.Queen(f"sqlite://{tmp_path / 'q.db'}")
        assert str(target) in str(caught.value), caught.value


class TestAHardLinkedDatabase:
    def test_a_file_with_a_second_hard_link_is_refused_under_either_name_and_kept_intact(
        self, tmp_path: Path
    ) -> None:
        original, hard = tmp_path / "a.db", tmp_path / "hard.db"
        with qs.Queen(f"sqlite://{original}") as q:
            assert q.kv.put("app", "k", "kept", forever=True)
        os.link(original, hard)
        for spelling in (hard, original):
            with pytest.raises(qs.UnsupportedOperationError) as caught:
                qs.Queen(f"sqlite://{spelling}")
            assert str(spelling) in str(caught.value) and "hard link" in str(caught.value), (
                f"the error must name the path and the reason: {caught.value}")
        os.unlink(hard)
        with qs.Queen(f"sqlite://{original}") as q:
            assert q.kv.get("app", "k")["value"] == "kept", "the refusals lost nothing"

    def test_a_hard_link_made_while_a_client_is_open_fails_its_next_call(
        self, tmp_path: Path
    ) -> None:
        path = tmp_path / "a.db"
        with qs.Queen(f"sqlite://{path}", renew_thread=False) as q:
            assert q.lock("job", ttl=30).acquire()
            os.link(path, tmp_path / "hard.db")
            with pytest.raises(qs.StoreReplacedError) as caught:
                q.locks.get("job")
            assert "hard link" in str(caught.value), caught.value


def _spellings(folder: Path) -> dict[str, str]:
    (folder / "sub").mkdir()
    (folder / "sym.db").symlink_to(folder / "a.db")
    (folder / "dirlink").symlink_to(folder)
    return {"symlink": f"{folder}/sym.db", "dotdot": f"{folder}/sub/../a.db",
            "doubleslash": f"{folder}//a.db", "dir-symlink": f"{folder}/dirlink/a.db"}


class TestOtherSpellingsOfOnePath:
    @pytest.mark.parametrize("spelling", ["symlink", "dotdot", "doubleslash", "dir-symlink"])
    def test_a_holder_through_one_spelling_excludes_a_process_using_another(
        self, tmp_path: Path, spelling: str
    ) -> None:
        with qs.Queen(f"sqlite://{tmp_path / 'a.db'}") as q:
            lock = q.lock("job", ttl=30)
            assert lock.acquire(), "the first client takes the free lock"
            other = run_worker("acquire", f"sqlite://{_spellings(tmp_path)[spelling]}", "job")
            assert not other["acquired"], f"the {spelling} spelling opened another store: {other}"
            assert other["holder_tokens"] == [lock.token], other
