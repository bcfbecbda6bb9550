"""The PostgreSQL engine under loads an ordinary client can produce: very many leases at once."""

from __future__ import annotations

import contextlib
import secrets
import threading
import time
from typing import Any, Iterator

import pytest
from pg_server import PgServer, require_pg, shared_server

if not require_pg():
    pytest.importorskip("psycopg")

import psycopg

import queen_sync as qs
from queen_sync._engines.postgres.errors import translate

pytestmark = pytest.mark.timeout(90)
MANY = 20_000  # past the shared lock table of a 300-connection server (64 x 300 locks)


@pytest.fixture(scope="module")
def server() -> Iterator[PgServer]:
    with shared_server() as running:
        yield running


@pytest.fixture
def q(server: PgServer) -> Iterator[qs.Queen]:
    client = qs.Queen(f"{server.url}?schema=t_{secrets.token_hex(6)}",
                      renew_thread=False)
    yield client
    client.close()


def _acquire_all(q: qs.Queen, names: list[str], owner: str) -> list[Any]:
    ops = [{"op": "acquire", "name": n, "ttlSeconds": 300, "owner": owner} for n in names]
    return q.locks.batch(ops)


class TestManyLeases:
    def test_one_client_acquires_and_renews_twenty_thousand_leases_in_one_batch_each(
            self, q: qs.Queen) -> None:
        names = [f"lease-{i:05d}" for i in range(MANY)]
        owner = "many:1:" + secrets.token_hex(4)
        started = time.monotonic()
        acquired = _acquire_all(q, names, owner)
        assert all(a["acquired"] for a in acquired), "not every lease was acquired"
        renews = [{"op": "renew", "name": n, "token": a["token"], "slot": a["slot"],
                   "owner": owner, "ttlSeconds": 300} for n, a in zip(names, acquired)]
        renewed = q.locks.batch(renews)
        lost = [n for n, r in zip(names, renewed) if not r["renewed"]]
        assert not lost, f"{len(lost)} of {MANY} leases were lost in one renew pass"
        old = {a["token"] for a in acquired}
        new = [r["token"] for r in renewed]
        assert len(set(new)) == MANY and not old & set(new), "renewals must mint unique new tokens"
        took = time.monotonic() - started
        assert took < 60, f"{MANY} acquires and renewals took {took:.0f}s"



class TestBodiesBeyondTheLockTable:
    """A server with a small lock table (10 x 300 entries): KV bodies stay atomic."""

    @pytest.fixture(scope="class")
    def small(self) -> Iterator[PgServer]:
        running = PgServer.start_new()
        with psycopg.connect(running.url, autocommit=True) as admin:
            admin.execute("ALTER SYSTEM SET max_locks_per_transaction = 10")
        running.restart()
        yield running
        running.destroy()

    def test_a_key_value_batch_too_big_for_one_transaction_says_why_and_writes_nothing(
            self, small: PgServer) -> None:
        size = 8_000
        ops = [{"op": "put", "ns": "big", "key": f"k{i}", "value": i, "forever": True}
               for i in range(size)]
        with qs.Queen(f"{small.url}?schema=t_{secrets.token_hex(6)}&timeout=30",
                      renew_thread=False) as q:
            with pytest.raises(qs.EngineError) as caught:
                q.kv.batch(ops)
            shown = str(caught.value)
            assert not isinstance(caught.value, qs.EngineUnavailableError), shown
            assert "unavailable" not in shown, f"a too-big body is not an outage: {shown}"
            assert f"{size} operations" in shown and "max_locks_per_transaction" in shown, shown
            assert not q.kv.get("big", "k0")["found"], "a refused batch must write nothing"

    def test_a_locks_batch_far_beyond_the_lock_table_is_answered_whole(
            self, small: PgServer) -> None:
        names = [f"small-{i}" for i in range(8_000)]
        with qs.Queen(f"{small.url}?schema=t_{secrets.token_hex(6)}&timeout=30",
                      renew_thread=False) as q:
            acquired = _acquire_all(q, names, "small:1:owner")
            assert all(a["acquired"] for a in acquired), "a locks batch was refused"
            released = q.locks.batch([{"op": "release", "name": n, "token": a["token"],
                                       "slot": a["slot"]} for n, a in zip(names, acquired)])
            assert all(r["released"] for r in released), "a release batch was refused"


def test_a_statement_timeout_names_itself_and_the_body_size() -> None:
    exc = psycopg.errors.QueryCanceled("canceling statement due to statement timeout")
    error = translate(exc, "db", operations=20_000)
    assert not isinstance(error, qs.EngineUnavailableError), error
    assert "statement_timeout" in str(error) and "20000 operations" in str(error), error


@contextlib.contextmanager
def names_held_off(server: PgServer, engine: Any, names: list[str],
                   for_seconds: float = 0.0) -> Iterator[None]:
    """Another session holds these names' entity locks (for a while, or until the block ends)."""
    from queen_sync._engines.postgres.txn import entity_key

    blocker = psycopg.connect(server.url)
    for name in names:
        blocker.execute("SELECT pg_advisory_xact_lock(%s, %s)",
                        (engine.storage.sql.lock_class, entity_key("L" + name)))
    timer = threading.Timer(for_seconds, blocker.rollback) if for_seconds else None
    if timer is not None:
        timer.start()
    try:
        yield
    finally:
        if timer is not None:
            timer.join()
        blocker.rollback()
        blocker.close()


class TestBodiesOfManyParts:
    """A locks body past 256 operations runs in parts, yet is one call with one deadline."""

    SIZE = 400

    @pytest.fixture
    def engine(self, server: PgServer) -> Iterator[Any]:
        from queen_sync._engines.postgres.engine import PostgresEngine

        engine = PostgresEngine.from_url(f"{server.url}?schema=t_{secrets.token_hex(6)}",
                                         timeout=1)
        engine.call("locks", {"operations": [{"op": "get", "name": "warm"}]})
        yield engine
        engine.close()

    def _acquires(self) -> list[dict[str, Any]]:
        return [{"op": "acquire", "name": f"part-{i}", "ttlSeconds": 60, "owner": "parts:1:a"}
                for i in range(self.SIZE)]

    def test_the_whole_body_is_bounded_by_one_timeout_whatever_each_part_takes(
            self, server: PgServer, engine: Any) -> None:
        with names_held_off(server, engine, ["part-0"], for_seconds=0.7), \
                names_held_off(server, engine, ["part-300"]):
            started = time.monotonic()
            with pytest.raises(qs.EngineUnavailableError):
                engine.call("locks", {"operations": self._acquires()})
            took = time.monotonic() - started
        assert took < 1.4, f"a body of {self.SIZE} operations took {took:.2f}s against 1s"

    def test_a_part_that_fails_names_the_body_what_was_applied_and_a_safe_resend(
            self, server: PgServer, engine: Any) -> None:
        ops = self._acquires()
        with names_held_off(server, engine, ["part-300"]), pytest.raises(qs.QueenError) as caught:
            engine.call("locks", {"operations": ops})
        shown = str(caught.value)
        assert f"a body of {self.SIZE} operations" in shown, shown
        assert "144 operations" not in shown, f"the part's size is not the caller's: {shown}"
        assert f"256 of {self.SIZE} operations were applied" in shown, shown
        assert "resending the body as the same owner is safe" in shown, shown
        again = engine.call("locks", {"operations": ops})["results"]
        assert all(r.get("already") for r in again[:256]), "the applied part was not answered again"
        assert all(r["acquired"] and not r.get("already") for r in again[256:]), again[256:]
