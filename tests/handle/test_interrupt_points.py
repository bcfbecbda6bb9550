"""Ctrl-C at EVERY point of a handle's block code leaves nothing stuck or stranded.

Rather than firing at random moments, each round is replayed once per point: a
trace function counts the events executed in the handle's code and, at the k-th,
delivers SIGINT there, as Python does (the SIGINT handler installed at that moment
runs with the frame it landed in), for every k until a round ends before point k.
The handler is called, not re-raised through the OS, so that a handler which holds
the interrupt back sees the same frame a real signal would show it.

By default the points are where CPython 3.11 really looks for a pending signal in
Python code: the start of every function (its RESUME: the "call" event), every
backward jump (a loop's next pass), and the return of every C function called from it
(a "c_return" profile event: a lock taken by a ``Condition``'s Python ``__enter__`` is
held there, and not yet guarded by the caller's ``with``). A C object's ``with`` entry
calls no function through the eval loop, so no point is there.

Each round runs under three SIGINT handlers: Python's default (which the handle takes
over while it needs to), and an application's own, installed before the round, that
raises ``KeyboardInterrupt`` or an ``Exception`` (as an alarm handler raising
``TimeoutError`` does). A handler the handle did not install may still not cut its
bookkeeping short: the handle defers it as it defers Ctrl-C.
``QUEEN_SYNC_INTERRUPT_POINTS=lines`` makes every line a point too, ``=opcodes`` every
bytecode (both stricter than CPython: a signal at a C lock's ``with`` exit leaves it
locked, which CPython never does), and ``=package`` extends opcode points to all of
queen_sync (the engines too).
"""

from __future__ import annotations

import _thread
import dis
import functools
import os
import signal
import sys
import threading
from pathlib import Path
from types import FrameType
from typing import Any, Callable, Iterator, Optional

import pytest

import queen_sync as qs
from queen_sync.testing import LocalBroker

PACKAGE = Path(qs.__file__).parent
MODE = os.environ.get("QUEEN_SYNC_INTERRUPT_POINTS", "checks")  # checks|lines|opcodes|package
SCOPE = str(PACKAGE if MODE == "package" else PACKAGE / "_handle")
MAX_POINTS = 50_000  # a round longer than this never ends: fail rather than spin
HANG = 2.0  # seconds after which a round is taken to be deadlocked, and interrupted

Tracer = Callable[[FrameType, str, Any], Any]


@pytest.fixture(params=["sqlite", "http"])
def q(request: pytest.FixtureRequest, sqlite_url: str, tmp_path: Path) -> Iterator[qs.Queen]:
    if request.param == "sqlite":
        with qs.Queen(sqlite_url, renew_thread=False) as client:
            yield client
        return
    with LocalBroker(str(tmp_path / "broker.db")) as broker, \
            qs.Queen(broker.url, renew_thread=False) as client:
        yield client


class AlarmFired(TimeoutError):
    """What the application's alarm-like handler raises: an ordinary ``Exception``."""


def app_raising_keyboard_interrupt(signum: int, frame: Optional[FrameType]) -> None:
    raise KeyboardInterrupt


def app_raising_timeout(signum: int, frame: Optional[FrameType]) -> None:
    raise AlarmFired("the application's handler fired")


APP_HANDLERS: dict[str, Any] = {
    "python-default": signal.default_int_handler,
    "app-keyboard-interrupt": app_raising_keyboard_interrupt,
    "app-timeout": app_raising_timeout,
}
INTERRUPTS = (KeyboardInterrupt, AlarmFired)


# Every handler on SQLite; over HTTP (a round there costs ten times more) Python's
# default: the handle's code is the same on both, and an application's handler runs
# through the same wrapper as the default one.
ROUND_SETUPS = [("sqlite", handler) for handler in sorted(APP_HANDLERS)] + [
    ("http", "python-default")]


@pytest.fixture
def sigint_handler(request: pytest.FixtureRequest) -> Iterator[Any]:
    """SIGINT's handler for the rounds; Python's default is put back after them."""
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler, \
        "setup: the test needs Python's default SIGINT handler"
    handler = APP_HANDLERS[request.param]
    signal.signal(signal.SIGINT, handler)
    try:
        yield handler
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def deliver_sigint(frame: FrameType) -> None:
    """Run the SIGINT handler installed now, in ``frame``, as Python runs it for a signal."""
    handler = signal.getsignal(signal.SIGINT)
    assert callable(handler), f"setup: SIGINT has no Python handler ({handler!r})"
    handler(signal.SIGINT, frame)


LOOP_BACK = dis.opmap.get("JUMP_BACKWARD", dis.opmap.get("JUMP_ABSOLUTE"))


def is_point(frame: FrameType, event: str) -> bool:
    """Whether Python would check for a signal here, in the mode the test runs."""
    if event in ("call", "c_return") or (MODE in ("opcodes", "package") and event == "opcode"):
        return True
    if MODE == "lines":
        return event == "line"
    return event == "opcode" and frame.f_code.co_code[frame.f_lasti] == LOOP_BACK


