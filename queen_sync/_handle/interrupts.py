"""Holding signals back while a handle's bookkeeping must finish.

A ``KeyboardInterrupt``, or whatever a signal handler raises (an alarm's
``TimeoutError``, a SIGTERM handler's ``SystemExit``), can surface between any two
steps of Python code. Landing between "the block is counted" and "the block is
recorded", inside the gate's Python ``__enter__``, or between "the permit is released"
and "the next thread may enter", it would leave a handle stuck or a permit held until
its TTL.

While the main thread is inside a block or a hold, every Python-level signal handler
is wrapped (put back when the last block or hold ends): SIGINT's default one, and an
application's own, as found when the block or hold began. A wrapped handler runs at
once, so Ctrl-C stays prompt in user code and in engine calls, except when its signal
lands in a hold (``interrupts_held()``) or in a function registered with
``bookkeeping`` (whose whole body is a hold, so a signal at its first bytecode, before
the hold is open, is covered too). Then it is noted, and the end of the outermost hold
runs it. A handler installed while a block is open is not wrapped: it runs where its
signal lands. Another handler that raises into the main thread (``@singleton_job``
installs one for its body) asks ``defer_if_held`` first, so it cannot cut a handle's
bookkeeping short.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from importlib import import_module as _import_module
from types import CodeType, FrameType, FunctionType
from typing import Any, Callable, Optional, TypeVar

F = TypeVar("F", bound=Callable[..., Any])
Handler = Callable[[int, Optional[FrameType]], Any]

# The C module ``signal`` wraps: its functions answer plain ints, with no enum conversion
# in Python frames where a signal could land mid-swap, and read every handler in about
# 3 µs instead of 45 µs on each block's entry.
_c_signal: Any = _import_module("_signal") if "_signal" in sys.builtin_module_names \
    else signal
_read_handler: Callable[[int], Any] = _c_signal.getsignal
_signal_mask: Callable[[int, Any], Any] = _c_signal.pthread_sigmask
_CATCHABLE = tuple(sorted(int(s) for s in signal.valid_signals()
                          if s not in (signal.SIGKILL, signal.SIGSTOP)))


class _Deferring:
    """A signal handler, run at once except inside a hold or bookkeeping (then at its end)."""

    __slots__ = ("original",)

    def __init__(self, original: Handler) -> None:
        self.original = original

    def __call__(self, signum: int, frame: Optional[FrameType]) -> None:
        if not _defer(self.original, signum, frame):
            self.original(signum, frame)

    def __repr__(self) -> str:
        return f"<deferred while a queen_sync handle keeps its books: {self.original!r}>"


class _SignalState:
    """The process's hold depth, noted signals, wrapped handlers and open main-thread blocks."""

    def __init__(self) -> None:
        self.depth = 0
        self.pending: list[tuple[Handler, int, Optional[FrameType]]] = []
        self.replaying = False  # running noted handlers: none of them is noted again
        self.blocks: set[int] = set()  # ids of handles whose block the main thread is in
        self.installed = False
        self.wrapped: dict[int, _Deferring] = {}


_state = _SignalState()
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


def _defer(handler: Handler, signum: int, frame: Optional[FrameType]) -> bool:
    if _state.replaying or not (_state.depth > 0 or _in_bookkeeping(frame)):
        return False
    _state.pending.append((handler, signum, frame))
    return True


def defer_if_held(frame: Optional[FrameType]) -> bool:
    """For a SIGINT landing in ``frame``: note it if a hold or bookkeeping must finish first.

    Returns:
        True when noted (the end of the outermost hold raises ``KeyboardInterrupt``);
        False when the caller may raise it at once.
    """
    return _defer(signal.default_int_handler, signal.SIGINT, frame)


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def block_opened(key: int) -> None:
    """The main thread entered a handle's outermost block: wrap the signal handlers."""
    if not _in_main_thread():
        return
    _take_signals()  # first: a signal before that leaves nothing recorded, after it is held
    _state.blocks.add(key)


