"""The worker processes of a history: one topology of ordinary use each, recording everything.

Run as ``python -m tests.history.workers TOPOLOGY JSON`` from the repository root
(the driver does). Each worker loops until killed, taking the history's lock names
in turn, and appends JSON lines to its own file:

- ``enter`` / ``exit``: a critical section (lock name, token and owner at entry;
  ``lost`` at exit: whether the library told the holder it lost the lease);
- ``ext``: a write to the external sink with ``lock.token`` (accepted or refused);
- ``guard``: a ``transaction().guard(lock)`` commit (a read-modify-write of a
  counter beside an ``incr`` of another), with its send and answer times;
- ``expected`` / ``error``: a library error (e.g. the engine restarting) or any other
  exception (always a finding); ``fork``: what a forked child found it held.

Times are ``time.monotonic()``: on Linux that is CLOCK_MONOTONIC, one clock for the
whole machine since boot, so records of different processes compare, and unlike the
wall clock it never steps when NTP corrects the time. Every record is one
``os.write`` on an ``O_APPEND`` descriptor, then fsync'd, so a SIGKILL loses at most
the record being written.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import queen_sync as qs

NS = "history"
_LOST_GRACE = 0.5  # how long a holder that sees ``held`` False waits to be told it was lost


# ---- records ---------------------------------------------------------------------------------


class Recorder:
    """Appends one JSON line per record to a worker's file (shared by its threads and forks)."""

    def __init__(self, path: str) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def emit(self, kind: str, **fields: Any) -> None:
        line = json.dumps({"k": kind, "pid": os.getpid(), "t": time.monotonic(), **fields})
        os.write(self._fd, (line + "\n").encode())
        os.fsync(self._fd)


# ---- the external sink -----------------------------------------------------------------------


class Sink:
    """A user-side store that refuses a token lower than the highest it accepted for a name.

    One SQLite file beside the engine's. Every write, accepted or refused, is logged
    with the counter value its writer read, the log position at that read, and the
    value it found when writing, so the checker can see an update overwritten.
    """

    SCHEMA = """
        CREATE TABLE IF NOT EXISTS high (name TEXT PRIMARY KEY, token INTEGER NOT NULL);
        CREATE TABLE IF NOT EXISTS counter (name TEXT PRIMARY KEY, value INTEGER NOT NULL);
        CREATE TABLE IF NOT EXISTS writes (
            seq INTEGER PRIMARY KEY AUTOINCREMENT, name TEXT, token INTEGER, sec TEXT,
            accepted INTEGER, read INTEGER, read_seq INTEGER, before INTEGER);
    """

    def __init__(self, path: str) -> None:
        self._db = sqlite3.connect(path, timeout=30, isolation_level=None,
                                   check_same_thread=False)
        self._mutex = threading.Lock()  # threads of one worker share the connection
        self._db.executescript(self.SCHEMA)

    @classmethod
    def create(cls, path: str) -> None:
        sink = cls(path)
        sink._db.execute("PRAGMA journal_mode=WAL")
        sink._db.close()

    def read(self, name: str) -> tuple[int, int]:
        """The counter for ``name`` and the last log position, read together."""
        with self._mutex:
            row = self._db.execute(
                "SELECT (SELECT value FROM counter WHERE name = ?),"
                " (SELECT MAX(seq) FROM writes)", (name,)).fetchone()
        return int(row[0] or 0), int(row[1] or 0)

    def write(self, name: str, token: int, sec: str, read: int, read_seq: int) -> tuple[bool, int]:
        """Accept ``read + 1`` as the counter if ``token`` is at least the highest accepted."""
        with self._mutex:
            db = self._db
            db.execute("BEGIN IMMEDIATE")
            try:
                high = db.execute("SELECT token FROM high WHERE name = ?", (name,)).fetchone()
                now = db.execute("SELECT value FROM counter WHERE name = ?", (name,)).fetchone()
                accepted = high is None or token >= high[0]
                if accepted:
                    db.execute("INSERT OR REPLACE INTO high VALUES (?, ?)", (name, token))
                    db.execute("INSERT OR REPLACE INTO counter VALUES (?, ?)", (name, read + 1))
                cursor = db.execute(
                    "INSERT INTO writes (name, token, sec, accepted, read, read_seq, before)"
                    " VALUES (?, ?, ?, ?, ?, ?, ?)",
                    (name, token, sec, int(accepted), read, read_seq, now[0] if now else 0))
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise
        return accepted, int(cursor.lastrowid or 0)

    def close(self) -> None:
        self._db.close()


