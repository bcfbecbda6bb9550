"""Lock semantics every engine keeps (DESIGN §2 invariants, §4 lock ops)."""

from __future__ import annotations

import time
from typing import Any, Optional

import pytest

import queen_sync as qs

# What an engine's refusal of a call raises, the same on every engine: RequestError (over
# HTTP the broker's 400 answer is also a QueenHttpError, carrying its status).
REFUSED = qs.RequestError


def acquire(q: qs.Queen, name: str, owner: str, *, ttl_seconds: int = 30,
            limit: Optional[int] = None) -> qs.Result:
    return q.locks.acquire(name, ttl_seconds=ttl_seconds, owner=owner, limit=limit)


def guarded(q: qs.Queen, guard: dict[str, Any]) -> qs.Transaction:
    """A bundle opening with ``guard`` as an answer gave it, kept past the handle's belief."""
    return q.transaction().kv.check(guard["ns"], guard["key"], expect=guard["expect"],
                                    required=guard["required"])


class TestAcquire:
    def test_a_free_lock_is_granted_on_slot_zero_with_a_guard(self, q: qs.Queen) -> None:
        answer = acquire(q, "job", "alice")
        assert answer, f"a free lock must be granted: {answer}"
        assert answer["slot"] == 0 and answer["owner"] == "alice", answer
        assert answer["guard"] == {"op": "check", "ns": "queen-locks", "key": "job#0",
                                   "expect": answer["token"], "required": True}, answer
        assert "already" not in answer, "a first grant is not a resend"

    def test_a_held_lock_answers_held_with_the_holder_listed(self, q: qs.Queen) -> None:
        first = acquire(q, "job", "alice")
        second = acquire(q, "job", "bob")
        assert not second and second["reason"] == "held", second
        (holder,) = second["holders"]
        assert holder["owner"] == "alice" and holder["token"] == first["token"], holder
        assert holder["slot"] == 0 and holder["expiresAt"] > holder["since"] > 0, holder
        assert holder["renewedAt"] >= holder["since"], holder

    def test_an_acquire_resent_by_its_owner_answers_the_same_permit(self, q: qs.Queen) -> None:
        first = acquire(q, "job", "alice")
        again = acquire(q, "job", "alice")
        assert again and again.get("already") is True, again
        assert again["token"] == first["token"] and again["slot"] == first["slot"], again

    def test_a_lock_without_an_owner_gets_one_minted(self, q: qs.Queen) -> None:
        answer = q.locks.acquire("job", ttl_seconds=30)
        assert answer and isinstance(answer["owner"], str) and answer["owner"], answer

    def test_ops_in_one_batch_answer_independently_and_in_order(self, q: qs.Queen) -> None:
        acquire(q, "busy", "alice")
        op = q.locks.op
        answers = q.locks.batch([op.acquire("busy", ttl_seconds=5, owner="bob"),
                                 op.acquire("free", ttl_seconds=5, owner="bob"),
                                 op.get("busy")])
        assert [bool(a) for a in answers] == [False, True, True], answers


class TestTokens:
    def test_tokens_strictly_rise_across_release(self, q: qs.Queen) -> None:
        tokens = []
        for _ in range(3):
            answer = acquire(q, "job", "alice")
            tokens.append(answer["token"])
            assert q.locks.release("job", token=answer["token"]), "release must succeed"
        assert tokens == sorted(set(tokens)), f"tokens must strictly rise: {tokens}"

    def test_tokens_are_unique_across_names_and_owners(self, q: qs.Queen) -> None:
        tokens = [acquire(q, f"name-{i}", f"owner-{i}")["token"] for i in range(20)]
        assert len(set(tokens)) == len(tokens), f"two holders shared a token: {tokens}"

    def test_tokens_rise_after_the_permit_row_is_deleted_behind_its_back(self, q: qs.Queen) -> None:
        first = acquire(q, "job", "alice")
        assert q.kv.delete("queen-locks", "job#0"), "the permit row is a KV row"
        second = acquire(q, "job", "bob")
        assert second["token"] > first["token"], (first, second)

    def test_tokens_rise_across_reopening_the_store(self, engine_url: str) -> None:
        with qs.Queen(engine_url) as q1:
            first = acquire(q1, "job", "alice")
            q1.locks.release("job", token=first["token"])
        with qs.Queen(engine_url) as q2:
            second = acquire(q2, "job", "alice")
        assert second["token"] > first["token"], (first, second)

    def test_an_expired_lock_is_free_and_its_next_token_is_higher(self, q: qs.Queen) -> None:
        first = acquire(q, "job", "alice", ttl_seconds=1)
        time.sleep(1.15)
        assert not q.locks.get("job"), "an expired permit is absent before any sweep"
        second = acquire(q, "job", "bob")
        assert second and second["token"] > first["token"], (first, second)
        assert not q.locks.release("job", token=first["token"]), "the expired token frees nothing"


