"""A release, an expiry pass and ``on_lost`` landing at the same moment each count once.

Threads cannot be made to interleave on cue, so each test puts the rival step exactly in
the window it targets: a hook runs it inline at that point of the handle's code, unless the
handle holds its state lock there (then the rival, a real thread, would wait for it and land
after the step, which the test does next). What is asserted is a count, never a time.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from manual_clock import ManualClock

import queen_sync as qs
from queen_sync._handle.lock import Lock

DRAIN = 5.0  # seconds to let the loss handlers queued so far end


class _TokenReadHook(Lock):
    """A ``Lock`` that runs ``on_read`` once, at the next read of its token after arming."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.on_read: Optional[Callable[[], None]] = None
        super().__init__(*args, **kwargs)

    @property
    def _token(self) -> Optional[int]:
        value, (hook, self.on_read) = self._token_value, (self.on_read, None)
        if hook is not None:
            hook()  # after the read: the rival lands between the read and what follows it
        return value

    @_token.setter
    def _token(self, value: Optional[int]) -> None:
        self._token_value = value


def _expiry_pass_unless_barred(lock: Lock) -> Callable[[], None]:
    """The renewer's expiry pass as it would land now, from another thread."""
    def land() -> None:
        if not lock._state.locked():  # held: that thread would wait, and land afterwards
            lock.mark_lost("expired")
    return land


def _hooked_lock(q: qs.Queen, name: str) -> _TokenReadHook:
    lock = _TokenReadHook(q._caller, name, ttl=30.0)
    assert lock.acquire(), "setup: the lease must be granted"
    return lock


class TestReleaseMeetingAnExpiryPass:
    def test_the_held_gauge_drops_by_one_when_an_expiry_pass_lands_as_release_reads_the_token(
        self, mq: qs.Queen
    ) -> None:
        other = mq.lock("other", ttl=30)
        assert other.acquire(), "setup: a second lease keeps the gauge off its floor of 0"
        lock = _hooked_lock(mq, "raced")
        assert mq.metrics.snapshot()["held"] == 2, "setup: two leases held"
        lock.on_read = _expiry_pass_unless_barred(lock)
        lock.release()
        lock.mark_lost("expired")  # the pass, if it was barred, lands now
        assert mq.metrics.snapshot()["held"] == 1, (
            "one lease given up was counted out twice: by release and by the expiry pass")
        assert other.held, "the other lease must be untouched"

    def test_the_held_gauge_drops_by_one_when_an_expiry_pass_lands_as_a_batched_release_begins(
        self, mq: qs.Queen
    ) -> None:
        other = mq.lock("other", ttl=30)
        assert other.acquire(), "setup: a second lease keeps the gauge off its floor of 0"
        lock = _hooked_lock(mq, "raced")
        lock.on_read = _expiry_pass_unless_barred(lock)
        assert lock.try_begin_call(), "setup: no call in flight"
        try:
            op = lock.begin_release()
            lock.mark_lost("expired")
            if op is not None:
                lock.end_release(mq._caller.call_locks([op])[0])
        finally:
            lock.end_call()
        assert mq.metrics.snapshot()["held"] == 1, (
            "one lease given up in a batch was counted out twice")


def _lose(q: qs.Queen, clock: ManualClock, lock: Lock) -> None:
    q.kv.delete("queen-locks", f"{lock.name}#0")
    clock.advance(10.01)
    q.renewer.tick()


class _AppendHook(list[Callable[[str], Any]]):
    """A handler list that runs ``on_append`` once, right after the next append."""

    on_append: Optional[Callable[[], None]] = None

    def append(self, item: Callable[[str], Any]) -> None:
        super().append(item)
        hook, self.on_append = self.on_append, None
        if hook is not None:
            hook()


class TestOnLostMeetingALoss:
    def test_a_handler_added_as_the_loss_lands_runs_once(
        self, mq: qs.Queen, clock: ManualClock
    ) -> None:
        lock = mq.lock("raced", ttl=30)
        assert lock.acquire(), "setup: the lease must be granted"
        handlers = _AppendHook()
        lock._handlers = handlers
        calls: list[str] = []

        def loss_lands() -> None:
            if not lock._state.locked():  # held: the loss would wait, and land afterwards
                _lose(mq, clock, lock)
        handlers.on_append = loss_lands
        lock.on_lost(calls.append)
        _lose(mq, clock, lock)
        assert mq._losses.drain(DRAIN) == 0, "the loss handlers did not end"
        assert calls == ["renew"], f"the handler ran {len(calls)} times for one loss: {calls}"

    def test_a_handler_added_between_the_loss_and_its_dispatch_runs_once(
        self, mq: qs.Queen, clock: ManualClock
    ) -> None:
        lock = mq.lock("raced", ttl=30)
        assert lock.acquire(), "setup: the lease must be granted"
        calls: list[str] = []
        counted = mq.metrics.count

        def count_then_add_handler(outcome: str, n: int = 1) -> None:
            counted(outcome, n)
            if outcome.startswith("lost_"):  # mark_lost, after setting lost
                lock.on_lost(calls.append)
        mq.metrics.count = count_then_add_handler  # type: ignore[method-assign]
        _lose(mq, clock, lock)
        assert mq._losses.drain(DRAIN) == 0, "the loss handlers did not end"
        assert calls == ["renew"], f"the handler ran {len(calls)} times for one loss: {calls}"
