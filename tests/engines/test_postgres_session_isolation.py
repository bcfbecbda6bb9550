"""PostgreSQL's engine runs its own sessions at READ COMMITTED, whatever the server defaults to.

The semantics take a name's advisory lock and only then read its rows, so each
statement must see what committed before it: at REPEATABLE READ or SERIALIZABLE a
transaction reads the snapshot taken by its first statement, the lock's, which
predates whatever committed while it waited. A database, role or URL may set
``default_transaction_isolation``; the engine's sessions override it.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import threading
import time
import urllib.parse
from typing import Any, Iterator

import pytest
from pg_server import require_pg

if not require_pg():
    pytest.importorskip("psycopg")
import psycopg

from queen_sync._engines.postgres.engine import PostgresEngine
from queen_sync._engines.postgres.txn import entity_key

pytestmark = pytest.mark.timeout(120)
STRICTER = ("repeatable read", "serializable")
CONTENDERS = 4
ROUNDS = int(os.environ.get("QUEEN_SYNC_CONTENTION_ROUNDS", "40"))  # more: a longer search


def _with_database(url: str, database: str) -> str:
    parts = urllib.parse.urlsplit(url)
    return urllib.parse.urlunsplit(parts._replace(path="/" + database))


@contextlib.contextmanager
def _database_defaulting_to(pg_url: str, isolation: str) -> Iterator[str]:
    """A throwaway database whose sessions start at ``isolation``; its URL."""
    name = "iso_" + secrets.token_hex(5)
    with psycopg.connect(pg_url, autocommit=True) as admin:
        admin.execute(f"CREATE DATABASE {name}")
        admin.execute(f"ALTER DATABASE {name} SET default_transaction_isolation = "
                      f"'{isolation}'")
    try:
        yield _with_database(pg_url, name)
    finally:
        with psycopg.connect(pg_url, autocommit=True) as admin:
            admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                          " WHERE datname = %s", (name,))
            admin.execute(f"DROP DATABASE {name}")


def _url_defaulting_to(pg_url: str, isolation: str) -> str:
    """The shared database, with sessions told to start at ``isolation`` by libpq options."""
    options = "-c default_transaction_isolation=" + isolation.replace(" ", "\\ ")
    return f"{pg_url}?options={urllib.parse.quote(options)}"


def _engine(url: str) -> PostgresEngine:
    sep = "&" if "?" in url else "?"
    return PostgresEngine.from_url(f"{url}{sep}schema=iso_{secrets.token_hex(4)}")


def _contend(engines: list[PostgresEngine], name: str) -> list[BaseException]:
    """Each engine's thread takes ``name`` and gives it back ROUNDS times; what they raised."""
    errors: list[BaseException] = []

    def contender(engine: PostgresEngine, owner: str) -> None:
        # A get beside the acquire sends it down the two-trip path, which reads the rows
        # in one statement and writes in the next; alone, it is one statement.
        beside = [{"op": "get", "name": name + "-other"}] if owner[-1] in "13" else []
        try:
            for _ in range(ROUNDS):
                answer = engine.call("locks", {"operations": [
                    {"op": "acquire", "name": name, "ttlSeconds": 60, "owner": owner}, *beside]})
                got = answer["results"][0]
                if got["acquired"]:
                    engine.call("locks", {"operations": [
                        {"op": "release", "name": name, "token": got["token"],
                         "slot": got["slot"]}]})
        except BaseException as exc:  # every failure is the test's finding
            errors.append(exc)

    threads = [threading.Thread(target=contender, args=(engine, f"o{i}"))
               for i, engine in enumerate(engines)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return errors


def _contended_acquires_raise_nothing(url: str, *, schema_made: bool) -> None:
    """Contenders each with an engine of their own; ``schema_made``: one made it first."""
    first = _engine(url)
    if schema_made:
        first.call("locks", {"operations": [{"op": "get", "name": "warm-up"}]})
    engines = [first] + [PostgresEngine.from_url(_same_schema(url, first))
                         for _ in range(CONTENDERS - 1)]
    try:
        errors = _contend(engines, "contended")
    finally:
        for engine in engines:
            engine.close()
    assert not errors, (f"{len(errors)} of {CONTENDERS} contenders on {first.url} failed, "
                        f"e.g. {errors[0]!r}" if errors else "")


def _same_schema(url: str, engine: PostgresEngine) -> str:
    sep = "&" if "?" in url else "?"
    return f"{url}{sep}schema={engine.storage.sql.schema}"


class TestContendedAcquiresUnderAStricterServerDefault:
    @pytest.mark.parametrize("isolation", STRICTER)
    def test_a_url_asking_for_a_stricter_isolation_still_gets_every_acquire_answered(
            self, pg_url: str, isolation: str) -> None:
        _contended_acquires_raise_nothing(_url_defaulting_to(pg_url, isolation),
                                          schema_made=True)

    @pytest.mark.parametrize("isolation", STRICTER)
    def test_a_database_defaulting_to_a_stricter_isolation_still_gets_every_acquire_answered(
            self, pg_url: str, isolation: str) -> None:
        with _database_defaulting_to(pg_url, isolation) as url:
            _contended_acquires_raise_nothing(url, schema_made=True)

    @pytest.mark.parametrize("isolation", STRICTER)
    def test_clients_making_a_new_schema_at_once_under_a_stricter_default_all_get_answers(
            self, pg_url: str, isolation: str) -> None:
        _contended_acquires_raise_nothing(_url_defaulting_to(pg_url, isolation),
                                          schema_made=False)


def _take(engine: PostgresEngine, name: str, owner: str) -> dict[str, Any]:
    got: dict[str, Any] = engine.call("locks", {"operations": [
        {"op": "acquire", "name": name, "ttlSeconds": 60, "owner": owner}]})["results"][0]
    assert got["acquired"], f"{owner} should take the free lock {name!r}: {got}"
    return got


def _wait_for_a_waiter(pg_url: str) -> None:
    """Until some session waits for an advisory lock (the guarded body, behind the rival)."""
    with psycopg.connect(pg_url, autocommit=True) as watcher:
        for _ in range(2000):
            record = watcher.execute("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'"
                                     " AND NOT granted").fetchone()
            if record is not None and record[0]:
                return
            time.sleep(0.005)
    raise AssertionError("the guarded body never waited for the name's lock")


class TestAGuardUnderARepeatableReadDefault:
    def test_a_guard_sees_the_takeover_that_committed_while_it_waited_for_the_name(
            self, pg_url: str) -> None:
        engine = _engine(_url_defaulting_to(pg_url, "repeatable read"))
        sql = engine.storage.sql
        kv = f'"{sql.schema}".kv'
        try:
            held = _take(engine, "export", "old-holder")
            answers: list[Any] = []
            with psycopg.connect(pg_url) as rival:
                # A takeover as the engine makes one: under the name's advisory lock.
                rival.execute("SELECT pg_advisory_xact_lock(%s, %s)",
                              (sql.lock_class, entity_key("Lexport")))
                committing = threading.Thread(target=lambda: answers.append(engine.call(
                    "transaction", {"operations": [], "kv": [
                        {**held["guard"]},
                        {"op": "put", "ns": "out", "key": "report", "value": "stale",
                         "forever": True}]})))
                committing.start()
                _wait_for_a_waiter(pg_url)
                rival.execute(f"UPDATE {kv} SET version = version + 1000,"
                              " value = '{\"owner\": \"new-holder\", \"limit\": 1}'"
                              " WHERE key = 'export#0'")
                rival.commit()
                committing.join()
            read = engine.call("kv", {"operations": [
                {"op": "get", "ns": "out", "key": "report"}]})["results"][0]
        finally:
            engine.close()
        assert answers and not answers[0]["success"], (
            f"the guard at token {held['token']} passed after the permit moved on: {answers}")
        assert not read["found"], f"the fenced-out write was stored: {read}"
