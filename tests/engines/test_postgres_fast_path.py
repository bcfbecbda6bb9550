"""PostgreSQL answers a lone acquire or get in one round trip, exactly as the two-trip path.

The one-statement acquire decides in SQL only the plain case (every live permit is
someone else's at this limit, a slot is free); the semantics then run on the rows it
read. The property test seeds one name's rows, the same in two schemas, with every
kind of row the SQL must not misjudge (expired ones, the caller's own, other limits,
keys and values no acquire writes) and checks the lone acquire on one schema answers
and writes what the same acquire run on the two-trip path does on the other.
PostgreSQL's clock cannot be moved, so expiry is covered by seeding rows that
expired before the call.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import threading
import time
from typing import Any, Iterator, Optional

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pg_server import PgServer, require_pg, shared_server

if not require_pg():
    pytest.importorskip("psycopg")
import psycopg
from pg_cuts import cut_after_first, record_trips

from queen_sync import QueenError
from queen_sync._engines.postgres.engine import PostgresEngine

pytestmark = pytest.mark.timeout(120)
NAME = "n"
SLOT_KEYS = ("n#0", "n#1", "n#2", "n#3", "n#01", "n#x", "n#0#1")
OWNERS = ('"alice"', '"me"', '"me"', "5")
LIMITS = ("1", "2", "3", '"2"', "1.0", None)
EXPIRIES = {"past": -5_000, "soon": 3_600_000, "forever": None}


@pytest.fixture(scope="module")
def server() -> Iterator[PgServer]:
    with shared_server() as running:
        yield running


def _fresh(server: PgServer) -> tuple[str, PostgresEngine]:
    schema = "t_fast_" + secrets.token_hex(5)
    engine = PostgresEngine.from_url(f"{server.url}?schema={schema}")
    engine.call("locks", {"operations": [{"op": "get", "name": "warm-up"}]})
    return schema, engine


@pytest.fixture
def engine(server: PgServer) -> Iterator[PostgresEngine]:
    _, made = _fresh(server)
    yield made
    made.close()


@pytest.fixture
def scripts(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every body's script sent from now on, one entry per round trip (PREPAREs left out)."""
    return record_trips(monkeypatch)


def _acquire(engine: PostgresEngine, owner: str, limit: int = 1,
             name: str = NAME) -> dict[str, Any]:
    op: dict[str, Any] = {"op": "acquire", "name": name, "ttlSeconds": 30, "owner": owner}
    if limit > 1:
        op["limit"] = limit
    answer: dict[str, Any] = engine.call("locks", {"operations": [op]})["results"][0]
    return answer


