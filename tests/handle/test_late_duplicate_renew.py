"""A renew that lands twice (over HTTP: a resend after a read timeout, the first send
applied late) moves the permit past the token the handle adopted. The engine still
renews that token for its owner; the handle must still be able to give the permit back
and to guard with it, and never for a permit somebody else holds."""

from __future__ import annotations

import time
from pathlib import Path

import queen_sync as qs
from queen_sync._ops import LockOps
from queen_sync.testing import LocalBroker


def _tokens_held(q: qs.Queen, name: str) -> list[int]:
    return [h["token"] for h in q.locks.get(name)["holders"]]


def _renew_landing_twice(q: qs.Queen, lock: qs.Lock) -> int:
    """Renew ``lock``, then land the same renew again, late; the permit's token after it."""
    first_send = LockOps.renew(lock.name, token=int(lock.token or 0), ttl_seconds=30, slot=0,
                               owner=lock.owner)
    assert lock.renew(), "the renew is answered"
    late = q.locks.batch([first_send])[0]
    assert late["renewed"] and late["token"] != lock.token, (
        f"the owner's earlier token renews again, as the engine is meant to: {late}")
    return int(late["token"])


class TestReleaseAfterALateDuplicateRenew:
    def test_release_gives_back_a_permit_a_late_duplicate_renew_moved(
            self, q: qs.Queen) -> None:
        lock = q.lock("job", ttl=30)
        assert lock.acquire(), "job is free"
        moved_to = _renew_landing_twice(q, lock)
        released = lock.release()
        assert released and not _tokens_held(q, "job"), (
            f"release() answered {released}; this owner's permit (token {moved_to}) is still "
            f"held: {_tokens_held(q, 'job')}, and others wait for its TTL")

    def test_close_gives_back_a_permit_a_late_duplicate_renew_moved(
            self, engine_url: str) -> None:
        q = qs.Queen(engine_url)
        try:
            lock = q.lock("job", ttl=30)
            assert lock.acquire(), "job is free"
            _renew_landing_twice(q, lock)
        finally:
            q.close()
        with qs.Queen(engine_url) as other:
            assert other.locks.acquire("job", ttl_seconds=30, owner="next"), (
                f"close() left this owner's permit held: {other.locks.get('job')}")

    def test_release_reports_false_and_frees_nothing_once_someone_else_holds(
            self, q: qs.Queen) -> None:
        lock = q.lock("job", ttl=30, auto_renew=False)
        assert lock.acquire(), "job is free"
        q.kv.delete("queen-locks", "job#0")  # an operator's break-glass
        intruder = q.locks.acquire("job", ttl_seconds=30, owner="intruder")
        assert intruder, intruder
        assert lock.release() is False, "release() reported a permit this owner does not hold"
        assert _tokens_held(q, "job") == [intruder["token"]], (
            f"the intruder's permit must stay: {q.locks.get('job')}")


class TestGuardAfterALateDuplicateRenew:
    def test_a_guard_that_lost_only_to_its_own_late_renew_renews_and_resends(
            self, q: qs.Queen) -> None:
        lock = q.lock("job", ttl=30)
        assert lock.acquire(), "job is free"
        _renew_landing_twice(q, lock)
        answer = q.transaction().guard(lock).kv.put("app", "k", 1, forever=True).commit()
        assert answer, (f"the guard lost only to this owner's own renew, yet the bundle failed "
                        f"({answer}) and the lock is {lock!r}")
        assert not lock.lost.is_set() and lock.held, f"losing to oneself is no loss: {lock!r}"
        assert q.kv.get("app", "k")["value"] == 1, "the guarded write must land, once"
        assert _tokens_held(q, "job") == [lock.token], (
            f"the handle must hold the permit's token now: {lock!r} {q.locks.get('job')}")


class TestVerifyAfterALateDuplicateRenew:
    def test_verify_renews_from_the_token_held_instead_of_calling_the_lease_lost(
            self, q: qs.Queen) -> None:
        lock = q.lock("job", ttl=30)
        assert lock.acquire(), "job is free"
        _renew_landing_twice(q, lock)
        assert lock.verify(), f"the permit is this owner's, moved by its own renew: {lock!r}"
        assert not lock.lost.is_set() and lock.held, f"losing to oneself is no loss: {lock!r}"
        assert _tokens_held(q, "job") == [lock.token], (
            f"the handle must hold the permit's token now: {lock!r} {q.locks.get('job')}")

    def test_verify_still_calls_a_permit_taken_by_someone_else_lost(self, q: qs.Queen) -> None:
        lock = q.lock("job", ttl=30, auto_renew=False)
        assert lock.acquire(), "job is free"
        q.kv.delete("queen-locks", "job#0")  # an operator's break-glass
        assert q.locks.acquire("job", ttl_seconds=30, owner="intruder")
        assert not lock.verify(), "verify() vouched for somebody else's permit"
        assert lock.lost.is_set() and lock.lost_reason == "guard", repr(lock)


