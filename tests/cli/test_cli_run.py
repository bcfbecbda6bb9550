"""``queen-sync run``: real processes sharing one embedded SQLite file."""

from __future__ import annotations

import contextlib
import json
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest
from cli_helpers import (
    Cli,
    child_waiting_for,
    cli_fixture,  # noqa: F401  # registers the ``cli`` fixture
)
from polling import wait_for

from queen_sync.testing import LocalBroker

LOST_EXIT = 76
BUSY_EXIT = 75


def _sleeper(report: Path, *, on_term: str = "") -> list[str]:
    """A child that optionally handles SIGTERM, reports its start, then sleeps 30 s."""
    code = (
        "import os, pathlib, signal, sys, time\n"
        f"{on_term}\n"
        f"pathlib.Path({str(report)!r}).write_text(os.environ['QUEEN_LOCK_TOKEN'])\n"
        "time.sleep(30)\n"
    )
    return [sys.executable, "-c", code]


class TestOneHolderAtATime:
    def test_two_concurrent_runs_let_one_run_and_the_other_exit_75_naming_the_holder(
            self, cli: Cli, tmp_path: Path) -> None:
        go = tmp_path / "go"
        runs = [cli.start("run", "nightly", "--ttl", "30s", "--",
                          *child_waiting_for(go, tmp_path / f"ran-{i}.json")) for i in (0, 1)]
        loser = wait_for(lambda: next((p for p in runs if p.poll() is not None), None),
                         what="one runner to give up")
        winner = runs[1 - runs.index(loser)]
        # The busy runner gave up while the holder's child still waits for ``go``: it did
        # not wait its turn.
        assert winner.poll() is None, "the busy runner must exit while the lock is still held"
        reports = wait_for(lambda: list(tmp_path.glob("ran-*.json")), what="the child to start")
        go.touch()
        _, loser_err = loser.communicate(timeout=10)
        winner.communicate(timeout=20)
        owner = json.loads(reports[0].read_text())["QUEEN_LOCK_OWNER"]
        assert len(reports) == 1, f"exactly one child must run, got {reports}"
        assert loser.returncode == BUSY_EXIT, (
            f"busy must exit 75, got {loser.returncode}: {loser_err!r}")
        assert owner in loser_err, f"busy message must name the holder {owner}: {loser_err!r}"
        assert winner.returncode == 0, "the winner exits with its child's code"

    def test_busy_exit_code_can_be_changed(self, cli: Cli, tmp_path: Path) -> None:
        go = tmp_path / "go"
        holder = cli.start("run", "job", "--ttl", "30s", "--",
                           *child_waiting_for(go, tmp_path / "ran.json"))
        wait_for((tmp_path / "ran.json").exists, what="the first child")
        busy = cli.run("run", "job", "--busy-exit-code", "0", "--", "true")
        go.touch()
        holder.communicate(timeout=20)
        assert busy.returncode == 0, f"--busy-exit-code 0 must exit 0, got {busy.returncode}"
        assert "busy" in busy.stderr, f"busy must still be reported: {busy.stderr!r}"

    def test_wait_takes_the_lease_once_the_holder_finishes(self, cli: Cli,
                                                            tmp_path: Path) -> None:
        go = tmp_path / "go"
        holder = cli.start("run", "job", "--ttl", "30s", "--",
                           *child_waiting_for(go, tmp_path / "first.json"))
        wait_for((tmp_path / "first.json").exists, what="the first child")
        waiter = cli.start("run", "job", "--wait", "20s", "--",
                           *child_waiting_for(go, tmp_path / "second.json"))
        time.sleep(0.3)
        assert waiter.poll() is None, "a runner with --wait must wait while the lease is busy"
        go.touch()
        holder.communicate(timeout=20)
        waiter.communicate(timeout=20)
        assert waiter.returncode == 0, f"the waiter must run once free, got {waiter.returncode}"
        assert (tmp_path / "second.json").exists(), "the waiter's child must have run"

    def test_limit_lets_as_many_runs_hold_as_there_are_slots(self, cli: Cli,
                                                              tmp_path: Path) -> None:
        go = tmp_path / "go"
        runs = [cli.start("run", "pool", "--limit", "2", "--ttl", "30s", "--",
                          *child_waiting_for(go, tmp_path / f"ran-{i}.json")) for i in (0, 1)]
        reports = wait_for(lambda: len(list(tmp_path.glob("ran-*.json"))) == 2,
                           what="both children")
        third = cli.run("run", "pool", "--limit", "2", "--", "true")
        go.touch()
        for process in runs:
            process.communicate(timeout=20)
        slots = sorted(json.loads(p.read_text())["QUEEN_LOCK_SLOT"]
                       for p in tmp_path.glob("ran-*.json"))
        assert reports and slots == ["0", "1"], f"two runs must hold slots 0 and 1, got {slots}"
        assert third.returncode == BUSY_EXIT, f"a third run must be busy, got {third.returncode}"


