"""What holding many leases costs, on SQLite, PostgreSQL and HTTP, measured in one run.

    python benchmarks/bench_scale.py [--quick] [--url URL] [--leases N] [--close N]
                                     [--engines sqlite,postgres,http] [--only tick]

1. one renew tick of a client holding 10,000 leases (``--quick``: 2,000): its wall time,
   beside the same number of renews sent as ONE raw ``q.locks.batch`` call by another
   client (the engine's own cost, with no handle in it), on each engine; on PostgreSQL
   also beside the ceiling: the same renews as bare guarded UPDATEs over arrays, one
   durable transaction per engine chunk, with no advisory lock, no row read back and no
   semantics (what the database's writes alone cost); on SQLite beside the same renews as
   bare guarded UPDATEs in one transaction of the file;
2. ``close()`` of a client holding 5,000 leases (``--quick``: 1,000): its wall time
   against its 3 s budget, and how many leases a fresh client still finds held, beside
   how many one ``release()`` per lease gives back in the same 3 s;
3. acquire+release pairs/s of a ``Lock`` handle on an empty store, beside the same with
   10,000 other leases held whose names sort before, and after, the probe's name, on
   the two SQL engines (interleaved rounds, so a slow spell slows all three alike).

PostgreSQL runs on a throwaway server (``tests/pg_server.py``) unless ``--url`` names one;
the HTTP engine talks to a ``LocalBroker`` on 127.0.0.1. The 1-minute load average is
printed beside each figure (the machine is shared), and a summary table closes the run.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import sqlite3
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterator, Optional

import queen_sync as qs
from queen_sync._ops import LOCKS_NS, LockOps
from queen_sync.testing import LocalBroker

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _measure as m

TICK_TARGET = 0.5  # seconds for one renew tick of 10,000 leases on the SQL engines
ACQUIRE_SLOWDOWN = 1.2  # acquire with 10,000 others held, at most this much slower


def load() -> str:
    return f"load {os.getloadavg()[0]:.2f}"


def hold(q: qs.Queen, names: list[str], renew_every: Optional[float] = None) -> list[qs.Lock]:
    """Handles holding ``names`` for an hour, taken by a few threads (engines serve in turn)."""
    locks = [q.lock(name, ttl=3600, renew_every=renew_every) for name in names]
    with ThreadPoolExecutor(8) as pool:
        if not all(pool.map(lambda lock: lock.acquire(), locks)):
            raise SystemExit("a lease could not be taken on a fresh store")
    return locks


def hold_on_the_wire(q: qs.Queen, names: list[str]) -> list[dict[str, object]]:
    """Leases held through ``q.locks``, no handle kept, in calls of 1,000."""
    answers: list[dict[str, object]] = []
    for start in range(0, len(names), 1000):
        ops = [LockOps.acquire(name, ttl_seconds=3600, owner=f"bench-{name}")
               for name in names[start:start + 1000]]
        answers += [dict(a) for a in q.locks.batch(ops)]
    if not all(a["acquired"] for a in answers):
        raise SystemExit("a wire lease could not be taken on a fresh store")
    return answers


def still_held(url: str, names: list[str]) -> int:
    with qs.Queen(url) as other:
        return sum(bool(answer["held"]) for start in range(0, len(names), 1000)
                   for answer in other.locks.batch(
                       [LockOps.get(name) for name in names[start:start + 1000]]))


# ---- 1. one renew tick ------------------------------------------------------------------


def timed_tick(q: qs.Queen, locks: list[qs.Lock]) -> float:
    """One tick once every lease is due; it must renew them all in one call."""
    time.sleep(max(0.0, max(lock.renew_due for lock in locks) - time.monotonic()))
    calls, started = q.renewer.calls, time.perf_counter()
    q.renewer.tick()
    took = time.perf_counter() - started
    if q.renewer.calls != calls + 1 or not all(lock.held for lock in locks):
        raise SystemExit(f"{q.url}: a tick lost leases or made several calls")
    return took


def timed_raw_renewal(raw: qs.Queen, answers: list[dict[str, object]]) -> float:
    """The same number of renews as one ``q.locks.batch`` call; ``answers`` move on."""
    ops = [LockOps.renew(f"raw-{i:05d}", token=int(str(a["token"])), ttl_seconds=3600, slot=0,
                         owner=f"bench-raw-{i:05d}") for i, a in enumerate(answers)]
    started = time.perf_counter()
    answers[:] = [dict(a) for a in raw.locks.batch(ops)]
    return time.perf_counter() - started


class BareRenewal:
    """The ceiling on PostgreSQL: renews as bare guarded UPDATEs, no engine around them."""

    def __init__(self, url: str, answers: list[dict[str, object]]) -> None:
        import psycopg  # only the PostgreSQL figures need it

        from queen_sync._engines.postgres.engine import LOCKS_PER_TRANSACTION

        self.chunk = LOCKS_PER_TRANSACTION
        dsn, schema = url.rsplit("?schema=", 1)
        self.conn = psycopg.connect(dsn, autocommit=True)
        self.tokens = {f"bare-{i:05d}#0": int(str(a["token"])) for i, a in enumerate(answers)}
        self.statement = (
            f'UPDATE "{schema}".kv AS k SET version = nextval(\'"{schema}".version\'::regclass),'
            " expires_at = c.now + 3600000, updated_at = c.now, prev_version = r.token"
            " FROM unnest(%s::text[], %s::bigint[]) AS r(key, token), (SELECT floor(extract("
            "epoch FROM clock_timestamp()) * 1000)::bigint AS now) AS c"
            " WHERE k.ns = %s AND k.key = r.key AND k.version = r.token RETURNING k.key, k.version")

    def seconds(self) -> float:
        """One pass over every lease, in chunks of the engine's size; tokens move on."""
        keys = list(self.tokens)
        started = time.perf_counter()
        for start in range(0, len(keys), self.chunk):
            chunk = keys[start:start + self.chunk]
            rows = self.conn.execute(self.statement, (
                chunk, [self.tokens[key] for key in chunk], LOCKS_NS)).fetchall()
            self.tokens.update({key: int(version) for key, version in rows})
            if len(rows) != len(chunk):
                raise SystemExit("a bare renew missed its row")
        return time.perf_counter() - started