class TestRenew:
    def test_renewing_mints_a_new_token_and_the_old_one_stops_working(self, q: qs.Queen) -> None:
        first = acquire(q, "job", "alice")
        renewed = q.locks.renew("job", token=first["token"], ttl_seconds=30, slot=0)
        assert renewed and renewed["token"] > first["token"], renewed
        assert renewed["guard"]["expect"] == renewed["token"], renewed
        assert not guarded(q, first["guard"]).commit(), "a guard on the old token must fail"
        assert not q.locks.renew("job", token=first["token"], ttl_seconds=30, owner="bob"), (
            "the old token renews nothing for anyone but its owner")
        assert q.locks.get("job")["holders"][0]["token"] == renewed["token"]

    def test_a_renew_resent_with_the_previous_token_by_its_owner_mints_a_higher_token(
        self, q: qs.Queen
    ) -> None:
        first = acquire(q, "job", "alice")
        renewed = q.locks.renew("job", token=first["token"], ttl_seconds=30, owner="alice")
        resent = q.locks.renew("job", token=first["token"], ttl_seconds=30, owner="alice")
        assert resent, f"the owner's resend must renew: {resent}"
        assert resent["token"] > renewed["token"], f"renewing always mints: {renewed} {resent}"
        assert resent["guard"]["expect"] == resent["token"], resent
        assert not guarded(q, renewed["guard"]).commit(), (
            "the token the resend replaced must stop guarding at once")
        holders = q.locks.get("job")["holders"]
        assert [h["token"] for h in holders] == [resent["token"]], holders

    def test_every_resend_of_the_previous_token_by_its_owner_renews_again(
        self, q: qs.Queen
    ) -> None:
        first = acquire(q, "job", "alice")
        tokens = [q.locks.renew("job", token=first["token"], ttl_seconds=30,
                                owner="alice")["token"] for _ in range(3)]
        assert tokens == sorted(set(tokens)) and tokens[0] > first["token"], (
            f"each answer was lost in transit, so each resend must renew and mint: {tokens}")

    def test_the_owner_renews_with_a_token_that_a_late_duplicate_replaced(
        self, q: qs.Queen
    ) -> None:
        first = acquire(q, "job", "alice")
        seen = q.locks.renew("job", token=first["token"], ttl_seconds=30, owner="alice")
        late = q.locks.renew("job", token=first["token"], ttl_seconds=30, owner="alice")
        assert late and late["token"] > seen["token"], (seen, late)
        # The owner adopted the first answer; a duplicate applied after it moved the row on.
        again = q.locks.renew("job", token=seen["token"], ttl_seconds=30, owner="alice")
        assert again and again["token"] > late["token"], f"the owner's token must renew: {again}"
        stale = q.locks.renew("job", token=first["token"], ttl_seconds=30, owner="alice")
        assert not stale and stale["reason"] == "lost", (
            f"a token older than the one the owner last renewed with renews nothing: {stale}")

    def test_a_resent_renew_leaves_the_owners_previous_token_releasing(self, q: qs.Queen) -> None:
        first = acquire(q, "job", "alice")
        for _ in range(2):
            assert q.locks.renew("job", token=first["token"], ttl_seconds=30, owner="alice")
        released = q.locks.release("job", token=first["token"])
        assert released, f"the token the owner last saw must release its permit: {released}"
        assert not q.locks.get("job"), "the permit must be free at once, not at its TTL"

    def test_a_different_owner_with_the_previous_token_is_lost(self, q: qs.Queen) -> None:
        first = acquire(q, "job", "alice")
        q.locks.renew("job", token=first["token"], ttl_seconds=30, owner="alice")
        other = q.locks.renew("job", token=first["token"], ttl_seconds=30, owner="mallory")
        assert not other and other["reason"] == "lost", other
        assert other["holders"][0]["owner"] == "alice", other

    def test_a_stale_token_renews_and_releases_nothing(self, q: qs.Queen) -> None:
        first = acquire(q, "job", "alice")
        q.locks.release("job", token=first["token"])
        second = acquire(q, "job", "bob")
        renew = q.locks.renew("job", token=first["token"], ttl_seconds=30)
        release = q.locks.release("job", token=first["token"])
        assert not renew and renew["reason"] == "lost", renew
        assert not release and release["reason"] == "lost", release
        holders = q.locks.get("job")["holders"]
        assert [h["token"] for h in holders] == [second["token"]], holders


