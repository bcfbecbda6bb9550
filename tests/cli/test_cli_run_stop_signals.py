"""``queen-sync run`` asked to stop at any moment: it ends cleanly and leaves no lease behind."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest
from cli_helpers import (
    Cli,
    cli_fixture,  # noqa: F401  # registers the ``cli`` fixture
)

import queen_sync as qs

pytestmark = [
    pytest.mark.realtime,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="POSIX signals"),
]

# Runs per test; QUEEN_SYNC_SIGNAL_RUNS runs the search longer.
RUNS = int(os.environ.get("QUEEN_SYNC_SIGNAL_RUNS", "8"))
# Not Python: a signal forwarded while it imports ends it with its own traceback and exit 1.
# It outlasts every signal's delay, so each lands while the run holds the lease.
SHORT_COMMAND = ["--", "sleep", "2"]


def _signal_when_held(process: subprocess.Popen[str], q: qs.Queen, name: str,
                      signum: int, after: float) -> None:
    """Sends ``signum`` ``after`` seconds past the moment the lease shows up as held."""
    deadline = time.monotonic() + 20
    while not q.locks.get(name).get("holders") and process.poll() is None:
        assert time.monotonic() < deadline, "the runner never took the lease"
    time.sleep(after)
    if process.poll() is None:
        process.send_signal(signum)


class TestAStopSignalAroundTheHold:
    def test_a_stop_signal_at_any_moment_of_a_run_leaves_no_lease_behind(
            self, cli: Cli) -> None:
        """From the acquire to the release, a signal is never queen-sync's default death."""
        chooser = random.Random(int(os.environ.get("QUEEN_SYNC_SEED", "0")) or None)
        with qs.Queen(cli.url, renew_thread=False) as q:
            for run in range(RUNS):
                signum = chooser.choice([signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
                after = chooser.choice([0.0, 0.0, 0.002, 0.01, 0.05, chooser.uniform(0, 0.3)])
                process = cli.start("run", f"job-{run}", "--ttl", "1m", *SHORT_COMMAND)
                _signal_when_held(process, q, f"job-{run}", signum, after)
                _, err = process.communicate(timeout=20)
                case = f"{signal.Signals(signum).name} {after * 1000:.0f} ms after the hold"
                assert process.returncode == 128 + signum, (
                    f"{case}: exit {process.returncode} (died by the signal?): {err!r}")
                assert "Traceback" not in err, f"{case}: a traceback: {err!r}"
                assert not q.locks.get(f"job-{run}").get("holders"), (
                    f"{case}: the lease was left behind for its TTL: {err!r}")

    def test_a_signal_before_the_command_starts_keeps_it_from_running(self, cli: Cli,
                                                                       tmp_path: object) -> None:
        """The first signal right at the hold: the command would run without its runner."""
        marker = f"{tmp_path}/ran"
        with qs.Queen(cli.url, renew_thread=False) as q:
            process = cli.start("run", "job", "--ttl", "1m", "--", "sh", "-c",
                                f"sleep 0.3; touch {marker}")
            _signal_when_held(process, q, "job", signal.SIGTERM, 0.0)
            _, err = process.communicate(timeout=20)
            assert process.returncode == 128 + signal.SIGTERM, (
                f"a SIGTERM'd run exits 143: {process.returncode}, {err!r}")
            assert not os.path.exists(marker), "the command ran on after SIGTERM"
            assert not q.locks.get("job").get("holders"), f"the lease stayed: {err!r}"


class TestAStopSignalWhileWaiting:
    @pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
    def test_a_run_waiting_for_a_busy_lease_stops_with_its_result_and_no_traceback(
            self, cli: Cli, signum: int) -> None:
        with qs.Queen(cli.url, renew_thread=False) as q:
            taken = q.locks.acquire("job", ttl_seconds=60)
            process = cli.start("--json", "run", "job", "--wait", "30s", *SHORT_COMMAND)
            time.sleep(1.0)  # long enough for the runner to be waiting
            started = time.monotonic()
            process.send_signal(signum)
            out, err = process.communicate(timeout=20)
            took = time.monotonic() - started
            assert process.returncode == 128 + signum, (
                f"exit 128+N for signal N: {process.returncode}, {err!r}")
            assert "Traceback" not in err and err.startswith("queen-sync: "), (
                f"one line says why: {err!r}")
            result = json.loads(out.splitlines()[-1])
            assert result["acquired"] is False and result["exit_code"] == 128 + signum, result
            assert signal.Signals(signum).name in (result["error"] or ""), result
            assert took < 5, f"the wait was not cut short: {took:.1f}s"
            holders = q.locks.get("job")["holders"]
            assert [h["token"] for h in holders] == [taken["token"]], (
                f"the waiter took or broke the held lease: {holders}")


class TestTheCommandsSignals:
    def test_the_command_runs_with_sigpipe_at_its_default(self, cli: Cli) -> None:
        """``yes | head`` ends because SIGPIPE kills ``yes``; ignored, it would see EPIPE."""
        done = cli.run("run", "job", "--", "cat", "/proc/self/status")
        ignored = int(next(line.split()[1] for line in done.stdout.splitlines()
                           if line.startswith("SigIgn:")), 16)
        assert not ignored & (1 << (signal.SIGPIPE - 1)), (
            f"the command inherited an ignored SIGPIPE: SigIgn {ignored:#x}")
