"""``queen-sync`` when things go wrong: a closed stdout, an engine out of reach, a refused name.

Each failure is one line on stderr, as env(1) and flock(1) print theirs; ``run --json``
still ends stdout with the run's result; a reader that went away costs no traceback.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from typing import Any

import pytest
from cli_helpers import (
    QUEEN_SYNC,
    Cli,
    cli_fixture,  # noqa: F401  # registers the ``cli`` fixture
)
from pg_server import free_port
from test_cli_run_json import RUN_KEYS

import queen_sync as qs
from queen_sync._front.cli import main
from queen_sync.testing import LocalBroker

EPIPE_EXIT = 128 + 13  # what a shell reports for a tool that SIGPIPE ended


def _into_a_closed_pipe(cli: Cli, *args: str) -> subprocess.CompletedProcess[str]:
    """``queen-sync ARGS`` with stdout a pipe whose reader is gone, as with ``| head -0``."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        return subprocess.run([*QUEEN_SYNC, *args], stdout=write_end, stderr=subprocess.PIPE,
                              text=True, env=cli.env, timeout=60, check=False)
    finally:
        os.close(write_end)


def _last_json_line(stdout: str) -> dict[str, Any]:
    lines = stdout.splitlines()
    assert lines, "--json must end stdout with the run's result, whatever the outcome"
    result: dict[str, Any] = json.loads(lines[-1])
    assert set(result) == RUN_KEYS, f"the keys must not depend on the outcome: {sorted(result)}"
    return result


class TestAReaderThatWentAway:
    @pytest.mark.parametrize(("command", "code"), [(["true"], 0), (["sh", "-c", "exit 3"], 3)])
    def test_a_finished_run_exits_with_the_commands_code_and_no_traceback(
            self, cli: Cli, command: list[str], code: int) -> None:
        done = _into_a_closed_pipe(cli, "run", "job", "--json", "--", *command)
        assert done.returncode == code, f"the command's code stands: {done.returncode}, " \
                                        f"{done.stderr!r}"
        assert "Traceback" not in done.stderr and "Broken pipe" not in done.stderr, done.stderr
        assert cli.holders("job") == [], "the lease was not released"

    @pytest.mark.parametrize("args", [["holders", "job"], ["holders", "job", "--json"],
                                      ["ping"], ["ping", "--json"]])
    def test_other_commands_end_quietly_as_sigpipe_would_end_them(
            self, cli: Cli, args: list[str]) -> None:
        done = _into_a_closed_pipe(cli, *args)
        assert done.returncode == EPIPE_EXIT, f"{args}: exit {done.returncode}, {done.stderr!r}"
        assert done.stderr == "", f"{args}: nothing to say to a reader that left: {done.stderr!r}"


def _run_json_failure(capsys: pytest.CaptureFixture[str], argv: list[str]) -> tuple[
        int, dict[str, Any], str]:
    code = main(argv)
    out, err = capsys.readouterr()
    assert err.count("\n") == 1 and err.startswith("queen-sync: "), f"one line: {err!r}"
    return code, _last_json_line(out), err


class TestTheJsonResultOfARunThatCouldNotStart:
    @pytest.mark.parametrize(("argv", "code", "says"), [
        (["--url", "http://127.0.0.1:{port}", "run", "job"], 69, "engine unavailable"),
        (["--url", "postgresql://u@127.0.0.1:{port}/db?timeout=2", "run", "job"], 69,
         "engine unavailable"),
        (["run", "a#b"], 2, "contains '#'"),
        (["run", "job-\udcff"], 2, "is not valid UTF-8"),
        (["--url", "http://broker:6632/?token=s3cretvalue", "run", "job"], 2,
         "must not have a query"),
    ], ids=["http unreachable", "postgres unreachable", "name refused", "name not UTF-8",
            "bad URL"])
    def test_the_last_line_is_the_result_with_the_error_it_printed(
            self, capsys: pytest.CaptureFixture[str], sqlite_url: str,
            monkeypatch: pytest.MonkeyPatch, argv: list[str], code: int, says: str) -> None:
        if "postgresql" in argv[1]:
            pytest.importorskip("psycopg")
        monkeypatch.setenv("QUEEN_URL", sqlite_url)
        argv = [word.format(port=free_port()) for word in argv] + ["--json", "--", "true"]
        exit_code, result, err = _run_json_failure(capsys, argv)
        assert exit_code == code == result["exit_code"], f"exit {exit_code}, result {result}"
        assert result["acquired"] is False and result["token"] is None, result
        assert says in result["error"] and result["error"] in err, (
            f"the error is the line on stderr: {result['error']!r}, {err!r}")
        assert "\n" not in result["error"] and "s3cret" not in json.dumps(result), result

    @pytest.mark.parametrize("engine", ["sqlite", "http"])
    def test_a_request_the_engine_refuses_is_bad_usage_on_every_engine(
            self, capsys: pytest.CaptureFixture[str], sqlite_url: str, engine: str) -> None:
        """A name held as a semaphore of 2, run as a lock: the same refusal everywhere, so
        the exit code is 2 (do not retry), never 69 (engine unreachable, retry later)."""
        with contextlib.ExitStack() as stack:
            url = sqlite_url
            if engine == "http":
                url = stack.enter_context(LocalBroker(sqlite_url[len("sqlite://"):])).url
            holder = stack.enter_context(qs.Queen(url))
            assert holder.semaphore("gpu", 2, ttl=60).acquire()
            exit_code, result, err = _run_json_failure(
                capsys, ["--url", url, "run", "gpu", "--json", "--", "true"])
        assert exit_code == 2 == result["exit_code"], f"exit {exit_code}: {err!r}"
        assert "lock_limit_mismatch" in err or "limit 2" in err, err

    def test_a_run_that_started_has_no_error(self, cli: Cli) -> None:
        done = cli.run("run", "job", "--json", "--", "true")
        assert _last_json_line(done.stdout)["error"] is None, done.stdout


