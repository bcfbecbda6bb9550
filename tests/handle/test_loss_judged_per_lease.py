"""The renewer's expiry pass marks lost only the lease it judged, never one taken since."""

from __future__ import annotations

from typing import Any

from manual_clock import ManualClock

import queen_sync as qs


class TestAnExpiryJudgedForAnOldLease:
    def test_does_not_end_the_lease_the_handle_took_after_the_judgement(
        self, mq: qs.Queen, clock: ManualClock
    ) -> None:
        lock = mq.lock("job", ttl=30)
        assert lock.acquire(), "a fresh store must grant the lease"
        clock.advance(31)  # past the local deadline: the next pass judges it expired
        mark_lost = lock.mark_lost

        def acquire_then_mark(reason: str, **how: Any) -> None:
            # The handle's own thread acquires again between the pass reading the old
            # deadline and the pass marking the lease lost.
            assert lock.acquire(), "setup: the handle must take a fresh lease"
            mark_lost(reason, **how)

        lock.mark_lost = acquire_then_mark  # type: ignore[method-assign]
        mq.renewer.tick()
        assert lock.held and not lock.lost.is_set(), (
            f"the fresh lease was marked lost for its predecessor's deadline: {lock!r}")
        assert lock in mq.renewer.held(), "the fresh lease is no longer renewed"

    def test_still_ends_the_lease_it_judged(self, mq: qs.Queen, clock: ManualClock) -> None:
        lock = mq.lock("job", ttl=30)
        assert lock.acquire()
        clock.advance(31)
        mq.renewer.tick()
        assert lock.lost.is_set() and lock.lost_reason == "expired", f"not lost: {lock!r}"
        assert lock not in mq.renewer.held(), "a lost lease must not be renewed"