class TestTheChild:
    def test_the_child_sees_the_four_variables_and_its_token_matches_holders_json(
            self, cli: Cli, tmp_path: Path) -> None:
        go, report = tmp_path / "go", tmp_path / "env.json"
        runner = cli.start("run", "daily-report", "--ttl", "30s", "--",
                           *child_waiting_for(go, report))
        wait_for(report.exists, what="the child to start")
        env = json.loads(report.read_text())
        rows = cli.holders("daily-report")
        go.touch()
        runner.communicate(timeout=20)
        assert set(env) == {"QUEEN_LOCK_NAME", "QUEEN_LOCK_OWNER", "QUEEN_LOCK_TOKEN",
                            "QUEEN_LOCK_SLOT"}, f"unexpected environment {env}"
        assert env["QUEEN_LOCK_NAME"] == "daily-report"
        assert len(rows) == 1, f"one holder expected, got {rows}"
        assert str(rows[0]["token"]) == env["QUEEN_LOCK_TOKEN"], (rows, env)
        assert rows[0]["owner"] == env["QUEEN_LOCK_OWNER"], (rows, env)
        assert str(rows[0]["slot"]) == env["QUEEN_LOCK_SLOT"], (rows, env)
        assert cli.holders("daily-report") == [], "the lease is released when the child ends"

    @pytest.mark.parametrize(("code", "expected"), [
        ("raise SystemExit(0)", 0),
        ("raise SystemExit(3)", 3),
        ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", 128 + 9),
    ])
    def test_the_exit_code_is_the_childs_own(self, cli: Cli, code: str, expected: int) -> None:
        done = cli.run("run", "job", "--ttl", "30s", "--", sys.executable, "-c", code)
        assert done.returncode == expected, f"{code!r}: {done.returncode}, {done.stderr!r}"
        assert cli.holders("job") == [], "the lease is released however the child ended"

    def test_a_command_that_does_not_exist_exits_127_and_releases(self, cli: Cli) -> None:
        done = cli.run("run", "job", "--", "no-such-command-queen-sync-test")
        assert done.returncode == 127, f"got {done.returncode}: {done.stderr!r}"
        assert "not found" in done.stderr
        assert cli.holders("job") == [], "nothing stays held"

    @pytest.mark.parametrize(("content", "mode"), [
        ("echo no shebang\n", 0o755),
        ("#!/bin/sh\necho not executable\n", 0o644),
        ("#!/no/such/interpreter\necho bad interpreter\n", 0o755),
    ], ids=["without a shebang", "not executable", "with a missing interpreter"])
    def test_a_file_that_cannot_be_executed_exits_126_and_releases(
            self, cli: Cli, tmp_path: Path, content: str, mode: int) -> None:
        program = tmp_path / "job"
        program.write_text(content)
        program.chmod(mode)
        done = cli.run("run", "job", "--", str(program))
        assert done.returncode == 126, (
            f"an existing file that cannot be executed exits 126, got {done.returncode}: "
            f"{done.stderr!r}")
        assert "could not be executed" in done.stderr and str(program) in done.stderr, (
            f"stderr must name the program and say why: {done.stderr!r}")
        assert "Traceback" not in done.stderr, f"no traceback: {done.stderr!r}"
        assert cli.holders("job") == [], "nothing stays held"

    def test_a_directory_given_as_the_command_exits_126_saying_so_on_one_line(
            self, cli: Cli, tmp_path: Path) -> None:
        done = cli.run("run", "job", "--", str(tmp_path))
        assert done.returncode == 126, f"a directory cannot be executed: {done.returncode}"
        assert done.stderr.splitlines() == [
            f"queen-sync: the command could not be executed: {tmp_path} (it is a directory)"
        ], f"one line naming the program and why: {done.stderr!r}"

    def test_a_command_that_is_not_found_is_reported_on_one_line(self, cli: Cli) -> None:
        done = cli.run("run", "job", "--", "no-such-command-queen-sync-test", "--flag")
        assert done.stderr.splitlines() == [
            "queen-sync: command not found: no-such-command-queen-sync-test"
        ], f"one line, as env(1) prints it, no traceback: {done.stderr!r}"

    def test_an_empty_command_name_exits_127_as_a_shell_does_and_releases(
            self, cli: Cli) -> None:
        shell = subprocess.run(["sh", "-c", '""'], capture_output=True, check=False)
        done = cli.run("run", "job", "--", "", "--flag")
        assert done.returncode == shell.returncode == 127, (
            f"an empty name is a command not found, as sh -c '\"\"' says ({shell.returncode}), "
            f"got {done.returncode}: {done.stderr!r}")
        assert done.stderr.splitlines() == ["queen-sync: command not found: '' (an empty name)"], (
            f"one line naming the empty program: {done.stderr!r}")
        assert cli.holders("job") == [], "nothing stays held"