class TestOneRoundTripPerLockCall:
    def test_a_lone_acquire_is_one_round_trip_that_commits_durably(
            self, engine: PostgresEngine, scripts: list[str]) -> None:
        answer = _acquire(engine, "me")
        assert answer["acquired"], answer
        assert len(scripts) == 1, f"one round trip, not {len(scripts)}: {scripts}"
        assert "BEGIN" not in scripts[0] and "synchronous_commit" not in scripts[0], (
            f"one implicit transaction with a durable commit: {scripts[0]}")

    def test_an_acquire_naming_no_owner_is_one_round_trip_under_the_owner_it_is_given(
            self, engine: PostgresEngine, scripts: list[str]) -> None:
        op = {"op": "acquire", "name": NAME, "ttlSeconds": 30}
        answer = engine.call("locks", {"operations": [op]})["results"][0]
        assert answer["acquired"] and answer["owner"], answer
        assert len(scripts) == 1, f"one round trip, not {len(scripts)}: {scripts}"
        state = engine.call("locks", {"operations": [{"op": "get", "name": NAME}]})
        assert state["results"][0]["holders"][0]["owner"] == answer["owner"], state

    def test_an_acquire_of_a_held_name_answers_held_in_one_round_trip(
            self, engine: PostgresEngine, scripts: list[str]) -> None:
        first = _acquire(engine, "alice")
        scripts.clear()
        answer = _acquire(engine, "me")
        assert answer["acquired"] is False and answer["reason"] == "held", answer
        assert [h["token"] for h in answer["holders"]] == [first["token"]], answer
        assert len(scripts) == 1, f"one round trip, not {len(scripts)}: {scripts}"

    def test_a_lone_get_is_one_round_trip(self, engine: PostgresEngine,
                                          scripts: list[str]) -> None:
        held = _acquire(engine, "alice")
        scripts.clear()
        answer = engine.call("locks", {"operations": [{"op": "get", "name": NAME}]})
        assert [h["token"] for h in answer["results"][0]["holders"]] == [held["token"]], answer
        assert len(scripts) == 1, f"one round trip, not {len(scripts)}: {scripts}"

    def test_a_renew_naming_its_slot_is_one_round_trip(
            self, engine: PostgresEngine, scripts: list[str]) -> None:
        held = _acquire(engine, "me")
        scripts.clear()
        renew = {"op": "renew", "name": NAME, "token": held["token"], "slot": 0,
                 "owner": "me", "ttlSeconds": 30}
        answer = engine.call("locks", {"operations": [renew]})["results"][0]
        assert answer["renewed"] and answer["token"] > held["token"], answer
        assert len(scripts) == 1, f"one round trip, not {len(scripts)}: {scripts}"
        assert "synchronous_commit" not in scripts[0], f"a durable commit: {scripts[0]}"

    def test_an_acquire_and_its_release_are_two_round_trips_in_all(
            self, engine: PostgresEngine, scripts: list[str]) -> None:
        for _ in range(3):
            held = _acquire(engine, "me")
            release = {"op": "release", "name": NAME, "token": held["token"], "slot": 0}
            assert engine.call("locks", {"operations": [release]})["results"][0]["released"]
        assert len(scripts) == 6, f"two round trips a pair, not {len(scripts) / 3:g}: {scripts}"

    def test_an_acquire_the_sql_leaves_to_the_semantics_still_answers_in_two_trips_more(
            self, engine: PostgresEngine, scripts: list[str]) -> None:
        """An odd row in the name: the statement writes nothing; the two-trip path decides."""
        engine.call("kv", {"operations": [{"op": "put", "ns": "queen-locks", "key": "n#x",
                                           "value": 1, "ttlSeconds": 30}]})
        scripts.clear()
        answer = _acquire(engine, "me")
        assert answer["acquired"] and answer["slot"] == 0, answer
        assert len(scripts) == 3, f"the statement, then two trips: {scripts}"


def _seed(conn: psycopg.Connection[Any], schema: str, rows: list[tuple[str, str, str, str]],
          now: int, floors: Optional[list[Optional[int]]] = None) -> None:
    """The name's rows as given (key, owner JSON, limit JSON or None, expiry), versions
    10, 20, ..., and the token each one's last renew presented (``floors``)."""
    for index, (key, owner, limit, expiry) in enumerate(rows):
        version = 10 * (index + 1)
        floor = floors[index] if floors else None
        if owner == "object":
            value = "[1]"
        else:
            value = "{" + f'"owner":{owner}' + ("" if limit is None else f',"limit":{limit}') + "}"
        offset = EXPIRIES[expiry]
        conn.execute(
            f'INSERT INTO "{schema}".kv VALUES (%s, %s, %s::json, %s, %s, %s, %s, %s)',
            ("queen-locks", key, value, version, None if offset is None else now + offset,
             now - 60_000, now - 60_000, None if floor is None else version - floor))
    conn.execute(f"SELECT setval('\"{schema}\".version', 1000)")


def _marked(value: Any, new: Optional[int]) -> Any:
    """The answer with the token minted by this call shown as "NEW"."""
    if isinstance(value, dict):
        return {k: _marked(v, new) for k, v in value.items()}
    if isinstance(value, list):
        return [_marked(v, new) for v in value]
    return "NEW" if new is not None and value == new and not isinstance(value, bool) else value


def _state(conn: psycopg.Connection[Any], schema: str, new: Optional[int]) -> list[Any]:
    rows = conn.execute(f'SELECT key, value::text, version, expires_at - updated_at,'
                        f' created_at = updated_at, prev_version FROM "{schema}".kv'
                        " WHERE ns = 'queen-locks' AND key LIKE 'n#%%' ORDER BY key").fetchall()
    return [_marked(list(row), new) for row in rows]


def _minted(answer: Any) -> Optional[int]:
    fresh = answer.get("acquired") and not answer.get("already")
    return int(answer["token"]) if fresh else None


