"""A leader election's life: start and stop in any order, failures of its thread, a close."""

from __future__ import annotations

import logging
import random
import secrets
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any, Callable, Optional, Union

import pytest
from counting_engine import CountingEngine
from polling import wait_for

import queen_sync as qs
from queen_sync.recipes.leader_election import Leader, LeaderElection, LeaderObserver
from queen_sync.testing import FaultyEngine


def _fresh_name() -> str:
    return f"election-{secrets.token_hex(4)}"


@contextmanager
def campaign_threads_start_late(seconds: float) -> Iterator[None]:
    """Hold each campaign thread started meanwhile for ``seconds`` before its first call."""

    def hook(frame: FrameType, event: str, arg: Any) -> None:
        sys.settrace(None)  # this thread's first call only
        if threading.current_thread().name.startswith("leader-election-"):
            time.sleep(seconds)

    threading.settrace(hook)
    try:
        yield
    finally:
        threading.settrace(None)


class TestAStopRightAfterStart:
    def test_ends_the_campaign_even_before_its_thread_got_going(self, client: qs.Queen) -> None:
        name = _fresh_name()
        election = LeaderElection(client, name, ttl=30)
        with campaign_threads_start_late(0.1):
            election.start()
            election.stop(timeout=2)
        thread: Optional[threading.Thread] = election._loops.thread
        alive = thread is not None and thread.is_alive()
        holders = client.locks.get(name).get("holders") or []
        election.stop(timeout=5)  # ends it, if the first stop was lost

        assert not alive, "the campaign went on after stop()"
        assert not holders, f"a stopped candidate holds the election: {holders}"

    def test_a_start_after_the_stop_campaigns_again(self, client: qs.Queen) -> None:
        election = LeaderElection(client, _fresh_name(), ttl=3)
        election.start()
        election.stop()
        election.start()
        elected = election.wait_elected(5)  # after the cooldown of one renew interval (1 s)
        election.stop()

        assert elected, "a start() after stop() did not campaign"


class TestACampaignWhoseAcquireRaisesAnErrorQueenSyncDoesNotKnow:
    def test_logs_it_with_its_traceback_keeps_campaigning_and_is_elected_once_it_passes(
            self, sqlite_faults: FaultyEngine, caplog: pytest.LogCaptureFixture) -> None:
        with qs.Queen(engine=sqlite_faults) as q:
            sqlite_faults.fail_next(3, error=RuntimeError("boom"), route="locks", op="acquire")
            election = LeaderElection(q, _fresh_name(), ttl=1).start()
            elected = election.wait_elected(5)
            campaigning = election.health().campaigning
            election.stop()

        told = [r for r in caplog.records if r.name.startswith("queen_sync")
                and "boom" in r.getMessage() + str(r.exc_info and r.exc_info[1])]
        tracebacks = [r for r in told if r.exc_info]
        assert elected and campaigning, "the campaign died on the error instead of retrying"
        assert len(tracebacks) == 1, (
            f"the first failure was not logged once with its traceback: "
            f"{[(r.levelname, r.getMessage()) for r in told]}")
        assert len(told) == 3, f"not each of 3 failures was told: {[r.getMessage() for r in told]}"

    def test_health_reports_it_while_it_lasts(self, sqlite_faults: FaultyEngine) -> None:
        with qs.Queen(engine=sqlite_faults) as q:
            sqlite_faults.fail_next(None, error=RuntimeError("boom"), route="locks",
                                    op="acquire")
            election = LeaderElection(q, _fresh_name(), ttl=1).start()
            deadline = time.monotonic() + 5
            while election.health().last_error is None and time.monotonic() < deadline:
                time.sleep(0.01)
            health = election.health()
            sqlite_faults.clear()
            elected = election.wait_elected(5)
            election.stop()

        assert health.campaigning, "the campaign thread died on the error"
        assert health.last_error is not None and "boom" in health.last_error, (
            f"health does not say what keeps the campaign from winning: {health}")
        assert elected, "the campaign was not elected once the error passed"


