"""A lock answer of the wrong shape (a broken broker, a proxy rewriting bodies) is a typed
``ProtocolError`` at the call that got it: it holds nothing, reports no release, and in a
renew batch it fails its own lease alone, logged once."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from manual_clock import ManualClock

import queen_sync as qs
from queen_sync._engines import engine_from_url
from queen_sync._engines.base import Engine

Rewrite = Callable[[Mapping[str, Any], dict[str, Any]], dict[str, Any]]


class RewritingEngine(Engine):
    """A real SQLite engine whose lock answers pass through ``rewrite(op, result)`` first."""

    kind = "sqlite"

    def __init__(self, url: str) -> None:
        self.inner = engine_from_url(url, {})
        self.capabilities = self.inner.capabilities
        self.rewrite: Rewrite = lambda op, result: result

    @property
    def url(self) -> str:
        return self.inner.url

    def call(self, route: str, body: Mapping[str, Any]) -> dict[str, Any]:
        answer = self.inner.call(route, body)
        if route == "locks":
            answer["results"] = [self.rewrite(op, result)
                                 for op, result in zip(body["operations"], answer["results"])]
        return answer

    def close(self) -> None:
        self.inner.close()


@pytest.fixture
def engine(tmp_path: Path) -> RewritingEngine:
    return RewritingEngine("sqlite://" + os.path.join(tmp_path, "q.db"))


@pytest.fixture
def rq(engine: RewritingEngine, clock: ManualClock) -> Iterator[qs.Queen]:
    """A client of ``engine`` on the manual clock, its renewer ticked by hand."""
    q = qs.Queen(engine=engine, clock=clock, renew_thread=False)
    yield q
    engine.rewrite = lambda op, result: result
    q.close()


def answering(kind: str, bad: dict[str, Any]) -> Rewrite:
    """A rewrite that answers every ``kind`` op with ``bad`` instead."""
    return lambda op, result: dict(bad) if op["op"] == kind else result


# Any JSON value: what a broken broker or a rewriting proxy may put in a field.
_JSON = st.recursive(st.none() | st.booleans() | st.integers(-3, 2**64) | st.floats()
                     | st.text(max_size=4),
                     lambda inner: st.lists(inner, max_size=2)
                     | st.dictionaries(st.text(max_size=3), inner, max_size=2), max_leaves=4)

BAD_GRANTS: dict[str, dict[str, Any]] = {
    "no token": {"acquired": True, "slot": 0},
    "token a string": {"acquired": True, "slot": 0, "token": "7"},
    "token null": {"acquired": True, "slot": 0, "token": None},
    "token a bool": {"acquired": True, "slot": 0, "token": True},
    "token a fraction": {"acquired": True, "slot": 0, "token": 7.9},
    "token a whole float": {"acquired": True, "slot": 0, "token": 7.0},
    "token negative": {"acquired": True, "slot": 0, "token": -5},
    "token zero": {"acquired": True, "slot": 0, "token": 0},
    "token past 64 bits": {"acquired": True, "slot": 0, "token": 2**63},
    "no slot": {"acquired": True, "token": 7},
    "slot a string": {"acquired": True, "slot": "0", "token": 7},
    "slot negative": {"acquired": True, "slot": -1, "token": 7},
    "verdict a string": {"acquired": "false", "reason": "held", "holders": []},
    "verdict missing": {"reason": "held", "holders": []},
    "already a string": {"acquired": True, "slot": 0, "token": 7, "already": "no"},
    "holders not a list": {"acquired": False, "reason": "held", "holders": 5},
    "a holder not an object": {"acquired": False, "reason": "held", "holders": [5]},
    "a holder without a token": {"acquired": False, "reason": "held", "holders": [
        {"slot": 0, "owner": "x", "since": 1, "expiresAt": 2, "renewedAt": 1}]},
    "a holder's slot a string": {"acquired": False, "reason": "held", "holders": [
        {"slot": "0", "owner": "x", "token": 3, "since": 1, "expiresAt": 2, "renewedAt": 1}]},
    "a holder's owner a number": {"acquired": False, "reason": "held", "holders": [
        {"slot": 0, "owner": 9, "token": 3, "since": 1, "expiresAt": 2, "renewedAt": 1}]},
}


class TestMalformedAcquireAnswers:
    @pytest.mark.parametrize("name", sorted(BAD_GRANTS))
    def test_a_malformed_acquire_answer_is_a_protocol_error_and_holds_nothing(
            self, rq: qs.Queen, engine: RewritingEngine, name: str) -> None:
        engine.rewrite = answering("acquire", BAD_GRANTS[name])
        lock = rq.lock("job", ttl=30)
        with pytest.raises(qs.ProtocolError) as caught:
            lock.acquire()
        assert caught.value.route == "locks", repr(caught.value)
        assert not lock.held and lock.token is None, (
            f"{BAD_GRANTS[name]} was taken as a lease: held={lock.held}, token={lock.token}")

    def test_a_well_formed_busy_answer_still_lists_its_holders(
            self, rq: qs.Queen) -> None:
        assert rq.locks.acquire("job", ttl_seconds=30, owner="other")
        lock = rq.lock("job", ttl=30)
        assert not lock.acquire(), "job is held by another owner"
        assert [h.owner for h in lock.holders] == ["other"], lock.holders

    @settings(max_examples=60, deadline=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(acquired=st.one_of(st.booleans(), _JSON), token=st.one_of(st.integers(-3, 9), _JSON),
           slot=st.one_of(st.integers(-2, 1025), _JSON))
    def test_an_acquire_answer_is_taken_exactly_as_granted_or_refused_as_a_protocol_error(
        self, rq: qs.Queen, engine: RewritingEngine, acquired: Any, token: Any, slot: Any,
    ) -> None:
        engine.rewrite = answering("acquire", {"acquired": acquired, "token": token,
                                               "slot": slot})
        lock = rq.lock("job", ttl=30)
        granted = (acquired is True and type(token) is int and 1 <= token < 2**63
                   and type(slot) is int and 0 <= slot < 1024)
        try:
            took = lock.acquire()
        except qs.ProtocolError:
            assert acquired is not False and not granted, (
                f"a readable answer was refused: acquired={acquired!r} token={token!r} "
                f"slot={slot!r}")
            assert not lock.held and lock.token is None, repr(lock)
            return
        assert took == granted, (f"acquired={acquired!r} token={token!r} slot={slot!r} was "
                                 f"taken as {took}")
        if took:
            assert (lock.token, lock.slot) == (token, slot), repr(lock)
            engine.rewrite = lambda op, result: result
            lock.release()


class TestMalformedReleaseAnswers:
    @pytest.mark.parametrize("bad", [{"released": "false"}, {"released": 1}, {}],
                             ids=["a string", "a number", "missing"])
    def test_a_malformed_release_answer_is_a_protocol_error_not_a_release(
            self, rq: qs.Queen, engine: RewritingEngine, bad: dict[str, Any]) -> None:
        lock = rq.lock("job", ttl=30)
        assert lock.acquire(), "job is free"
        engine.rewrite = answering("release", bad)
        with pytest.raises(qs.ProtocolError):
            lock.release()
        assert not lock.held, f"after an unreadable release answer nothing is held: {lock!r}"


class TestMalformedRenewAnswers:
    @pytest.mark.parametrize("bad", [
        {"renewed": "yes", "slot": 0, "token": 99}, {"renewed": True, "slot": 0, "token": "99"},
        {"renewed": True, "slot": 0, "token": True}, {"slot": 0, "token": 99},
    ], ids=["verdict a string", "token a string", "token a bool", "verdict missing"])
    def test_a_malformed_renew_answer_raises_and_keeps_the_lease_unsure(
            self, rq: qs.Queen, engine: RewritingEngine, bad: dict[str, Any]) -> None:
        lock = rq.lock("job", ttl=30)
        assert lock.acquire(), "job is free"
        token = lock.token
        engine.rewrite = answering("renew", bad)
        with pytest.raises(qs.ProtocolError):
            lock.renew()
        assert lock.held and lock.token == token and not lock.lost.is_set(), (
            f"an unreadable renew answer is no answer: the lease stays, unsure: {lock!r}")

    def test_one_malformed_renew_answer_in_a_batch_spoils_no_other_lease_and_logs_once(
        self, rq: qs.Queen, engine: RewritingEngine, clock: ManualClock,
        caplog: pytest.LogCaptureFixture,
    ) -> None:
        locks = [rq.lock(f"job-{i}", ttl=30) for i in range(3)]
        assert all(lock.acquire() for lock in locks), "a fresh store grants every lease"
        first = {lock.name: lock.token for lock in locks}
        engine.rewrite = lambda op, result: (
            {**result, "renewed": "yes"} if op["op"] == "renew" and op["name"] == "job-1"
            else result)
        caplog.set_level(logging.DEBUG, logger="queen_sync")
        clock.advance(10.01)
        for _ in range(8):  # the first renew, then the unreadable lease's quicker retries
            rq.renewer.tick()
            clock.advance(1.5)
        broken, healthy = locks[1], [locks[0], locks[2]]
        assert broken.held and broken.token == first["job-1"], (
            f"the lease with the unreadable answer keeps its token, unsure: {broken!r}")
        stored = {h["slot"]: h["token"] for lock in healthy
                  for h in rq.locks.get(lock.name)["holders"]}
        for lock in healthy:
            assert lock.token != first[lock.name] and lock.token == rq.locks.get(
                lock.name)["holders"][0]["token"], (
                f"{lock.name}'s renewal, answered in the same batch, was not applied: {lock!r}")
        assert stored, "the healthy leases are held"
        told = [r.getMessage() for r in caplog.records
                if r.levelno >= logging.WARNING and "job-1" in r.getMessage()]
        assert len(told) == 1, f"one unreadable lease is logged once, not at every retry: {told}"
