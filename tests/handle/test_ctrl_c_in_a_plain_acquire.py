"""Ctrl-C at any bytecode of a plain ``acquire()``'s in-flight bookkeeping leaves the client usable.

Outside a block, Python's own SIGINT handler is installed, so ``KeyboardInterrupt`` can
surface between any two bytecodes of the code that counts an acquire in flight (which
``close()`` waits for). Each round is replayed once per point: a trace function counts
the opcodes run in that bookkeeping and raises there at the k-th, for every k until a
round ends first. Opcode points are stricter than CPython (which checks for signals only
at calls and backward jumps), so passing here covers every place a real signal can land.
After each one, another lock on the same client must still be taken, nothing may stay
counted in flight, and ``close()`` must not wait for an acquire that is gone.
"""

from __future__ import annotations

import signal
import sys
import threading
from types import CodeType, FrameType
from typing import Any, Callable, Optional

import pytest

import queen_sync as qs
from queen_sync import _client
from queen_sync._handle import lock as lock_module

Tracer = Callable[[FrameType, str, Any], Any]

# The acquire path's bookkeeping: listing and unlisting the attempt, and the ``with`` and
# ``finally`` around it.
BOOKKEEPING: frozenset[CodeType] = frozenset({
    _client.Queen._take_off.__code__,
    _client.Queen._land.__code__,
    _client._HandleCaller.take_off.__code__,
    _client._HandleCaller.land.__code__,
    lock_module.Lock._attempt.__code__,
})
MAX_POINTS = 2_000  # a round longer than this never ends: fail rather than spin
HANG = 1.0  # seconds after which a probe is taken to be deadlocked


def interrupted_at(point: int, body: Callable[[], object]) -> Optional[str]:
    """Run ``body`` with KeyboardInterrupt raised at its ``point``-th bookkeeping opcode.

    Returns where it was raised, or None when the body ended before that point.
    """
    seen = 0
    where: Optional[str] = None

    def local(frame: FrameType, event: str, arg: Any) -> Optional[Tracer]:
        nonlocal seen, where
        if where is None and event in ("call", "opcode"):
            seen += 1
            if seen == point:
                where = f"{frame.f_code.co_name}:{frame.f_lineno} ({event} @{frame.f_lasti})"
                signal.default_int_handler(signal.SIGINT, frame)
        return local

    def calls(frame: FrameType, event: str, arg: Any) -> Optional[Tracer]:
        if where is not None or frame.f_code not in BOOKKEEPING:
            return None
        frame.f_trace_opcodes = True
        return local(frame, event, arg)

    sys.settrace(calls)
    try:
        body()
    except KeyboardInterrupt:
        assert where is not None, f"point {point}: KeyboardInterrupt with no interrupt raised"
    finally:
        sys.settrace(None)
    return where


def finishes(work: Callable[[], object], within: float) -> bool:
    """Whether ``work`` ends within ``within`` seconds (a daemon thread: a hang stays there)."""
    worker = threading.Thread(target=work, daemon=True)
    worker.start()
    worker.join(within)
    return not worker.is_alive()


def aftermath(q: qs.Queen, caplog: pytest.LogCaptureFixture) -> list[str]:
    """What an interrupted plain acquire must not leave behind on its client."""
    found = []
    if q._acquires != 0:
        found.append(f"{q._acquires} acquire(s) left counted in flight")
    other = q.lock("another", ttl=60)
    if not finishes(other.acquire, HANG):
        found.append("acquire() of another lock hangs")
    elif not other.held:
        found.append("acquire() of another (free) lock failed")
    caplog.clear()
    if not finishes(lambda: q.close(timeout=HANG), HANG + 2):
        found.append("close() hangs past its budget")
    elif "still in flight" in caplog.text:
        found.append("close() waited out its budget for an acquire that is gone")
    return found


class TestCtrlCInAPlainAcquire:
    def test_an_interrupt_at_any_bookkeeping_opcode_leaves_no_lock_held_and_no_count_wrong(
            self, sqlite_url: str, caplog: pytest.LogCaptureFixture) -> None:
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler, \
            "setup: the test needs Python's default SIGINT handler"
        problems: list[str] = []
        for point in range(1, MAX_POINTS):
            q = qs.Queen(sqlite_url, renew_thread=False)
            lock = q.lock(f"job-{point}", ttl=60)
            where = interrupted_at(point, lock.acquire)
            if where is None:
                q.close()
                break
            problems += [f"point {point} at {where}: {p}" for p in aftermath(q, caplog)]
        else:
            pytest.fail(f"a plain acquire never ended within {MAX_POINTS} points")
        assert point > 10, f"setup: only {point} bookkeeping points traced"
        assert not problems, f"{len(problems)} problems, first ones:\n" + "\n".join(problems[:8])
