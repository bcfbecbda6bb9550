"""``on_lost="exit"`` ends the process even when user code that the loss also runs is stuck."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# A job whose lease is lost while another lease's on_lost handler is stuck, and while the
# application's log handler hangs on the very line the exit writes.
SCRIPT = r'''
import logging, sys, threading, time
import queen_sync as qs

class Clock:
    now = 1000.0
    def monotonic(self):
        return self.now
    def wait(self, event, timeout):
        return event.wait(0.01)

class HangingHandler(logging.Handler):
    def emit(self, record):
        if record.levelno >= logging.CRITICAL:
            time.sleep(20)

logging.getLogger().addHandler(HangingHandler())
clock = Clock()
q = qs.Queen(sys.argv[1], clock=clock, renew_thread=False)
cleanup = q.lock("cleanup", ttl=30)
assert cleanup.acquire()
cleanup.on_lost(lambda reason: threading.Event().wait(20))

@qs.singleton_job("nightly", ttl=30, on_lost="exit", client=q)
def nightly():
    for name in ("cleanup", "nightly"):
        q.kv.delete("queen-locks", name + "#0")
    clock.now += 10.01
    q.renewer.tick()
    time.sleep(15)
    print("finished", flush=True)

nightly()
'''


@pytest.mark.realtime
class TestExitOnLoss:
    def test_exit_ends_the_process_while_a_user_handler_and_a_log_handler_are_stuck(
        self, tmp_path: Path, sqlite_url: str
    ) -> None:
        script = tmp_path / "job.py"
        script.write_text(SCRIPT)
        env = dict(os.environ, PYTHONPATH=str(REPO))
        done = subprocess.run([sys.executable, str(script), sqlite_url], env=env, text=True,
                              capture_output=True, timeout=60, check=False)
        assert "finished" not in done.stdout, (
            f"the job body ran to its end after its lease was lost: {done.stderr}")
        assert done.returncode == 76, (
            f"on_lost='exit' must end the process with 76, got {done.returncode}: {done.stderr}")
