"""A handle given ``owner=`` shares that owner with any later incarnation (a worker's stable
id across a restart): releasing by owner must free only what this handle's own calls moved,
and a failed acquire's late sends must still be given back at close()."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

import queen_sync as qs
from queen_sync._ops import LockOps
from queen_sync.testing import FaultyEngine, LocalBroker


def _holders(q: qs.Queen, name: str) -> list[tuple[str, int]]:
    return [(h["owner"], h["token"]) for h in q.locks.get(name)["holders"]]


def _unsure_stale_handle_and_a_successor(faults: FaultyEngine,
                                         q: qs.Queen) -> tuple[qs.Lock, qs.Lock]:
    """A handle whose last renew applied with its answer lost, whose permit then ended,
    and a later handle of the same owner holding the lock afresh."""
    stale = q.lock("job", ttl=30, owner="worker-7", auto_renew=False)
    assert stale.acquire(), "job is free"
    faults.fail_next(1, route="locks", op="renew", applied=True)
    with pytest.raises(qs.EngineError):
        stale.renew()
    q.kv.delete("queen-locks", "job#0")  # an operator's break-glass (or an expiry)
    fresh = q.lock("job", ttl=30, owner="worker-7", auto_renew=False)
    assert fresh.acquire(), "job is free again"
    return stale, fresh


class TestAHandleUnsureOfItsTokenWithASameOwnerSuccessor:
    def test_its_release_frees_nothing_of_the_successor(self, faults: FaultyEngine,
                                                        faulty_q: qs.Queen) -> None:
        stale, fresh = _unsure_stale_handle_and_a_successor(faults, faulty_q)
        released = stale.release()
        assert released is False, "the stale handle held nothing any more"
        assert _holders(faulty_q, "job") == [("worker-7", int(fresh.token or 0))], (
            f"the successor's permit was freed: {_holders(faulty_q, 'job')}")

    def test_its_verify_does_not_adopt_the_successors_token(self, faults: FaultyEngine,
                                                             faulty_q: qs.Queen) -> None:
        stale, fresh = _unsure_stale_handle_and_a_successor(faults, faulty_q)
        vouched = stale.verify()
        assert not (vouched and stale.token == fresh.token), (
            f"verify() vouched for the stale handle at the successor's token {fresh.token}: "
            f"two handles hold one token ({stale!r}, {fresh!r})")


class TestAGivenOwnersOwnLateRenew:
    def test_release_gives_back_the_permit_it_moved(self, q: qs.Queen) -> None:
        lock = q.lock("job", ttl=30, owner="worker-7")
        assert lock.acquire(), "job is free"
        first_send = LockOps.renew("job", token=int(lock.token or 0), ttl_seconds=30, slot=0,
                                   owner="worker-7")
        assert lock.renew(), "the renew is answered"
        assert q.locks.batch([first_send])[0]["renewed"], "the late first send lands"
        assert lock.release(), "the permit this handle's own late renew moved is its own"
        assert not _holders(q, "job"), f"still held: {_holders(q, 'job')}"


class TestAnAcquireWhoseEverySendTimedOut:
    @pytest.mark.realtime
    def test_close_gives_back_what_its_late_sends_took(self, tmp_path: Path) -> None:
        with LocalBroker(str(tmp_path / "broker.db")) as broker:
            q = qs.Queen(broker.url, renew_thread=False, timeout=(1.0, 0.2), call_timeout=2,
                         retries=1)
            lock = q.lock("job", ttl=30)
            broker.faults.delay_next(2, seconds=0.4, route="locks")
            with pytest.raises(qs.EngineError):
                lock.acquire()
            time.sleep(0.6)  # both stalled sends have landed: the first took the permit
            ghost = [h["owner"] for h in q.locks.get("job")["holders"]]
            q.close()
            with qs.Queen(broker.url) as other:
                taken = other.locks.acquire("job", ttl_seconds=30, owner="next")
                left = other.locks.get("job")["holders"]
        assert ghost == [lock.owner], f"the stalled sends should have taken a permit: {ghost}"
        assert taken, f"close() left the permit the late sends took held: {left}"
