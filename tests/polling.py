"""Waiting in tests for something another process or thread does, with a bounded timeout."""

from __future__ import annotations

import time
from typing import Any, Callable


def wait_for(predicate: Callable[[], Any], timeout: float = 10.0, what: str = "condition") -> Any:
    """The first truthy value of ``predicate()``, polled every 20 ms; AssertionError on timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def woken_within(waiter: Any, seconds: float) -> bool:
    """True when ``waiter`` (an engine's ``subscribe``) is woken by a release within
    ``seconds``: its waits may end early with no release (its turn in a line came)."""
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        if waiter.wait(left):
            return True
    return False
