"""Every bad argument is refused at the call that caused it, before any I/O."""

from __future__ import annotations

import subprocess
import sys
from datetime import datetime, timedelta, timezone
from typing import Any, Callable, Mapping, Sequence

import pytest
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

import queen_sync as qs
from queen_sync import parse_duration
from queen_sync._durations import MAX_TTL_SECONDS, MIN_TTL_SECONDS
from queen_sync.testing import FaultyEngine

_UNIT_ORDER = ["d", "h", "m", "s", "ms"]  # largest first, as a duration is written
_UNIT_SECONDS = {"d": 86400, "h": 3600, "m": 60, "s": 1, "ms": 0.001}


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

    @settings(max_examples=200, deadline=None)
    @given(parts=st.lists(st.tuples(st.sampled_from(_UNIT_ORDER),
                                    st.decimals(min_value=0, max_value=999, places=2)),
                          min_size=1, max_size=5, unique_by=lambda part: part[0]),
           spaced=st.booleans())
    def test_a_string_of_distinct_units_largest_first_is_their_sum(
            self, parts: list[tuple[str, Any]], spaced: bool) -> None:
        parts.sort(key=lambda part: _UNIT_ORDER.index(part[0]))
        text = (" " if spaced else "").join(f"{number}{unit}" for unit, number in parts)
        seconds = sum(float(number) * _UNIT_SECONDS[unit] for unit, number in parts)
        assume(seconds > 0)
        assert parse_duration(text) == pytest.approx(seconds), text

    @pytest.mark.parametrize("bad", [
        "5m5m", "1s1s", "30s1m", "1m1h", "500ms1s", "1h1d",  # a unit twice, or out of order
        "\u0665m", "1\u0660s", "\uff15s", "\u0665",  # digits of other scripts
        "1_000", "1_0s", "1 0s", "1. 5s", "5 m 5",  # not one ASCII number per part
    ])
    def test_a_string_that_says_a_duration_two_ways_is_a_value_error(self, bad: str) -> None:
        with pytest.raises(ValueError, match="duration"):
            parse_duration(bad)

    @pytest.mark.parametrize("text", [".5s", "5.s", "1h.5m", "0.5s"])
    def test_a_number_may_start_or_end_with_its_point_as_in_go(self, text: str) -> None:
        expected = {".5s": 0.5, "5.s": 5.0, "1h.5m": 3630.0, "0.5s": 0.5}[text]
        assert parse_duration(text) == pytest.approx(expected)

    def test_a_long_malformed_string_is_refused_in_linear_time(self) -> None:
        # A quadratic scan takes minutes on this (4.9 s at 16,000 characters); a linear one
        # milliseconds. Run apart, so that a slow scan fails instead of stalling the suite.
        script = ("import queen_sync as qs\n"
                  "for text in ['1' * 300_000 + 'x', '1s' + '9' * 300_000, "
                  "'1' * 300_000 + 'm' * 3]:\n"
                  "    try:\n        qs.parse_duration(text)\n    except ValueError:\n"
                  "        pass\n    else:\n        raise SystemExit('accepted')\n")
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                              timeout=120, check=False)
        assert done.returncode == 0, done.stderr

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

    def test_a_fractional_lifetime_is_rounded_up_on_the_wire(
            self, faulty_mq: qs.Queen, sqlite_faults: FaultyEngine) -> None:
        sent: list[Mapping[str, Any]] = []
        sqlite_faults.hook_next(None, hook=lambda route, body: sent.append(body))
        lock = faulty_mq.lock("job", ttl=1.2)
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


SUB_SECOND: list[Any] = [0.5, 0.999, "999ms", "10ms", timedelta(milliseconds=500), 1e-9]