class TestOverHttp:
    def test_a_renew_resent_after_a_read_timeout_leaves_a_releasable_permit(
            self, tmp_path: Path) -> None:
        with LocalBroker(str(tmp_path / "broker.db")) as broker:
            q = qs.Queen(broker.url, renew_thread=False, timeout=(1.0, 0.2), call_timeout=2)
            lock = q.lock("job", ttl=30)
            assert lock.acquire(), "job is free"
            broker.faults.delay_next(1, seconds=0.4, route="locks")
            assert lock.renew(), "the resend of the stalled renew is answered"
            time.sleep(0.5)  # the first send has been applied now, late
            released = lock.release()
            left = _tokens_held(q, "job")
            q.close()
        assert released and not left, (
            f"release() answered {released}; the permit is still held ({left}) until its TTL")


class TestALateDuplicateAcquire:
    def test_close_gives_back_a_permit_a_late_duplicate_acquire_took_after_release(
            self, tmp_path: Path) -> None:
        with LocalBroker(str(tmp_path / "broker.db")) as broker:
            q = qs.Queen(broker.url, renew_thread=False, timeout=(1.0, 0.2), call_timeout=2)
            lock = q.lock("job", ttl=30)
            broker.faults.delay_next(1, seconds=0.4, route="locks")
            assert lock.acquire(), "the resend of the stalled acquire is answered"
            assert lock.release(), "released at once"
            time.sleep(0.5)  # the first send has been applied now, late: it took the permit
            ghost = q.locks.get("job")["holders"]
            assert [h["owner"] for h in ghost] == [lock.owner], (
                f"the late first send should have taken a permit for this owner: {ghost}")
            q.close()
            with qs.Queen(broker.url) as other:
                taken = other.locks.acquire("job", ttl_seconds=30, owner="next")
        assert taken, f"close() left the late acquire's permit held until its TTL: {taken}"

    def test_close_leaves_the_permits_of_an_owner_given_as_owner_alone(
            self, tmp_path: Path) -> None:
        with LocalBroker(str(tmp_path / "broker.db")) as broker:
            q = qs.Queen(broker.url, renew_thread=False, timeout=(1.0, 0.2), call_timeout=2)
            lock = q.lock("job", ttl=30, owner="shared-owner")
            broker.faults.delay_next(1, seconds=0.4, route="locks")
            assert lock.acquire(), "the resend of the stalled acquire is answered"
            assert lock.release(), "released at once"
            time.sleep(0.5)
            q.close()
            held = qs.Queen(broker.url)
            try:
                holders = held.locks.get("job")["holders"]
            finally:
                held.close()
        assert [h["owner"] for h in holders] == ["shared-owner"], (
            f"an owner given as owner= may be another handle's too: close() must not release "
            f"its permits: {holders}")


class TestAnOwnerGivenAsOwnerSharedByTwoHandles:
    """An owner passed as ``owner=`` may be a later incarnation's too (a worker's stable id
    across a restart): the earlier handle's release must not take the later one's permit."""

    def test_a_stale_handles_release_frees_nothing_of_the_handle_holding_now(
            self, q: qs.Queen, engine_url: str) -> None:
        stale = q.lock("job", ttl=30, owner="worker-7", auto_renew=False)
        assert stale.acquire(), "job is free"
        q.kv.delete("queen-locks", "job#0")  # its permit ended (expired, say)
        with qs.Queen(engine_url) as restarted:
            current = restarted.lock("job", ttl=30, owner="worker-7", auto_renew=False)
            assert current.acquire(), "the restarted worker takes the free lock"
            assert stale.release() is False, "the stale handle held nothing any more"
            assert _tokens_held(q, "job") == [current.token], (
                f"the stale handle's release took the current holder's permit: "
                f"{q.locks.get('job')}")
            current.release()

    def test_closing_the_stale_handles_client_frees_nothing_of_the_handle_holding_now(
            self, engine_url: str) -> None:
        q = qs.Queen(engine_url)
        stale = q.lock("job", ttl=30, owner="worker-7", auto_renew=False)
        assert stale.acquire(), "job is free"
        q.kv.delete("queen-locks", "job#0")
        with qs.Queen(engine_url) as restarted:
            current = restarted.lock("job", ttl=30, owner="worker-7", auto_renew=False)
            assert current.acquire(), "the restarted worker takes the free lock"
            q.close()
            assert _tokens_held(restarted, "job") == [current.token], (
                f"closing the stale client took the current holder's permit: "
                f"{restarted.locks.get('job')}")
            current.release()
