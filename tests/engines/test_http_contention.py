"""Four processes contend for one lock over a LocalBroker that fails 30% of the calls.

Each worker, while it holds the lock, commits guarded transactions that bump a
shared counter and a counter of their own (``call:<tenure>:<step>``). Faults are
500/502/503/504s, timeouts, connection resets and slow answers, each applied to
the store or not. Afterwards:

- every per-call counter is 1: no call was applied twice;
- the shared counter equals the number of calls applied: nothing half-applied;
- sorted by the counter value each commit got, every tenure is one unbroken run:
  no two holders' guarded commits interleaved.

Run as a script, this file is one worker.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

import queen_sync as qs
from queen_sync.testing import LocalBroker

WORKERS = 4
SECONDS = 4.0
STEPS = 3


def worker(url: str, name: str, seconds: float) -> dict[str, object]:
    """Hold the lock in turns and commit guarded steps; report what came back."""
    committed: list[tuple[int, str]] = []
    failures: dict[str, int] = {}
    with qs.Queen(url, timeout=(0.5, 1.0), backoff=0.01) as q:
        lock = q.lock("contended", ttl=3)
        tenure = 0
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            try:
                if not lock.acquire(wait=0.3):
                    continue
            except qs.EngineError as exc:
                failures[type(exc).__name__] = failures.get(type(exc).__name__, 0) + 1
                continue
            tenure += 1
            tid = f"{name}:{tenure}"
            for step in range(STEPS):
                try:
                    answer = (q.transaction().guard(lock)
                              .kv.incr("c", "counter", forever=True)
                              .kv.incr("c", f"call:{tid}:{step}", forever=True)
                              .commit())
                except (qs.EngineError, qs.LockNotHeldError) as exc:
                    failures[type(exc).__name__] = failures.get(type(exc).__name__, 0) + 1
                    continue
                if not answer:
                    break
                committed.append((int(answer["kv"][1]["value"]), tid))
            try:
                lock.release()
            except qs.EngineError:
                failures["release"] = failures.get("release", 0) + 1
            time.sleep(random.uniform(0, 0.05))
    return {"committed": committed, "failures": failures}


def runs_of(committed: list[tuple[int, str]]) -> list[str]:
    """The tenures in counter order, one entry per unbroken run."""
    runs: list[str] = []
    for _value, tid in sorted(committed):
        if not runs or runs[-1] != tid:
            runs.append(tid)
    return runs


@pytest.mark.realtime
def test_no_guarded_commits_interleave_and_none_is_applied_twice_under_faults(
    tmp_path: Path,
) -> None:
    with LocalBroker(str(tmp_path / "broker.db")) as broker:
        broker.faults.chaos(0.3, seed=7)
        procs = [subprocess.Popen([sys.executable, __file__, broker.url, f"w{i}", str(SECONDS)],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for i in range(WORKERS)]
        outputs = [proc.communicate(timeout=60) for proc in procs]
        broker.faults.clear()
        for proc, (_out, err) in zip(procs, outputs):
            assert proc.returncode == 0, f"a worker failed: {err[-2000:]}"
        reports = [json.loads(out) for out, _err in outputs]
        with broker.client() as q:
            calls = {row["key"]: row["value"] for row in q.kv.list_all("c", "call:")}
            counter = q.kv.get("c", "counter")["value"]
        injected = dict(broker.faults.injected)
        broker.assert_no_stale_writes()

    committed = [tuple(pair) for report in reports for pair in report["committed"]]
    assert len(committed) >= 20, f"too little got through to prove anything: {reports}"
    assert sum(injected.values()) >= 50 and len(injected) == 4, f"faults injected: {injected}"
    twice = {key: value for key, value in calls.items() if value != 1}
    assert not twice, f"calls applied more than once: {twice}"
    assert counter == len(calls), f"counter {counter} != {len(calls)} calls applied"
    values = [value for value, _ in committed]
    assert len(set(values)) == len(values), "two commits saw the same counter value"
    runs = runs_of(committed)
    assert len(runs) == len(set(runs)), f"a holder's commits interleaved with another's: {runs}"


if __name__ == "__main__":
    report = worker(sys.argv[1], sys.argv[2], float(sys.argv[3]))
    print(json.dumps(report))
