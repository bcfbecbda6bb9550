"""The renew op a handle sends: always the one ``LockOps.renew`` builds for what it holds now."""

from __future__ import annotations

import logging
import os
import tempfile

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from manual_clock import ManualClock

import queen_sync as qs
from queen_sync._durations import wire_seconds
from queen_sync._ops import LockOps

# Printable characters only (names refuse control characters and '#').
_NAMES = st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E, exclude_characters="#")
                 | st.characters(min_codepoint=0xA1, max_codepoint=0x2FF), min_size=1, max_size=12)


def expected_op(lock: qs.Lock) -> dict[str, object]:
    assert lock.token is not None, f"{lock!r} should hold"
    return LockOps.renew(lock.name, token=lock.token, ttl_seconds=wire_seconds(lock.ttl),
                         slot=lock.slot, owner=lock.owner)


class TestRenewOp:
    @settings(max_examples=15, deadline=None)
    @given(name=_NAMES, owner=st.none() | _NAMES, ttl=st.integers(3, 3600),
           limit=st.integers(1, 4), renews=st.integers(0, 3),
           new_ttl=st.none() | st.integers(3, 3600), new_owner=st.none() | _NAMES)
    def test_the_renew_op_is_the_one_built_for_the_token_slot_ttl_and_owner_held_now(
        self, name: str, owner: str | None, ttl: int, limit: int, renews: int,
        new_ttl: int | None, new_owner: str | None,
    ) -> None:
        clock = ManualClock()
        with tempfile.TemporaryDirectory() as folder, \
                qs.Queen("sqlite://" + os.path.join(folder, "q.db"), clock=clock,
                         renew_thread=False) as mq:
            lock = (mq.semaphore(name, limit, ttl=ttl, owner=owner) if limit > 1
                    else mq.lock(name, ttl=ttl, owner=owner))
            assert lock.acquire(), "a fresh store must grant the lease"
            for _ in range(renews):
                assert lock.renew_op() == expected_op(lock), "op differs before a renew"
                clock.advance(lock.renew_every + 0.01)
                mq.renewer.tick()
                assert lock.held, f"the renew must have kept {lock!r}"
            if new_ttl is not None:
                lock.ttl = new_ttl
            if new_owner is not None:
                with pytest.raises(qs.LockError, match="release it first"):
                    lock.owner = new_owner  # the permit is the old owner's row
            assert lock.renew_op() == expected_op(lock), "op not rebuilt after a change"

    def test_changing_a_renew_op_leaves_the_next_one_as_it_should_be(
        self, mq: qs.Queen
    ) -> None:
        lock = mq.lock("job", ttl=30)
        assert lock.acquire()
        first = lock.renew_op()
        assert first is not None
        first["name"], first["ttlSeconds"] = "someone-else", 1
        assert lock.renew_op() == expected_op(lock), "an op handed out was shared"

    def test_a_lifetime_set_to_garbage_is_refused_at_the_assignment_and_the_op_stays(
        self, mq: qs.Queen
    ) -> None:
        lock = mq.lock("job", ttl=30)
        assert lock.acquire()
        before = lock.renew_op()
        with pytest.raises(ValueError, match="ttl"):
            lock.ttl = "soon"
        assert lock.renew_op() == before, "a refused lifetime changed the renew op"

    def test_a_handle_that_holds_nothing_has_no_renew_op(self, mq: qs.Queen) -> None:
        lock = mq.lock("job", ttl=30)
        assert lock.renew_op() is None, "nothing held: nothing to renew"
        assert lock.acquire() and lock.release()
        assert lock.renew_op() is None, "released: nothing to renew"


class TestAHandleWhoseRenewCannotBeBuilt:
    """One handle set to garbage after its acquire must not stop the renewal of the others."""

    @pytest.mark.parametrize("attribute, garbage", [("owner", ""), ("name", 7)])
    def test_fails_alone_as_a_failed_renew_until_its_deadline(
        self, mq: qs.Queen, clock: ManualClock, attribute: str, garbage: object
    ) -> None:
        locks = [mq.lock(f"job-{i}", ttl=30) for i in range(5)]
        assert all(lock.acquire() for lock in locks)
        broken, others = locks[2], locks[:2] + locks[3:]
        # Assignment refuses garbage; past it (a bug, say), the renewer must still cope.
        setattr(broken, "_" + attribute, garbage)
        for _ in range(4):  # past the broken lease's deadline, retrying it on the way
            before = [lock.token for lock in others]
            clock.advance(10.01)
            mq.renewer.tick()
            assert all(lock.token is not None and old is not None and lock.token > old
                       for lock, old in zip(others, before)), "the other leases were not renewed"
        assert mq.metrics.snapshot()["counts"]["renew_error"] == 2, "each try is a renew_error"
        assert broken.lost.is_set() and broken.lost_reason == "expired", (
            f"the broken lease must end at its local deadline: {broken.lost_reason!r}")
        assert broken not in mq.renewer.held(), "the renewer still keeps the broken handle"

    def test_a_lifetime_set_to_garbage_is_refused_and_every_lease_is_still_renewed(
        self, mq: qs.Queen, clock: ManualClock
    ) -> None:
        locks = [mq.lock(f"job-{i}", ttl=30) for i in range(3)]
        assert all(lock.acquire() for lock in locks)
        before = [lock.token for lock in locks]
        with pytest.raises(ValueError, match="ttl"):
            locks[1].ttl = "soon"
        clock.advance(10.01)
        mq.renewer.tick()
        assert all(lock.token is not None and old is not None and lock.token > old
                   for lock, old in zip(locks, before)), "a lease was not renewed"

    def test_close_still_gives_back_every_other_lease(
        self, sqlite_url: str, caplog: pytest.LogCaptureFixture
    ) -> None:
        q = qs.Queen(sqlite_url, renew_thread=False)
        locks = [q.lock(f"job-{i}", ttl=3600) for i in range(5)]
        assert all(lock.acquire() for lock in locks)
        locks[2]._name = 7  # type: ignore[assignment]  # past the assignment's check
        with caplog.at_level(logging.WARNING, logger="queen_sync"):
            q.close()
        assert any("1 of 5 lease(s) were not given back" in r.message
                   for r in caplog.records), caplog.text
        with qs.Queen(sqlite_url) as other:
            held = [lock.name for lock in locks[:2] + locks[3:]
                    if other.locks.batch([LockOps.get(str(lock.name))])[0]["held"]]
        assert not held, f"close() left these held: {held}"
