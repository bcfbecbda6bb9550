"""A test run stuck where no signal handler runs is ended, with every thread's stack shown."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def test_a_run_stuck_with_signals_blocked_is_aborted_with_its_stacks(tmp_path: Path) -> None:
    (tmp_path / "conftest.py").write_text(textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(TESTS)!r})
        from stall_guard import (  # noqa: F401
            pytest_runtest_logfinish, pytest_runtest_logstart, pytest_sessionfinish,
            pytest_sessionstart)
    """))
    (tmp_path / "test_stuck.py").write_text(textwrap.dedent("""
        import signal
        import time

        def test_ends() -> None:
            pass

        def test_waits_with_every_signal_it_could_be_stopped_by_blocked() -> None:
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM, signal.SIGINT})
            time.sleep(300)
    """))
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "timeout=1",
         "--rootdir", str(tmp_path), "-c", os.devnull, str(tmp_path / "test_stuck.py")],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
        env={**os.environ, "QUEEN_SYNC_STALL_LIMIT": "3"})
    assert run.returncode not in (0, 5), f"the stuck run passed: {run.stdout[-500:]}"
    assert "stall guard: no test started or ended" in run.stderr, run.stderr[-1500:]
    assert "test_waits_with_every_signal_it_could_be_stopped_by_blocked" in run.stderr, (
        f"the abort printed no stack of the stuck test: {run.stderr[-1500:]}")
