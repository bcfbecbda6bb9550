"""Measurements the benchmark scripts share, each parametrized by the engine URL.

Not a script: ``bench_core.py`` and ``bench_postgres.py`` import it (their own folder
is on ``sys.path``). The worker functions (``queen_waiter``, ``hold_forever``) live
here so that 'spawn' children can import them by module name.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import random
import signal
import statistics
import threading
import time
from typing import Any, Callable, Iterator, Optional

import queen_sync as qs

CTX = multiprocessing.get_context("spawn")
ROWS: list[tuple[str, str, str, str, str]] = []


# ---- the summary table ------------------------------------------------------------------


def row(metric: str, figure: str, beside: str = "", target: str = "",
        ok: Optional[bool] = None) -> None:
    """Add one line to the summary table: ``ok`` None leaves the verdict blank."""
    verdict = "" if ok is None else ("met" if ok else "MISSED")
    ROWS.append((metric, figure, beside, target, verdict))


def summary() -> None:
    head = ("metric", "queen_sync", "beside / ratio", "target", "")
    widths = [max(len(r[i]) for r in [head, *ROWS]) for i in range(5)]
    print("\nsummary")
    for line in [head, *ROWS]:
        print("  " + "  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip())


# ---- figures ----------------------------------------------------------------------------


def percentile(values: list[float], pct: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(pct / 100 * (len(ordered) - 1)))]


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.2f} ms"


def latency_line(values: list[float]) -> str:
    """``p50 .. ms  p95 .. ms  max .. ms``."""
    return (f"p50 {ms(percentile(values, 50))}  p95 {ms(percentile(values, 95))}  "
            f"max {ms(max(values))}")


# ---- 1. uncontended pairs/s --------------------------------------------------------------


def rates(pairs: dict[str, Callable[[], None]], seconds: float, rounds: int = 5,
          batch: int = 100) -> dict[str, float]:
    """Pairs per second of each contender: the median of ``rounds`` timed runs.

    The rounds are interleaved (every contender runs once per round, in turn, for
    ``seconds / rounds``), so a slow spell of a noisy machine slows them all alike
    instead of skewing one figure. The clock is read every ``batch`` pairs.
    """
    for pair in pairs.values():
        for _ in range(200):
            pair()  # warm caches, connections and the file's pages
    measured: dict[str, list[float]] = {name: [] for name in pairs}
    for _ in range(rounds):
        for name, pair in pairs.items():
            done, started = 0, time.perf_counter()
            while True:
                for _ in range(batch):
                    pair()
                done += batch
                elapsed = time.perf_counter() - started
                if elapsed >= seconds / rounds:
                    break
            measured[name].append(done / elapsed)
    return {name: statistics.median(values) for name, values in measured.items()}


def queen_pairs(q: qs.Queen) -> dict[str, Callable[[], None]]:
    """An acquire+release pair through a ``Lock`` handle (auto-renewed), and through ``q.locks``."""
    lock = q.lock("pairs", ttl=30)

    def handle_pair() -> None:
        lock.acquire()
        lock.release()

    def wire_pair() -> None:
        answer = q.locks.acquire("wire", ttl_seconds=30)
        q.locks.release("wire", token=answer["token"], slot=answer["slot"])

    return {"handle": handle_pair, "wire": wire_pair}


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


@contextlib.contextmanager
def waiter_process(target: Callable[[str, Any], None], url: str) -> Iterator[Any]:
    """A 'spawn' child running ``target(url, pipe)``; yields this end of the pipe."""
    here, there = CTX.Pipe()
    process = CTX.Process(target=target, args=(url, there), daemon=True)
    process.start()
    try:
        yield here
    finally:
        here.send("stop")
        process.join(10)


def handoffs(pipe: Any, take: Callable[[], Any], give: Callable[[], Any], samples: int,
             pause_max: float = 0.05) -> list[float]:
    """Seconds from ``give()`` here to the waiter at the other end of ``pipe`` holding it."""
    latencies = []
    for _ in range(samples):
        take()
        pipe.send("go")
        pipe.recv()  # the waiter is about to block
        time.sleep(random.uniform(0.02, pause_max))  # it has tried once and is waiting now
        released_at = time.time()
        give()
        held_at = pipe.recv()
        if held_at is None:
            raise RuntimeError("the waiter never got the lock")
        latencies.append(held_at - released_at)
    return latencies


def queen_handoffs(url: str, samples: int, pause_max: float = 0.05) -> list[float]:
    """Hand-off latencies of a ``Lock`` between this process and a ``queen_waiter`` child."""
    with qs.Queen(url) as q, waiter_process(queen_waiter, url) as pipe:
        lock = q.lock("handoff", ttl=10)

        def take() -> None:
            if not lock.acquire(wait=5):
                raise RuntimeError("the holder could not take the lock back")

        return handoffs(pipe, take, lock.release, samples, pause_max)


# ---- 3. takeover after SIGKILL ----------------------------------------------------------


def hold_forever(url: str, name: str, ttl: float, pipe: Any) -> None:
    q = qs.Queen(url)
    pipe.send(q.lock(name, ttl=ttl).acquire(wait=5))
    while True:
        time.sleep(1)


def takeovers(url: str, samples: int, ttl: float, expiry: bool = False
              ) -> tuple[list[float], list[float]]:
    """SIGKILL a holder at a random phase of its renewals, time the successor's acquire.

    Prints one line per sample and returns the seconds from the kill and, with
    ``expiry``, from the lease's expiry as the engine recorded it (read after the kill).
    """
    from_kill: list[float] = []
    from_expiry: list[float] = []
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
            if expiry:
                expires_at = q.locks.get(name)["holders"][0]["expiresAt"] / 1000
            successor = q.lock(name, ttl=ttl)
            if not successor.acquire(wait=ttl + 5):
                raise RuntimeError("the successor never took over")
            took_at = time.time()
            successor.release()
            holder.join(5)
            from_kill.append(took_at - killed_at)
            if expiry:
                from_expiry.append(took_at - expires_at)
                print(f"   sample {i}: {from_kill[-1] * 1000:.0f} ms after the kill, "
                      f"{from_expiry[-1] * 1000:.1f} ms after the lease's expiry")
            else:
                print(f"   sample {i}: held {from_kill[-1] * 1000:.0f} ms after the kill")
    return from_kill, from_expiry


# ---- contended pairs/s: several processes taking turns on one lock ----------------------


def queen_contender(url: str, start_at: float, seconds: float, pipe: Any) -> None:
    """From ``start_at`` for ``seconds``: take ``contended`` (waiting), release, count."""
    with qs.Queen(url) as q:
        lock = q.lock("contended", ttl=30)
        pipe.send(_count_turns(lambda: lock.acquire(wait=10), lock.release, start_at, seconds))


def filelock_contender(path: str, start_at: float, seconds: float, pipe: Any) -> None:
    """The same turns through ``filelock.FileLock`` (blocking acquire), for the comparison."""
    import filelock  # the baseline, imported only in the children that measure it

    lock = filelock.FileLock(path)
    pipe.send(_count_turns(lambda: bool(lock.acquire()), lock.release, start_at, seconds))


def _count_turns(take: Callable[[], bool], give: Callable[[], Any], start_at: float,
                 seconds: float) -> int:
    time.sleep(max(0.0, start_at - time.time()))
    done, ends_at = 0, start_at + seconds
    while time.time() < ends_at:
        if not take():
            raise RuntimeError("a contender gave up waiting for its turn")
        give()
        done += 1
    return done


def contended_rate(worker: Callable[[str, float, float, Any], None], target: str,
                   processes: int, seconds: float) -> float:
    """Acquisitions per second summed over ``processes`` 'spawn' children of ``worker``."""
    start_at = time.time() + 2.0  # every child has imported and connected by then
    pipes, children = [], []
    for _ in range(processes):
        here, there = CTX.Pipe()
        child = CTX.Process(target=worker, args=(target, start_at, seconds, there), daemon=True)
        child.start()
        pipes.append(here)
        children.append(child)
    total = sum(int(pipe.recv()) for pipe in pipes)
    for child in children:
        child.join(10)
    return total / seconds


def load_average() -> str:
    """The 1-minute load average, shown beside each figure (the machine is shared)."""
    return f"load {os.getloadavg()[0]:.2f}"


class HandClock:
    """A monotonic clock a benchmark moves by hand, so a tick finds every lease due."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def wait(self, event: threading.Event, timeout: float) -> bool:
        return event.wait(0.01)
