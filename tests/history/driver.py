"""Runs one history: workers of every topology against a real engine, with faults, then checks it.

The faults, drawn at random from a seeded generator (the seed is printed; setting
``QUEEN_SYNC_HISTORY_SEED`` replays its choices): SIGKILL a worker's process group
(and start a replacement), SIGSTOP one past the lease lifetime then SIGCONT it,
restart the engine (the HTTP engine's LocalBroker; PostgreSQL when the plan asks
and the driver owns the server), and run ``queen-sync holders`` as an operator
would. Process scheduling is not seeded, so a replay repeats the faults, not the
interleavings.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import secrets
import signal
import sqlite3
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import queen_sync as qs

from . import checker
from .workers import NS, TOPOLOGIES, Sink

ROOT = Path(__file__).resolve().parents[2]
FAULTS = ("kill", "stop", "restart", "holders")


def seed_from_env() -> int:
    """``QUEEN_SYNC_HISTORY_SEED`` when set (a replay), else a fresh random seed."""
    chosen = os.environ.get("QUEEN_SYNC_HISTORY_SEED")
    return int(chosen) if chosen else secrets.randbelow(2**32)


@dataclass(frozen=True)
class Plan:
    """What to run: the engine, for how long, with which topologies and faults."""

    engine: str
    seconds: float
    seed: int
    ttl: float = 1.0
    names: tuple[str, ...] = ("h0", "h1")
    topologies: tuple[str, ...] = tuple(TOPOLOGIES)
    faults: tuple[str, ...] = FAULTS
    fault_gap: tuple[float, float] = (0.3, 1.0)  # seconds between two faults


@dataclass
class Outcome:
    """The figures of one history, and what the checker found in it."""

    plan: Plan
    sections: int = 0
    ext_accepted: int = 0
    ext_refused: int = 0
    guard_accepted: int = 0
    guard_refused: int = 0
    faults: Counter[str] = field(default_factory=Counter)
    expected: Counter[str] = field(default_factory=Counter)
    violations: list[checker.Violation] = field(default_factory=list)
    per_topology: Counter[str] = field(default_factory=Counter)
    elapsed: float = 0.0
    loadavg: tuple[float, float, float] = (0.0, 0.0, 0.0)

    def examples(self, per_rule: int = 3) -> list[checker.Violation]:
        """The first few violations of each rule."""
        shown: Counter[str] = Counter()
        out = []
        for v in self.violations:
            shown[v.rule] += 1
            if shown[v.rule] <= per_rule:
                out.append(v)
        return out

    def report(self) -> str:
        p = self.plan
        lines = [
            f"engine {p.engine}: seed {p.seed} (QUEEN_SYNC_HISTORY_SEED={p.seed} replays it), "
            f"{self.elapsed:.1f}s, load average {' '.join(f'{x:.2f}' for x in self.loadavg)}",
            f"  critical sections {self.sections} "
            f"({', '.join(f'{k} {v}' for k, v in sorted(self.per_topology.items()))})",
            f"  sink writes accepted {self.ext_accepted}, refused {self.ext_refused}; "
            f"guarded commits accepted {self.guard_accepted}, refused {self.guard_refused}",
            f"  faults {dict(sorted(self.faults.items()))}; library errors seen "
            f"{dict(sorted(self.expected.items()))}",
            f"  violations {len(self.violations)} "
            f"{dict(sorted(Counter(v.rule for v in self.violations).items()))}",
            *(f"    {v.rule}: {v.detail}" for v in self.examples()),
        ]
        return "\n".join(lines)


# ---- the engine under test -------------------------------------------------------------------


@dataclass
class Store:
    url: str
    restart: Optional[Callable[[random.Random], None]] = None


@contextlib.contextmanager
def open_store(engine: str, folder: Path, pg_url: Optional[str] = None,
               own_pg: bool = False) -> Iterator[Store]:
    """A fresh store of ``engine``: a file, a schema on ``pg_url`` (or a server of its own),
    or a LocalBroker the driver can restart."""
    if engine == "sqlite":
        yield Store("sqlite://" + str(folder / "queen.db"))
    elif engine == "http":
        from queen_sync.testing import LocalBroker

        broker = LocalBroker(str(folder / "broker.db")).start()

        def bounce(rng: random.Random) -> None:
            broker.stop()
            time.sleep(rng.uniform(0.05, 0.3))
            broker.start()

        try:
            yield Store(broker.url, bounce)
        finally:
            broker.close()
    elif engine == "postgres" and own_pg:
        from pg_server import PgServer  # tests/ is on sys.path (pytest's rootdir, or the soak)

        server = PgServer.start_new()
        try:
            yield Store(server.url, lambda rng: server.restart("fast"))
        finally:
            server.destroy()
    elif engine == "postgres":
        assert pg_url, "the postgres engine needs the tests' server URL"
        yield Store(pg_url + "?schema=h_" + secrets.token_hex(6))
    else:
        raise ValueError(f"unknown engine {engine!r}")


# ---- the workers -----------------------------------------------------------------------------


class Fleet:
    """The worker processes of one history, each in its own process group."""

    def __init__(self, plan: Plan, url: str, folder: Path) -> None:
        self.plan, self.url, self.folder = plan, url, folder
        self.running: dict[str, tuple[str, subprocess.Popen[bytes]]] = {}
        self.kills: dict[str, list[float]] = {}
        self.pauses: dict[str, list[tuple[float, float]]] = {}
        self.findings: list[checker.Violation] = []
        self._started = 0

    def start(self, topology: str) -> None:
        self._started += 1
        worker = f"{topology}-{self._started}"
        args = {"url": self.url, "worker": worker, "names": list(self.plan.names),
                "ttl": self.plan.ttl, "folder": str(self.folder), "seed": self.plan.seed}
        with open(self.folder / f"{worker}.stderr", "wb") as stderr:
            process = subprocess.Popen(
                [sys.executable, "-m", "tests.history.workers", topology, json.dumps(args)],
                cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                stdout=subprocess.DEVNULL, stderr=stderr, start_new_session=True)
        self.running[worker] = (topology, process)

    def kill(self, worker: str) -> None:
        """SIGKILL the worker's group and start a replacement of the same topology."""
        topology, process = self.running.pop(worker)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        self.kills.setdefault(worker, []).append(time.monotonic())
        self.start(topology)

    def stop(self, worker: str, seconds: float) -> None:
        """SIGSTOP the worker's group for ``seconds``, then SIGCONT it."""
        pid = self.running[worker][1].pid
        began = time.monotonic()
        os.killpg(pid, signal.SIGSTOP)
        try:
            time.sleep(seconds)
        finally:
            os.killpg(pid, signal.SIGCONT)
            self.pauses.setdefault(worker, []).append((began, time.monotonic()))

    def reap_crashed(self) -> None:
        """A worker that exited by itself is a finding (its stderr says why); replace it."""
        for worker, (topology, process) in list(self.running.items()):
            if process.poll() is not None:
                tail = (self.folder / f"{worker}.stderr").read_text(errors="replace")[-800:]
                self.findings.append(checker.Violation(
                    "worker_crashed", f"{worker} exited {process.returncode}: {tail}"))
                del self.running[worker]
                self.kills.setdefault(worker, []).append(time.monotonic())
                self.start(topology)

    def kill_all(self) -> None:
        for worker in list(self.running):
            _, process = self.running.pop(worker)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGCONT)
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            self.kills.setdefault(worker, []).append(time.monotonic())


