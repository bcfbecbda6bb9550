"""PostgreSQL renews a body of many leases in one round trip per transaction, as the two-trip path.

A body made only of renews, each naming its slot and owner on a name of its own
(a renewer's tick), is answered per transaction by one script: the names' advisory
locks, then one statement applying the renew rule to every op. The semantics then
run on the rows it read and must arrive at exactly the rows it wrote. The property
test seeds several names' rows, the same in two schemas, and checks such a body on
one schema answers and writes what the same body run on the two-trip path (a get
appended makes it one) does on the other.
"""

from __future__ import annotations

import contextlib
import math
import os
import secrets
from typing import Any, Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pg_server import PgServer, require_pg, shared_server

if not require_pg():
    pytest.importorskip("psycopg")
import psycopg
from pg_cuts import cut_after_first, record_trips

from queen_sync._engines.postgres import engine as engine_module
from queen_sync._engines.postgres.engine import LOCKS_PER_TRANSACTION, PostgresEngine

pytestmark = pytest.mark.timeout(180)
NAMES = ("a", "b", "c")
SUFFIXES = ("0", "1", "2", "01", "x")
OWNERS = ('"alice"', '"me"', '"me"', "5", "array", "twice")
LIMITS = ("1", "2", None)
EXPIRIES = {"past": -5_000, "soon": 3_600_000, "forever": None}
SEEDED_BELOW = 1_000  # seeded versions stay below it; the sequence restarts above it


@pytest.fixture(scope="module")
def server() -> Iterator[PgServer]:
    with shared_server() as running:
        yield running


def _fresh(server: PgServer) -> tuple[str, PostgresEngine]:
    schema = "t_renews_" + secrets.token_hex(5)
    engine = PostgresEngine.from_url(f"{server.url}?schema={schema}")
    engine.call("locks", {"operations": [{"op": "get", "name": "warm-up"}]})
    return schema, engine


@pytest.fixture
def engine(server: PgServer) -> Iterator[PostgresEngine]:
    _, made = _fresh(server)
    yield made
    made.close()


