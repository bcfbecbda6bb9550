"""The PostgreSQL engine's figures beside PostgreSQL's own advisory locks, on one server, one run.

    python benchmarks/bench_postgres.py [--quick] [--url URL] [--no-fsync]

Starts a throwaway server with the tests' helper (``tests/pg_server.py``: it needs
``initdb`` and ``pg_ctl``), unless ``--url`` names one to use.

1. uncontended acquire+release pairs/s: a ``Lock`` handle and the ``q.locks`` wire,
   beside ``pg_try_advisory_lock``/``pg_advisory_unlock`` on one connection, the
   engine's own SQL for one pair replayed with none of its Python, this engine's design
   done in bare SQL (one trip a call: the name's lock, a row inserted with a token drawn
   under it, committed durably; the release not waiting for the disk: this
   design's ceiling), a lease done as one bare SQL statement per call (the ceiling of any
   design with a durable acquire), and two trivial round trips (the floor of any two-call
   pair); the SQL of each peer prepared and sent as the engine sends its own (one
   pipeline of bound statements a call), and the handle's figure as a ratio of each;
2. hand-off latency: one process releases, another waiting in ``acquire(wait=...)``
   (woken by LISTEN/NOTIFY) holds it; beside a waiter blocked in ``pg_advisory_lock``;
3. takeover after the holder is SIGKILLed (ttl 2 s), from the kill;
4. four processes taking turns on one lock, each turn incrementing a counter row:
   acquisitions/s and lost updates, beside the same turns under ``pg_advisory_lock``,
   and this design's turns in bare SQL (a durable one-statement acquire, an
   asynchronous release that NOTIFYs; waiting on LISTEN, or polling; and one process
   alone, which bounds any number of them), in interleaved rounds;
5. what else is held: handle pairs/s with 10,000 other leases held in the store, beside
   an empty store; and ``close()`` of a client whose handles hold 5,000 leases.

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
from psycopg.pq import ExecStatus

import queen_sync as qs
from queen_sync._ops import LockOps  # op builders: a measurement, not an API

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # _measure, in spawn children too
import _measure as m

RAW_KEY = 424242


# ---- 1. uncontended pairs/s --------------------------------------------------------------


def _send(cur: psycopg.Cursor[Any], statements: list[tuple[str, Any]], answering: int = -1
          ) -> list[Any]:
    """Statements as one query string, one round trip; the rows of the one at ``answering``."""
    cur.execute("; ".join(s for s, _ in statements), [p for _, ps in statements for p in ps])
    results = []
    while True:
        returned = cur.pgresult is not None and cur.pgresult.status == ExecStatus.TUPLES_OK
        results.append(cur.fetchall() if returned else [])
        if not cur.nextset():
            return results[answering]


@contextlib.contextmanager
def replayed_pair(q: qs.Queen, url: str) -> Iterator[Callable[[], None]]:
    """The engine's SQL for one pair, sent bare: its one-trip acquire, then the one-trip
    guarded release of the permit it returned.

    Sent as the engine sends them: prepared statements bound and executed in one
    pipeline a call. What is left between this and the handle is our Python. Reaches
    into the engine's private statements; a measurement, not an API.
    """
    from queen_sync._engines.postgres import pipeline
    from queen_sync._engines.postgres.scripted import one_trip_script
    from queen_sync._engines.postgres.txn import entity_key

    storage: Any = q.engine.storage  # type: ignore[attr-defined]
    sql = storage.sql
    q.locks.get("replayed")  # the schema is made, and the connection prepared
    lock = (sql.lock, (sql.lock_class, entity_key("Lreplayed")))
    acquire = one_trip_script(sql, {"op": "acquire", "name": "replayed", "ttlSeconds": 30,
                                    "owner": "replayer"})
    with psycopg.connect(url, autocommit=True, cursor_factory=psycopg.ClientCursor) as conn:
        conn.execute(sql.prepare)
        cur = conn.cursor()

        def replay_pair() -> None:
            cells = pipeline.send(cur, acquire)[-1][0][:3]
            now, key, token = int(cells[0] or 0), (cells[1] or b"").decode(), int(cells[2] or 0)
            pipeline.send(cur, [(sql.lock_no_wait, lock[1]), (
                sql.guarded_delete_notify, ("queen-locks", key, token, now + 30_000, now, now,
                                            None, now, sql.channel, "replayed"))])

        yield replay_pair


DESIGN_DDL = (
    "CREATE TABLE IF NOT EXISTS bench_design (name text PRIMARY KEY, owner text NOT NULL,"
    " token bigint NOT NULL, expires_at timestamptz NOT NULL)")
# This engine's design with none of its generality: the name's lock, a row inserted with a
# token drawn under it, one implicit transaction committed durably as it ends.
DESIGN_LOCK = "SELECT pg_advisory_xact_lock(%s)"
DESIGN_INSERT = (
    "INSERT INTO bench_design VALUES (%s, %s, nextval('bench_token'), now() + interval '30 s')"
    " ON CONFLICT DO NOTHING RETURNING token")
# The release: no wait for the disk, the name's lock, the row deleted if still at the
# token, waiters told.
NO_WAIT = "SELECT set_config('synchronous_commit', 'off', true)"
DESIGN_DELETE = "DELETE FROM bench_design WHERE name = %s AND token = %s RETURNING 1"
DESIGN_NOTIFY = "SELECT pg_notify('bench_design', %s)"


def _prepare(conn: psycopg.Connection[Any], name: str, types: str, query: str) -> bytes:
    """``query`` (one statement, ``%s`` placeholders) PREPAREd on ``conn`` as ``name``."""
    parts = query.split("%s")
    numbered = parts[0] + "".join(f"${i}{part}" for i, part in enumerate(parts[1:], 1))
    conn.execute(f"PREPARE {name}{f'({types})' if types else ''} AS {numbered}")
    return name.encode()


def _pipelined(conn: psycopg.Connection[Any], statements: list[tuple[bytes, list[Any]]]
               ) -> list[Any]:
    """Prepared statements in one pipeline, one round trip; the last one's rows, as text."""
    from queen_sync._engines.postgres import pipeline  # the engine's way of sending them

    return pipeline.exchange(conn, statements)[-1]


