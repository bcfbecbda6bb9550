"""``queen-sync run``'s command: started under the lease, watched, and never left behind.

The command runs in its own session and process group, so a lost lease stops its
whole tree and a signal to queen-sync reaches it exactly once (forwarded). The lease
is what makes the group's work exclusive, so it is released only once nothing of the
group runs: what the command leaves behind is stopped first. Nor may the group
outlive queen-sync, since nobody renews the lease then: on Linux the kernel's
parent-death signal kills the command itself, and a watchdog process, started before
the command and told its group before ``exec``, kills the rest when queen-sync dies,
however it died.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from typing import IO, TYPE_CHECKING, Any, Callable, Optional

from .singleton import LOST_EXIT_CODE

log = logging.getLogger("queen_sync.cli")

if TYPE_CHECKING:
    from .._handle.lock import Lock

FORWARDED = ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT")


class StopRequested(BaseException):
    """A stop signal came while the lease was being taken (a BaseException, as Ctrl-C's)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


class StopSignals:
    """Catches the forwarded signals from before the acquire until after the release.

    Their default action would end queen-sync holding a lease that nobody releases, left
    for its TTL. While the lease is being taken, the first one raises ``StopRequested``
    (the lock gives back what an acquire cut short took); once ``held()`` each is only
    noted, so the command is not started, or gets it forwarded.
    """

    def __init__(self) -> None:
        self.received: list[int] = []
        self.raising = True
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopSignals:
        for sig in _signals():
            self._previous[sig] = signal.signal(sig, self._note)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def held(self) -> None:
        """The acquire is over: from here a signal is noted, never raised."""
        self.raising = False

    def _note(self, signum: int, frame: Any) -> None:
        self.received.append(signum)
        if self.raising:
            self.raising = False  # once: a second signal must not cut the give-back short
            raise StopRequested(signum)


class Child:
    """The command under the lease: forwarded signals, and stopped when the lease is lost."""

    def __init__(self, lock: Lock, command: list[str], grace: float,
                 relay_stdout: bool = False) -> None:
        self.lock = lock
        self.command = command
        self.grace = grace
        self.relay_stdout = relay_stdout  # pass stdout through, to know how its last line ended
        self.stdout_ends_line = True  # False once a relayed stdout ended mid-line, or may have
        self.process: Optional[subprocess.Popen[bytes]] = None
        self.kill_at: Optional[float] = None  # monotonic; when the group gets SIGKILL
        self.killed = False  # the group got SIGKILL: nothing of it runs user code any more
        self.finished = False  # supervision is over: the group's number may name another
        self.pending: list[int] = []  # signals that came while the command was starting

    def environment(self) -> dict[str, str]:
        lock = self.lock
        return dict(os.environ, QUEEN_LOCK_NAME=lock.name, QUEEN_LOCK_OWNER=lock.owner,
                    QUEEN_LOCK_TOKEN=str(lock.token), QUEEN_LOCK_SLOT=str(lock.slot))

    def run(self, stops: StopSignals) -> int:
        """The command's exit code; ``stops`` noted the signals that came while taking the lease.

        The forwarding handlers go in before anything is started, and a signal that lands
        before the command's process exists is kept and sent to its group once it does.
        """
        previous = {sig: signal.signal(sig, self._forward) for sig in _signals()}
        try:
            if stops.received:  # asked to stop before the command started: it never does
                return _not_run_after(stops.received[0])
            return self._start_and_supervise()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _start_and_supervise(self) -> int:
        # The watchdog comes first and learns the group from the command's own process
        # before exec, so no instruction of the command runs unwatched.
        watchdog = _Watchdog.start()
        relay = StdoutRelay.start() if self.relay_stdout else None
        try:
            # Its own session and group: a lost lease stops the whole tree, and a
            # signal to queen-sync reaches the command exactly once (forwarded).
            self.process = subprocess.Popen(
                self.command, env=self.environment(), start_new_session=True,
                stdout=None if relay is None else relay.write_fd,
                preexec_fn=prepare_child(None if watchdog is None else watchdog.fd))
        except (OSError, subprocess.SubprocessError) as exc:
            _dismiss(watchdog)
            return _not_started(self.command[0], exc)
        finally:
            if relay is not None:
                relay.close_write_end()  # the command's copy is all that is left
        try:
            for signum in self.pending:
                self._forward(signum, None)
            if watchdog is not None:
                watchdog.warn_if_gone()
            return self._supervise(self.process)
        finally:
            self._reap(self.process)
            _dismiss(watchdog)
            if relay is not None:
                self.stdout_ends_line = relay.finish()

    def _supervise(self, process: subprocess.Popen[bytes]) -> int:
        """The exit code, once nothing of the command's group is left running."""
        if self._watch(process):
            self._stop_for_loss()
            return LOST_EXIT_CODE
        self._stop_leftovers()
        return _shell_code(process.wait())

    def _forward(self, signum: int, frame: Any) -> None:
        if self.process is None:  # still starting: the group gets it once it exists
            self.pending.append(signum)
            return
        self._signal_group(signum)
        if signum in _STOPPING and self.kill_at is None:
            self.kill_at = time.monotonic() + self.grace

    def _signal_group(self, signum: int) -> None:
        if self.process is None or self.finished:
            return
        if signum == signal.SIGKILL:
            self.killed = True
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signum)

    def _watch(self, process: subprocess.Popen[bytes]) -> bool:
        """Waits for the command's own process to end; True when the lease was lost first."""
        while not _exited(process):
            if self.lock.lost.is_set() or not self.lock.held:
                return True
            if self.kill_at is not None and time.monotonic() >= self.kill_at:
                self._kill_after_grace()
            time.sleep(_POLL)
        return False

    def _kill_after_grace(self) -> None:
        print(f"queen-sync: the command outlived the {self.grace:g}s grace after being "
              "asked to stop; sending SIGKILL", file=sys.stderr)
        self._signal_group(signal.SIGKILL)
        self.kill_at = None  # once; then wait for it as for any exit

    def _stop_for_loss(self) -> None:
        reason = self.lock.lost_reason or "expired"
        print(f"queen-sync: the lease on {self.lock.name!r} was lost ({reason}); stopping the "
              f"command (SIGTERM, SIGKILL after {self.grace:g}s)", file=sys.stderr)
        self._signal_group(signal.SIGTERM)
        self._drain(time.monotonic() + self.grace)

    def _stop_leftovers(self) -> None:
        """What the command left in its group must not outlive the lease: stop it first."""
        assert self.process is not None
        left = _group_size(self.process.pid)
        if not left:
            return
        if self.killed:  # the group got SIGKILL already: only let it vanish
            self._drain(time.monotonic())
            return
        asked = self.kill_at is not None  # a forwarded signal already asked them to stop
        how = (f"SIGKILL when the {self.grace:g}s grace ends" if asked
               else f"SIGTERM, SIGKILL after {self.grace:g}s")
        print(f"queen-sync: warning: the command exited but left {left} process"
              f"{'es' if left > 1 else ''} running in its group; stopping them ({how}) "
              "before the lease is released", file=sys.stderr)
        if self.kill_at is None:
            self._signal_group(signal.SIGTERM)
            self.kill_at = time.monotonic() + self.grace
        self._drain(self.kill_at)

    def _drain(self, deadline: float) -> None:
        """Waits until nothing of the group runs; SIGKILLs what is left at ``deadline``."""
        assert self.process is not None
        group = self.process.pid
        while _group_size(group) and time.monotonic() < deadline:
            time.sleep(_POLL)
        if _group_size(group):
            self._signal_group(signal.SIGKILL)
            # A SIGKILLed process runs none of its code again; this wait only lets it
            # vanish before the lease is released, bounded for one stuck in the kernel.
            until = time.monotonic() + _KILL_WAIT
            while _group_size(group) and time.monotonic() < until:
                time.sleep(_POLL / 5)

    def _reap(self, process: subprocess.Popen[bytes]) -> None:
        """Collects the command's status; an error in supervision leaves nothing running."""
        if process.returncode is None and _group_size(process.pid):
            self._signal_group(signal.SIGKILL)
        self.finished = True
        process.wait()