def _take_signals() -> None:
    """Wrap every Python-level handler, so that the hold being entered opens.

    A handler not yet wrapped may still run meanwhile, for a signal that landed before
    the mask: what it raises is noted like a deferred signal, raised at the hold's end,
    and the swap is done again. Only a swap that fails four times raises.
    """
    if _state.installed:
        return
    failures = 0
    while True:  # no call before the try: its return could run a handler not yet wrapped
        try:
            # Signals wait in the kernel while the handlers are swapped: one landing
            # between two swaps would run a handler not yet wrapped. They land when the
            # mask is put back, on wrapped handlers, here in bookkeeping: noted.
            before = _signal_mask(signal.SIG_BLOCK, ())
            try:
                _signal_mask(signal.SIG_BLOCK, _CATCHABLE)
                _wrap_handlers()
                # Last, under the mask: installed only once every handler is wrapped. A
                # take cut short is done again whole (a wrapper it left is recorded then).
                _state.installed = True
            finally:
                _signal_mask(signal.SIG_SETMASK, before)
            return
        except BaseException as exc:
            failures += 1
            if failures > 3:  # not a signal's exception but a swap that keeps failing
                raise
            _state.pending.append((_Reraise(exc), 0, None))


class _Reraise:
    """A noted exception a handler raised before it was wrapped: raised when run."""

    __slots__ = ("exc",)

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc

    def __call__(self, signum: int, frame: Optional[FrameType]) -> None:
        raise self.exc


def _wrap_handlers() -> None:
    for signum in _CATCHABLE:
        handler = _read_handler(signum)
        if isinstance(handler, _Deferring):  # one a cut-short give-back left in place
            _state.wrapped.setdefault(signum, handler)
        elif callable(handler):
            wrapper = _Deferring(handler)
            _state.wrapped[signum] = wrapper
            _c_signal.signal(signum, wrapper)


def block_closed(key: int) -> None:
    """A handle's outermost block ended: the last one gives the handlers back."""
    _state.blocks.discard(key)
    if _state.depth == 0:  # in a hold, its end gives them back: its own exit stays covered
        _give_signals_back()


def _give_signals_back() -> None:
    """Put each wrapped handler back.

    Each one given back runs where its signal lands from then on, even here, and may
    cut this short. Marked not installed first, so the next take looks at every signal
    again and records any wrapper this left in place.
    """
    if _state.blocks or not _state.installed or not _in_main_thread():
        return
    _state.installed = False
    wrapped = _state.wrapped
    while wrapped:
        signum, wrapper = wrapped.popitem()
        if _read_handler(signum) is wrapper:  # a handler set meanwhile stays
            _c_signal.signal(signum, wrapper.original)


def _run_noted() -> None:
    """Run the handlers of the signals noted during the hold, in the order they landed.

    All of them run now: one raising leaves the rest to run while its exception
    unwinds, as Python runs a signal landing then, so a later one's exception comes out
    with the earlier one as its context.
    """
    _state.replaying = True
    try:
        _run_pending()
    finally:
        _state.replaying = False


def _run_pending() -> None:
    pending = _state.pending
    while pending:
        handler, signum, frame = pending.pop(0)
        try:
            handler(signum, frame)
        except BaseException:
            _run_pending()
            raise


class interrupts_held:  # lower-case: written `with interrupts_held():` like a function
    """Defer the main thread's signal handlers to the end of the outermost hold.

    Python runs signal handlers only in the main thread, so for others the section
    simply runs.
    """

    __slots__ = ()

    @bookkeeping
    def __enter__(self) -> None:
        if _in_main_thread():
            _take_signals()  # before counting: a signal in between must not leave depth high
            _state.depth += 1

    @bookkeeping
    def __exit__(self, *exc_info: Any) -> None:
        if not _in_main_thread():
            return
        _state.depth = max(0, _state.depth - 1)
        if _state.depth == 0:
            _give_signals_back()
        if _state.depth == 0 and _state.pending:
            _run_noted()


def _forget_in_child() -> None:
    # The forking thread is the child's main thread; no block of the parent is open here.
    _state.depth, _state.replaying = 0, False
    _state.pending.clear()
    _state.blocks.clear()


os.register_at_fork(after_in_child=_forget_in_child)
