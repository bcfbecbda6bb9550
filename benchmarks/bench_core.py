"""The embedded engine's core figures, measured side by side in one run on this machine.

    python benchmarks/bench_core.py [--quick] [--dir PATH]

1. uncontended acquire+release pairs/s: a ``Lock`` handle (auto-renewed) and the
   stateless ``q.locks`` wire, beside ``filelock`` and ``portalocker`` on the same disk;
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
import sys
import tempfile
import threading
import time

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
                            "portalocker": portalocker_pair}, seconds * 3)
    handle, wire = measured["handle"], measured["wire"]
    filelock_rate, portalocker_rate = measured["filelock"], measured["portalocker"]
    for label, value in (("lock.acquire(); lock.release()", handle),
                         ("q.locks.acquire/release", wire), ("filelock.FileLock", filelock_rate),
                         ("portalocker.Lock", portalocker_rate)):
        print(f"   {label:34s} {value:10,.0f} pairs/s")
    against = f"filelock {filelock_rate:,.0f} ({handle / filelock_rate:.2f}x); " \
              f"portalocker {portalocker_rate:,.0f} ({handle / portalocker_rate:.2f}x)"
    m.row("pairs/s, Lock handle (auto_renew)", f"{handle:,.0f}", against, ">= 4,000",
        handle >= 4000)
    m.row("pairs/s, q.locks wire", f"{wire:,.0f}",
        f"filelock {wire / filelock_rate:.2f}x; portalocker {wire / portalocker_rate:.2f}x",
        ">= 4,000", wire >= 4000)


# ---- 2. hand-off latency ----------------------------------------------------------------


def bench_handoff(folder: str, samples: int) -> None:
    print(f"2. hand-off latency, {samples} samples")
    latencies = m.queen_handoffs("sqlite://" + os.path.join(folder, "handoff.db"), samples,
                                 pause_max=0.06)
    print(f"   {m.latency_line(latencies)}")
    p50, p95 = m.percentile(latencies, 50), m.percentile(latencies, 95)
    m.row("hand-off p50", m.ms(p50), f"p95 {m.ms(p95)}", "<= 10 ms", p50 <= 0.010)


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
        bench_handoff(folder, 60 if args.quick else 200)
        bench_takeover(folder, 2 if args.quick else 4)
        bench_renewer(folder, 2000 if args.quick else 10_000, 3)
    m.summary()


if __name__ == "__main__":
    main()
