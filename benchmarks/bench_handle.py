"""What the handle layer itself costs: a renew tick and an acquire+release pair over an
engine that answers at once, so that no storage, SQL or network is in the figure.

    python benchmarks/bench_handle.py [--leases N] [--rounds R] [--pairs P]

1. one renew tick of a client holding 10,000 leases: microseconds per lease, beside the
   same renews handed straight to the instant engine as one body (its own cost: the op
   check every engine runs, and building answers). The difference is the handle layer's.
2. ``lock.acquire(); lock.release()`` with auto_renew on: microseconds per pair, beside
   the same two bodies handed straight to the engine.

Each figure is the best of its rounds, taken in turn with its peer so that a noisy spell
slows both; the 1-minute load average is printed beside it (the machine is shared).
"""

from __future__ import annotations

import argparse
import os
import threading
import time
from typing import Any, Mapping

import queen_sync as qs
from queen_sync._engines.base import Engine
from queen_sync._ops import check_lock_op


class InstantEngine(Engine):
    """Answers every lock op at once, as an engine would: each op checked, tokens rising."""

    kind = "instant"

    def __init__(self) -> None:
        self.version = 0

    @property
    def url(self) -> str:
        return "instant://"

    def call(self, route: str, body: Mapping[str, Any]) -> dict[str, Any]:
        return {"results": [self._answer(check_lock_op(op)) for op in body["operations"]]}

    def _answer(self, op: Mapping[str, Any]) -> dict[str, Any]:
        self.version += 1
        kind = op["op"]
        if kind == "acquire":
            return {"acquired": True, "slot": 0, "token": self.version, "owner": op.get("owner")}
        if kind == "renew":
            return {"renewed": True, "slot": op.get("slot", 0), "token": self.version}
        if kind == "release":
            return {"released": True}
        return {"held": False, "holders": []}


class HandClock:
    """A monotonic clock moved by hand, so that every lease is due at each tick."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def wait(self, event: threading.Event, timeout: float) -> bool:
        return event.wait(min(max(0.0, timeout), 0.01))


def load() -> str:
    return f"load {os.getloadavg()[0]:.2f}"


def tick_figures(leases: int, rounds: int) -> tuple[float, float]:
    """Best microseconds per lease of a tick, and of the engine's own pass over its renews."""
    engine, clock = InstantEngine(), HandClock()
    with qs.Queen(engine=engine, clock=clock, renew_thread=False) as q:
        locks = [q.lock(f"tick-{i:05d}", ttl=3600, renew_every=1.0) for i in range(leases)]
        if not all(lock.acquire() for lock in locks):
            raise SystemExit("the instant engine refused a lease")
        ticks, raws = [], []
        for _ in range(rounds):
            clock.now += 1.0
            calls, started = q.renewer.calls, time.perf_counter()
            q.renewer.tick()
            ticks.append(time.perf_counter() - started)
            if q.renewer.calls != calls + 1 or not all(lock.held for lock in locks):
                raise SystemExit("a tick lost leases or made several calls")
            ops = [op for op in (lock.renew_op() for lock in locks) if op is not None]
            started = time.perf_counter()
            engine.call("locks", {"operations": ops})
            raws.append(time.perf_counter() - started)
    return min(ticks) / leases * 1e6, min(raws) / leases * 1e6


def pair_figures(pairs: int, rounds: int) -> tuple[float, float]:
    """Best microseconds per acquire+release pair, and of the engine's two bodies alone."""
    engine = InstantEngine()
    with qs.Queen(engine=engine) as q:
        lock = q.lock("pair", ttl=30)
        for _ in range(200):  # warm: the ops are built once, the renewer thread is up
            lock.acquire()
            lock.release()
        acquire = {"operations": [{"op": "acquire", "name": "pair", "ttlSeconds": 30,
                                   "owner": lock.owner}]}
        handle, raw = [], []
        for _ in range(rounds):
            started = time.perf_counter()
            for _ in range(pairs):
                lock.acquire()
                lock.release()
            handle.append(time.perf_counter() - started)
            started = time.perf_counter()
            for _ in range(pairs):
                token = engine.call("locks", acquire)["results"][0]["token"]
                engine.call("locks", {"operations": [{"op": "release", "name": "pair",
                                                      "token": token, "slot": 0}]})
            raw.append(time.perf_counter() - started)
    return min(handle) / pairs * 1e6, min(raw) / pairs * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--leases", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--pairs", type=int, default=20_000)
    args = parser.parse_args()
    tick, engine = tick_figures(args.leases, args.rounds)
    print(f"1. renew tick of {args.leases:,} leases: {tick:5.2f} us/lease "
          f"({tick * args.leases / 1000:5.1f} ms/tick); the engine alone {engine:5.2f} us/lease;"
          f" handle layer {tick - engine:5.2f} us/lease   ({load()})")
    pair, raw = pair_figures(args.pairs, max(3, args.rounds // 3))
    print(f"2. acquire+release pair: {pair:5.2f} us; the engine's two bodies alone "
          f"{raw:5.2f} us; handle+client {pair - raw:5.2f} us   ({load()})")


if __name__ == "__main__":
    main()
