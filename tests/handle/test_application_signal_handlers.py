"""An application's own signal handlers, raising into a handle's calls, strand nothing.

Cron scripts install a SIGTERM handler that raises ``SystemExit``, notebooks and
services a SIGINT handler of their own, batch code an alarm that raises
``TimeoutError``. Real signals from a timer land wherever the main thread is, over
and over, while it takes and gives back leases; afterwards the handle must be
usable, hold nothing, and have left no permit on the engine. The storm runs in a
child process, so a deadlock shows as a child that never reports. The handler raises
only where the signal lands outside the child's own loop, which must keep count.

``QUEEN_SYNC_SIGNAL_STORM_SECONDS`` runs each storm longer (default 1.5 s).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

STORM_SECONDS = float(os.environ.get("QUEEN_SYNC_SIGNAL_STORM_SECONDS", "1.5"))

CHILD = textwrap.dedent('''
    import faulthandler, json, signal, sys, time
    import queen_sync as qs

    url, raising, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3])
    faulthandler.dump_traceback_later(seconds + 15, exit=True)  # a hang tells where

    class Fired(Exception):
        pass

    def handler(signum, frame):
        if frame is not None and frame.f_code.co_filename == __file__:
            return  # only into the library's code: the loop below must keep count
        if raising == "keyboard-interrupt":
            raise KeyboardInterrupt
        if raising == "system-exit":
            raise SystemExit(3)
        raise Fired("alarm")

    signal.signal(signal.SIGALRM, handler)
    rounds = interrupted = 0
    with qs.Queen(url) as q:
        lock = q.lock("storm", ttl=30)
        signal.setitimer(signal.ITIMER_REAL, 0.0007, 0.0007)
        until = time.monotonic() + seconds
        while time.monotonic() < until:
            rounds += 1
            try:
                if rounds % 3 == 0:
                    lock.run(lambda: None)
                elif rounds % 3 == 1:
                    with lock, lock:
                        pass
                else:
                    if lock.acquire():
                        lock.release()
            except (KeyboardInterrupt, SystemExit, Fired):
                interrupted += 1
        signal.setitimer(signal.ITIMER_REAL, 0, 0)
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
        report = {
            "rounds": rounds, "interrupted": interrupted,
            "in_block": lock.in_block, "held": lock.held,
            "renewed": len(q.renewer.held()),
            "stranded": [h["owner"] for h in q.locks.get("storm")["holders"]],
            "handler": repr(signal.getsignal(signal.SIGINT)),
        }
        with lock:
            report["reusable"] = lock.held
    print(json.dumps(report))
''')


@pytest.mark.parametrize("raising", ["keyboard-interrupt", "system-exit", "timeout"])
class TestARealSignalStormFromTheApplicationsHandler:
    def test_leaves_the_handle_usable_and_no_permit_behind(
        self, sqlite_url: str, tmp_path: Path, raising: str
    ) -> None:
        script = tmp_path / "storm.py"
        script.write_text(CHILD)
        try:
            done = subprocess.run(
                [sys.executable, str(script), sqlite_url, raising, str(STORM_SECONDS)],
                capture_output=True, text=True, timeout=STORM_SECONDS + 30)
        except subprocess.TimeoutExpired as exc:
            pytest.fail(f"the child hung (deadlocked handle?): {exc.stderr!r}")
        assert done.returncode == 0, done.stderr[-6000:]
        report = json.loads(done.stdout.strip().splitlines()[-1])
        assert report["interrupted"] > 20, f"setup: too few signals landed: {report}"
        assert report == {**report, "in_block": False, "held": False, "renewed": 0,
                          "stranded": [], "reusable": True,
                          "handler": repr(__import__("signal").default_int_handler)}, report
