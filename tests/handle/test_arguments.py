"""Every bad argument is refused at the call that caused it, before any I/O."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from typing import Any

import pytest

import queen_sync as qs
from queen_sync._durations import MAX_TTL_SECONDS


@pytest.fixture
def q(sqlite_url: str) -> Any:
    client = qs.Queen(sqlite_url)
    yield client
    client.close()


class TestLifetimes:
    @pytest.mark.parametrize(("text", "seconds"), [
        ("30s", 30), ("5m", 300), ("1h30m", 5400), ("250ms", 0.25), ("1.5s", 1.5),
        ("2d", 172800), (" 10 ", 10), (timedelta(minutes=2), 120), (7, 7), (0.5, 0.5),
    ])
    def test_durations_parse_from_numbers_timedeltas_and_strings(self, text: Any,
                                                                 seconds: float) -> None:
        assert qs.parse_duration(text) == pytest.approx(seconds)

    @pytest.mark.parametrize("bad", ["", "5 minutes", "m5", "1h-3m", "-5s", "nan", "inf"])
    def test_malformed_or_non_positive_durations_are_value_errors(self, bad: str) -> None:
        with pytest.raises(ValueError):
            qs.parse_duration(bad)

    @pytest.mark.parametrize("bad", [True, None, [5], b"5s"])
    def test_durations_of_another_type_are_type_errors(self, bad: Any) -> None:
        with pytest.raises(TypeError):
            qs.parse_duration(bad)

    @pytest.mark.parametrize("kwargs", [{}, {"ttl": 5, "ttl_seconds": 5}])
    def test_a_lock_needs_exactly_one_lifetime(self, q: qs.Queen, kwargs: Any) -> None:
        with pytest.raises(TypeError, match="exactly one"):
            q.lock("job", **kwargs)

    @pytest.mark.parametrize("kwargs", [
        {"ttl": 0}, {"ttl": -1}, {"ttl": "soon"}, {"ttl_seconds": 0},
    ])
    def test_a_lifetime_must_be_positive(self, q: qs.Queen, kwargs: Any) -> None:
        with pytest.raises(ValueError):
            q.lock("job", **kwargs)

    @pytest.mark.parametrize("kwargs", [{"ttl": True}, {"ttl_seconds": 1.5},
                                        {"ttl_seconds": True}])
    def test_bools_and_floats_are_not_whole_seconds(self, q: qs.Queen, kwargs: Any) -> None:
        with pytest.raises(TypeError):
            q.lock("job", **kwargs)

    def test_a_fractional_lifetime_is_rounded_up_on_the_wire(self, q: qs.Queen) -> None:
        sent: list[Any] = []
        real = q._engine.call
        q._engine.call = lambda route, body: sent.append(body) or real(route, body)  # type: ignore[method-assign]
        lock = q.lock("job", ttl=1.2)
        assert lock.acquire()
        assert sent[0]["operations"][0]["ttlSeconds"] == 2, sent[0]
        assert lock.ttl == 1.2, "the local deadline keeps the exact, shorter lifetime"

    @pytest.mark.parametrize("kwargs", [
        {"ttl": 10**12}, {"ttl": float(MAX_TTL_SECONDS) + 0.5}, {"ttl": "3651d"},
        {"ttl": timedelta(days=3651)}, {"ttl_seconds": MAX_TTL_SECONDS + 1},
        {"ttl_seconds": 2**70},
    ])
    def test_a_lifetime_above_ten_years_is_refused_where_it_is_given(self, q: qs.Queen,
                                                                     kwargs: Any) -> None:
        with pytest.raises(ValueError, match="at most 10 years"):
            q.lock("job", **kwargs)
        with pytest.raises(ValueError, match="at most 10 years"):
            q.semaphore("pool", 2, **kwargs)
        with pytest.raises(ValueError, match="at most 10 years"):
            q.locks.acquire("job", **kwargs)
        with pytest.raises(ValueError, match="at most 10 years"):
            q.kv.put("app", "k", 1, **kwargs)
        with pytest.raises(ValueError, match="at most 10 years"):
            q.kv.incr("app", "n", **kwargs)
        assert not q.locks.get("job") and not q.kv.get("app", "k"), "nothing may be written"

    def test_an_expiry_date_beyond_ten_years_is_refused(self, q: qs.Queen) -> None:
        until = datetime.now(timezone.utc) + timedelta(days=3700)
        with pytest.raises(ValueError, match="at most 10 years"):
            q.kv.put("app", "k", 1, until=until)
        assert not q.kv.get("app", "k"), "nothing may be written"

    @pytest.mark.parametrize("op", [
        {"op": "acquire", "name": "job", "ttlSeconds": MAX_TTL_SECONDS + 1},
        {"op": "renew", "name": "job", "token": 1, "ttlSeconds": 10**17},
    ])
    def test_a_raw_lock_op_with_a_huge_lifetime_is_refused_before_sending(
        self, q: qs.Queen, op: Any
    ) -> None:
        with pytest.raises(ValueError, match="ttlSeconds"):
            q.locks.batch([op])
        assert not q.locks.get("job"), "nothing may be acquired"

    def test_a_raw_kv_op_with_a_huge_lifetime_is_refused_before_sending(self, q: qs.Queen) -> None:
        with pytest.raises(ValueError, match="ttlSeconds"):
            q.kv.batch([{"op": "put", "ns": "app", "key": "k", "value": 1, "ttlSeconds": 10**17}])
        assert not q.kv.get("app", "k"), "nothing may be written"

    def test_renew_every_must_be_shorter_than_the_lifetime(self, q: qs.Queen) -> None:
        with pytest.raises(ValueError, match="renew_every"):
            q.lock("job", ttl=10, renew_every=10)


class TestNamesAndNumbers:
    @pytest.mark.parametrize("name", ["", "a#1", "bell\x07", "x" * 257, "é" * 129])
    def test_bad_lock_names_are_value_errors(self, q: qs.Queen, name: str) -> None:
        with pytest.raises(ValueError):
            q.lock(name, ttl=5)

    @pytest.mark.parametrize("name", [None, 5, b"job"])
    def test_lock_names_must_be_strings(self, q: qs.Queen, name: Any) -> None:
        with pytest.raises(TypeError):
            q.lock(name, ttl=5)

    @pytest.mark.parametrize("owner", ["", "line\nbreak", "o" * 257])
    def test_bad_owners_are_value_errors(self, q: qs.Queen, owner: str) -> None:
        with pytest.raises(ValueError):
            q.lock("job", ttl=5, owner=owner)

    @pytest.mark.parametrize(("limit", "error"), [(0, ValueError), (1025, ValueError),
                                                  (True, TypeError), ("3", TypeError)])
    def test_semaphore_limits_are_ints_from_1_to_1024(self, q: qs.Queen, limit: Any,
                                                     error: type) -> None:
        with pytest.raises(error):
            q.semaphore("pool", limit, ttl=5)

    @pytest.mark.parametrize(("token", "error"), [(0, ValueError), (-3, ValueError),
                                                  (True, TypeError), ("7", TypeError),
                                                  (None, TypeError)])
    def test_tokens_are_positive_ints(self, q: qs.Queen, token: Any, error: type) -> None:
        with pytest.raises(error):
            q.locks.release("job", token=token)
        with pytest.raises(error):
            q.locks.renew("job", token=token, ttl_seconds=5)

    def test_a_bad_wait_is_refused_before_asking(self, q: qs.Queen) -> None:
        lock = q.lock("job", ttl=5)
        with pytest.raises(ValueError):
            lock.acquire(wait="forever")
        assert not q.locks.get("job"), "nothing may be sent for a bad wait"

    @pytest.mark.parametrize("thing", ["job", None, {"op": "check"}])
    def test_a_transaction_guards_only_with_a_lock_handle(self, q: qs.Queen, thing: Any) -> None:
        with pytest.raises(TypeError, match=f"guard takes a Lock .*got {type(thing).__name__}"):
            q.transaction().guard(thing)

    def test_a_semaphore_handle_is_a_lock_and_guards_a_transaction(self, q: qs.Queen) -> None:
        with q.semaphore("pool", 2, ttl=30) as permit:
            assert q.transaction().guard(permit).kv.put("out", "a", 1, forever=True).commit()

    def test_on_lost_takes_a_callable(self, q: qs.Queen) -> None:
        with pytest.raises(TypeError):
            q.lock("job", ttl=5).on_lost("not callable")  # type: ignore[arg-type]

    def test_a_closed_client_refuses_calls(self, sqlite_url: str) -> None:
        q = qs.Queen(sqlite_url)
        q.close()
        with pytest.raises(qs.QueenError, match="closed"):
            q.kv.get("app", "k")
        with pytest.raises(qs.QueenError, match="closed"):
            q.lock("job", ttl=5)
