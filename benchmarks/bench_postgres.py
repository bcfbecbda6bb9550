"""The PostgreSQL engine's figures beside PostgreSQL's own advisory locks, on one server, one run.

    python benchmarks/bench_postgres.py [--quick] [--url URL] [--no-fsync]

Starts a throwaway server with the tests' helper (``tests/pg_server.py``: it needs
``initdb`` and ``pg_ctl``), unless ``--url`` names one to use.

1. uncontended acquire+release pairs/s: a ``Lock`` handle and the ``q.locks`` wire,
   beside ``pg_try_advisory_lock``/``pg_advisory_unlock`` on one connection, and the
   engine's own SQL for one pair replayed with none of its Python (the design's ceiling);
2. hand-off latency: one process releases, another waiting in ``acquire(wait=...)``
   (woken by LISTEN/NOTIFY) holds it; beside a waiter blocked in ``pg_advisory_lock``;
3. takeover after the holder is SIGKILLed (ttl 2 s), from the kill.

A summary table with targets and ratios closes the run.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from typing import Any, Callable, Iterator, Optional

import psycopg

import queen_sync as qs

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # _measure, in spawn children too
import _measure as m

RAW_KEY = 424242


# ---- 1. uncontended pairs/s --------------------------------------------------------------


@contextlib.contextmanager
def replayed_pair(q: qs.Queen) -> Iterator[Callable[[], None]]:
    """A pair made of the exact SQL one acquire and one release send, replayed bare.

    The ceiling of the engine's design (an acquire in two round trips with a durable
    commit, a release in one) with none of its Python: what is left between this and
    the handle is our code and the driver's. Reaches into the engine's private
    connection handling; a measurement, not an API.
    """
    storage: Any = q.engine.storage  # type: ignore[attr-defined]
    sent: list[tuple[Any, Any]] = []
    real_execute = psycopg.ClientCursor.execute

    def recording(self: Any, query: Any, params: Any = None, **kw: Any) -> Any:
        sent.append((query, params))
        return real_execute(self, query, params, **kw)

    lock = q.lock("replayed", ttl=3600)  # its guard, replayed, must hold all run long
    q.locks.get("replayed")  # the schema is made, and a connection prepared, before recording
    psycopg.ClientCursor.execute = recording  # type: ignore[method-assign]
    try:
        assert lock.acquire()
        lock.release()
    finally:
        psycopg.ClientCursor.execute = real_execute  # type: ignore[method-assign]
    sent = [(query, params) for query, params in sent if not str(query).startswith("PREPARE")]
    from queen_sync._engines.postgres.storage import Call
    from queen_sync._engines.storage import Footprint

    conn, pool = storage.sessions.checkout(Call(Footprint(), storage.where, 60.0))
    try:
        cur = conn.cursor()

        def replay_pair() -> None:
            for query, params in sent:
                cur.execute(query, params)
                while cur.nextset():
                    pass

        yield replay_pair
    finally:
        storage.sessions.checkin(conn, pool)


def bench_pairs(url: str, seconds: float) -> None:
    print("1. uncontended acquire+release pairs/s, interleaved rounds")
    with qs.Queen(url) as q, psycopg.connect(url, autocommit=True) as conn, \
            replayed_pair(q) as replay:

        def raw_pair() -> None:
            conn.execute("SELECT pg_try_advisory_lock(%s)", (RAW_KEY,)).fetchone()
            conn.execute("SELECT pg_advisory_unlock(%s)", (RAW_KEY,)).fetchone()

        measured = m.rates({**m.queen_pairs(q), "replayed": replay, "raw": raw_pair},
                           seconds * 3, batch=50)
    handle, wire, replayed, raw = (measured[k] for k in ("handle", "wire", "replayed", "raw"))
    for label, value in (("Lock handle (auto-renewed)", handle), ("q.locks wire", wire),
                         ("its SQL replayed, no Python", replayed),
                         ("raw pg_try_advisory_lock", raw)):
        print(f"   {label:30s} {value:10,.0f} pairs/s")
    m.row("pairs/s, Lock handle", f"{handle:,.0f}", f"{handle / raw:.2f}x raw advisory",
        ">= 1,333", handle >= 1333)
    m.row("pairs/s, q.locks wire", f"{wire:,.0f}", f"{wire / raw:.2f}x raw advisory", ">= 1,333",
        wire >= 1333)
    m.row("pairs/s, SQL replayed", f"{replayed:,.0f}", f"{replayed / raw:.2f}x raw advisory",
          "(ceiling)", None)
    m.row("pairs/s, raw advisory lock", f"{raw:,.0f}", "baseline (no lease, no token)", "", None)


# ---- 2. hand-off latency ----------------------------------------------------------------


def raw_waiter(url: str, pipe: Any) -> None:
    """``_measure.queen_waiter``'s dance, blocked in ``pg_advisory_lock`` instead."""
    with psycopg.connect(url, autocommit=True) as conn:
        while pipe.recv() == "go":
            pipe.send("waiting")
            conn.execute("SELECT pg_advisory_lock(%s)", (RAW_KEY,)).fetchone()
            held_at = time.time()
            conn.execute("SELECT pg_advisory_unlock(%s)", (RAW_KEY,)).fetchone()
            pipe.send(held_at)


def bench_handoff(url: str, samples: int) -> None:
    print(f"2. hand-off latency, {samples} samples each")
    ours = m.queen_handoffs(url, samples)
    with psycopg.connect(url, autocommit=True) as conn, m.waiter_process(raw_waiter, url) as pipe:
        raw = m.handoffs(pipe, lambda: conn.execute("SELECT pg_advisory_lock(%s)", (RAW_KEY,)),
                         lambda: conn.execute("SELECT pg_advisory_unlock(%s)", (RAW_KEY,)),
                         samples)
    for label, values in (("queen_sync (LISTEN/NOTIFY)", ours), ("blocking pg_advisory_lock",
                                                                  raw)):
        print(f"   {label:28s} {m.latency_line(values)}")
    p50, raw50 = m.percentile(ours, 50), m.percentile(raw, 50)
    m.row("hand-off p50", m.ms(p50), f"p95 {m.ms(m.percentile(ours, 95))}; raw p50 {m.ms(raw50)} "
        f"({p50 / raw50:.1f}x)", "<= 10 ms", p50 <= 0.010)


# ---- 3. takeover after SIGKILL ----------------------------------------------------------


def bench_takeover(url: str, samples: int, ttl: float = 2.0) -> None:
    print(f"3. takeover after SIGKILL, ttl {ttl:.0f} s, {samples} samples")
    from_kill, _ = m.takeovers(url, samples, ttl)
    worst = max(from_kill)
    m.row("takeover after SIGKILL (worst)", f"{worst * 1000:.0f} ms",
        f"median {statistics.median(from_kill) * 1000:.0f} ms", f"<= {ttl * 1000 + 100:.0f} ms",
        worst <= ttl + 0.1)


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
    m.summary()


if __name__ == "__main__":
    main()
