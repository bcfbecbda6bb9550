"""``queen-sync run`` killed or stopped: its command never runs on past the lease for long."""

from __future__ import annotations

import functools
import signal
import sys
import time
from pathlib import Path

import pytest
from cli_helpers import (
    Cli,
    alive,
    child_waiting_for,
    cli_fixture,  # noqa: F401  # registers the ``cli`` fixture
    kill_if_alive,
)
from polling import wait_for

LOST_EXIT = 76

pytestmark = [
    pytest.mark.realtime,
    pytest.mark.skipif(not sys.platform.startswith("linux"),
                       reason="the parent-death signal is Linux's"),
]


def _pid_writer(report: Path) -> list[str]:
    """A command that writes its pid to ``report`` and then sleeps 30 s."""
    code = ("import os, pathlib, time\n"
            f"pathlib.Path({str(report)!r}).write_text(str(os.getpid()))\n"
            "time.sleep(30)\n")
    return [sys.executable, "-c", code]


def _written(report: Path) -> str:
    """The report's stripped text once it exists (empty, so falsy, until then)."""
    return report.read_text().strip() if report.exists() else ""


class TestTheRunnerKilled:
    def test_a_command_dies_within_a_second_when_its_runner_is_killed_with_sigkill(
            self, cli: Cli, tmp_path: Path) -> None:
        report = tmp_path / "pid"
        runner = cli.start("run", "etl", "--ttl", "30s", "--", *_pid_writer(report))
        pid = int(wait_for(lambda: report.exists() and report.read_text(), what="the command"))
        try:
            runner.kill()
            runner.wait(timeout=5)
            killed_at = time.monotonic()
            while alive(pid) and time.monotonic() - killed_at < 3.0:
                time.sleep(0.02)
            took = time.monotonic() - killed_at
            assert not alive(pid), (
                f"the command (pid {pid}) was still running 3 s after its runner was killed")
            assert took < 1.0, f"the command must die within ~1 s of its runner, took {took:.2f}s"
        finally:
            kill_if_alive(pid)

    def test_processes_the_command_started_die_too_when_its_runner_is_killed(
            self, cli: Cli, tmp_path: Path) -> None:
        report = tmp_path / "pid"
        script = tmp_path / "writer.py"
        script.write_text(_pid_writer(report)[-1])
        # Not a lone command, so the shell forks the writer instead of becoming it.
        runner = cli.start("run", "etl", "--ttl", "30s", "--", "sh", "-c",
                           f"'{sys.executable}' '{script}'; true")
        pid = int(wait_for(lambda: report.exists() and report.read_text(), what="the command"))
        try:
            runner.kill()
            runner.wait(timeout=5)
            killed_at = time.monotonic()
            while alive(pid) and time.monotonic() - killed_at < 3.0:
                time.sleep(0.02)
            took = time.monotonic() - killed_at
            assert not alive(pid), (
                f"a process the command started (pid {pid}) outlived the killed runner by 3 s")
            assert took < 1.0, f"it must die within ~1 s of its runner, took {took:.2f}s"
        finally:
            kill_if_alive(pid)


    def test_a_runner_killed_the_moment_its_command_starts_leaves_nothing_of_it_running(
            self, cli: Cli, tmp_path: Path) -> None:
        # The command forks a worker and kills its runner at once, standing in for the OOM
        # killer striking as the command starts; a race, so several runs at once.
        runs = 8
        for i in range(runs):
            cli.start("run", f"etl-{i}", "--ttl", "30s", "--", "sh", "-c",
                      f"sleep 30 & echo $! > '{tmp_path}/pid-{i}'; kill -9 $PPID; wait")
        reports = [tmp_path / f"pid-{i}" for i in range(runs)]
        for process in cli.started:
            process.wait(timeout=20)
        pids = [int(wait_for(functools.partial(_written, report), what="a worker's pid"))
                for report in reports]
        try:
            wait_for(lambda: not any(alive(pid) for pid in pids), timeout=3.0,
                     what="every worker to die with its runner")
        except AssertionError:
            survivors = [pid for pid in pids if alive(pid)]
            raise AssertionError(f"{len(survivors)} of {runs} workers outlived their killed "
                                 f"runner by 3 s, running without a lease: {survivors}") from None
        finally:
            for pid in pids:
                kill_if_alive(pid)


class TestTheRunnerStopped:
    def test_a_runner_stopped_past_its_ttl_stops_its_command_when_continued(
            self, cli: Cli, tmp_path: Path) -> None:
        report, go = tmp_path / "pid", tmp_path / "go"
        first = cli.start("run", "etl", "--ttl", "2s", "--grace", "2s", "--",
                          *_pid_writer(report))
        pid = int(wait_for(lambda: report.exists() and report.read_text(), what="the command"))
        try:
            first.send_signal(signal.SIGSTOP)
            time.sleep(2.3)  # past the 2 s lifetime: nobody renews a stopped runner's lease
            second = cli.start("run", "etl", "--ttl", "30s", "--",
                               *child_waiting_for(go, tmp_path / "second.json"))
            wait_for((tmp_path / "second.json").exists, what="a second run to take the lease")
            continued_at = time.monotonic()
            first.send_signal(signal.SIGCONT)
            _, err = first.communicate(timeout=10)
            took = time.monotonic() - continued_at
            assert first.returncode == LOST_EXIT, (
                f"a continued runner whose lease expired must exit {LOST_EXIT}, got "
                f"{first.returncode}: {err!r}")
            assert "lost" in err, f"stderr must say the lease was lost: {err!r}"
            assert not alive(pid), "the first command must be stopped"
            assert took < 1.5, f"the command must be stopped at once on SIGCONT, took {took:.2f}s"
            go.touch()
            second.communicate(timeout=10)
            assert second.returncode == 0, f"the second run is unharmed: {second.returncode}"
        finally:
            kill_if_alive(pid)
