"""A run queue refuses bad arguments at the call that takes them, and loses no run to them."""

from __future__ import annotations

from typing import Any, Iterator

import pytest

import queen_sync as qs
from queen_sync.recipes.run_queue import Claim, RunQueue


async def _async_fn(claim: Claim) -> None:
    return None


def _generator_fn(claim: Claim) -> Iterator[int]:
    yield 1


class TestWorkWithAFunctionThatCannotRunARun:
    @pytest.mark.parametrize("fn", [None, "resize", 3, _async_fn, _generator_fn],
                             ids=["None", "str", "int", "async", "generator"])
    def test_is_refused_before_a_claim_so_no_attempt_is_spent(
            self, client: qs.Queen, fn: Any) -> None:
        runs = RunQueue(client, "jobs", max_attempts=1)
        runs.submit("r1", {"n": 1})
        with pytest.raises(TypeError, match="fn"):
            runs.work(fn, ttl=30)
        entries = [(e.run_id, e.attempts, e.claimed) for e in runs.list()]
        done = runs.work(lambda claim: claim.payload["n"], ttl=30)

        assert entries == [("r1", 0, False)], f"the refused call touched the run: {entries}"
        assert (done, list(runs.dead_letters())) == (1, []), (
            "the run was not completed by a good call after the refused one")

