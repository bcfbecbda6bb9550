"""The test server's ``frozen()``: every process of the server stopped, even one forked
while it was being frozen (a session another thread was opening)."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from typing import Iterator

import psycopg
import pytest
from pg_server import PgServer, frozen

TRIALS = int(os.environ.get("QUEEN_SYNC_FREEZE_TRIALS", "25"))


@pytest.fixture
def server() -> Iterator[PgServer]:
    running = PgServer.start_new()
    yield running
    running.destroy()


def _postmaster(server: PgServer) -> int:
    with open(os.path.join(server.data, "postmaster.pid"), encoding="utf-8") as handle:
        return int(handle.readline())


def _states_of_children(parent: int) -> dict[int, str]:
    """Each child of ``parent`` and its state letter (``T``: stopped)."""
    states = {}
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat", encoding="utf-8") as handle:
                fields = handle.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == parent:
            states[int(entry)] = fields[0]
    return states


class TestAServerFrozenWhileSessionsOpen:
    def test_every_process_of_the_server_is_stopped_inside_frozen(
            self, server: PgServer) -> None:
        done = threading.Event()

        def open_sessions() -> None:
            while not done.is_set():
                # A session opened across a freeze may time out.
                with contextlib.suppress(psycopg.Error):
                    psycopg.connect(server.url, connect_timeout=3).close()

        openers = [threading.Thread(target=open_sessions, daemon=True) for _ in range(4)]
        for opener in openers:
            opener.start()
        postmaster = _postmaster(server)
        running: list[tuple[int, dict[int, str]]] = []
        try:
            time.sleep(0.2)  # the openers are forking backends by now
            for trial in range(TRIALS):
                with frozen(server):
                    # Stopped, finished (a zombie), or traced: anything but running.
                    awake = {pid: state for pid, state in _states_of_children(postmaster).items()
                             if state not in "TtZX"}
                if awake:
                    running.append((trial, awake))
                time.sleep(0.01)
        finally:
            done.set()
            for opener in openers:
                opener.join(10)
        assert not running, (
            f"processes of a frozen server kept running (trial, pid: state): {running}")