@pytest.fixture
def trips(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every script sent from now on, one entry per round trip (PREPAREs left out)."""
    return record_trips(monkeypatch)


def _locks(engine: PostgresEngine, ops: list[dict[str, Any]]) -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = engine.call("locks", {"operations": ops})["results"]
    return results


def _held(engine: PostgresEngine, count: int) -> list[dict[str, Any]]:
    answers = _locks(engine, [{"op": "acquire", "name": f"r-{i:04d}", "ttlSeconds": 60,
                               "owner": f"o{i}"} for i in range(count)])
    assert all(a["acquired"] for a in answers), "every lease should be taken"
    return answers


def _renews(answers: list[dict[str, Any]], **changes: Any) -> list[dict[str, Any]]:
    return [{"op": "renew", "name": f"r-{i:04d}", "token": a["token"], "slot": a["slot"],
             "owner": f"o{i}", "ttlSeconds": 60, **changes} for i, a in enumerate(answers)]


class TestARenewalOfManyLeasesIsOneTripPerTransaction:
    def test_renewing_many_leases_takes_one_round_trip_per_transaction(
            self, engine: PostgresEngine, trips: list[str]) -> None:
        answers = _held(engine, 600)
        trips.clear()
        renewed = _locks(engine, _renews(answers))
        assert all(r["renewed"] and r["token"] > a["token"]
                   for r, a in zip(renewed, answers)), "every lease renews to a higher token"
        bound = math.ceil(600 / LOCKS_PER_TRANSACTION)
        assert len(trips) <= bound, (
            f"600 renews took {len(trips)} round trips, more than one per transaction "
            f"({bound})")

    def test_renews_with_stale_foreign_or_expired_tokens_are_refused_as_before(
            self, server: PgServer, engine: PostgresEngine) -> None:
        first = _held(engine, 40)
        answers = _locks(engine, _renews(_locks(engine, _renews(first))))
        current = _renews(answers)
        # Below the floor its last renew presented: stale even from its owner.
        stale = [{**op, "token": old["token"]} for op, old in zip(current[:10], first)]
        foreign = [{**op, "owner": "intruder"} for op in current[10:20]]
        schema = engine.url.rsplit("schema=", 1)[1]
        with psycopg.connect(server.url, autocommit=True) as admin:
            admin.execute(f'UPDATE "{schema}".kv SET expires_at = 1'
                          " WHERE key >= 'r-0020' AND key < 'r-0030'")
        body = stale + foreign + current[20:]
        results = _locks(engine, body)
        refused = [i for i, r in enumerate(results) if not r["renewed"]]
        assert refused == list(range(30)), (
            f"the stale, foreign and expired renews must be refused, not {refused}")
        assert all(r["reason"] == "lost" for r in results[:30]), results[:30]
        assert all(r["renewed"] for r in results[30:]), "the current renews still renew"


def _seed(conn: psycopg.Connection[Any], schema: str,
          rows: list[tuple[str, str, str, str | None, str, int | None]], now: int) -> None:
    """Rows as (name, key suffix, owner JSON, limit JSON, expiry, floor offset)."""
    for index, (name, suffix, owner, limit, expiry, floor) in enumerate(rows):
        version = 10 * (index + 1)
        value = "{" + f'"owner":{owner}' + ("" if limit is None else f',"limit":{limit}') + "}"
        if owner == "array":
            value = '["me"]'
        elif owner == "twice":  # JSON with a key twice: the last one counts, in SQL as here
            value = '{"owner":"alice","owner":"me","limit":1}'
        offset = EXPIRIES[expiry]
        conn.execute(
            f'INSERT INTO "{schema}".kv VALUES (%s, %s, %s::json, %s, %s, %s, %s, %s)',
            ("queen-locks", f"{name}#{suffix}", value, version,
             None if offset is None else now + offset, now - 60_000, now - 60_000,
             None if floor is None else version - floor))
    conn.execute(f"SELECT setval('\"{schema}\".version', {SEEDED_BELOW})")


def _marked(value: Any) -> Any:
    """Tokens minted by the call shown as "NEW": the paths may draw them in another order."""
    if isinstance(value, dict):
        return {k: _marked(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_marked(v) for v in value]
    fresh = isinstance(value, int) and not isinstance(value, bool)
    return "NEW" if fresh and SEEDED_BELOW < value < 10 * SEEDED_BELOW else value


def _state(conn: psycopg.Connection[Any], schema: str) -> list[Any]:
    rows = conn.execute(f'SELECT key, value::text, version, expires_at - updated_at,'
                        f' created_at = updated_at, prev_version FROM "{schema}".kv'
                        " WHERE ns = 'queen-locks' ORDER BY key").fetchall()
    return [_marked(row) for row in rows]


_ROWS = st.lists(st.tuples(st.sampled_from(NAMES), st.sampled_from(SUFFIXES),
                           st.sampled_from(OWNERS), st.sampled_from(LIMITS),
                           st.sampled_from(sorted(EXPIRIES)),
                           st.sampled_from([None, 0, 3, 10])),
                 max_size=7, unique_by=lambda row: (row[0], row[1]))
_SETTINGS = settings(max_examples=int(os.environ.get("QUEEN_SYNC_RENEW_BATCH_EXAMPLES", "40")),
                     deadline=None, suppress_health_check=[
    HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


def _renew_of(data: st.DataObject, name: str,
              rows: list[tuple[str, str, str, str | None, str, int | None]]) -> dict[str, Any]:
    """A renew of ``name``: mostly of a seeded slot, with a token near a seeded version;
    often that slot is made the renewing owner's live permit (``rows`` changes)."""
    index = next((i for i, row in enumerate(rows) if row[0] == name
                  and row[1] in ("0", "1", "2") and data.draw(st.booleans())), None)
    if index is not None and data.draw(st.booleans()):
        _, suffix, _, limit, _, floor = rows[index]
        rows[index] = (name, suffix, '"me"', limit, "soon", floor)
    slot = int(rows[index][1]) if index is not None else data.draw(st.integers(0, 2))
    version = 10 * (index + 1) if index is not None else 10
    floor = rows[index][5] if index is not None else None
    at_floor = version - (floor if floor is not None else 3)  # what its last renew presented
    # A token below 1 is refused by the op check before either path runs: not drawn.
    token = data.draw(st.sampled_from([t for t in (version, version, at_floor, at_floor,
                                                    version - 2, version + 10, 999) if t >= 1]))
    return {"op": "renew", "name": name, "slot": slot, "token": token, "ttlSeconds": 30,
            "owner": data.draw(st.sampled_from(["me", "me", "alice", "5"]))}


class TestTheRenewBatchAgreesWithTheTwoTripPath:
    # None: one transaction; 2: transactions of two renews at most, sent as one pipeline.
    @pytest.mark.parametrize("per_transaction", [None, 2])
    @_SETTINGS
    @given(rows=_ROWS, data=st.data())
    def test_a_body_of_renews_on_any_rows_answers_and_writes_the_same(
            self, server: PgServer, trips: list[str], monkeypatch: pytest.MonkeyPatch,
            per_transaction: int | None,
            rows: list[tuple[str, str, str, str | None, str, int | None]],
            data: st.DataObject) -> None:
        rows = list(rows)
        ops = [_renew_of(data, name, rows) for name in NAMES]
        (fast_schema, fast), (slow_schema, slow) = _fresh(server), _fresh(server)
        with contextlib.closing(fast), contextlib.closing(slow), psycopg.connect(
                server.url, autocommit=True) as conn:
            now = int(conn.execute("SELECT floor(extract(epoch FROM clock_timestamp())"
                                   " * 1000)::bigint").fetchone()[0])  # type: ignore[index]
            for schema in (fast_schema, slow_schema):
                _seed(conn, schema, rows, now)
            trips.clear()
            with monkeypatch.context() as patched:
                if per_transaction is not None:
                    patched.setattr(engine_module, "LOCKS_PER_TRANSACTION", per_transaction)
                one = _locks(fast, ops)
            if per_transaction is None:
                assert len(trips) == 1 and "qs_renew_many" in trips[0], (
                    f"the renews should be one statement in one trip: {trips}")
            else:
                sent = [trip for trip in trips if "qs_renew" in trip]
                assert sent == [], f"every transaction should travel in the pipeline: {sent}"
            two = _locks(slow, [*ops, {"op": "get", "name": "a"}])[:len(ops)]
            assert _marked(one) == _marked(two), f"the batch answered {one}, two trips {two}"
            assert _state(conn, fast_schema) == _state(conn, slow_schema), (
                "the two paths left the rows differently")
            for schema in (fast_schema, slow_schema):
                conn.execute(f'DROP SCHEMA "{schema}" CASCADE')


class TestTheBatchComparesOwnersAsTheSemanticsDo:
    def test_an_owner_stored_as_a_json_number_is_not_the_owner_of_the_same_digits(
            self, server: PgServer, engine: PostgresEngine) -> None:
        """JSON's 5 and the owner "5" read alike as SQL text; only the string owns the permit."""
        schema = engine.url.rsplit("schema=", 1)[1]
        with psycopg.connect(server.url, autocommit=True) as conn:
            now = int(conn.execute("SELECT floor(extract(epoch FROM clock_timestamp())"
                                   " * 1000)::bigint").fetchone()[0])  # type: ignore[index]
            _seed(conn, schema, [("a", "0", "5", "1", "soon", None),
                                 ("b", "0", '"me"', "1", "soon", None)], now)
        answers = _locks(engine, [
            {"op": "renew", "name": "a", "slot": 0, "token": 10, "ttlSeconds": 30, "owner": "5"},
            {"op": "renew", "name": "b", "slot": 0, "token": 20, "ttlSeconds": 30,
             "owner": "me"}])
        assert not answers[0]["renewed"] and answers[0]["holders"][0]["owner"] is None, (
            f"a permit whose owner is the number 5 is held for an unknown owner, not \"5\": "
            f"{answers[0]}")
        assert answers[1]["renewed"], f"the string owner's renew renews: {answers[1]}"


class TestARenewalWhoseOutcomeWasLeftOpen:
    def test_renews_whose_connection_broke_after_they_committed_renew_again_on_the_retry(
            self, engine: PostgresEngine, monkeypatch: pytest.MonkeyPatch) -> None:
        """The statement ran and committed, then the connection died before the answer."""
        answers = _held(engine, 20)
        broke = cut_after_first(monkeypatch, "qs_renew_many")
        renewed = _locks(engine, _renews(answers))
        assert broke, "the one-statement renewal never ran"
        assert all(r["renewed"] for r in renewed), (
            f"the retry must renew what the first attempt renewed: {renewed}")
        state = _locks(engine, [{"op": "get", "name": f"r-{i:04d}"} for i in range(20)])
        assert [s["holders"][0]["token"] for s in state] == [r["token"] for r in renewed], (
            "every row must be at the token the retry answered")
