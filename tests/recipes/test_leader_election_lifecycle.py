"""A leader election's life: start and stop in any order, failures of its thread, a close."""

from __future__ import annotations

import secrets
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any, Optional

import queen_sync as qs
from queen_sync.recipes.leader_election import LeaderElection


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
        thread: Optional[threading.Thread] = election._thread
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
