"""How an SQLite step runs a batch (a renewer's tick): the fewest statements, no token twice.

A step draws its versions with one counter statement and writes where it reached with one
more at commit, inside the same transaction; a batch reads the slots its ops name in a few
statements; a renew rewrites only the columns it changes.
The property tests below interleave several clients of one file (and, in the last test,
several processes) with rollbacks and commits that fail on either side of the COMMIT, and
check that no version is ever answered twice and that each one exceeds every earlier one.
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator, Optional

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlite_trace import statements_sent

from queen_sync import EngineError
from queen_sync._engines import sqlite as _sqlite
from queen_sync._engines.sqlite import SqliteEngine

pytestmark = pytest.mark.timeout(120)


def _acquire_all(engine: SqliteEngine, names: list[str]) -> list[int]:
    ops = [{"op": "acquire", "name": n, "owner": f"owner-{n}", "ttlSeconds": 60} for n in names]
    answers = engine.call("locks", {"operations": ops})["results"]
    assert all(a["acquired"] for a in answers), answers
    return [int(a["token"]) for a in answers]


def _renews(names: list[str], tokens: list[int]) -> list[dict[str, Any]]:
    return [{"op": "renew", "name": n, "token": t, "slot": 0, "owner": f"owner-{n}",
             "ttlSeconds": 60} for n, t in zip(names, tokens)]


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[SqliteEngine]:
    opened = SqliteEngine(str(tmp_path / "versions.db"))
    yield opened
    opened.close()


class TestAStepDrawsItsVersionsWithOneCounterReadAndOneWrite:
    @pytest.mark.parametrize("size", [3, 50, 400])
    def test_a_batch_of_renews_sends_two_counter_statements_whatever_its_size(
        self, engine: SqliteEngine, size: int
    ) -> None:
        names = [f"lease-{i:04d}" for i in range(size)]
        tokens = _acquire_all(engine, names)
        sent = statements_sent(
            engine, lambda: engine.call("locks", {"operations": _renews(names, tokens)}))
        counter = [s for s in sent if "queen_meta" in s]
        assert len(counter) == 2, (
            f"a body of {size} renews sent {len(counter)} statements on the version counter "
            f"(first ones: {counter[:3]}); one draw and one write at commit are enough")

    def test_a_batch_of_puts_sends_two_counter_statements(self, engine: SqliteEngine) -> None:
        puts = [{"op": "put", "ns": "app", "key": f"k{i}", "value": i, "forever": True}
                for i in range(30)]
        sent = statements_sent(engine, lambda: engine.call("kv", {"operations": puts}))
        counter = [s for s in sent if "queen_meta" in s]
        assert len(counter) == 2, f"30 puts sent {len(counter)} counter statements: {counter[:3]}"

    @pytest.mark.skipif(sqlite3.sqlite_version_info < (3, 35, 0),
                        reason="SQLite before 3.35 has no UPDATE ... RETURNING")
    def test_a_lone_acquire_still_draws_with_one_statement(self, engine: SqliteEngine) -> None:
        sent = statements_sent(engine, lambda: _acquire_all(engine, ["solo"]))
        counter = [s for s in sent if "queen_meta" in s]
        assert len(counter) == 1, f"one acquire sent {len(counter)} counter statements: {counter}"

    def test_the_versions_a_batch_answers_are_those_the_counter_reached(
        self, engine: SqliteEngine
    ) -> None:
        names = [f"n{i}" for i in range(20)]
        tokens = _acquire_all(engine, names)
        renewed = engine.call("locks", {"operations": _renews(names, tokens)})["results"]
        new = [int(r["token"]) for r in renewed]
        assert new == list(range(max(tokens) + 1, max(tokens) + 21)), (
            f"renews after tokens up to {max(tokens)} answered {new}")
        conn = sqlite3.connect(engine.path)
        try:
            (stored,) = conn.execute("SELECT value FROM queen_meta WHERE name = 'version'"
                                     ).fetchone()
        finally:
            conn.close()
        assert stored == max(new), f"the counter stored {stored} after answering up to {max(new)}"


class TestACounterMovedInsideAStepIsRefused:
    def test_a_step_whose_counter_moved_under_it_raises_and_commits_nothing(
        self, engine: SqliteEngine
    ) -> None:
        before = engine.call("kv", {"operations": [
            {"op": "put", "ns": "app", "key": "k", "value": 0, "forever": True}]})["results"]
        drawn: list[int] = []
        with pytest.raises(EngineError, match="version counter"), \
                engine.storage.atomic() as txn:
            drawn += [txn.next_version(), txn.next_version()]
            # What two steps drawing at once would look like from inside one of them.
            txn._conn.execute("UPDATE queen_meta SET value = value + 5")
        answer = engine.call("kv", {"operations": [
            {"op": "put", "ns": "app", "key": "k", "value": 1, "forever": True}]})["results"]
        assert answer[0]["version"] == before[0]["version"] + 1, (
            f"the refused step drew {drawn}, yet the next write got {answer}: it committed")


class TestABatchReadsTheSlotsItNamesInAFewStatements:
    @pytest.mark.parametrize("size", [3, 400, 1200])
    def test_a_batch_of_renews_reads_its_rows_in_one_statement_per_500(
        self, engine: SqliteEngine, size: int
    ) -> None:
        names = [f"lease-{i:04d}" for i in range(size)]
        tokens = _acquire_all(engine, names)
        sent = statements_sent(
            engine, lambda: engine.call("locks", {"operations": _renews(names, tokens)}))
        reads = [s for s in sent if s.upper().startswith("SELECT")]
        assert len(reads) == -(-size // 500), (
            f"a body of {size} renews sent {len(reads)} reads (first: {reads[:2]})")

    def test_a_batch_of_releases_reads_its_rows_in_one_statement(
        self, engine: SqliteEngine
    ) -> None:
        names = [f"lease-{i:03d}" for i in range(40)]
        tokens = _acquire_all(engine, names)
        ops = [{"op": "release", "name": n, "token": t, "slot": 0} for n, t in zip(names, tokens)]
        results: list[dict[str, Any]] = []
        sent = statements_sent(engine, lambda: results.extend(
            engine.call("locks", {"operations": ops})["results"]))
        assert all(r["released"] for r in results), results
        reads = [s for s in sent if s.upper().startswith("SELECT")]
        assert len(reads) == 1, f"40 releases sent {len(reads)} reads (first: {reads[:2]})"

    def test_a_slot_named_twice_in_one_batch_is_read_as_the_batch_left_it(
        self, engine: SqliteEngine
    ) -> None:
        (token,) = _acquire_all(engine, ["job"])
        renew = _renews(["job"], [token])[0]
        results = engine.call("locks", {"operations": [
            renew, renew, {"op": "release", "name": "job", "token": token, "slot": 0},
            {**renew, "token": token + 2}, {"op": "get", "name": "job"}]})["results"]
        assert [r.get("renewed", r.get("released", r.get("held"))) for r in results] == [
            True, True, True, False, False], results
        assert results[1]["token"] == results[0]["token"] + 1, results


class TestARenewRewritesOnlyWhatItChanges:
    def test_a_renew_sends_no_value_text_and_inserts_nothing(self, engine: SqliteEngine) -> None:
        names = ["job", "pool"]
        tokens = _acquire_all(engine, names)
        sent = statements_sent(
            engine, lambda: engine.call("locks", {"operations": _renews(names, tokens)}))
        carrying = [s for s in sent if "owner-job" in s or "owner-pool" in s]
        assert carrying == [], f"renews re-sent the permits' stored values: {carrying}"
        assert not [s for s in sent if s.upper().startswith("INSERT")], sent

    def test_a_renew_keeps_the_stored_value_text_byte_for_byte(self, engine: SqliteEngine) -> None:
        (token,) = _acquire_all(engine, ["job"])
        spaced = '{"owner": "owner-job", "limit": 1}'  # as another writer might have spelt it
        conn = sqlite3.connect(engine.path, isolation_level=None)
        try:
            conn.execute("UPDATE queen_kv SET value = ? WHERE key = 'job#0'", (spaced,))
            answer = engine.call("locks", {"operations": _renews(["job"], [token])})["results"]
            assert answer[0]["renewed"], answer
            (text, version) = conn.execute(
                "SELECT value, version FROM queen_kv WHERE key = 'job#0'").fetchone()
        finally:
            conn.close()
        assert text == spaced, f"the renew rewrote the value as {text!r}"
        assert version == answer[0]["token"], "the row carries the renewed token"


# ---- no version answered twice, whatever fails ------------------------------------------


class _FailingCommit:
    """A connection whose next COMMIT fails: before it runs (nothing lands) or after (it did)."""

    def __init__(self, conn: sqlite3.Connection, *, after: bool) -> None:
        self.conn = conn
        self.after = after
        self.armed = True

    def execute(self, sql: str, *args: Any) -> Any:
        if self.armed and sql == "COMMIT":
            self.armed = False
            if self.after:
                self.conn.execute(sql)
            raise sqlite3.OperationalError("disk I/O error")
        return self.conn.execute(sql, *args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.conn, name)


_NAMES = ("a", "b", "c")
_step = st.tuples(
    st.integers(0, 2),  # which client
    st.sampled_from(["acquire", "renew", "release", "puts", "rolled_back", "incr"]),
    st.sampled_from([None, None, None, "before", "after"]),  # how its COMMIT fails, if it does
    st.integers(1, 4),  # how many ops
)


class _Clients:
    """Three engines on one file, the leases each holds, and every version answered."""

    def __init__(self, path: str) -> None:
        self.engines = [SqliteEngine(path) for _ in range(3)]
        self.held: dict[tuple[int, str], int] = {}
        self.answered: list[int] = []

    def close(self) -> None:
        for opened in self.engines:
            opened.close()

    def run(self, who: int, kind: str, fault: Optional[str], size: int) -> None:
        engine = self.engines[who]
        storage = engine.storage
        real = storage._conn
        if fault is not None and real is not None:
            storage._conn = _FailingCommit(real, after=fault == "after")  # type: ignore[assignment]
        try:
            self._answer(who, kind, size)
        except EngineError:
            assert fault is not None, f"a {kind} body failed without a fault"
        finally:
            storage._conn = real

    def _answer(self, who: int, kind: str, size: int) -> None:
        engine = self.engines[who]
        if kind in ("acquire", "renew", "release"):
            names = _NAMES[:min(size, len(_NAMES))]
            ops = [self._lock_op(who, kind, name) for name in names]
            for name, result in zip(names, engine.call("locks", {"operations": ops})["results"]):
                self._note_lock(who, name, result)
            return
        ops = [{"op": "put", "ns": "app", "key": f"k{i}", "value": i, "forever": True}
               for i in range(size)]
        if kind == "incr":
            ops = [{"op": "incr", "ns": "app", "key": "n", "delta": 1, "forever": True}] * size
        if kind == "rolled_back":
            ops.append({"op": "check", "ns": "app", "key": "absent", "expect": 7,
                        "required": True})
        answer = engine.call("transaction", {"kv": ops})
        if answer["success"]:
            self.answered += [int(r["version"]) for r in answer["kv"]]

    def _lock_op(self, who: int, kind: str, name: str) -> dict[str, Any]:
        token = self.held.get((who, name), 1)
        if kind == "acquire":
            return {"op": "acquire", "name": name, "owner": f"c{who}", "ttlSeconds": 60}
        if kind == "renew":
            return {"op": "renew", "name": name, "token": token, "slot": 0, "owner": f"c{who}",
                    "ttlSeconds": 60}
        return {"op": "release", "name": name, "token": token, "slot": 0}

    def _note_lock(self, who: int, name: str, result: dict[str, Any]) -> None:
        if result.get("acquired") and not result.get("already"):
            self.answered.append(int(result["token"]))
        if result.get("renewed"):
            self.answered.append(int(result["token"]))
        if result.get("acquired") or result.get("renewed"):
            self.held[(who, name)] = int(result["token"])


def _assert_rising(answered: list[int], where: str) -> None:
    repeated = sorted({v for v in answered if answered.count(v) > 1})
    assert not repeated, f"{where}: versions answered twice: {repeated} in {answered}"
    assert answered == sorted(answered), (
        f"{where}: a version was answered below an earlier one: {answered}")


class TestNoVersionIsAnsweredTwice:
    @settings(max_examples=int(os.environ.get("QUEEN_SYNC_VERSION_EXAMPLES", "40")),
              deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(steps=st.lists(_step, min_size=1, max_size=25))
    def test_several_clients_of_one_file_with_failed_commits_answer_rising_versions(
        self, tmp_path: Path, steps: list[tuple[int, str, Optional[str], int]]
    ) -> None:
        path = tmp_path / f"clients-{len(os.listdir(tmp_path))}.db"
        clients = _Clients(str(path))
        try:
            for who, kind, fault, size in steps:
                clients.run(who, kind, fault, size)
        finally:
            clients.close()
        # Calls run one after another and each commits before it answers, so across all
        # clients the versions answered rise in the order of the calls.
        _assert_rising(clients.answered, f"steps {steps}")

    def test_processes_drawing_at_once_never_answer_one_version_twice(
        self, tmp_path: Path
    ) -> None:
        path = str(tmp_path / "processes.db")
        SqliteEngine(path).close()
        rounds = os.environ.get("QUEEN_SYNC_VERSION_ROUNDS", "60")
        workers = [subprocess.Popen([sys.executable, __file__, path, str(seed), rounds],
                                    stdout=subprocess.PIPE, text=True) for seed in range(3)]
        seen: list[list[int]] = []
        for worker in workers:
            out, _ = worker.communicate(timeout=100)
            assert worker.returncode == 0, f"a worker failed: {out}"
            seen.append(json.loads(out.strip().splitlines()[-1]))
        for index, versions in enumerate(seen):
            _assert_rising(versions, f"worker {index}")
        every = [v for versions in seen for v in versions]
        assert len(every) == len(set(every)), (
            f"{len(every) - len(set(every))} versions were answered to two processes")
        assert len(every) > 3 * int(rounds), "the workers answered too few versions to judge"


def _worker(path: str, seed: int, rounds: int) -> list[int]:
    """One process's share: batches of acquires, renews and puts on one file, as they come."""
    engine = SqliteEngine(path)
    answered: list[int] = []
    names = [f"w{seed}-{i}" for i in range(8)]
    tokens: dict[str, int] = {}
    try:
        for index in range(rounds):
            size = 1 + (index * 7 + seed) % len(names)
            ops: list[dict[str, Any]] = []
            for name in names[:size]:
                if name in tokens:
                    ops.append({"op": "renew", "name": name, "token": tokens[name], "slot": 0,
                                "owner": f"p{seed}", "ttlSeconds": 60})
                else:
                    ops.append({"op": "acquire", "name": name, "owner": f"p{seed}",
                                "ttlSeconds": 60})
            for name, result in zip(names, engine.call("locks", {"operations": ops})["results"]):
                token = result.get("token")
                if token is not None and not result.get("already"):
                    tokens[name] = int(token)
                    answered.append(int(token))
            puts = [{"op": "put", "ns": "shared", "key": f"k{i}", "value": seed, "forever": True}
                    for i in range(size)]
            answered += [int(r["version"]) for r in engine.call("kv", {"operations": puts}
                                                                )["results"]]
    finally:
        engine.close()
    return answered


if __name__ == "__main__":
    print(json.dumps(_worker(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))))


_json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=12)


class TestAValueIsStoredAsTheStandardEncoderSpellsIt:
    @given(value=_json_values)
    def test_the_encoder_built_once_writes_the_same_text(self, value: Any) -> None:
        assert _sqlite._encoded(value) == _sqlite._encode(value), f"{value!r} spelt otherwise"

    def test_a_value_json_cannot_hold_raises_the_standard_error(self) -> None:
        circular: list[Any] = []
        circular.append(circular)
        with pytest.raises(ValueError, match="Circular reference"):
            _sqlite._encoded(circular)
        with pytest.raises(TypeError, match="set is not JSON serializable"):
            _sqlite._encoded({"owner": {1, 2}})