class TestWaitingForALeaderWithAStoppedObserver:
    def test_returns_after_one_read_instead_of_polling_until_the_timeout(
            self, sqlite_url: str) -> None:
        engine = CountingEngine(sqlite_url)
        with qs.Queen(engine=engine) as q:
            observer = LeaderObserver(q, _fresh_name(), every=1).start()
            observer.stop()
            started = time.monotonic()
            seen, calls, _ = engine.measure(lambda: observer.wait_for_leader(timeout=5))
            took = time.monotonic() - started

        assert seen is None, f"a leader was seen where there is none: {seen}"
        assert took < 1 and calls <= 1, (
            f"the stopped observer waited {took:.2f}s and read the lock {calls} times")

    def test_a_wait_under_way_when_stop_is_called_returns_at_once(
            self, client: qs.Queen) -> None:
        observer = LeaderObserver(client, _fresh_name(), every=10).start()
        answers: list[Optional[Leader]] = []
        waiter = threading.Thread(target=lambda: answers.append(
            observer.wait_for_leader(timeout=30)))
        waiter.start()
        time.sleep(0.1)
        stopped_at = time.monotonic()
        observer.stop()
        waiter.join(5)
        took = time.monotonic() - stopped_at

        assert not waiter.is_alive() and answers == [None], (
            f"the wait did not end with stop(): {answers}")
        assert took < 1, f"the wait ended {took:.2f}s after stop()"

    def test_still_reports_a_leader_that_is_there(self, client: qs.Queen) -> None:
        name = _fresh_name()
        election = LeaderElection(client, name, ttl=30, identity="node-a").start()
        assert election.wait_elected(5), "never elected"
        observer = LeaderObserver(client, name, every=1).start()
        observer.stop()
        seen = observer.wait_for_leader(timeout=5)
        election.stop()

        assert seen is not None and seen.identity == "node-a", f"the leader was not seen: {seen}"


class TestClosingTheClientOfALeader:
    def test_deposes_it_at_once_for_the_reason_closed_and_ends_the_campaign(
            self, sqlite_url: str) -> None:
        deposed: list[tuple[str, float]] = []
        q = qs.Queen(sqlite_url)
        election = LeaderElection(
            q, _fresh_name(), ttl=30,
            on_deposed=lambda reason: deposed.append((reason, time.monotonic()))).start()
        assert election.wait_elected(5), "never elected"
        closed_at = time.monotonic()
        q.close()
        thread = election._loops.thread
        assert thread is not None
        thread.join(3)  # the lease would have lasted 30 s: anything near that is late
        told = list(deposed)
        election.stop()

        assert [reason for reason, _ in told] == ["closed"], (
            f"on_deposed was told {told} within 3 s of the close")
        late = told[0][1] - closed_at
        assert late < 1, f"on_deposed came {late:.2f}s after the close"
        assert not thread.is_alive(), "the campaign goes on after its client closed"
        assert not election.is_leader and election.health().terms == 1, (
            f"after the close: {election.health()}")


def _threads_of(name: str) -> list[threading.Thread]:
    """The live campaign and observer threads of the election ``name``."""
    return [t for t in threading.enumerate() if t.is_alive() and t.name in (
        f"leader-election-{name}", f"leader-observer-{name}")]


