"""The recipes re-read the permit durably before resuming work, on every engine.

A permit taken away (an operator's break-glass release) and re-taken by another client
in the window between winning a lease and starting its work passes every local check;
only ``lock.verify()`` sees it. The window is made deterministic by a hook on the call
that wins the lease: the theft happens right after that call lands.
"""

from __future__ import annotations

import threading
from typing import Any, Iterator, Mapping

import pytest

import queen_sync as qs
from queen_sync.recipes.leader_election import LeaderElection
from queen_sync.recipes.run_queue import RunQueue
from queen_sync.testing import FaultyEngine


@pytest.fixture
def faulty(engine_url: str) -> Iterator[tuple[qs.Queen, FaultyEngine, qs.Queen]]:
    """A client over a FaultyEngine, and a second, plain client (the thief) on one store."""
    engine = FaultyEngine(engine_url)
    with qs.Queen(engine=engine) as worker, qs.Queen(engine_url) as thief:
        yield worker, engine, thief


def _steal(thief: qs.Queen, name: str) -> qs.Lock:
    """Break-glass release of the current permit of ``name``, then take it for ``thief``."""
    holders = thief.locks.get(name)["holders"]
    assert holders, f"nobody held {name!r} when the theft was due"
    thief.locks.release(name, token=holders[0]["token"], slot=holders[0]["slot"])
    taken = thief.lock(name, ttl=30)
    assert taken.acquire(), f"the thief could not take {name!r} after the break-glass release"
    return taken


class TestARunWhoseClaimWasTakenAwayBeforeItRuns:
    def test_it_is_dropped_without_running_and_the_new_holder_keeps_it(
            self, faulty: tuple[qs.Queen, FaultyEngine, qs.Queen]) -> None:
        worker, engine, thief = faulty
        runs = RunQueue(worker, "verify")
        assert runs.submit("r1", {"n": 1})
        lock_name = "queen-sync.run-queue/verify/r1"
        stop = threading.Event()
        stolen: list[qs.Lock] = []

        def after_claim_lands(route: str, body: Mapping[str, Any]) -> None:
            stolen.append(_steal(thief, lock_name))
            stop.set()  # the worker's loop ends after this one claim

        # The claim's last call is its guarded transaction: steal right after it lands.
        engine.hook_next(1, route="transaction", applied=True, hook=after_claim_lands)
        ran: list[str] = []
        completed = runs.work(lambda claim: ran.append(claim.run_id), ttl=30, stop=stop)

        assert stolen, "the hook never fired: the window was not exercised"
        assert ran == [], f"fn ran for a claim whose permit was taken away: {ran}"
        assert completed == 0, f"work() counted {completed} completions of a stolen run"
        assert "r1" not in runs.results(), "the stolen run was completed by the old holder"
        assert stolen[0].verify(), "dropping the run took the permit from its new holder"
        entries = runs.list()
        assert [e.run_id for e in entries] == ["r1"], f"the run left the queue: {entries}"


class TestATermWhosePermitWasTakenAwayBeforeItStarts:
    def test_on_elected_is_not_called_for_it_and_a_later_term_is_elected_higher(
            self, faulty: tuple[qs.Queen, FaultyEngine, qs.Queen]) -> None:
        worker, engine, thief = faulty
        elected: list[int] = []
        stolen: list[qs.Lock] = []
        theft_done = threading.Event()

        def after_win_lands(route: str, body: Mapping[str, Any]) -> None:
            stolen.append(_steal(thief, "verify-leader"))
            theft_done.set()

        engine.hook_next(1, route="locks", op="acquire", applied=True, hook=after_win_lands)
        election = LeaderElection(worker, "verify-leader", ttl=1.5, on_elected=elected.append)
        with election:
            assert theft_done.wait(5), "the candidate never won: the window was not exercised"
            stolen_token = election.lock.token  # None once verify marked it lost
            assert not election.wait_elected(timeout=0.3), (
                "the candidate counted itself elected for a term whose permit was taken away")
            thief_token = stolen[0].token
            assert thief_token is not None
            stolen[0].release()
            assert election.wait_elected(timeout=5), "the candidate never led again"
        assert len(elected) == 1 and elected[0] > thief_token, (
            f"on_elected calls {elected}: want exactly one, above the thief's {thief_token} "
            f"(the stolen term's token was {stolen_token})")