# ---- one history -----------------------------------------------------------------------------


def run_history(plan: Plan, folder: Path, store: Store) -> Outcome:
    """Run ``plan`` against ``store`` with faults, then judge what was recorded."""
    rng = random.Random(plan.seed)
    Sink.create(str(folder / "sink.db"))
    fleet = Fleet(plan, store.url, folder)
    outcome = Outcome(plan)
    began = time.monotonic()
    try:
        for topology in plan.topologies:
            fleet.start(topology)
        while time.monotonic() - began + plan.fault_gap[1] < plan.seconds:
            time.sleep(rng.uniform(*plan.fault_gap))
            fleet.reap_crashed()
            _inject(rng, plan, fleet, store, outcome)
        # A short history on a busy machine can end before a topology got its turn at the
        # shared names: it runs on, with no more faults, until each has entered a section.
        overtime = time.monotonic() + plan.seconds
        while _idle_topologies(folder, plan.topologies) and time.monotonic() < overtime:
            time.sleep(0.2)
            fleet.reap_crashed()
    finally:
        fleet.kill_all()
    if "cli" in plan.topologies:
        time.sleep(plan.ttl * 1.5 + 0.3)  # a command that outlived its killed queen-sync ends
    outcome.elapsed = time.monotonic() - began
    outcome.loadavg = os.getloadavg()
    _judge(plan, folder, store, fleet, outcome)
    return outcome


