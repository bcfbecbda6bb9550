"""The recipes at scale: run-queue claims with 8 workers beside pgqueuer, and leader failover.

Measures, on the embedded SQLite engine and on PostgreSQL (a throwaway server started
with the tests' helper, ``tests/pg_server.py``, unless ``--url`` names one):

* the cost of one ``claim()`` + ``complete()`` with 100 and with 3,000 runs submitted
  (20 completed first), in one run, and their ratio (the target is at most 2x);
* claims+completes per second with 8 worker processes, with 1,000 and with 100,000 runs
  submitted (the workers drain the first 1,000 either way; ``--quick``: 200 and 5,000);
* pgqueuer (when it is installed) draining the same number of jobs with 8 worker
  processes on the same PostgreSQL server, and the ratio;
* leader failover: from SIGKILL of the leader until a waiting candidate leads (ttl 2 s).

The load average is printed beside each figure, since the machine may be shared.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing
import os
import secrets
import signal
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from typing import Any, Callable, Iterator, Optional

import _measure as m  # this folder's shared helpers (the script's folder is on sys.path)

import queen_sync as qs
from queen_sync.recipes.leader_election import LeaderElection
from queen_sync.recipes.run_queue import RunQueue

CTX = multiprocessing.get_context("spawn")
WORKERS = 8


def load() -> str:
    return "load {:.2f} {:.2f} {:.2f}".format(*os.getloadavg())


# ---- per-claim cost ------------------------------------------------------------------------


def claim_costs(url: str, sizes: tuple[int, ...], samples: int) -> list[float]:
    """Median seconds of one claim()+complete() on a queue of each size (20 completed
    first), timed in interleaved turns so a slow spell of the machine slows each alike."""
    with qs.Queen(url) as q:
        queues = []
        for submitted in sizes:
            runs = RunQueue(q, f"cost-{secrets.token_hex(3)}")
            runs.submit_many((f"run-{n:06d}", {"n": n}) for n in range(submitted))
            for _ in range(20):
                _take_one(runs)
            queues.append(runs)
        times: list[list[float]] = [[] for _ in sizes]
        for _ in range(samples):
            for runs, spent in zip(queues, times):
                started = time.perf_counter()
                _take_one(runs)
                spent.append(time.perf_counter() - started)
    return [statistics.median(spent) for spent in times]


def _take_one(runs: RunQueue) -> None:
    claim = runs.claim(ttl="30s")
    assert claim is not None, "the queue ran dry"
    claim.complete(None)


def bench_cost(engine: str, url: str, samples: int) -> None:
    small, large = claim_costs(url, (100, 3000), samples)
    ratio = large / small
    print(f"{engine}: claim+complete {m.ms(small)} with 100 submitted, {m.ms(large)} with "
          f"3,000 ({ratio:.2f}x; {load()})")
    m.row(f"{engine} claim+complete, 100 submitted", m.ms(small))
    m.row(f"{engine} claim+complete, 3,000 submitted", m.ms(large), f"{ratio:.2f}x of 100",
          "<= 2x", ratio <= 2.0)


# ---- throughput with 8 worker processes ---------------------------------------------------


def queue_worker(url: str, queue: str, target: int, done: Any, go: Any) -> None:
    """Claim and complete runs until ``target`` are done among all workers."""
    with qs.Queen(url) as q:
        runs = RunQueue(q, queue)
        go.wait()
        while done.value < target:
            claim = runs.claim(ttl="30s")
            if claim is None:
                time.sleep(0.01)
                continue
            claim.complete(None)
            with done.get_lock():
                done.value += 1


@contextlib.contextmanager
def workers(target: Callable[..., None], *args: Any) -> Iterator[tuple[Any, Any]]:
    """8 worker processes started and waiting; yields the shared counter and the go event."""
    done, go = CTX.Value("i", 0), CTX.Event()
    procs = [CTX.Process(target=target, args=(*args, done, go), daemon=True)
             for _ in range(WORKERS)]
    for proc in procs:
        proc.start()
    try:
        yield done, go
    finally:
        for proc in procs:
            if proc.is_alive() and proc.pid is not None:
                os.kill(proc.pid, signal.SIGKILL)
            proc.join(10)


def drain_rate(done: Any, go: Any, target: int, timeout: float = 600.0) -> float:
    """Release the workers; items per second from the first one done to the last.

    Timed from the first item, not from the release, so each contender's start-up
    (connecting, pgqueuer's schema check) is left out alike.
    """
    time.sleep(1.0)  # let every worker connect
    go.set()
    deadline = time.perf_counter() + timeout
    first: Optional[tuple[float, int]] = None
    while done.value < target:
        if time.perf_counter() > deadline:
            raise SystemExit(f"only {done.value} of {target} done in {timeout:.0f}s")
        if first is None and done.value > 0:
            first = (time.perf_counter(), done.value)
        time.sleep(0.002)
    if first is None:
        first = (time.perf_counter() - 1e-3, 0)
    return (target - first[1]) / (time.perf_counter() - first[0])


def queue_rate(url: str, submitted: int, drained: int) -> float:
    queue = f"rate-{secrets.token_hex(3)}"
    with qs.Queen(url) as q:
        RunQueue(q, queue).submit_many((f"run-{n:06d}", {"n": n}) for n in range(submitted))
    with workers(queue_worker, url, queue, drained) as (done, go):
        return drain_rate(done, go, drained)


def bench_rates(engine: str, url: str, sizes: list[int], drained: int) -> dict[int, float]:
    out = {}
    for submitted in sizes:
        take = min(drained, submitted)
        rate = out[submitted] = queue_rate(url, submitted, take)
        print(f"{engine}: {rate:,.0f} claims+completes/s with {WORKERS} workers, "
              f"{submitted:,} submitted, {take:,} drained ({load()})")
        m.row(f"{engine} claims+completes/s, {submitted:,} submitted", f"{rate:,.0f}/s")
    smallest, largest = min(out), max(out)
    if largest > smallest:
        # The queue's history must not slow a claim: the largest queue within 2x of the smallest.
        ratio = out[largest] / out[smallest]
        m.row(f"{engine} claims+completes/s, {largest:,} vs {smallest:,} submitted",
              f"{ratio:.2f}x", "", ">= 0.5x", ratio >= 0.5)
    return out


# ---- pgqueuer beside it ----------------------------------------------------------------------


def pgqueuer_worker(url: str, target: int, done: Any, go: Any) -> None:
    asyncio.run(_pgqueuer_drain(url, done, go))


async def _pgqueuer_drain(url: str, done: Any, go: Any) -> None:
    import psycopg
    from pgqueuer import PsycopgDriver, Queries, QueueManager

    conn = await psycopg.AsyncConnection.connect(url, autocommit=True)
    qm = QueueManager(Queries(PsycopgDriver(conn)))

    # Untyped where pgqueuer is not installed (it is a peer only this benchmark needs).
    @qm.entrypoint("job")  # type: ignore[untyped-decorator, unused-ignore]
    async def job(_: Any) -> None:
        with done.get_lock():
            done.value += 1

    await asyncio.get_running_loop().run_in_executor(None, go.wait)
    # batch_size 1: each worker takes one job per claim, as RunQueue.claim() does.
    await qm.run(batch_size=1, dequeue_timeout=timedelta(seconds=1))


async def _pgqueuer_fill(url: str, jobs: int) -> None:
    import psycopg
    from pgqueuer import PsycopgDriver, Queries

    conn = await psycopg.AsyncConnection.connect(url, autocommit=True)
    queries = Queries(PsycopgDriver(conn))
    if not await queries.schema_is_installed():
        await queries.install()
    await queries.clear_queue()
    for start in range(0, jobs, 1000):
        count = min(1000, jobs - start)
        await queries.enqueue(["job"] * count, [None] * count, [0] * count)
    await conn.close()


def bench_pgqueuer(url: str, sizes: list[int], drained: int, ours: dict[int, float]) -> None:
    try:
        import pgqueuer  # noqa: F401
    except ImportError:
        print("pgqueuer is not installed (pip install pgqueuer): no peer figure")
        return
    for submitted in sizes:
        take = min(drained, submitted)
        asyncio.run(_pgqueuer_fill(url, submitted))
        with workers(pgqueuer_worker, url, take) as (done, go):
            rate = drain_rate(done, go, take)
        ratio = ours[submitted] / rate
        print(f"pgqueuer: {rate:,.0f} jobs/s with {WORKERS} workers, {submitted:,} enqueued; "
              f"queen_sync on postgres is {ratio:.2f}x of it ({load()})")
        m.row(f"pgqueuer jobs/s, {submitted:,} enqueued", f"{rate:,.0f}/s",
              f"queen_sync {ratio:.2f}x")


# ---- leader failover ---------------------------------------------------------------------


def candidate(url: str, name: str, ttl: float, elected: Any) -> None:
    with qs.Queen(url) as q:
        election = LeaderElection(q, name, ttl=ttl, identity=str(os.getpid()),
                                  on_elected=lambda _token: elected.put((os.getpid(),
                                                                         time.time())))
        election.start()
        time.sleep(600)


def failover(url: str, ttl: float) -> float:
    """Seconds from SIGKILL of the leader until the waiting candidate is elected."""
    name, elected = f"leader-{secrets.token_hex(3)}", CTX.Queue()
    first = CTX.Process(target=candidate, args=(url, name, ttl, elected), daemon=True)
    first.start()
    leader_pid, _ = elected.get(timeout=30)
    second = CTX.Process(target=candidate, args=(url, name, ttl, elected), daemon=True)
    second.start()
    time.sleep(1.0)  # the second one is campaigning
    killed_at = time.time()
    os.kill(leader_pid, signal.SIGKILL)
    _, at = elected.get(timeout=ttl * 3 + 10)
    for proc in (first, second):
        if proc.is_alive() and proc.pid is not None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
    return float(at - killed_at)


def bench_failover(engine: str, url: str, ttl: float = 2.0, samples: int = 2) -> None:
    times = [failover(url, ttl) for _ in range(samples)]
    print(f"{engine}: leader failover {statistics.median(times):.2f} s after SIGKILL "
          f"(ttl {ttl:.0f} s; {load()})")
    m.row(f"{engine} leader failover after SIGKILL", f"{statistics.median(times):.2f} s",
          f"ttl {ttl:.0f} s")


# ---- main --------------------------------------------------------------------------------


def run_engine(engine: str, url: str, args: argparse.Namespace) -> dict[int, float]:
    bench_cost(engine, url, 20 if args.quick else 60)
    ours = bench_rates(engine, url, args.sizes, args.drained)
    bench_failover(engine, url, samples=1 if args.quick else 3)
    return ours


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller queues, fewer samples")
    parser.add_argument("--url", help="an existing PostgreSQL server (default: start one)")
    parser.add_argument("--no-postgres", action="store_true", help="SQLite only")
    parser.add_argument("--no-sqlite", action="store_true", help="PostgreSQL (and pgqueuer) only")
    args = parser.parse_args()
    # A stopped run still removes its server: SIGTERM unwinds through the finally blocks.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    args.sizes = [200, 5000] if args.quick else [1000, 100_000]
    args.drained = 200 if args.quick else 1000
    print(f"{os.cpu_count()} CPUs; queen_sync {qs.__version__}; {load()}\n")
    if not args.no_sqlite:
        with tempfile.TemporaryDirectory() as folder:
            run_engine("sqlite", "sqlite://" + os.path.join(folder, "queue.db"), args)
    if not args.no_postgres:
        from bench_postgres import server_url  # starts a throwaway server, as its tests do

        with server_url(args.url, fsync=True) as url:
            ours = run_engine("postgres", url, args)
            bench_pgqueuer(url, args.sizes, args.drained, ours)
    m.summary()


if __name__ == "__main__":
    main()