# ---- one worker's context --------------------------------------------------------------------


@dataclass
class Ctx:
    """What every topology needs: where to record, the sink, the names, the lifetime."""

    url: str
    worker: str
    names: list[str]
    ttl: float
    folder: str
    seed: int
    rng: random.Random = field(init=False)
    rec: Recorder = field(init=False)
    sink: Sink = field(init=False)
    _count: int = 0

    def __post_init__(self) -> None:
        self.rng = random.Random(f"{self.seed}-{self.worker}-{os.getpid()}")
        self.reopen()

    def reopen(self) -> None:
        """Open the record file and the sink afresh (in a forked child: its own descriptors)."""
        self.rec = Recorder(os.path.join(self.folder, f"{self.worker}.jsonl"))
        self.sink = Sink(os.path.join(self.folder, "sink.db"))

    def new_section(self) -> str:
        self._count += 1
        return f"{self.worker}/{os.getpid()}/{threading.get_ident()}/{self._count}"

    def name(self) -> str:
        return self.rng.choice(self.names)

    def pause(self, low: float = 0.0, high: float = 0.02) -> None:
        time.sleep(self.rng.uniform(low, high))


def told_lost(lock: Optional[qs.Lock]) -> bool:
    """Whether the library told this holder its lease is gone (waiting briefly once it is)."""
    if lock is None:
        return False
    if not lock.lost.is_set() and not lock.held:
        lock.lost.wait(_LOST_GRACE)  # loss is signalled at the local deadline, give it a moment
    return lock.lost.is_set()


@contextlib.contextmanager
def section(ctx: Ctx, lock: Optional[qs.Lock], name: str, token: Optional[int],
            owner: str) -> Iterator[str]:
    """Record a critical section from here to the end of the block (inside the hold)."""
    sec = ctx.new_section()
    told = False
    try:
        # Inside the try: a loss the library raises asynchronously (a singleton job's
        # on_lost="interrupt") may land during this very record, and must still close it.
        ctx.rec.emit("enter", sec=sec, w=ctx.worker, name=name, token=token, owner=owner)
        yield sec
    except (qs.LockLostError, KeyboardInterrupt):
        told = True  # the library (or queen-sync's SIGTERM) interrupted the body with the loss
        raise
    finally:
        ctx.rec.emit("exit", sec=sec, w=ctx.worker, lost=told or told_lost(lock))


def ext_write(ctx: Ctx, sec: str, name: str, token_now: Callable[[], Optional[int]]) -> bool:
    """Read the sink's counter, take the token at use time, then write ``counter + 1``."""
    value, read_seq = ctx.sink.read(name)
    token = token_now()
    if token is None:
        return False  # the holder knows it no longer holds: it stops writing
    ctx.pause(0.0, 0.01)  # a slow step between reading the token and the write it fences
    accepted, seq = ctx.sink.write(name, token, sec, value, read_seq)
    ctx.rec.emit("ext", sec=sec, name=name, token=token, ok=accepted, seq=seq)
    return True


def guarded_write(ctx: Ctx, q: qs.Queen, lock: qs.Lock, sec: str, name: str) -> None:
    """Read-modify-write ``rmw#name`` and ``incr`` ``incr#name`` in one guarded transaction."""
    seen = q.kv.get(NS, f"rmw#{name}")
    current = int(seen["value"]) if seen else 0
    sent = time.monotonic()
    token = lock.token
    try:
        answer = (q.transaction().guard(lock)
                  .kv.incr(NS, f"incr#{name}", forever=True)
                  .kv.put(NS, f"rmw#{name}", current + 1, forever=True)
                  .commit())
        ok = bool(answer)
    except qs.LockError:
        ok = False  # the handle already knows it does not hold: nothing was sent
    ctx.rec.emit("guard", sec=sec, name=name, token=token, ok=ok, t0=sent)


def work(ctx: Ctx, q: qs.Queen, lock: qs.Lock, sec: str, rounds: int = 2) -> None:
    """The body of a critical section: fenced writes of both kinds, with pauses between."""
    for _ in range(rounds):
        if not ext_write(ctx, sec, lock.name, lambda: lock.token):
            return
        guarded_write(ctx, q, lock, sec, lock.name)
        ctx.pause()