def _inject(rng: random.Random, plan: Plan, fleet: Fleet, store: Store, outcome: Outcome) -> None:
    kinds = [k for k in plan.faults if k != "restart" or store.restart is not None]
    kind = rng.choice(kinds)
    worker = rng.choice(sorted(fleet.running))
    if kind == "kill":
        fleet.kill(worker)
    elif kind == "stop":
        fleet.stop(worker, plan.ttl * 1.5 + rng.uniform(0.0, 0.5))
    elif kind == "restart":
        assert store.restart is not None
        store.restart(rng)
    else:
        _holders(plan, store, fleet)
    outcome.faults[kind] += 1


def _holders(plan: Plan, store: Store, fleet: Fleet) -> None:
    """``queen-sync holders`` as an operator runs it: it must answer (0), or say unreachable."""
    done = subprocess.run([sys.executable, "-m", "queen_sync", "holders", *plan.names,
                           "--url", store.url], capture_output=True, text=True, timeout=60,
                          check=False)
    if done.returncode not in (0, 69):
        fleet.findings.append(checker.Violation(
            "operator_command_failed", f"queen-sync holders exited {done.returncode}: "
                                       f"{done.stderr[-400:]}"))


def _judge(plan: Plan, folder: Path, store: Store, fleet: Fleet, outcome: Outcome) -> None:
    records = read_records(folder)
    history = checker.from_records(records, fleet.kills)
    history.sink = read_sink(folder / "sink.db")
    history.pauses = fleet.pauses
    history.counters = read_counters(store.url, plan.names)
    history.findings.extend(fleet.findings)
    outcome.violations = checker.check(history)
    outcome.sections = len(history.sections)
    outcome.per_topology = Counter(s.worker.rsplit("-", 1)[0] for s in history.sections)
    outcome.ext_accepted = sum(1 for w in history.sink if w.accepted)
    outcome.ext_refused = sum(1 for w in history.sink if not w.accepted)
    outcome.guard_accepted = sum(1 for g in history.guards if g.ok)
    outcome.guard_refused = sum(1 for g in history.guards if not g.ok)
    outcome.expected = Counter(r["type"] for r in records if r["k"] == "expected")


def _idle_topologies(folder: Path, topologies: tuple[str, ...]) -> set[str]:
    """The topologies none of whose workers has recorded entering a critical section yet."""
    idle = set(topologies)
    for path in folder.glob("*.jsonl"):
        topology = path.stem.rsplit("-", 1)[0]
        if topology in idle and '"k": "enter"' in path.read_text(errors="replace"):
            idle.discard(topology)
    return idle


def read_records(folder: Path) -> list[dict[str, Any]]:
    """Every worker's records; a line cut short by a SIGKILL is skipped."""
    records = []
    for path in sorted(folder.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            with contextlib.suppress(json.JSONDecodeError):
                records.append(json.loads(line))
    return records


def read_sink(path: Path) -> list[checker.SinkWrite]:
    with contextlib.closing(sqlite3.connect(path)) as db:
        rows = db.execute("SELECT seq, name, token, sec, accepted, read, read_seq, before"
                          " FROM writes ORDER BY seq").fetchall()
    return [checker.SinkWrite(seq, name, token, sec, bool(accepted), read, read_seq, before)
            for seq, name, token, sec, accepted, read, read_seq, before in rows]


def read_counters(url: str, names: tuple[str, ...]) -> dict[str, tuple[int, int]]:
    """Each name's guarded ``incr`` counter and its read-modify-write twin, read afresh."""
    with qs.Queen(url) as q:
        counters = {}
        for name in names:
            incr, rmw = q.kv.get(NS, f"incr#{name}"), q.kv.get(NS, f"rmw#{name}")
            counters[name] = (int(incr["value"]) if incr else 0, int(rmw["value"]) if rmw else 0)
    return counters
