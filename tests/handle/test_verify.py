"""``lock.verify()``: one durable read of the permit (owner AND token), on every engine.

``check()`` only looks at the handle's own token and local deadline; ``verify()`` asks
the engine, so a permit taken away and re-taken by someone else is caught before parked
work resumes.
"""

from __future__ import annotations

import logging
from typing import Iterator

import pytest
from manual_clock import ManualClock
from polling import wait_for

import queen_sync as qs
from queen_sync.testing import FaultyEngine


@pytest.fixture
def mq(faults: FaultyEngine, clock: ManualClock) -> Iterator[qs.Queen]:
    """A client of every engine on the manual clock, whose calls go through ``faults``."""
    client = qs.Queen(engine=faults, clock=clock, renew_thread=False)
    yield client
    client.close()


@pytest.fixture
def other(engine_url: str) -> Iterator[qs.Queen]:
    """A second client of the same store: another process, as far as the engine knows."""
    client = qs.Queen(engine_url, renew_thread=False)
    yield client
    client.close()


class TestVerify:
    def test_a_permit_still_this_handles_verifies_in_one_read(
            self, mq: qs.Queen, faults: FaultyEngine) -> None:
        lock = mq.semaphore("pool", 3, ttl=30)
        assert mq.semaphore("pool", 3, ttl=30).acquire() and lock.acquire()
        before = faults.sent["locks"]
        assert lock.verify(), "the engine has the permit at this owner and token"
        reads = faults.sent["locks"] - before
        assert reads == 1, f"one durable read, not {reads}"
        assert lock.held and not lock.lost.is_set(), repr(lock)

    def test_a_permit_taken_away_and_retaken_by_someone_else_fails_and_is_lost(
            self, mq: qs.Queen, other: qs.Queen) -> None:
        lock = mq.lock("job", ttl=30)
        reasons: list[str] = []
        lock.on_lost(reasons.append)
        assert lock.acquire()
        token = lock.token
        assert other.locks.release("job", token=token), "break-glass release"  # type: ignore[arg-type]
        thief = other.lock("job", ttl=30)
        assert thief.acquire(), "another holder takes the freed permit"
        lock.check()  # the local look cannot tell: this is what verify() is for
        assert not lock.verify(), "the permit is someone else's now"
        assert lock.lost.is_set() and lock.lost_reason == "guard", repr(lock)
        assert not lock.held and lock.last_token == token, repr(lock)
        with pytest.raises(qs.LockLostError):
            lock.check()
        assert not lock.release(), "the lost handle has nothing to give back"
        assert thief.verify() and other.locks.get("job")["holders"][0]["owner"] == thief.owner, (
            "verifying the lost handle must leave the new holder's permit alone")
        wait_for(lambda: reasons == ["guard"], timeout=5, what="on_lost told 'guard'")

    def test_a_permit_released_by_someone_else_fails_and_is_lost(
            self, mq: qs.Queen, other: qs.Queen) -> None:
        lock = mq.lock("job", ttl=30)
        assert lock.acquire()
        assert other.locks.release("job", token=lock.token)  # type: ignore[arg-type]
        assert not lock.verify(), "nobody holds the permit"
        assert lock.lost_reason == "guard", repr(lock)

    def test_a_handle_that_holds_nothing_answers_false_without_asking(
            self, mq: qs.Queen, faults: FaultyEngine, clock: ManualClock) -> None:
        lock = mq.lock("job", ttl=30)
        assert not lock.verify(), "never acquired"
        assert lock.acquire()
        clock.advance(31)  # past the local deadline, no renew
        calls = faults.sent["locks"]
        assert not lock.verify(), "past the local deadline it is not held"
        assert faults.sent["locks"] == calls, "nothing to verify: nothing may be sent"

    def test_an_engine_that_cannot_be_asked_leaves_the_local_belief_and_logs(
            self, mq: qs.Queen, faults: FaultyEngine, clock: ManualClock,
            caplog: pytest.LogCaptureFixture) -> None:
        lock = mq.lock("job", ttl=30)
        assert lock.acquire()
        faults.fail_next(None, route="locks")  # unreachable, unsent, until clear()
        with caplog.at_level(logging.WARNING, logger="queen_sync"):
            assert lock.verify(), "held locally, and the engine could not say otherwise"
        assert not lock.lost.is_set(), "a failed read is not a loss"
        assert any("verify" in r.getMessage() and "job" in r.getMessage()
                   for r in caplog.records), [r.getMessage() for r in caplog.records]
        faults.clear()
        assert lock.verify(), "once the engine answers again, the permit checks out"

    def test_after_a_renew_whose_answer_was_lost_the_handle_verifies_and_guards(
            self, mq: qs.Queen, faults: FaultyEngine) -> None:
        lock = mq.lock("job", ttl=30, auto_renew=False)
        assert lock.acquire()
        before = lock.token
        faults.fail_next(route="locks", applied=True)  # applied, then its answer is lost
        with pytest.raises(qs.EngineUnavailableError):
            lock.renew()  # applied: the row moved to a token this handle never saw
        row = mq.locks.get("job")["holders"][0]
        assert row["owner"] == lock.owner and row["token"] > before, row
        assert lock.verify(), "the row is this handle's own, at its own unseen renewal"
        assert lock.token == row["token"], "the handle now carries the row's token"
        answer = mq.transaction().guard(lock).kv.put("app", "k", 1, forever=True).commit()
        assert answer, f"a guarded write must commit with the verified token: {answer}"

