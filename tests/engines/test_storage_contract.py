"""The storage contract both SQL engines keep: footprints, one expiry rule, one waking rule."""

from __future__ import annotations

import threading
from typing import Any, Callable, Iterator, TypeVar

import pytest
from engine_factories import ENGINE_FACTORIES
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from polling import woken_within

import queen_sync as qs
from queen_sync._engines.embedded import EmbeddedSemantics
from queen_sync._engines.storage import Footprint, Row, StorageTxn

pytestmark = pytest.mark.timeout(60)
T = TypeVar("T")
SQL_ENGINES = ("sqlite", "postgres")


@pytest.fixture(params=SQL_ENGINES)
def client(request: pytest.FixtureRequest) -> Iterator[qs.Queen]:
    if request.param == "postgres":
        pytest.importorskip("psycopg")
    with qs.Queen(ENGINE_FACTORIES[request.param](request), renew_thread=False) as q:
        yield q


def _storage(q: qs.Queen) -> Any:
    return q.engine.storage  # type: ignore[attr-defined]


class Recording:
    """A storage that notes every footprint it is handed, then runs the real one."""

    def __init__(self, real: Any) -> None:
        self.real = real
        self.footprints: list[Footprint] = []

    def transaction(self, footprint: Footprint, work: Callable[[StorageTxn], T]) -> T:
        self.footprints.append(footprint)
        result: T = self.real.transaction(footprint, work)
        return result

    def close(self) -> None:
        self.real.close()


ACQUIRE = {"op": "acquire", "name": "a", "ttlSeconds": 5, "owner": "o"}
RENEW = {"op": "renew", "name": "b", "token": 1, "ttlSeconds": 5}
RELEASE = {"op": "release", "name": "c", "token": 1}


class TestTheSemanticsSayWhatABodyTouches:
    def test_each_body_reaches_the_storage_with_its_footprint(self, client: qs.Queen) -> None:
        storage = Recording(_storage(client))
        semantics = EmbeddedSemantics(storage)
        semantics.call("locks", {"operations": [ACQUIRE, RENEW, RELEASE]})
        semantics.call("locks", {"operations": [RELEASE]})
        put = {"op": "put", "ns": "n", "key": "k", "value": 1, "forever": True}
        many = {"op": "getMany", "ns": "n", "keys": ["x", "y"]}
        semantics.call("kv", {"operations": [put, many]})
        guard = {"op": "check", "ns": "queen-locks", "key": "a#0", "expect": 1, "required": True}
        semantics.call("transaction", {"kv": [guard, {**put, "op": "incr", "delta": 1}]})
        assert storage.footprints == [
            Footprint(names=frozenset("abc"), mints=2, operations=3),
            Footprint(names=frozenset("c"), only_releases=True, operations=1),
            Footprint(keys=frozenset({("n", "k"), ("n", "x"), ("n", "y")}), mints=1,
                      operations=2),
            Footprint(keys=frozenset({("queen-locks", "a#0"), ("n", "k")}), mints=1,
                      operations=2),
        ], "the footprint is what the validated operations name"

    def test_a_malformed_body_reaches_no_storage(self, client: qs.Queen) -> None:
        storage = Recording(_storage(client))
        with pytest.raises(TypeError, match="lock name"):
            EmbeddedSemantics(storage).call("locks", {"operations": [{"op": "acquire"}]})
        assert storage.footprints == [], "a body is validated whole before any transaction"


_names = st.sampled_from(["a", "b", "c", "e"])
_lock_ops = st.one_of(
    st.builds(lambda n: {"op": "acquire", "name": n, "ttlSeconds": 5, "owner": "o"}, _names),
    st.builds(lambda n, t: {"op": "renew", "name": n, "token": t, "ttlSeconds": 5,
                            "owner": "o"}, _names, st.integers(1, 6)),
    st.builds(lambda n, t: {"op": "release", "name": n, "token": t}, _names,
              st.integers(1, 6)),
    st.builds(lambda n: {"op": "get", "name": n}, _names))
_kv_ops = st.one_of(
    st.builds(lambda k: {"op": "put", "ns": "n", "key": k, "value": 1, "ttlSeconds": 5},
              st.sampled_from(["k", "l"])),
    st.builds(lambda k, v: {"op": "check", "ns": "queen-locks", "key": k, "expect": v},
              st.sampled_from(["a#0", "b#0"]), st.integers(0, 6)),
    st.builds(lambda k: {"op": "incr", "ns": "n", "key": k, "delta": 1, "forever": True},
              st.sampled_from(["k", "m"])),
    # Reads go in batches and bundles too: the keys they look at must be planned as well.
    st.builds(lambda k: {"op": "get", "ns": "n", "key": k}, st.sampled_from(["k", "r"])),
    st.builds(lambda ks: {"op": "getMany", "ns": "n", "keys": ks},
              st.lists(st.sampled_from(["l", "m", "s"]), min_size=1, max_size=3)))


