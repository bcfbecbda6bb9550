"""A database file its own user may only read is refused as such, not as an outage.

``EngineUnavailableError`` says "try again later"; a read-only file never gets better by
waiting, so a caller that retries on unavailability must not spin on it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Iterator

import pytest

NOBODY = 65534

# Run as the file's owner: as root a mode is no bar, so the child drops to ``nobody`` once
# everything it needs is imported (root's interpreter is not readable by nobody).
_CHILD = textwrap.dedent("""
    import json, os, sys, tempfile
    import queen_sync as qs
    warm = tempfile.mkdtemp()
    with qs.Queen(f"sqlite://{warm}/warm.db") as w:
        lock = w.lock("w", ttl=5)
        lock.acquire(wait=1)
        lock.release()
        w.kv.put("n", "k", 1, forever=True)
    if os.geteuid() == 0:
        os.setgid(NOBODY)
        os.setuid(NOBODY)
    path = sys.argv[1]
    with qs.Queen("sqlite://" + path) as q:
        assert q.lock("held", ttl=30).acquire()
        q.kv.put("n", "k", "before", forever=True)
    os.chmod(path, 0o400)
    seen = {}
    with qs.Queen("sqlite://" + path) as q:
        for what, call in [("acquire", lambda: q.lock("other", ttl=30).acquire()),
                           ("put", lambda: q.kv.put("n", "k", "after", forever=True))]:
            try:
                seen[what] = ["answered", repr(call())]
            except qs.QueenError as exc:
                seen[what] = [type(exc).__name__, str(exc),
                              isinstance(exc, qs.EngineUnavailableError)]
        seen["read"] = q.kv.get("n", "k").get("value")
    print(json.dumps(seen))
""").replace("NOBODY", str(NOBODY))


@pytest.fixture
def folder() -> Iterator[Path]:
    """A folder the test's unprivileged user owns (under /tmp, which it may enter)."""
    path = Path(tempfile.mkdtemp(prefix="queen-ro-", dir="/tmp"))
    if os.geteuid() == 0:
        os.chown(path, NOBODY, NOBODY)
    yield path
    shutil.rmtree(path, ignore_errors=True)


class TestADatabaseItsUserMayOnlyRead:
    def test_refuses_writes_with_an_engine_error_saying_read_only_and_still_reads(
            self, folder: Path) -> None:
        import json

        done = subprocess.run([sys.executable, "-c", _CHILD, str(folder / "queen.db")],
                              capture_output=True, text=True, timeout=60, check=False,
                              env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
        assert done.returncode == 0, done.stderr
        seen = json.loads(done.stdout)
        for what in ("acquire", "put"):
            kind, message, unavailable = seen[what]
            assert kind == "EngineError" and not unavailable, (
                f"{what}: a read-only file is no outage to wait out: {seen[what]}")
            assert "read-only" in message and "queen.db" in message, (
                f"{what}: the error must say the file is read-only: {message}")
        assert seen["read"] == "before", f"reads still answer: {seen}"