class TestRelease:
    def test_release_frees_the_lock(self, q: qs.Queen) -> None:
        first = acquire(q, "job", "alice")
        assert q.locks.release("job", token=first["token"], slot=0)
        got = q.locks.get("job")
        assert not got and got["holders"] == [], got
        assert acquire(q, "job", "bob"), "a released lock is free"

    def test_the_token_before_a_renew_whose_answer_was_lost_still_releases(
        self, q: qs.Queen
    ) -> None:
        first = acquire(q, "job", "alice")
        renewed = q.locks.renew("job", token=first["token"], ttl_seconds=30, owner="alice")
        assert renewed and renewed["token"] > first["token"], renewed
        released = q.locks.release("job", token=first["token"])
        assert released, f"the owner's previous token must release its permit: {released}"
        assert not q.locks.get("job"), "the permit must be free at once, not at its TTL"

    def test_a_token_older_than_the_previous_one_releases_nothing(self, q: qs.Queen) -> None:
        first = acquire(q, "job", "alice")
        second = q.locks.renew("job", token=first["token"], ttl_seconds=30, owner="alice")
        third = q.locks.renew("job", token=second["token"], ttl_seconds=30, owner="alice")
        stale = q.locks.release("job", token=first["token"])
        assert not stale and stale["reason"] == "lost", stale
        holders = q.locks.get("job")["holders"]
        assert [h["token"] for h in holders] == [third["token"]], holders

    def test_a_renew_resent_after_a_release_with_the_new_token_does_not_revive_it(
        self, q: qs.Queen
    ) -> None:
        first = acquire(q, "job", "alice")
        renewed = q.locks.renew("job", token=first["token"], ttl_seconds=30, owner="alice")
        assert q.locks.release("job", token=renewed["token"]), "the current token releases"
        resent = q.locks.renew("job", token=first["token"], ttl_seconds=30, owner="alice")
        assert not resent and resent["reason"] == "lost", resent
        assert not q.locks.release("job", token=first["token"]), "nothing is left to release"
        assert not q.locks.get("job"), "a released permit must stay released"

    def test_a_released_lock_never_readmits_a_stalled_holders_guarded_write(
        self, q: qs.Queen
    ) -> None:
        first = acquire(q, "job", "alice")
        q.locks.release("job", token=first["token"])
        for _ in range(2):  # once while free, once after a new holder took it
            txn = guarded(q, first["guard"]).kv.put("out", "result", "stale", forever=True)
            answer = txn.commit()
            assert not answer and answer["reason"] == "kv_precondition", answer
            assert answer["failedIndex"] == 0, answer
            assert not q.kv.get("out", "result"), "nothing of the stale bundle may land"
            acquire(q, "job", "bob")


