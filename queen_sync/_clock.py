"""The clock the handles and the renewer read, injectable so time-dependent tests run fast."""

from __future__ import annotations

import threading
import time
from _thread import allocate_lock
from typing import Optional, Protocol


class Clock(Protocol):
    def monotonic(self) -> float:
        """Seconds on a clock that never goes back (local deadlines are on it)."""

    def wait(self, event: threading.Event, timeout: float) -> bool:
        """Block until ``event`` is set or ``timeout`` passes; True when it was set."""


class WakeFlag(threading.Event):
    """A ``threading.Event`` for one waiting thread, whose ``set()`` enters no Python code.

    ``Event.set()`` takes its Condition's lock inside a Python ``__enter__``: a signal's
    exception landing there in the main thread (Ctrl-C, an application's handler)
    leaves that lock taken, and the next ``set()`` or the waiter hangs for good. Here
    the flag is a C lock, released when set, so every step is one C call (the Event's
    own Condition is never used).
    """

    def __init__(self) -> None:
        super().__init__()
        self._unset = allocate_lock()
        self._unset.acquire()

    def set(self) -> None:
        try:  # noqa: SIM105 - contextlib.suppress would add Python frames a signal can cut
            self._unset.release()
        except RuntimeError:  # set already
            pass

    def clear(self) -> None:
        """Only the waiting thread clears (a clear beside its wait may leave it set)."""
        self._unset.acquire(False)

    def is_set(self) -> bool:
        return not self._unset.locked()

    def wait(self, timeout: Optional[float] = None) -> bool:
        if not self._unset.acquire(True, -1 if timeout is None else timeout):
            return False
        self.set()  # stays set until cleared, as an Event does
        return True


class SystemClock:
    """The real clock."""

    def monotonic(self) -> float:
        return time.monotonic()

    def wait(self, event: threading.Event, timeout: float) -> bool:
        return event.wait(max(0.0, timeout))


SYSTEM_CLOCK = SystemClock()
