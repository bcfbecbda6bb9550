"""PostgreSQL with many leases in one body: statements per transaction stay flat.

A renewal pass for thousands of leases runs as transactions of a bounded number of
operations; what each transaction sends must not grow with the leases in it, or the
server spends its time planning (and the client quoting) one statement per row.
"""

from __future__ import annotations

import secrets
from typing import Any, Iterator

import pytest

psycopg = pytest.importorskip("psycopg")

import queen_sync as qs  # noqa: E402  (after the skip: the engine needs psycopg)
from queen_sync._engines.postgres import renew_ahead  # noqa: E402
from queen_sync._ops import LockOps  # noqa: E402


@pytest.fixture
def client(pg_url: str) -> Iterator[qs.Queen]:
    client = qs.Queen(pg_url + "?schema=t_" + secrets.token_hex(6), pool_min_size=0,
                      renew_thread=False)
    client.kv.get("warm", "up")  # the schema is made before anything is recorded
    yield client
    client.close()


@pytest.fixture
def sent(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every script the engine sends over its connections, as the text it executes."""
    scripts: list[str] = []
    real_execute = psycopg.ClientCursor.execute

    def recording(self: Any, query: Any, params: Any = None, **kw: Any) -> Any:
        scripts.append(str(query))
        return real_execute(self, query, params, **kw)

    monkeypatch.setattr(psycopg.ClientCursor, "execute", recording)
    # A tick's transactions travel as one pipeline: each recorded as its statements' text.
    real_statements = renew_ahead._Pipeline._statements

    def pipelined(self: Any, *args: Any) -> Any:
        statements = real_statements(self, *args)
        scripts.append("; ".join(text.decode() for text, _, _ in statements))
        return statements

    monkeypatch.setattr(renew_ahead._Pipeline, "_statements", pipelined)
    return scripts


def _statements(script: str) -> int:
    return script.count("; ") + 1


def _hold(client: qs.Queen, count: int) -> list[dict[str, Any]]:
    ops = [LockOps.acquire(f"many-{i:05d}", ttl_seconds=3600, owner=f"owner-{i}")
           for i in range(count)]
    answers = [dict(a) for a in client.locks.batch(ops)]
    assert all(a["acquired"] for a in answers), "every lease should be taken"
    return answers


def _renew_ops(answers: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [LockOps.renew(f"many-{i:05d}", token=a["token"], ttl_seconds=3600, slot=a["slot"],
                          owner=f"owner-{i}") for i, a in enumerate(answers)]


class TestRenewingManyLeases:
    def test_each_transaction_of_a_big_renewal_sends_a_script_that_does_not_grow_with_it(
            self, client: qs.Queen, sent: list[str]) -> None:
        answers = _hold(client, 600)
        sent.clear()
        renewed = client.locks.batch(_renew_ops(answers))
        assert all(r["renewed"] for r in renewed), "every lease should be renewed"
        # A transaction starts with BEGIN, or is one implicit transaction of renews.
        begun = [s for s in sent if s.startswith("BEGIN") or "qs_renew_many" in s]
        assert len(begun) >= 2, f"600 ops should run as several transactions, not {len(begun)}"
        longest = max(_statements(s) for s in sent if not s.startswith("PREPARE"))
        assert longest <= 12, (
            f"a transaction of a big renewal sent a script of {longest} statements: one per "
            "row, so the server plans each, and the client quotes each")

    def test_a_big_renewal_moves_every_row_to_the_token_its_answer_gives(
            self, client: qs.Queen) -> None:
        answers = _hold(client, 700)
        renewed = [dict(r) for r in client.locks.batch(_renew_ops(answers))]
        holders = client.locks.batch([LockOps.get(f"many-{i:05d}") for i in range(700)])
        wrong = [i for i, (r, h) in enumerate(zip(renewed, holders))
                 if [(p["token"], p["owner"]) for p in h["holders"]]
                 != [(r["token"], f"owner-{i}")]]
        assert not wrong, f"rows not at the token their renew answered: {wrong[:10]}"
        old = {a["token"] for a in answers}
        assert all(r["token"] not in old and r["token"] > a["token"]
                   for r, a in zip(renewed, answers)), "a renew must mint a higher token"


class TestOneRowUpdatedTwiceInABody:
    def test_a_lease_renewed_twice_in_one_body_ends_at_the_second_answer(
            self, client: qs.Queen) -> None:
        answers = _hold(client, 30)
        twice = _renew_ops(answers) + _renew_ops(answers)  # the resend presents the old token
        renewed = [dict(r) for r in client.locks.batch(twice)]
        assert all(r["renewed"] for r in renewed), "a resent renew by its owner renews"
        holders = client.locks.batch([LockOps.get(f"many-{i:05d}") for i in range(30)])
        ends = [h["holders"][0]["token"] for h in holders]
        assert ends == [r["token"] for r in renewed[30:]], (
            "each row must end at the token of its LAST update in the body")

    def test_keys_written_twice_in_one_batch_keep_the_last_value(self, client: qs.Queen) -> None:
        keys = [f"k{i:03d}" for i in range(40)]
        client.kv.batch([{"op": "put", "ns": "twice", "key": k, "value": 0, "forever": True}
                         for k in keys])
        writes = [{"op": "put", "ns": "twice", "key": k, "value": {"round": r, "k": k},
                   "forever": True} for r in (1, 2) for k in keys]
        answers = client.kv.batch(writes)
        assert all(a["applied"] for a in answers), "every put applies"
        rows = client.kv.batch([{"op": "get", "ns": "twice", "key": k} for k in keys])
        assert [row["value"] for row in rows] == [{"round": 2, "k": k} for k in keys], (
            "the second write of each key must win")
        assert [row["version"] for row in rows] == [a["version"] for a in answers[40:]], (
            "each key is at the version its last write answered")

    def test_a_value_equal_in_python_but_not_in_json_is_stored_as_written(
            self, client: qs.Queen) -> None:
        client.kv.put("typed", "flag", 1, forever=True)
        for value in (True, 1.0, 1):
            client.kv.put("typed", "flag", value, forever=True)
            stored = client.kv.get("typed", "flag")["value"]
            assert stored == value and type(stored) is type(value), (
                f"wrote {value!r}, read back {stored!r}")


class TestABigBodyIsCheckedOnce:
    def test_each_op_of_a_body_run_as_several_transactions_is_validated_exactly_once(
            self, client: qs.Queen, monkeypatch: pytest.MonkeyPatch) -> None:
        import queen_sync._engines.embedded as embedded
        import queen_sync._engines.postgres.engine as engine
        from queen_sync._ops import check_lock_op as real_check

        checked: list[str] = []

        def counting(op: Any) -> Any:
            checked.append(op["name"])
            return real_check(op)

        for module in (embedded, engine):
            if hasattr(module, "check_lock_op"):
                monkeypatch.setattr(module, "check_lock_op", counting)
        answers = _hold(client, 600)
        assert len(checked) == 600, (
            f"600 acquires were validated {len(checked)} times: each op should be checked "
            "once, where the body enters the engine")
        checked.clear()
        renewed = client.locks.batch(_renew_ops(answers))
        assert all(r["renewed"] for r in renewed), "every lease should be renewed"
        assert len(checked) == 600, f"600 renews were validated {len(checked)} times, not once"


class _CountingRows(dict):  # type: ignore[type-arg]
    """A transaction's remembered rows, counting how many a full pass over them visits."""

    visited = 0

    def items(self) -> Any:
        _CountingRows.visited += len(self)
        return super().items()

    def values(self) -> Any:
        _CountingRows.visited += len(self)
        return super().values()

    def __iter__(self) -> Any:
        _CountingRows.visited += len(self)
        return super().__iter__()


class TestAPrefixReadInABigTransaction:
    def test_reading_one_names_permits_visits_only_that_names_rows(
            self, client: qs.Queen, monkeypatch: pytest.MonkeyPatch) -> None:
        from queen_sync._engines.postgres import txn

        real_init = txn.PgTxn.__init__

        def counting_init(self: txn.PgTxn, *args: Any, **kwargs: Any) -> None:
            real_init(self, *args, **kwargs)
            self._rows = _CountingRows(self._rows)

        monkeypatch.setattr(txn.PgTxn, "__init__", counting_init)
        _CountingRows.visited = 0
        _hold(client, 256)  # one transaction: every acquire reads its name's permits
        assert _CountingRows.visited <= 4 * 256, (
            f"256 acquires in one transaction visited {_CountingRows.visited} remembered rows: "
            "each prefix read scans every row the transaction knows (quadratic)")
