"""``@singleton_job`` across real processes sharing one embedded SQLite file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from polling import wait_for

import queen_sync as qs

REPO = Path(__file__).resolve().parents[2]

SCRIPT = r'''
import json, os, pathlib, sys, time
import queen_sync as qs

mode, folder = sys.argv[1], pathlib.Path(sys.argv[2])

def wait_for_go():
    deadline = time.time() + 20
    while not (folder / "go").exists() and time.time() < deadline:
        time.sleep(0.02)

if mode == "race":
    @qs.singleton_job("race", ttl="30s", on_busy=sys.argv[3])
    def job():
        (folder / f"ran-{os.getpid()}").write_text(qs.current_lock().owner)
        wait_for_go()
        return "done"
    try:
        print(json.dumps({"value": job()}))
    except qs.LockBusyError as exc:
        print(json.dumps({"busy": [h.owner for h in exc.holders]}))
        sys.exit(3)
else:
    @qs.singleton_job("long", ttl="1.5s", on_lost=mode)
    def long_job():
        (folder / "token").write_text(str(qs.current_lock().token))
        time.sleep(30)
        return "finished"
    try:
        print(json.dumps({"value": long_job()}))
    except qs.LockLostError as exc:
        print(json.dumps({"lost": exc.reason, "name": exc.name}))
        sys.exit(4)
'''


class Jobs:
    def __init__(self, folder: Path, url: str) -> None:
        self.folder = folder
        self.script = folder / "job.py"
        self.script.write_text(SCRIPT)
        self.env = dict(os.environ, QUEEN_URL=url, PYTHONPATH=str(REPO))
        self.processes: list[subprocess.Popen[str]] = []

    def start(self, *args: str) -> subprocess.Popen[str]:
        process = subprocess.Popen([sys.executable, str(self.script), args[0], str(self.folder),
                                    *args[1:]], env=self.env, text=True,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.processes.append(process)
        return process

    def finish(self, process: subprocess.Popen[str]) -> tuple[int, Any, str]:
        out, err = process.communicate(timeout=30)
        return process.returncode, json.loads(out) if out.strip() else None, err


@pytest.fixture
def jobs(tmp_path: Path, sqlite_url: str) -> Any:
    runner = Jobs(tmp_path, sqlite_url)
    yield runner
    for process in runner.processes:
        if process.poll() is None:
            process.kill()
        process.communicate(timeout=10)


class TestOneRunsAtATime:
    def test_two_processes_calling_one_job_concurrently_run_it_exactly_once(
            self, jobs: Jobs, tmp_path: Path) -> None:
        first, second = jobs.start("race", "skip"), jobs.start("race", "skip")
        wait_for(lambda: list(tmp_path.glob("ran-*")), what="one job to start")
        loser = wait_for(lambda: next((p for p in (first, second) if p.poll() is not None),
                                       None), what="the other caller to skip")
        (tmp_path / "go").touch()
        results = [jobs.finish(p) for p in (first, second)]
        ran = list(tmp_path.glob("ran-*"))
        assert len(ran) == 1, f"exactly one process must run the body, got {ran}"
        assert all(r[1] is not None for r in results), f"a caller printed nothing: {results}"
        assert sorted(r[1]["value"] or "" for r in results) == ["", "done"], results
        assert all(code == 0 for code, _, _ in results), results
        assert loser.returncode == 0, "a skipped call returns None and the script exits 0"

    def test_on_busy_raise_raises_lock_busy_error_carrying_the_holders(
            self, jobs: Jobs, tmp_path: Path) -> None:
        holder = jobs.start("race", "raise")
        ran = wait_for(lambda: list(tmp_path.glob("ran-*")), what="the first job to start")
        code, answer, _ = jobs.finish(jobs.start("race", "raise"))
        (tmp_path / "go").touch()
        jobs.finish(holder)
        assert code == 3, f"the busy caller must raise LockBusyError, exit {code}"
        assert answer == {"busy": [ran[0].read_text()]}, f"holders must name the runner: {answer}"


class TestLosingTheLease:
    def _take_away(self, url: str, folder: Path) -> float:
        token = int(wait_for(lambda: (folder / "token").exists()
                              and (folder / "token").read_text(), what="the job to start"))
        with qs.Queen(url) as q:
            assert q.locks.release("long", token=token), "the operator's release must apply"
        return time.monotonic()

    def test_on_lost_interrupt_stops_a_long_job_with_lock_lost_error(
            self, jobs: Jobs, sqlite_url: str, tmp_path: Path) -> None:
        process = jobs.start("interrupt")
        taken_at = self._take_away(sqlite_url, tmp_path)
        code, answer, err = jobs.finish(process)
        stopped_after = time.monotonic() - taken_at
        assert code == 4, f"the job must end in LockLostError, exit {code}: {err}"
        assert answer == {"lost": "renew", "name": "long"}, answer
        assert stopped_after < 1.5, f"stopped {stopped_after:.2f}s after the loss (ttl 1.5s)"

    def test_on_lost_exit_ends_the_process_with_code_76(self, jobs: Jobs, sqlite_url: str,
                                                        tmp_path: Path) -> None:
        process = jobs.start("exit")
        self._take_away(sqlite_url, tmp_path)
        code, answer, err = jobs.finish(process)
        assert code == 76, f"on_lost='exit' must exit 76, got {code}: {err}"
        assert answer is None, "the job must not have finished"
        assert "lost its lease" in err, f"the exit must be logged: {err!r}"