def guarded_loop(ctx: Ctx, body: Callable[[], None], stop: Optional[threading.Event] = None
                 ) -> None:
    """Call ``body`` until stopped; record library errors as expected, anything else as found."""
    while stop is None or not stop.is_set():
        try:
            body()
        except qs.QueenError as exc:
            ctx.rec.emit("expected", type=type(exc).__name__, msg=str(exc)[:200])
            ctx.pause(0.02, 0.1)
        except Exception as exc:
            ctx.rec.emit("error", type=type(exc).__name__, msg=str(exc)[:500])
            ctx.pause(0.02, 0.1)
        ctx.pause(0.0, 0.03)


# ---- topologies ------------------------------------------------------------------------------


def plain(ctx: Ctx) -> None:
    """One client, ``with lock:`` on a handle per name."""
    q = qs.Queen(ctx.url)
    locks = {n: q.lock(n, ttl=ctx.ttl, wait=1.0) for n in ctx.names}

    def once() -> None:
        lock = locks[ctx.name()]
        with lock, section(ctx, lock, lock.name, lock.token, lock.owner) as sec:
            work(ctx, q, lock, sec)

    guarded_loop(ctx, once)


def clients(ctx: Ctx) -> None:
    """Several clients of one store in one process: one long-lived, one created again and again.

    The second thread makes a new ``Queen(url)`` for every few sections (a re-run
    setup cell, a ``@singleton_job`` default client beside an app's own), while
    the first client holds leases.
    """
    stop = threading.Event()
    resident = threading.Thread(target=plain, args=(ctx,), daemon=True)
    resident.start()

    def churn() -> None:
        with qs.Queen(ctx.url) as q:
            for _ in range(3):
                lock = q.lock(ctx.name(), ttl=ctx.ttl, wait=1.0)
                with lock, section(ctx, lock, lock.name, lock.token, lock.owner) as sec:
                    work(ctx, q, lock, sec)

    guarded_loop(ctx, churn, stop)


def forks(ctx: Ctx) -> None:
    """A worker that forks, inside a section, a child using the parent's client and its own."""
    q = qs.Queen(ctx.url)

    def once() -> None:
        lock = q.lock(ctx.name(), ttl=ctx.ttl, wait=1.0)
        with lock, section(ctx, lock, lock.name, lock.token, lock.owner) as sec:
            work(ctx, q, lock, sec, rounds=1)
            child = os.fork()
            if child == 0:
                _forked_child(ctx, q, lock)
            work(ctx, q, lock, sec, rounds=1)
        _reap(child, 10.0)

    guarded_loop(ctx, once)


def _forked_child(ctx: Ctx, q: qs.Queen, parents: qs.Lock) -> None:
    """In the child: it must hold nothing; then it takes locks with both clients, and exits."""
    code = 0
    try:
        ctx.reopen()
        ctx.rec.emit("fork", w=ctx.worker, inherited=parents.held or parents.token is not None)
        own = qs.Queen(ctx.url)
        for client in (q, own):
            lock = client.lock(ctx.name(), ttl=ctx.ttl, wait=2.0)
            with lock, section(ctx, lock, lock.name, lock.token, lock.owner) as sec:
                work(ctx, client, lock, sec, rounds=1)
        own.close()
        q.close()
    except qs.QueenError as exc:
        ctx.rec.emit("expected", type=type(exc).__name__, msg=str(exc)[:200])
    except BaseException as exc:
        ctx.rec.emit("error", type=type(exc).__name__, msg=str(exc)[:500])
        code = 3
    os._exit(code)


def _reap(pid: int, within: float) -> None:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if os.waitpid(pid, os.WNOHANG)[0]:
            return
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)


def singleton(ctx: Ctx) -> None:
    """``@singleton_job`` bodies that enter ``with qs.current_lock():`` as a helper would."""
    q = qs.Queen(ctx.url)

    def body() -> None:
        lock = qs.current_lock()
        assert lock is not None, "a singleton_job body runs without a current lock"
        with section(ctx, lock, lock.name, lock.token, lock.owner) as sec:
            work(ctx, q, lock, sec, rounds=1)
            with qs.current_lock() or lock:  # a helper that fences with "the current lock"
                work(ctx, q, lock, sec, rounds=1)
            work(ctx, q, lock, sec, rounds=1)

    jobs = [qs.singleton_job(n, ttl=ctx.ttl, wait=1.0, client=q)(body) for n in ctx.names]
    guarded_loop(ctx, lambda: ctx.rng.choice(jobs)())


