"""Closing a client while other threads acquire never reads another thread's stack.

On CPython 3.11, walking the frames of another thread that is starting or ending can crash
the interpreter, or spin in C where no signal reaches it (python/cpython#111363 and its
kin): a CI run hung for an hour inside ``close()`` this way, and a local run of the same
race died of SIGSEGV. So an acquire in flight is told apart by a lock its attempt holds
while it runs, never by looking for its frame on a stack.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Callable

import pytest
from test_process_life import enter_until_closed

import queen_sync as qs

ROOT = Path(__file__).resolve().parents[2]
ROUNDS = int(os.environ.get("QUEEN_SYNC_CLOSE_RACE_ROUNDS", "6"))


def close_among_workers(url: str, label: str, workers: int = 4) -> list[str]:
    """Close a client while ``workers`` threads acquire on it; the names they took."""
    q = qs.Queen(url)
    names: list[str] = []
    threads = [threading.Thread(target=enter_until_closed, args=(q, f"{label}-{k}", names),
                                daemon=True) for k in range(workers)]
    for thread in threads:
        thread.start()
    time.sleep(0.02)
    q.close()
    for thread in threads:
        thread.join(10)
    assert not any(thread.is_alive() for thread in threads), "a worker outlived close()"
    return names


class TestClosingAmongAcquiringThreads:
    def test_never_reads_the_frames_of_another_thread(
            self, sqlite_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
        reads: list[str] = []
        real: Callable[[], dict[int, FrameType]] = sys._current_frames

        def recorded() -> dict[int, FrameType]:
            reads.append(threading.current_thread().name)
            return real()

        monkeypatch.setattr(sys, "_current_frames", recorded)
        for run in range(3):
            close_among_workers(sqlite_url, f"run{run}")
        monkeypatch.undo()
        assert not reads, (f"sys._current_frames() was called {len(reads)} times (first by "
                           f"{reads[0]}): CPython 3.11 can crash walking what it returns")

    @pytest.mark.realtime
    def test_a_process_closing_clients_among_threads_round_after_round_ends_cleanly(
            self, tmp_path: Path) -> None:
        # In a child process: a crash or a hang in C then fails this test instead of the run.
        script = textwrap.dedent(f"""
            import sys
            sys.path.insert(0, {str(Path(__file__).parent)!r})
            import queen_sync as qs
            from test_close_reads_no_other_stack import close_among_workers
            url = "sqlite:///" + {str(tmp_path / "q.db")!r}
            taken = []
            for run in range({ROUNDS}):
                taken += close_among_workers(url, f"run{{run}}")
            with qs.Queen(url) as probe:
                held = [name for name in taken if probe.locks.get(name)["held"]]
            print(len(taken), len(held), held[:3])
        """)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        try:
            done = subprocess.run([sys.executable, "-c", script], capture_output=True,
                                  text=True, timeout=60 + 10 * ROUNDS, env=env)
        except subprocess.TimeoutExpired as exc:
            pytest.fail(f"the process hung closing clients among threads: {exc.stderr!r}")
        assert done.returncode == 0, (
            f"the process ended with {done.returncode}: {done.stderr[-2000:]}")
        taken, held, first = done.stdout.split(maxsplit=2)
        assert int(taken) > 0, "setup: no worker took a lock"
        assert held == "0", f"permits still held after close() returned: {first}"
