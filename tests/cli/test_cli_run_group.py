"""``queen-sync run``: nothing of the command's process group outlives the lease.

The lease is the only thing that makes the command's work exclusive, so what the command
left running in its group (``sh -c 'worker &'``) is stopped before the lease is released,
however the command ended.
"""

from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path

import pytest
from cli_helpers import (
    Cli,
    alive,
    cli_fixture,  # noqa: F401  # registers the ``cli`` fixture
    kill_if_alive,
)
from polling import wait_for

LOST_EXIT = 76

pytestmark = [
    pytest.mark.realtime,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc"),
]


def _worker(tmp_path: Path, on_term: str) -> Path:
    """A worker script that sets up its SIGTERM handling, writes its pid, then sleeps 30 s."""
    script = tmp_path / "worker.py"
    script.write_text("import os, pathlib, signal, subprocess, sys, time\n"
                      f"{on_term}\n"
                      f"pathlib.Path({str(tmp_path / 'pid')!r}).write_text(str(os.getpid()))\n"
                      "time.sleep(30)\n")
    return script


def _shell_starting(worker: Path, then: str) -> list[str]:
    """``sh -c``: start ``worker`` in the background, wait until it is ready, then ``then``.

    The worker does not hold the run's output pipes, so a test reads them when run exits.
    """
    ready = worker.parent / "pid"
    return ["sh", "-c", f"'{sys.executable}' '{worker}' >/dev/null 2>&1 & "
                        f"while [ ! -s '{ready}' ]; do sleep 0.02; done; {then}"]


def _pid(tmp_path: Path) -> int:
    return int(wait_for(lambda: (tmp_path / "pid").exists() and (tmp_path / "pid").read_text(),
                        what="the worker to start"))


class TestACommandThatExitsLeavingWorkers:
    def test_a_worker_left_by_a_finished_command_is_stopped_while_the_lease_is_still_held(
            self, cli: Cli, tmp_path: Path) -> None:
        seen = tmp_path / "seen.json"
        # On SIGTERM the worker records who holds the lease, then exits.
        on_term = ("def _term(signum, frame):\n"
                   "    done = subprocess.run([sys.executable, '-m', 'queen_sync', 'holders',\n"
                   "                           'etl', '--json'], capture_output=True)\n"
                   f"    pathlib.Path({str(seen)!r}).write_bytes(done.stdout)\n"
                   "    sys.exit(0)\n"
                   "signal.signal(signal.SIGTERM, _term)")
        command = _shell_starting(_worker(tmp_path, on_term), then="exit 0")
        done = cli.run("run", "etl", "--ttl", "30s", "--grace", "10s", "--", *command)
        pid = _pid(tmp_path)
        try:
            assert not alive(pid), (
                f"the worker (pid {pid}) the command left behind still runs after run exited, "
                "without a lease")
            assert done.returncode == 0, (
                f"the command's own code is kept: {done.returncode}, {done.stderr!r}")
            assert "left 1 process" in done.stderr, (
                f"stderr must warn how many processes the command left: {done.stderr!r}")
            holders = json.loads(seen.read_text())
            assert len(holders) == 1, (
                f"the worker must be stopped BEFORE the lease is released: it saw {holders}")
            assert cli.holders("etl") == [], "the lease is released afterwards"
        finally:
            kill_if_alive(pid)

    def test_a_worker_ignoring_sigterm_is_killed_after_the_grace_when_its_command_exits(
            self, cli: Cli, tmp_path: Path) -> None:
        worker = _worker(tmp_path, "signal.signal(signal.SIGTERM, signal.SIG_IGN)")
        started = time.monotonic()
        done = cli.run("run", "etl", "--ttl", "30s", "--grace", "0.5s", "--",
                       *_shell_starting(worker, then="exit 3"))
        took = time.monotonic() - started
        pid = _pid(tmp_path)
        try:
            assert not alive(pid), f"the worker (pid {pid}) must be SIGKILLed after the grace"
            assert done.returncode == 3, f"the command's own code is kept: {done.returncode}"
            assert took < 0.5 + 5.0, f"SIGKILL must follow the 0.5s grace, run took {took:.2f}s"
        finally:
            kill_if_alive(pid)


class TestAStoppedCommandsWorkers:
    @pytest.mark.parametrize(("stop", "expected"), [
        ("the lease is lost", LOST_EXIT),
        ("a SIGTERM is forwarded", 128 + signal.SIGTERM),
    ])
    def test_a_worker_ignoring_sigterm_is_killed_after_the_grace_though_its_shell_died_at_once(
            self, cli: Cli, tmp_path: Path, stop: str, expected: int) -> None:
        # The shell dies of the SIGTERM at once; its worker ignores it and must get SIGKILL.
        worker = _worker(tmp_path, "signal.signal(signal.SIGTERM, signal.SIG_IGN)")
        runner = cli.start("run", "etl", "--ttl", "2s", "--grace", "0.5s", "--",
                           *_shell_starting(worker, then="wait"))
        pid = _pid(tmp_path)
        try:
            stopped_at = time.monotonic()
            if stop == "the lease is lost":
                token = str(cli.holders("etl")[0]["token"])
                assert cli.run("release", "etl", "--token", token).returncode == 0
            else:
                runner.send_signal(signal.SIGTERM)
            _, err = runner.communicate(timeout=20)
            took = time.monotonic() - stopped_at
            assert not alive(pid), (
                f"when {stop}, the worker (pid {pid}) must be SIGKILLed after the grace; it "
                f"still runs after run exited: {err!r}")
            assert runner.returncode == expected, (
                f"when {stop}, run exits {expected}, got {runner.returncode}: {err!r}")
            assert took < 2.0 + 0.5 + 2.0, f"SIGKILL must follow the grace, took {took:.2f}s"
            assert cli.holders("etl") == [], "the lease is released"
        finally:
            kill_if_alive(pid)