_POLL = 0.05  # seconds between looks at the command and the lease
_KILL_WAIT = 1.0  # seconds a SIGKILLed group gets to vanish


def _not_run_after(signum: int) -> int:
    print(f"queen-sync: {signal.Signals(signum).name} came before the command started; "
          "it was not run", file=sys.stderr)
    return 128 + signum


def _not_started(program: str, exc: BaseException) -> int:
    """Reports a command that could not be started: 127 not found, 126 not executable."""
    if not program:  # exec's search says "permission denied" for it; a shell says 127
        print("queen-sync: command not found: '' (an empty name)", file=sys.stderr)
        return 127
    if isinstance(exc, FileNotFoundError) and not _exists(program):
        print(f"queen-sync: command not found: {program}", file=sys.stderr)
        return 127
    if isinstance(exc, FileNotFoundError):  # the file is there: its #! interpreter is not
        why = "its #! interpreter was not found"
    elif os.sep in program and os.path.isdir(program):  # exec says only "permission denied"
        why = "it is a directory"
    else:
        why = (exc.strerror if isinstance(exc, OSError) else None) or str(exc)
    print(f"queen-sync: the command could not be executed: {program} ({why})", file=sys.stderr)
    return 126


def _exists(program: str) -> bool:
    return os.path.exists(program) if os.sep in program else shutil.which(program) is not None