class BareSqliteRenewal:
    """The ceiling on SQLite: the same renews as bare guarded UPDATEs in ONE transaction of
    the engine's file, the counter read and written once, with no semantics around them."""

    def __init__(self, url: str, answers: list[dict[str, object]]) -> None:
        self.path = url[len("sqlite://"):]
        self.tokens = {f"bare-{i:05d}#0": int(str(a["token"])) for i, a in enumerate(answers)}

    def seconds(self) -> float:
        conn = sqlite3.connect(self.path, isolation_level=None)
        try:
            conn.execute("PRAGMA synchronous=NORMAL")  # the engine's default
            started = time.perf_counter()
            conn.execute("BEGIN IMMEDIATE")
            counter = conn.execute("SELECT value FROM queen_meta WHERE name = 'version'")
            first = int(counter.fetchone()[0]) + 1
            now = int(time.time() * 1000)
            rows = [(first + i, now + 3_600_000, now, token, LOCKS_NS, key, token)
                    for i, (key, token) in enumerate(self.tokens.items())]
            changed = conn.executemany(
                "UPDATE queen_kv SET version = ?, expires_at = ?, updated_at = ?, prev_version = ?"
                " WHERE ns = ? AND key = ? AND version = ?", rows).rowcount
            conn.execute("UPDATE queen_meta SET value = ? WHERE name = 'version'",
                         (first + len(rows) - 1,))
            conn.execute("COMMIT")
            took = time.perf_counter() - started
        finally:
            conn.close()
        if changed != len(rows):
            raise SystemExit("a bare SQLite renew missed its row")
        self.tokens = {key: row[0] for key, row in zip(self.tokens, rows)}
        return took