class TestLosingTheLease:
    @pytest.mark.parametrize("how", ["release --token", "row deleted"])
    def test_a_runner_whose_lease_is_taken_away_stops_its_child_within_the_ttl(
            self, cli: Cli, tmp_path: Path, how: str) -> None:
        report = tmp_path / "token"
        runner = cli.start("run", "etl", "--ttl", "2s", "--grace", "5s", "--",
                           *_sleeper(report))
        token = wait_for(lambda: report.exists() and report.read_text(), what="the child")
        taken_at = time.monotonic()
        if how == "release --token":
            done = cli.run("release", "etl", "--token", token)
            assert done.returncode == 0, f"release must succeed: {done.stderr!r}"
        else:
            with contextlib.closing(sqlite3.connect(cli.url.removeprefix("sqlite://"))) as db:
                deleted = db.execute("DELETE FROM queen_kv WHERE ns = 'queen-locks'").rowcount
                db.commit()
            assert deleted == 1, "the permit row must have been there"
        _, err = runner.communicate(timeout=20)
        stopped_after = time.monotonic() - taken_at
        assert runner.returncode == LOST_EXIT, f"lost must exit {LOST_EXIT}: {runner.returncode}"
        assert "lost" in err, f"stderr must say the lease was lost: {err!r}"
        assert stopped_after < 2.0, f"the child must stop within the TTL, took {stopped_after:.2f}s"

    def test_a_child_that_ignores_sigterm_is_killed_after_the_grace(self, cli: Cli,
                                                                   tmp_path: Path) -> None:
        report = tmp_path / "token"
        ignore = "signal.signal(signal.SIGTERM, signal.SIG_IGN)"
        runner = cli.start("run", "etl", "--ttl", "2s", "--grace", "0.3s", "--",
                           *_sleeper(report, on_term=ignore))
        token = wait_for(lambda: report.exists() and report.read_text(), what="the child")
        assert cli.run("release", "etl", "--token", token).returncode == 0
        started = time.monotonic()
        runner.communicate(timeout=20)
        assert runner.returncode == LOST_EXIT, f"got {runner.returncode}"
        assert time.monotonic() - started < 2.0 + 0.3 + 1.0, "SIGKILL must follow the grace"


