"""A handle's local deadline is never later than the engine's expiry of the permit it holds.

The engine runs on the same manual clock as the handles, so "the engine's permit has
expired" and "the handle still believes it holds" are exact statements here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import pytest
from manual_clock import ManualClock

import queen_sync as qs
from queen_sync.testing import FaultyEngine


@pytest.fixture
def shared_clock() -> ManualClock:
    return ManualClock(start=1_700_000_000.0)


def _engine(folder: Path, clock: ManualClock) -> FaultyEngine:
    return FaultyEngine("sqlite://" + str(folder / "q.db"), clock=lambda: clock.now)


@pytest.fixture
def store(tmp_path: Path, shared_clock: ManualClock) -> Iterator[FaultyEngine]:
    engine = _engine(tmp_path, shared_clock)
    yield engine
    engine.close()


@pytest.fixture
def holder(store: FaultyEngine, shared_clock: ManualClock) -> Iterator[qs.Queen]:
    with qs.Queen(engine=store, clock=shared_clock, renew_thread=False) as client:
        yield client


@pytest.fixture
def rival(tmp_path: Path, shared_clock: ManualClock) -> Iterator[qs.Queen]:
    with qs.Queen(engine=_engine(tmp_path, shared_clock), clock=shared_clock,
                  renew_thread=False) as client:
        yield client


def rival_takes(rival: qs.Queen, ttl: float) -> qs.Lock:
    other = rival.lock("job", ttl=ttl)
    assert other.acquire(), "setup: the engine's permit has expired, so a rival takes it"
    return other


class TestAnAlreadyAnswerCountsFromTheEnginesGrant:
    def test_an_acquire_after_a_release_that_never_arrived_is_not_held_past_the_grant(
        self, holder: qs.Queen, rival: qs.Queen, store: FaultyEngine,
        shared_clock: ManualClock
    ) -> None:
        lock = holder.lock("job", ttl=30)
        assert lock.acquire(), "a fresh store must grant the lease"
        store.fail_next(route="locks", op="release")  # the release never reaches the engine
        with pytest.raises(qs.EngineUnavailableError):
            lock.release()
        shared_clock.advance(25)
        assert lock.acquire(), "the owner's own permit must be answered ('already')"
        shared_clock.advance(6)  # 31 s after the first grant
        holder.renewer.tick()
        if not lock.held:
            return  # the handle no longer believes it holds: no second holder can appear
        other = rival.lock("job", ttl=30)
        assert not other.acquire(), (
            f"two holders: {lock!r} counts from the retry while {other!r} took the permit")

    def test_a_retry_after_a_lost_grant_counts_from_its_own_send_not_the_grant(
        self, holder: qs.Queen, rival: qs.Queen, store: FaultyEngine,
        shared_clock: ManualClock
    ) -> None:
        lock = holder.lock("job", ttl=10)
        store.fail_next(route="locks", op="acquire", applied=True)  # granted; answer lost
        with pytest.raises(qs.EngineUnavailableError):
            lock.acquire()
        shared_clock.advance(6)
        assert lock.acquire(), "the retry must be answered with the owner's permit"
        store.fail_next(None, route="locks", op="renew")  # a partition: renewals fail
        for _ in range(3):
            shared_clock.advance(1.5)
            holder.renewer.tick()
        if not lock.held:
            return  # the handle no longer believes it holds: no second holder can appear
        other = rival.lock("job", ttl=10)
        assert not other.acquire(), (
            f"two holders: {lock!r} counts from the retry while {other!r} took the permit")

    def test_an_already_answer_is_renewed_at_once_with_a_new_token(
        self, holder: qs.Queen, store: FaultyEngine, shared_clock: ManualClock
    ) -> None:
        lock = holder.lock("job", ttl=30)
        assert lock.acquire()
        first = lock.token
        store.fail_next(route="locks", op="release")
        with pytest.raises(qs.EngineUnavailableError):
            lock.release()
        shared_clock.advance(25)
        assert lock.acquire(), "the owner's own permit must be answered ('already')"
        assert lock.token is not None and first is not None and lock.token > first, (
            f"{lock!r} kept the token of the first grant: the permit was not renewed")
        assert lock.remaining == pytest.approx(30), "the deadline must count from the renew"
        tokens = [h["token"] for h in holder.locks.get("job")["holders"]]
        assert tokens == [lock.token], f"the engine has {tokens}, the handle {lock!r}"

    def test_an_already_answer_whose_renew_is_refused_is_not_acquired(
        self, holder: qs.Queen, store: FaultyEngine, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        lock = holder.lock("job", ttl=30)
        assert lock.acquire()
        store.fail_next(route="locks", op="release")
        with pytest.raises(qs.EngineUnavailableError):
            lock.release()
        real_call = holder._caller.call_locks

        def refuse_renewals(ops: list[dict[str, Any]]) -> list[Any]:
            answers = real_call(ops)
            return [{"renewed": False, "reason": "not_held"} if op["op"] == "renew" else a
                    for op, a in zip(ops, answers)]

        monkeypatch.setattr(holder._caller, "call_locks", refuse_renewals)
        assert not lock.acquire(), "a permit whose renew was refused must not count as held"
        assert not lock.held and lock.token is None, f"{lock!r} believes it holds"


class TestTheTtlOfAHeldLease:
    def test_raising_it_does_not_extend_the_lease_held(
        self, holder: qs.Queen, rival: qs.Queen, shared_clock: ManualClock
    ) -> None:
        lock = holder.lock("job", ttl=3, auto_renew=False)
        assert lock.acquire()
        lock.ttl = 60  # the engine's permit still lapses 3 s after the acquire was sent
        shared_clock.advance(4)
        other = rival_takes(rival, 3)
        assert not lock.held, f"two holders: {lock!r} and {other!r}"

    def test_raising_it_past_the_deadline_does_not_revive_the_lease(
        self, holder: qs.Queen, shared_clock: ManualClock
    ) -> None:
        lock = holder.lock("job", ttl=6, auto_renew=False)
        assert lock.acquire()
        shared_clock.advance(7)
        lock.ttl = 20
        assert not lock.held, f"{lock!r} came back to life with no permit on the engine"

    def test_lowering_it_keeps_the_lease_held_and_renewed(
        self, holder: qs.Queen, shared_clock: ManualClock
    ) -> None:
        lock = holder.lock("job", ttl=30)
        assert lock.acquire()
        lock.ttl = 3
        assert lock.renew_every == pytest.approx(1), "the default period must follow the ttl"
        for _ in range(30):
            shared_clock.advance(0.5)
            holder.renewer.tick()
        assert lock.held and not lock.lost.is_set(), f"lowering the ttl lost {lock!r}"
        assert lock.remaining <= 3, f"{lock!r} still counts the old 30 s lifetime"

    def test_an_explicit_renew_period_stays_and_must_fit_the_new_ttl(
        self, holder: qs.Queen
    ) -> None:
        lock = holder.lock("job", ttl=30, renew_every=5)
        lock.ttl = 60
        assert lock.renew_every == 5, "a period the caller chose must not be recomputed"
        with pytest.raises(ValueError, match="renew_every"):
            lock.ttl = 4
        assert lock.ttl == 60, "a refused ttl must leave the handle as it was"

    @pytest.mark.parametrize("garbage", ["soon", None, -1, 0.2, True])
    def test_garbage_is_refused_at_the_assignment(self, holder: qs.Queen, garbage: Any) -> None:
        lock = holder.lock("job", ttl=30)
        assert lock.acquire()
        with pytest.raises((TypeError, ValueError)):
            lock.ttl = garbage
        assert lock.ttl == 30 and lock.held, f"a refused ttl changed {lock!r}"


class TestEveryEngineAnswersTheOwnersPermitAsAlready:
    def test_so_an_acquire_after_a_release_that_never_arrived_renews_it_at_once(
        self, engine_url: str
    ) -> None:
        faults = FaultyEngine(engine_url)
        with qs.Queen(engine=faults, renew_thread=False) as client:
            lock = client.lock("job", ttl=30)
            assert lock.acquire(), "a fresh store must grant the lease"
            first = lock.token
            faults.fail_next(route="locks", op="release")
            with pytest.raises(qs.EngineUnavailableError):
                lock.release()
            assert lock.acquire(), "the owner's own permit must be answered again"
            assert lock.token is not None and first is not None and lock.token > first, (
                f"{faults.kind}: {lock!r} took the old grant's token: 'already' went unseen")
            tokens = [h["token"] for h in client.locks.get("job")["holders"]]
            assert tokens == [lock.token], f"the engine has {tokens}, the handle {lock!r}"
