"""What a release costs the SQLite wake-up channel, and what it still refuses.

Every release notifies the waiters of its lock name. The folder the waiters' sockets
live in is checked (ours, private, on a path nobody else can change) before it is used;
once checked, a release looks at the folder alone, and a folder swapped meanwhile is
checked whole again.
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import queen_sync as qs
from queen_sync._engines import sqlite_wake
from queen_sync._engines.sqlite_wake import WakeChannel


@pytest.fixture
def channel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[WakeChannel]:
    runtime = tempfile.mkdtemp(prefix="qw")  # short: a socket path holds ~100 bytes
    monkeypatch.setenv("XDG_RUNTIME_DIR", runtime)
    made = WakeChannel(str(tmp_path / "q.db"))
    yield made
    made.close()
    shutil.rmtree(runtime, ignore_errors=True)


def _count_calls(monkeypatch: pytest.MonkeyPatch, names: tuple[str, ...]) -> list[str]:
    """Record every call of these ``os`` functions, wherever they are called from."""
    calls: list[str] = []
    for name in names:
        real: Callable[..., Any] = getattr(os, name)

        def counted(*args: Any, _real: Callable[..., Any] = real, _name: str = name,
                    **kwargs: Any) -> Any:
            calls.append(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(os, name, counted)
    return calls


def _bound_socket(folder: str, name: str) -> socket.socket:
    """A socket bound where a waiter on lock ``name`` binds one."""
    name_folder = os.path.join(folder, sqlite_wake._digest(name))
    os.makedirs(name_folder, mode=0o700, exist_ok=True)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(os.path.join(name_folder, f"{os.getpid()}.test"))
    sock.setblocking(False)
    return sock


class TestAReleaseNotifyingWaiters:
    def test_once_the_folder_was_checked_a_release_looks_only_at_the_folder(
        self, channel: WakeChannel, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        with channel.subscribe("job"):
            channel.notify(["job"])  # the first notify checks the whole path
            calls = _count_calls(monkeypatch, ("stat", "lstat"))
            channel.notify(["job"])
        assert len(calls) <= 1, (
            f"a release after the folder was checked made {len(calls)} metadata calls "
            f"({calls}): it walked the path again")

    def test_a_release_on_a_database_nobody_waited_on_looks_only_for_the_folder(
        self, channel: WakeChannel, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        calls = _count_calls(monkeypatch, ("stat", "lstat"))
        channel.notify(["job"])
        assert len(calls) <= 1, (
            f"a release with no wake-up folder made {len(calls)} metadata calls ({calls})")

    def test_a_folder_replaced_by_one_others_can_write_is_refused_after_a_check(
        self, channel: WakeChannel, caplog: pytest.LogCaptureFixture
    ) -> None:
        with channel.subscribe("job") as waiter:
            channel.notify(["job"])
            assert waiter.wait(1.0), "a socket in the private folder is woken"
        shutil.rmtree(channel.folder)
        os.mkdir(channel.folder)
        os.chmod(channel.folder, 0o777)  # another user could plant or swap sockets here
        planted = _bound_socket(channel.folder, "job")
        try:
            channel.notify(["job"])
            with pytest.raises(BlockingIOError):
                planted.recv(16)  # nothing was sent into the folder others can write
        finally:
            planted.close()
        assert "poll" in caplog.text, f"the refusal must be logged: {caplog.text!r}"


def _count_entries_read(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Record the name of every folder entry listed by ``os.scandir`` or ``os.listdir``."""
    read: list[str] = []
    real_scandir, real_listdir = os.scandir, os.listdir

    class CountedScan:
        def __init__(self, path: str) -> None:
            self._inner = real_scandir(path)

        def __iter__(self) -> CountedScan:
            return self

        def __next__(self) -> os.DirEntry[str]:
            entry = next(self._inner)
            read.append(entry.name)
            return entry

        def __enter__(self) -> CountedScan:
            return self

        def __exit__(self, *exc_info: object) -> None:
            self._inner.close()

    def counted_listdir(path: str) -> list[str]:
        names = real_listdir(path)
        read.extend(names)
        return names

    monkeypatch.setattr(os, "scandir", CountedScan)
    monkeypatch.setattr(os, "listdir", counted_listdir)
    return read


