"""A fork landing while another thread closes a client must not carry that client's
open SQLite connection into the child (the child's SQLite would then trust locks only
the parent holds: two writers, one token answered twice)."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import pytest

import queen_sync as qs
import queen_sync._engines.sqlite as sqlite_engine


class _PausingLock:
    """``_OPENING``, except that the closing thread stops before taking it until told."""

    def __init__(self, inner: Any, closer: list[threading.Thread]) -> None:
        self._inner, self._closer = inner, closer
        self.reached, self.go = threading.Event(), threading.Event()

    def acquire(self, *args: Any) -> bool:
        here = threading.current_thread()
        # close() does its closing on a thread of its own, which the closing thread starts.
        if self._closer and (here is self._closer[0] or here.name == "queen_sync-close"):
            self.reached.set()
            self.go.wait(1.0)  # a fork that waits for this close gets it after this
        return bool(self._inner.acquire(*args))

    def release(self) -> None:
        self._inner.release()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()


def _store_descriptors(path: Path) -> list[str]:
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(str(path)):
            found.append(target)
    return found


class TestAForkWhileAThreadClosesAClient:
    @pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
    def test_leaves_no_connection_of_the_store_open_in_the_child(
            self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        path = tmp_path / "q.db"
        client = qs.Queen(f"sqlite://{path}", renew_thread=False)
        assert client.kv.put("app", "k", 1, forever=True), "setup: the store takes a write"
        closer: list[threading.Thread] = []
        pausing = _PausingLock(sqlite_engine._OPENING, closer)
        monkeypatch.setattr(sqlite_engine, "_OPENING", pausing)
        closer.append(threading.Thread(target=client.close))
        closer[0].start()
        assert pausing.reached.wait(10), "setup: the close never reached the opening lock"
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: which of the store's files does it have open?
            os.write(write, repr(_store_descriptors(path)).encode())
            os._exit(0)
        os.close(write)
        pausing.go.set()
        closer[0].join(10)
        os.waitpid(pid, 0)
        inherited = os.read(read, 65536).decode()
        os.close(read)
        assert inherited == "[]", (
            f"the child was forked holding the closing client's SQLite files open: {inherited}")
