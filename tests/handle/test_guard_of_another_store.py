"""A transaction is guarded only by a lease of the store it commits to.

The guard is a check of the lock's permit row at the handle's token. A handle of
another store (another SQLite file, schema or broker) may hold the same name at the
same token by chance, and the check would pass in a store that never granted it.
Refused at ``guard()``; a second client of the same store is fine.
"""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Iterator

import pytest

import queen_sync as qs
from queen_sync.testing import LocalBroker


@pytest.fixture
def other_store_url(engine_url: str, tmp_path: Path, request: pytest.FixtureRequest) -> \
        Iterator[str]:
    """A URL to a second, separate store of the same engine."""
    if engine_url.startswith("sqlite"):
        yield "sqlite://" + str(tmp_path / "other.db")
    elif engine_url.startswith("postgresql"):
        yield str(request.getfixturevalue("pg_url")) + "?schema=o_" + secrets.token_hex(6)
    else:
        with LocalBroker(str(tmp_path / "other-broker.db")) as broker:
            yield broker.url


class TestAGuardFromAnotherStore:
    def test_is_refused_at_the_call_even_with_equal_tokens(
        self, q: qs.Queen, other_store_url: str
    ) -> None:
        with qs.Queen(other_store_url, pool_min_size=0) if other_store_url.startswith(
                "postgresql") else qs.Queen(other_store_url) as other:
            mine, theirs = q.lock("job", ttl=30), other.lock("job", ttl=30)
            assert mine.acquire() and theirs.acquire()
            theirs_token = theirs.token
            while mine.token != theirs_token:  # the same token by chance, made certain
                assert mine.token is not None and theirs_token is not None
                if mine.token < theirs_token:
                    assert mine.renew()
                else:
                    assert theirs.renew()
                    theirs_token = theirs.token
            txn = q.transaction().kv.put("ns", "k", 1, forever=True)
            with pytest.raises(qs.RequestError, match="another store") as caught:
                txn.guard(theirs)
            assert caught.value.code == "guard_other_store"
            assert not q.kv.get("ns", "k")["found"]

    def test_from_a_second_client_of_the_same_store_guards_the_commit(
        self, q: qs.Queen, engine_url: str
    ) -> None:
        with qs.Queen(engine_url) as second:
            lock = second.lock("job", ttl=30)
            assert lock.acquire()
            assert q.transaction().kv.put("ns", "k", 1, forever=True).guard(lock).commit()
            assert q.kv.get("ns", "k")["value"] == 1


def _spellings(url: str) -> list[str]:
    """Other URLs of the same PostgreSQL schema: another host name, another option order."""
    base, _, query = url.partition("?")
    return [base.replace("127.0.0.1", "localhost", 1) + "?" + query,
            base + "?" + "&".join([*reversed(query.split("&")), "application_name=other"])]


class TestAGuardOfTheSameStoreSpelledAnotherWay:
    @pytest.mark.parametrize("spelling", [0, 1], ids=["host name", "options"])
    def test_guards_the_commit_on_postgresql(self, pg_schema_url: str, spelling: int) -> None:
        other_url = _spellings(pg_schema_url)[spelling]
        assert other_url != pg_schema_url
        with qs.Queen(pg_schema_url, pool_min_size=0) as q, \
                qs.Queen(other_url, pool_min_size=0) as second:
            lock = second.lock("job", ttl=30)
            assert lock.acquire()
            assert q.transaction().kv.put("ns", "k", 1, forever=True).guard(lock).commit()
            assert q.kv.get("ns", "k")["value"] == 1

    def test_another_schema_of_the_same_database_is_still_another_store(
            self, pg_schema_url: str) -> None:
        other_url = pg_schema_url.replace("schema=", "schema=o", 1)
        with qs.Queen(pg_schema_url, pool_min_size=0) as q, \
                qs.Queen(other_url, pool_min_size=0) as other:
            lock = other.lock("job", ttl=30)
            assert lock.acquire()
            with pytest.raises(qs.RequestError) as caught:
                q.transaction().kv.put("ns", "k", 1, forever=True).guard(lock)
            assert caught.value.code == "guard_other_store"