def design_pair(conn: psycopg.Connection[Any]) -> Callable[[], None]:
    """A lease as this engine's design does it in bare SQL: one trip a call, the acquire
    answered after a durable commit, the release not waiting for the disk; its statements
    prepared and sent in one pipeline a call, as the engine sends its own."""
    conn.execute(ONE_STATEMENT_DDL)
    conn.execute(DESIGN_DDL)
    lock = _prepare(conn, "design_lock", "bigint", DESIGN_LOCK)
    acquire = _prepare(conn, "design_acquire", "text, text", DESIGN_INSERT)
    no_wait = _prepare(conn, "design_no_wait", "", NO_WAIT)
    release = _prepare(conn, "design_release", "text, bigint", DESIGN_DELETE)
    notify = _prepare(conn, "design_notify", "text", DESIGN_NOTIFY)

    def pair() -> None:
        token = _pipelined(conn, [(lock, [RAW_KEY]), (acquire, ["design", "me"])])
        if not token:
            raise RuntimeError("the design's lease was not free")
        _pipelined(conn, [(no_wait, []), (lock, [RAW_KEY]),
                          (release, ["design", int(token[0][0])]), (notify, ["design"])])

    return pair


ONE_STATEMENT_DDL = (
    "CREATE TABLE IF NOT EXISTS bench_lease (name text PRIMARY KEY, owner text NOT NULL,"
    " token bigint NOT NULL, expires_at timestamptz NOT NULL);"
    "CREATE SEQUENCE IF NOT EXISTS bench_token")
