"""A renew for a shorter lifetime whose answer is lost may have shortened the lease.

The engine then counts the lease from that renew, with its shorter lifetime; the handle
cannot tell whether it applied, so its local deadline must be the earlier of the two.
The engine runs on the handle's manual clock, so both deadlines are exact.
"""

from __future__ import annotations

import os
import tempfile
from typing import Callable, Iterator

import pytest
from manual_clock import ManualClock

import queen_sync as qs
from queen_sync.testing import FaultyEngine

START = 1_700_000_000.0


@pytest.fixture
def world() -> Iterator[tuple[qs.Queen, FaultyEngine, qs.Queen, ManualClock]]:
    """A client behind faults, a judge reading the same file without them, one clock."""
    clock = ManualClock(start=START)
    with tempfile.TemporaryDirectory() as folder:
        url = "sqlite://" + os.path.join(folder, "q.db")
        faults = FaultyEngine(url, clock=lambda: clock.now)
        judge_engine = FaultyEngine(url, clock=lambda: clock.now)
        with qs.Queen(engine=faults, clock=clock, renew_thread=False) as client, \
                qs.Queen(engine=judge_engine, clock=clock, renew_thread=False) as judge:
            yield client, faults, judge, clock


def _engine_expiry(judge: qs.Queen, lock: qs.Lock) -> float:
    holders = judge.locks.get(lock.name)["holders"]
    permit = next(h for h in holders if h["slot"] == lock.slot)
    return float(permit["expiresAt"]) / 1000


def _by_hand(lock: qs.Lock, client: qs.Queen) -> None:
    with pytest.raises(qs.EngineError):
        lock.renew()


def _by_the_renewer(lock: qs.Lock, client: qs.Queen) -> None:
    calls = client.renewer.calls
    client.renewer.tick()  # its batch fails; the lease stays, to be retried sooner
    assert client.renewer.calls == calls + 1, "setup: the tick must have sent the renew"


@pytest.mark.parametrize("renew", [_by_hand, _by_the_renewer], ids=["by_hand", "by_the_renewer"])
class TestShorterLifetimeRenewWithItsAnswerLost:
    def test_the_local_deadline_is_not_after_the_engines_expiry(
        self, world: tuple[qs.Queen, FaultyEngine, qs.Queen, ManualClock],
        renew: Callable[[qs.Lock, qs.Queen], None],
    ) -> None:
        client, faults, judge, clock = world
        lock = client.lock("job", ttl=6)
        assert lock.acquire(), "setup: a fresh store grants the lease"
        lock.ttl = 3
        clock.advance(lock.renew_due - clock.now + 0.01)  # due for the renewer, inside the lease
        faults.fail_next(1, route="locks", op="renew", applied=True)
        renew(lock, client)
        assert lock.held, f"a renew whose answer was lost must not end the lease: {lock!r}"
        engine_expiry = _engine_expiry(judge, lock)
        assert engine_expiry >= lock.deadline - 0.001, (
            f"the local deadline {lock.deadline:.3f} outlives the engine's expiry "
            f"{engine_expiry:.3f}: work could go on after another holder took over")
