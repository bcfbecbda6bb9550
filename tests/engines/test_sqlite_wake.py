"""What a release costs the SQLite wake-up channel, and what it still refuses.

Every release notifies the waiters of its lock name. The folder the waiters' sockets
live in is checked (ours, private, on a path nobody else can change) before it is used;
once checked, a release looks at the folder alone, and a folder swapped meanwhile is
checked whole again.
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

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
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(os.path.join(folder, f"{sqlite_wake._digest(name)}.{os.getpid()}.test"))
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