class TestPostgresLocksWhatTheFootprintNames:
    @settings(max_examples=25, deadline=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(locks=st.lists(_lock_ops, max_size=5), kv=st.lists(_kv_ops, max_size=4))
    def test_no_body_reaches_a_row_its_footprint_did_not_name(
            self, pg_url: str, locks: list[Any], kv: list[Any]) -> None:
        """Every entity a body locks on the way is one it missed planning: there must be none."""
        from queen_sync._engines.postgres import txn as pg_txn

        reached: list[set[str]] = []
        real_init = pg_txn.PgTxn.__init__

        def noting(txn: Any, *args: Any, **kwargs: Any) -> None:
            real_init(txn, *args, **kwargs)
            reached.append(txn.unplanned)

        with qs.Queen(pg_url + "?schema=footprints", renew_thread=False) as q, \
                pytest.MonkeyPatch.context() as patch:
            patch.setattr(pg_txn.PgTxn, "__init__", noting)
            q.engine.call("locks", {"operations": locks})
            q.engine.call("kv", {"operations": kv})
            q.engine.call("transaction", {"kv": kv})
        assert reached and all(not extra for extra in reached), (
            f"rows reached beyond the footprint: {reached}")


def _row(txn: StorageTxn, key: str, expires_at: int) -> Row:
    now = txn.now_ms()
    return Row("n", key, {"v": key}, txn.next_version(), expires_at, now, now)


class TestOneExpiryContract:
    def test_read_and_read_prefix_both_answer_live_rows_only(self, client: qs.Queen) -> None:
        storage = _storage(client)

        def seed(txn: StorageTxn) -> int:
            now = txn.now_ms()
            txn.write(_row(txn, "p-gone", now - 1))
            txn.write(_row(txn, "p-live", now + 60_000))
            return now

        now = storage.transaction(Footprint(keys=frozenset({("n", "p-gone"), ("n", "p-live")}),
                                            mints=2), seed)

        def look(txn: StorageTxn) -> tuple[Any, Any, list[str]]:
            rows = txn.read_prefix("n", "p-", after=None, limit=10, now_ms=now)
            return (txn.read("n", "p-gone", now_ms=now), txn.read("n", "p-live", now_ms=now),
                    [row.key for row in rows])

        gone, live, prefixed = storage.transaction(Footprint(), look)
        assert gone is None, f"read answered an expired row: {gone}"
        assert live is not None and live.key == "p-live", "read lost a live row"
        assert prefixed == ["p-live"], f"read_prefix answered {prefixed}"


class TestOneWakingRule:
    def test_waiters_wake_when_a_step_that_freed_a_name_commits_and_not_on_rollback(
            self, client: qs.Queen) -> None:
        storage = _storage(client)
        with client.engine.subscribe("w") as waiter:
            def fails(txn: StorageTxn) -> None:
                txn.freed("w")
                raise LookupError("rolled back")

            with pytest.raises(LookupError):
                storage.transaction(Footprint(names=frozenset({"w"})), fails)
            assert not woken_within(waiter, 0.3), "a rolled-back step woke the waiters"
            storage.transaction(Footprint(names=frozenset({"w"})),
                                lambda txn: txn.freed("w"))
            assert woken_within(waiter, 5.0), "a committed step that freed the name woke nobody"

    def test_a_key_value_delete_of_a_permit_wakes_its_waiters(self, client: qs.Queen) -> None:
        held = client.locks.acquire("kvw", ttl=30, owner="o")
        with client.engine.subscribe("kvw") as waiter:
            client.kv.delete("queen-locks", f"kvw#{held['slot']}")
            assert woken_within(waiter, 5.0), "freeing a permit through the KV wire woke nobody"


def test_the_postgres_storage_keeps_no_state_per_thread(pg_url: str) -> None:
    """What one call's attempts share travels with the call, not in a thread-local."""
    with qs.Queen(pg_url, renew_thread=False) as q:
        storage = _storage(q)
        q.locks.get("x")
        holders = [storage, *vars(storage).values()]
        assert not [h for h in holders if isinstance(h, threading.local)], (
            f"thread-local state in {type(storage).__name__}")
        assert not hasattr(storage, "new_call"), "the storage parses bodies a second time"


class TestOnePermitKeyRule:
    @given(name=st.text(min_size=1, max_size=20).filter(lambda n: "#" not in n),
           slot=st.integers(0, 1023))
    def test_splitting_a_permit_key_gives_back_its_name_and_slot(self, name: str,
                                                                  slot: int) -> None:
        from queen_sync._ops import permit_key, split_permit_key

        assert split_permit_key(permit_key(name, slot)) == (name, slot), permit_key(name, slot)

    @pytest.mark.parametrize("key", ["a#", "a#x", "a#07", "a#\u00b2", "a#-1"])
    def test_a_tail_permit_key_never_writes_has_no_slot(self, key: str) -> None:
        from queen_sync._ops import split_permit_key

        assert split_permit_key(key) == ("a", None), f"{key!r} read as a slot"
