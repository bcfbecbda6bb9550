"""PostgreSQL's sweeper deletes expired rows only under their entity's advisory lock.

Every statement that answers a body in one trip decides on the rows it read and
assumes they change only under the name's (or key's) advisory lock, which it
holds: the sweeper must keep that too. It tries each entity's lock and passes
over the busy ones, so a sweep never waits behind a body, nor a body behind it.
"""

from __future__ import annotations

import secrets
import threading
import time
from typing import Any, Callable, Iterator

import pytest
from pg_server import require_pg

if not require_pg():
    pytest.importorskip("psycopg")
import psycopg

import queen_sync as qs
import queen_sync._engines.postgres.storage as pg_storage
from queen_sync._engines.postgres.engine import PostgresEngine
from queen_sync._engines.postgres.txn import entity_key
from queen_sync._ops import LockOps

pytestmark = pytest.mark.timeout(120)
NOW = "floor(extract(epoch FROM clock_timestamp()) * 1000)"


@pytest.fixture
def engine(pg_url: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[PostgresEngine]:
    """An engine on a fresh schema that sweeps after every commit."""
    monkeypatch.setattr(pg_storage, "_SWEEP_EVERY", 1)
    made = PostgresEngine.from_url(f"{pg_url}?schema=sweep_{secrets.token_hex(4)}")
    yield made
    made.close()


def _kv(engine: PostgresEngine) -> str:
    return f'"{engine.storage.sql.schema}".kv'


def _expire(pg_url: str, engine: PostgresEngine, key: str) -> None:
    with psycopg.connect(pg_url, autocommit=True) as admin:
        admin.execute(f"UPDATE {_kv(engine)} SET expires_at = {NOW} - 1000 WHERE key = %s",
                      (key,))


def _present(pg_url: str, engine: PostgresEngine, key: str) -> bool:
    with psycopg.connect(pg_url, autocommit=True) as reader:
        return reader.execute(f"SELECT 1 FROM {_kv(engine)} WHERE key = %s",
                              (key,)).fetchone() is not None


def _commit_something(engine: PostgresEngine) -> None:
    """One committed body elsewhere, which the engine follows with a sweep."""
    got = engine.call("locks", {"operations": [
        {"op": "acquire", "name": "elsewhere-" + secrets.token_hex(3), "ttlSeconds": 60,
         "owner": "sweeping"}]})["results"][0]
    assert got["acquired"], f"a free name should be taken: {got}"


class TestTheSweeperKeepsToTheEntityLocks:
    @pytest.mark.parametrize("entity, ns, key", [
        ("Lreport", "queen-locks", "report#0"),
        ("Kjobs/state", "jobs", "state"),
    ])
    def test_a_sweep_leaves_the_expired_rows_of_a_busy_entity_and_takes_them_once_free(
            self, pg_url: str, engine: PostgresEngine, entity: str, ns: str, key: str) -> None:
        if ns == "queen-locks":
            engine.call("locks", {"operations": [
                {"op": "acquire", "name": "report", "ttlSeconds": 60, "owner": "a"}]})
        else:
            engine.call("kv", {"operations": [
                {"op": "put", "ns": ns, "key": key, "value": 1, "ttlSeconds": 60}]})
        _expire(pg_url, engine, key)
        with psycopg.connect(pg_url) as body:  # a body of that entity, mid-flight
            body.execute("SELECT pg_advisory_xact_lock(%s, %s)",
                         (engine.storage.sql.lock_class, entity_key(entity)))
            _commit_something(engine)
            assert _present(pg_url, engine, key), (
                f"the sweeper deleted {ns}/{key} while a body held {entity!r}'s lock")
        _commit_something(engine)
        assert not _present(pg_url, engine, key), (
            f"the sweeper left the expired {ns}/{key} once {entity!r} was free")


def _wait_for_a_row_lock_waiter(pg_url: str) -> None:
    with psycopg.connect(pg_url, autocommit=True) as watcher:
        for _ in range(2000):
            record = watcher.execute("SELECT count(*) FROM pg_locks WHERE NOT granted"
                                     " AND locktype IN ('transactionid', 'tuple')").fetchone()
            if record is not None and record[0]:
                return
            time.sleep(0.005)
    raise AssertionError("the batch never waited for the row the outsider holds")


def _outside_delete_during(pg_url: str, schema: str, key: str, lapse_ms: int,
                           send: Callable[[], Any]) -> Any:
    """``send``'s answer (or error) when, as it runs, a delete from outside the engine (an
    operator's) holds ``key``'s row until the permit has lapsed, then deletes it."""
    kv = f'"{schema}".kv'
    answers: list[Any] = []

    def sending() -> None:
        try:
            answers.append(send())
        except qs.QueenError as exc:
            answers.append(exc)

    with psycopg.connect(pg_url) as outsider:
        outsider.execute(f"UPDATE {kv} SET expires_at = {NOW} + %s WHERE key = %s",
                         (lapse_ms, key))
        outsider.commit()
        outsider.execute(f"SELECT 1 FROM {kv} WHERE key = %s FOR UPDATE", (key,))
        call = threading.Thread(target=sending)
        call.start()
        _wait_for_a_row_lock_waiter(pg_url)
        time.sleep(max(lapse_ms, 0) / 1000 + 0.1)  # the permit lapses while the call waits
        outsider.execute(f"DELETE FROM {kv} WHERE key = %s AND expires_at <= {NOW}", (key,))
        outsider.commit()
        call.join()
    return answers[0]


class TestOneStatementCallsRacingAnOutsideDelete:
    def test_a_permit_deleted_under_a_batch_renewal_is_answered_lost_and_the_rest_renewed(
            self, pg_url: str) -> None:
        schema = "sweep_" + secrets.token_hex(4)
        with qs.Queen(f"{pg_url}?schema={schema}", renew_thread=False) as q:
            held = [q.locks.acquire(f"m{i}", ttl_seconds=60, owner="A") for i in range(2)]
            ops = [LockOps.renew(f"m{i}", token=h["token"], ttl_seconds=60, slot=0, owner="A")
                   for i, h in enumerate(held)]
            answer = _outside_delete_during(pg_url, schema, "m1#0", 300,
                                            lambda: q.locks.batch(ops))
        assert isinstance(answer, list), f"the batch committed, yet raised: {answer!r}"
        assert answer[0]["renewed"] and not answer[1]["renewed"], answer

    def test_a_permit_deleted_under_a_lone_renewal_is_answered_lost(self, pg_url: str) -> None:
        schema = "sweep_" + secrets.token_hex(4)
        with qs.Queen(f"{pg_url}?schema={schema}", renew_thread=False) as q:
            held = q.locks.acquire("m", ttl_seconds=60, owner="A")
            answer = _outside_delete_during(pg_url, schema, "m#0", 300, lambda: q.locks.renew(
                "m", token=held["token"], ttl_seconds=60, slot=0, owner="A"))
        assert not isinstance(answer, Exception), f"the renewal raised: {answer!r}"
        assert not answer["renewed"] and answer["reason"] == "lost", answer

    def test_an_expired_permit_deleted_under_a_takeover_leaves_the_slot_to_it(
            self, pg_url: str) -> None:
        schema = "sweep_" + secrets.token_hex(4)
        with qs.Queen(f"{pg_url}?schema={schema}", renew_thread=False) as q:
            old = q.locks.acquire("m", ttl_seconds=60, owner="A")
            answer = _outside_delete_during(pg_url, schema, "m#0", -1000, lambda: q.locks.acquire(
                "m", ttl_seconds=60, owner="B"))
            now = q.locks.get("m")
        assert not isinstance(answer, Exception), f"the takeover raised: {answer!r}"
        assert answer["acquired"] and answer["token"] > old["token"], answer
        assert [h["owner"] for h in now["holders"]] == ["B"], now
