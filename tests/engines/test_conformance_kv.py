"""Key/value semantics every engine keeps (DESIGN §4, /api/v1/kv)."""

from __future__ import annotations

import itertools
import time
from typing import Any, Callable

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import queen_sync as qs
from queen_sync._durations import MAX_TTL_SECONDS
from queen_sync._ops import MAX_VALUE_DEPTH
from queen_sync.testing import FaultyEngine

_NAMESPACES = itertools.count()


class TestReads:
    def test_a_written_key_reads_back_with_its_version_and_times(self, q: qs.Queen) -> None:
        put = q.kv.put("app", "k", {"a": 1}, ttl="1h")
        got = q.kv.get("app", "k")
        assert got and got["value"] == {"a": 1} and got["version"] == put["version"], got
        assert got["expiresAt"] > got["updatedAt"] > 0, got
        assert got["index"] == 0 and got["key"] == "k", got

    def test_a_missing_key_is_not_found_and_differs_from_a_stored_null(self, q: qs.Queen) -> None:
        q.kv.put("app", "null", None, forever=True)
        stored, missing = q.kv.get("app", "null"), q.kv.get("app", "nope")
        assert stored and stored["found"] is True and stored["value"] is None, stored
        assert not missing and missing["found"] is False, missing
        assert stored["expiresAt"] is None, "a forever row has no expiry"

    def test_get_many_splits_rows_and_missing_keys(self, q: qs.Queen) -> None:
        q.kv.put("app", "a", 1, forever=True)
        q.kv.put("app", "c", 3, forever=True)
        got = q.kv.get_many("app", ["a", "b", "c"])
        assert [r["key"] for r in got["rows"]] == ["a", "c"], got
        assert got["missing"] == ["b"], got

    def test_get_prefix_matches_literally_in_key_order_and_pages(self, q: qs.Queen) -> None:
        for key in ["p%_3", "p%_1", "p%_2", "pX_9", "q"]:
            q.kv.put("app", key, key, forever=True)
        page = q.kv.get_prefix("app", "p%_", limit=2)
        assert [r["key"] for r in page["rows"]] == ["p%_1", "p%_2"], page
        assert page["truncated"] is True and page["nextAfter"] == "p%_2", page
        rest = q.kv.get_prefix("app", "p%_", after=page["nextAfter"])
        assert [r["key"] for r in rest["rows"]] == ["p%_3"] and not rest["truncated"], rest
        keys = q.kv.get_prefix("app", "p", keys_only=True)
        assert all("value" not in r for r in keys["rows"]), keys
        assert [r["key"] for r in q.kv.list_all("app", "p")] == ["p%_1", "p%_2", "p%_3", "pX_9"]

    def test_every_result_of_a_batch_carries_its_index(self, q: qs.Queen) -> None:
        op = q.kv.op
        answers = q.kv.batch([op.put("app", "a", 1, forever=True), op.get("app", "a"),
                              op.get("app", "zz")])
        assert [a["index"] for a in answers] == [0, 1, 2], answers