class TestOneLineMessages:
    def test_an_unreachable_postgresql_is_one_line(self, capsys: pytest.CaptureFixture[str]
                                                   ) -> None:
        pytest.importorskip("psycopg")
        code = main(["--url", f"postgresql://u@127.0.0.1:{free_port()}/db?timeout=2",
                     "holders", "job"])
        err = capsys.readouterr().err
        assert code == 69 and "engine unavailable" in err, (code, err)
        assert err.count("\n") == 1, f"libpq's several lines must become one: {err!r}"
        assert "Is the server running" in err, f"the hint is joined, not dropped: {err!r}"

    def test_a_lock_name_that_is_not_utf8_is_named_as_such(self, cli: Cli) -> None:
        done = subprocess.run([sys.executable.encode(), b"-m", b"queen_sync", b"holders",
                               b"job-\xff"], capture_output=True, env=cli.env, timeout=60,
                              check=False)
        err = done.stderr.decode()
        assert done.returncode == 2, f"a bad name is bad usage: {done.returncode}, {err!r}"
        assert "lock name 'job-\\udcff' is not valid UTF-8" in err, err
        assert "codec" not in err and err.count("\n") == 1, err

    @pytest.mark.parametrize("extra", [["--version"], ["--bogus", "-x"]])
    def test_unknown_options_are_not_offered_as_a_command_to_run(
            self, capsys: pytest.CaptureFixture[str], extra: list[str]) -> None:
        with pytest.raises(SystemExit) as exited:
            main(["run", "job", *extra])
        err = capsys.readouterr().err
        assert exited.value.code == 2, err
        assert f"unknown option{'s' if len(extra) > 1 else ''} for run: {' '.join(extra)}" \
            in err, err
        assert "-- --" not in err and "put the command after" not in err, (
            f"the hint would run a program called {extra[0]}: {err!r}")


