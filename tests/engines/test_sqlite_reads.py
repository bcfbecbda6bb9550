"""What an SQLite call reads: exactly the rows of what it names, however much else is stored.

The cost is counted in SQLite virtual-machine steps (a progress handler called at every
step), which depend on the rows visited and not on the machine's speed or load.
"""

from __future__ import annotations

import itertools
import sqlite3
from pathlib import Path
from typing import Any, Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from queen_sync._engines import sqlite as _sqlite
from queen_sync._engines.sqlite import SqliteEngine
from queen_sync._engines.storage import prefix_end

_OTHERS = 2000
_namespaces = itertools.count()


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[SqliteEngine]:
    opened = SqliteEngine(str(tmp_path / "reads.db"))
    yield opened
    opened.close()


def _hold_others(engine: SqliteEngine, names: list[str]) -> None:
    for start in range(0, len(names), 500):
        ops = [{"op": "acquire", "name": n, "ttlSeconds": 3600} for n in names[start:start + 500]]
        answers = engine.call("locks", {"operations": ops})["results"]
        assert all(a["acquired"] for a in answers), "every other lease must be taken"


def _steps_of_a_pair(engine: SqliteEngine, name: str) -> int:
    """SQLite VM steps of one acquire and one release of ``name``."""
    steps = [0]

    def count() -> int:
        steps[0] += 1
        return 0  # go on

    conn = engine.storage._conn
    assert conn is not None, "the engine connects when it opens"
    conn.set_progress_handler(count, 1)
    try:
        taken = engine.call("locks", {"operations": [
            {"op": "acquire", "name": name, "ttlSeconds": 30}]})["results"][0]
        assert taken["acquired"], taken
        released = engine.call("locks", {"operations": [
            {"op": "release", "name": name, "token": taken["token"], "slot": taken["slot"]}]})
        assert released["results"][0]["released"], released
    finally:
        conn.set_progress_handler(None, 0)
    return steps[0]


class TestAnAcquireReadsOnlyItsNamesPermits:
    def test_a_pair_costs_the_same_with_thousands_of_leases_named_after_it(
        self, engine: SqliteEngine
    ) -> None:
        empty = _steps_of_a_pair(engine, "a")
        _hold_others(engine, [f"b-{i:05d}" for i in range(_OTHERS)])
        crowded = _steps_of_a_pair(engine, "a")
        assert crowded <= empty * 1.2, (
            f"a pair on 'a' took {crowded} SQLite steps with {_OTHERS} leases named after it, "
            f"{empty} in an empty store: the read visits rows beyond its name's permits")

    def test_a_pair_costs_the_same_with_thousands_of_leases_named_before_it(
        self, engine: SqliteEngine
    ) -> None:
        empty = _steps_of_a_pair(engine, "z")
        _hold_others(engine, [f"b-{i:05d}" for i in range(_OTHERS)])
        crowded = _steps_of_a_pair(engine, "z")
        assert crowded <= empty * 1.2, (
            f"a pair on 'z' took {crowded} SQLite steps with {_OTHERS} leases named before it, "
            f"{empty} in an empty store")


class TestAPairsStatements:
    @pytest.mark.skipif(sqlite3.sqlite_version_info < (3, 35, 0),
                        reason="SQLite before 3.35 has no UPDATE ... RETURNING")
    def test_a_pair_sends_begin_read_token_write_commit_then_one_delete(
        self, engine: SqliteEngine
    ) -> None:
        sent: list[str] = []
        conn = engine.storage._conn
        assert conn is not None, "the engine connects when it opens"
        conn.set_trace_callback(sent.append)
        try:
            taken = engine.call("locks", {"operations": [
                {"op": "acquire", "name": "job", "ttlSeconds": 30}]})["results"][0]
            engine.call("locks", {"operations": [
                {"op": "release", "name": "job", "token": taken["token"], "slot": 0}]})
        finally:
            conn.set_trace_callback(None)
        verbs = [statement.split()[0].upper() for statement in sent]
        assert verbs == ["BEGIN", "SELECT", "UPDATE", "INSERT", "COMMIT", "DELETE"], (
            f"one pair sent {len(sent)} statements: {sent}")

    def test_tokens_still_rise_on_an_sqlite_without_returning(
        self, engine: SqliteEngine, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        tokens = []
        for returning in (True, False, True):
            monkeypatch.setattr(_sqlite, "_RETURNING", returning)
            taken = engine.call("locks", {"operations": [
                {"op": "acquire", "name": "job", "ttlSeconds": 30}]})["results"][0]
            engine.call("locks", {"operations": [
                {"op": "release", "name": "job", "token": taken["token"], "slot": 0}]})
            tokens.append(taken["token"])
        assert tokens == sorted(set(tokens)), f"tokens must rise either way: {tokens}"


# Characters at the edges that a prefix's upper bound must get right: '#' (the slot
# separator) and its neighbours, the last character before the surrogates, the first
# after them, the last of the basic plane and the last code point of all.
_EDGES = "\"#$09\ud7ff\ue000\uffff\U00010000\U0010ffff"
_texts = st.text(alphabet=st.sampled_from(_EDGES) | st.characters(
    blacklist_categories=("Cs", "Cc")), min_size=1, max_size=4)


class TestThePrefixBound:
    @given(prefix=_texts, other=_texts)
    @settings(max_examples=200)
    def test_a_string_starts_with_the_prefix_exactly_when_it_lies_below_its_end(
        self, prefix: str, other: str
    ) -> None:
        for text in (other, prefix + other, prefix[:-1] + other):
            end = prefix_end(prefix)
            inside = text >= prefix and (end is None or text < end)
            assert inside == text.startswith(prefix), (
                f"{text!r} against prefix {prefix!r} (end {end!r}): in the range {inside}, "
                f"starts with it {text.startswith(prefix)}")

    def test_a_prefix_of_only_the_last_code_point_has_no_end(self) -> None:
        assert prefix_end("\U0010ffff\U0010ffff") is None, "nothing sorts above it"
        assert prefix_end("a\U0010ffff") == "b", "the last code point carries into the one before"
        assert prefix_end("\ud7ff") == "\ue000", "surrogates are skipped: text cannot hold them"

    @given(keys=st.lists(_texts, min_size=1, max_size=12, unique=True), prefix=_texts)
    @settings(max_examples=60, deadline=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture])
    def test_a_prefix_read_answers_exactly_the_keys_starting_with_it(
        self, engine: SqliteEngine, keys: list[str], prefix: str
    ) -> None:
        ns = f"edges-{next(_namespaces)}"  # a namespace of its own: exactly these keys
        engine.call("kv", {"operations": [
            {"op": "put", "ns": ns, "key": k, "value": 1, "ttlSeconds": 60} for k in keys]})
        answer: dict[str, Any] = engine.call("kv", {"operations": [
            {"op": "getPrefix", "ns": ns, "prefix": prefix, "limit": 1000}]})["results"][0]
        got = [row["key"] for row in answer["rows"]]
        assert got == sorted(k for k in keys if k.startswith(prefix)), (
            f"prefix {prefix!r} over {sorted(keys)!r} answered {got!r}")
