"""Real processes on one SQLite file: exclusion, permits, crashes, pauses and fork.

Every other handle test may use threads or a manual clock; these start real
interpreters (``multiprocessing`` with ``spawn``) and use real signals, because
what they pin — a SIGKILLed holder, a SIGSTOPped one, a fork — only happens to
processes. The workers live in ``_workers.py`` so a spawned child can import them.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import time
from typing import Any, Callable, Iterator

import _workers
import pytest

import queen_sync as qs

pytestmark = pytest.mark.realtime

CTX = multiprocessing.get_context("spawn")
TTL = 2.0


class Processes:
    """Starts worker processes and makes sure none outlives its test."""

    def __init__(self) -> None:
        self.started: list[Any] = []
        self.results = CTX.Queue()
        self.channels = [self.results]

    def start(self, target: Callable[..., None], *args: Any, results: Any = None) -> Any:
        process = CTX.Process(target=target, args=(*args, results or self.results), daemon=True)
        process.start()
        self.started.append(process)
        return process

    def own_channel(self) -> Any:
        """A result queue for one worker that the test will SIGSTOP.

        A queue's writers share one lock; a worker stopped while its feeder thread
        holds it would silence every other worker on the same queue.
        """
        channel = CTX.Queue()
        self.channels.append(channel)
        return channel

    def get(self, timeout: float = 15.0, channel: Any = None) -> Any:
        return (channel or self.results).get(timeout=timeout)

    def join_all(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for process in self.started:
            process.join(max(0.1, deadline - time.monotonic()))
        stuck = [p.pid for p in self.started if p.is_alive()]
        assert not stuck, f"worker processes still running after {timeout}s: {stuck}"

    def stop_all(self) -> None:
        for process in self.started:
            if process.is_alive():
                if process.pid is not None:
                    os.kill(process.pid, signal.SIGCONT)  # a stopped process cannot die
                process.kill()
            process.join(5)
        for channel in self.channels:
            channel.close()
            channel.join_thread()


@pytest.fixture
def procs() -> Iterator[Processes]:
    group = Processes()
    try:
        yield group
    finally:
        group.stop_all()


@pytest.fixture
def q(sqlite_url: str) -> Iterator[qs.Queen]:
    client = qs.Queen(sqlite_url)
    yield client
    client.close()


def _expect(procs: Processes, kind: str, timeout: float = 15.0,
            channel: Any = None) -> tuple[Any, ...]:
    message = procs.get(timeout, channel)
    assert message[0] == kind, f"expected a {kind!r} report from a worker, got {message!r}"
    return tuple(message)


def test_four_processes_contending_on_one_lock_lose_no_guarded_increment(
        procs: Processes, q: qs.Queen, sqlite_url: str) -> None:
    start_at = time.time() + 1.0  # let every interpreter start before the race begins
    for _ in range(4):
        procs.start(_workers.contend_with_guarded_incr, sqlite_url, "counted", 4.0, start_at)
    reports = [procs.get(30) for _ in range(4)]
    procs.join_all(10)

    committed = sum(r[1] for r in reports)
    refused = sum(r[2] for r in reports)
    counter = q.kv.get(_workers.NS, "counter")
    rmw = q.kv.get(_workers.NS, "rmw")
    print(f"\ncommits per process: {[r[1] for r in reports]}, refused: {refused}")
    assert committed > 0, f"no process committed anything: {reports}"
    assert counter["value"] == committed, (
        f"the counter is {counter['value']} but the processes report {committed} commits")
    assert rmw["value"] == committed, (
        f"the read-modify-write counter is {rmw['value']} for {committed} commits: "
        "two holders overlapped and an update was lost")
    assert refused == 0, f"{refused} guarded commits were refused while holding the lock"
    assert sum(1 for r in reports if r[1] > 0) >= 2, (
        f"only one process ever held the lock, so nothing contended: {reports}")


def _max_overlap(intervals: list[tuple[float, float, int]]) -> int:
    # At equal times a release counts first, so touching intervals do not overlap.
    events = sorted([(a, 1) for a, _, _ in intervals] + [(r, -1) for _, r, _ in intervals])
    inside = peak = 0
    for _, step in sorted(events, key=lambda e: (e[0], e[1])):
        inside += step
        peak = max(peak, inside)
    return peak


def test_eight_processes_on_a_semaphore_of_three_never_exceed_three_holders(
        procs: Processes, sqlite_url: str) -> None:
    start_at = time.time() + 1.5
    for _ in range(8):
        procs.start(_workers.hold_semaphore_permits, sqlite_url, "three", 3, 2.5, start_at)
    reports = [procs.get(30) for _ in range(8)]
    procs.join_all(10)

    intervals = [iv for _, ivs in reports for iv in ivs]
    tokens = [token for _, _, token in intervals]
    peak = _max_overlap(intervals)
    print(f"\n{len(intervals)} holds by 8 processes, peak concurrent holders {peak}")
    assert len(intervals) >= 8, f"too few holds to judge anything: {len(intervals)}"
    assert peak <= 3, f"{peak} processes held one of 3 permits at the same time"
    assert peak == 3, f"the permits were never all taken at once (peak {peak}): no contention"
    assert len(set(tokens)) == len(tokens), "two holds were given the same fencing token"


def test_a_sigkilled_holder_is_replaced_after_its_ttl_with_a_higher_token(
        procs: Processes, q: qs.Queen, sqlite_url: str) -> None:
    holder = procs.start(_workers.hold_until_killed, sqlite_url, "crashy", TTL)
    _, first_token = _expect(procs, "held")
    procs.start(_workers.wait_then_take, sqlite_url, "crashy", TTL, 10.0, 0.1)
    _expect(procs, "waiting")
    time.sleep(0.5)  # the successor is inside acquire(wait=...), polling a live lease
    killed_at = time.time()
    os.kill(holder.pid, signal.SIGKILL)
    final = q.locks.get("crashy")["holders"][0]  # the dead holder's row no longer changes
    expires_at = final["expiresAt"] / 1000
    _, took_at, token = _expect(procs, "took", timeout=TTL + 5)
    procs.join_all(10)

    takeover, past_expiry = took_at - killed_at, took_at - expires_at
    print(f"\ntakeover after SIGKILL: {takeover * 1000:.0f} ms from the kill, "
          f"{past_expiry * 1000:.1f} ms past the lease's expiry (ttl {TTL:.0f} s)")
    assert token > final["token"] >= first_token, (
        f"the successor's token {token} does not exceed the dead holder's {final['token']}")
    assert takeover <= TTL + 0.5, f"takeover took {takeover:.3f}s, more than ttl {TTL}s + 0.5s"
    assert past_expiry >= -0.05, (
        f"the successor took the lock {-past_expiry:.3f}s BEFORE the dead holder's lease ended")
    assert past_expiry <= 0.5, f"the successor noticed the expiry only {past_expiry:.3f}s late"


def test_a_sigstopped_holder_past_its_ttl_has_its_guarded_commit_refused_and_sees_the_loss(
        procs: Processes, q: qs.Queen, sqlite_url: str) -> None:
    about_to_write = CTX.Event()
    paused_channel = procs.own_channel()
    paused = procs.start(_workers.commit_after_pause, sqlite_url, "paused", TTL, about_to_write,
                         results=paused_channel)
    _, paused_token = _expect(procs, "held", channel=paused_channel)
    assert about_to_write.wait(10), "the holder never started its guarded commit"
    os.kill(paused.pid, signal.SIGSTOP)
    try:
        procs.start(_workers.wait_then_take, sqlite_url, "paused", TTL, 10.0, 1.0)
        _expect(procs, "waiting")
        _, _, successor_token = _expect(procs, "took", timeout=TTL + 5)
    finally:
        os.kill(paused.pid, signal.SIGCONT)
    report = _expect(procs, "committed", channel=paused_channel)
    procs.join_all(10)

    _, answer_json, lost, lost_reason, held, token = report
    answer = qs.Result(json.loads(answer_json))
    assert successor_token > paused_token, (
        f"the successor's token {successor_token} does not exceed the paused {paused_token}")
    assert not answer, f"the paused holder's guarded commit was accepted: {answer!r}"
    assert answer.get("reason") == "kv_precondition", f"refused for another reason: {answer!r}"
    assert lost, "the paused holder's handle does not report the lease lost"
    assert lost_reason in ("guard", "expired"), f"unexpected loss reason {lost_reason!r}"
    assert not held and token is None, f"the paused handle still claims token {token}"
    winner = q.kv.get(_workers.NS, "winner")
    assert winner["value"] == "successor", f"the stale write landed: {winner!r}"


def test_a_forked_child_holds_nothing_and_locks_on_its_own_while_the_parent_keeps_renewing(
        procs: Processes, sqlite_url: str) -> None:
    procs.start(_workers.fork_while_holding, sqlite_url)
    _, child = _expect(procs, "child", timeout=20)
    _, parent = _expect(procs, "parent", timeout=10)
    procs.join_all(10)

    assert child["exit_status"] == 0, f"the forked child failed: {child!r}"
    assert child["held"] is False, "the forked child believes it holds the parent's lock"
    assert child["token"] is None, f"the forked child sees token {child['token']}"
    assert child["renewer_tracks"] == 0, "the child's renewer inherited the parent's leases"
    assert child["own_acquired"], "the child could not take a lock of its own"
    assert child["own_held_after_ttl"] and child["own_renewed"], (
        f"the child's own lock was not kept renewed past its ttl: {child!r}")
    assert child["own_renewer_alive"] and not child["renewer_is_parents"], (
        "the child's lock is not renewed by a renewer thread of its own")
    assert child["child_owner"] != child["parent_owner"], "the child kept the parent's owner"
    assert child["forked_engine_owner"] == child["parent_owner"], (
        "the engine no longer lists the parent as the holder while the child runs")
    assert child["forked_still_held_after_child_close"], (
        "closing the child's client released the parent's lock")
    assert parent["held"] and not parent["lost"], f"the parent lost its lock: {parent!r}"
    assert parent["renew_calls"] >= 2 and parent["token_after"] > parent["token_before"], (
        f"the parent's lock was not renewed while the child ran: {parent!r}")
    assert parent["engine_owner"] == parent["owner"], "the engine lists another holder"


def test_forking_while_another_thread_is_mid_call_leaves_every_child_a_working_engine(
        procs: Processes, q: qs.Queen, sqlite_url: str) -> None:
    forks = 20
    procs.start(_workers.fork_during_calls, sqlite_url, forks)
    _, failures, parent_calls = _expect(procs, "forks", timeout=60)
    procs.join_all(10)

    children = q.kv.get(_workers.NS, "children")
    assert parent_calls > forks, f"the parent's thread made only {parent_calls} calls"
    assert not failures, f"a child forked mid-call could not use the engine: {failures}"
    assert children["value"] == forks, f"children counted {children['value']}, not {forks}"