def interrupted_at(point: int, body: Callable[[], None]) -> tuple[Optional[str], bool]:
    """Run ``body`` with SIGINT delivered at its ``point``-th event in ``SCOPE``.

    Returns:
        Where it was delivered (None: the body ended first), and whether the
        interrupt (``KeyboardInterrupt`` or ``AlarmFired``) came out of the body.
    """
    seen = 0
    where: Optional[str] = None

    def local(frame: FrameType, event: str, arg: Any) -> Optional[Tracer]:
        nonlocal seen, where
        if where is not None:
            return None
        if is_point(frame, event):
            seen += 1
            if seen == point:
                where = f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno} " \
                        f"{frame.f_code.co_name} ({event} @{frame.f_lasti})"
                deliver_sigint(frame)
        return local

    def calls(frame: FrameType, event: str, arg: Any) -> Optional[Tracer]:
        if where is not None or not frame.f_code.co_filename.startswith(SCOPE):
            return None
        frame.f_trace_opcodes = MODE != "lines"
        return local(frame, event, arg)

    def c_returns(frame: FrameType, event: str, arg: Any) -> None:
        # An exception raised here comes out of the C call, in ``frame``, as a signal's does.
        if event == "c_return" and where is None \
                and frame.f_code.co_filename.startswith(SCOPE):
            local(frame, event, arg)

    sys.settrace(calls)
    sys.setprofile(c_returns)
    try:
        body()
    except INTERRUPTS:
        return where, True
    finally:
        sys.setprofile(None)
        sys.settrace(None)
    return where, False


def leftovers(q: qs.Queen, lock: qs.Lock, handler: Any) -> list[str]:
    """What a round interrupted anywhere must not leave behind."""
    found = []
    if lock.in_block:
        found.append("stuck in a block")
    if lock._token is not None or lock in q.renewer.held():
        found.append("lease kept with no block open")
    if any(h["owner"] == lock.owner for h in q.locks.get(lock.name)["holders"]):
        found.append("permit stranded on the engine")
    if qs.current_lock() is not None:
        found.append(f"current_lock() is still {qs.current_lock()!r}")
    if signal.getsignal(signal.SIGINT) is not handler:
        found.append(f"SIGINT handler left as {signal.getsignal(signal.SIGINT)!r}")
    return found


def reusable(q: qs.Queen, lock: qs.Lock, handler: Any) -> list[str]:
    with lock:
        took = lock.held
    if not took:
        return ["the handle could not be used again"]
    return [f"after reuse: {what}" for what in leftovers(q, lock, handler)]


def wake_a_hung_round(hung: threading.Event) -> None:
    hung.set()
    _thread.interrupt_main()


def with_block(lock: qs.Lock) -> None:
    with lock:
        pass


def nested_blocks(lock: qs.Lock) -> None:
    with lock, lock:
        pass


def run_call(lock: qs.Lock) -> None:
    assert lock.run(lambda: None).acquired, "setup: run() did not acquire"


def run_in_block(lock: qs.Lock) -> None:
    with lock:
        assert lock.run(lambda: None).acquired, "setup: nested run() did not acquire"


ROUNDS: dict[str, Callable[[qs.Lock], None]] = {
    "with": with_block, "nested": nested_blocks, "run": run_call, "run-in-with": run_in_block,
}


class TestInterruptAtEveryPoint:
    @pytest.mark.parametrize(("q", "sigint_handler"), ROUND_SETUPS, indirect=True)
    @pytest.mark.parametrize("kind", sorted(ROUNDS))
    def test_sigint_at_any_point_of_a_round_leaves_the_handle_clean_and_usable(
        self, q: qs.Queen, kind: str, sigint_handler: Any
    ) -> None:
        problems: list[str] = []
        for point in range(1, MAX_POINTS):
            lock = q.lock(f"{kind}-{point}", ttl=60)
            hung = threading.Event()
            watchdog = threading.Timer(HANG, wake_a_hung_round, args=(hung,))
            watchdog.start()
            where, raised = interrupted_at(point, functools.partial(ROUNDS[kind], lock))
            watchdog.cancel()
            watchdog.join()
            if hung.is_set():
                problems.append(f"point {point} at {where}: the round deadlocked")
                continue
            if where is None:
                assert not raised, f"point {point}: an interrupt with no SIGINT"
                break
            found = leftovers(q, lock, sigint_handler)
            if not raised:
                found.append("the interrupt was swallowed")
            found += [] if found else reusable(q, lock, sigint_handler)
            problems += [f"point {point} at {where}: {p}" for p in found]
        else:
            pytest.fail(f"a {kind} round never ended within {MAX_POINTS} points")
        assert point > 10, f"setup: only {point} points traced in {SCOPE}"
        assert not problems, f"{len(problems)} problems, first ones: " + "\n".join(problems[:8])
