"""``@singleton_job``: a function that runs on at most one process at a time, fleet-wide.

```python
import queen_sync as qs

@qs.singleton_job("daily-report", ttl="2m")
def daily_report() -> int:
    lock = qs.current_lock()          # the lease this run holds; fence writes with it
    assert lock is not None and lock.held
    return 42

print(daily_report())                 # 42, or None (and a log line) when another copy holds it
```

What it guarantees: while one call holds the lease no other call (any thread,
process or host sharing the engine) starts the body; the lease is released on
return and on exception; with ``once_per`` a period's completion is recorded in
a transaction guarded by the lease, so at most one completion per period is
recorded fleet-wide. What it does not: stop a body that kept running after its
lease expired from doing side effects; fence those with ``lock.token`` or
``transaction().guard(lock)`` (``on_lost="interrupt"`` narrows the window, it
cannot close it).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import math
import os
import signal
import threading
import time
import warnings
from dataclasses import dataclass
from types import FrameType
from typing import (
    TYPE_CHECKING,
    Any,
    Callable,
    Iterator,
    Literal,
    Optional,
    TypeVar,
    Union,
    cast,
    overload,
)

from typing_extensions import Concatenate, ParamSpec

from .._durations import Duration, lease_seconds, parse_duration, utc_text
from .._errors import LockBusyError, LockLostError, LockNotHeldError
from .._handle.interrupts import defer_if_held
from .._handle.lock import (
    Lock,
    check_body,
    check_body_result,
    require_arbitration,
    wait_seconds,
)
from .._handle.losses import Reaction
from .._ops import check_name
from .._results import Result, describe_holders

if TYPE_CHECKING:
    from .._client import Queen
    from .supervision import Supervisor

log = logging.getLogger("queen_sync")
P = ParamSpec("P")
T = TypeVar("T")

OnBusy = Literal["skip", "raise", "wait"]
OnLost = Union[Literal["interrupt", "exit", "ignore"], Callable[[Lock], Any]]

# Exit code of a process ended because its lease was lost (on_lost="exit", queen-sync run):
# distinct from 75 (busy), 1/2 (common failures), 126/127 (shell) and 128+n (signals).
LOST_EXIT_CODE = 76
EXIT_LOG_SECONDS = 1.0  # how long on_lost="exit" gives the log handlers before it exits anyway
LANDING_SECONDS = 1.0  # how long a job's end waits for its interrupt, already sent, to land

ONCE_NS = "queen-jobs"
_ON_BUSY = ("skip", "raise", "wait")
_ON_LOST = ("interrupt", "exit", "ignore")
_wall: Callable[[], float] = time.time  # the wall clock periods are cut on (tests replace it)


@dataclass(frozen=True)
class _Spec:
    name: Optional[str]
    ttl: float
    wait: float
    on_busy: str
    on_lost: OnLost
    client: Optional[Queen]
    bind: bool
    once_per: Optional[float]
    supervision: Optional[str]


@overload
def singleton_job(name: Callable[P, T], /) -> Callable[P, Optional[T]]: ...


@overload
def singleton_job(name: Optional[str] = None, *, ttl: Duration = 60, wait: Duration = 0,
                  on_busy: OnBusy = "skip", on_lost: OnLost = "interrupt",
                  client: Optional[Queen] = None, bind: Literal[False] = False,
                  once_per: Optional[Duration] = None, supervision: Optional[str] = None,
                  queen: Optional[Queen] = None,
                  ) -> Callable[[Callable[P, T]], Callable[P, Optional[T]]]: ...


@overload
def singleton_job(name: Optional[str] = None, *, ttl: Duration = 60, wait: Duration = 0,
                  on_busy: OnBusy = "skip", on_lost: OnLost = "interrupt",
                  client: Optional[Queen] = None, bind: Literal[True],
                  once_per: Optional[Duration] = None, supervision: Optional[str] = None,
                  queen: Optional[Queen] = None,
                  ) -> Callable[[Callable[Concatenate[Lock, P], T]],
                                Callable[P, Optional[T]]]: ...


def singleton_job(name: Any = None, *, ttl: Duration = 60, wait: Duration = 0,
                  on_busy: OnBusy = "skip", on_lost: OnLost = "interrupt",
                  client: Optional[Queen] = None, bind: bool = False,
                  once_per: Optional[Duration] = None, supervision: Optional[str] = None,
                  queen: Optional[Queen] = None) -> Any:
    """Run the decorated function only while holding the lease ``name``.

    Use it bare (``@singleton_job``: the name is the function's module and
    qualified name) or with arguments. The wrapper keeps the function's signature
    and returns its value, or None when the call was skipped.

    Args:
        name: the lock name, shared by every copy of the job on every host.
        ttl: the lease's lifetime; renewed at a third of it while the body runs, so
            it only bounds how long a crashed holder keeps others out (default 1 minute).
        wait: how long to wait for a busy lease before ``on_busy`` applies.
        on_busy: ``"skip"`` logs who holds it (owner, since, expires) and returns
            None; ``"raise"`` raises ``LockBusyError`` with the holders; ``"wait"``
            waits up to ``wait`` (required then) and raises ``LockBusyError`` after.
        on_lost: ``"interrupt"`` stops the body when it runs in the main thread, by a
            ``KeyboardInterrupt`` raised in it (which no ``except Exception`` swallows),
            and the call raises ``LockLostError`` in its place; a loss noticed as the
            body returns raises ``LockLostError`` in place of the value (elsewhere it
            only logs and sets ``lock.lost``);
            ``"exit"`` logs and ends the process with exit code 76; ``"ignore"``
            only sets ``lock.lost``; a callable is called with the lock.
        client: the client; None uses ``queen_sync.default_client()`` at call time.
        bind: pass the lock as the first argument (for plain functions; a method
            reads ``queen_sync.current_lock()`` instead).
        once_per: run at most once per period (e.g. ``"1d"``: one UTC day) across
            the fleet: a call in a period already completed skips, logging when and
            by whom it ran.
        supervision: a group name (the broker's rule: 1-255 of ``A-Za-z0-9._-``, first
            a letter or digit, not ``coordination``): publish the job's status where
            the broker's Supervisors page reads it, while it runs (off by default: no
            thread, no traffic).
        queen: the old name of ``client`` (deprecated: it warns).

    Raises:
        TypeError, ValueError: at decoration, for a bad argument (nothing is sent).
        UnsupportedOperationError: the client's engine cannot arbitrate a lease (it lacks
            ``fencing`` or ``engine_clock_expiry``): at decoration when ``client`` is
            given, else at the call.
    """
    client = _client_argument(client, queen)
    if callable(name) and not isinstance(name, str):
        return _decorate(_spec(None, ttl, wait, on_busy, on_lost, client, bind, once_per,
                               supervision), name)
    spec = _spec(name, ttl, wait, on_busy, on_lost, client, bind, once_per, supervision)
    return functools.partial(_decorate, spec)


def _check_client(client: Optional[Queen], keyword: str) -> None:
    from .._client import Queen

    if client is not None and not isinstance(client, Queen):
        raise TypeError(f"{keyword} must be a queen_sync.Queen or None, "
                        f"not {type(client).__name__}")


def _client_argument(client: Optional[Queen], queen: Optional[Queen]) -> Optional[Queen]:
    """``client``, or the deprecated ``queen`` (with a warning pointing at the decorated line)."""
    if queen is None:
        return client
    if client is not None:
        raise TypeError("give client= only (queen= is its deprecated old name)")
    _check_client(queen, "queen")
    warnings.warn("singleton_job(queen=...) is deprecated; pass client=... instead",
                  DeprecationWarning, stacklevel=3)
    return queen


def _spec(name: Optional[str], ttl: Duration, wait: Duration, on_busy: str, on_lost: OnLost,
          client: Optional[Queen], bind: bool, once_per: Optional[Duration],
          supervision: Optional[str]) -> _Spec:
    if name is not None:
        check_name(name)
    if on_busy not in _ON_BUSY:
        raise ValueError(f"on_busy must be one of {_ON_BUSY}, got {on_busy!r}")
    if not callable(on_lost) and on_lost not in _ON_LOST:
        raise ValueError(f"on_lost must be one of {_ON_LOST} or a callable, got {on_lost!r}")
    waiting = wait_seconds(wait)
    if on_busy == "wait" and waiting <= 0:
        raise ValueError('on_busy="wait" needs wait= (how long to wait), e.g. wait="30s"')
    _check_client(client, "client")
    if not isinstance(bind, bool):
        raise TypeError("bind must be True or False")
    if supervision is not None:
        from .supervision import check_group  # loaded only by jobs that publish a status

        check_group(supervision)
    period = parse_duration(once_per, what="once_per") if once_per is not None else None
    return _Spec(name, lease_seconds(ttl), waiting, on_busy, on_lost, client, bind,
                 period, supervision)


def _decorate(spec: _Spec, fn: Callable[..., T]) -> Callable[..., Optional[T]]:
    if isinstance(fn, staticmethod):
        # The function inside, decorated as if written below it: the plain function this
        # would return would take the instance it is called on as its first argument.
        inner: Callable[..., T] = fn.__func__
        return cast(Callable[..., Optional[T]], staticmethod(_decorate(spec, inner)))
    if not callable(fn):
        raise TypeError(f"singleton_job decorates a function, not {type(fn).__name__}")
    check_body(fn, "singleton_job")
    if spec.bind and _is_method_body(fn):
        raise TypeError(
            f"singleton_job(bind=True) passes the lock as the first argument, where the method "
            f"{fn.__qualname__} takes its {_first_parameter(fn)!r}: leave bind out and read "
            "queen_sync.current_lock() in the body")
    name = spec.name or _name_of(fn)
    check_name(name)
    if spec.client is not None:
        require_arbitration(spec.client.engine, f"job {name!r}")
    supervisor: Optional[Supervisor] = None
    if spec.supervision is not None:
        from .supervision import Supervisor

        supervisor = Supervisor(spec.supervision, name)

    @functools.wraps(fn)
    def job(*args: Any, **kwargs: Any) -> Optional[T]:
        return _call(spec, name, fn, supervisor, args, kwargs)

    return job


def _first_parameter(fn: Callable[..., Any]) -> Optional[str]:
    try:
        parameters = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):  # a builtin without a signature
        return None
    return parameters[0] if parameters else None


def _is_method_body(fn: Callable[..., Any]) -> bool:
    """Whether ``fn`` is defined in a class body and takes ``self`` or ``cls`` first.

    A static method or a nested function has no such first parameter; its qualified name
    tells a class body (``Job.run``) from a function's (``outer.<locals>.run``).
    """
    qualname = getattr(fn, "__qualname__", "")
    in_class = isinstance(qualname, str) and "." in qualname and \
        qualname.rsplit(".", 2)[-2] != "<locals>"
    return in_class and _first_parameter(fn) in ("self", "cls")


def _name_of(fn: Callable[..., Any]) -> str:
    """The lease name of a bare ``@singleton_job``: the function's module and qualified name."""
    qualname, module = getattr(fn, "__qualname__", None), getattr(fn, "__module__", None)
    if not isinstance(qualname, str) or not isinstance(module, str):
        # A partial of one function may be meant as one job or as one per argument.
        raise TypeError(f"a {type(fn).__name__} has no name to give its lease: use "
                        f'singleton_job("a-name")(...)')
    return f"{module}.{qualname}"


