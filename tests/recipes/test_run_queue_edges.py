"""A run queue at its edges: a completion whose answer was lost, and run ids at the length limit."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import queen_sync as qs
from queen_sync.recipes.run_queue import RunQueue
from queen_sync.testing import FaultyEngine


class TestACompletionWhoseAnswerWasLost:
    def test_runs_the_run_once_takes_it_off_the_queue_and_frees_its_claim(
            self, tmp_path: Path) -> None:
        engine = FaultyEngine("sqlite://" + str(tmp_path / "q.db"))
        executions: list[str] = []
        with qs.Queen(engine=engine) as q:
            runs = RunQueue(q, "thumbnails")
            runs.submit("img-1", {"size": 1})
            # The completion commits, then its answer is lost on the way back.
            engine.fail_next(route="transaction", op="putIfAbsent", applied=True)
            with pytest.raises(qs.EngineError):
                runs.work(lambda claim: executions.append(claim.run_id), ttl="30s")
            stop = threading.Event()
            stopper = threading.Timer(1.0, stop.set)
            stopper.start()
            runs.work(lambda claim: executions.append(claim.run_id), ttl="30s", stop=stop,
                      poll=0.05)
            stopper.join()
            pending = [(entry.run_id, entry.claimed) for entry in runs.list()]
            completed = sorted(runs.results())
            claim_holders = q.locks.get(runs._lock_name("img-1")).get("holders")
        engine.close()
        assert executions == ["img-1"], f"a completed run ran again: {executions}"
        assert (completed, pending) == (["img-1"], []), (
            f"results {completed}, still pending {pending}")
        assert not claim_holders, f"the claim's lease was kept: {claim_holders}"


class TestRunIdsAtTheLengthLimit:
    @settings(max_examples=12, deadline=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(queue_bytes=st.integers(1, 64), id_bytes=st.integers(160, 185))
    @example(queue_bytes=64, id_bytes=180)  # the longest of each that submit once accepted
    def test_a_run_id_submit_accepts_can_be_claimed_and_completed(
            self, tmp_path_factory: pytest.TempPathFactory, queue_bytes: int,
            id_bytes: int) -> None:
        url = "sqlite://" + str(tmp_path_factory.mktemp("ids") / "q.db")
        with qs.Queen(url) as q:
            runs = RunQueue(q, "q" * queue_bytes)
            try:
                runs.submit("a" * id_bytes, {"n": 1})
            except ValueError as exc:
                assert "run id" in str(exc), f"the refusal names what is too long: {exc}"
                return
            try:
                done = runs.work(lambda claim: claim.payload["n"], ttl="30s")
            except ValueError as exc:
                raise AssertionError(f"a run submit accepted cannot be claimed: {exc}") from exc
            assert done == 1, f"the run should complete, {done} did"
