"""What a release costs the SQLite wake-up channel while others wait on OTHER lock names.

Each release notifies the waiters of its lock name. This script binds 0, 10, 100 and
1,000 waiter sockets for other names where waiters of other processes bind theirs
(they wait on held locks, so none of them is due a wake-up), then times, in interleaved
rounds, the channel's ``notify`` of the probe's name and a handle's acquire+release
pairs on the probe, each beside the same figure with no other waiter. The targets,
whatever the number of waiters on other names: a pair at most 1.2x its cost with none
(the bound the other "what else is held" figures use), and ``notify`` at most 2x (a
few microseconds, so the machine's noise is a large share of it).

    python benchmarks/bench_wake.py [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time
from typing import Callable, Iterator

import _measure

import queen_sync as qs
from queen_sync._engines.sqlite import SqliteEngine
from queen_sync._engines.sqlite_wake import WakeChannel, _SocketWaiter

WAITERS = (0, 10, 100, 1000)


@contextlib.contextmanager
def other_waiters(channel: WakeChannel, count: int) -> Iterator[None]:
    """``count`` sockets of waiters on other names, bound as each waiter binds its own."""
    entered = contextlib.ExitStack()
    with entered:
        for index in range(count):
            waiter = entered.enter_context(channel.subscribe(f"other-{index}"))
            if not isinstance(waiter, _SocketWaiter):
                sys.exit(f"the wake channel fell back to polling in {channel.folder}")
        yield


def per_call_us(step: Callable[[], object], seconds: float) -> float:
    """Microseconds per ``step``, timed over about ``seconds``."""
    calls, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        for _ in range(50):
            step()
        calls += 50
    return (time.perf_counter() - started) / calls * 1e6


def measure(q: qs.Queen, channel: WakeChannel, seconds: float, rounds: int
            ) -> dict[int, tuple[float, float]]:
    """Per waiter count: the median (notify µs, pair µs) over ``rounds`` interleaved rounds."""
    probe = q.lock("probe", ttl=60)

    def pair() -> None:
        probe.acquire()
        probe.release()

    samples: dict[int, list[tuple[float, float]]] = {n: [] for n in WAITERS}
    for _ in range(rounds):
        for count in WAITERS:
            with other_waiters(channel, count):
                samples[count].append((per_call_us(lambda: channel.notify(["probe"]), seconds),
                                       per_call_us(pair, seconds)))
    return {n: (statistics.median(s[0] for s in found), statistics.median(s[1] for s in found))
            for n, found in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    quick = parser.parse_args().quick
    seconds, rounds = (0.05, 9) if quick else (0.1, 21)  # many short rounds: noise evens out
    print(f"load average before: {_measure.load_average()}")
    with tempfile.TemporaryDirectory(prefix="qw") as folder:
        os.environ["XDG_RUNTIME_DIR"] = folder  # a short path: a socket address is ~100 bytes
        with qs.Queen("sqlite://" + os.path.join(folder, "q.db"), renew_thread=False) as q:
            engine = q.engine
            assert isinstance(engine, SqliteEngine) and engine.storage.wake is not None
            channel = engine.storage.wake
            with channel.subscribe("probe"):
                pass  # the folder exists from now on, as on any database waited on once
            figures = measure(q, channel, seconds, rounds)
    notify_none, pair_none = figures[0]
    for count, (notify_us, pair_us) in figures.items():
        print(f"{count:5d} waiters on other names: notify {notify_us:7.1f} us "
              f"({notify_us / notify_none:5.2f}x none), acquire+release {pair_us:7.1f} us "
              f"({pair_us / pair_none:4.2f}x none)")
        if count:
            _measure.row(f"notify with {count} waiters on other names", f"{notify_us:.1f} us",
                         f"{notify_us / notify_none:.2f}x none", "<= 2x",
                         notify_us / notify_none <= 2.0)
            _measure.row(f"acquire+release with {count} waiters on other names",
                         f"{pair_us:.1f} us", f"{pair_us / pair_none:.2f}x none", "<= 1.2x",
                         pair_us / pair_none <= 1.2)
    print(f"load average after: {_measure.load_average()}")
    _measure.summary()


if __name__ == "__main__":
    main()