def _call(spec: _Spec, name: str, fn: Callable[..., T], supervisor: Optional[Supervisor],
          args: tuple[Any, ...], kwargs: dict[str, Any]) -> Optional[T]:
    from .._default import default_client

    client = spec.client if spec.client is not None else default_client()
    require_arbitration(client.engine, f"job {name!r}")
    period = _Period(name, spec.once_per) if spec.once_per is not None else None
    if period is not None and period.done(client):
        return None
    lock = client.lock(name, ttl=spec.ttl, wait=spec.wait)

    def work() -> T:
        with _supervised(supervisor, client):
            value = fn(lock, *args, **kwargs) if spec.bind else fn(*args, **kwargs)
            check_body_result(value, "singleton_job")  # before the period is marked done
            return value

    def body() -> Optional[T]:
        if period is not None and period.done(client):
            return None
        value = _reacting_to_loss(spec, lock, work)
        if period is not None:
            period.record(client, lock)
        return value

    outcome = lock.run(body)
    if outcome.acquired:
        return outcome.value
    busy = describe_holders(outcome.holders)
    if spec.on_busy == "skip":
        log.info("job %r skipped: lock is busy: %s", name, busy)
        return None
    raise LockBusyError(f"job {name!r} did not run: lock is busy: {busy}", name=name,
                        holders=outcome.holders)


