"""Each LeaderElection object is one candidate: a shared identity or racing starts never
make two leaders, or two campaigns on one handle."""

from __future__ import annotations

import secrets
import threading
from pathlib import Path

import pytest

import queen_sync as qs
from queen_sync.recipes.leader_election import LeaderElection, LeaderObserver

STARTERS = 8


def _url(tmp_path: Path) -> str:
    return "sqlite://" + str(tmp_path / "q.db")


class TestCandidatesSharingAnIdentity:
    def test_never_lead_at_once_and_the_second_waits_for_the_first(self, tmp_path: Path) -> None:
        name = f"election-{secrets.token_hex(4)}"
        with qs.Queen(_url(tmp_path)) as old_node, qs.Queen(_url(tmp_path)) as new_node:
            first = LeaderElection(old_node, name, ttl="10s", identity="node-a").start()
            second = LeaderElection(new_node, name, ttl="10s", identity="node-a")
            try:
                assert first.wait_elected(5), "the first candidate leads an empty election"
                second.start()
                assert not second.wait_elected(1.0), (
                    f"a restarted node took over a live term: tokens {first.token} and "
                    f"{second.token} lead at once")
                first.stop()
                assert second.wait_elected(5), "the second leads once the first resigned"
                assert not first.is_leader
            finally:
                second.stop()
                first.stop()

    def test_the_leader_is_reported_by_the_identity_it_was_given(self, tmp_path: Path) -> None:
        name = f"election-{secrets.token_hex(4)}"
        with qs.Queen(_url(tmp_path)) as q, \
                LeaderElection(q, name, ttl="10s", identity="node-a") as election:
            assert election.wait_elected(5)
            assert election.identity == "node-a", election.identity
            leader = election.leader()
            assert leader is not None and leader.identity == "node-a", leader
            assert election.lock.owner != "node-a", (
                "the lease's owner is this candidate's own, not the shared identity")


class TestStartCalledFromManyThreads:
    def test_starts_one_campaign_and_one_term(self, tmp_path: Path) -> None:
        elected: list[int] = []
        name = f"election-{secrets.token_hex(4)}"
        with qs.Queen(_url(tmp_path)) as q:
            election = LeaderElection(q, name, ttl="10s", on_elected=elected.append)
            gate = threading.Barrier(STARTERS)

            def start() -> None:
                gate.wait()
                election.start()

            starters = [threading.Thread(target=start) for _ in range(STARTERS)]
            for thread in starters:
                thread.start()
            for thread in starters:
                thread.join()
            assert election.wait_elected(5)
            campaigns = [t for t in threading.enumerate()
                         if t.name == f"leader-election-{name}"]
            election.stop()
            assert len(campaigns) == 1, f"{len(campaigns)} campaign threads on one handle"
            assert len(elected) == 1, f"on_elected ran {len(elected)} times for one term"

    def test_of_an_observer_starts_one_watch(self, tmp_path: Path) -> None:
        name = f"election-{secrets.token_hex(4)}"
        with qs.Queen(_url(tmp_path)) as q:
            observer = LeaderObserver(q, name, every=0.05)
            gate = threading.Barrier(STARTERS)

            def start() -> None:
                gate.wait()
                observer.start()

            starters = [threading.Thread(target=start) for _ in range(STARTERS)]
            for thread in starters:
                thread.start()
            for thread in starters:
                thread.join()
            watches = [t for t in threading.enumerate() if t.name == f"leader-observer-{name}"]
            observer.stop()
            assert len(watches) == 1, f"{len(watches)} observer threads for one observer"


class TestAClosedClient:
    def test_ends_the_campaign_quietly_saying_why(self, tmp_path: Path,
                                                  caplog: pytest.LogCaptureFixture) -> None:
        q = qs.Queen(_url(tmp_path))
        election = LeaderElection(q, f"election-{secrets.token_hex(4)}", ttl="1s").start()
        assert election.wait_elected(5)
        q.close()
        thread = election._loops.thread
        assert thread is not None
        thread.join(10)  # the term ends within its lease, then the campaign sees the close
        assert not thread.is_alive(), "the campaign goes on against a closed client"
        last_error = election.health().last_error
        assert last_error is not None and "closed" in last_error, f"says why: {last_error!r}"
        assert not [r for r in caplog.records if r.exc_info], (
            f"a traceback was logged: {[r.getMessage() for r in caplog.records]}")
        election.stop()

    def test_ends_an_observer_with_one_warning(self, tmp_path: Path,
                                               caplog: pytest.LogCaptureFixture) -> None:
        q = qs.Queen(_url(tmp_path))
        observer = LeaderObserver(q, f"election-{secrets.token_hex(4)}", every=0.01).start()
        q.close()
        thread = observer._loops.thread
        assert thread is not None
        thread.join(5)
        assert not thread.is_alive(), "the observer polls a closed client forever"
        assert not [r for r in caplog.records if r.exc_info], (
            f"a traceback was logged: {[r.getMessage() for r in caplog.records]}")
        with pytest.raises(qs.QueenError, match="closed"):
            observer.wait_for_leader(timeout=0.1)