def _with_stdout(cli: Cli, stdout: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``queen-sync ARGS`` with stdout ``/dev/full`` (every write fails) or ``closed``."""
    if stdout == "closed":
        argv = ["sh", "-c", 'exec "$@" >&-', "sh", *QUEEN_SYNC, *args]
        return subprocess.run(argv, stderr=subprocess.PIPE, text=True, env=cli.env,
                              timeout=60, check=False)
    with open(os.devnull if stdout == "null" else "/dev/full", "w") as target:
        return subprocess.run([*QUEEN_SYNC, *args], stdout=target, stderr=subprocess.PIPE,
                              text=True, env=cli.env, timeout=60, check=False)


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
class TestAStdoutThatCannotBeWritten:
    @pytest.mark.parametrize("stdout", ["full", "closed"])
    @pytest.mark.parametrize("command", [["true"], ["sh", "-c", "exit 3"]])
    def test_a_run_keeps_its_commands_code_and_says_the_result_was_not_written(
            self, cli: Cli, stdout: str, command: list[str]) -> None:
        code = 3 if "exit 3" in command[-1] else 0
        done = _with_stdout(cli, stdout, "run", "job", "--json", "--", *command)
        assert done.returncode == code, f"the command's code stands: {done.returncode}, " \
                                        f"{done.stderr!r}"
        assert "Traceback" not in done.stderr and "Exception ignored" not in done.stderr, (
            done.stderr)
        assert done.stderr.startswith("queen-sync: ") and "stdout" in done.stderr \
            and done.stderr.count("\n") == 1, f"one line names stdout: {done.stderr!r}"
        assert cli.holders("job") == [], "the lease was not released"

    @pytest.mark.parametrize("stdout", ["full", "closed"])
    @pytest.mark.parametrize("args", [["holders", "job"], ["ping", "--json"]])
    def test_other_commands_fail_with_one_line_and_exit_74(
            self, cli: Cli, stdout: str, args: list[str]) -> None:
        done = _with_stdout(cli, stdout, *args)
        assert done.returncode == 74, f"{args}: EX_IOERR: {done.returncode}, {done.stderr!r}"
        assert done.stderr.startswith("queen-sync: ") and "stdout" in done.stderr \
            and done.stderr.count("\n") == 1, f"{args}: one line names stdout: {done.stderr!r}"

    def test_a_writable_stdout_changes_nothing(self, cli: Cli) -> None:
        done = _with_stdout(cli, "null", "holders", "job")
        assert done.returncode == 0 and done.stderr == "", done


# The command writes what it sees of its stdio to ``marker``, after output and a pause in
# which the engine's connection is open (and, with a closed stdout, would be fd 1).
_STDIO_REPORTER = (
    "import os, sys, time\n"
    "time.sleep(0.3)\n"
    "for line in range(3):\n"
    "    try:\n"
    "        os.write(1, b'log line\\n')\n"
    "    except OSError:\n"
    "        pass\n"
    "seen = []\n"
    "for fd in (0, 1, 2):\n"
    "    try:\n"
    "        os.fstat(fd)\n"
    "        seen.append('open')\n"
    "    except OSError:\n"
    "        seen.append('closed')\n"
    "open(sys.argv[1], 'w').write(' '.join(seen))\n")


class TestAStdioStreamClosedAtStart:
    """A descriptor the command line opens (its engine's socket, its database file) must
    not take the number of a closed stdin, stdout or stderr: writes meant for them would go
    into it."""

    @pytest.mark.parametrize("closed", ["1", "2", "0 1 2"])
    @pytest.mark.parametrize("engine", ["sqlite", "http"])
    def test_the_command_runs_to_its_end_sees_them_closed_and_the_lease_is_released(
            self, cli: Cli, sqlite_url: str, tmp_path: Any, closed: str, engine: str) -> None:
        marker = tmp_path / "seen"
        with contextlib.ExitStack() as stack:
            url = sqlite_url
            if engine == "http":
                url = stack.enter_context(LocalBroker(sqlite_url[len("sqlite://"):])).url
            closing = " ".join(f"{fd}>&-" if fd != "0" else "<&-" for fd in closed.split())
            argv = ["sh", "-c", f'exec "$@" {closing}', "sh", *QUEEN_SYNC, "--url", url,
                    "run", "job", "--ttl", "30s", "--json", "--", sys.executable, "-c",
                    _STDIO_REPORTER, str(marker)]
            done = subprocess.run(argv, capture_output=True, text=True, env=cli.env,
                                  timeout=60, check=False)
            assert done.returncode == 0, (
                f"the command was cut short: exit {done.returncode}, {done.stderr!r}")
            assert marker.read_text() == " ".join(
                "closed" if str(fd) in closed.split() else "open" for fd in range(3)), (
                f"the command's stdio is not as queen-sync was given it: {marker.read_text()}")
            assert "Bad file descriptor" not in done.stderr, done.stderr
            with qs.Queen(url) as q:
                assert not q.locks.get("job"), "the lease was not released"


class TestEveryMessageOnOneLine:
    """The command line's stderr is one line per message, whatever a driver or log says."""

    def test_a_release_that_fails_with_a_several_line_error_warns_on_one_line(
            self, capsys: pytest.CaptureFixture[str], sqlite_url: str) -> None:
        from queen_sync._front.cli import _final_release
        from queen_sync.testing import FaultyEngine

        engine = FaultyEngine(sqlite_url)
        with qs.Queen(engine=engine, renew_thread=False) as q:
            lock = q.lock("job", ttl=30)
            assert lock.acquire()
            engine.fail_next(error=qs.EngineUnavailableError(
                "server closed the connection\nHINT:  is the server running?\n"), route="locks")
            assert _final_release(lock) is False
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "connection HINT:  is the server running?)" in err, (
            f"one line, the hint joined, not dropped: {err!r}")

    def test_log_lines_of_queen_sync_and_of_the_driver_are_one_line_each(
            self, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
        import logging

        from queen_sync._front import cli

        def dispatch(args: Any, command: list[str]) -> int:
            try:
                raise qs.EngineUnavailableError("connection lost\nDETAIL:  reset by peer")
            except qs.EngineError:
                logging.getLogger("queen_sync.renewer").warning("renew failed\n\tretrying",
                                                                exc_info=True)
            logging.getLogger("psycopg.pool").warning("error connecting in 'pool-1':\nrefused")
            return 0

        monkeypatch.setattr(cli, "_dispatch", dispatch)
        assert cli.main(["ping"]) == 0
        lines = capsys.readouterr().err.splitlines()
        assert len(lines) == 2 and all(line.startswith("queen-sync: ") for line in lines), (
            f"one line per message, each said by queen-sync: {lines}")
        assert "lost DETAIL:  reset by peer)" in lines[0] and "refused" in lines[1], lines