def _answer(engine: PostgresEngine, ops: list[dict[str, Any]]) -> Any:
    try:
        return engine.call("locks", {"operations": ops})["results"][0]
    except Exception as refusal:  # a refusal is an answer here: both paths must agree on it
        return {"raised": type(refusal).__name__, "code": getattr(refusal, "code", None)}


_ROWS = st.lists(st.tuples(st.sampled_from(SLOT_KEYS), st.sampled_from((*OWNERS, "object")),
                           st.sampled_from(LIMITS), st.sampled_from(sorted(EXPIRIES))),
                 max_size=4, unique_by=lambda row: row[0])


def _both_paths(server: PgServer, rows: list[tuple[str, str, str, str]], op: dict[str, Any],
                floors: Optional[list[Optional[int]]] = None) -> None:
    """Seed the rows in two schemas; ``op`` alone on one, first of two ops on the other
    (the two-trip path: the get after it does not change its answer); compare."""
    (fast_schema, fast), (slow_schema, slow) = _fresh(server), _fresh(server)
    with contextlib.closing(fast), contextlib.closing(slow), psycopg.connect(
            server.url, autocommit=True) as conn:
        now = int(conn.execute("SELECT floor(extract(epoch FROM clock_timestamp())"
                               " * 1000)::bigint").fetchone()[0])  # type: ignore[index]
        for schema in (fast_schema, slow_schema):
            _seed(conn, schema, rows, now, floors)
        one = _answer(fast, [op])
        two = _answer(slow, [op, {"op": "get", "name": NAME}])
        new_one, new_two = (_minted(one), _minted(two))
        assert _marked(one, new_one) == _marked(two, new_two), (
            f"one statement answered {one}, two trips {two}")
        assert _state(conn, fast_schema, new_one) == _state(conn, slow_schema, new_two), (
            "the two paths left the name's rows differently")
        for schema in (fast_schema, slow_schema):
            conn.execute(f'DROP SCHEMA "{schema}" CASCADE')


