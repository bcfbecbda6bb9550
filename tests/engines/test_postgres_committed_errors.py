"""An error raised after a one-statement call committed says so, and never "nothing applied".

A renew batch (or a lone acquire or renew) is answered by one statement that
commits as it runs; the semantics then check it. Should the two copies of the
rule ever disagree, the error is raised after the commit: it must carry how many
writes committed, and a big body's error must count them instead of claiming that
only the parts before it were applied. The disagreement is made here by giving the
statement a rule that differs from the semantics' (it renews an expired permit).
"""

from __future__ import annotations

import secrets
from typing import Any, Callable, Iterator

import pytest
from pg_server import require_pg

if not require_pg():
    pytest.importorskip("psycopg")
import psycopg

import queen_sync._engines.postgres.scripted_sql as scripted_sql
from queen_sync._engines.postgres.engine import LOCKS_PER_TRANSACTION, PostgresEngine
from queen_sync._errors import EngineError

pytestmark = pytest.mark.timeout(120)
NOW = "floor(extract(epoch FROM clock_timestamp()) * 1000)"
LIVE_ONLY = "(s.expires_at IS NULL OR s.expires_at > (SELECT now FROM clock))"


def _renewing_expired_permits(original: Callable[[str, str], str]) -> Callable[[str, str], str]:
    def differing(kv: str, seq: str) -> str:
        sql = original(kv, seq)
        assert LIVE_ONLY in sql, "the batch statement's liveness test moved: update this test"
        return sql.replace(LIVE_ONLY, "true")
    return differing


@pytest.fixture
def engine(pg_url: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[PostgresEngine]:
    """An engine whose batch-renewal statement renews expired permits too."""
    monkeypatch.setattr(scripted_sql, "_renew_many",
                        _renewing_expired_permits(scripted_sql._renew_many))
    made = PostgresEngine.from_url(f"{pg_url}?schema=committed_{secrets.token_hex(4)}")
    yield made
    made.close()


def _hold(engine: PostgresEngine, count: int) -> list[dict[str, Any]]:
    ops = [{"op": "acquire", "name": f"n{i:04d}", "ttlSeconds": 60, "owner": "A"}
           for i in range(count)]
    held: list[dict[str, Any]] = engine.call("locks", {"operations": ops})["results"]
    assert all(h["acquired"] for h in held), "every free name should be taken"
    return held


def _renews(held: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"op": "renew", "name": f"n{i:04d}", "token": h["token"], "slot": h["slot"],
             "ttlSeconds": 60, "owner": "A"} for i, h in enumerate(held)]


def _expire(pg_url: str, engine: PostgresEngine, name: str) -> None:
    with psycopg.connect(pg_url, autocommit=True) as admin:
        admin.execute(f'UPDATE "{engine.storage.sql.schema}".kv'
                      f" SET expires_at = {NOW} - 1000 WHERE key = %s", (name + "#0",))


def _versions(pg_url: str, engine: PostgresEngine) -> dict[str, int]:
    with psycopg.connect(pg_url, autocommit=True) as reader:
        return {key: version for key, version in reader.execute(
            f'SELECT key, version FROM "{engine.storage.sql.schema}".kv'
            " WHERE ns = 'queen-locks'").fetchall()}


def _failed_renewal(engine: PostgresEngine, ops: list[dict[str, Any]]) -> EngineError:
    with pytest.raises(EngineError) as caught:
        engine.call("locks", {"operations": ops})
    return caught.value


class TestAnErrorAfterABatchRenewalCommitted:
    def test_it_says_how_many_renewals_committed(self, pg_url: str,
                                                 engine: PostgresEngine) -> None:
        held = _hold(engine, 3)
        _expire(pg_url, engine, "n0001")
        before = _versions(pg_url, engine)
        err = _failed_renewal(engine, _renews(held))
        moved = sum(before[k] != v for k, v in _versions(pg_url, engine).items())
        assert moved == 3, f"the statement should have committed 3 renewals, not {moved}"
        assert getattr(err, "committed", None) == 3, f"the error hides what committed: {err!r}"
        assert "committed" in str(err), f"the message hides that it committed: {err}"

    def test_a_big_bodys_error_counts_the_failing_parts_commits_as_applied(
            self, pg_url: str, engine: PostgresEngine) -> None:
        count = LOCKS_PER_TRANSACTION + 44
        held = _hold(engine, count)
        _expire(pg_url, engine, "n0005")  # in the first part
        err = _failed_renewal(engine, _renews(held))
        assert f"{LOCKS_PER_TRANSACTION} of {count} operations were applied" in str(err), (
            f"it should count the first part's {LOCKS_PER_TRANSACTION} committed renewals: {err}")