def tick_seconds(url: str, leases: int, kind: str) -> tuple[float, float, Optional[float], str]:
    """Medians of three ticks, three raw batches and (PostgreSQL) three bare passes, taken
    in turn so that noise hits all alike."""
    with qs.Queen(url, renew_thread=False) as q, qs.Queen(url) as raw:
        # A long lifetime renewed every second: every lease is due after one second.
        locks = hold(q, [f"tick-{i:05d}" for i in range(leases)], renew_every=1.0)
        answers = hold_on_the_wire(raw, [f"raw-{i:05d}" for i in range(leases)])
        bare: Optional[BareRenewal | BareSqliteRenewal] = None
        if kind in ("postgres", "sqlite"):
            held = hold_on_the_wire(raw, [f"bare-{i:05d}" for i in range(leases)])
            bare = BareRenewal(url, held) if kind == "postgres" else BareSqliteRenewal(url, held)
        ticks, batches, floors = [], [], []
        for _ in range(3):
            ticks.append(timed_tick(q, locks))
            batches.append(timed_raw_renewal(raw, answers))
            if bare is not None:
                floors.append(bare.seconds())
        measured_at = load()
        if isinstance(bare, BareRenewal):
            bare.conn.close()
    return (statistics.median(ticks), statistics.median(batches),
            statistics.median(floors) if floors else None, measured_at)


def bench_ticks(urls: dict[str, str], leases: int) -> None:
    print(f"1. one renew tick of a client holding {leases:,} leases (median of 3)")
    for kind, url in urls.items():
        tick, batch, floor, measured_at = tick_seconds(url, leases, kind)
        bare = "" if floor is None else f"   bare UPDATEs {floor * 1000:6.0f} ms"
        print(f"   {kind:9s} tick {tick * 1000:8.0f} ms   raw batch of the same renews "
              f"{batch * 1000:8.0f} ms{bare}   ({measured_at})")
        target = f"< {TICK_TARGET * 1000:.0f} ms" if kind != "http" else ""
        ceiling = ("" if floor is None
                   else f", bare UPDATEs {floor * 1000:.0f} ms ({tick / floor:.2f}x)")
        m.row(f"renew tick, {leases:,} leases, {kind}", f"{tick * 1000:.0f} ms",
              f"raw batch {batch * 1000:.0f} ms ({tick / batch:.2f}x){ceiling}; {measured_at}",
              target, tick < TICK_TARGET if target and leases >= 10_000 else None)


# ---- 2. close() of a client holding many ------------------------------------------------


def one_by_one(url: str, leases: int, budget: float = 3.0) -> int:
    """How many of ``leases`` a ``release()`` per lease gives back within ``budget``: the peer."""
    names = [f"each-{i:05d}" for i in range(leases)]
    with qs.Queen(url) as q:
        locks = hold(q, names)
        ends, done = time.monotonic() + budget, 0
        for lock in locks:
            if time.monotonic() >= ends:
                break
            lock.release()
            done += 1
        return done  # close() gives back the rest


def bench_close(urls: dict[str, str], leases: int) -> None:
    print(f"2. close() of a client holding {leases:,} leases (budget 3 s)")
    for kind, url in urls.items():
        names = [f"close-{i:05d}" for i in range(leases)]
        q = qs.Queen(url)
        hold(q, names)
        started = time.perf_counter()
        q.close()
        took = time.perf_counter() - started
        left = still_held(url, names)
        measured_at = load()
        each = one_by_one(url, leases)
        print(f"   {kind:9s} {took * 1000:8.0f} ms, {left} still held   one release() per "
              f"lease gives back {each:,} in 3 s   ({measured_at})")
        m.row(f"close(), {leases:,} leases, {kind}", f"{took * 1000:.0f} ms",
              f"{left} left held; one call per lease: {each:,} in 3 s; {measured_at}",
              "all released", left == 0)