class TestAStartAfterAStopWhoseWaitTimedOut:
    def test_campaigns_again_once_the_stopped_campaign_has_finished_deposing(
            self, client: qs.Queen) -> None:
        events: list[str] = []
        deposing = threading.Event()  # the test lets the first on_deposed return

        def on_deposed(reason: str) -> None:
            events.append(f"deposed:{reason}")
            deposing.wait(5)

        name = _fresh_name()
        election = LeaderElection(client, name, ttl=1, on_deposed=on_deposed,
                                  on_elected=lambda token: events.append("elected")).start()
        assert election.wait_elected(5), "never elected"
        election.stop(timeout=0.05)  # returns while on_deposed still runs
        election.start()
        while_deposing = election.health().campaigning
        deposing.set()
        re_elected = election.wait_elected(5)
        threads = len(_threads_of(name))
        election.stop()

        assert while_deposing, "health() says the restarted candidate does not campaign"
        assert re_elected, f"the start() after a timed-out stop() was lost: {events}"
        assert events == ["elected", "deposed:resigned", "elected", "deposed:resigned"], (
            f"the terms' callbacks did not alternate once each: {events}")
        assert threads == 1, f"{threads} campaign threads ran at once on one handle"

    def test_a_stop_from_the_stopped_campaigns_on_deposed_returns_at_once_and_ends_both(
            self, client: qs.Queen) -> None:
        restarted = threading.Event()
        took: list[float] = []

        def on_deposed(reason: str) -> None:
            if not took and restarted.wait(5):
                started = time.monotonic()
                election.stop(timeout=3)
                took.append(time.monotonic() - started)

        name = _fresh_name()
        election = LeaderElection(client, name, ttl=1, on_deposed=on_deposed).start()
        assert election.wait_elected(5), "never elected"
        election.stop(timeout=0.05)  # returns while on_deposed still runs
        election.start()
        restarted.set()
        wait_for(lambda: not _threads_of(name), timeout=10, what="the campaign to end")

        assert took and took[0] < 1, (
            f"stop() in on_deposed waited {took} s for the campaign waiting for it")


class TestStartAndStopCalledFromManyThreadsAtOnce:
    @pytest.mark.parametrize("kind", ["election", "observer"])
    def test_never_raise_and_the_last_start_after_a_timed_out_stop_runs_for_good(
            self, client: qs.Queen, kind: str) -> None:
        name = _fresh_name()
        events: list[str] = []
        subject: Union[LeaderElection, LeaderObserver] = (
            LeaderElection(client, name, ttl=1, on_elected=lambda token: events.append("e"),
                           on_deposed=lambda reason: events.append("d"))
            if kind == "election" else LeaderObserver(client, name, every=0.01))
        errors: list[str] = []
        gate = threading.Barrier(4)

        def start_and_stop(seed: int) -> None:
            rounds = random.Random(seed)
            gate.wait()
            for _ in range(150):
                try:
                    if rounds.random() < 0.5:
                        subject.start()
                    else:
                        subject.stop(timeout=rounds.choice([0, 0.001, 1]))
                except Exception as exc:  # what the test looks for: any error at all
                    errors.append(repr(exc))

        switch = sys.getswitchinterval()
        sys.setswitchinterval(1e-5)  # more interleavings of start() and stop()
        try:
            workers = [threading.Thread(target=start_and_stop, args=(n,)) for n in range(4)]
            for worker in workers:
                worker.start()
            for worker in workers:
                worker.join(60)
        finally:
            sys.setswitchinterval(switch)
        subject.stop(timeout=0)
        subject.start()
        wait_for(lambda: len(_threads_of(name)) <= 1, timeout=10,
                 what="the stopped threads to end")
        time.sleep(0.05)
        running = (subject.health().campaigning if isinstance(subject, LeaderElection)
                   else subject.observing)
        subject.stop()
        left = _threads_of(name)

        assert not errors, f"start() or stop() raised {len(errors)} times: {errors[:3]}"
        assert running, f"the last start() of the {kind} was lost after a timed-out stop()"
        assert not left, f"threads run on after stop(): {left}"
        assert "".join(events) == "ed" * (len(events) // 2), (
            f"on_elected and on_deposed did not alternate once per term: {''.join(events)}")


def _raise_first_time(raised: BaseException) -> tuple[list[Any], Callable[[Any], None]]:
    """A callback that raises ``raised`` at its first call, and the list of its calls."""
    calls: list[Any] = []

    def callback(arg: Any) -> None:
        calls.append(arg)
        if len(calls) == 1:
            raise raised

    return calls, callback