class TestTheMinimumLeaseLifetime:
    def test_the_minimum_is_one_second_by_a_named_constant(self) -> None:
        assert MIN_TTL_SECONDS == 1.0, "docs and errors promise a one-second minimum"

    @pytest.mark.parametrize("ttl", SUB_SECOND)
    def test_a_lease_shorter_than_a_second_is_refused_by_every_call_that_takes_one(
        self, q: qs.Queen, ttl: Any
    ) -> None:
        calls: dict[str, Callable[[], Any]] = {
            "lock": lambda: q.lock("job", ttl=ttl),
            "semaphore": lambda: q.semaphore("pool", 2, ttl=ttl),
            "locks.acquire": lambda: q.locks.acquire("job", ttl=ttl),
            "locks.renew": lambda: q.locks.renew("job", token=1, ttl=ttl),
            "singleton_job": lambda: qs.singleton_job("job", ttl=ttl, client=q),
        }
        for what, call in calls.items():
            with pytest.raises(ValueError, match="at least 1 second") as refused:
                call()
            assert repr(ttl) in str(refused.value), f"{what}: name the value: {refused.value}"
        assert not q.locks.get("job") and not q.locks.get("pool"), "nothing may be sent"

    @pytest.mark.parametrize("ttl", [1, 1.0, "1s", "1000ms", timedelta(seconds=1), "1.5s"])
    def test_a_lease_of_at_least_the_minimum_is_taken(self, q: qs.Queen, ttl: Any) -> None:
        lock = q.lock("job", ttl=ttl)
        assert lock.acquire(), f"ttl={ttl!r} is at least the minimum"
        assert q.locks.acquire("raw", ttl=ttl), f"the raw wire takes ttl={ttl!r} too"
        lock.release()

    @settings(max_examples=200, deadline=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(seconds=st.floats(min_value=0.001, max_value=3))
    def test_a_lease_is_accepted_exactly_when_it_lasts_at_least_the_minimum(
        self, q: qs.Queen, seconds: float
    ) -> None:
        spellings = (seconds, f"{seconds:.4f}s", f"{seconds * 1000:.1f}ms",
                     timedelta(seconds=seconds))
        for ttl in spellings:
            expected = parse_duration(ttl) >= MIN_TTL_SECONDS
            try:
                q.lock("job", ttl=ttl)
                accepted = True
            except ValueError:
                accepted = False
            assert accepted == expected, f"ttl={ttl!r}: accepted={accepted}"

    def test_the_notebook_magic_refuses_it_in_its_own_words(self, sqlite_url: str) -> None:
        from queen_sync._front.magic import run_locked_cell

        with pytest.raises(ValueError, match=r"^%%lock: --ttl: a lease must last at least 1 s"):
            run_locked_cell(object(), f"job --ttl 500ms --url {sqlite_url}", "pass")

    def test_a_key_value_expiry_below_a_second_is_no_lease_and_is_accepted(
        self, q: qs.Queen
    ) -> None:
        assert q.kv.put("app", "k", 1, ttl="100ms"), "data expiry is not a lease lifetime"
        assert q.kv.get("app", "k")["found"], "rounded up to the wire's whole second"


class TestTheShortestRenewInterval:
    def test_the_floor_is_a_third_of_the_shortest_lease_by_a_named_constant(self) -> None:
        from queen_sync._durations import MIN_RENEW_EVERY_SECONDS

        assert MIN_RENEW_EVERY_SECONDS == MIN_TTL_SECONDS / 3, (
            "the floor is how often the renewer renews the shortest lease by default")

    @pytest.mark.parametrize("every", ["1ms", 1e-9, "10ms", 0.3, timedelta(milliseconds=100)])
    def test_a_renew_interval_below_the_floor_is_refused_naming_the_value(
        self, q: qs.Queen, every: Any
    ) -> None:
        calls: dict[str, Callable[[], Any]] = {
            "lock": lambda: q.lock("job", ttl="1s", renew_every=every),
            "semaphore": lambda: q.semaphore("pool", 2, ttl="1m", renew_every=every),
        }
        for what, call in calls.items():
            with pytest.raises(ValueError, match=r"renew_every must be at least 0\.333s") as no:
                call()
            assert repr(every) in str(no.value), f"{what}: name the value: {no.value}"
        assert not q.locks.get("job") and not q.locks.get("pool"), "nothing may be sent"

    @settings(max_examples=200, deadline=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(every=st.floats(min_value=1e-6, max_value=3), ttl=st.floats(min_value=1, max_value=4))
    def test_a_renew_interval_is_accepted_exactly_from_the_floor_up_to_the_lifetime(
        self, q: qs.Queen, every: float, ttl: float
    ) -> None:
        from queen_sync._durations import MIN_RENEW_EVERY_SECONDS

        expected = MIN_RENEW_EVERY_SECONDS <= every < ttl
        try:
            lock = q.lock("job", ttl=ttl, renew_every=every)
        except ValueError:
            accepted = False
        else:
            accepted = lock.renew_every == every
        assert accepted == expected, f"ttl={ttl!r}, renew_every={every!r}: accepted={accepted}"

    def test_the_default_interval_of_the_shortest_lease_meets_the_floor(self, q: qs.Queen) -> None:
        lock = q.lock("job", ttl=MIN_TTL_SECONDS)
        assert lock.renew_every == MIN_TTL_SECONDS / 3, f"default: a third, {lock.renew_every}"


class TestNamesAndNumbers:
    @pytest.mark.parametrize("name", ["", "a#1", "bell\x07", "x" * 257, "é" * 129])
    def test_bad_lock_names_are_value_errors(self, q: qs.Queen, name: str) -> None:
        with pytest.raises(ValueError):
            q.lock(name, ttl=5)

    @pytest.mark.parametrize("what", ["name", "owner"])
    def test_a_name_or_owner_that_is_not_utf8_is_refused_as_such(self, q: qs.Queen,
                                                                  what: str) -> None:
        text = b"job-\xff".decode("utf-8", "surrogateescape")  # as a Latin-1 file name arrives
        kwargs: dict[str, Any] = {"owner": text} if what == "owner" else {}
        with pytest.raises(qs.RequestError, match=r"is not valid UTF-8$") as refused:
            q.lock(text if what == "name" else "job", ttl=5, **kwargs)
        assert "codec" not in str(refused.value), f"a raw codec error: {refused.value}"

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


_JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                     lambda inner: st.lists(inner, max_size=3)
                     | st.dictionaries(st.text(max_size=5), inner, max_size=3), max_leaves=6)
_KV_FIELDS = ["op", "ns", "key", "keys", "prefix", "value", "ttlSeconds", "forever", "expect",
              "required", "delta", "min", "max", "after", "limit", "keysOnly"]
_LOCK_FIELDS = ["op", "name", "ttlSeconds", "owner", "limit", "token", "slot"]


def _raw_ops(fields: list[str], kinds: list[str]) -> st.SearchStrategy[dict[str, Any]]:
    """Ops whose fields hold any JSON value, the ``op`` field a known kind or anything."""
    return st.fixed_dictionaries(
        {"op": st.sampled_from(kinds) | _JSON},
        optional={field: _JSON for field in fields if field != "op"})


class TestRawOpsOfAnyShape:
    """A raw op, however malformed, is refused with a typed error naming what is wrong; no
    Python error of the checks' own (an unhashable list, a missing key) escapes."""

    @settings(max_examples=300, deadline=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(op=_raw_ops(_KV_FIELDS, ["get", "getMany", "getPrefix", "put", "putIfAbsent",
                                    "delete", "incr", "check"]))
    @example(op={"op": ["get"], "ns": "n", "key": "k"})
    @example(op={"op": {"get": 1}, "ns": "n", "key": "k"})
    def test_a_kv_batch_refuses_it_or_answers(self, q: qs.Queen, op: dict[str, Any]) -> None:
        try:
            q.kv.batch([op])
        except (qs.RequestError, TypeError, ValueError) as exc:
            assert "unhashable" not in str(exc) and str(exc), f"{op}: {exc!r}"

    @settings(max_examples=300, deadline=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(op=_raw_ops(_LOCK_FIELDS, ["acquire", "renew", "release", "get"]))
    @example(op={"op": ["acquire"], "name": "job", "ttlSeconds": 5})
    def test_a_lock_batch_refuses_it_or_answers(self, q: qs.Queen, op: dict[str, Any]) -> None:
        try:
            q.locks.batch([op])
        except (qs.RequestError, TypeError, ValueError) as exc:
            assert "unhashable" not in str(exc) and str(exc), f"{op}: {exc!r}"


class TestFlagsAreBools:
    """A flag given a str or a number is refused, not read by its truth ("no" is true)."""

    @pytest.mark.parametrize("flag", ["no", 1, 0, None, "false"])
    @pytest.mark.parametrize("call", [
        lambda q, flag: q.kv.put("n", "k", 1, forever=True, required=flag),
        lambda q, flag: q.kv.put_if_absent("n", "k", 1, forever=True, required=flag),
        lambda q, flag: q.kv.delete("n", "k", required=flag),
        lambda q, flag: q.kv.incr("n", "k", forever=True, required=flag),
        lambda q, flag: q.kv.check("n", "k", expect=0, required=flag),
        lambda q, flag: q.kv.get_prefix("n", "k", keys_only=flag),
        lambda q, flag: q.kv.list_all("n", "k", keys_only=flag),
        lambda q, flag: q.transaction().kv.put("n", "k", 1, forever=True, required=flag),
        lambda q, flag: q.kv.op.put("n", "k", 1, forever=True, required=flag),
    ], ids=["put", "putIfAbsent", "delete", "incr", "check", "get_prefix", "list_all",
            "transaction put", "op.put"])
    def test_a_flag_that_is_not_a_bool_is_a_type_error_and_writes_nothing(
            self, q: qs.Queen, call: Callable[[qs.Queen, Any], Any], flag: Any) -> None:
        with pytest.raises(TypeError, match=r"(required|keys_only) must be True or False"):
            call(q, flag)
        assert not q.kv.get("n", "k"), "a refused call wrote"


class TestTheKeysOfAGetMany:
    """One str is not a list of keys: read as one, "config" would ask for c, o, n, f, i, g."""

    @pytest.mark.parametrize("keys", ["config", b"config", {"config": 1}],
                             ids=["str", "bytes", "dict"])
    @pytest.mark.parametrize("call", [
        lambda q, keys: q.kv.get_many("n", keys),
        lambda q, keys: q.kv.op.get_many("n", keys),
        lambda q, keys: q.transaction().kv.get_many("n", keys),
    ], ids=["kv", "op", "transaction"])
    def test_one_str_or_a_mapping_is_a_type_error_naming_it(
            self, q: qs.Queen, call: Callable[[qs.Queen, Any], Any], keys: Any) -> None:
        q.kv.put("n", "g", "an unrelated key", forever=True)
        with pytest.raises(TypeError, match="keys must be"):
            call(q, keys)

    def test_a_list_or_a_tuple_of_keys_is_read_as_those_keys(self, q: qs.Queen) -> None:
        q.kv.put("n", "config", 1, forever=True)
        keys: Sequence[str]
        for keys in (("config", "other"), ["config", "other"]):
            answer = q.kv.get_many("n", keys)
            assert [row["key"] for row in answer["rows"]] == ["config"], answer
            assert answer["missing"] == ["other"], answer