class TestConditionalWrites:
    def test_put_with_a_matching_expect_applies(self, q: qs.Queen) -> None:
        first = q.kv.put("app", "k", 1, forever=True)
        second = q.kv.put("app", "k", 2, forever=True, expect=first["version"])
        assert second and second["version"] > first["version"], second

    def test_put_with_a_stale_expect_loses_and_reports_the_current_row(self, q: qs.Queen) -> None:
        first = q.kv.put("app", "k", 1, forever=True)
        q.kv.put("app", "k", 2, forever=True)
        lost = q.kv.put("app", "k", 3, forever=True, expect=first["version"])
        assert not lost and lost["reason"] == "version" and lost["value"] == 2, lost
        assert q.kv.get("app", "k")["value"] == 2, "the losing write changed nothing"

    def test_expect_on_an_absent_key_creates_nothing(self, q: qs.Queen) -> None:
        lost = q.kv.put("app", "ghost", 1, forever=True, expect=5)
        assert not lost and lost["reason"] == "absent", lost
        assert not q.kv.get("app", "ghost"), "expect must never create a key"

    def test_put_if_absent_lets_the_first_writer_win(self, q: qs.Queen) -> None:
        first = q.kv.put_if_absent("app", "k", "first", forever=True)
        second = q.kv.put_if_absent("app", "k", "second", forever=True)
        assert first and not second, (first, second)
        assert second["reason"] == "exists" and second["value"] == "first", second
        assert second["version"] == first["version"], second

    def test_delete_reports_absent_and_version_mismatch(self, q: qs.Queen) -> None:
        put = q.kv.put("app", "k", 1, forever=True)
        assert not q.kv.delete("app", "k", expect=put["version"] + 100)
        assert q.kv.delete("app", "k", expect=put["version"])
        absent = q.kv.delete("app", "k")
        assert not absent and absent["reason"] == "absent", absent

    def test_check_asserts_a_version_and_writes_nothing(self, q: qs.Queen) -> None:
        assert q.kv.check("app", "k", expect=0), "expect 0 holds while the key is absent"
        put = q.kv.put("app", "k", 1, forever=True)
        assert q.kv.check("app", "k", expect=put["version"])
        stale = q.kv.check("app", "k", expect=put["version"] + 100)
        assert not stale and stale["reason"] == "version", stale
        assert q.kv.get("app", "k")["version"] == put["version"], "check wrote something"

    def test_check_for_absence_on_a_present_key_answers_exists_with_the_row(
        self, q: qs.Queen
    ) -> None:
        put = q.kv.put("app", "k", "here", forever=True)
        present = q.kv.check("app", "k", expect=0)
        assert not present and present["reason"] == "exists", (
            f"'must not exist' lost to a present key: the broker says exists: {present}")
        assert present["version"] == put["version"] and present["value"] == "here", present
        absent = q.kv.check("app", "gone", expect=put["version"])
        assert not absent and absent["reason"] == "absent", absent

    def test_put_and_delete_with_expect_zero_mean_the_key_must_not_exist(
        self, q: qs.Queen
    ) -> None:
        created = q.kv.put("app", "k", "first", forever=True, expect=0)
        assert created and created["value"] == "first", f"expect 0 creates an absent key: {created}"
        again = q.kv.put("app", "k", "second", forever=True, expect=0)
        assert not again and again["reason"] == "exists", again
        assert again["value"] == "first" and again["version"] == created["version"], again
        refused = q.kv.delete("app", "k", expect=0)
        assert not refused and refused["reason"] == "exists", refused
        assert q.kv.get("app", "k")["value"] == "first", "a lost expect 0 changed the key"
        absent = q.kv.delete("app", "none", expect=0)
        assert not absent and absent["reason"] == "absent", f"nothing to delete: {absent}"

    @pytest.mark.parametrize("value", [{"a": [1, None]}, None, "text"])
    def test_an_applied_put_or_put_if_absent_answers_the_value_it_wrote(
        self, q: qs.Queen, value: Any
    ) -> None:
        created = q.kv.put_if_absent("app", "k", value, forever=True)
        assert created and created["value"] == value and created["version"] > 0, created
        updated = q.kv.put("app", "k", [value], forever=True, expect=created["version"])
        assert updated and updated["value"] == [value], updated
        assert updated["version"] > created["version"], updated
        answer = q.transaction().kv.put("app", "t", value, forever=True).commit()
        (written,) = answer["kv"]
        assert written["applied"] and written["value"] == value, (
            f"a bundle's applied put answers its value too: {answer}")

    def test_write_versions_and_lock_tokens_share_one_rising_counter(self, q: qs.Queen) -> None:
        lock = q.locks.acquire("job", ttl_seconds=30)
        put = q.kv.put("app", "k", 1, forever=True)
        again = q.locks.acquire("other", ttl_seconds=30)
        assert lock["token"] < put["version"] < again["token"], (lock, put, again)


def _nested(depth: int) -> Any:
    value: Any = "leaf"
    for level in range(depth):
        value = [value] if level % 2 else {"k": value}
    return value


def _store_of(q: qs.Queen, ns: str) -> list[tuple[str, Any, int]]:
    return [(r["key"], r["value"], r["version"]) for r in q.kv.list_all(ns, "k")]


def _write_op(q: qs.Queen, ns: str, kind: str, key: str, n: int) -> dict[str, Any]:
    op = q.kv.op
    if kind == "put":
        return op.put(ns, key, n, forever=True)
    if kind == "putIfAbsent":
        return op.put_if_absent(ns, key, n, forever=True)
    if kind == "incr":
        return op.incr(ns, key, delta=n, forever=True)
    if kind == "delete":
        return op.delete(ns, key)
    return op.get(ns, key)


