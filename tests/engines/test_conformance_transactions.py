"""Guarded transactions every engine keeps: atomic, guards first, failures returned."""

from __future__ import annotations

from typing import Any

import pytest

import queen_sync as qs


class TestBundles:
    def test_a_guarded_bundle_applies_every_write(self, q: qs.Queen) -> None:
        lock = q.lock("job", ttl=30)
        assert lock.acquire()
        answer = (q.transaction().guard(lock)
                  .kv.put("out", "a", 1, forever=True)
                  .kv.incr("out", "n", forever=True)
                  .commit())
        assert answer and answer["success"] is True, answer
        assert q.kv.get("out", "a")["value"] == 1 and q.kv.get("out", "n")["value"] == 1
        lock.release()

    def test_a_lost_required_op_rolls_the_whole_bundle_back(self, q: qs.Queen) -> None:
        q.kv.put("out", "taken", "x", forever=True)
        answer = (q.transaction()
                  .kv.put("out", "a", 1, forever=True)
                  .kv.put_if_absent("out", "taken", "y", forever=True, required=True)
                  .commit())
        assert not answer and answer["reason"] == "kv_precondition", answer
        assert answer["failedIndex"] == 1 and answer["kvReason"] == "exists", answer
        assert answer["value"] == "x" and answer["version"] > 0, answer
        assert not q.kv.get("out", "a"), "the earlier write must be rolled back"

    def test_a_lost_optional_op_does_not_roll_back_the_others(self, q: qs.Queen) -> None:
        q.kv.put("out", "taken", "x", forever=True)
        answer = (q.transaction()
                  .kv.put("out", "a", 1, forever=True)
                  .kv.put_if_absent("out", "taken", "y", forever=True)
                  .commit())
        assert answer, answer
        assert q.kv.get("out", "a")["value"] == 1

    def test_once_commits_the_first_time_only(self, q: qs.Queen) -> None:
        first = q.transaction().once("runs", "2026-11-30", ttl="1d").commit()
        second = q.transaction().once("runs", "2026-11-30", ttl="1d").commit()
        assert first and not second and second["kvReason"] == "exists", (first, second)

    def test_reads_inside_a_bundle_are_refused(self, q: qs.Queen) -> None:
        with pytest.raises(ValueError, match="inside a transaction"):
            q.transaction().kv.get_prefix("out", "a")


class TestGuards:
    def test_a_guard_on_a_lock_not_held_raises_before_sending(self, q: qs.Queen) -> None:
        lock = q.lock("job", ttl=30)
        with pytest.raises(qs.LockNotHeldError):
            q.transaction().guard(lock).kv.put("out", "a", 1, forever=True).commit()
        assert not q.kv.get("out", "a")

    def test_a_guard_lost_to_another_holder_is_returned_and_marks_the_lock_lost(
        self, q: qs.Queen
    ) -> None:
        lock = q.lock("job", ttl=30, auto_renew=False)
        assert lock.acquire()
        q.kv.delete("queen-locks", "job#0")  # an operator's break-glass
        assert q.locks.acquire("job", ttl_seconds=30, owner="intruder")
        answer = q.transaction().guard(lock).kv.put("out", "a", 1, forever=True).commit()
        assert not answer and answer["failedIndex"] == 0, answer
        assert lock.lost.is_set() and lock.lost_reason == "guard", repr(lock)
        assert not q.kv.get("out", "a"), "the fenced write must not land"

    def test_a_guard_that_lost_only_to_its_own_renewal_is_resent(self, q: qs.Queen) -> None:
        lock = q.lock("job", ttl=30, auto_renew=False)
        assert lock.acquire()
        engine = q._engine
        real_call = engine.call
        sent: list[Any] = []

        def renew_first(route: str, body: Any) -> Any:
            if route == "transaction" and not sent:
                assert lock.renew(), "the renew underneath must succeed"
            if route == "transaction":
                sent.append(body["kv"][0]["expect"])
            return real_call(route, body)

        engine.call = renew_first  # type: ignore[method-assign]
        try:
            answer = q.transaction().guard(lock).kv.incr("out", "n", forever=True).commit()
        finally:
            engine.call = real_call  # type: ignore[method-assign]
        assert answer, f"the bundle must commit on the renewed token: {answer}"
        assert len(sent) == 2 and sent[1] > sent[0], f"one resend, new token: {sent}"
        assert not lock.lost.is_set(), "losing to our own renewal is not a loss"
        assert q.kv.get("out", "n")["value"] == 1, "applied exactly once"
