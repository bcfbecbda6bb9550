"""Leader election's depth on every engine: observers that never campaign, and health."""

from __future__ import annotations

import logging
import secrets
import signal
import threading
import time
from pathlib import Path
from typing import Any, Optional

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from manual_clock import ManualClock
from recipe_workers import Spawn, Worker

import queen_sync as qs
from queen_sync.recipes.leader_election import (
    Leader,
    LeaderElection,
    LeaderObserver,
    observe,
)

TTL = 1.0


def _fresh_name() -> str:
    return f"election-{secrets.token_hex(4)}"


def _elect(q: qs.Queen, name: str, identity: str) -> LeaderElection:
    election = LeaderElection(q, name, ttl=30, identity=identity).start()
    assert election.wait_elected(10), f"{identity} was never elected"
    return election


class TestAnObserverThatNeverCampaigns:
    def test_it_hears_of_each_new_term_once_with_its_leader_and_a_higher_token(
            self, q: qs.Queen) -> None:
        name = _fresh_name()
        heard: list[Leader] = []
        observer = LeaderObserver(q, name, on_new_leader=heard.append)
        nobody = observer.poll()
        first = _elect(q, name, "first")
        seen_first = observer.poll()
        assert first.lock.renew(), "the leader could not renew"
        after_renewal = observer.poll()
        first.stop()
        second = _elect(q, name, "second")
        seen_second = observer.poll()
        holders = [h["owner"] for h in q.locks.get(name)["holders"]]
        second.stop()

        assert nobody is None, f"a leader was read before any was elected: {nobody}"
        assert [(t.identity, t.token) for t in heard] == [
            ("first", seen_first.token if seen_first else None),
            ("second", seen_second.token if seen_second else None)], (
            f"terms heard: {heard}")
        assert after_renewal is not None and after_renewal.token > heard[0].token, (
            "a renewal was not seen as the same term at a newer token")
        assert heard[1].token > after_renewal.token, (
            f"the second term's token {heard[1].token} is not above the first's "
            f"{after_renewal.token}")
        assert holders == [second.lock.owner], (
            f"the observer took part in the election: {holders}")

    def test_a_started_observer_survives_a_callback_that_raises_and_reports_terms_in_order(
            self, q: qs.Queen, caplog: pytest.LogCaptureFixture) -> None:
        name = _fresh_name()
        heard: list[Leader] = []
        got_two = threading.Event()

        def on_new_leader(leader: Leader) -> None:
            heard.append(leader)
            if len(heard) == 2:
                got_two.set()
            if len(heard) == 1:
                raise RuntimeError("a callback bug")

        with caplog.at_level(logging.ERROR, logger="queen_sync.recipes"), observe(
                q, name, on_new_leader=on_new_leader, every=0.02) as observer:
            first = _elect(q, name, "first")
            deadline = time.monotonic() + 10
            while not heard and time.monotonic() < deadline:
                time.sleep(0.01)
            first.stop()
            second = _elect(q, name, "second")
            assert got_two.wait(10), f"the second term was not heard: {heard}"
            alive = observer.observing
            second.stop()

        assert [t.identity for t in heard] == ["first", "second"], f"heard {heard}"
        assert heard[1].token > heard[0].token, f"tokens did not rise: {heard}"
        assert alive, "the observer's thread died when its callback raised"
        assert "a callback bug" in caplog.text, "the callback's failure was not logged"

    @pytest.mark.parametrize("bad, error", [
        ({"name": "a#b"}, ValueError), ({"every": 0}, ValueError),
        ({"every": "2h"}, ValueError), ({"every": True}, TypeError),
        ({"on_new_leader": 3}, TypeError),
    ])
    def test_bad_arguments_are_refused_at_construction(
            self, sqlite_url: str, bad: dict[str, Any], error: type) -> None:
        with qs.Queen(sqlite_url) as q, pytest.raises(error):
            LeaderObserver(q, **{"name": "ok", **bad})


class _Model:
    """The election's lock as the engine holds it: which holding is current, and its owner."""

    def __init__(self) -> None:
        self.holding: Optional[tuple[int, str]] = None  # (holding number, owner)
        self.token = 0  # the current holding's token (meaningless while nobody holds)
        self.count = 0
        self.last_released_owner: Optional[str] = None