# A permit kept as a tombstone, its token drawn under the row's lock: one statement a call.
ONE_STATEMENT_ACQUIRE = (
    "INSERT INTO bench_lease VALUES (%s, %s, nextval('bench_token'), now() + interval '30 s')"
    " ON CONFLICT (name) DO UPDATE SET owner = EXCLUDED.owner, token = nextval('bench_token'),"
    " expires_at = EXCLUDED.expires_at WHERE bench_lease.expires_at < now() RETURNING token")
ONE_STATEMENT_RELEASE = (
    "UPDATE bench_lease SET expires_at = '-infinity' WHERE name = %s AND token = %s RETURNING 1")


def one_statement_pair(conn: psycopg.Connection[Any]) -> Callable[[], None]:
    """A lease as one bare SQL statement per call, durable acquire, asynchronous release;
    prepared and sent by the extended protocol, as the engine sends its own."""
    conn.execute(ONE_STATEMENT_DDL)
    acquire = _prepare(conn, "one_acquire", "text, text", ONE_STATEMENT_ACQUIRE)
    no_wait = _prepare(conn, "one_no_wait", "", NO_WAIT)
    release = _prepare(conn, "one_release", "text, bigint", ONE_STATEMENT_RELEASE)

    def pair() -> None:
        token = _pipelined(conn, [(acquire, ["one", "me"])])
        if not token:
            raise RuntimeError("the one-statement lease was not free")
        _pipelined(conn, [(no_wait, []), (release, ["one", int(token[0][0])])])

    return pair


PAIR_LINES = (("handle", "Lock handle (auto-renewed)"), ("wire", "q.locks wire"),
              ("replayed", "its SQL replayed, no Python"),
              ("design", "this design in bare SQL"),
              ("one", "one bare statement per call"), ("raw", "raw pg_try_advisory_lock"),
              ("floor", "two trivial round trips"))


def measure_pairs(url: str, seconds: float) -> dict[str, float]:
    """Pairs/s of every contender of ``PAIR_LINES``, in interleaved rounds on one server."""
    with qs.Queen(url) as q, psycopg.connect(url, autocommit=True) as conn, \
            replayed_pair(q, url) as replay:

        def raw_pair() -> None:
            conn.execute("SELECT pg_try_advisory_lock(%s)", (RAW_KEY,)).fetchone()
            conn.execute("SELECT pg_advisory_unlock(%s)", (RAW_KEY,)).fetchone()

        def floor_pair() -> None:
            conn.execute("SELECT 1").fetchone()
            conn.execute("SELECT 1").fetchone()

        return m.rates({**m.queen_pairs(q), "replayed": replay, "design": design_pair(conn),
                        "raw": raw_pair, "one": one_statement_pair(conn), "floor": floor_pair},
                       seconds * 3, batch=50)


def bench_pairs(url: str, seconds: float) -> None:
    print("1. uncontended acquire+release pairs/s, interleaved rounds")
    measured = measure_pairs(url, seconds)
    handle = measured["handle"]
    for key, label in PAIR_LINES:
        beside = "" if key == "handle" else f"   handle {handle / measured[key]:5.2f}x of it"
        print(f"   {label:30s} {measured[key]:10,.0f} pairs/s{beside}")
    print(f"   ({m.load_average()})")
    wire, raw = measured["wire"], measured["raw"]
    m.row("pairs/s, Lock handle", f"{handle:,.0f}", f"{handle / raw:.2f}x raw advisory",
          ">= 1,333", handle >= 1333)
    m.row("pairs/s, q.locks wire", f"{wire:,.0f}", f"{wire / raw:.2f}x raw advisory", ">= 1,333",
          wire >= 1333)
    for key, metric, note in (("replayed", "SQL replayed", "(ceiling)"),
                              ("design", "this design, bare SQL", "(its ceiling)"),
                              ("one", "one statement a call", "(ceiling)"),
                              ("floor", "two trivial trips", "(floor)")):
        value = measured[key]
        m.row(f"pairs/s, {metric}", f"{value:,.0f}", f"{value / raw:.2f}x raw advisory", note,
              None)
    m.row("pairs/s, raw advisory lock", f"{raw:,.0f}", "baseline (no lease, no token)", "", None)
    for key, peer in (("replayed", "its SQL replayed"), ("design", "this design"),
                      ("one", "one statement a call"), ("floor", "two trivial trips")):
        m.row(f"Lock handle / {peer}", f"{handle / measured[key]:.2f}x", m.load_average(), "",
              None)
    m.row("Lock handle / raw advisory", f"{handle / raw:.2f}x", m.load_average(), ">= 0.5x",
          handle / raw >= 0.5)


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
        f"({p50 / raw50:.1f}x)", "<= 5 ms", p50 <= 0.005)


