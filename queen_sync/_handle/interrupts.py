"""Holding Ctrl-C back while a handle's bookkeeping must finish.

A ``KeyboardInterrupt`` can surface between any two steps of Python code. Landing
between "the block is counted" and "the block is recorded", or between "the permit
is released" and "the next thread may enter", it would leave a handle stuck or a
permit held until its TTL. Inside ``interrupts_held()`` the main thread's Ctrl-C is
noted instead, and raised as soon as the section ends, where the state is whole.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from types import FrameType
from typing import Iterator, Optional


@contextlib.contextmanager
def interrupts_held() -> Iterator[None]:
    """Defer SIGINT to the end of the section (main thread with Python's default handler).

    Elsewhere (another thread, or an application's own SIGINT handler) the section runs
    as it is: only the main thread receives KeyboardInterrupt from the default handler.
    """
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
        yield
        return
    noted: list[int] = []

    def note(signum: int, frame: Optional[FrameType]) -> None:
        noted.append(signum)

    signal.signal(signal.SIGINT, note)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        if noted:
            raise KeyboardInterrupt
