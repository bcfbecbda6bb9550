"""A claim whose commit's answer is lost: the attempt it counted is the run's, once.

The claim counts its attempt on the run's record in one guarded commit. When the answer
is lost, the commit may or may not have landed; counted but taken for failed, the run
would be dead-lettered at its next claim (with ``max_attempts=1``) without ever running.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

import queen_sync as qs
from queen_sync.recipes.run_queue import RunQueue
from queen_sync.testing import FaultyEngine


class TestAClaimsCommitWithItsAnswerLost:
    @pytest.mark.parametrize("applied", [True, False], ids=["landed", "not landed"])
    def test_the_run_is_run_once_and_never_dead_lettered_unrun(
            self, tmp_path: Path, applied: bool) -> None:
        engine = FaultyEngine(f"sqlite:///{tmp_path}/q.db")
        with qs.Queen(engine=engine) as q:
            runs = RunQueue(q, "jobs", max_attempts=1)
            runs.submit("r1", {"n": 1})
            ran: list[str] = []

            def fn(claim: Any) -> str:
                ran.append(claim.run_id)
                return "done"

            engine.fail_next(route="transaction", applied=applied)
            for _ in range(2):
                try:
                    runs.work(fn, ttl=5)
                except qs.EngineUnavailableError:
                    assert not applied, "a claim that landed was reported as failed"
            dead = [(letter.run_id, letter.attempts) for letter in runs.dead_letters()]
            results = dict(runs.results())
        assert ran == ["r1"], f"fn ran {ran}; dead letters {dead}"
        assert dead == [] and "r1" in results, (dead, results)

    def test_a_renewal_landing_before_the_answer_is_lost_still_finds_the_claim_landed(
            self, tmp_path: Path) -> None:
        """The lease renews (its token rises) while the lost answer is awaited: the record
        carries the fence the claim was written with, not the token of now."""
        engine = FaultyEngine(f"sqlite:///{tmp_path}/q.db")
        with qs.Queen(engine=engine) as q:
            runs = RunQueue(q, "jobs", max_attempts=1)
            runs.submit("r1", {"n": 1})
            ran: list[str] = []

            def lose_after_a_renewal(route: str, body: Any) -> None:
                time.sleep(0.6)  # past a third of the 1 s lease: the renewer renews meanwhile
                raise qs.EngineUnavailableError("the answer was lost")

            engine.hook_next(1, hook=lose_after_a_renewal, route="transaction", applied=True)
            runs.work(lambda claim: ran.append(claim.run_id), ttl=1)
            dead = [(letter.run_id, letter.attempts) for letter in runs.dead_letters()]
        assert ran == ["r1"] and dead == [], f"fn ran {ran}; dead letters {dead}"
