"""Windows inside one handle where a lease could be believed in wrongly, each hit on cue.

A nested block entered as the outer lease's deadline passes; ``ttl`` raised while the
acquire or renew that carries the old one is in flight (the fork while ``release()`` is
stopping the lease is in test_fork_during_acquire). A hook runs the rival step exactly
inside the window.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import pytest
from manual_clock import ManualClock

import queen_sync as qs
from queen_sync.testing import FaultyEngine


class JumpingClock(ManualClock):
    """A manual clock that jumps ``seconds`` ahead at a chosen later reading."""

    def __init__(self, start: float = 1_700_000_000.0) -> None:
        super().__init__(start)
        self._readings_left = -1
        self._jump = 0.0

    def jump_after(self, readings: int, seconds: float) -> None:
        self._readings_left, self._jump = readings, seconds

    def monotonic(self) -> float:
        if self._readings_left == 0:
            self.now += self._jump
        if self._readings_left >= 0:
            self._readings_left -= 1
        return self.now


def faulty_client(folder: Path, clock: ManualClock) -> tuple[qs.Queen, FaultyEngine]:
    """A client on one shared SQLite file, every call going through a hookable engine."""
    faults = FaultyEngine("sqlite://" + str(folder / "q.db"), clock=lambda: clock.now)
    return qs.Queen(engine=faults, clock=clock, renew_thread=False), faults


class TestANestedBlockEnteredAsTheDeadlinePasses:
    @pytest.mark.parametrize("expires", ["after its first look", "before it"])
    def test_never_sends_an_acquire_that_a_rival_could_have_run_before(
        self, tmp_path: Path, expires: str
    ) -> None:
        clock = JumpingClock()
        client, faults = faulty_client(tmp_path, clock)
        rival_client, _ = faulty_client(tmp_path, clock)
        lock = client.lock("job", ttl=6)
        rival_tokens: list[int] = []

        def rival_takes_and_gives_back(route: str, body: Mapping[str, Any]) -> None:
            rival = rival_client.lock("job", ttl=6, auto_renew=False)
            assert rival.acquire(), "the rival should take the expired permit"
            assert rival.token is not None, "the rival must hold a token"
            rival_tokens.append(rival.token)
            rival.release()

        entered: list[bool] = []
        try:
            with lock:
                if expires == "before it":
                    clock.advance(7.0)  # expired; the renewer has not looked yet
                else:
                    clock.advance(5.0)  # still held at the nested entry's first look ...
                    clock.jump_after(1, 2.0)  # ... and expired at its next one
                faults.hook_next(hook=rival_takes_and_gives_back, route="locks", op="acquire")
                try:
                    with lock:
                        entered.append(True)
                except qs.LockLostError:
                    assert lock.lost.is_set(), f"a refused entry must leave lost set: {lock!r}"
                assert rival_tokens == [], (
                    f"the nested entry (lease expiring {expires}) sent an acquire, and a "
                    f"rival held 'job' (token {rival_tokens}) under the outer block: {lock!r}")
                assert entered == ([True] if expires != "before it" else []), (
                    f"a nested entry must go in exactly when the lease is live at its one "
                    f"look (expiring {expires}): entered={entered}")
        finally:
            client.close()
            rival_client.close()

    def test_after_an_explicit_release_inside_the_outer_block_takes_a_new_lease(
        self, tmp_path: Path
    ) -> None:
        client, _ = faulty_client(tmp_path, ManualClock(start=1_700_000_000.0))
        lock = client.lock("job", ttl=6)
        try:
            with lock:
                first = lock.token
                assert lock.release(), "the explicit release should give the permit back"
                with lock:
                    assert lock.held and lock.token != first, (
                        f"a nested block after release() must take a new lease: {lock!r}")
        finally:
            client.close()


class TestATtlRaisedWhileItsOpIsInFlight:
    def test_during_the_renew_call_does_not_plan_the_next_renew_past_the_deadline(
        self, tmp_path: Path
    ) -> None:
        clock = ManualClock(start=1_700_000_000.0)
        client, faults = faulty_client(tmp_path, clock)
        lock = client.lock("job", ttl=3)
        try:
            assert lock.acquire(), "a free lock should be taken"
            clock.advance(1.1)  # the renew is due (every second)
            faults.hook_next(hook=lambda route, body: setattr(lock, "ttl", 60),
                             route="locks", op="renew")
            client.renewer.tick()  # renews with ttl 3: the lease lasts 3 s from now
            for _ in range(12):
                clock.advance(0.25)
                client.renewer.tick()
            assert not lock.lost.is_set(), (
                f"the lease was lost ({lock.lost_reason}) though the engine would have renewed "
                f"it: its next renew ({lock.renew_due:.2f}) was planned past its deadline "
                f"({lock.deadline:.2f})")
        finally:
            client.close()

    def test_during_the_acquire_call_does_not_plan_the_first_renew_past_the_deadline(
        self, tmp_path: Path
    ) -> None:
        clock = ManualClock(start=1_700_000_000.0)
        client, faults = faulty_client(tmp_path, clock)
        lock = client.lock("job", ttl=3)
        try:
            faults.hook_next(hook=lambda route, body: setattr(lock, "ttl", 60),
                             route="locks", op="acquire")
            assert lock.acquire(), "a free lock should be taken"
            assert lock.renew_due < lock.deadline, (
                f"the first renew ({lock.renew_due:.2f}) is planned past the deadline "
                f"({lock.deadline:.2f}) of the lease the acquire took")
            for _ in range(16):
                clock.advance(0.25)
                client.renewer.tick()
            assert not lock.lost.is_set(), (
                f"the lease was lost ({lock.lost_reason}) after the ttl changed mid-acquire")
        finally:
            client.close()
