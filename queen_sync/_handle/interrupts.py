"""Holding Ctrl-C back while a handle's bookkeeping must finish.

A ``KeyboardInterrupt`` can surface between any two steps of Python code. Landing
between "the block is counted" and "the block is recorded", or between "the permit
is released" and "the next thread may enter", it would leave a handle stuck or a
permit held until its TTL.

While the main thread is inside a block or a hold, the SIGINT handler is ours
(installed only over Python's default one). It raises ``KeyboardInterrupt`` at once, so Ctrl-C stays
prompt in user code and in engine calls, except when the signal lands in a hold
(``interrupts_held()``) or in a function registered with ``bookkeeping`` (whose
whole body is a hold, so a signal at its first bytecode, before the hold is open,
is covered too). Then it is noted, and the end of the outermost hold raises it.
Another handler that raises into the main thread (``@singleton_job`` installs one for
its body) asks ``defer_if_held`` first, so it cannot cut a handle's bookkeeping short.
"""

from __future__ import annotations

import os
import signal
import threading
from types import CodeType, FrameType, FunctionType
from typing import Any, Callable, Optional, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


class _SigintState:
    """The process's hold depth, noted interrupt, and the blocks open in its main thread."""

    def __init__(self) -> None:
        self.depth = 0
        self.pending = False
        self.blocks: set[int] = set()  # ids of handles whose block the main thread is in
        self.installed = False


_state = _SigintState()
_bookkeeping: set[CodeType] = set()


def bookkeeping(fn: F) -> F:
    """Mark ``fn`` as a handle step that a signal landing in it must not cut short."""
    assert isinstance(fn, FunctionType), f"bookkeeping marks functions, not {fn!r}"
    _bookkeeping.add(fn.__code__)
    return fn


def _in_bookkeeping(frame: Optional[FrameType]) -> bool:
    while frame is not None:
        if frame.f_code in _bookkeeping:
            return True
        frame = frame.f_back
    return False


def defer_if_held(frame: Optional[FrameType]) -> bool:
    """For a SIGINT landing in ``frame``: note it if a hold or bookkeeping must finish first.

    Returns:
        True when noted (the end of the outermost hold raises ``KeyboardInterrupt``);
        False when the caller may raise it at once.
    """
    if _state.depth > 0 or _in_bookkeeping(frame):
        _state.pending = True
        return True
    return False


def _on_sigint(signum: int, frame: Optional[FrameType]) -> None:
    if not defer_if_held(frame):
        raise KeyboardInterrupt


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def block_opened(key: int) -> None:
    """The main thread entered a handle's outermost block: take over SIGINT if default."""
    if not _in_main_thread():
        return
    _take_sigint()  # first: a Ctrl-C before that leaves nothing recorded, after it is held
    _state.blocks.add(key)


def _take_sigint() -> None:
    if not _state.installed and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _on_sigint)
        _state.installed = True


def block_closed(key: int) -> None:
    """A handle's outermost block ended: the last one gives Python's handler back."""
    _state.blocks.discard(key)
    if _state.depth == 0:  # in a hold, its end gives it back: its own exit stays covered
        _give_sigint_back()


def _give_sigint_back() -> None:
    if _state.blocks or not _state.installed or not _in_main_thread():
        return
    _state.installed = False
    if signal.getsignal(signal.SIGINT) is _on_sigint:  # an application's own handler stays
        signal.signal(signal.SIGINT, signal.default_int_handler)


class interrupts_held:  # lower-case: written `with interrupts_held():` like a function
    """Defer the main thread's Ctrl-C to the end of the outermost hold.

    Other threads never receive KeyboardInterrupt from a signal, so for them (and when
    SIGINT is not ours) the section simply runs.
    """

    __slots__ = ()

    @bookkeeping
    def __enter__(self) -> None:
        if _in_main_thread():
            _take_sigint()  # before counting: a Ctrl-C in between must not leave depth high
            _state.depth += 1

    @bookkeeping
    def __exit__(self, *exc_info: Any) -> None:
        if not _in_main_thread():
            return
        _state.depth = max(0, _state.depth - 1)
        if _state.depth == 0:
            _give_sigint_back()
        if _state.depth == 0 and _state.pending:
            _state.pending = False
            raise KeyboardInterrupt


def _forget_in_child() -> None:
    # The forking thread is the child's main thread; no block of the parent is open here.
    _state.depth, _state.pending = 0, False
    _state.blocks.clear()


os.register_at_fork(after_in_child=_forget_in_child)
