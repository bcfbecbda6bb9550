"""A lone lock op on SQLite leaves the store exactly as the same op in a batch does.

A body of one lock op (each acquire and release of a handle) takes the embedded engine's
short path; a batch takes the general one. Random histories of lock ops, mixed with
key/value writes on permit keys (values and slots no acquire writes), with releases and
renews mostly presenting tokens the name was just answered with, must get the same
answers and leave the same rows and version counter on both paths.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from queen_sync import RequestError
from queen_sync._engines.sqlite import SqliteEngine

NAMES = ("job", "job", "jo", "job2")  # "jo", "job2" sort beside "job#...": ranges must not mix
OWNERS = ("alice", "bob")
UNTOUCHED = {"op": "get", "name": "never-touched"}  # makes a body a batch, answering nothing
# No time, a little, and past every lifetime an op gives (1..3 s), in milliseconds.
WAITS_MS = st.sampled_from([0, 0, 300, 1200, 3100])
LAST, BEFORE_LAST = -1, -2  # stand for the name's latest tokens (never sent as they are)


class _Time:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def _ops() -> st.SearchStrategy[tuple[str, dict[str, Any]]]:
    """Lock ops, and key/value writes on permit keys (values no acquire writes)."""
    name, owner = st.sampled_from(NAMES), st.sampled_from(OWNERS)
    # Mostly a token the name was answered with lately (see ``_resolved``), so that
    # releases and renews hit live, expired and renewed permits, not only misses.
    token = st.one_of(st.sampled_from([LAST, BEFORE_LAST]), st.integers(1, 9))
    ttl = st.integers(1, 3)
    acquire = st.builds(lambda n, o, t, extra: {"op": "acquire", "name": n, "owner": o,
                                                "ttlSeconds": t, **extra},
                        name, owner, ttl, st.sampled_from([{}, {"limit": 1}, {"limit": 2}]))
    release = st.builds(lambda n, tok, s: {"op": "release", "name": n, "token": tok, **s},
                        name, token, st.sampled_from([{}, {"slot": 0}, {"slot": 0}, {"slot": 1}]))
    renew = st.builds(lambda n, o, tok, s: {"op": "renew", "name": n, "ttlSeconds": 2,
                                            "token": tok, "owner": o, **s},
                      name, owner, token, st.sampled_from([{}, {"slot": 0}]))
    get = st.builds(lambda n: {"op": "get", "name": n}, name)
    locks = st.one_of(acquire, release, renew, get).map(lambda op: ("locks", op))
    put = st.builds(lambda n, tail, value, t: ("kv", {
        "op": "put", "ns": "queen-locks", "key": f"{n}#{tail}", "value": value, "ttlSeconds": t}),
        name, st.sampled_from(["0", "1", "x", "00"]),
        st.sampled_from([{"owner": "alice", "limit": 1}, {"owner": "bob"}, "text", None]), ttl)
    return st.one_of(locks, locks, locks, put)


def _handover() -> st.SearchStrategy[list[tuple[str, dict[str, Any]]]]:
    """An owner takes a name, renews, then releases with the token it held before the
    renew (its answer may never have arrived): the previous token must release too."""
    def moves(name: str, owner: str) -> list[tuple[str, dict[str, Any]]]:
        return [("locks", {"op": "acquire", "name": name, "owner": owner, "ttlSeconds": 3}),
                ("locks", {"op": "renew", "name": name, "owner": owner, "ttlSeconds": 3,
                           "token": LAST, "slot": 0}),
                ("locks", {"op": "release", "name": name, "token": BEFORE_LAST, "slot": 0})]
    return st.builds(moves, st.sampled_from(NAMES), st.sampled_from(OWNERS))


def _moves() -> st.SearchStrategy[list[tuple[str, dict[str, Any]]]]:
    return st.one_of(_ops().map(lambda op: [op]), _handover())


def _resolved(op: dict[str, Any], seen: dict[str, list[int]]) -> dict[str, Any]:
    """``op`` with a LAST or BEFORE_LAST token replaced by one ``seen`` for its name."""
    if op.get("token") not in (LAST, BEFORE_LAST):
        return op
    tokens = seen.get(op["name"], [])
    back = 1 if op["token"] == LAST else 2
    return {**op, "token": tokens[-back] if len(tokens) >= back else 1}


def _note_tokens(answer: Any, op: dict[str, Any], seen: dict[str, list[int]]) -> None:
    if isinstance(answer, dict) and isinstance(answer.get("token"), int) and "name" in op:
        seen.setdefault(op["name"], []).append(answer["token"])


def _answer(send: Callable[[], Any]) -> Any:
    try:
        return send()
    except RequestError as exc:
        return ("raised", exc.code)


def _rows(engine: SqliteEngine) -> list[tuple[Any, ...]]:
    """Every stored row and the version counter, read on the engine's own connection."""
    conn = engine.storage._conn
    assert conn is not None, "setup: the engine has no connection"
    return conn.execute("SELECT * FROM queen_kv ORDER BY ns, key").fetchall() + \
        conn.execute("SELECT * FROM queen_meta").fetchall()


def _send(engine: SqliteEngine, route: str, op: dict[str, Any], *, lone: bool) -> Any:
    if route == "kv":
        return engine.call("kv", {"operations": [op]})["results"][0]
    ops = [op] if lone else [op, UNTOUCHED]
    return engine.call("locks", {"operations": ops})["results"][0]


class TestALoneOpStoresWhatTheSameOpInABatchStores:
    @settings(max_examples=60, deadline=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(moves=st.lists(st.tuples(_moves(), WAITS_MS), min_size=1, max_size=20))
    def test_random_histories_leave_the_same_answers_rows_and_tokens_on_both_paths(
            self, tmp_path_factory: pytest.TempPathFactory,
            moves: list[tuple[list[tuple[str, dict[str, Any]]], int]]) -> None:
        steps = [(op, wait_ms if i == 0 else 0) for ops, wait_ms in moves
                 for i, op in enumerate(ops)]
        folder = tmp_path_factory.mktemp("paths")
        time = _Time()
        lone = SqliteEngine(str(folder / "lone.db"), clock=time)
        batch = SqliteEngine(str(folder / "batch.db"), clock=time)
        try:
            seen: dict[str, list[int]] = {}
            for index, ((route, drawn), wait_ms) in enumerate(steps):
                time.now += wait_ms / 1000
                op = _resolved(drawn, seen)
                got = _answer(partial(_send, lone, route, op, lone=True))
                expected = _answer(partial(_send, batch, route, op, lone=False))
                assert got == expected, f"step {index} {op}: lone {got} != batch {expected}"
                _note_tokens(expected, op, seen)
                assert _rows(lone) == _rows(batch), f"step {index} {op}: the stores differ"
        finally:
            lone.close()
            batch.close()
