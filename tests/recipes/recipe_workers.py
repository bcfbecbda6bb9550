"""Real worker processes for the recipes' fault tests, and the helpers that drive them.

Each worker is started with ``spawn_worker(role, **args)`` (a fresh interpreter,
``python recipe_workers.py <role> <json args>``) and reports what it sees as JSON
lines in its own events file, stamped with this machine's wall clock, which is the
clock every process on one machine shares.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional

HERE = Path(__file__).resolve().parent


# ---- the driving side ----------------------------------------------------------------------


class Worker:
    """One worker process and the events it has reported."""

    def __init__(self, role: str, events: Path, **args: Any) -> None:
        self.events_path = events
        self.stderr_path = events.with_suffix(".stderr")
        with open(self.stderr_path, "wb") as stderr:
            self.proc = subprocess.Popen(
                [sys.executable, str(HERE / "recipe_workers.py"), role,
                 json.dumps({**args, "events": str(events)})],
                stdout=subprocess.DEVNULL, stderr=stderr)
        self.name = str(args.get("me", role))

    def events(self, kind: Optional[str] = None) -> list[dict[str, Any]]:
        try:
            lines = self.events_path.read_text().splitlines()
        except FileNotFoundError:
            return []
        parsed = [json.loads(line) for line in lines if line.endswith("}")]
        return [e for e in parsed if kind is None or e["kind"] == kind]

    def wait_for(self, kind: str, timeout: float = 15.0,
                 where: Callable[[dict[str, Any]], bool] = lambda e: True) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = [e for e in self.events(kind) if where(e)]
            if found:
                return found[0]
            if self.proc.poll() is not None:
                found = [e for e in self.events(kind) if where(e)]
                if found:
                    return found[0]
                raise AssertionError(f"{self.name} exited ({self.proc.returncode}) before "
                                     f"reporting {kind!r}: {self.stderr()}")
            time.sleep(0.005)
        raise AssertionError(f"{self.name} did not report {kind!r} within {timeout}s; "
                             f"it reported {self.events()}")

    def signal(self, sig: int) -> float:
        """Send ``sig``; returns the wall-clock time just BEFORE sending (the process may
        run again, and report, before this call returns)."""
        at = time.time()
        os.kill(self.proc.pid, sig)
        return at

    def stderr(self) -> str:
        try:
            return self.stderr_path.read_text(errors="replace")[-2000:]
        except FileNotFoundError:
            return ""

    def finish(self, timeout: float = 30.0) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            raise

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)



Spawn = Callable[..., Worker]

class FencedLog:
    """An external sink (its own SQLite file) that refuses a token below the highest accepted.

    The check and the append are one ``BEGIN IMMEDIATE`` transaction, as a user's own
    database would do it; every attempt is kept, accepted or refused, in commit order.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        with contextlib.closing(self._connect()) as conn:  # sqlite3's own `with` never closes
            conn.execute("CREATE TABLE IF NOT EXISTS log (seq INTEGER PRIMARY KEY AUTOINCREMENT,"
                         " token INTEGER, who TEXT, at REAL, accepted INTEGER)")

    def _connect(self) -> sqlite3.Connection:
        conn = sqlite3.connect(self.path, timeout=30, isolation_level=None)
        conn.execute("PRAGMA journal_mode=WAL")
        return conn

    def write(self, token: int, who: str) -> Optional[int]:
        """Append; returns None when accepted, else the high-water mark that refused it."""
        conn = self._connect()
        try:
            conn.execute("BEGIN IMMEDIATE")
            (high,) = conn.execute("SELECT MAX(token) FROM log WHERE accepted = 1").fetchone()
            accepted = high is None or token >= high
            conn.execute("INSERT INTO log (token, who, at, accepted) VALUES (?, ?, ?, ?)",
                         (token, who, time.time(), int(accepted)))
            conn.execute("COMMIT")
        finally:
            conn.close()
        return None if accepted else int(high)

    def rows(self) -> list[tuple[int, str, float, bool]]:
        conn = self._connect()
        try:
            found = conn.execute("SELECT token, who, at, accepted FROM log ORDER BY seq")
            return [(t, w, a, bool(ok)) for t, w, a, ok in found.fetchall()]
        finally:
            conn.close()


# ---- the worker side -----------------------------------------------------------------------


class _Reporter:
    def __init__(self, path: str, me: str) -> None:
        self._handle = open(path, "a", buffering=1)  # noqa: SIM115  # open for the process's life
        self._mutex = threading.Lock()
        self.me = me

    def __call__(self, kind: str, **fields: Any) -> None:
        line = json.dumps({"kind": kind, "me": self.me, "at": time.time(), **fields})
        with self._mutex:
            self._handle.write(line + "\n")
            self._handle.flush()