# ---- 3. takeover after SIGKILL ----------------------------------------------------------


def bench_takeover(url: str, samples: int, ttl: float = 2.0) -> None:
    print(f"3. takeover after SIGKILL, ttl {ttl:.0f} s, {samples} samples")
    from_kill, _ = m.takeovers(url, samples, ttl)
    worst = max(from_kill)
    m.row("takeover after SIGKILL (worst)", f"{worst * 1000:.0f} ms",
        f"median {statistics.median(from_kill) * 1000:.0f} ms", f"<= {ttl * 1000 + 100:.0f} ms",
        worst <= ttl + 0.1)


# ---- 4. contended turns -------------------------------------------------------------------


def _count_increments(url: str, take: Callable[[], bool], give: Callable[[], Any],
                      start_at: float, seconds: float) -> int:
    """Turns from ``start_at`` for ``seconds``; each reads the counter and writes it + 1.

    The read and the write are two statements on a connection of their own, so two
    holders at once would lose an update: the counter ends below the turns counted.
    """
    # The counter need not survive a crash, so its commits do not wait for the disk.
    with psycopg.connect(url, autocommit=True, options="-c synchronous_commit=off") as counter:
        time.sleep(max(0.0, start_at - time.time()))
        done, ends_at = 0, start_at + seconds
        while time.time() < ends_at:
            if not take():
                raise RuntimeError("a contender gave up waiting for its turn")
            row = counter.execute("SELECT n FROM bench_counter").fetchone()
            counter.execute("UPDATE bench_counter SET n = %s", ((row[0] if row else 0) + 1,))
            give()
            done += 1
    return done


def lease_contender(url: str, start_at: float, seconds: float, pipe: Any) -> None:
    with qs.Queen(url) as q:
        lock = q.lock("contended", ttl=30)
        pipe.send(_count_increments(url, lambda: lock.acquire(wait=10), lock.release, start_at,
                                    seconds))


def advisory_contender(url: str, start_at: float, seconds: float, pipe: Any) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        def take() -> bool:
            conn.execute("SELECT pg_advisory_lock(%s)", (RAW_KEY,)).fetchone()
            return True

        def give() -> None:
            conn.execute("SELECT pg_advisory_unlock(%s)", (RAW_KEY,)).fetchone()

        pipe.send(_count_increments(url, take, give, start_at, seconds))


# This design's turns in bare SQL: the one-statement acquire committed durably, the
# release as an asynchronous commit that NOTIFYs, on the tombstone table of section 1.
TURN_RELEASE = (
    "SET LOCAL synchronous_commit = off; UPDATE bench_lease SET expires_at = '-infinity'"
    " WHERE name = %s AND token = %s RETURNING 1; SELECT pg_notify('bench_turns', %s)")


def _design_turns(url: str, start_at: float, seconds: float, pipe: Any, listen: bool) -> None:
    """Turns of this design in bare SQL, waiting on the connection's LISTEN or by polling.

    A failed attempt waits for a NOTIFY (or 1 ms when polling), then tries again; the
    owner is this process, so a lost answer cannot be mistaken for someone else's.
    """
    owner, token = f"bench-{os.getpid()}", [0]
    with psycopg.connect(url, autocommit=True) as conn:
        cur = psycopg.ClientCursor(conn)
        if listen:
            conn.execute("LISTEN bench_turns")

        def take() -> bool:
            gives_up = time.monotonic() + 10
            while time.monotonic() < gives_up:
                won = cur.execute(ONE_STATEMENT_ACQUIRE, ("turns", owner)).fetchone()
                if won is not None:
                    token[0] = won[0]
                    return True
                if listen:
                    for _ in conn.notifies(timeout=0.05, stop_after=1):
                        pass
                else:
                    time.sleep(0.001)
            return False

        def give() -> None:
            _send(cur, [(TURN_RELEASE, ("turns", token[0], "turns"))])

        pipe.send(_count_increments(url, take, give, start_at, seconds))


