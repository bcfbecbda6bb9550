"""``queen-sync run``'s command: started under the lease, watched, and never left behind.

The command runs in its own session and process group, so a lost lease stops its
whole tree and a signal to queen-sync reaches it exactly once (forwarded). It must
not outlive queen-sync either, since nobody renews the lease then: on Linux the
kernel's parent-death signal kills the command itself, and a watchdog process kills
the rest of its group when queen-sync dies, however it died.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from typing import TYPE_CHECKING, Any, Callable, Optional

from .singleton import LOST_EXIT_CODE

if TYPE_CHECKING:
    from .._handle.lock import Lock

FORWARDED = ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT")


class Child:
    """The command under the lease: forwarded signals, and stopped when the lease is lost."""

    def __init__(self, lock: Lock, command: list[str], grace: float) -> None:
        self.lock = lock
        self.command = command
        self.grace = grace
        self.process: Optional[subprocess.Popen[bytes]] = None
        self.kill_at: Optional[float] = None  # monotonic; set by the first SIGTERM or SIGINT

    def environment(self) -> dict[str, str]:
        lock = self.lock
        return dict(os.environ, QUEEN_LOCK_NAME=lock.name, QUEEN_LOCK_OWNER=lock.owner,
                    QUEEN_LOCK_TOKEN=str(lock.token), QUEEN_LOCK_SLOT=str(lock.slot))

    def run(self) -> int:
        try:
            # Its own session and group: a lost lease stops the whole tree, and a
            # signal to queen-sync reaches the command exactly once (forwarded).
            self.process = subprocess.Popen(self.command, env=self.environment(),
                                            start_new_session=True,
                                            preexec_fn=die_with_parent())
        except FileNotFoundError:
            print(f"queen-sync: command not found: {self.command[0]}", file=sys.stderr)
            return 127
        except PermissionError:
            print(f"queen-sync: cannot execute: {self.command[0]}", file=sys.stderr)
            return 126
        watchdog = _Watchdog.start(self.process.pid)
        previous = {sig: signal.signal(sig, self._forward) for sig in _signals()}
        try:
            return self._watch(self.process)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            if watchdog is not None:
                watchdog.dismiss()

    def _forward(self, signum: int, frame: Any) -> None:
        self._signal_group(signum)
        if signum in _STOPPING and self.kill_at is None:
            self.kill_at = time.monotonic() + self.grace

    def _signal_group(self, signum: int) -> None:
        if self.process is None or self.process.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signum)

    def _watch(self, process: subprocess.Popen[bytes]) -> int:
        while True:
            try:
                return _shell_code(process.wait(timeout=0.05))
            except subprocess.TimeoutExpired:
                pass
            if self.lock.lost.is_set() or not self.lock.held:
                return self._stop(process)
            if self.kill_at is not None and time.monotonic() >= self.kill_at:
                print(f"queen-sync: the command outlived the {self.grace:g}s grace after being "
                      "asked to stop; sending SIGKILL", file=sys.stderr)
                self._signal_group(signal.SIGKILL)
                self.kill_at = None  # once; then wait for it as for any exit

    def _stop(self, process: subprocess.Popen[bytes]) -> int:
        reason = self.lock.lost_reason or "expired"
        print(f"queen-sync: the lease on {self.lock.name!r} was lost ({reason}); stopping the "
              f"command (SIGTERM, SIGKILL after {self.grace:g}s)", file=sys.stderr)
        self._signal_group(signal.SIGTERM)
        try:
            process.wait(timeout=self.grace)
        except subprocess.TimeoutExpired:
            self._signal_group(signal.SIGKILL)
            process.wait()
        return LOST_EXIT_CODE


_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def die_with_parent() -> Optional[Callable[[], None]]:
    """A ``preexec_fn`` that has the kernel SIGKILL the command when queen-sync dies (Linux).

    SIGKILL, not SIGTERM: once queen-sync is gone nobody renews the lease or enforces
    ``--grace``, so a command that caught SIGTERM to finish its work would do that work
    unprotected. None where there is no ``prctl`` (the command then outlives a killed
    queen-sync, as documented).
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


# Reads its stdin until queen-sync says "done" (one byte) or dies (end of file, whatever
# killed it); on the latter it kills the command's whole process group.
_WATCHDOG_CODE = """\
import os, signal, sys
if not sys.stdin.buffer.read(1):
    try:
        os.killpg(int(sys.argv[1]), signal.SIGKILL)
    except OSError:
        pass
"""


class _Watchdog:
    """A tiny process that kills the command's process group if queen-sync dies first.

    The parent-death signal reaches only the command's own process; what it started
    (``sh -c 'a; b'`` forks ``a``) would run on without a lease. A pipe's end of file
    is how the watchdog learns that queen-sync is gone, however it died.
    """

    def __init__(self, process: subprocess.Popen[bytes]) -> None:
        self.process = process

    @classmethod
    def start(cls, group: int) -> Optional[_Watchdog]:
        if not sys.executable:
            return None
        try:
            # Its own session: a Ctrl-C or SIGHUP meant for queen-sync never reaches it.
            process = subprocess.Popen([sys.executable, "-I", "-S", "-c", _WATCHDOG_CODE,
                                        str(group)], stdin=subprocess.PIPE,
                                       stdout=subprocess.DEVNULL, start_new_session=True)
        except OSError as exc:
            print(f"queen-sync: warning: no watchdog for the command ({exc}); what it starts "
                  "may outlive a killed queen-sync", file=sys.stderr)
            return None
        return cls(process)

    def dismiss(self) -> None:
        """The command is over: the watchdog exits without killing anything."""
        stdin = self.process.stdin
        if stdin is not None:
            with contextlib.suppress(OSError):  # it died already: nothing to tell it
                stdin.write(b"x")
            with contextlib.suppress(OSError):
                stdin.close()
        try:
            self.process.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


# Forwarded signals that ask the command to stop: it gets --grace to do so before SIGKILL.
# SIGHUP and SIGQUIT are only forwarded (daemons often take SIGHUP as "reload").
_STOPPING = frozenset({signal.SIGTERM, signal.SIGINT})


def _signals() -> list[signal.Signals]:
    return [getattr(signal, name) for name in FORWARDED if hasattr(signal, name)]


def _shell_code(returncode: int) -> int:
    """A child's exit status as a shell reports it: 128+N when killed by signal N."""
    return 128 - returncode if returncode < 0 else returncode
