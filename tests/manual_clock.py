"""A monotonic clock that tests move by hand."""

from __future__ import annotations

import threading


class ManualClock:
    """A monotonic clock that moves only when a test says so."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def monotonic(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds

    def wait(self, event: threading.Event, timeout: float) -> bool:
        return event.wait(0.01)