def _dismiss(watchdog: Optional[_Watchdog]) -> None:
    if watchdog is not None:
        watchdog.dismiss()


_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def prepare_child(watchdog: Optional[int]) -> Optional[Callable[[], None]]:
    """A ``preexec_fn``: ties the command to queen-sync and names its group to the watchdog.

    It runs in the command's process after ``setsid`` and before ``exec``, so both are in
    place before the command's first instruction. ``watchdog`` is the write end of the
    watchdog's pipe (None without a watchdog).
    """
    tie = die_with_parent()
    if tie is None and watchdog is None:
        return None

    def prepare() -> None:
        if tie is not None:
            tie()
        if watchdog is not None:
            _name_group(watchdog)

    return prepare


def _name_group(fd: int) -> None:
    # SIGPIPE is back at its default here (``restore_signals``): a watchdog that died must
    # not kill the command before it starts (queen-sync warns about the missing watchdog
    # instead). Python's own record still says "ignored", so the default is set by name.
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    try:
        os.write(fd, b"%d\n" % os.getpgid(0))
    except OSError:
        pass
    finally:
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)


def die_with_parent() -> Optional[Callable[[], None]]:
    """The part of ``preexec_fn`` that has the kernel SIGKILL the command when queen-sync dies.

    SIGKILL, not SIGTERM: once queen-sync is gone nobody renews the lease or enforces
    ``--grace``, so a command that caught SIGTERM to finish its work would do that work
    unprotected. None where there is no ``prctl`` (not Linux).
    """
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def tie() -> None:
        # The signal fires when the THREAD that forked exits: this is the CLI's main
        # thread, which lives as long as queen-sync does.
        prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL))
        if os.getppid() != parent:  # queen-sync died before the tie was made
            os.kill(os.getpid(), signal.SIGKILL)

    return tie


# Reads the command's group (a line the command's process writes before exec), then waits
# for queen-sync to say "done" or to die (end of file, whatever killed it); on the latter
# it kills the whole group.
_WATCHDOG_CODE = """\
import os, signal, sys
group = None
for line in sys.stdin.buffer:
    if line == b"done\\n":
        sys.exit()
    group = int(line)
if group is not None:
    try:
        os.killpg(group, signal.SIGKILL)
    except OSError:
        pass
"""


class _Watchdog:
    """A tiny process that kills the command's process group if queen-sync dies first.

    The parent-death signal reaches only the command's own process; what it started
    (``sh -c 'a; b'`` forks ``a``) would run on without a lease. A pipe's end of file
    is how the watchdog learns that queen-sync is gone, however it died.
    """

    def __init__(self, process: subprocess.Popen[bytes], stdin: IO[bytes]) -> None:
        self.process = process
        self.stdin = stdin
        self.fd = stdin.fileno()

    @classmethod
    def start(cls) -> Optional[_Watchdog]:
        if not sys.executable:
            return None
        try:
            # Its own session: a Ctrl-C or SIGHUP meant for queen-sync never reaches it.
            process = subprocess.Popen([sys.executable, "-I", "-S", "-c", _WATCHDOG_CODE],
                                       stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                       start_new_session=True)
        except OSError as exc:
            print(f"queen-sync: warning: no watchdog for the command ({exc}); what it starts "
                  "may outlive a killed queen-sync", file=sys.stderr)
            return None
        assert process.stdin is not None
        return cls(process, process.stdin)

    def warn_if_gone(self) -> None:
        if self.process.poll() is not None:
            print("queen-sync: warning: the command's watchdog is gone; what the command "
                  "starts may outlive a killed queen-sync", file=sys.stderr)

    def dismiss(self) -> None:
        """The command is over: the watchdog exits without killing anything."""
        with contextlib.suppress(OSError):  # it died already: nothing to tell it
            self.stdin.write(b"done\n")
        with contextlib.suppress(OSError):
            self.stdin.close()
        try:
            self.process.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


