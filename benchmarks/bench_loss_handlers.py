"""What running ``on_lost`` handlers costs, and how long one lease's wait behind another's.

1. 10,000 leases lost at once, each with one handler (trivial, or 1 ms of blocking work
   such as a cleanup call): the time until all have run and the threads used, for the
   pool at widths 1 (one thread for all, in turn), 2, 4, 8 (the default) and 16, beside
   a thread per lease (the unbounded peer).
2. A lease's handler while another lease's handler takes 0.5 s: how late it runs with one
   thread for all beside the default pool.
3. A real client on SQLite holding N leases (10,000; 2,000 with ``--quick``), all lost in
   one renew tick: from the tick's end until every handler has run, and the threads.

    python benchmarks/bench_loss_handlers.py [--quick]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import threading
import time
from typing import Callable

from _measure import HandClock

import queen_sync as qs
from queen_sync._handle.losses import MAX_WORKERS, LossDispatcher


def load() -> str:
    one, five, fifteen = os.getloadavg()
    return f"load {one:.2f} {five:.2f} {fifteen:.2f}"


class Countdown:
    """Counts handlers done; ``wait`` returns once all have."""

    def __init__(self, total: int) -> None:
        self.left = total
        self.peak_threads = 0
        self._done = threading.Condition()

    def tick(self) -> None:
        with self._done:
            self.left -= 1
            self.peak_threads = max(self.peak_threads, threading.active_count())
            if self.left == 0:
                self._done.notify_all()

    def wait(self) -> None:
        with self._done:
            self._done.wait_for(lambda: self.left == 0)


def handler_for(work: float, countdown: Countdown) -> Callable[[str], None]:
    def handler(reason: str) -> None:
        if work:
            time.sleep(work)
        countdown.tick()
    return handler


def settled() -> int:
    """The threads alive once the previous run's idle workers have ended."""
    time.sleep(0.6)
    return threading.active_count()


def pooled(width: int, leases: int, work: float) -> tuple[float, int]:
    base = settled()
    dispatcher, countdown = LossDispatcher(workers=width), Countdown(leases)
    started = time.perf_counter()
    for _ in range(leases):
        dispatcher.dispatch(handler_for(work, countdown), "renew", object())
    countdown.wait()
    return time.perf_counter() - started, countdown.peak_threads - base


def thread_per_lease(leases: int, work: float) -> tuple[float, int]:
    base = settled()
    countdown = Countdown(leases)
    started = time.perf_counter()
    for _ in range(leases):
        threading.Thread(target=handler_for(work, countdown), args=("renew",),
                         daemon=True).start()
    countdown.wait()
    return time.perf_counter() - started, countdown.peak_threads - base


def burst(leases: int) -> None:
    print(f"\n1. {leases:,} leases lost at once, one handler each ({load()})")
    for work in (0.0, 0.001):
        kind = "trivial" if not work else "1 ms blocking"
        for width in (1, 2, 4, MAX_WORKERS, 16):
            took, peak = pooled(width, leases, work)
            tag = " (default)" if width == MAX_WORKERS else ""
            print(f"   {kind:14} pool width {width:2}{tag:10} {took * 1000:9.1f} ms, "
                  f"peak handler threads {peak}")
        took, peak = thread_per_lease(leases, work)
        print(f"   {kind:14} thread per lease      {took * 1000:9.1f} ms, "
              f"peak handler threads {peak}")


def setting(event: threading.Event) -> Callable[[str], None]:
    def handler(reason: str) -> None:
        event.set()
    return handler


def behind_a_slow_one() -> None:
    print(f"\n2. a lease's handler behind another lease's 0.5 s handler ({load()})")
    for width in (1, MAX_WORKERS):
        dispatcher, ran = LossDispatcher(workers=width), threading.Event()
        dispatcher.dispatch(lambda reason: time.sleep(0.5), "renew", object())
        started = time.perf_counter()
        dispatcher.dispatch(setting(ran), "renew", object())
        ran.wait()
        print(f"   pool width {width:2}: ran {(time.perf_counter() - started) * 1000:7.1f} ms "
              "after its loss")


def real_client(leases: int) -> None:
    print(f"\n3. a client on SQLite losing {leases:,} leases in one tick ({load()})")
    clock = HandClock()
    with tempfile.TemporaryDirectory() as folder, \
            qs.Queen(f"sqlite://{folder}/q.db", clock=clock, renew_thread=False) as q:
        countdown = Countdown(leases)
        for i in range(leases):
            lock = q.lock(f"lease-{i}", ttl=30)
            assert lock.acquire()
            lock.on_lost(handler_for(0.0, countdown))
        before = threading.active_count()
        clock.now += 31  # past every deadline: the tick reports them all lost
        ticked = time.perf_counter()
        q.renewer.tick()
        tick_took = time.perf_counter() - ticked
        countdown.wait()
        print(f"   tick {tick_took * 1000:.0f} ms; every handler done "
              f"{(time.perf_counter() - ticked) * 1000:.0f} ms after the tick began; "
              f"threads {before} before, peak {countdown.peak_threads}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2,000 real leases, not 10,000")
    args = parser.parse_args()
    import logging

    logging.getLogger("queen_sync").setLevel(logging.ERROR)  # one warning per lost lease
    burst(10_000)
    behind_a_slow_one()
    real_client(2_000 if args.quick else 10_000)
    print(f"\n({load()})")


if __name__ == "__main__":
    main()