class TestTermsSeenByPollsAtAnyMoment:
    @settings(max_examples=20, deadline=None, suppress_health_check=[
        HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
    @given(steps=st.lists(st.sampled_from(["acquire", "renew", "release", "poll"]),
                          min_size=1, max_size=25),
           owners=st.lists(st.sampled_from(["a", "b", "c"]), min_size=25, max_size=25))
    def test_each_holding_current_at_a_poll_is_reported_once_and_tokens_only_rise(
            self, q: qs.Queen, steps: list[str], owners: list[str]) -> None:
        name = _fresh_name()
        heard: list[Leader] = []
        observer = LeaderObserver(q, name, on_new_leader=heard.append)
        model, reported, expected = _Model(), set(), []
        for step, owner in zip(steps, owners):
            if step == "acquire" and model.holding is None:
                if owner == model.last_released_owner:
                    time.sleep(0.002)  # the engine's `since` has millisecond resolution
                answer = q.locks.acquire(name, ttl=60, owner=owner)
                assert answer["acquired"], f"a free lock was refused: {answer}"
                model.count += 1
                model.holding, model.token = (model.count, owner), int(answer["token"])
            elif step == "renew" and model.holding is not None:
                answer = q.locks.renew(name, token=model.token, ttl=60, owner=model.holding[1])
                assert answer["renewed"], f"the holder could not renew: {answer}"
                model.token = int(answer["token"])
            elif step == "release" and model.holding is not None:
                assert q.locks.release(name, token=model.token)["released"], "release failed"
                model.last_released_owner, model.holding = model.holding[1], None
            elif step == "poll":
                seen = observer.poll()
                held_token = model.token if model.holding is not None else None
                assert (seen.token if seen else None) == held_token, (
                    f"poll saw {seen}, the model holds {model.holding} at {held_token}")
                if model.holding is not None and model.holding[0] not in reported:
                    reported.add(model.holding[0])
                    expected.append((model.holding[1], model.token))
        if model.holding is not None:
            q.locks.release(name, token=model.token)

        assert [(t.identity, t.token) for t in heard] == expected, (
            f"steps {steps}: heard {heard}, expected {expected}")
        tokens = [t.token for t in heard]
        assert tokens == sorted(set(tokens)), f"reported tokens did not rise: {tokens}"


class TestHealth:
    def test_it_says_whether_this_process_leads_with_which_token_and_for_how_long(
            self, sqlite_url: str, clock: ManualClock) -> None:
        with qs.Queen(sqlite_url, clock=clock, renew_thread=False) as q:
            election = LeaderElection(q, "health", ttl=30)
            before = election.health()
            election.start()
            assert election.wait_elected(10), "never elected"
            fresh = election.health()
            clock.advance(4)
            later = election.health()
            clock.advance(21)  # 25s without a renewal: renewals are failing
            stale = election.health()
            clock.advance(6)  # past the lease's local deadline
            lapsed = election.health()
            election.stop()
            stopped = election.health()

        assert (before.leading, before.campaigning, before.token) == (False, False, None), before
        assert fresh.leading and fresh.token == election.lock.last_token, fresh
        assert (fresh.seconds_left, fresh.renewed_ago, fresh.terms) == (30, 0, 1), fresh
        assert fresh.campaigning and fresh.renewing, fresh
        assert (later.seconds_left, later.renewed_ago) == (26, 4), later
        assert stale.leading and not stale.renewing, f"25s without renewal looks fine: {stale}"
        assert (lapsed.leading, lapsed.token, lapsed.seconds_left, lapsed.renewed_ago) == (
            False, None, 0.0, None), lapsed
        assert not stopped.campaigning, stopped

    def test_it_reports_the_engine_failure_that_keeps_the_campaign_from_winning(
            self, tmp_path: Path) -> None:
        from queen_sync.testing import LocalBroker

        broker = LocalBroker(str(tmp_path / "broker.db")).start()
        url = broker.url
        broker.close()
        with qs.Queen(url, timeout=0.3) as q:
            election = LeaderElection(q, "unreachable", ttl=3).start()
            deadline = time.monotonic() + 10
            while election.health().last_error is None and time.monotonic() < deadline:
                time.sleep(0.02)
            health = election.health()
            election.stop()

        assert health.last_error, f"the failure was not reported: {health}"
        assert health.campaigning and not health.leading, health


def _first_leader(observer: Worker, after: float = 0.0,
                  other_than: Optional[str] = None) -> dict[str, Any]:
    return observer.wait_for("leader", where=lambda e: e["at"] > after
                             and e["identity"] != other_than)


class TestAnObserverWhenTheLeaderIsKilled:
    @pytest.mark.realtime
    def test_it_sees_the_new_leader_with_a_higher_token(
            self, engine_url: str, spawn: Spawn, tmp_path: Path) -> None:
        log = tmp_path / "fenced-log.db"
        name = _fresh_name()
        candidates = {f"c{n}": spawn("candidate", me=f"c{n}", url=engine_url, name=name,
                                     ttl=TTL, log=str(log)) for n in range(2)}
        watcher = spawn("observer", me="watcher", url=engine_url, name=name, every=0.05)
        first = _first_leader(watcher)
        with qs.Queen(engine_url) as q:
            before = q.locks.get(name)["holders"]
            killed_at = candidates[first["identity"]].signal(signal.SIGKILL)
            second = _first_leader(watcher, after=killed_at, other_than=first["identity"])

        # A candidate's lease owner is its identity plus a suffix of its own.
        assert [h["owner"].rsplit("/", 1)[0] for h in before] == [first["identity"]], (
            f"holders {before}")
        assert second["identity"] in candidates, f"an unknown leader was reported: {second}"
        assert second["token"] > int(before[0]["token"]) >= first["token"], (
            f"the new leader's token {second['token']} is not above the killed one's "
            f"{before[0]['token']}")
        took = second["at"] - killed_at
        assert took <= TTL + TTL / 3 + 1.0, f"the observer heard of the successor after {took:.2f}s"
        tokens = [e["token"] for e in watcher.events("leader")]
        assert tokens == sorted(tokens), f"the observer reported tokens out of order: {tokens}"
