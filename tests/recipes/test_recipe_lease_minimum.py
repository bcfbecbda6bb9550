"""The recipes refuse a lease shorter than the one-second minimum at the call that gives it."""

from __future__ import annotations

from typing import Any, Callable

import pytest

import queen_sync as qs
from queen_sync.recipes.fenced_export import FencedExport, FencedKv
from queen_sync.recipes.leader_election import LeaderElection
from queen_sync.recipes.run_queue import RunQueue


class TestTheRecipesLeaseMinimum:
    @pytest.mark.parametrize("ttl", [0.5, "250ms"])
    def test_every_recipe_refuses_a_sub_second_lease_before_any_io(self, sqlite_url: str,
                                                                   ttl: Any) -> None:
        with qs.Queen(sqlite_url) as q:
            calls: dict[str, Callable[[], Any]] = {
                "LeaderElection": lambda: LeaderElection(q, "leader", ttl=ttl),
                "FencedExport": lambda: FencedExport(q, "export", FencedKv(q, "out"), ttl=ttl),
                # An empty queue: nothing to claim, so only the check itself can refuse it.
                "RunQueue.claim": lambda: RunQueue(q, "jobs").claim(ttl=ttl),
            }
            for what, call in calls.items():
                with pytest.raises(ValueError, match="at least 1 second"):
                    call()
                    pytest.fail(f"{what} took ttl={ttl!r}")

    def test_a_claim_of_exactly_the_minimum_is_taken(self, sqlite_url: str) -> None:
        with qs.Queen(sqlite_url) as q:
            runs = RunQueue(q, "jobs")
            assert runs.submit("r1")
            claim = runs.claim(ttl=1)
            assert claim is not None, "a one-second claim is allowed"
            claim.release()