@contextlib.contextmanager
def _supervised(supervisor: Optional[Supervisor], client: Queen) -> Iterator[None]:
    if supervisor is None:
        yield
        return
    with supervisor.running(client):
        yield


# ---- loss -----------------------------------------------------------------------------------


def _reacting_to_loss(spec: _Spec, lock: Lock, work: Callable[[], T]) -> T:
    """Run ``work`` (the body) with the job's reaction to a lost lease in place."""
    action = spec.on_lost
    if callable(action):
        react = action
        lock.on_lost(lambda _reason: react(lock))
    elif action == "exit":
        lock.on_lost(Reaction(lambda reason: _exit_lost(lock, reason)))
    if action != "interrupt":
        return work()
    if threading.current_thread() is not threading.main_thread():
        lock.on_lost(lambda reason: log.warning(
            "job %r lost its lease (%s) in a thread that cannot be interrupted; "
            "lock.lost is set", lock.name, reason))
        return work()
    return _Interrupter(lock).run(work)


def _exit_lost(lock: Lock, reason: str) -> None:
    # The log handlers are the application's: a stuck one must not keep the body running.
    teller = threading.Thread(target=_tell_exit, args=(lock, reason),
                              name="queen_sync-exit-log", daemon=True)
    try:
        teller.start()
    except RuntimeError:  # no thread can start: exit untold rather than risk a hang
        os._exit(LOST_EXIT_CODE)
    teller.join(EXIT_LOG_SECONDS)
    os._exit(LOST_EXIT_CODE)


