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
import multiprocessing
import os
import random
import signal
import statistics
import tempfile
import threading
import time
from typing import Any, Callable, Optional

import filelock
import portalocker

import queen_sync as qs

CTX = multiprocessing.get_context("spawn")
ROWS: list[tuple[str, str, str, str, str]] = []


def row(metric: str, figure: str, beside: str = "", target: str = "", ok: Optional[bool] = None
        ) -> None:
    verdict = "" if ok is None else ("met" if ok else "MISSED")
    ROWS.append((metric, figure, beside, target, verdict))


def rate(pair: Callable[[], None], seconds: float, rounds: int = 3) -> float:
    """Pairs per second: the median of ``rounds`` timed runs of ``seconds`` each."""
    for _ in range(200):
        pair()  # warm caches and the file's pages
    rates = []
    for _ in range(rounds):
        done, started = 0, time.perf_counter()
        deadline = started + seconds
        while True:
            for _ in range(100):
                pair()
            done += 100
            now = time.perf_counter()
            if now >= deadline:
                break
        rates.append(done / (now - started))
    return statistics.median(rates)


# ---- 1. uncontended pairs/s --------------------------------------------------------------


def bench_pairs(folder: str, seconds: float) -> None:
    print("1. uncontended acquire+release pairs/s")
    with qs.Queen("sqlite://" + os.path.join(folder, "pairs.db")) as q:
        lock = q.lock("pairs", ttl=30)

        def handle_pair() -> None:
            lock.acquire()
            lock.release()

        def wire_pair() -> None:
            answer = q.locks.acquire("wire", ttl_seconds=30)
            q.locks.release("wire", token=answer["token"], slot=answer["slot"])

        handle = rate(handle_pair, seconds)
        wire = rate(wire_pair, seconds)
    flock = filelock.FileLock(os.path.join(folder, "filelock.lock"))
    filelock_rate = rate(lambda: (flock.acquire(), flock.release()), seconds)
    plock = portalocker.Lock(os.path.join(folder, "portalocker.lock"), timeout=5)
    portalocker_rate = rate(lambda: (plock.acquire(), plock.release()), seconds)
    for label, value in (("lock.acquire(); lock.release()", handle),
                         ("q.locks.acquire/release", wire), ("filelock.FileLock", filelock_rate),
                         ("portalocker.Lock", portalocker_rate)):
        print(f"   {label:34s} {value:10,.0f} pairs/s")
    against = f"filelock {filelock_rate:,.0f} ({handle / filelock_rate:.2f}x); " \
              f"portalocker {portalocker_rate:,.0f} ({handle / portalocker_rate:.2f}x)"
    row("pairs/s, Lock handle (auto_renew)", f"{handle:,.0f}", against, ">= 4,000",
        handle >= 4000)
    row("pairs/s, q.locks wire", f"{wire:,.0f}",
        f"filelock {wire / filelock_rate:.2f}x; portalocker {wire / portalocker_rate:.2f}x",
        ">= 4,000", wire >= 4000)


# ---- 2. hand-off latency ----------------------------------------------------------------


def handoff_waiter(url: str, conn: Any) -> None:
    """Each round: say "waiting", wait for the lock, answer the time it was held, release."""
    q = qs.Queen(url)
    lock = q.lock("handoff", ttl=10)
    while conn.recv() == "go":
        conn.send("waiting")
        got = lock.acquire(wait=5)
        held_at = time.time()
        lock.release()
        conn.send(held_at if got else None)
    q.close()


def bench_handoff(folder: str, samples: int) -> None:
    print(f"2. hand-off latency, {samples} samples")
    url = "sqlite://" + os.path.join(folder, "handoff.db")
    here, there = CTX.Pipe()
    waiter = CTX.Process(target=handoff_waiter, args=(url, there), daemon=True)
    waiter.start()
    latencies: list[float] = []
    with qs.Queen(url) as q:
        lock = q.lock("handoff", ttl=10)
        for _ in range(samples):
            if not lock.acquire(wait=5):
                raise RuntimeError("the holder could not take the lock back")
            here.send("go")
            here.recv()  # the waiter is about to block in acquire(wait=...)
            time.sleep(random.uniform(0.02, 0.06))  # it has failed once and sleeps or listens
            released_at = time.time()
            lock.release()
            held_at = here.recv()
            if held_at is None:
                raise RuntimeError("the waiter never got the lock")
            latencies.append(held_at - released_at)
        here.send("stop")
    waiter.join(10)
    p50, p95 = percentile(latencies, 50), percentile(latencies, 95)
    worst = max(latencies)
    print(f"   p50 {p50 * 1000:.2f} ms  p95 {p95 * 1000:.2f} ms  max {worst * 1000:.2f} ms")
    row("hand-off p50", f"{p50 * 1000:.2f} ms", f"p95 {p95 * 1000:.2f} ms", "<= 10 ms",
        p50 <= 0.010)


def percentile(values: list[float], pct: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(pct / 100 * (len(ordered) - 1)))]


# ---- 3. takeover after SIGKILL ----------------------------------------------------------


def hold_forever(url: str, name: str, ttl: float, conn: Any) -> None:
    q = qs.Queen(url)
    lock = q.lock(name, ttl=ttl)
    conn.send(lock.acquire(wait=5))
    while True:
        time.sleep(1)


def bench_takeover(folder: str, samples: int, ttl: float = 2.0) -> None:
    print(f"3. takeover after SIGKILL, ttl {ttl:.0f} s, {samples} samples")
    url = "sqlite://" + os.path.join(folder, "takeover.db")
    from_kill, from_expiry = [], []
    with qs.Queen(url) as q:
        for i in range(samples):
            name = f"takeover-{i}"
            here, there = CTX.Pipe()
            holder = CTX.Process(target=hold_forever, args=(url, name, ttl, there), daemon=True)
            holder.start()
            if not here.recv():
                raise RuntimeError("the holder could not take the lock")
            time.sleep(random.uniform(0.0, ttl / 3))  # kill at any phase of its renewals
            killed_at = time.time()
            os.kill(holder.pid or 0, signal.SIGKILL)
            expires_at = q.locks.get(name)["holders"][0]["expiresAt"] / 1000
            successor = q.lock(name, ttl=ttl)
            if not successor.acquire(wait=ttl + 5):
                raise RuntimeError("the successor never took over")
            took_at = time.time()
            successor.release()
            holder.join(5)
            from_kill.append(took_at - killed_at)
            from_expiry.append(took_at - expires_at)
            print(f"   sample {i}: {from_kill[-1] * 1000:.0f} ms after the kill, "
                  f"{from_expiry[-1] * 1000:.1f} ms after the lease's expiry")
    worst = max(from_kill)
    row("takeover after SIGKILL (worst)", f"{worst * 1000:.0f} ms",
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
    row("renewer threads (10k leases)", str(threads), "", "<= 2", threads <= 2)
    row("engine calls per renew tick", f"{per_tick:.2f}", f"{ticks} ticks in {window:.0f} s",
        "<= 1", per_tick <= 1)
    row("engine calls per renew period", f"{per_period:.1f}", f"{leases:,} leases",
        "~1 (one batch)", per_period <= 2)
    row("renewer CPU (10k leases)", f"{cpu_pct:.1f}% of a core", f"{lost} leases lost", "", None)


def summary() -> None:
    head = ("metric", "queen_sync", "beside / ratio", "target", "")
    widths = [max(len(r[i]) for r in [head, *ROWS]) for i in range(5)]
    print("\nsummary")
    for line in [head, *ROWS]:
        print("  " + "  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip())


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
    summary()


if __name__ == "__main__":
    main()
