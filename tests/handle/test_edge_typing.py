"""The user's edge is typed as it is read: a lifetime is required, KV keywords are spelled out.

Checked by running mypy on a small program: every line marked ``# E`` must be
reported, and nothing else.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

PROGRAM = '''
from __future__ import annotations

from datetime import timedelta

import queen_sync as qs

q = qs.Queen()
ttl: qs.Duration = "2m"
q.lock("a", ttl=ttl)
q.lock("a", ttl=timedelta(minutes=2), wait="5s")
q.lock("a", ttl_seconds=120)
q.semaphore("s", 3, ttl=30.5)
q.semaphore("s", 3, ttl_seconds=30)
q.lock("a")  # E: a lease has no default lifetime
q.semaphore("s", 3)  # E: nor a semaphore permit
q.lock("a", ttl=[5])  # E: a lifetime is a Duration
q.lock("a", ttl_seconds="5")  # E: ttl_seconds is whole seconds
q.kv.put("ns", "k", 1, ttl="1d")
q.kv.put("ns", "k", 1, forever=True, expect=3)
q.kv.put("ns", "k", 1, tll="1d")  # E: no unknown keyword
q.kv.put_if_absent("ns", "k", 1, until=None, ttl_seconds=5)
q.kv.put_if_absent("ns", "k", 1, ttl="1d", expect=0)  # E: putIfAbsent has no expect
q.kv.incr("ns", "k", delta=2, max=10, ttl="1h")
q.kv.incr("ns", "k", delta="2")  # E: delta is a number
q.kv.once("ns", "k", ttl="1d")
q.transaction().kv.put("ns", "k", 1, ttl="1d").kv.incr("ns", "n", forever=True).commit()
q.transaction().kv.put("ns", "k", 1, tll="1d")  # E: no unknown keyword in a bundle either


@qs.singleton_job("job", ttl="1m", client=q)
def job() -> None: ...
'''


def test_mypy_reads_the_edge_as_it_is_documented(tmp_path: Path) -> None:
    pytest.importorskip("mypy")
    program = tmp_path / "program.py"
    program.write_text(PROGRAM)
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--no-pretty", "--config-file", os.devnull,
         "--cache-dir", str(tmp_path / "cache"), str(program)],
        capture_output=True, text=True, timeout=110, cwd=tmp_path,
        env=dict(os.environ, MYPYPATH=str(REPO)), check=False)
    reported = {int(n) for n in re.findall(r"program\.py:(\d+): error", done.stdout)}
    expected = {n for n, line in enumerate(PROGRAM.splitlines(), 1) if "# E" in line}
    assert reported == expected, f"mypy reported lines {sorted(reported)}, expected " \
                                 f"{sorted(expected)}:\n{done.stdout}{done.stderr}"


def test_duration_is_exported_as_the_type_every_lifetime_takes() -> None:
    import queen_sync as qs
    from queen_sync._durations import Duration

    assert qs.Duration is Duration, "one Duration, exported"
    assert qs.parse_duration(timedelta(seconds=3)) == 3.0, "a timedelta is a Duration"