class StdoutRelay:
    """The command's stdout passed through to queen-sync's own, byte for byte.

    ``run --json`` promises its result as the last line of stdout; only bytes that pass
    through here tell whether the command left its last line unfinished. A stdout that
    whose reader went away ends the relay, so the command meets EPIPE (SIGPIPE) as it
    would have writing there itself.
    """

    def __init__(self, read_fd: int, write_fd: int) -> None:
        self.read_fd = read_fd
        self.write_fd: Optional[int] = write_fd
        self.ends_line = True
        self.thread = threading.Thread(target=self._pump, name="queen-sync stdout relay",
                                       daemon=True)

    @classmethod
    def start(cls) -> StdoutRelay:
        relay = cls(*os.pipe())
        relay.thread.start()
        return relay

    def close_write_end(self) -> None:
        if self.write_fd is not None:
            os.close(self.write_fd)
            self.write_fd = None

    def finish(self) -> bool:
        """True when stdout ends a line; False when it does not, or is still being written.

        A process that left the command's group may hold the pipe open; it is not waited
        for longer than ``_RELAY_WAIT``.
        """
        self.close_write_end()
        self.thread.join(_RELAY_WAIT)
        return self.ends_line and not self.thread.is_alive()

    def _pump(self) -> None:
        failed: Optional[OSError] = None
        try:
            while chunk := os.read(self.read_fd, 1 << 16):
                if failed is not None:
                    continue  # drained, so the command is not blocked on a full pipe
                try:
                    _write_all(_STDOUT, chunk)
                    self.ends_line = chunk.endswith(b"\n")
                except BrokenPipeError:
                    return  # the reader went away: the command meets EPIPE, as it would
                except OSError as exc:  # a full disk: said once, the rest is dropped
                    failed = exc
                    print(f"queen-sync: warning: the command's stdout could not be written "
                          f"({exc.strerror or exc}); the rest of it is dropped", file=sys.stderr)
        except BaseException:
            log.exception("the relay of the command's stdout stopped")
        finally:
            os.close(self.read_fd)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


_STDOUT = 1
_RELAY_WAIT = 1.0  # seconds a relay is waited for once the command's group is gone


def relays_stdout() -> bool:
    """Whether ``run --json`` passes the command's stdout through: an open one, not a terminal.

    A terminal stays the command's own (it may ask ``isatty``); a person reads it there.
    """
    if sys.__stdout__ is None:  # closed when Python started: the command gets it closed too
        return False
    try:
        os.fstat(_STDOUT)
    except OSError:
        return False
    return not os.isatty(_STDOUT)


def hold_closed_stdio() -> None:
    """Put ``/dev/null`` on each of stdin, stdout and stderr that is closed, kept from the
    command (close-on-exec), which gets it closed as this process was given it.

    Else the next descriptor opened (the engine's socket, the database file) takes its
    number, and what is written to that stream goes into it: a command's output relayed
    into the broker's connection, which drops it, and the command dies of SIGPIPE.
    """
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            held = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
            if held != fd:  # a lower number came free meanwhile: move it into place
                os.dup2(held, fd, inheritable=False)
                os.close(held)


# Linux lists a group's members in /proc; elsewhere only "is anybody left" can be asked.
_PROC = os.path.exists("/proc/self/stat")


def _exited(process: subprocess.Popen[bytes]) -> bool:
    """True once the command's own process has ended.

    Where /proc lists the group, the process is left unreaped (a zombie): its pid names
    the group, and no other process or group can take that number while it is emptied.
    """
    if process.returncode is not None:
        return True
    if _PROC and hasattr(os, "waitid"):
        flags = os.WEXITED | os.WNOHANG | os.WNOWAIT
        return os.waitid(os.P_PID, process.pid, flags) is not None
    return process.poll() is not None


def _group_size(group: int) -> int:
    """How many processes of ``group`` still run (zombies excluded)."""
    if not _PROC:
        try:
            os.killpg(group, 0)
        except ProcessLookupError:
            return 0
        except PermissionError:
            pass
        return 1
    return sum(1 for pid in os.listdir("/proc") if pid.isdigit() and _runs_in(pid, group))


def _runs_in(pid: str, group: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            fields = stat.read().rsplit(b")", 1)[1].split()
    except OSError:  # it ended while the list was read
        return False
    return fields[0] not in (b"Z", b"X") and int(fields[2]) == group


# Forwarded signals that ask the command to stop: it gets --grace to do so before SIGKILL.
# SIGHUP and SIGQUIT are only forwarded (daemons often take SIGHUP as "reload").
_STOPPING = frozenset({signal.SIGTERM, signal.SIGINT})


def _signals() -> list[signal.Signals]:
    return [getattr(signal, name) for name in FORWARDED if hasattr(signal, name)]


def _shell_code(returncode: int) -> int:
    """A child's exit status as a shell reports it: 128+N when killed by signal N."""
    return 128 - returncode if returncode < 0 else returncode
