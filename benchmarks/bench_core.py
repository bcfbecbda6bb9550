"""The embedded engine's core figures, measured side by side in one run on this machine.

    python benchmarks/bench_core.py [--quick] [--dir PATH]

1. uncontended acquire+release pairs/s: a ``Lock`` handle (auto-renewed) and the
   stateless ``q.locks`` wire, beside ``filelock`` and ``portalocker`` on the same disk
   and beside the ceiling, the fewest SQL statements a pair with fencing tokens needs
   sent through ``sqlite3`` directly; then the same handle with 10,000 other leases held
   (names sorting before and after it) beside an empty store, and 4 processes taking
   turns on one lock beside 4 processes taking turns on one ``filelock``;
2. hand-off latency: one process releases, another waiting in ``acquire(wait=...)``
   holds it (``time.time()`` on both sides, one machine);
3. takeover after the holder is SIGKILLed (ttl 2 s), from the kill and from the
   lease's expiry as the engine recorded it;
4. the renewer's cost for 10,000 leases of ttl 3 s on one client: threads, engine
   calls per tick and per renew period, CPU % of the process.

A summary table with targets and ratios closes the run.
"""

from __future__ import annotations

import argparse
import os
import sqlite3
import sys
import tempfile
import threading
import time
from typing import Callable

import filelock
import portalocker

import queen_sync as qs

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # _measure, in spawn children too
import _measure as m

# ---- 1. uncontended pairs/s --------------------------------------------------------------


def bench_pairs(folder: str, seconds: float) -> None:
    print("1. uncontended acquire+release pairs/s, interleaved rounds")
    flock = filelock.FileLock(os.path.join(folder, "filelock.lock"))
    plock = portalocker.Lock(os.path.join(folder, "portalocker.lock"), timeout=5)

    def filelock_pair() -> None:
        flock.acquire()
        flock.release()

    def portalocker_pair() -> None:
        plock.acquire()
        plock.release()

    with qs.Queen("sqlite://" + os.path.join(folder, "pairs.db")) as q:
        measured = m.rates({**m.queen_pairs(q), "filelock": filelock_pair,
                            "portalocker": portalocker_pair,
                            "raw": raw_sqlite_pair(os.path.join(folder, "raw.db"))}, seconds * 3)
    handle, wire = measured["handle"], measured["wire"]
    filelock_rate, portalocker_rate = measured["filelock"], measured["portalocker"]
    for label, value in (("lock.acquire(); lock.release()", handle),
                         ("q.locks.acquire/release", wire), ("filelock.FileLock", filelock_rate),
                         ("portalocker.Lock", portalocker_rate),
                         ("raw SQL on sqlite3 (ceiling)", measured["raw"])):
        print(f"   {label:34s} {value:10,.0f} pairs/s")
    print(f"   ({m.load_average()})")
    against = f"filelock {filelock_rate:,.0f} ({handle / filelock_rate:.2f}x); " \
              f"portalocker {portalocker_rate:,.0f} ({handle / portalocker_rate:.2f}x)"
    m.row("pairs/s, Lock handle (auto_renew)", f"{handle:,.0f}", against, ">= 4,000",
        handle >= 4000)
    m.row("pairs/s, q.locks wire", f"{wire:,.0f}",
        f"filelock {wire / filelock_rate:.2f}x; portalocker {wire / portalocker_rate:.2f}x",
        ">= 4,000", wire >= 4000)
    m.row("pairs/s, Lock handle vs filelock", f"{handle / filelock_rate:.2f}x",
          f"raw SQL ceiling {measured['raw']:,.0f} ({handle / measured['raw']:.2f}x of it)",
          ">= 0.8x", handle >= 0.8 * filelock_rate)


_RAW_SCHEMA = """
CREATE TABLE IF NOT EXISTS kv (ns TEXT NOT NULL, key TEXT NOT NULL, value TEXT NOT NULL,
    version INTEGER NOT NULL, expires_at INTEGER, PRIMARY KEY (ns, key)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value INTEGER NOT NULL);
INSERT OR IGNORE INTO meta VALUES ('version', 0);
"""


def raw_sqlite_pair(path: str) -> Callable[[], None]:
    """The ceiling: one pair as the fewest statements that keep a store-wide token counter.

    Acquire draws the next token and inserts the permit, or takes it over when expired, in
    one write transaction; release deletes it only at that token. No Python around it.
    """
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=NORMAL")
    conn.executescript(_RAW_SCHEMA)

    def pair() -> None:
        now = int(time.time() * 1000)
        conn.execute("BEGIN IMMEDIATE")
        (token,) = conn.execute(
            "UPDATE meta SET value = value + 1 WHERE name = 'version' RETURNING value").fetchone()
        conn.execute(
            "INSERT INTO kv VALUES ('queen-locks', 'raw#0', '{}', ?, ?) ON CONFLICT (ns, key)"
            " DO UPDATE SET value = excluded.value, version = excluded.version,"
            " expires_at = excluded.expires_at WHERE kv.expires_at <= ?",
            (token, now + 30_000, now))
        conn.execute("COMMIT")
        conn.execute("DELETE FROM kv WHERE ns = 'queen-locks' AND key = 'raw#0' AND version = ?",
                     (token,))

    return pair


