"""Ends a pytest run that has stopped making progress, printing every thread's stack first.

pytest-timeout's SIGALRM is handled only between bytecodes: a test stuck inside C (a spin
in the interpreter, a wait with signals blocked) would hold CI until its own limit, printing
nothing. A separate process watches a file the run touches as each test starts and ends;
once it is older than the limit, the guard sends SIGABRT, whose faulthandler report (pytest
enables it) shows where every thread stood, and the run fails.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

LIMIT = float(os.environ.get("QUEEN_SYNC_STALL_LIMIT", "600"))  # seconds without progress


class StallGuard:
    """The watching process of this run, and the file it watches."""

    def __init__(self, limit: float = LIMIT) -> None:
        handle, name = tempfile.mkstemp(prefix="queen-sync-progress-")
        os.close(handle)
        self.beat_file = Path(name)
        self._process: Optional[subprocess.Popen[bytes]] = subprocess.Popen(
            [sys.executable, __file__, str(os.getpid()), name, str(limit)])

    def beat(self) -> None:
        os.utime(self.beat_file)

    def stop(self) -> None:
        if self._process is not None:
            self._process.terminate()
            self._process.wait(10)
            self._process = None
        self.beat_file.unlink(missing_ok=True)


_guards: list[StallGuard] = []


def pytest_sessionstart(session: object) -> None:
    _guards.append(StallGuard())


def pytest_runtest_logstart(nodeid: str, location: object) -> None:
    for guard in _guards:
        guard.beat()


def pytest_runtest_logfinish(nodeid: str, location: object) -> None:
    for guard in _guards:
        guard.beat()


def pytest_sessionfinish(session: object) -> None:
    while _guards:
        _guards.pop().stop()


def _watch(pid: int, beat_file: str, limit: float) -> None:
    while os.getppid() == pid:  # re-parented: the run is over
        time.sleep(min(5.0, limit / 4))
        try:
            age = time.time() - os.stat(beat_file).st_mtime
        except FileNotFoundError:
            return
        if age > limit:
            sys.stderr.write(f"\nstall guard: no test started or ended for {age:.0f}s; "
                             f"aborting pytest (pid {pid}) to print its stacks\n")
            sys.stderr.flush()
            os.kill(pid, signal.SIGABRT)
            for _ in range(60):  # the report can take a moment; then it must be over
                time.sleep(0.5)
                if os.getppid() != pid:
                    break
            else:
                os.kill(pid, signal.SIGKILL)
            os.unlink(beat_file)
            return


if __name__ == "__main__":
    _watch(int(sys.argv[1]), sys.argv[2], float(sys.argv[3]))