def _told_with_traceback(caplog: pytest.LogCaptureFixture, raised: BaseException) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name.startswith("queen_sync")
            and r.levelno >= logging.WARNING and r.exc_info and r.exc_info[1] is raised]


NOT_EXCEPTIONS = pytest.mark.parametrize(
    "raised", [SystemExit(3), KeyboardInterrupt()], ids=["sys.exit", "ctrl-c"])


class TestACallbackOnTheCampaignThreadThatRaisesWhatIsNotAnException:
    @NOT_EXCEPTIONS
    @pytest.mark.parametrize("which", ["on_elected", "on_deposed"])
    def test_is_logged_with_its_traceback_and_reported_and_the_campaign_goes_on(
            self, client: qs.Queen, caplog: pytest.LogCaptureFixture, raised: BaseException,
            which: str) -> None:
        calls, callback = _raise_first_time(raised)
        election = LeaderElection(
            client, _fresh_name(), ttl=3, on_elected=callback if which == "on_elected" else None,
            on_deposed=callback if which == "on_deposed" else None).start()
        assert election.wait_elected(5), "never elected"
        if which == "on_deposed":
            election.resign()
        wait_for(lambda: calls, timeout=5, what=f"{which} to be called")
        deadline = time.monotonic() + 5
        while election.health().last_error is None and time.monotonic() < deadline:
            time.sleep(0.005)
        reported = election.health()
        if which == "on_elected":
            election.resign()
        re_elected = wait_for(lambda: election.health().terms == 2, timeout=5,
                              what="a second term")
        election.stop()

        assert reported.campaigning, f"the campaign thread died of {raised!r}: {reported}"
        assert reported.last_error is not None and type(raised).__name__ in (
            reported.last_error), f"health() does not say {which} raised: {reported}"
        assert re_elected and len(calls) >= 2, f"the campaign did not go on: {calls}"
        told = _told_with_traceback(caplog, raised)
        assert len(told) == 1, f"{raised!r} was not logged once with its traceback: {told}"


class TestAnObserverCallbackThatRaisesWhatIsNotAnException:
    @NOT_EXCEPTIONS
    def test_is_logged_with_its_traceback_and_observing_goes_on(
            self, client: qs.Queen, caplog: pytest.LogCaptureFixture,
            raised: BaseException) -> None:
        name = _fresh_name()
        heard, on_new_leader = _raise_first_time(raised)
        observer = LeaderObserver(client, name, on_new_leader=on_new_leader, every=0.01)
        observer.start()
        first = LeaderElection(client, name, ttl=30, identity="first").start()
        assert first.wait_elected(5), "never elected"
        wait_for(lambda: heard, timeout=5, what="the first term to be heard")
        first.stop()
        second = LeaderElection(client, name, ttl=30, identity="second").start()
        assert second.wait_elected(5), "the second was never elected"
        wait_for(lambda: len(heard) == 2 or not observer.observing, timeout=5,
                 what="the second term to be heard")
        observing = observer.observing
        second.stop()
        observer.stop()

        assert observing, f"the observer's thread died of {raised!r}"
        assert [leader.identity for leader in heard] == ["first", "second"], f"heard {heard}"
        told = _told_with_traceback(caplog, raised)
        assert len(told) == 1, f"{raised!r} was not logged once with its traceback: {told}"


class TestACtrlCInACallbackOfRunOnTheCallersThread:
    def test_ends_run_after_resigning(self, client: qs.Queen) -> None:
        name = _fresh_name()
        deposed: list[str] = []

        def on_elected(token: int) -> None:
            raise KeyboardInterrupt

        election = LeaderElection(client, name, ttl=30, on_elected=on_elected,
                                  on_deposed=deposed.append)
        with pytest.raises(KeyboardInterrupt):
            election.run()
        holders = client.locks.get(name).get("holders") or []

        assert deposed == ["resigned"], f"run() ended without resigning once: {deposed}"
        assert not holders and not election.is_leader, f"the lease is still held: {holders}"
