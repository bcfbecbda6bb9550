"""``queen-sync holders``, ``release``, ``ping``, the help texts and the README's command."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from cli_helpers import (
    QUEEN_SYNC,
    REPO,
    Cli,
    child_waiting_for,
    cli_fixture,  # noqa: F401  # registers the ``cli`` fixture
)
from polling import wait_for

import queen_sync as qs


def _examples(help_text: str) -> list[str]:
    return [line.strip() for line in help_text.splitlines()
            if line.startswith("  queen-sync ")]


def _as_argv(example: str) -> list[str]:
    words = shlex.split(example)
    assert words[0] == "queen-sync"
    return [sys.executable if w == "python" else w for w in words[1:]]


class TestHelp:
    @pytest.mark.parametrize("command", [[], ["run"], ["holders"], ["release"], ["ping"]])
    def test_every_help_shows_examples_that_work(self, cli: Cli, command: list[str]) -> None:
        shown = cli.run(*command, "--help")
        examples = _examples(shown.stdout)
        assert shown.returncode == 0 and examples, f"--help must show examples: {shown.stdout}"
        for example in examples:
            done = cli.run(*_as_argv(example))
            allowed = {0, 1} if " release " in f" {example} " else {0}
            assert done.returncode in allowed, (
                f"example {example!r} exited {done.returncode}: {done.stderr}")

    def test_help_documents_the_busy_and_lost_exit_codes(self, cli: Cli) -> None:
        text = cli.run("run", "--help").stdout
        assert "75" in text and "76" in text, f"run --help must name both codes: {text}"

    def test_no_subcommand_prints_the_help_and_exits_2(self, cli: Cli) -> None:
        done = cli.run()
        assert done.returncode == 2 and "examples:" in done.stderr, done


class TestBadUsage:
    @pytest.mark.parametrize("argv", [
        ["run", "job", "--ttl", "soon", "--", "true"],
        ["run", "job", "--ttl", "5m"],
        ["run", "job", "--limit", "0", "--", "true"],
        ["run", "job", "--busy-exit-code", "300", "--", "true"],
        ["release", "job"],
        ["release", "job", "--token", str(1 << 63), "--slot", "0"],
        ["holders"],
    ])
    def test_bad_arguments_exit_2_before_touching_the_engine(self, tmp_path: Path,
                                                             argv: list[str]) -> None:
        url = "sqlite://" + str(tmp_path / "never.db")
        done = Cli(url).run(*argv)
        assert done.returncode == 2, f"{argv}: exit {done.returncode}, {done.stderr!r}"
        assert "usage" in done.stderr.lower() or "queen-sync" in done.stderr
        assert not (tmp_path / "never.db").exists(), "bad usage must not open the engine"
        assert "Traceback" not in done.stderr, f"{argv}: a message, not a crash: {done.stderr!r}"

    def test_an_unreachable_engine_exits_69(self, tmp_path: Path) -> None:
        done = Cli("http://127.0.0.1:9").run("ping", "--url", "http://127.0.0.1:9")
        assert done.returncode == 69, f"got {done.returncode}: {done.stderr!r}"
        assert "Traceback" not in done.stderr, "an unreachable engine is a message, not a crash"


class TestHoldersAndRelease:
    def test_holders_lists_slot_owner_token_since_and_expires_in(self, cli: Cli,
                                                                 sqlite_url: str) -> None:
        with qs.Queen(sqlite_url) as q:
            lock = q.lock("report", ttl="1m")
            assert lock.acquire()
            table = cli.run("holders", "report", "other").stdout
            rows = cli.holders("report")
            token = lock.token
        assert rows[0]["token"] == token and rows[0]["owner"] == lock.owner, rows
        assert 0 < rows[0]["expires_in"] <= 60, rows
        assert {"slot", "since", "expires_in"} <= set(rows[0]), rows
        assert lock.owner in table and str(token) in table, table
        assert "other: free" in table, table

    def test_release_with_the_live_token_frees_the_lock(self, cli: Cli, tmp_path: Path) -> None:
        go, report = tmp_path / "go", tmp_path / "env.json"
        runner = cli.start("run", "job", "--ttl", "30s", "--", *child_waiting_for(go, report))
        wait_for(report.exists, what="the child")
        token = json.loads(report.read_text())["QUEEN_LOCK_TOKEN"]
        stale = cli.run("release", "job", "--token", str(int(token) + 1000))
        released = cli.run("release", "job", "--token", token, "--json")
        go.touch()
        runner.communicate(timeout=20)
        assert stale.returncode == 1 and "nothing released" in stale.stderr, stale
        assert released.returncode == 0, released.stderr
        assert json.loads(released.stdout)["released"] is True, released.stdout

    def test_url_and_json_go_before_or_after_the_subcommand(self, cli: Cli) -> None:
        before = cli.run("--url", cli.url, "--json", "holders", "x")
        after = cli.run("holders", "x", "--url", cli.url, "--json")
        assert before.stdout == after.stdout == "[]\n", (before, after)


class TestPing:
    def test_ping_prints_the_engine_its_url_and_the_latency(self, cli: Cli) -> None:
        text = cli.run("ping")
        answer = json.loads(cli.run("ping", "--json").stdout)
        assert text.returncode == 0 and cli.url in text.stdout and "ms" in text.stdout, text
        assert answer["ok"] is True and answer["engine"] == "sqlite", answer
        assert answer["url"] == cli.url and answer["latency_ms"] > 0, answer
        assert cli.holders(answer["url"]) == [], "ping leaves nothing held"


class TestReadme:
    def test_the_readmes_main_job_command_runs_on_the_embedded_default(self,
                                                                      tmp_path: Path) -> None:
        readme = (REPO / "README.md").read_text()
        line = next(line for line in readme.splitlines()
                    if line.startswith("python -m pip install . && queen-sync run"))
        command = line.split(" && ", 1)[1]
        env = {k: v for k, v in os.environ.items()
               if k not in ("QUEEN_URL", "XDG_STATE_HOME")}
        env["HOME"] = str(tmp_path)
        env["PYTHONPATH"] = str(REPO)
        if shutil.which("queen-sync") is None:
            command = command.replace("queen-sync", shlex.join(QUEEN_SYNC), 1)
        command = re.sub(r"-- python ", f"-- {shlex.quote(sys.executable)} ", command)
        done = subprocess.run(["bash", "-c", command], env=env, text=True,
                              capture_output=True, timeout=60, check=False)
        state = tmp_path / ".local" / "state" / "queen_sync" / "queen.db"
        assert done.returncode == 0, f"exit {done.returncode}: {done.stderr}"
        assert re.fullmatch(r"holding daily-report token \d+\n", done.stdout), done.stdout
        assert state.exists(), "the embedded default is a file in the user's state directory"


DOC_PAGES = ["docs/reference/cli.md", "docs/how-to/cron-job.md"]


def _doc_commands(page: str) -> list[str]:
    text = (REPO / page).read_text()
    blocks = re.findall(r"^```bash\n(.*?)^```", text, re.S | re.M)
    return [line for block in blocks for line in block.splitlines()
            if line.startswith("queen-sync ")]


class TestDocs:
    @pytest.mark.parametrize("page", DOC_PAGES)
    def test_every_queen_sync_line_in_the_docs_runs(self, cli: Cli, page: str) -> None:
        commands = _doc_commands(page)
        assert commands, f"{page} shows no queen-sync command"
        for command in commands:
            done = cli.run(*_as_argv(command))
            allowed = {0, 1} if " release " in f" {command} " else {0}
            assert done.returncode in allowed, (
                f"{page}: {command!r} exited {done.returncode}: {done.stderr}")
