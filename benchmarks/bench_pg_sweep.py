"""What one PostgreSQL sweep costs with 10,000 expired rows, beside a sweep that takes no locks.

    python benchmarks/bench_pg_sweep.py [--url URL] [--rows N] [--rounds N]

Starts a throwaway server with the tests' helper (``tests/pg_server.py``) unless
``--url`` names one. The engine's sweep (expired rows found, then each one's entity
advisory lock tried, busy entities and fenced rows passed over) runs once per 1,000
committed bodies and deletes at most 256 rows; beside it, in interleaved rounds, the
sweep it replaced (the clock, then ``DELETE ... IN (SELECT ... FOR UPDATE SKIP LOCKED)``
without advisory locks, through the engine's pool), and that deletion as one bare
statement on a connection of its own (the ceiling). Each round starts from ``--rows``
expired rows (permits and key/value rows, half each); the median round is reported,
with the load average.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import statistics
import sys
import time
from typing import Any, Callable, Iterator

import psycopg

from queen_sync._engines.postgres.engine import PostgresEngine
from queen_sync._engines.postgres.sql import CLOCK, SWEEP_BATCH
from queen_sync._engines.postgres.storage import Call
from queen_sync._engines.storage import Footprint

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))


@contextlib.contextmanager
def _server_url(url: str) -> Iterator[str]:
    if url:
        yield url
        return
    from pg_server import PgServer  # the tests' helper: a throwaway server

    server = PgServer.start_new()
    try:
        yield server.url
    finally:
        server.stop()


def _seed(conn: psycopg.Connection[Any], kv: str, rows: int) -> None:
    """``rows`` expired rows (again, where a sweep deleted some): permits and keys, half each."""
    conn.execute(
        f"INSERT INTO {kv} (ns, key, value, version, expires_at, created_at, updated_at)"
        " SELECT CASE WHEN i %% 2 = 0 THEN 'queen-locks' ELSE 'bench' END,"
        " CASE WHEN i %% 2 = 0 THEN 'n' || i || '#0' ELSE 'k' || i END,"
        " '{\"owner\": \"gone\", \"limit\": 1}', i, 1, 0, 0 FROM generate_series(1, %s) AS i"
        " ON CONFLICT DO NOTHING", (rows,))


def _expired(conn: psycopg.Connection[Any], kv: str) -> int:
    record = conn.execute(f"SELECT count(*) FROM {kv} WHERE expires_at <= 1").fetchone()
    return 0 if record is None else int(record[0])


def _timed(work: Callable[[], None]) -> float:
    start = time.perf_counter()
    work()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="")
    parser.add_argument("--rows", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=21)
    args = parser.parse_args()
    with _server_url(args.url) as url:
        engine = PostgresEngine.from_url(f"{url}?schema=bench_sweep_{secrets.token_hex(3)}")
        engine.call("locks", {"operations": [{"op": "get", "name": "warm-up"}]})
        storage = engine.storage
        kv = f'"{storage.sql.schema}".kv'
        lockless = (f"DELETE FROM {kv} WHERE (ns, key) IN (SELECT ns, key FROM {kv}"
                    f" WHERE expires_at <= ({CLOCK}) LIMIT {SWEEP_BATCH} FOR UPDATE SKIP LOCKED)")
        previous = (f"DELETE FROM {kv} WHERE (ns, key) IN (SELECT ns, key FROM {kv}"
                    f" WHERE expires_at <= %s LIMIT {SWEEP_BATCH} FOR UPDATE SKIP LOCKED)")
        times: dict[str, list[float]] = {
            "engine sweep": [], "previous sweep": [], "no advisory locks": []}
        deleted: dict[str, list[int]] = {name: [] for name in times}
        with psycopg.connect(url, autocommit=True) as admin:
            def engine_sweep() -> None:
                storage._sweep(Call(Footprint(), storage.where, storage.call_timeout))

            def lockless_sweep() -> None:
                admin.execute(lockless)

            def previous_sweep() -> None:
                """The sweep before it tried the entities' locks: the clock, then the delete."""
                call = Call(Footprint(), storage.where, storage.call_timeout)
                conn, pool = storage.sessions.checkout(call)
                try:
                    record = conn.execute(CLOCK).fetchone()
                    conn.execute(previous, (record[0] if record else 0,))
                finally:
                    storage.sessions.checkin(conn, pool)

            for _ in range(args.rounds):
                for name, work in (("engine sweep", engine_sweep),
                                   ("previous sweep", previous_sweep),
                                   ("no advisory locks", lockless_sweep)):
                    _seed(admin, kv, args.rows)
                    before = _expired(admin, kv)
                    times[name].append(_timed(work))
                    deleted[name].append(before - _expired(admin, kv))
        engine.close()
    engine_ms = statistics.median(times["engine sweep"]) * 1000
    bare_ms = statistics.median(times["no advisory locks"]) * 1000
    print(f"one sweep with {args.rows:,} expired rows, median of {args.rounds} rounds"
          f" (load {os.getloadavg()[0]:.2f}):")
    for name, spent in times.items():
        print(f"  {name:18} {statistics.median(spent) * 1000:7.2f} ms,"
              f" {statistics.median(deleted[name]):.0f} rows deleted")
    previous_ms = statistics.median(times["previous sweep"]) * 1000
    print(f"  ratio engine / previous sweep: {engine_ms / previous_ms:.2f}x;"
          f" engine / no advisory locks: {engine_ms / bare_ms:.2f}x")


if __name__ == "__main__":
    main()
