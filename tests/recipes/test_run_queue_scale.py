"""The run queue's cost at scale, on every engine: what a claim reads, what history keeps."""

from __future__ import annotations

import time
from typing import Iterator, Optional

import pytest
from counting_engine import CountingEngine

import queen_sync as qs
from queen_sync.recipes.run_queue import RUNS_NS, Claim, RunQueue

DAY = 86_400.0


@pytest.fixture
def counted(engine_url: str) -> Iterator[tuple[qs.Queen, CountingEngine]]:
    engine = CountingEngine(engine_url)
    with qs.Queen(engine=engine) as client:
        yield client, engine


def _submit(runs: RunQueue, prefix: str, count: int) -> None:
    for n in range(count):
        assert runs.submit(f"{prefix}-{n:04d}", {"n": n}), f"{prefix}-{n:04d} was refused"


def _claim_cost(client: qs.Queen, engine: CountingEngine) -> tuple[int, int]:
    """Calls and rows of one claim by a fresh worker (its cursor at the start), given back."""
    claim, calls, rows = engine.measure(lambda: RunQueue(client, "scale").claim(ttl=30))
    assert claim is not None, "nothing was claimable"
    claim.release()
    return calls, rows


class TestAClaimReadsABoundedPage:
    def test_the_rows_a_claim_reads_do_not_grow_with_completed_runs_or_queue_length(
            self, counted: tuple[qs.Queen, CountingEngine]) -> None:
        client, engine = counted
        runs = RunQueue(client, "scale")
        _submit(runs, "r", 40)
        baseline = _claim_cost(client, engine)
        _submit(runs, "h", 150)  # history: sorts before the pending runs, all completed
        for _ in range(150):
            claim: Optional[Claim] = runs.claim(ttl=30)
            assert claim is not None and claim.run_id.startswith("h-"), f"claimed {claim}"
            claim.complete("done")
        after_history = _claim_cost(client, engine)
        _submit(runs, "s", 200)
        after_length = _claim_cost(client, engine)

        assert after_history[1] <= baseline[1], (
            f"a claim read {after_history[1]} rows after 150 completions, {baseline[1]} before")
        assert after_length[1] <= baseline[1], (
            f"a claim read {after_length[1]} rows with 240 runs pending, {baseline[1]} with 40")
        assert max(after_history[0], after_length[0]) <= baseline[0], (
            f"calls per claim grew: {baseline[0]} -> {after_history[0]}, {after_length[0]}")


class TestCompletedRecordsAreKeptForTheRetention:
    @pytest.mark.parametrize("retention, seconds", [(None, 7 * DAY), ("2d", 2 * DAY)])
    def test_a_completion_record_expires_after_the_queues_retention(
            self, q: qs.Queen, retention: Optional[str], seconds: float) -> None:
        runs = (RunQueue(q, "kept") if retention is None
                else RunQueue(q, "kept", retention=retention))
        runs.submit("one")
        claim = runs.claim(ttl=30)
        assert claim is not None, "the run was not claimable"
        claim.complete("result")
        record = q.kv.get(RUNS_NS, "kept/done/one")

        assert record, "no completion record was written"
        expires_at = record["expiresAt"]
        assert expires_at is not None, "the completion record is kept forever"
        left = expires_at / 1000 - time.time()
        assert abs(left - seconds) < 300, f"it expires in {left:.0f}s, not {seconds:.0f}s"
        assert runs.results()["one"].result == "result", "the result is not listed"