def _tell_exit(lock: Lock, reason: str) -> None:
    log.critical("job %r lost its lease (%s); ending the process with exit code %d",
                 lock.name, reason, LOST_EXIT_CODE)
    for handler in logging.getLogger().handlers + log.handlers:
        with contextlib.suppress(Exception):
            handler.flush()


def _blocks_sigint(native_id: Optional[int]) -> bool:
    """Whether the thread ``native_id`` blocks SIGINT (read where Linux tells; else False)."""
    try:
        with open(f"/proc/self/task/{native_id}/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("SigBlk:"):
                    return bool(int(line.split()[1], 16) >> (signal.SIGINT - 1) & 1)
    except (OSError, ValueError):
        pass
    return False


class _Interrupter:
    """While the body runs in the main thread, a lost lease interrupts it.

    The loss reaction sends SIGINT to the main thread (a real signal wakes a blocking
    sleep or read). This SIGINT handler turns OUR interrupt into a ``KeyboardInterrupt``
    that ``run`` converts to ``LockLostError``, and hands any other SIGINT (a real
    Ctrl-C) to the handler that was there before. Either is raised only inside the body,
    and there not in a handle's bookkeeping (``defer_if_held``: a lock's gate left taken
    would hang its next exit). One landing in the job's own set-up or tear-down is noted
    and raised at the body's edge, so the previous handler is always put back.
    """

    def __init__(self, lock: Lock) -> None:
        self._lock = lock
        self._mutex = threading.Lock()
        self._active = False
        self._pending = False  # our interrupt was sent and has not landed
        self._in_body = False
        self._ctrl_c = False  # a real Ctrl-C landed outside the body: replayed at its edge
        self.fired = False  # our interrupt landed while the body could still be stopped
        self._previous: Any = signal.getsignal(signal.SIGINT)

    def run(self, work: Callable[[], T]) -> T:
        """Run ``work``; a loss before it returned raises ``LockLostError`` instead."""
        try:
            self._install()
            value = self._body(work)
        except KeyboardInterrupt as exc:
            self._uninstall()
            if not self.fired:
                raise
            raise self._lost_error("stopped: its lease was lost") from exc
        except BaseException:
            self._uninstall()
            raise
        self._uninstall()
        # Lost while it ran, the interrupt outrun by the return: the work was not exclusive.
        if self.fired or self._lock.lost.is_set():
            raise self._lost_error("lost its lease before it finished; its value is dropped")
        return value

    def _install(self) -> None:
        signal.signal(signal.SIGINT, self._on_sigint)
        self._active = True
        self._lock.on_lost(Reaction(self._lost))

    def _body(self, work: Callable[[], T]) -> T:
        self._in_body = True
        try:
            if self.fired:  # landed during the set-up
                raise KeyboardInterrupt
            if self._ctrl_c:
                self._ctrl_c = False
                signal.raise_signal(signal.SIGINT)  # handled as if it landed here
            return work()
        finally:
            self._in_body = False

    def _uninstall(self) -> None:
        self._active = False
        with self._mutex:  # past it no reaction is mid-send: _pending tells what was sent
            sent = self._pending
        if sent:
            self._await_landing()
        if self._previous is not None:  # None: set outside Python, which cannot be restored
            signal.signal(signal.SIGINT, self._previous)  # runs pending handlers first
        if self._ctrl_c:
            self._ctrl_c = False
            signal.raise_signal(signal.SIGINT)  # to the handler it was meant for

    def _await_landing(self) -> None:
        """Let our interrupt, sent to this thread, land here rather than after the job."""
        deadline = time.monotonic() + LANDING_SECONDS
        while self._pending and time.monotonic() < deadline:
            time.sleep(0.001)  # a signal sent to this thread lands when the sleep returns

    def _lost(self, reason: str) -> None:
        with self._mutex:
            if not self._active:
                return
            self._pending = True
            main = threading.main_thread()
            if hasattr(signal, "pthread_kill") and not _blocks_sigint(main.native_id):
                assert main.ident is not None
                signal.pthread_kill(main.ident, signal.SIGINT)  # also cuts a blocking call short
            else:
                # A signal the thread blocks would wait in the kernel and land after the job:
                # this one runs the handler at the thread's next bytecode and leaves nothing.
                import _thread

                _thread.interrupt_main()

    def _on_sigint(self, signum: int, frame: Optional[FrameType]) -> None:
        if not self._pending:
            self._forward(signum, frame)
            return
        self._pending = False
        if not self._active:  # the body has ended: ``run`` reads the loss from lock.lost
            return
        self.fired = True
        if self._in_body and not defer_if_held(frame):
            raise KeyboardInterrupt

    def _forward(self, signum: int, frame: Optional[FrameType]) -> None:
        """A real Ctrl-C: to the previous handler, or raised as Python's default would."""
        if not self._in_body:
            self._ctrl_c = True
            return
        previous = self._previous
        if callable(previous) and previous is not signal.default_int_handler:
            previous(signum, frame)
        elif previous != signal.SIG_IGN and not defer_if_held(frame):
            raise KeyboardInterrupt

    def _lost_error(self, what: str) -> LockLostError:
        lock = self._lock
        reason = lock.lost_reason or "lost"
        return LockLostError(f"job {lock.name!r} {what} ({reason})", name=lock.name,
                             reason=reason, token=lock.last_token)


# ---- once per period ------------------------------------------------------------------------


class _Period:
    """The fleet-wide record that a job completed in the current period."""

    def __init__(self, name: str, seconds: float) -> None:
        self.name = name
        self.seconds = seconds
        self.index = math.floor(_wall() / seconds)
        self.key = f"{name}#once#{seconds:g}#{self.index}"

    def done(self, client: Queen) -> bool:
        found = client.kv.get(ONCE_NS, self.key)
        if not found:
            return False
        value = found.get("value") or {}
        finished = value.get("finished") if isinstance(value, dict) else None
        when = utc_text(finished) if isinstance(finished, (int, float)) else "an unknown time"
        who = value.get("owner") if isinstance(value, dict) else None
        log.info("job %r skipped: it already ran in this %s period, finished at %s by %s",
                 self.name, _span(self.seconds), when, who or "an unknown owner")
        return True

    def record(self, client: Queen, lock: Lock) -> None:
        started = self.index * self.seconds
        value = {"owner": lock.owner, "token": lock.token, "finished": int(_wall() * 1000),
                 "period_start": int(started * 1000)}
        lifetime = max(1, math.ceil(started + 2 * self.seconds - _wall()))
        try:
            answer = (client.transaction().guard(lock)
                      .once(ONCE_NS, self.key, value=value, ttl_seconds=lifetime).commit())
        except LockNotHeldError:
            answer = Result({"success": False, "reason": "lease lost"})
        if not answer:
            log.warning("job %r ran but its completion was not recorded (%s): the lease was "
                        "lost or another copy recorded first", self.name,
                        answer.get("kvReason") or answer.get("reason"))


def _span(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{seconds / size:g}{unit}"
    return f"{seconds:g}s"