class TestSignals:
    def test_sigterm_to_the_runner_reaches_the_child_and_releases_the_lease(
            self, cli: Cli, tmp_path: Path) -> None:
        report, got = tmp_path / "token", tmp_path / "got"
        on_term = ("def _term(signum, frame):\n"
                   f"    pathlib.Path({str(got)!r}).write_text(str(signum)); sys.exit(7)\n"
                   "signal.signal(signal.SIGTERM, _term)")
        runner = cli.start("run", "etl", "--ttl", "30s", "--", *_sleeper(report, on_term=on_term))
        wait_for(report.exists, what="the child")
        assert len(cli.holders("etl")) == 1, "the runner must hold the lease"
        runner.send_signal(signal.SIGTERM)
        runner.communicate(timeout=20)
        assert got.read_text() == str(int(signal.SIGTERM)), "the child must receive SIGTERM"
        assert runner.returncode == 7, f"the child's own code is kept, got {runner.returncode}"
        assert cli.holders("etl") == [], "the lease must be released"

    def test_sigint_to_the_runner_is_forwarded_once(self, cli: Cli, tmp_path: Path) -> None:
        report, got = tmp_path / "token", tmp_path / "got"
        on_term = ("def _int(signum, frame):\n"
                   f"    with open({str(got)!r}, 'a') as f: f.write('int ')\n"
                   "signal.signal(signal.SIGINT, _int)")
        code = _sleeper(report, on_term=on_term)
        code[-1] = code[-1].replace("time.sleep(30)", "time.sleep(0.6)")
        runner = cli.start("run", "etl", "--ttl", "30s", "--", *code)
        wait_for(report.exists, what="the child")
        runner.send_signal(signal.SIGINT)
        runner.communicate(timeout=20)
        assert got.read_text() == "int ", f"SIGINT must reach the child once: {got.read_text()!r}"
        assert runner.returncode == 0, f"got {runner.returncode}"

    def test_a_child_that_ignores_a_forwarded_sigterm_is_killed_after_the_grace(
            self, cli: Cli, tmp_path: Path) -> None:
        report = tmp_path / "token"
        ignore = "signal.signal(signal.SIGTERM, signal.SIG_IGN)"
        runner = cli.start("run", "etl", "--ttl", "30s", "--grace", "0.5s", "--",
                           *_sleeper(report, on_term=ignore))
        wait_for(report.exists, what="the child")
        sent_at = time.monotonic()
        runner.send_signal(signal.SIGTERM)
        _, err = runner.communicate(timeout=20)
        took = time.monotonic() - sent_at
        assert runner.returncode == 128 + signal.SIGKILL, (
            f"the child's own status (killed by SIGKILL) is the exit code: {runner.returncode}")
        assert "grace" in err, f"stderr must say why the command was killed: {err!r}"
        assert 0.5 <= took < 0.5 + 5.0, f"SIGKILL must follow the 0.5s grace, not {took:.2f}s"
        assert cli.holders("etl") == [], "the lease must be released"


@pytest.fixture
def broker_cli(tmp_path: Path) -> Iterator[tuple[LocalBroker, Cli]]:
    """``queen-sync`` processes on a LocalBroker in this process, whose faults a test sets."""
    with LocalBroker(str(tmp_path / "broker.db")) as broker:
        runner = Cli(broker.url)
        yield broker, runner
        runner.stop_all()


class TestTheFinalRelease:
    def test_a_failed_final_release_keeps_the_commands_exit_code_and_warns(
            self, broker_cli: tuple[LocalBroker, Cli], tmp_path: Path) -> None:
        broker, cli = broker_cli
        go, report = tmp_path / "go", tmp_path / "env.json"
        runner = cli.start("run", "etl", "--ttl", "30s", "--", *child_waiting_for(go, report))
        wait_for(report.exists, what="the command to start")
        broker.faults.fail_next(50, status=500, route="locks")  # every release from now on
        go.touch()
        _, err = runner.communicate(timeout=20)
        broker.faults.clear()
        assert runner.returncode == 0, (
            f"the command succeeded, so run must exit 0, got {runner.returncode}: {err!r}")
        assert "could not release" in err and "expire" in err, (
            f"stderr must warn that the lease was not released and will expire: {err!r}")
        assert "30s" in err, f"the warning must say within what time it expires: {err!r}"