def nested(ctx: Ctx) -> None:
    """``with lock:`` inside ``with lock:``, and ``lock.run(f)`` inside ``with lock:``."""
    q = qs.Queen(ctx.url)
    locks = {n: q.lock(n, ttl=ctx.ttl, wait=1.0) for n in ctx.names}

    def once() -> None:
        lock = locks[ctx.name()]
        with lock, section(ctx, lock, lock.name, lock.token, lock.owner) as sec:
            work(ctx, q, lock, sec, rounds=1)
            if ctx.rng.random() < 0.5:
                with lock:
                    work(ctx, q, lock, sec, rounds=1)
            else:
                lock.run(work, ctx, q, lock, sec, 1)
            ctx.pause(0.01, 0.03)  # the outer block goes on after the inner one has ended
            work(ctx, q, lock, sec, rounds=1)

    guarded_loop(ctx, once)


def threads(ctx: Ctx) -> None:
    """Two threads doing ``with lock:`` on the SAME handle object."""
    q = qs.Queen(ctx.url)
    lock = q.lock(ctx.names[0], ttl=ctx.ttl, wait=1.0)

    def once() -> None:
        with lock, section(ctx, lock, lock.name, lock.token, lock.owner) as sec:
            work(ctx, q, lock, sec)

    other = threading.Thread(target=guarded_loop, args=(ctx, once), daemon=True)
    other.start()
    guarded_loop(ctx, once)


def cli(ctx: Ctx) -> None:
    """``queen-sync run NAME -- python -m tests.history.workers cs ...`` again and again."""
    args = json.dumps(_args(ctx))
    while True:
        done = subprocess.run(
            [sys.executable, "-m", "queen_sync", "run", ctx.name(), "--url", ctx.url,
             "--ttl", str(ctx.ttl), "--wait", "1", "--grace", "1", "--",
             sys.executable, "-m", "tests.history.workers", "cs", args],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, check=False)
        if done.returncode not in (0, 75, 76, 69):
            ctx.rec.emit("error", type="ExitCode", msg=f"queen-sync run exited {done.returncode}: "
                         f"{done.stderr.decode(errors='replace')[-400:]}")
        ctx.pause(0.0, 0.05)


def cs(ctx: Ctx) -> None:
    """The command under ``queen-sync run``: a section using ``QUEEN_LOCK_TOKEN``.

    It lasts longer than the lifetime, so that if ``queen-sync`` dies the lease
    expires while the command would still be writing. A SIGTERM from queen-sync
    (the lease was lost) ends it as told.
    """
    name, token = os.environ["QUEEN_LOCK_NAME"], int(os.environ["QUEEN_LOCK_TOKEN"])

    def told(signum: int, frame: Any) -> None:
        raise qs.LockLostError(f"queen-sync stopped the command (signal {signum})", name=name)

    signal.signal(signal.SIGTERM, told)
    with section(ctx, None, name, token, os.environ["QUEEN_LOCK_OWNER"]) as sec:
        until = time.monotonic() + ctx.ttl * 1.5
        while time.monotonic() < until:
            ext_write(ctx, sec, name, lambda: token)
            ctx.pause(0.02, 0.08)


TOPOLOGIES: dict[str, Callable[[Ctx], None]] = {
    "plain": plain, "clients": clients, "forks": forks, "singleton": singleton,
    "cli": cli, "nested": nested, "threads": threads,
}


def _args(ctx: Ctx) -> dict[str, Any]:
    return {"url": ctx.url, "worker": ctx.worker, "names": ctx.names, "ttl": ctx.ttl,
            "folder": ctx.folder, "seed": ctx.seed}


def main(argv: list[str]) -> None:
    topology, raw = argv
    ctx = Ctx(**json.loads(raw))
    if topology == "cs":
        cs(ctx)
        return
    ctx.rec.emit("start", w=ctx.worker, topology=topology)
    TOPOLOGIES[topology](ctx)


if __name__ == "__main__":
    main(sys.argv[1:])