_OPS = st.lists(st.tuples(st.sampled_from(["put", "putIfAbsent", "incr", "delete", "get"]),
                          st.sampled_from(["k0", "k1", "k2"]), st.integers(-5, 5)),
                max_size=5)


class TestRequiredInBatches:
    def test_a_required_op_that_loses_writes_nothing_of_its_batch(self, q: qs.Queen) -> None:
        op = q.kv.op
        q.kv.put("app", "taken", "x", forever=True)
        answers = q.kv.batch([op.put("app", "a", 1, forever=True),
                              op.put_if_absent("app", "taken", "y", forever=True, required=True),
                              op.put("app", "b", 2, forever=True)])
        assert not q.kv.get("app", "a") and not q.kv.get("app", "b"), (
            f"a batch whose required op lost must write nothing: {answers}")
        assert q.kv.get("app", "taken")["value"] == "x", "the losing op changed its key"
        failed = answers[1]
        assert not failed and failed["reason"] == "exists" and failed["value"] == "x", failed
        assert failed["failedIndex"] == 1 and failed["version"] > 0, failed
        for i in (0, 2):
            assert answers[i] == {"index": i, "applied": False, "reason": "rolled_back",
                                  "failedIndex": 1}, answers

    def test_a_required_op_that_applies_lets_the_batch_apply(self, q: qs.Queen) -> None:
        op = q.kv.op
        answers = q.kv.batch([op.check("app", "a", expect=0, required=True),
                              op.put("app", "a", 1, forever=True)])
        assert all(answers) and "failedIndex" not in answers[1], answers
        assert q.kv.get("app", "a")["value"] == 1, "the gated write must land"

    def test_a_single_required_op_answers_as_a_batch_of_one_would(self, q: qs.Queen) -> None:
        put = q.kv.put("app", "k", "v", forever=True)
        answers = {
            "delete": q.kv.delete("app", "gone", required=True),
            "check": q.kv.check("app", "k", expect=0, required=True),
            "put": q.kv.put("app", "k", "w", forever=True, expect=put["version"] + 9,
                            required=True),
        }
        reasons = {kind: (a["applied"], a["reason"], a["failedIndex"])
                   for kind, a in answers.items()}
        assert reasons == {"delete": (False, "absent", 0), "check": (False, "exists", 0),
                           "put": (False, "version", 0)}, answers
        assert q.kv.get("app", "k")["version"] == put["version"], "a lost op wrote something"
        applied = q.kv.check("app", "k", expect=put["version"], required=True)
        assert applied and "failedIndex" not in applied, applied

    @settings(max_examples=25, deadline=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(before=_OPS, after=_OPS, seed=_OPS)
    def test_random_batches_with_a_losing_required_op_never_change_the_store(
        self, q: qs.Queen, before: list[tuple[str, str, int]],
        after: list[tuple[str, str, int]], seed: list[tuple[str, str, int]],
    ) -> None:
        ns = f"prop{next(_NAMESPACES)}"
        q.kv.batch([_write_op(q, ns, *spec) for spec in seed] or [q.kv.op.get(ns, "k0")])
        stored = _store_of(q, ns)
        ops = [_write_op(q, ns, *spec) for spec in before]
        ops.append(q.kv.op.check(ns, "k9", expect=10**9, required=True))
        ops += [_write_op(q, ns, *spec) for spec in after]
        answers = q.kv.batch(ops)
        assert _store_of(q, ns) == stored, f"the batch changed the store: {ops} -> {answers}"
        k = len(before)
        assert [a["index"] for a in answers] == list(range(len(ops))), answers
        assert answers[k]["reason"] == "absent" and answers[k]["failedIndex"] == k, answers
        others = [a for i, a in enumerate(answers) if i != k]
        assert all(a["reason"] == "rolled_back" and a["failedIndex"] == k for a in others), (
            answers)



# Required ops that lose to what the ops before them in their batch did, or to the store:
# the stale ones always lose, the "must be absent" ones lose where the key is present.
_LOSERS = st.sampled_from(["check stale", "put stale", "check absent", "putIfAbsent"])


def _loser(q: qs.Queen, ns: str, kind: str, key: str) -> dict[str, Any]:
    op = q.kv.op
    if kind == "put stale":
        return op.put(ns, key, "late", forever=True, expect=10**9, required=True)
    if kind == "putIfAbsent":
        return op.put_if_absent(ns, key, "late", forever=True, required=True)
    return op.check(ns, key, expect=0 if kind == "check absent" else 10**9, required=True)


class TestRolledBackAnswers:
    """A rolled-back batch reports each key as the store holds it, never a row it undid."""

    def test_a_check_losing_to_its_own_batch_reports_the_key_as_stored(
            self, q: qs.Queen) -> None:
        op = q.kv.op
        answers = q.kv.batch([op.put("app", "k", "mine", forever=True),
                              op.check("app", "k", expect=0, required=True)])
        failed = answers[1]
        assert not failed and failed["reason"] == "exists", answers
        assert not q.kv.get("app", "k"), f"the batch was rolled back: {answers}"
        assert (failed["version"], failed["value"]) == (0, None), (
            f"the key is absent, yet the failed op reported the row its batch undid: {failed}")

    def test_a_version_a_rolled_back_batch_reported_is_never_issued_again(
            self, q: qs.Queen) -> None:
        op = q.kv.op
        answers = q.kv.batch([op.put("app", "k", "mine", forever=True),
                              op.check("app", "k", expect=0, required=True)])
        reported = answers[1]["version"]
        other = q.kv.put("app", "k", "someone else's", forever=True)
        assert other["version"] != reported, (
            f"version {reported}, from the rolled-back batch {answers}, was issued again: "
            f"{other}")
        clobber = q.kv.put("app", "k", "clobber", forever=True, expect=reported)
        assert not clobber, (f"a put expecting version {reported}, seen only in a rolled-back "
                             f"answer, overwrote a value its caller never saw: {clobber}")

    @settings(max_examples=30, deadline=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(seed=_OPS, before=_OPS, loser=_LOSERS, key=st.sampled_from(["k0", "k1"]))
    def test_a_losing_required_op_reports_its_key_as_committed_whatever_came_before(
        self, q: qs.Queen, seed: list[tuple[str, str, int]],
        before: list[tuple[str, str, int]], loser: str, key: str,
    ) -> None:
        ns = f"undo{next(_NAMESPACES)}"
        q.kv.batch([_write_op(q, ns, *spec) for spec in seed] or [q.kv.op.get(ns, "k0")])
        stored = _store_of(q, ns)
        ops = [_write_op(q, ns, *spec) for spec in before] + [_loser(q, ns, loser, key)]
        answers = q.kv.batch(ops)
        failed = answers[-1]
        assume(not failed)  # a "must be absent" op on an absent key applies: nothing undone
        assert _store_of(q, ns) == stored, f"the batch changed the store: {ops} -> {answers}"
        row = q.kv.get(ns, key)
        committed = (row["version"], row["value"]) if row else (0, None)
        assert (failed["version"], failed["value"]) == committed, (
            f"the failed op reported {failed}, the store holds {committed}: {ops}")

class TestIncr:
    def test_incr_creates_then_adds(self, q: qs.Queen) -> None:
        assert q.kv.incr("app", "n", delta=5, forever=True)["value"] == 5
        assert q.kv.incr("app", "n", delta=-2, forever=True)["value"] == 3

    def test_incr_past_max_refuses_without_spending_even_the_first_write(self, q: qs.Queen) -> None:
        first = q.kv.incr("app", "n", delta=3, max=2, forever=True)
        assert not first and first["reason"] == "limit", first
        assert not q.kv.get("app", "n"), "a refused first write must create nothing"
        q.kv.incr("app", "n", delta=2, max=2, forever=True)
        over = q.kv.incr("app", "n", delta=1, max=2, forever=True)
        assert not over and over["reason"] == "limit" and over["value"] == 2, over
        assert q.kv.get("app", "n")["value"] == 2, "a refused incr spent something"
        under = q.kv.incr("app", "n", delta=-3, min=0, forever=True)
        assert not under and under["reason"] == "limit", under

    def test_incr_on_a_live_non_number_is_a_type_error_result(self, q: qs.Queen) -> None:
        q.kv.put("app", "s", "text", forever=True)
        lost = q.kv.incr("app", "s", forever=True)
        assert not lost and lost["reason"] == "type", lost

    def test_incr_keeps_the_lifetime_it_was_created_with(self, q: qs.Queen) -> None:
        created = q.kv.incr("app", "window", ttl_seconds=60)
        expires = q.kv.get("app", "window")["expiresAt"]
        q.kv.incr("app", "window", ttl_seconds=3600)
        assert q.kv.get("app", "window")["expiresAt"] == expires, "TTL is create-only"
        assert created["value"] == 1


class TestExpiry:
    def test_the_longest_lifetime_is_stored_and_read_back(self, q: qs.Queen) -> None:
        put = q.kv.put("app", "k", 1, ttl_seconds=MAX_TTL_SECONDS)
        got = q.kv.get("app", "k")
        assert put and got["expiresAt"] - got["updatedAt"] == MAX_TTL_SECONDS * 1000, got
        lock = q.locks.acquire("job", ttl_seconds=MAX_TTL_SECONDS)
        assert lock and q.locks.get("job")["holders"][0]["token"] == lock["token"], lock
        assert q.locks.renew("job", token=lock["token"], ttl_seconds=MAX_TTL_SECONDS)

    def test_expired_keys_are_absent_before_any_sweep(self, q: qs.Queen) -> None:
        q.kv.put("app", "k", "old", ttl_seconds=1)
        q.kv.put("app", "s", "text", ttl_seconds=1)
        q.kv.put("app", "p1", 1, ttl_seconds=1)
        time.sleep(1.15)
        assert not q.kv.get("app", "k"), "an expired key must read as absent"
        assert q.kv.get_prefix("app", "p")["rows"] == [], "expired rows must not be listed"
        revived = q.kv.put_if_absent("app", "k", "new", forever=True)
        assert revived and q.kv.get("app", "k")["value"] == "new", revived
        assert not q.kv.put("app", "p1", 2, forever=True, expect=1), "expired counts as absent"
        counted = q.kv.incr("app", "s", delta=2, forever=True)
        assert counted and counted["value"] == 2, f"an expired non-number counts as 0: {counted}"


class TestBadKvOps:
    @pytest.mark.parametrize("ns", ["", "has space", "-lead", "x" * 129])
    def test_a_bad_namespace_is_a_named_bad_request(self, q: qs.Queen, ns: str) -> None:
        with pytest.raises(qs.RequestError) as caught:
            q.kv.get(ns, "k")
        assert caught.value.code == "kv_bad_request", repr(caught.value)

    @pytest.mark.parametrize("key", ["", "new\nline", "k" * 1025])
    def test_a_bad_key_is_a_named_bad_request(self, q: qs.Queen, key: str) -> None:
        with pytest.raises(qs.RequestError) as caught:
            q.kv.put("app", key, 1, forever=True)
        assert caught.value.code == "kv_bad_request", repr(caught.value)

    def test_expect_none_is_a_caller_bug_not_an_unconditional_write(self, q: qs.Queen) -> None:
        with pytest.raises(ValueError, match="expect=None"):
            q.kv.put("app", "k", 1, forever=True, expect=None)
        assert not q.kv.get("app", "k"), "nothing may be written"

    @pytest.mark.parametrize("expiry", [{}, {"ttl": 5, "forever": True}, {"ttl_seconds": 0},
                                        {"ttl_seconds": True}, {"ttl": "soon"}])
    def test_a_write_needs_exactly_one_valid_expiry(self, q: qs.Queen, expiry: dict) -> None:  # type: ignore[type-arg]
        with pytest.raises((TypeError, ValueError)):
            q.kv.put("app", "k", 1, **expiry)

    @pytest.mark.parametrize("value", [{1: "a", "1": "b"}, {"x": [{True: 1, "true": 2}]},
                                       {None: 0, "null": 1}, {1.5: 0, "1.5": 1}])
    def test_a_value_whose_keys_collide_as_json_text_is_refused_whole(
            self, q: qs.Queen, value: Any) -> None:
        # As JSON, both keys are one name: one of the two values would be lost unsaid.
        writes: list[Callable[[], Any]] = [
            lambda: q.kv.put("app", "k", value, forever=True),
            lambda: q.transaction().kv.put("app", "k", value, forever=True).commit()]
        for write in writes:
            with pytest.raises(qs.RequestError, match="same JSON key") as caught:
                write()
            assert caught.value.code == "kv_bad_request", repr(caught.value)
        assert not q.kv.get("app", "k"), "nothing may be written"

    def test_a_value_with_distinct_non_text_keys_is_stored_with_text_keys(
            self, q: qs.Queen) -> None:
        assert q.kv.put("app", "k", {1: "a", 2: "b"}, forever=True)
        assert q.kv.get("app", "k")["value"] == {"1": "a", "2": "b"}

    def test_a_value_nested_to_the_limit_is_stored_and_read_back(self, q: qs.Queen) -> None:
        value = _nested(MAX_VALUE_DEPTH)
        assert q.kv.put("app", "deep", value, forever=True), "a value at the limit is stored"
        assert q.kv.get("app", "deep")["value"] == value, "and reads back whole"
        assert q.kv.get_many("app", ["deep"])["rows"][0]["value"] == value
        assert q.transaction().kv.put("app", "deep2", value, forever=True).commit()
        lost = q.kv.put_if_absent("app", "deep", 1, forever=True)
        assert not lost and lost["value"] == value, "a losing write reports the deep value"

    @pytest.mark.parametrize("depth", [MAX_VALUE_DEPTH + 1, 100_000])
    def test_a_value_nested_past_the_limit_is_refused_before_any_io(
            self, faulty_q: qs.Queen, faults: FaultyEngine, depth: int) -> None:
        q = faulty_q
        sent: list[str] = []
        faults.hook_next(None, hook=lambda route, body: sent.append(route))
        for write in (lambda v: q.kv.put("app", "deep", v, forever=True),
                      lambda v: q.transaction().once("app", "deep", value=v, forever=True)):
            with pytest.raises(qs.RequestError, match=f"deeper than {MAX_VALUE_DEPTH}") as caught:
                write(_nested(depth))
            assert caught.value.code == "kv_bad_request", repr(caught.value)
        assert sent == [], f"a builder must refuse it before calling the engine: {sent}"
        with pytest.raises(qs.RequestError, match=f"deeper than {MAX_VALUE_DEPTH}"):
            q.kv.batch([{"op": "putIfAbsent", "ns": "app", "key": "deep", "value": _nested(depth),
                         "forever": True}])
        assert not q.kv.get("app", "deep"), "a raw op is refused before anything is written"

    @pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
    @pytest.mark.parametrize("field", ["delta", "min", "max"])
    def test_a_non_finite_number_in_incr_is_refused_at_the_call(self, q: qs.Queen, bad: float,
                                                               field: str) -> None:
        q.kv.incr("app", "n", delta=1, forever=True)
        limit: dict[str, Any] = {field: bad}
        with pytest.raises(ValueError, match=f"{field} must be a finite number"):
            q.kv.incr("app", "n", forever=True, **limit)
        with pytest.raises(ValueError, match=f"{field} must be a finite number"):
            q.kv.batch([{"op": "incr", "ns": "app", "key": "n", "delta": 1, field: bad,
                         "forever": True}])
        assert q.kv.get("app", "n")["value"] == 1, "the counter is left as it was"

    @pytest.mark.parametrize(("start", "delta"), [(1e308, 1e308), (-1e308, -1e308),
                                                  (10 ** 400, 1.5)],
                             ids=["past the largest float", "past the smallest", "huge int"])
    def test_an_incr_whose_sum_is_no_finite_number_is_refused_whole(
            self, q: qs.Queen, start: float, delta: float) -> None:
        """Only the sum overflows, so only the engine can tell: it refuses the call as it
        refuses a non-finite delta, on every engine, and writes nothing of the batch."""
        q.kv.put("app", "n", start, forever=True)
        before = q.kv.get("app", "n")
        with pytest.raises(qs.RequestError, match="finite number") as caught:
            q.kv.batch([{"op": "put", "ns": "app", "key": "other", "value": 1, "forever": True},
                        {"op": "incr", "ns": "app", "key": "n", "delta": delta,
                         "forever": True}])
        assert caught.value.code == "kv_bad_request", repr(caught.value)
        with pytest.raises(qs.RequestError, match="finite number"):
            q.kv.incr("app", "n", delta=delta, forever=True)
        after = q.kv.get("app", "n")
        assert (after["value"], after["version"]) == (before["value"], before["version"]), after
        assert not q.kv.get("app", "other"), "the batch's other write was kept"

    @pytest.mark.parametrize("required", [True, False])
    @pytest.mark.parametrize("read", [{"op": "get", "key": "k"}, {"op": "getMany", "keys": ["k"]},
                                      {"op": "getPrefix", "prefix": "k"}])
    def test_required_on_a_read_is_refused_before_anything_of_its_batch_is_written(
            self, q: qs.Queen, read: dict[str, Any], required: bool) -> None:
        # A read cannot gate a batch, so a required flag on one is a caller's mistake.
        batch = [{"op": "put", "ns": "app", "key": "w", "value": 1, "forever": True},
                 {**read, "ns": "app", "required": required}]
        with pytest.raises(qs.RequestError, match="required") as caught:
            q.kv.batch(batch)
        assert caught.value.code == "kv_bad_request", repr(caught.value)
        assert not q.kv.get("app", "w"), "the write before the bad read must not be applied"

    def test_a_value_that_is_not_json_is_refused_at_the_call(self, q: qs.Queen) -> None:
        with pytest.raises(TypeError, match="JSON"):
            q.kv.put("app", "k", object(), forever=True)


# Values a caller may hand over that JSON changes: number keys become text, tuples lists.
_JSON_CHANGED = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6), st.text(max_size=5)),
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.tuples(inner, inner),
        st.dictionaries(st.one_of(st.integers(0, 9), st.text("ab", max_size=2)), inner,
                        max_size=3).filter(lambda d: len({str(k) for k in d}) == len(d))),
    max_leaves=8)


