"""The PostgreSQL engine's figures beside PostgreSQL's own advisory locks, on one server, one run.

    python benchmarks/bench_postgres.py [--quick] [--url URL] [--no-fsync]

Starts a throwaway server with the tests' helper (``tests/pg_server.py``: it needs
``initdb`` and ``pg_ctl``), unless ``--url`` names one to use.

1. uncontended acquire+release pairs/s: a ``Lock`` handle and the ``q.locks`` wire,
   beside ``pg_try_advisory_lock``/``pg_advisory_unlock`` on one connection;
2. hand-off latency: one process releases, another waiting in ``acquire(wait=...)``
   (woken by LISTEN/NOTIFY) holds it; beside a waiter blocked in ``pg_advisory_lock``;
3. takeover after the holder is SIGKILLed (ttl 2 s), from the kill.

A summary table with targets and ratios closes the run.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
import random
import signal
import statistics
import sys
import time
from typing import Any, Callable, Iterator, Optional

import psycopg

import queen_sync as qs

CTX = multiprocessing.get_context("spawn")
ROWS: list[tuple[str, str, str, str, str]] = []
RAW_KEY = 424242


def row(metric: str, figure: str, beside: str = "", target: str = "",
        ok: Optional[bool] = None) -> None:
    verdict = "" if ok is None else ("met" if ok else "MISSED")
    ROWS.append((metric, figure, beside, target, verdict))


def rate(pair: Callable[[], None], seconds: float, rounds: int = 3) -> float:
    """Pairs per second: the median of ``rounds`` timed runs of about ``seconds`` each."""
    for _ in range(200):
        pair()
    rates = []
    for _ in range(rounds):
        done, started = 0, time.perf_counter()
        while True:
            for _ in range(50):
                pair()
            done += 50
            elapsed = time.perf_counter() - started
            if elapsed >= seconds:
                break
        rates.append(done / elapsed)
    return statistics.median(rates)


def percentile(values: list[float], pct: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(pct / 100 * (len(ordered) - 1)))]


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.2f} ms"


# ---- 1. uncontended pairs/s --------------------------------------------------------------


def bench_pairs(url: str, seconds: float) -> None:
    print("1. uncontended acquire+release pairs/s")
    with qs.Queen(url) as q, psycopg.connect(url, autocommit=True) as conn:
        lock = q.lock("pairs", ttl=30)

        def handle_pair() -> None:
            lock.acquire()
            lock.release()

        def wire_pair() -> None:
            answer = q.locks.acquire("wire", ttl_seconds=30)
            q.locks.release("wire", token=answer["token"], slot=answer["slot"])

        def raw_pair() -> None:
            conn.execute("SELECT pg_try_advisory_lock(%s)", (RAW_KEY,)).fetchone()
            conn.execute("SELECT pg_advisory_unlock(%s)", (RAW_KEY,)).fetchone()

        handle, wire, raw = rate(handle_pair, seconds), rate(wire_pair, seconds), rate(
            raw_pair, seconds)
    for label, value in (("Lock handle (auto-renewed)", handle), ("q.locks wire", wire),
                         ("raw pg_try_advisory_lock", raw)):
        print(f"   {label:30s} {value:10,.0f} pairs/s")
    row("pairs/s, Lock handle", f"{handle:,.0f}", f"{handle / raw:.2f}x raw advisory",
        ">= 1,333", handle >= 1333)
    row("pairs/s, q.locks wire", f"{wire:,.0f}", f"{wire / raw:.2f}x raw advisory", ">= 1,333",
        wire >= 1333)
    row("pairs/s, raw advisory lock", f"{raw:,.0f}", "baseline (no lease, no token)", "", None)


# ---- 2. hand-off latency ----------------------------------------------------------------


def queen_waiter(url: str, pipe: Any) -> None:
    """Each round: say "waiting", wait in acquire, answer when it was held, release."""
    with qs.Queen(url) as q:
        lock = q.lock("handoff", ttl=10)
        while pipe.recv() == "go":
            pipe.send("waiting")
            got = lock.acquire(wait=5)
            held_at = time.time()
            lock.release()
            pipe.send(held_at if got else None)


def raw_waiter(url: str, pipe: Any) -> None:
    """The same dance, blocked in ``pg_advisory_lock`` instead."""
    with psycopg.connect(url, autocommit=True) as conn:
        while pipe.recv() == "go":
            pipe.send("waiting")
            conn.execute("SELECT pg_advisory_lock(%s)", (RAW_KEY,)).fetchone()
            held_at = time.time()
            conn.execute("SELECT pg_advisory_unlock(%s)", (RAW_KEY,)).fetchone()
            pipe.send(held_at)


@contextlib.contextmanager
def waiter_process(target: Callable[[str, Any], None], url: str) -> Iterator[Any]:
    here, there = CTX.Pipe()
    process = CTX.Process(target=target, args=(url, there), daemon=True)
    process.start()
    try:
        yield here
    finally:
        here.send("stop")
        process.join(10)


def handoffs(pipe: Any, take: Callable[[], Any], give: Callable[[], Any],
             samples: int) -> list[float]:
    latencies = []
    for _ in range(samples):
        take()
        pipe.send("go")
        pipe.recv()  # the waiter is about to block
        time.sleep(random.uniform(0.02, 0.05))  # it has tried once and is waiting now
        released_at = time.time()
        give()
        held_at = pipe.recv()
        if held_at is None:
            raise RuntimeError("the waiter never got the lock")
        latencies.append(held_at - released_at)
    return latencies


def bench_handoff(url: str, samples: int) -> None:
    print(f"2. hand-off latency, {samples} samples each")
    with qs.Queen(url) as q, waiter_process(queen_waiter, url) as pipe:
        lock = q.lock("handoff", ttl=10)

        def take() -> None:
            if not lock.acquire(wait=5):
                raise RuntimeError("the holder could not take the lock back")

        ours = handoffs(pipe, take, lock.release, samples)
    with psycopg.connect(url, autocommit=True) as conn, waiter_process(raw_waiter, url) as pipe:
        raw = handoffs(pipe, lambda: conn.execute("SELECT pg_advisory_lock(%s)", (RAW_KEY,)),
                       lambda: conn.execute("SELECT pg_advisory_unlock(%s)", (RAW_KEY,)),
                       samples)
    for label, values in (("queen_sync (LISTEN/NOTIFY)", ours), ("blocking pg_advisory_lock",
                                                                  raw)):
        print(f"   {label:28s} p50 {ms(percentile(values, 50))}  p95 "
              f"{ms(percentile(values, 95))}  max {ms(max(values))}")
    p50, raw50 = percentile(ours, 50), percentile(raw, 50)
    row("hand-off p50", ms(p50), f"p95 {ms(percentile(ours, 95))}; raw p50 {ms(raw50)} "
        f"({p50 / raw50:.1f}x)", "<= 10 ms", p50 <= 0.010)


# ---- 3. takeover after SIGKILL ----------------------------------------------------------


def hold_forever(url: str, name: str, ttl: float, pipe: Any) -> None:
    q = qs.Queen(url)
    pipe.send(q.lock(name, ttl=ttl).acquire(wait=5))
    while True:
        time.sleep(1)


def bench_takeover(url: str, samples: int, ttl: float = 2.0) -> None:
    print(f"3. takeover after SIGKILL, ttl {ttl:.0f} s, {samples} samples")
    from_kill = []
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
            successor = q.lock(name, ttl=ttl)
            if not successor.acquire(wait=ttl + 5):
                raise RuntimeError("the successor never took over")
            from_kill.append(time.time() - killed_at)
            successor.release()
            holder.join(5)
            print(f"   sample {i}: held {from_kill[-1] * 1000:.0f} ms after the kill")
    worst = max(from_kill)
    row("takeover after SIGKILL (worst)", f"{worst * 1000:.0f} ms",
        f"median {statistics.median(from_kill) * 1000:.0f} ms", f"<= {ttl * 1000 + 100:.0f} ms",
        worst <= ttl + 0.1)


def summary() -> None:
    head = ("metric", "queen_sync", "beside / ratio", "target", "")
    widths = [max(len(r[i]) for r in [head, *ROWS]) for i in range(5)]
    print("\nsummary")
    for line in [head, *ROWS]:
        print("  " + "  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip())


@contextlib.contextmanager
def server_url(url: Optional[str], fsync: bool) -> Iterator[str]:
    if url:
        yield url
        return
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
    from pg_server import PgServer, find_bin_dir  # the tests' helper, not a package module

    if find_bin_dir() is None:
        raise SystemExit("initdb/pg_ctl not found: install PostgreSQL or pass --url")
    server = PgServer.start_new(fsync=fsync)
    try:
        yield server.url
    finally:
        server.destroy()


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="shorter runs, fewer samples")
    parser.add_argument("--url", help="an existing server to use (default: start one)")
    parser.add_argument("--no-fsync", action="store_true",
                        help="start the server with fsync=off (faster commits, not durable)")
    args = parser.parse_args()
    with server_url(args.url, fsync=not args.no_fsync) as url:
        with qs.Queen(url) as q:
            print(f"{q.url}; {os.cpu_count()} CPUs; queen_sync {qs.__version__}; "
                  f"fsync {'off' if args.no_fsync else 'on'}\n")
        bench_pairs(url, 0.5 if args.quick else 1.5)
        bench_handoff(url, 40 if args.quick else 200)
        bench_takeover(url, 2 if args.quick else 4)
    summary()


if __name__ == "__main__":
    main()