@pytest.fixture
def pg_schema_url(request: pytest.FixtureRequest) -> str:
    """The shared server's URL with a schema of this test's own."""
    return str(request.getfixturevalue("pg_url")) + "?schema=g_" + secrets.token_hex(6)


class TestAGuardOfACopiedDatabase:
    def test_a_database_made_from_another_as_its_template_is_another_store(
            self, pg_url: str) -> None:
        import psycopg

        base = pg_url.rsplit("/", 1)[0]
        original, copy = "ga_" + secrets.token_hex(4), "gb_" + secrets.token_hex(4)
        # The two databases are left to the session's throwaway server: DROP DATABASE waits
        # for a checkpoint and for every session of the server to take note of it, which
        # took 59 s in a full run of the suite (0.3 s alone).
        with psycopg.connect(pg_url, autocommit=True) as admin:
            admin.execute(f"CREATE DATABASE {original}")
            with qs.Queen(f"{base}/{original}", pool_min_size=0) as first:
                first.kv.put("ns", "x", 0, forever=True)  # its schema and store number
            # A staging copy of production: the schema, its rows and store number too.
            admin.execute(f"CREATE DATABASE {copy} TEMPLATE {original}")
        with qs.Queen(f"{base}/{original}", pool_min_size=0) as q, \
                qs.Queen(f"{base}/{copy}", pool_min_size=0) as staging:
            lock = q.lock("job", ttl=30)
            assert lock.acquire()
            with pytest.raises(qs.RequestError) as caught:
                staging.transaction().kv.put("ns", "x", 1, forever=True).guard(lock)
            assert caught.value.code == "guard_other_store"
            assert lock.held, "the original's lock was disturbed"


class TestTheStoreOfAClosedPostgresqlClient:
    def test_is_refused_without_creating_the_schema(self, pg_schema_url: str,
                                                    pg_url: str) -> None:
        import psycopg

        schema = pg_schema_url.rsplit("schema=", 1)[1]
        q = qs.Queen(pg_schema_url, pool_min_size=0)
        q.close()
        with pytest.raises(qs.EngineError, match="closed"):
            _ = q.engine.store
        with psycopg.connect(pg_url) as admin:
            found = admin.execute("SELECT count(*) FROM pg_namespace WHERE nspname = %s",
                                  (schema,)).fetchone()
        assert found == (0,), "a closed client made its schema"


_NO_PRIVILEGE = "DO $$ BEGIN RAISE insufficient_privilege; END $$"


class TestAStoreWhoseServerCannotBeNamed:
    """A role that may not read the server's system identifier (pg_control_system revoked)
    cannot tell a restored copy on another server by the numbers alone: the store is then
    named by its address too, so only the same spelling of one URL is one store."""

    @staticmethod
    def _client(url: str, monkeypatch: pytest.MonkeyPatch) -> qs.Queen:
        client = qs.Queen(url, pool_min_size=0)
        monkeypatch.setattr(client.engine.storage.sessions.sql,  # type: ignore[attr-defined]
                            "server_id", _NO_PRIVILEGE)
        return client

    def test_the_same_url_is_one_store(self, pg_schema_url: str,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
        with self._client(pg_schema_url, monkeypatch) as q, \
                self._client(pg_schema_url, monkeypatch) as second:
            lock = second.lock("job", ttl=30)
            assert lock.acquire()
            assert q.transaction().kv.put("ns", "k", 1, forever=True).guard(lock).commit()

    def test_another_address_is_another_store(self, pg_schema_url: str,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
        other_url = _spellings(pg_schema_url)[0]  # another host name for the same server
        with self._client(pg_schema_url, monkeypatch) as q, \
                self._client(other_url, monkeypatch) as second:
            lock = second.lock("job", ttl=30)
            assert lock.acquire()
            with pytest.raises(qs.RequestError) as caught:
                q.transaction().kv.put("ns", "k", 1, forever=True).guard(lock)
            assert caught.value.code == "guard_other_store"