class TestAnswersCarryTheStoredJson:
    """An answer's value is the JSON the store keeps, the same on every engine, and never the
    caller's own object (which it could change after the call)."""

    @settings(max_examples=25, deadline=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(value=_JSON_CHANGED)
    def test_put_batch_and_bundle_answers_are_the_json_and_not_the_callers_object(
            self, q: qs.Queen, value: Any) -> None:
        import json

        stored = json.loads(json.dumps(value))
        ns = f"json-{next(_NAMESPACES)}"
        put = q.kv.put(ns, "k", value, forever=True)
        batch = q.kv.batch([q.kv.op.put(ns, "k", value, forever=True), q.kv.op.get(ns, "k")])
        bundle = (q.transaction().kv.put(ns, "k", value, forever=True).kv.get(ns, "k")
                  .commit())
        answered = [put["value"], *(a["value"] for a in batch), *(a["value"] for a in
                                                                 bundle["kv"])]
        for at, seen in enumerate(answered):
            assert seen == stored and json.dumps(seen) == json.dumps(stored), (
                f"answer {at} is not the stored JSON {stored!r}: {seen!r}")
            if isinstance(value, (dict, list)):
                assert seen is not value, f"answer {at} is the caller's own object"
        assert q.kv.get(ns, "k")["value"] == stored

    @pytest.mark.parametrize("how", ["bundle", "batch"])
    @pytest.mark.parametrize("first", ["get", "put", "lost put"])
    def test_two_answers_in_one_call_are_objects_of_their_own(
            self, q: qs.Queen, how: str, first: str) -> None:
        ns = f"json-{next(_NAMESPACES)}"
        q.kv.put(ns, "k", {"a": [1]}, forever=True)
        # Each op written once, for q.kv.op (a batch's op) and a bundle's kv alike.
        ops: dict[str, Callable[[Any], Any]] = {
            "get": lambda kv: kv.get(ns, "k"),
            "put": lambda kv: kv.put(ns, "k", {"a": [1]}, forever=True),
            "lost put": lambda kv: kv.put(ns, "k", {"b": 0}, forever=True, expect=10**9)}
        sent = [ops[first], ops["get"], ops["get"]]
        if how == "bundle":
            txn = q.transaction()
            for add in sent:
                txn = add(txn.kv)
            answers = list(txn.commit()["kv"])
        else:
            answers = list(q.kv.batch([build(q.kv.op) for build in sent]))
        answers[0]["value"]["a"].append(2)
        assert [a["value"] for a in answers[1:]] == [{"a": [1]}] * 2, (
            f"changing one answer changed another: {answers}")
        assert q.kv.get(ns, "k")["value"] == {"a": [1]}, "changing an answer changed the store"
