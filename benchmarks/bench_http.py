"""The HTTP engine's cost over a LocalBroker on 127.0.0.1.

1. Client-side cost per lock call: wall time per call (broker included), the
   calling thread's own CPU time per call (``time.thread_time``: the client's
   cost, whatever the broker thread does), and requests sent per call.
2. Requests per renew tick while holding 1,000 leases: the renewer batches every
   due lease into one ``locks`` call (the official clients send one per lease).

    python benchmarks/bench_http.py [--calls 2000] [--leases 1000]
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from _measure import HandClock

import queen_sync as qs
from queen_sync.testing import LocalBroker


def _sent(q: qs.Queen) -> int:
    return int(q.engine.requests_sent)  # type: ignore[attr-defined]


def lock_call_cost(url: str, calls: int) -> dict[str, Any]:
    """Acquire and release one lock ``calls // 2`` times through a handle."""
    with qs.Queen(url, renew_thread=False) as q:
        lock = q.lock("bench", ttl=30)
        lock.acquire()
        lock.release()  # warm the connection
        before = _sent(q)
        wall, cpu = time.perf_counter(), time.thread_time()
        for _ in range(calls // 2):
            lock.acquire()
            lock.release()
        wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
        done = (calls // 2) * 2
        return {"calls": done, "wall_us_per_call": round(wall / done * 1e6, 1),
                "client_cpu_us_per_call": round(cpu / done * 1e6, 1),
                "requests_per_call": (_sent(q) - before) / done}


def renew_tick(url: str, leases: int) -> dict[str, Any]:
    """Hold ``leases`` leases, make them all due, and count the requests of one tick."""
    clock = HandClock()
    with qs.Queen(url, renew_thread=False, clock=clock) as q:
        held = [q.lock(f"lease-{i}", ttl=60) for i in range(leases)]
        for lock in held:
            lock.acquire()
        clock.now += 21  # past a third of the lifetime: every lease is due
        before, started = _sent(q), time.perf_counter()
        q.renewer.tick()
        seconds = time.perf_counter() - started
        requests = _sent(q) - before
        renewed = sum(1 for lock in held if lock.held and not lock.lost.is_set())
        return {"leases": leases, "requests_per_tick": requests, "renewed": renewed,
                "tick_ms": round(seconds * 1000, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--leases", type=int, default=1000)
    args = parser.parse_args()
    with LocalBroker() as broker:
        report = {"lock_calls": lock_call_cost(broker.url, args.calls),
                  "renew_tick": renew_tick(broker.url, args.leases)}
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