# ---- 3. acquire with many others held ---------------------------------------------------


@contextlib.contextmanager
def probe_pairs(url: str, others: list[str]) -> Iterator[Callable[[], None]]:
    """Acquire+release of one handle on a store where ``others`` are held on the wire."""
    with qs.Queen(url) as holder, qs.Queen(url) as q:
        hold_on_the_wire(holder, others)
        lock = q.lock("m-probe", ttl=30)

        def pair() -> None:
            lock.acquire()
            lock.release()

        yield pair


def bench_acquire(stores: dict[str, Callable[[str], str]], held: int, seconds: float) -> None:
    print(f"3. acquire+release pairs/s, empty store vs {held:,} other leases held")
    for kind, fresh in stores.items():
        with probe_pairs(fresh("empty"), []) as empty, \
                probe_pairs(fresh("before"), [f"a-{i:05d}" for i in range(held)]) as before, \
                probe_pairs(fresh("after"), [f"z-{i:05d}" for i in range(held)]) as after:
            rates = m.rates({"empty": empty, "before": before, "after": after}, seconds)
        measured_at = load()
        print(f"   {kind:9s} empty {rates['empty']:7,.0f}/s   names before "
              f"{rates['before']:7,.0f}/s   names after {rates['after']:7,.0f}/s   ({measured_at})")
        for side in ("before", "after"):
            slowdown = rates["empty"] / rates[side]
            m.row(f"acquire, {held:,} held ({side}), {kind}", f"{rates[side]:,.0f} pairs/s",
                  f"empty store {rates['empty']:,.0f}/s: {slowdown:.2f}x its time; "
                  f"{measured_at}",
                  f"<= {ACQUIRE_SLOWDOWN}x", slowdown <= ACQUIRE_SLOWDOWN)


# ---- the run ----------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer leases, shorter rounds")
    parser.add_argument("--url", help="an existing PostgreSQL server (default: start one)")
    parser.add_argument("--leases", type=int, help="leases held for the tick and the acquire")
    parser.add_argument("--close", type=int, help="leases held by the closing client")
    parser.add_argument("--engines", default="sqlite,postgres,http",
                        help="comma-separated engines to measure (default: all three)")
    parser.add_argument("--only", choices=["tick", "close", "acquire"], action="append",
                        help="run only these sections (repeatable; default: all)")
    args = parser.parse_args()
    leases = args.leases or (2_000 if args.quick else 10_000)
    closing = args.close or (1_000 if args.quick else 5_000)
    from bench_postgres import server_url  # needs psycopg, as the PostgreSQL figures do

    with tempfile.TemporaryDirectory() as folder, server_url(args.url, fsync=True) as pg, \
            LocalBroker(os.path.join(folder, "broker.db")) as broker:

        def sqlite(tag: str) -> str:
            return f"sqlite://{folder}/{tag}-{secrets.token_hex(4)}.db"

        def postgres(tag: str) -> str:
            return f"{pg}?schema=s_{tag}_{secrets.token_hex(4)}"

        print(f"{os.cpu_count()} CPUs; queen_sync {qs.__version__}; {load()}\n")
        def http(tag: str) -> str:
            return broker.url  # one broker, and the names of each measurement are its own

        every: dict[str, Callable[[str], str]] = {"sqlite": sqlite, "postgres": postgres,
                                                  "http": http}
        engines = {kind: every[kind] for kind in args.engines.split(",")}
        chosen = set(args.only or ["tick", "close", "acquire"])
        if "tick" in chosen:
            bench_ticks({kind: fresh("tick") for kind, fresh in engines.items()}, leases)
        if "close" in chosen:
            bench_close({kind: fresh("close") for kind, fresh in engines.items()}, closing)
        if "acquire" in chosen:
            bench_acquire({k: f for k, f in engines.items() if k != "http"}, leases,
                          1.0 if args.quick else 3.0)
    m.summary()


if __name__ == "__main__":
    main()
