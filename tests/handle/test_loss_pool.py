"""The loss-handler pool on its own: bounded threads, per-lease order, reactions apart.

``QUEEN_SYNC_LOSS_EXAMPLES`` runs the property test longer (default 40 histories).
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from typing import Callable

from hypothesis import given, settings
from hypothesis import strategies as st

from queen_sync._handle.losses import MAX_WORKERS, LossDispatcher, Reaction

WAIT = 10.0  # how long the test waits for something that should happen soon
EXAMPLES = int(os.environ.get("QUEEN_SYNC_LOSS_EXAMPLES", "40"))


@dataclass
class Tally:
    """What the handlers saw: per lease the order they ran in, and every overlap."""

    runs: dict[int, list[int]] = field(default_factory=dict)
    running: set[int] = field(default_factory=set)
    overlaps: list[int] = field(default_factory=list)
    threads: set[int] = field(default_factory=set)
    done: int = 0
    mutex: threading.Condition = field(default_factory=threading.Condition)

    def handler(self, lease: int, seq: int, gate: threading.Event,
                fails: bool) -> Callable[[str], None]:
        def run(reason: str) -> None:
            self._enter(lease, seq)
            try:
                gate.wait(WAIT)
                if fails:
                    raise RuntimeError(f"handler {seq} of lease {lease} fails on purpose")
            finally:
                self._leave(lease)
        return run

    def _enter(self, lease: int, seq: int) -> None:
        with self.mutex:
            if lease in self.running:
                self.overlaps.append(lease)
            self.running.add(lease)
            self.runs.setdefault(lease, []).append(seq)
            self.threads.add(threading.get_ident())

    def _leave(self, lease: int) -> None:
        with self.mutex:
            self.running.discard(lease)
            self.done += 1
            self.mutex.notify_all()

    def wait_for(self, count: int) -> bool:
        with self.mutex:
            return self.mutex.wait_for(lambda: self.done >= count, WAIT)


class TestBounds:
    def test_ten_thousand_leases_lost_at_once_are_served_by_at_most_the_pool(self) -> None:
        dispatcher, tally, gate = LossDispatcher(), Tally(), threading.Event()
        leases = [object() for _ in range(10_000)]
        for seq, lease in enumerate(leases):
            dispatcher.dispatch(tally.handler(seq, seq, gate, False), "renew", lease)
        with tally.mutex:
            assert tally.mutex.wait_for(lambda: len(tally.running) >= MAX_WORKERS, WAIT), (
                f"only {len(tally.running)} handlers started; the pool has {MAX_WORKERS}")
            started = len(tally.running)
        gate.set()
        assert tally.wait_for(len(leases)), f"only {tally.done} of {len(leases)} handlers ran"
        assert started == MAX_WORKERS, f"{started} handlers ran at once, above the pool"
        assert len(tally.threads) <= MAX_WORKERS, (
            f"{len(tally.threads)} threads ran handlers; at most {MAX_WORKERS} may")

    def test_a_reaction_runs_while_every_worker_is_stuck_in_a_user_handler(self) -> None:
        dispatcher, tally, gate = LossDispatcher(), Tally(), threading.Event()
        for seq in range(MAX_WORKERS * 3):
            dispatcher.dispatch(tally.handler(seq, seq, gate, False), "renew", object())
        reacted = threading.Event()
        try:
            dispatcher.dispatch(Reaction(lambda reason: reacted.set()), "renew", object())
            assert reacted.wait(WAIT), "a reaction waited behind stuck user handlers"
            assert not gate.is_set() and tally.done == 0, "the user handlers were not stuck"
        finally:
            gate.set()
        assert tally.wait_for(MAX_WORKERS * 3), "the user handlers did not all run"

    def test_drain_reports_the_leases_whose_handlers_did_not_end(self) -> None:
        dispatcher, tally, gate = LossDispatcher(), Tally(), threading.Event()
        for seq in range(3):
            dispatcher.dispatch(tally.handler(seq, seq, gate, False), "renew", object())
        try:
            assert dispatcher.drain(0.05) == 3, "drain must name the 3 leases still running"
        finally:
            gate.set()
        assert dispatcher.drain(WAIT) == 0, "drain did not wait for the handlers to end"


class TestOrder:
    @settings(max_examples=EXAMPLES, deadline=None)
    @given(st.lists(st.tuples(st.integers(0, 11), st.booleans()), min_size=1, max_size=60))
    def test_each_leases_handlers_run_alone_in_dispatch_order_whatever_the_mix(
        self, history: list[tuple[int, bool]]
    ) -> None:
        dispatcher, tally, gate = LossDispatcher(workers=3), Tally(), threading.Event()
        leases = [object() for _ in range(12)]
        expected: dict[int, list[int]] = {}
        for seq, (lease, fails) in enumerate(history):
            expected.setdefault(lease, []).append(seq)
            dispatcher.dispatch(tally.handler(lease, seq, gate, fails), "renew", leases[lease])
            if seq == len(history) // 2:
                gate.set()  # half dispatched while the workers are stuck, half while they run
        gate.set()
        assert tally.wait_for(len(history)), f"{tally.done} of {len(history)} handlers ran"
        assert not tally.overlaps, f"handlers of one lease overlapped: leases {tally.overlaps}"
        assert tally.runs == expected, "a lease's handlers ran out of dispatch order"
        assert len(tally.threads) <= 3, f"{len(tally.threads)} threads for a pool of 3"
