"""The embedded engine's short path for a lone lock op keeps every rule of the general one.

A body of one lock op (what a ``Lock`` handle sends for each acquire and release) is
answered without the bookkeeping a batch needs. These tests pin that it answers exactly
as the general path does, refuses what the general path refuses, and counts what it did.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Optional

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import queen_sync as qs
from queen_sync import RequestError
from queen_sync._engines.sqlite import SqliteEngine
from queen_sync._ops import check_name, check_owner

NAMES = ("job", "pool", "é")
OWNERS = ("alice", "bob", "carol")
UNTOUCHED = {"op": "get", "name": "never-touched"}  # makes a body a batch, answering nothing


class _Time:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def _ops() -> st.SearchStrategy[dict[str, Any]]:
    name, owner = st.sampled_from(NAMES), st.sampled_from(OWNERS)
    token, slot = st.integers(1, 12), st.integers(0, 2)
    ttl = st.integers(1, 3)
    acquire = st.builds(lambda n, o, t, limit: {"op": "acquire", "name": n, "owner": o,
                                                "ttlSeconds": t, **limit},
                        name, owner, ttl, st.sampled_from([{}, {"limit": 1}, {"limit": 2}]))
    renew = st.builds(lambda n, o, t, tok, s: {"op": "renew", "name": n, "ttlSeconds": t,
                                               "token": tok, **s, **o},
                      name, st.sampled_from([{}, {"owner": "alice"}, {"owner": "bob"}]), ttl,
                      token, st.sampled_from([{}, {"slot": 0}, {"slot": 1}]))
    release = st.builds(lambda n, tok, s: {"op": "release", "name": n, "token": tok, **s},
                        name, token, st.one_of(st.just({}), slot.map(lambda v: {"slot": v})))
    get = st.builds(lambda n: {"op": "get", "name": n}, name)
    return st.one_of(acquire, renew, release, get)


def _answer(send: Callable[[], dict[str, Any]]) -> Any:
    """What a call answered, or the type and code of what it raised."""
    try:
        return send()
    except RequestError as exc:
        return ("raised", type(exc).__name__, exc.code)


def _lone(engine: SqliteEngine, op: dict[str, Any]) -> Callable[[], Any]:
    return lambda: engine.call("locks", {"operations": [op]})["results"][0]


def _in_batch(engine: SqliteEngine, op: dict[str, Any]) -> Callable[[], Any]:
    return lambda: engine.call("locks", {"operations": [op, UNTOUCHED]})["results"][0]


class TestALoneLockOpAnswersAsTheSameOpInABatch:
    @settings(max_examples=40, deadline=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(steps=st.lists(st.tuples(_ops(), st.integers(0, 2500)), min_size=1, max_size=30))
    def test_random_histories_get_the_same_answers_and_tokens_on_both_paths(
            self, tmp_path_factory: pytest.TempPathFactory,
            steps: list[tuple[dict[str, Any], int]]) -> None:
        folder = tmp_path_factory.mktemp("paths")
        time = _Time()
        lone = SqliteEngine(str(folder / "lone.db"), clock=time)
        batch = SqliteEngine(str(folder / "batch.db"), clock=time)
        try:
            for index, (op, wait_ms) in enumerate(steps):
                time.now += wait_ms / 1000
                got, expected = _answer(_lone(lone, op)), _answer(_in_batch(batch, op))
                assert got == expected, f"step {index} {op}: lone {got} != batch {expected}"
        finally:
            lone.close()
            batch.close()


class TestABadLoneLockOpIsRefusedAtTheCall:
    @pytest.mark.parametrize("op", [
        {"op": "acquire", "name": "a#b", "ttlSeconds": 5},
        {"op": "acquire", "name": "job", "ttlSeconds": 0},
        {"op": "acquire", "name": "job", "ttlSeconds": 5, "owner": "x\n"},
        {"op": "acquire", "name": "job", "ttlSeconds": 5, "limit": 0},
        {"op": "release", "name": "job", "token": True},
        {"op": "renew", "name": "job", "token": 1},
        {"op": "steal", "name": "job"},
        {"op": "get", "name": ""},
    ])
    def test_it_raises_and_nothing_is_written(self, tmp_path: Path, op: dict[str, Any]) -> None:
        engine = SqliteEngine(str(tmp_path / "q.db"))
        try:
            with pytest.raises((RequestError, TypeError, ValueError)):
                engine.call("locks", {"operations": [op]})
            first = engine.call("locks", {"operations": [
                {"op": "acquire", "name": "job", "ttlSeconds": 5, "owner": "o"}]})["results"][0]
            assert first["token"] == 1, f"the refused {op} drew a token or wrote a row: {first}"
        finally:
            engine.close()

    def test_an_op_changed_after_the_builder_made_it_is_checked_again(
            self, tmp_path: Path) -> None:
        with qs.Queen("sqlite://" + str(tmp_path / "q.db")) as q:
            op = q.locks.op.acquire("job", ttl_seconds=5)
            op["name"] = "bad#name"
            with pytest.raises(RequestError) as raised:
                q.locks.batch([op])
            assert raised.value.code == "lock_bad_request", f"refused as {raised.value!r}"


class TestTheCountersStayExactOnTheShortPath:
    def test_pairs_busy_attempts_and_the_held_gauge_add_up(self, sqlite_url: str) -> None:
        with qs.Queen(sqlite_url) as q, qs.Queen(sqlite_url) as other:
            lock, rival = q.lock("counted", ttl=30), other.lock("counted", ttl=30)
            for _ in range(25):
                assert lock.acquire(), "a free lock was not taken"
                assert not rival.acquire(), "a held lock was taken by another client"
                assert lock.release(), "a held lock was not given back"
            snap, rival_snap = q.metrics.snapshot(), other.metrics.snapshot()
        counts: dict[str, Optional[int]] = snap["counts"]
        assert (counts["acquired"], counts["released"], snap["held"]) == (25, 25, 0), snap
        assert snap["acquire_wait_seconds"]["count"] == 25, snap
        assert rival_snap["counts"]["busy"] == 25, rival_snap


def _verdict(check: Callable[[Any], str], value: Any) -> Any:
    try:
        return ("ok", check(value))
    except (RequestError, TypeError) as exc:
        return ("refused", type(exc).__name__)


class _Sly(str):
    """A name that hashes and compares as a good one but is not one (its bytes differ)."""

    def __hash__(self) -> int:
        return hash("job")

    def __eq__(self, other: object) -> bool:
        return other == "job" or str.__eq__(self, other)

    def __ne__(self, other: object) -> bool:
        return not self.__eq__(other)


class TestNamesAndOwnersRememberedAsValidAreCheckedAlike:
    @settings(max_examples=300, deadline=None)
    @given(text=st.text(max_size=300))
    def test_every_text_gets_the_same_verdict_the_first_time_and_every_time_after(
            self, text: str) -> None:
        for check in (check_name, check_owner):
            first = _verdict(check, text)
            assert _verdict(check, text) == first, f"{check.__name__}({text!r}) changed verdict"

    def test_a_str_subclass_equal_to_a_remembered_name_is_still_checked(self) -> None:
        assert check_name("job") == "job", "setup: a good name was refused"
        sly = _Sly("job#0")
        assert sly == "job" and hash(sly) == hash("job"), "setup: the subclass must collide"
        with pytest.raises(RequestError):
            check_name(sly)

    def test_a_name_over_the_byte_limit_is_refused_however_often_it_is_tried(self) -> None:
        long = "é" * 129  # 258 UTF-8 bytes, 129 characters
        for _ in range(3):
            with pytest.raises(RequestError):
                check_name(long)