def design_listen_contender(url: str, start_at: float, seconds: float, pipe: Any) -> None:
    _design_turns(url, start_at, seconds, pipe, listen=True)


def design_polling_contender(url: str, start_at: float, seconds: float, pipe: Any) -> None:
    _design_turns(url, start_at, seconds, pipe, listen=False)


def _turns(url: str, worker: Callable[[str, float, float, Any], None], processes: int,
           seconds: float) -> tuple[float, int]:
    """Acquisitions/s of ``processes`` contenders, and the updates they lost."""
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(ONE_STATEMENT_DDL)
        conn.execute("CREATE TABLE IF NOT EXISTS bench_counter (n bigint NOT NULL)")
        conn.execute("DELETE FROM bench_counter")
        conn.execute("INSERT INTO bench_counter VALUES (0)")
        rate = m.contended_rate(worker, url, processes, seconds)
        row = conn.execute("SELECT n FROM bench_counter").fetchone()
    return rate, round(rate * seconds) - (row[0] if row else 0)


# (key, label, worker, processes: None for the section's count). The one-process turns
# of this design bound any number of processes: turns on one lock run one at a time, and
# each acquire waits for its durable commit.
CONTENDERS: tuple[tuple[str, str, Callable[[str, float, float, Any], None], Optional[int]],
                  ...] = (
    ("handle", "queen_sync Lock (LISTEN wake)", lease_contender, None),
    ("listen", "this design, bare SQL, LISTEN", design_listen_contender, None),
    ("polling", "this design, bare SQL, 1 ms poll", design_polling_contender, None),
    ("alone", "this design, bare SQL, 1 process", design_polling_contender, 1),
    ("handle1", "queen_sync Lock, 1 process", lease_contender, 1),
    ("raw", "blocking pg_advisory_lock", advisory_contender, None))


def _contended_rounds(url: str, seconds: float, processes: int, rounds: int
                      ) -> tuple[dict[str, float], dict[str, int]]:
    """Median acquisitions/s of each contender over interleaved rounds, and updates lost."""
    measured: dict[str, list[float]] = {key: [] for key, *_ in CONTENDERS}
    lost = dict.fromkeys(measured, 0)
    for _ in range(rounds):
        for key, _label, worker, count in CONTENDERS:
            rate, missing = _turns(url, worker, count or processes, seconds)
            measured[key].append(rate)
            lost[key] += missing
    return {key: statistics.median(rates) for key, rates in measured.items()}, lost


def bench_contended(url: str, seconds: float, processes: int = 4, rounds: int = 2) -> None:
    print(f"4. {processes} processes taking turns on one lock, {seconds:g} s each, median of "
          f"{rounds} interleaved rounds")
    rates, lost = _contended_rounds(url, seconds, processes, rounds)
    for key, label, _worker, count in CONTENDERS:
        print(f"   {label:34s} {rates[key]:8,.0f} acquisitions/s, {lost[key]} lost updates"
              + (" (alone)" if count == 1 else ""))
    print(f"   ({m.load_average()})")
    ours, raw = rates["handle"], rates["raw"]
    ceiling = max(rates["listen"], rates["polling"])
    m.row(f"contended, {processes} processes", f"{ours:,.0f}/s",
          f"{ours / raw:.2f}x advisory ({raw:,.0f}/s); {lost['handle']} lost updates",
          ">= 0.3x, 0 lost", ours / raw >= 0.3 and lost["handle"] == 0)
    m.row("contended, this design in bare SQL", f"{ceiling:,.0f}/s",
          f"{ceiling / raw:.2f}x advisory; handle {ours / ceiling:.2f}x of it", "(its ceiling)",
          None)
    m.row("one process, this design in bare SQL", f"{rates['alone']:,.0f}/s",
          f"{rates['alone'] / raw:.2f}x advisory; handle alone {rates['handle1']:,.0f}/s",
          "(bounds any count)", None)


