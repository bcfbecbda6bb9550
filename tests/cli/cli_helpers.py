"""Helpers for running the real ``queen-sync`` command (``python -m queen_sync``)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest

REPO = Path(__file__).resolve().parents[2]
QUEEN_SYNC = [sys.executable, "-m", "queen_sync"]


def child_waiting_for(go: Path, report: Path) -> list[str]:
    """A child command that writes its QUEEN_LOCK_* environment to ``report``, then waits for
    ``go`` to exist (20 s at most)."""
    # Written aside and renamed: a test waiting for the report must never read it half-written.
    code = (
        "import json, os, pathlib, time\n"
        f"pathlib.Path({str(report)!r} + '.part').write_text(json.dumps("
        "{k: v for k, v in os.environ.items() if k.startswith('QUEEN_LOCK_')}))\n"
        f"os.replace({str(report)!r} + '.part', {str(report)!r})\n"
        "deadline = time.time() + 20\n"
        f"while not os.path.exists({str(go)!r}) and time.time() < deadline:\n"
        "    time.sleep(0.02)\n"
    )
    return [sys.executable, "-c", code]


def alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie nobody has reaped yet counts as dead)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            state = stat.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def kill_if_alive(pid: int) -> None:
    if alive(pid):
        os.kill(pid, signal.SIGKILL)


class Cli:
    """Starts ``queen-sync`` processes with QUEEN_URL set to one test's SQLite file."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.env = dict(os.environ, QUEEN_URL=url,
                        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO),
                                                                 os.environ.get("PYTHONPATH")])))
        self.started: list[subprocess.Popen[str]] = []

    def start(self, *args: str) -> subprocess.Popen[str]:
        process = subprocess.Popen([*QUEEN_SYNC, *args], env=self.env, text=True,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.started.append(process)
        return process

    def run(self, *args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*QUEEN_SYNC, *args], env=self.env, text=True,
                              capture_output=True, timeout=timeout, check=False)

    def holders(self, name: str) -> list[dict[str, Any]]:
        done = self.run("holders", name, "--json")
        assert done.returncode == 0, f"holders failed: {done.stderr}"
        rows: list[dict[str, Any]] = json.loads(done.stdout)
        return rows

    def stop_all(self) -> None:
        """SIGTERM (the runner forwards it to its command's group), then SIGKILL, then reap."""
        for process in self.started:
            if process.poll() is None:
                process.terminate()
                try:
                    process.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    process.kill()
            try:
                process.communicate(timeout=5)
            except subprocess.TimeoutExpired:  # an orphaned command still holds the pipes
                for pipe in (process.stdout, process.stderr):
                    if pipe is not None:
                        pipe.close()
                process.wait()


@pytest.fixture(name="cli")
def cli_fixture(sqlite_url: str) -> Iterator[Cli]:
    """``queen-sync`` processes sharing this test's SQLite file (killed at the end)."""
    runner = Cli(sqlite_url)
    yield runner
    runner.stop_all()