def candidate(args: dict[str, Any]) -> None:
    """Campaign; while leading, write to the fenced log in batches under one token read."""
    import queen_sync as qs
    from queen_sync.recipes.leader_election import LeaderElection

    report = _Reporter(args["events"], args["me"])
    sink = FencedLog(Path(args["log"]))
    q = qs.Queen(args["url"])
    election = LeaderElection(
        q, args["name"], ttl=args["ttl"], identity=args["me"],
        on_elected=lambda token: report("elected", token=token),
        on_deposed=lambda reason: report("deposed", reason=reason))
    election.start()
    report("started")
    while True:
        token = election.token
        if token is None:
            time.sleep(0.01)
            continue
        # One batch of output under the token read at its start, as a job would write it.
        for _ in range(10):
            refused_by = sink.write(token, args["me"])
            if refused_by is not None:
                report("refused", presented=token, current=refused_by)
                break
            time.sleep(0.02)


def exporter(args: dict[str, Any]) -> None:
    """Export partitions p00..pNN to a FencedDirectory, slowly, reporting each step."""
    import queen_sync as qs
    from queen_sync.recipes.fenced_export import FencedExport

    report = _Reporter(args["events"], args["me"])
    q = qs.Queen(args["url"])
    export = FencedExport(q, args["name"], _export_sink(q, args), ttl=args["ttl"],
                          wait=args.get("wait", 0))

    def produce(partition: str) -> str:
        report("producing", partition=partition, token=export_lock_token(q, args["name"]))
        if partition == args.get("stall_at"):
            # Stopped by itself, not by the test: a SIGSTOP sent on reading the event
            # above could land after this partition was written, on a loaded machine.
            os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(args["delay"])
        return json.dumps({"partition": partition, "by": args["me"]})

    partitions = [f"p{n:02d}" for n in range(args["partitions"])]
    try:
        result = export.run(partitions, produce)
    except qs.FencedOutError as exc:
        report("fenced", presented=exc.presented, current=exc.current)
        return
    report("finished", written=result.written, skipped=result.skipped, tokens=result.tokens,
           acquired=result.acquired)


def _export_sink(q: Any, args: dict[str, Any]) -> Any:
    """The exporter's sink: a table of its own when given ``table`` (and ``dsn``), else a
    directory."""
    from queen_sync.recipes.fenced_export import FencedDirectory, FencedTable

    if "table" in args:
        import psycopg

        return FencedTable(q, psycopg.connect(args["dsn"]), args["table"])
    return FencedDirectory(args["out"])


def export_lock_token(q: Any, name: str) -> Optional[int]:
    holders = q.locks.get(name).get("holders") or []
    return int(holders[0]["token"]) if holders else None


def queue_worker(args: dict[str, Any]) -> None:
    """Drain a run queue with ``work``; optionally hang (mid-run) on the Nth run."""
    import queen_sync as qs
    from queen_sync.recipes.run_queue import Claim, RunQueue

    report = _Reporter(args["events"], args["me"])
    q = qs.Queen(args["url"])
    runs = RunQueue(q, args["queue"])
    seen = [0]

    def run(claim: Claim) -> None:
        seen[0] += 1
        report("claimed", run=claim.run_id, fence=claim.fence)
        claim.checkpoint({"step": 1, "by": args["me"]})
        if seen[0] == args.get("hang_on"):
            report("hanging", run=claim.run_id, fence=claim.fence, attempt=claim.attempt)
            time.sleep(600)
        time.sleep(args["delay"])
        claim.complete({"by": args["me"]})
        report("completed", run=claim.run_id, fence=claim.fence)

    done = runs.work(run, holder=args["me"], ttl=args["ttl"], poll=0.05)
    report("drained", completed=done)


def stale_claimer(args: dict[str, Any]) -> None:
    """Claim one run, wait for the go file, then try to checkpoint it."""
    import queen_sync as qs
    from queen_sync.recipes.run_queue import RunQueue

    report = _Reporter(args["events"], args["me"])
    q = qs.Queen(args["url"])
    runs = RunQueue(q, args["queue"], max_attempts=args.get("max_attempts"))
    claim = runs.claim(holder=args["me"], ttl=args["ttl"])
    if claim is None:
        report("nothing")
        return
    report("claimed", run=claim.run_id, fence=claim.fence, attempt=claim.attempt)
    go = Path(args["go"])
    while not go.exists():
        time.sleep(0.01)
    try:
        claim.checkpoint({"late": True})
    except qs.FencedOutError as exc:
        report("fenced", presented=exc.presented, current=exc.current)
        return
    report("checkpointed", fence=claim.fence)
    if args.get("hold"):
        time.sleep(600)


def observer(args: dict[str, Any]) -> None:
    """Never campaign: report each new term of the election that ``observe`` sees."""
    import queen_sync as qs
    from queen_sync.recipes.leader_election import observe

    report = _Reporter(args["events"], args["me"])
    q = qs.Queen(args["url"])
    observe(q, args["name"], every=args["every"],
            on_new_leader=lambda leader: report("leader", identity=leader.identity,
                                                token=leader.token))
    report("started")
    while True:
        time.sleep(1)


ROLES = {"candidate": candidate, "observer": observer, "exporter": exporter,
         "queue_worker": queue_worker, "stale_claimer": stale_claimer}

if __name__ == "__main__":
    ROLES[sys.argv[1]](json.loads(sys.argv[2]))
