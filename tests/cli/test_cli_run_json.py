"""``queen-sync run --json``: one JSON object with the same keys however the run ended."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from cli_helpers import (
    QUEEN_SYNC,
    Cli,
    cli_fixture,  # noqa: F401  # registers the ``cli`` fixture
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import queen_sync as qs

RUN_KEYS = {"name", "acquired", "owner", "token", "slot", "exit_code", "held_seconds", "lost",
            "released", "holders", "error"}


def _result(stdout: str) -> dict[str, Any]:
    """The run's JSON object: the last line of stdout, after whatever the command printed."""
    lines = stdout.splitlines()
    assert lines, "--json must print the run's result"
    result: dict[str, Any] = json.loads(lines[-1])
    assert set(result) == RUN_KEYS, f"the keys must not depend on the outcome: {sorted(result)}"
    return result


class TestTheRunsJsonResult:
    def test_a_successful_run_prints_its_result_with_the_token_the_command_saw(
            self, cli: Cli) -> None:
        show = "import os; print(os.environ['QUEEN_LOCK_TOKEN'], os.environ['QUEEN_LOCK_OWNER'])"
        done = cli.run("--json", "run", "job", "--ttl", "30s", "--", sys.executable, "-c", show)
        assert done.returncode == 0, f"exit {done.returncode}: {done.stderr!r}"
        token, owner = done.stdout.splitlines()[0].split()
        result = _result(done.stdout)
        assert result["acquired"] is True and result["name"] == "job", result
        assert result["token"] == int(token) and result["owner"] == owner, (
            f"the result names the lease the command held: {result}, saw {token} {owner}")
        assert result["slot"] == 0 and result["exit_code"] == 0, result
        assert result["lost"] is None and result["released"] is True, result
        assert isinstance(result["held_seconds"], float) and result["held_seconds"] >= 0, result
        assert result["holders"] == [], result

    @pytest.mark.parametrize(("command", "expected"), [
        ([sys.executable, "-c", "raise SystemExit(3)"], 3),
        (["no-such-command-queen-sync-test"], 127),
    ], ids=["failing command", "missing command"])
    def test_the_result_carries_the_exit_code_the_run_exits_with(
            self, cli: Cli, command: list[str], expected: int) -> None:
        done = cli.run("run", "job", "--ttl", "30s", "--json", "--", *command)
        result = _result(done.stdout)
        assert done.returncode == expected == result["exit_code"], (
            f"exit {done.returncode}, result {result}")
        assert result["acquired"] is True and result["released"] is True, result

    def test_a_busy_run_prints_the_same_keys_naming_the_holder(self, cli: Cli,
                                                               sqlite_url: str) -> None:
        with qs.Queen(sqlite_url) as q:
            holder = q.lock("job", ttl="1m")
            assert holder.acquire()
            done = cli.run("run", "job", "--json", "--", "true")
        result = _result(done.stdout)
        assert done.returncode == 75 == result["exit_code"], (done.returncode, result)
        assert result["acquired"] is False and result["token"] is None, result
        assert result["held_seconds"] is None and result["released"] is False, result
        assert [h["owner"] for h in result["holders"]] == [holder.owner], result


class TestTheResultStartsALineOfItsOwn:
    """The result is the last line of stdout, whatever the command left unfinished."""

    @pytest.mark.parametrize("stdout", ["pipe", "file"])
    @given(text=st.text(st.characters(blacklist_categories=["Cs"], blacklist_characters="\0"),
                        max_size=40))
    @settings(max_examples=6, deadline=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture])
    def test_the_last_line_is_the_result_and_the_commands_bytes_come_before_it_unchanged(
            self, cli: Cli, tmp_path: Path, stdout: str, text: str) -> None:
        write = f"import sys; sys.stdout.buffer.write({text.encode()!r})"
        argv = [*QUEEN_SYNC, "--json", "run", "job", "--", sys.executable, "-c", write]
        if stdout == "pipe":
            out = subprocess.run(argv, env=cli.env, capture_output=True, timeout=30,
                                 check=False).stdout
        else:
            target = tmp_path / "out.txt"
            with open(target, "wb") as sink:
                subprocess.run(argv, env=cli.env, stdout=sink, timeout=30, check=False)
            out = target.read_bytes()
        _, _, last = out.rstrip(b"\n").rpartition(b"\n")
        result = json.loads(last)
        assert result["exit_code"] == 0 and set(result) == RUN_KEYS, result
        expected = text.encode()
        if expected and not expected.endswith(b"\n"):
            expected += b"\n"  # the one byte queen-sync adds, so the result starts a line
        assert out == expected + last + b"\n", (
            f"the command's bytes must come first, as written: {out!r}")

    def test_a_process_that_left_the_group_holding_stdout_does_not_hold_the_run(
            self, cli: Cli, tmp_path: Path) -> None:
        """It escaped the group (setsid), so nothing stops it; the result comes anyway."""
        target = tmp_path / "out.txt"
        escape = "printf partial; setsid sleep 4 2>/dev/null &"
        with open(target, "wb") as sink:
            started = time.monotonic()
            done = subprocess.run([*QUEEN_SYNC, "--json", "run", "job", "--", "sh", "-c", escape],
                                  env=cli.env, stdout=sink, stderr=subprocess.PIPE, timeout=30,
                                  check=False)
            took = time.monotonic() - started
        assert done.returncode == 0, done.stderr
        assert took < 3.5, f"the run waited for the escaped process: {took:.1f}s"
        out = target.read_bytes()
        assert out.startswith(b"partial\n"), f"the result starts a line of its own: {out!r}"
        assert json.loads(out.splitlines()[-1])["exit_code"] == 0, out
