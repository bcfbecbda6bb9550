"""Claimed run queues under faults: real worker processes sharing one store, on every engine."""

from __future__ import annotations

import collections
import signal
import time
from pathlib import Path

import pytest
from recipe_workers import Spawn

import queen_sync as qs
from queen_sync.recipes.run_queue import RunQueue

TTL = 1.0
RENEW = TTL / 3

pytestmark = pytest.mark.realtime


class TestFourWorkersWithOneKilledMidRun:
    def test_every_run_completes_exactly_once_and_the_killed_run_is_retaken_with_a_higher_fence(
            self, spawn: Spawn, engine_url: str) -> None:
        with qs.Queen(engine_url) as q:
            runs = RunQueue(q, "batch")
            ids = [f"run-{n:03d}" for n in range(100)]
            for run_id in ids:
                runs.submit(run_id, {"n": run_id})
            common = {"url": engine_url, "queue": "batch", "ttl": TTL, "delay": 0.01}
            victim = spawn("queue_worker", me="victim", hang_on=5, **common)
            others = [spawn("queue_worker", me=f"w{n}", **common) for n in range(3)]
            hung = victim.wait_for("hanging")
            killed_at = victim.signal(signal.SIGKILL)
            for worker in others:
                assert worker.finish() == 0, f"{worker.name} failed: {worker.stderr()}"
            results = runs.results()
            pending = runs.list()

        assert sorted(results) == ids and not pending, (
            f"{len(results)} runs completed, still pending: {[e.run_id for e in pending]}")
        completions = [e for w in [victim, *others] for e in w.events("completed")]
        per_run = collections.Counter(e["run"] for e in completions)
        assert sorted(per_run) == ids and set(per_run.values()) == {1}, (
            f"runs completed more than once: {[r for r, n in per_run.items() if n > 1]}")
        for event in completions:
            record = results[event["run"]]
            assert (record.holder, record.fence) == (event["me"], event["fence"]), (
                f"completion record {record} is not the completion {event}")

        retaken = results[hung["run"]]
        retake = next(e for w in others for e in w.events("claimed") if e["run"] == hung["run"])
        assert retaken.holder != "victim" and retaken.fence > hung["fence"], (
            f"{hung['run']} was not retaken with a higher fence: {retaken} after {hung}")
        assert (hung["attempt"], retaken.attempts) == (1, 2), (
            f"the killed claim was not counted as an attempt: {hung}, then {retaken}")
        others_first = {r.attempts for run_id, r in results.items() if run_id != hung["run"]}
        assert others_first == {1}, f"runs nobody killed took {others_first} attempts"
        waited = retake["at"] - killed_at
        assert TTL - RENEW - 0.05 <= waited <= TTL + 1.0, (
            f"retaken {waited:.3f}s after the kill: not after the claim's expiry")


class TestAStalledWorker:
    def test_its_checkpoint_raises_fenced_out_once_its_claim_was_retaken(
            self, spawn: Spawn, tmp_path: Path, engine_url: str) -> None:
        go = tmp_path / "go"
        with qs.Queen(engine_url) as q:
            runs = RunQueue(q, "stall")
            runs.submit("only")
            stalled = spawn("stale_claimer", me="stalled", url=engine_url, queue="stall",
                            ttl=TTL, go=str(go))
            first = stalled.wait_for("claimed")
            stalled.signal(signal.SIGSTOP)
            time.sleep(TTL + 0.2)
            claim = runs.claim(holder="successor", ttl=TTL)
            assert claim is not None, "the stalled worker's expired claim could not be retaken"
            go.touch()
            stalled.signal(signal.SIGCONT)
            fenced = stalled.wait_for("fenced")
            claim.complete("done by the successor")

        assert (fenced["presented"], fenced["current"]) == (first["fence"], claim.fence), (
            f"the refusal should name the stale fence and the current one: {fenced}")
        assert claim.fence > first["fence"], "the retaken claim's fence is not higher"


class TestListingClaims:
    def test_an_expired_claim_is_listed_as_unclaimed_with_its_last_holder(
            self, spawn: Spawn, tmp_path: Path, engine_url: str) -> None:
        with qs.Queen(engine_url) as q:
            runs = RunQueue(q, "listing")
            runs.submit("a")
            runs.submit("b")
            dead = spawn("stale_claimer", me="dead", url=engine_url, queue="listing", ttl=TTL,
                         go=str(tmp_path / "never"))
            claimed = dead.wait_for("claimed")
            held = [e.run_id for e in runs.list(claimed=True)]
            dead.signal(signal.SIGKILL)
            time.sleep(TTL + 0.2)
            unclaimed = {e.run_id: e for e in runs.list(claimed=False)}
            still_held = runs.list(claimed=True)

        assert held == [claimed["run"]], f"the live claim was not listed as claimed: {held}"
        entry = unclaimed.get(claimed["run"])
        assert entry is not None and entry.claim is not None, (
            f"the dead worker's run is missing from list(claimed=False): {unclaimed}")
        assert entry.claim.expired and entry.claim.holder == "dead", f"claim: {entry.claim}"
        assert entry.claim.fence == claimed["fence"], f"claim fence: {entry.claim}"
        assert not still_held, f"an expired claim was listed as claimed: {still_held}"


class TestARunThatKeepsKillingItsWorkers:
    def test_it_is_dead_lettered_once_past_max_attempts_with_its_last_claim(
            self, spawn: Spawn, tmp_path: Path, engine_url: str) -> None:
        with qs.Queen(engine_url) as q:
            runs = RunQueue(q, "poison", max_attempts=2)
            runs.submit("poison", {"bad": True})
            claims = []
            for n in range(2):
                doomed = spawn("stale_claimer", me=f"doomed-{n}", url=engine_url,
                               queue="poison", ttl=TTL, max_attempts=2,
                               go=str(tmp_path / "never"))
                claims.append(doomed.wait_for("claimed"))
                doomed.signal(signal.SIGKILL)
                time.sleep(TTL + 0.2)
            third = runs.claim(holder="third", ttl=TTL)
            dead = runs.dead_letters()
            pending = runs.list()

        assert [c["attempt"] for c in claims] == [1, 2], f"attempts counted: {claims}"
        assert third is None and not pending, (
            f"a run past max_attempts was offered again: {third}, pending {pending}")
        listed = [(d.run_id, d.attempts, d.payload) for d in dead]
        assert listed == [("poison", 2, {"bad": True})], f"dead letters: {dead}"
        last = dead[0].claim
        assert last is not None and (last.holder, last.fence) == ("doomed-1", claims[1]["fence"]), (
            f"the dead letter does not name the last claim: {last}")
