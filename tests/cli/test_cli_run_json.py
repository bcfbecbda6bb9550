"""``queen-sync run --json``: one JSON object with the same keys however the run ended."""

from __future__ import annotations

import json
import sys
from typing import Any

import pytest
from cli_helpers import (
    Cli,
    cli_fixture,  # noqa: F401  # registers the ``cli`` fixture
)

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
