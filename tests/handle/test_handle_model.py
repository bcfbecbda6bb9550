"""A stateful search of one handle against its engine: whenever the handle believes it
holds, the engine's permit is this owner's and lives at least as long as the handle's
local deadline.

The engine runs on the handle's manual clock, so both sides of that comparison are exact.
Steps: acquire, release, renew, verify, renewer ticks, time passing, ``ttl`` changes,
nested blocks, faults before or after the engine applies a call, and a rival taking the
permit whenever the engine lets it. ``QUEEN_SYNC_HANDLE_MODEL_EXAMPLES`` runs it longer.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule
from manual_clock import ManualClock

import queen_sync as qs
from queen_sync.testing import FaultyEngine

EXAMPLES = int(os.environ.get("QUEEN_SYNC_HANDLE_MODEL_EXAMPLES", "60"))


class OneHandleAndARival(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.clock = ManualClock(start=1_700_000_000.0)
        self.folder = tempfile.mkdtemp()
        url = "sqlite://" + os.path.join(self.folder, "q.db")
        self.faults = FaultyEngine(url, clock=lambda: self.clock.now)
        self.client = qs.Queen(engine=self.faults, clock=self.clock, renew_thread=False)
        # The judge shares the file but not the faults: it reads what the engine really has.
        self.judge = qs.Queen(engine=FaultyEngine(url, clock=lambda: self.clock.now),
                              clock=self.clock, renew_thread=False)
        self.lock = self.client.lock("job", ttl=6)
        self.rivals: list[qs.Lock] = []

    def teardown(self) -> None:
        self.client.close()
        self.judge.close()
        shutil.rmtree(self.folder, ignore_errors=True)

    @rule()
    def acquire(self) -> None:
        with contextlib.suppress(qs.EngineError):  # a lost answer: retried later
            self.lock.acquire()

    @rule()
    def release(self) -> None:
        with contextlib.suppress(qs.EngineError):
            self.lock.release()

    @rule()
    def renew(self) -> None:
        with contextlib.suppress(qs.EngineError):
            self.lock.renew()

    @rule()
    def verify(self) -> None:
        with contextlib.suppress(qs.EngineError):
            self.lock.verify()

    @rule()
    def nested_block_after_time_passes(self) -> None:
        try:
            with self.lock:
                self.clock.advance(4)
                self.client.renewer.tick()
                lost_before = self.lock.lost.is_set()
                with contextlib.suppress(qs.LockLostError), self.lock:
                    pass
                assert not lost_before or self.lock.lost.is_set(), (
                    f"a nested block erased the outer block's loss: {self.lock!r}")
        except (qs.EngineError, qs.LockNotHeldError):
            pass

    @rule()
    def tick(self) -> None:
        self.client.renewer.tick()

    @rule(seconds=st.sampled_from([0.5, 1.0, 2.1, 3.0, 7.0]))
    def advance(self, seconds: float) -> None:
        self.clock.advance(seconds)

    @rule(ttl=st.sampled_from([3, 6, 20]))
    def change_ttl(self, ttl: int) -> None:
        self.lock.ttl = ttl

    @rule(op=st.sampled_from(["acquire", "renew", "release", "get"]), applied=st.booleans(),
          n=st.integers(1, 3))
    def fault(self, op: str, applied: bool, n: int) -> None:
        self.faults.fail_next(n, route="locks", op=op, applied=applied)

    @rule()
    def heal(self) -> None:
        self.faults.clear()

    @rule()
    def rival_acquires(self) -> None:
        rival = self.judge.lock("job", ttl=6, auto_renew=False)
        if rival.acquire():
            self.rivals.append(rival)

    @rule()
    def rivals_release(self) -> None:
        for rival in self.rivals:
            rival.release()
        self.rivals.clear()

    @invariant()
    def a_belief_is_backed_by_the_engine(self) -> None:
        lock = self.lock
        if not lock.held:
            return
        holders = self.judge.locks.get("job")["holders"]
        permit = next((h for h in holders if h["slot"] == lock.slot), None)
        assert permit is not None, f"{lock!r} believes it holds; the engine has {holders}"
        assert permit["owner"] == lock.owner, (
            f"two holders: {lock!r} believes it holds {permit['owner']}'s permit")
        assert permit["expiresAt"] >= lock.deadline * 1000 - 1, (
            f"{lock!r}: the local deadline {lock.deadline:.3f} outlives the engine's expiry "
            f"{permit['expiresAt'] / 1000:.3f}")


OneHandleAndARival.TestCase.settings = settings(max_examples=EXAMPLES,
                                                stateful_step_count=40, deadline=None)
TestOneHandleAndARival = OneHandleAndARival.TestCase