def bench_crowded(folder: str, seconds: float, others: int) -> None:
    print(f"   with {others:,} other leases held (half named before the probe, half after)")
    with qs.Queen("sqlite://" + os.path.join(folder, "empty.db")) as empty, \
            qs.Queen("sqlite://" + os.path.join(folder, "crowded.db")) as crowded:
        for start in range(0, others, 500):
            crowded.locks.batch([
                {"op": "acquire", "name": f"{'a' if i % 2 else 'z'}-{i:06d}", "ttlSeconds": 3600}
                for i in range(start, min(others, start + 500))])
        measured = m.rates({"empty": m.queen_pairs(empty)["handle"],
                            "crowded": m.queen_pairs(crowded)["handle"]}, seconds * 2)
    ratio = measured["empty"] / measured["crowded"]
    print(f"   empty store {measured['empty']:10,.0f} pairs/s; {others:,} held "
          f"{measured['crowded']:10,.0f} pairs/s ({m.load_average()})")
    m.row(f"pairs/s, {others:,} other leases held", f"{measured['crowded']:,.0f}",
          f"empty store {measured['empty']:,.0f} (a pair costs {ratio:.2f}x)", "<= 1.2x",
          ratio <= 1.2)


def bench_contended(folder: str, seconds: float, processes: int = 4) -> None:
    print(f"   {processes} processes taking turns on one lock, {seconds:.0f} s each")
    queen = m.contended_rate(m.queen_contender, "sqlite://" + os.path.join(folder, "turns.db"),
                             processes, seconds)
    peer = m.contended_rate(m.filelock_contender, os.path.join(folder, "turns.lock"),
                            processes, seconds)
    print(f"   Lock.acquire(wait=...) {queen:10,.0f}/s; filelock {peer:10,.0f}/s "
          f"({m.load_average()})")
    m.row(f"acquisitions/s, {processes} contending processes", f"{queen:,.0f}",
          f"filelock {peer:,.0f} ({queen / peer:.2f}x)", "", None)


# ---- 2. hand-off latency ----------------------------------------------------------------


def bench_handoff(folder: str, samples: int) -> None:
    print(f"2. hand-off latency, {samples} samples")
    latencies = m.queen_handoffs("sqlite://" + os.path.join(folder, "handoff.db"), samples,
                                 pause_max=0.06)
    print(f"   {m.latency_line(latencies)}")
    p50, p95 = m.percentile(latencies, 50), m.percentile(latencies, 95)
    m.row("hand-off p50", m.ms(p50), f"p95 {m.ms(p95)}", "<= 2 ms", p50 <= 0.002)


# ---- 3. takeover after SIGKILL ----------------------------------------------------------


def bench_takeover(folder: str, samples: int, ttl: float = 2.0) -> None:
    print(f"3. takeover after SIGKILL, ttl {ttl:.0f} s, {samples} samples")
    from_kill, from_expiry = m.takeovers("sqlite://" + os.path.join(folder, "takeover.db"),
                                         samples, ttl, expiry=True)
    worst = max(from_kill)
    m.row("takeover after SIGKILL (worst)", f"{worst * 1000:.0f} ms",
        f"{max(from_expiry) * 1000:.1f} ms past expiry", f"<= {ttl * 1000 + 100:.0f} ms",
        worst <= ttl + 0.1)


# ---- 4. the renewer's cost ----------------------------------------------------------------


def bench_renewer(folder: str, leases: int, periods: int, ttl: float = 3.0) -> None:
    print(f"4. renewer cost, {leases:,} leases of ttl {ttl:.0f} s on one client")
    threads_before = threading.active_count()
    with qs.Queen("sqlite://" + os.path.join(folder, "renewer.db")) as q:
        handles = [q.lock(f"lease-{i}", ttl=ttl) for i in range(leases)]
        started = time.perf_counter()
        for handle in handles:
            if not handle.acquire():
                raise RuntimeError(f"could not take {handle.name}")
        print(f"   took {leases:,} leases in {time.perf_counter() - started:.1f} s")
        time.sleep(ttl / 3 + 0.2)  # let the renewer settle into its rhythm
        ticks, calls = q.renewer.ticks, q.renewer.calls
        wall, cpu = time.perf_counter(), time.process_time()
        window = periods * ttl / 3
        time.sleep(window)
        cpu_pct = 100 * (time.process_time() - cpu) / (time.perf_counter() - wall)
        ticks, calls = q.renewer.ticks - ticks, q.renewer.calls - calls
        threads = threading.active_count() - threads_before + 1
        lost = sum(1 for h in handles if not h.held)
    per_tick = calls / max(1, ticks)
    per_period = calls / periods
    print(f"   {threads} threads; {ticks} ticks and {calls} engine calls in {window:.0f} s "
          f"({per_tick:.2f} calls/tick, {per_period:.1f} calls per renew period); "
          f"CPU {cpu_pct:.1f}% of one core; {lost} leases not held")
    m.row("renewer threads (10k leases)", str(threads), "", "<= 2", threads <= 2)
    m.row("engine calls per renew tick", f"{per_tick:.2f}", f"{ticks} ticks in {window:.0f} s",
        "<= 1", per_tick <= 1)
    m.row("engine calls per renew period", f"{per_period:.1f}", f"{leases:,} leases",
        "~1 (one batch)", per_period <= 2)
    m.row("renewer CPU (10k leases)", f"{cpu_pct:.1f}% of a core", f"{lost} leases lost", "", None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="shorter runs, fewer samples")
    parser.add_argument("--dir", help="folder for the database and lock files (default: a "
                        "temporary folder)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="queen_sync-bench-") as folder:
        print(f"files in {folder}; {os.cpu_count()} CPUs; queen_sync {qs.__version__}\n")
        bench_pairs(folder, 0.5 if args.quick else 1.5)
        bench_crowded(folder, 0.5 if args.quick else 1.5, 10_000)
        bench_contended(folder, 2 if args.quick else 5)
        bench_handoff(folder, 60 if args.quick else 200)
        bench_takeover(folder, 2 if args.quick else 4)
        bench_renewer(folder, 2000 if args.quick else 10_000, 3)
    m.summary()


if __name__ == "__main__":
    main()