# ---- 5. what else is held ----------------------------------------------------------------


def _hold_many(q: qs.Queen, count: int) -> None:
    """``count`` leases taken through the wire in batches (nobody renews them: TTL 1 h)."""
    for start in range(0, count, 1000):
        ops = [LockOps.acquire(f"other-{i}", ttl_seconds=3600, owner="bystander")
               for i in range(start, min(count, start + 1000))]
        q.locks.batch(ops)


def bench_held(url: str, seconds: float, others: int, closing: int) -> None:
    print(f"5. with {others:,} other leases held; close() of {closing:,} held leases")
    with qs.Queen(f"{url}?schema=bench_empty") as empty, \
            qs.Queen(f"{url}?schema=bench_full") as full:
        _hold_many(full, others)
        measured = m.rates({"empty": m.queen_pairs(empty)["handle"],
                            "full": m.queen_pairs(full)["handle"]}, seconds * 2, batch=50)
    ratio = measured["empty"] / measured["full"]
    print(f"   empty store {measured['empty']:8,.0f} pairs/s; with {others:,} held "
          f"{measured['full']:8,.0f} pairs/s ({m.load_average()})")
    m.row(f"pairs/s, {others:,} others held", f"{measured['full']:,.0f}",
          f"empty store {measured['empty']:,.0f} ({ratio:.2f}x slower)", "<= 1.2x", ratio <= 1.2)
    closing_url = f"{url}?schema=bench_close"
    q = qs.Queen(closing_url)
    for i in range(closing):
        if not q.lock(f"closing-{i}", ttl=60).acquire():
            raise RuntimeError("a lease to close could not be taken")
    started = time.monotonic()
    q.close()
    took = time.monotonic() - started
    with qs.Queen(closing_url) as check:
        names = [f"closing-{i}" for i in range(closing)]
        left = sum(bool(r["held"]) for start in range(0, closing, 200) for r in
                   check.locks.batch([LockOps.get(n) for n in names[start:start + 200]]))
    print(f"   close(): {took:.2f} s, {left} of {closing:,} leases left held")
    m.row(f"close() of {closing:,} leases", f"{took:.2f} s", f"{left} left held",
          "all released", left == 0)


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
    parser.add_argument("--only", choices=["pairs", "handoff", "takeover", "contended", "held"],
                        action="append", help="run only these sections (repeatable)")
    args = parser.parse_args()
    chosen = set(args.only or ["pairs", "handoff", "takeover", "contended", "held"])
    with server_url(args.url, fsync=not args.no_fsync) as url:
        with qs.Queen(url) as q:
            print(f"{q.url}; {os.cpu_count()} CPUs; queen_sync {qs.__version__}; "
                  f"fsync {'off' if args.no_fsync else 'on'}\n")
        sections: list[tuple[str, Callable[[], None]]] = [
            ("pairs", lambda: bench_pairs(url, 0.5 if args.quick else 1.5)),
            ("handoff", lambda: bench_handoff(url, 40 if args.quick else 200)),
            ("takeover", lambda: bench_takeover(url, 2 if args.quick else 4)),
            ("contended", lambda: bench_contended(url, 3.0 if args.quick else 8.0, 4,
                                                   1 if args.quick else 3)),
            ("held", lambda: bench_held(url, 0.5 if args.quick else 1.5, 10_000,
                                        1_000 if args.quick else 5_000))]
        for section, run in sections:
            if section in chosen:
                run()
    m.summary()


if __name__ == "__main__":
    main()
