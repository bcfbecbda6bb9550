"""A hold whose taking of the signal handlers is cut short never claims them taken.

While the handle takes over the handlers (wraps each, under a signal mask), one not
yet wrapped can still run, for a signal that had landed before the mask. Cut short
there, the state must not say "installed" with a handler left unwrapped: every later
hold would then trust it, and that raw handler could cut the gate's bookkeeping short
and leave it locked (a hang seen under a real SIGALRM storm). Here the application's
handler runs at every point of the take where CPython 3.11 looks for a signal in
``interrupts.py``: each function start, loop back-edge, and the instruction after each
call (a call of a type such as ``range()`` reports no C return to a profiler).
"""

from __future__ import annotations

import dis
import signal
import sys
from types import FrameType
from typing import Any, Iterator, Optional

import pytest

from queen_sync._handle import interrupts

MAX_POINTS = 5_000


def app_handler(signum: int, frame: Optional[FrameType]) -> None:
    raise KeyboardInterrupt


@pytest.fixture
def app_alarm() -> Iterator[None]:
    previous = signal.signal(signal.SIGALRM, app_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGALRM, previous)


def run_hold_with_the_handler_at(point: int) -> Optional[str]:
    """Open and close one outermost hold, the raw handler run at its ``point``-th point."""
    seen = 0
    where: Optional[str] = None

    def deliver(frame: FrameType, event: str) -> None:
        nonlocal seen, where
        seen += 1
        if seen == point:
            where = f"{frame.f_code.co_name}:{frame.f_lineno} ({event})"
            handler = signal.getsignal(signal.SIGALRM)
            assert callable(handler)
            handler(signal.SIGALRM, frame)

    def trace(frame: FrameType, event: str, arg: Any) -> Any:
        if where is not None or frame.f_code.co_filename != interrupts.__file__:
            return None
        frame.f_trace_opcodes = True
        if event == "call" or (event == "opcode" and is_check_point(frame)):
            deliver(frame, event)
        return trace

    sys.settrace(trace)
    try:
        with interrupts.interrupts_held():
            pass
    except KeyboardInterrupt:
        pass
    finally:
        sys.settrace(None)
    return where


JUMP_BACK = dis.opmap.get("JUMP_BACKWARD", dis.opmap.get("JUMP_ABSOLUTE"))
CALL = dis.opmap.get("CALL", dis.opmap.get("CALL_FUNCTION"))
CACHE = dis.opmap.get("CACHE")


def is_check_point(frame: FrameType) -> bool:
    """A back-edge, or the first instruction after a call (past its inline caches)."""
    code, at = frame.f_code.co_code, frame.f_lasti
    if code[at] == JUMP_BACK:
        return True
    before = at - 2
    while before >= 0 and code[before] == CACHE:
        before -= 2
    return before >= 0 and code[before] == CALL


class TestTakingTheHandlersCutShortAnywhere:
    def test_leaves_them_either_all_wrapped_or_not_claimed_taken(self, app_alarm: None) -> None:
        problems = []
        for point in range(1, MAX_POINTS):
            where = run_hold_with_the_handler_at(point)
            if where is None:
                break
            wrapped = isinstance(signal.getsignal(signal.SIGALRM), interrupts._Deferring)
            if interrupts._state.installed and not wrapped:
                problems.append(f"point {point} at {where}: installed, SIGALRM not wrapped")
            if interrupts._state.depth != 0:
                problems.append(f"point {point} at {where}: hold depth left at "
                                f"{interrupts._state.depth}")
            # Whatever a cut left, the next hold must set it right (what was noted and not
            # yet raised is dropped: only the handlers are looked at here).
            interrupts._state.pending.clear()
            with interrupts.interrupts_held():
                if not isinstance(signal.getsignal(signal.SIGALRM), interrupts._Deferring):
                    problems.append(f"point {point} at {where}: the next hold ran unwrapped")
            interrupts._state.pending.clear()
            assert signal.getsignal(signal.SIGALRM) is app_handler, \
                f"point {point} at {where}: the handler was not given back"
        else:
            pytest.fail(f"the hold never ended within {MAX_POINTS} points")
        assert point > 5, "setup: too few points traced"
        assert not problems, "\n".join(problems[:10])