class TestWaitersOfOtherNames:
    def test_a_release_reads_no_entry_of_a_waiter_on_another_name(
        self, channel: WakeChannel, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        with contextlib.ExitStack() as waiting:
            others = [waiting.enter_context(channel.subscribe(f"other-{i}")) for i in range(50)]
            job = waiting.enter_context(channel.subscribe("job"))
            channel.notify(["job"])  # the first notify checks the whole path
            assert job.wait(1.0), "the waiter on the released name is woken"
            read = _count_entries_read(monkeypatch)
            channel.notify(["job"])
            assert job.wait(1.0), "the waiter on the released name is woken again"
            disturbed = [i for i, other in enumerate(others) if other.wait(0.0)]
        assert not disturbed, f"waiters on other names were woken: {disturbed}"
        assert len(read) <= 1, (
            f"a release of one name read {len(read)} folder entries: its cost grows with "
            "the waiters of every other name")

    def test_a_release_removes_the_socket_of_a_waiter_that_died_and_its_empty_folder(
        self, channel: WakeChannel
    ) -> None:
        with channel.subscribe("job"):
            pass  # the folder is made and checked, as by any earlier waiter
        dead = _bound_socket(channel.folder, "job")
        dead.close()  # killed: its socket file stays, and nobody reads it
        channel.notify(["job"])
        left = os.listdir(channel.folder)
        assert left == [], f"a dead waiter's socket or its name's folder stayed: {left}"

    def test_a_waiter_arriving_as_the_last_one_of_its_name_leaves_is_still_woken(
        self, channel: WakeChannel, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        with channel.subscribe("job"):
            pass  # the folder is made and checked, as by any earlier waiter
        real_mkdir = os.mkdir
        removed: list[str] = []

        def mkdir_then_last_waiter_leaves(path: str, mode: int = 0o777) -> None:
            real_mkdir(path, mode)
            if not removed:  # the leaving waiter removes the folder just made, once
                removed.append(path)
                os.rmdir(path)

        monkeypatch.setattr(os, "mkdir", mkdir_then_last_waiter_leaves)
        with channel.subscribe("job") as waiter:
            monkeypatch.undo()
            channel.notify(["job"])
            woken = waiter.wait(1.0)
        assert removed, "the name's folder was never made, so the race was not run"
        assert isinstance(waiter, sqlite_wake._SocketWaiter) and woken, (
            f"a waiter whose name's folder vanished before it bound was not woken ({waiter})")

    @settings(max_examples=int(os.environ.get("QUEEN_SYNC_WAKE_EXAMPLES", "40")),
              deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(steps=st.lists(st.tuples(st.sampled_from(["wait", "leave", "release"]),
                                    st.sets(st.sampled_from(["a", "b", "c"]), min_size=1)),
                          max_size=25))
    def test_each_release_wakes_exactly_the_waiters_armed_on_its_names(
        self, channel: WakeChannel, steps: list[tuple[str, set[str]]]
    ) -> None:
        with contextlib.ExitStack() as everything:
            armed: list[tuple[str, Any, contextlib.ExitStack]] = []
            for step, names in steps:
                if step == "wait":
                    for name in sorted(names):
                        own = everything.enter_context(contextlib.ExitStack())
                        armed.append((name, own.enter_context(channel.subscribe(name)), own))
                elif step == "leave":
                    leaving = [w for w in armed if w[0] in names][:1]
                    for waiter in leaving:
                        armed.remove(waiter)
                        waiter[2].close()
                else:
                    channel.notify(sorted(names))
                    woken = sorted(name for name, waiter, _ in armed if waiter.wait(0.0))
                    due = sorted(name for name, _, _ in armed if name in names)
                    assert woken == due, (
                        f"releasing {sorted(names)} woke waiters on {woken}, not on {due}")
        left = os.listdir(channel.folder) if os.path.exists(channel.folder) else []
        assert left == [], f"every waiter left, but these stayed in the folder: {left}"


class TestAWaiterOnAHeldLock:
    def test_its_attempts_after_the_first_read_without_taking_the_write_lock(
        self, tmp_path: Path
    ) -> None:
        url = f"sqlite://{tmp_path / 'q.db'}"
        with qs.Queen(url, renew_thread=False) as holder_client, \
                qs.Queen(url, renew_thread=False) as waiter_client:
            assert holder_client.lock("job", ttl=30).acquire()
            waiter = waiter_client.lock("job", ttl=30)
            waiter_client.locks.get("job")  # connected, so the trace sees every statement
            conn = waiter_client.engine.storage._conn  # type: ignore[attr-defined]
            sent: list[str] = []
            conn.set_trace_callback(sent.append)
            try:
                assert not waiter.acquire(wait=0.3), "the lock stays held"
            finally:
                conn.set_trace_callback(None)
        writes = [s for s in sent if s == "BEGIN IMMEDIATE"]
        reads = [s for s in sent if s == "BEGIN"]
        assert len(writes) == 1 and reads, (
            f"a waiter took the write lock {len(writes)} times and read {len(reads)} times: "
            "once armed it must look without queueing every other writer behind it")


_AS_ANOTHER_EFFECTIVE_USER = """
import json, os, sys
from queen_sync._engines.sqlite_wake import WakeChannel, _SocketWaiter
runtime, database, uid, gid = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
os.setegid(gid)
os.seteuid(uid)  # the real user stays root, as in a service that drops privileges so
os.environ["XDG_RUNTIME_DIR"] = runtime
channel = WakeChannel(database)
with channel.subscribe("job") as waiter:
    channel.notify(["job"])
    woken = waiter.wait(1.0)
print(json.dumps({"socket": isinstance(waiter, _SocketWaiter), "woken": woken,
                  "folder": channel.folder}))
"""


@pytest.mark.skipif(not hasattr(os, "seteuid") or os.geteuid() != 0,
                    reason="only root may take another effective user")
class TestAProcessWhoseEffectiveUserIsNotItsRealUser:
    def test_its_waiters_are_woken_through_a_folder_of_the_user_its_files_belong_to(
        self, tmp_path: Path
    ) -> None:
        nobody = pwd.getpwnam("nobody")
        runtime = Path(tempfile.mkdtemp(prefix="qe"))  # short: a socket path holds ~100 bytes
        try:
            os.chown(runtime, nobody.pw_uid, nobody.pw_gid)
            runtime.chmod(0o700)
            done = subprocess.run(
                [sys.executable, "-c", _AS_ANOTHER_EFFECTIVE_USER, str(runtime),
                 str(tmp_path / "q.db"), str(nobody.pw_uid), str(nobody.pw_gid)],
                capture_output=True, text=True, timeout=30, check=False)
        finally:
            shutil.rmtree(runtime, ignore_errors=True)
        assert done.returncode == 0, f"the probe failed: {done.stderr}"
        seen = json.loads(done.stdout)
        assert seen["socket"] and seen["woken"], (
            f"a process whose files belong to uid {nobody.pw_uid} polls instead of being "
            f"woken: {seen}; {done.stderr.strip()}")
        assert f"queen_sync-{nobody.pw_uid}" in seen["folder"], (
            f"the folder is named for another user than the one owning its files: {seen}")


def _plant_in_name_folder(channel: WakeChannel, name: str, target: Path) -> None:
    """Make the channel's folder (as any earlier waiter does), then plant a symlink as the
    folder of lock ``name``, pointing at ``target``."""
    with channel.subscribe("other"):
        pass
    os.symlink(target, os.path.join(channel.folder, sqlite_wake._digest(name)))


class TestAReleaseTouchesOnlyWakeSockets:
    def test_a_release_of_a_name_whose_folder_is_a_symlink_deletes_none_of_its_targets_files(
        self, channel: WakeChannel, tmp_path: Path
    ) -> None:
        precious = Path(tempfile.mkdtemp(prefix="qp"))  # short: else no send is even tried
        try:
            for i in range(3):
                (precious / f"file{i}.txt").write_text("keep me")
            _plant_in_name_folder(channel, "job", precious)
            channel.notify(["job"])
            left = sorted(p.name for p in precious.iterdir())
        finally:
            shutil.rmtree(precious, ignore_errors=True)
        assert left == ["file0.txt", "file1.txt", "file2.txt"], (
            f"a release of 'job' deleted files outside the wake folder; left: {left}")

    def test_a_release_leaves_an_entry_of_a_name_folder_that_is_no_socket_in_place(
        self, channel: WakeChannel
    ) -> None:
        with channel.subscribe("job"):
            stray = os.path.join(channel.folder, sqlite_wake._digest("job"), "notes.txt")
            Path(stray).write_text("not a waiter")
            channel.notify(["job"])
            kept = os.path.exists(stray)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(stray)  # the waiter's leaving would keep a non-empty folder
        assert kept, "a release removed a regular file it took for a dead waiter's socket"


class TestAWaiterWhoseNameFolderIsNotItsOwn:
    def test_it_never_binds_inside_a_name_folder_that_is_a_symlink(
        self, channel: WakeChannel, caplog: pytest.LogCaptureFixture
    ) -> None:
        elsewhere = Path(tempfile.mkdtemp(prefix="qs"))
        try:
            _plant_in_name_folder(channel, "job", elsewhere)
            with channel.subscribe("job") as waiter:
                made_there = os.listdir(elsewhere)
        finally:
            shutil.rmtree(elsewhere, ignore_errors=True)
        assert made_there == [], f"a waiter bound its socket through a symlink: {made_there}"
        assert isinstance(waiter, sqlite_wake._PollingWaiter), (
            f"a waiter behind a symlinked name folder must poll, it got {waiter}")
        assert "poll" in caplog.text, f"the refusal must be logged: {caplog.text!r}"

    def test_it_never_binds_inside_a_name_folder_others_can_write_and_the_next_one_heals(
        self, channel: WakeChannel
    ) -> None:
        with channel.subscribe("other"):
            pass
        name_folder = os.path.join(channel.folder, sqlite_wake._digest("job"))
        os.mkdir(name_folder)
        os.chmod(name_folder, 0o777)
        with channel.subscribe("job") as refused:
            inside = os.listdir(name_folder)
        with channel.subscribe("job") as next_waiter:
            channel.notify(["job"])
            woken = next_waiter.wait(1.0)
        assert inside == [] and isinstance(refused, sqlite_wake._PollingWaiter), (
            f"a waiter bound inside a name folder others can write: {inside}, {refused}")
        assert isinstance(next_waiter, sqlite_wake._SocketWaiter) and woken, (
            "the refused folder, once empty, must give way to a private one that wakes "
            f"its waiters ({next_waiter}, woken={woken})")


def _remove_name_folder_after_mkdir(monkeypatch: pytest.MonkeyPatch, times: int) -> list[str]:
    """Let the last waiter of a name remove its folder right after each of ``times`` mkdirs."""
    real_mkdir = os.mkdir
    removed: list[str] = []

    def mkdir_then_last_waiter_leaves(path: str, mode: int = 0o777) -> None:
        real_mkdir(path, mode)
        if len(removed) < times and os.path.basename(path) == sqlite_wake._digest("job"):
            removed.append(path)
            os.rmdir(path)

    monkeypatch.setattr(os, "mkdir", mkdir_then_last_waiter_leaves)
    return removed


class TestAWaiterRacingTheLastWaiterOfItsName:
    def test_one_whose_folder_is_removed_many_times_before_it_binds_is_still_woken(
        self, channel: WakeChannel, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture
    ) -> None:
        removed = _remove_name_folder_after_mkdir(monkeypatch, times=10)
        with channel.subscribe("job") as waiter:
            monkeypatch.undo()
            channel.notify(["job"])
            woken = waiter.wait(1.0)
        assert len(removed) == 10, f"the race was run {len(removed)} times, not 10"
        assert isinstance(waiter, sqlite_wake._SocketWaiter) and woken, (
            f"a waiter that lost the race to its name's folder 10 times polls ({waiter})")
        assert "poll" not in caplog.text, f"a lost race was logged as a fallback: {caplog.text}"

    def test_one_that_loses_every_race_polls_for_this_wait_without_a_lasting_warning(
        self, channel: WakeChannel, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture
    ) -> None:
        with channel.subscribe("other"):
            pass
        removed = _remove_name_folder_after_mkdir(monkeypatch, times=10_000)
        with caplog.at_level("WARNING", logger="queen_sync"), \
                channel.subscribe("job") as waiter:
            pass
        monkeypatch.undo()
        assert isinstance(waiter, sqlite_wake._PollingWaiter), f"no bind could work: {waiter}"
        assert 3 < len(removed) <= 1000, f"the retries were not bounded: {len(removed)} tries"
        assert not caplog.records, (
            f"lost races were logged as a lasting fallback: {caplog.text!r}")
        with channel.subscribe("job") as later:
            channel.notify(["job"])
            assert isinstance(later, sqlite_wake._SocketWaiter) and later.wait(1.0), (
                "once the race is over, the next waiter is woken again")


_UNDER_A_RESTRICTIVE_UMASK = """
import json, os, pwd, sys
from queen_sync._engines.sqlite_wake import WakeChannel, _SocketWaiter
runtime, database = sys.argv[1], sys.argv[2]
if os.geteuid() == 0:  # root writes into any folder, so take a user the modes apply to
    nobody = pwd.getpwnam("nobody")
    os.setegid(nobody.pw_gid)
    os.seteuid(nobody.pw_uid)
os.umask(0o277)  # mkdir(0o700) now makes 0500 folders, bind makes 0500 sockets
os.environ["XDG_RUNTIME_DIR"] = runtime
waiting, releasing = WakeChannel(database), WakeChannel(database)
with waiting.subscribe("job") as waiter:
    releasing.notify(["job"])
    woken = waiter.wait(1.0)
print(json.dumps({"socket": isinstance(waiter, _SocketWaiter), "woken": woken}))
"""


class TestAProcessWithARestrictiveUmask:
    def test_its_waiters_are_woken_on_release(self, tmp_path: Path) -> None:
        runtime = Path(tempfile.mkdtemp(prefix="qu"))  # short: a socket path holds ~100 bytes
        try:
            if os.geteuid() == 0:
                nobody = pwd.getpwnam("nobody")
                os.chown(runtime, nobody.pw_uid, nobody.pw_gid)
            runtime.chmod(0o700)
            done = subprocess.run(
                [sys.executable, "-c", _UNDER_A_RESTRICTIVE_UMASK, str(runtime),
                 str(tmp_path / "q.db")],
                capture_output=True, text=True, timeout=30, check=False)
        finally:
            shutil.rmtree(runtime, ignore_errors=True)
        assert done.returncode == 0, f"the probe failed: {done.stderr}"
        seen = json.loads(done.stdout)
        assert seen["socket"] and seen["woken"], (
            f"under umask 0o277 a waiter is not woken on release: {seen}; "
            f"{done.stderr.strip()}")


_STRAY_KINDS = ("file", "fifo", "folder", "symlink_to_file", "symlink_to_socket")


def _plant_stray(folder: str, kind: str, index: int, outside: Path) -> str:
    """Put an entry that is no waiter's socket in ``folder``; return its path."""
    path = os.path.join(folder, f"stray{index}")
    if kind == "file":
        Path(path).write_text("not a waiter")
    elif kind == "fifo":
        os.mkfifo(path, 0o600)
    elif kind == "folder":
        os.mkdir(path, 0o700)
    else:
        os.symlink(outside / ("f" if kind == "symlink_to_file" else "s"), path)
    return path


def _remove_stray(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        os.rmdir(path)
    elif os.path.lexists(path):
        os.unlink(path)


def _received(sock: socket.socket) -> bool:
    try:
        sock.recv(16)
    except BlockingIOError:
        return False
    return True


class TestReleasesAmongStrayEntries:
    @settings(max_examples=int(os.environ.get("QUEEN_SYNC_WAKE_EXAMPLES", "40")),
              deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(strays=st.lists(st.tuples(st.sampled_from(["a", "b"]), st.sampled_from(_STRAY_KINDS)),
                           max_size=6),
           released=st.sets(st.sampled_from(["a", "b", "c"]), min_size=1))
    def test_a_release_wakes_its_waiters_and_leaves_every_stray_entry_and_target_alone(
        self, channel: WakeChannel, strays: list[tuple[str, str]], released: set[str]
    ) -> None:
        outside = Path(tempfile.mkdtemp(prefix="qo"))  # short: a socket path holds ~100 bytes
        (outside / "f").write_text("keep me")
        target = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        target.bind(str(outside / "s"))
        target.setblocking(False)
        try:
            with channel.subscribe("a") as on_a, channel.subscribe("b") as on_b:
                # "c" has no waiter, only a symlink planted as its folder.
                os.symlink(outside, os.path.join(channel.folder, sqlite_wake._digest("c")))
                planted = [_plant_stray(os.path.join(channel.folder, sqlite_wake._digest(name)),
                                        kind, i, outside) for i, (name, kind) in enumerate(strays)]
                channel.notify(sorted(released))
                woken = sorted(name for name, w in (("a", on_a), ("b", on_b)) if w.wait(0.0))
                gone = [p for p in planted if not os.path.lexists(p)]
                for path in planted:
                    _remove_stray(path)  # so that the waiters' leaving empties the folder
                os.unlink(os.path.join(channel.folder, sqlite_wake._digest("c")))
            reached_outside = _received(target)
            outside_left = sorted(p.name for p in outside.iterdir())
        finally:
            target.close()
            shutil.rmtree(outside, ignore_errors=True)
        assert not reached_outside, "a release sent to a socket outside through a symlink"
        assert woken == sorted(released & {"a", "b"}), (
            f"releasing {sorted(released)} woke the waiters on {woken}")
        assert not gone, f"a release removed entries that were no waiter's socket: {gone}"
        assert outside_left == ["f", "s"], (
            f"a release removed files outside the wake folder; left: {outside_left}")
