"""Key/value semantics every engine keeps (DESIGN §4, /api/v1/kv)."""

from __future__ import annotations

import time

import pytest

import queen_sync as qs


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
        wrong = q.kv.check("app", "k", expect=0)
        assert not wrong and wrong["reason"] == "version", wrong
        assert q.kv.get("app", "k")["version"] == put["version"], "check wrote something"

    def test_write_versions_and_lock_tokens_share_one_rising_counter(self, q: qs.Queen) -> None:
        lock = q.locks.acquire("job", ttl_seconds=30)
        put = q.kv.put("app", "k", 1, forever=True)
        again = q.locks.acquire("other", ttl_seconds=30)
        assert lock["token"] < put["version"] < again["token"], (lock, put, again)


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

    def test_a_value_that_is_not_json_is_refused_at_the_call(self, q: qs.Queen) -> None:
        with pytest.raises(TypeError, match="JSON"):
            q.kv.put("app", "k", object(), forever=True)