class TestSemaphore:
    def test_a_semaphore_hands_out_the_lowest_free_slot(self, q: qs.Queen) -> None:
        grants = [acquire(q, "pool", f"w{i}", limit=3) for i in range(3)]
        assert [g["slot"] for g in grants] == [0, 1, 2], grants
        full = acquire(q, "pool", "w3", limit=3)
        assert not full and full["reason"] == "held" and len(full["holders"]) == 3, full
        q.locks.release("pool", token=grants[1]["token"], slot=1)
        again = acquire(q, "pool", "w3", limit=3)
        assert again and again["slot"] == 1, again
        slots = [h["slot"] for h in q.locks.get("pool")["holders"]]
        assert slots == [0, 1, 2], f"holders are listed by slot: {slots}"

    def test_the_permit_row_is_readable_through_kv(self, q: qs.Queen) -> None:
        grant = acquire(q, "pool", "w0", limit=2)
        row = q.kv.get("queen-locks", "pool#0")
        assert row and row["version"] == grant["token"], row
        assert row["value"] == {"owner": "w0", "limit": 2}, row

    @pytest.mark.parametrize(("held", "asked"), [(1, 3), (3, 1), (3, 2)])
    def test_a_name_held_with_one_limit_refuses_an_acquire_with_another(
        self, q: qs.Queen, held: int, asked: int
    ) -> None:
        first = acquire(q, "job", "alice", limit=held)
        with pytest.raises(REFUSED) as caught:
            acquire(q, "job", "bob", limit=asked)
        error = caught.value
        assert error.code == "lock_limit_mismatch", repr(error)
        assert f"limit {held}" in str(error) and f"limit {asked}" in str(error), str(error)
        holders = q.locks.get("job")["holders"]
        assert [h["token"] for h in holders] == [first["token"]], f"nothing changed: {holders}"

    def test_a_lock_handle_and_a_semaphore_handle_cannot_share_a_name(self, q: qs.Queen) -> None:
        lock = q.lock("job", ttl=30)
        assert lock.acquire()
        with pytest.raises(REFUSED, match=r"limit 1.*limit 3"):
            q.semaphore("job", 3, ttl=30).acquire()
        assert lock.held and len(q.locks.get("job")["holders"]) == 1, "the lock stays alone"
        lock.release()
        assert q.semaphore("job", 3, ttl=30).acquire(), "a free name takes any limit"

    def test_a_permit_row_that_records_no_limit_refuses_nobody(self, q: qs.Queen) -> None:
        q.kv.put("queen-locks", "job#0", {"owner": "old"}, ttl_seconds=30)
        grant = acquire(q, "job", "bob", limit=3)
        assert grant and grant["slot"] == 1, grant


class TestRowsWrittenByHandIntoThePermitNamespace:
    """``queen-locks`` is an ordinary namespace: a KV write can put anything there."""

    @pytest.mark.parametrize("value", ["junk", {"owner": 5}, {"owner": None}, [1], None,
                                       {"owner": "old", "limit": "three"}])
    def test_a_row_that_is_no_permit_holds_its_slot_for_an_unknown_owner(
        self, q: qs.Queen, value: Any
    ) -> None:
        q.kv.put("queen-locks", "job#0", value, ttl_seconds=30)
        owner = value.get("owner") if isinstance(value, dict) else None
        owner = owner if isinstance(owner, str) else None
        refused = acquire(q, "job", "bob")
        assert not refused and refused["reason"] == "held", refused
        assert [(h["slot"], h["owner"]) for h in refused["holders"]] == [(0, owner)], refused
        lock = q.lock("job", ttl=30)
        assert not lock.acquire(), "the slot is taken"
        assert [(h.slot, h.owner) for h in lock.holders] == [(0, owner)], lock.holders
        grant = acquire(q, "job", "bob", limit=2)
        assert grant and grant["slot"] == 1, grant

    def test_keys_that_name_no_slot_hold_nothing(self, q: qs.Queen) -> None:
        for key in ("job#", "job#x", "job#-1", "job#01", "job#1024", "job#" + "9" * 30):
            q.kv.put("queen-locks", key, {"owner": "planted"}, ttl_seconds=30)
        grant = acquire(q, "job", "bob")
        assert grant and grant["slot"] == 0, grant
        assert [h["owner"] for h in q.locks.get("job")["holders"]] == ["bob"]


class TestBadLockOps:
    @pytest.mark.parametrize("name", ["", "a#b", "tab\there", "x" * 257])
    def test_a_bad_name_is_refused_at_the_call(self, q: qs.Queen, name: str) -> None:
        with pytest.raises(ValueError):
            q.locks.acquire(name, ttl_seconds=5)

    def test_a_raw_op_without_a_lifetime_is_refused_before_sending(self, q: qs.Queen) -> None:
        with pytest.raises(qs.RequestError) as caught:
            q.locks.batch([{"op": "acquire", "name": "job"}])
        assert caught.value.code == "lock_bad_request", repr(caught.value)
        assert not q.locks.get("job"), "nothing was acquired"

    @pytest.mark.parametrize("limit", [0, 1025, True, 2.0])
    def test_a_limit_outside_1_to_1024_or_not_an_int_is_refused(self, q: qs.Queen,
                                                                 limit: object) -> None:
        with pytest.raises((ValueError, TypeError)):
            q.locks.acquire("job", ttl_seconds=5, limit=limit)  # type: ignore[arg-type]