# QUEEN_SYNC_FAST_PATH_EXAMPLES runs the agreement searches longer.
_SETTINGS = settings(max_examples=int(os.environ.get("QUEEN_SYNC_FAST_PATH_EXAMPLES", "60")),
                     deadline=None, suppress_health_check=[
    HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


class TestTheOneStatementCallsAgreeWithTheTwoTripPath:
    @_SETTINGS
    @given(rows=_ROWS, limit=st.sampled_from([1, 2, 3]))
    def test_an_acquire_on_any_rows_of_the_name_answers_and_writes_the_same(
            self, server: PgServer, rows: list[tuple[str, str, str, str]], limit: int) -> None:
        _both_paths(server, rows, {"op": "acquire", "name": NAME, "ttlSeconds": 30,
                                   "owner": "me", "limit": limit})

    @_SETTINGS
    @given(limit=st.sampled_from([1, 2, 3]), data=st.data())
    def test_an_acquire_among_permits_of_its_own_limit_answers_and_writes_the_same(
            self, server: PgServer, limit: int, data: st.DataObject) -> None:
        """Rows as acquires at this very limit leave them, the caller's own among them:
        the rows the statement decides on by itself, where a rule it misjudges writes."""
        slots = data.draw(st.lists(st.integers(0, limit), unique=True, max_size=limit + 1),
                          label="slots")
        rows = [(f"n#{slot}", data.draw(st.sampled_from(('"me"', '"alice"', '"bob"')),
                                        label="owner"),
                 str(limit), data.draw(st.sampled_from(sorted(EXPIRIES)), label="expiry"))
                for slot in slots]
        _both_paths(server, rows, {"op": "acquire", "name": NAME, "ttlSeconds": 30,
                                   "owner": "me", "limit": limit})

    @_SETTINGS
    @given(rows=_ROWS, data=st.data())
    def test_a_renew_on_any_rows_of_the_name_answers_and_writes_the_same(
            self, server: PgServer, rows: list[tuple[str, str, str, str]],
            data: st.DataObject) -> None:
        floors = [data.draw(st.sampled_from([None, 0, 3, 10]), label="floor") for _ in rows]
        # Mostly a seeded row's slot, with its token, one its owner minted since its floor,
        # or its floor; sometimes anything.
        slots = [int(key[2:]) for key, *_ in rows if key[2:] in ("0", "1", "2", "3")]
        seeded: st.SearchStrategy[int] = st.sampled_from(slots) if slots else st.integers(0, 3)
        slot = data.draw(seeded if data.draw(st.integers(0, 3)) else st.integers(0, 3),
                         label="slot")
        index = next((i for i, row in enumerate(rows) if row[0] == f"n#{slot}"), None)
        if index is not None and data.draw(st.booleans(), label="the owner's live permit"):
            key, _, limit, _ = rows[index]
            rows = [*rows[:index], (key, '"me"', limit, "soon"), *rows[index + 1:]]
        version = 10 * (index + 1) if index is not None else 10
        token = data.draw(st.sampled_from([version, version, version - 2, version - 3,
                                           version + 10, 999]), label="token")
        op: dict[str, Any] = {"op": "renew", "name": NAME, "ttlSeconds": 30, "token": token,
                              "slot": slot}
        owner = data.draw(st.sampled_from([None, "me", "me", "me", "alice", "5"]),
                          label="owner")
        if owner is not None:
            op["owner"] = owner
        _both_paths(server, rows, op, floors)



class TestAnOutcomeLeftOpen:
    def test_an_acquire_whose_connection_broke_after_it_committed_is_answered_on_the_retry(
            self, engine: PostgresEngine, monkeypatch: pytest.MonkeyPatch) -> None:
        """The statement ran and committed, then the connection died before the answer."""
        broke = cut_after_first(monkeypatch, "qs_acquire_alone_scripted")
        answer = _acquire(engine, "me")
        assert broke, "the one-statement acquire never ran"
        assert answer["acquired"] and answer.get("already") is True, (
            f"the retry must answer the permit the first attempt took: {answer}")
        state = engine.call("locks", {"operations": [{"op": "get", "name": NAME}]})
        holders = state["results"][0]["holders"]
        assert [(h["owner"], h["token"]) for h in holders] == [("me", answer["token"])], holders


    def test_a_renew_naming_no_owner_whose_answer_was_lost_after_it_committed_is_not_called_lost(
            self, engine: PostgresEngine, monkeypatch: pytest.MonkeyPatch) -> None:
        """Only an owner's resend is recognised by the renew rule, so a renew without one
        must not commit where a lost answer leaves the retry judging it stale."""
        token = _acquire(engine, "me")["token"]
        # Whichever path the renew takes, cut the trip that commits it.
        broke = cut_after_first(monkeypatch, "renew", "COMMIT")
        op = {"op": "renew", "name": NAME, "token": token, "ttlSeconds": 30, "slot": 0}
        try:
            answer: Optional[dict[str, Any]] = engine.call(
                "locks", {"operations": [op]})["results"][0]
        except QueenError as exc:
            assert "unknown" in str(exc), f"a lost answer must say the outcome is unknown: {exc}"
            answer = None
        monkeypatch.undo()
        assert broke, "no trip of the renew was cut"
        state = engine.call("locks", {"operations": [{"op": "get", "name": NAME}]})
        renewed = [h for h in state["results"][0]["holders"] if h["token"] != token]
        if answer is not None:
            assert answer.get("renewed") or not renewed, (
                f"answered {answer} although the permit was renewed: {renewed}")


class TestFencesStillHoldOffATakeover:
    def test_a_takeover_of_a_fenced_permit_that_expired_waits_for_the_fence_to_commit(
            self, server: PgServer, engine: PostgresEngine) -> None:
        held = _acquire(engine, "me")
        schema = engine.url.rsplit("schema=", 1)[1]
        with psycopg.connect(server.url) as fenced, psycopg.connect(
                server.url, autocommit=True) as admin:
            engine.fence(fenced, name=NAME, slot=0, token=held["token"])
            admin.execute(f'UPDATE "{schema}".kv SET expires_at = 0')  # it lapses, fenced
            taken: list[dict[str, Any]] = []
            successor = threading.Thread(target=lambda: taken.append(_acquire(engine, "next")))
            successor.start()
            while not admin.execute("SELECT 1 FROM pg_stat_activity WHERE wait_event_type ="
                                    " 'Lock' AND query LIKE '%%qs_acquire_alone_scripted%%'"
                                    ).fetchall():
                assert successor.is_alive() and not taken, (
                    f"the takeover did not wait for the fence: {taken}")
                time.sleep(0.01)
            assert not taken, "answered while the fenced transaction was open"
            fenced.commit()
            successor.join(10)
        assert taken and taken[0]["acquired"] and taken[0]["token"] > held["token"], taken
