"""The PostgreSQL engine under loads an ordinary client can produce: very many leases at once."""

from __future__ import annotations

import secrets
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
