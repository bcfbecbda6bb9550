"""Cross-process wake-up on release for the SQLite engine.

A waiter binds a Unix datagram socket in a folder private to this (effective) user and
database, in a subfolder of its lock name; a process that frees a permit sends one
byte to every socket in the subfolders of the names it freed, so a release reads
the waiters of its names and no others. That turns a hand-off into a wake-up instead
of a poll period, while waiters still time out and retry, so a lost datagram only
costs latency. The last waiter of a name to leave removes the name's subfolder.

The folder lies under a directory other users may write to (the temp directory,
when cron leaves ``XDG_RUNTIME_DIR`` unset), so every folder on its path is checked
before use: ours, not a symlink, writable by nobody else; a name's subfolder too, since
a stray symlink there would lead a release to other files. A folder that fails, or a
path too long for a socket, turns waiting into plain polling: slower, never broken.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import secrets
import socket
import stat
import tempfile
import time
from typing import Iterable, Iterator, Optional, Sequence, Union

log = logging.getLogger("queen_sync")


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


class _SocketWaiter:
    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock

    def wait(self, timeout: float) -> bool:
        self._sock.settimeout(max(timeout, 0.0005))
        try:
            self._sock.recv(16)
        except (TimeoutError, BlockingIOError):
            return False
        self._sock.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            while self._sock.recv(16):
                pass
        return True


class _PollingWaiter:
    def wait(self, timeout: float) -> bool:
        time.sleep(max(0.0, timeout))
        return False


class _UnsafeFolderError(OSError):
    """A folder on the wake-up path could be changed by another user."""


def _check_base(path: str) -> None:
    """Every folder from ``/`` to ``path``: root's or ours, and if others may write, sticky."""
    here = os.path.realpath(path)
    while True:
        info = os.stat(here)
        shared = info.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
        if info.st_uid not in (0, os.geteuid()) or (shared and not info.st_mode & stat.S_ISVTX):
            raise _UnsafeFolderError(f"{here} may be changed by another user")
        parent = os.path.dirname(here)
        if parent == here:
            return
        here = parent


def _private_folder(path: str, *, create: bool) -> os.stat_result:
    """Refuse ``path`` unless it is a folder of ours alone; make it (0700) first if asked.

    When making, a folder found private is set to 0700: under a restrictive umask mkdir
    leaves out the owner's write bit, and no waiter could bind a socket in it.
    """
    if create:
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, 0o700)
    info = os.lstat(path)
    if (not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid()
            or info.st_mode & (stat.S_IWGRP | stat.S_IWOTH)):
        raise _UnsafeFolderError(f"{path} is not a folder private to this user")
    if create and stat.S_IMODE(info.st_mode) != 0o700:
        os.chmod(path, 0o700)  # lstat found a folder of ours, not a symlink
    return info


# Each attempt lost a race to the last waiter of the name leaving; a run this long
# means something keeps removing the folder, and the waiter polls rather than spin.
_BIND_ATTEMPTS = 100


def _bind_in(sock: socket.socket, folder: str, path: str) -> None:
    """Bind ``sock`` at ``path`` in its name's ``folder``, made (0700) or checked first.

    The last waiter of a name may remove the folder between our making it and binding,
    so a bind that finds no folder makes it again; a bound socket keeps it from removal.
    Raises FileNotFoundError only if every attempt lost that race.
    """
    for attempt in range(_BIND_ATTEMPTS):
        try:
            _private_folder(folder, create=True)
            sock.bind(path)
        except FileNotFoundError:
            if attempt == _BIND_ATTEMPTS - 1:
                raise
            continue
        # bind gives the socket 0777 less the umask, and a sender needs its write bit.
        os.chmod(path, 0o600)
        return


def _remove_dead_socket(folder_fd: int, leaf: str) -> None:
    """Remove the socket a waiter that died left behind; any other kind of entry stays."""
    with contextlib.suppress(OSError):
        if stat.S_ISSOCK(os.stat(leaf, dir_fd=folder_fd, follow_symlinks=False).st_mode):
            os.unlink(leaf, dir_fd=folder_fd)


def _remove_if_empty(folder: str) -> None:
    """Remove a name's folder that no waiter's socket is in (one still in use stays)."""
    with contextlib.suppress(OSError):
        os.rmdir(folder)


class WakeChannel:
    """Wake-ups keyed by lock name among the processes sharing one database file."""

    supported = hasattr(socket, "AF_UNIX")

    def __init__(self, db_path: str) -> None:
        self._base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
        # The effective user: the one a database's files must belong to, and the owner
        # of every folder this process makes, whatever its real user is.
        self._user_folder = os.path.join(self._base, f"queen_sync-{os.geteuid()}")
        self.folder = os.path.join(self._user_folder, _digest(db_path))
        self._sender: Optional[socket.socket] = None
        self._sender_pid = 0
        self._warned = False
        self._checked: Optional[tuple[int, int]] = None  # the folder last found safe
        # Lock name -> one mark per waiter of this process armed on it. Appending to and
        # removing from a list are atomic, so threads arming at once need no lock.
        self._waiting: dict[str, list[object]] = {}

    def _usable(self, *, create: bool) -> bool:
        """Whether every folder on the way to ``folder`` is safe (made first when ``create``)."""
        if self._still_checked():
            return True
        self._checked = None
        if not create and not os.path.lexists(self.folder):
            return False  # nobody has waited on this database yet: no socket to wake
        try:
            _check_base(self._base)
            _private_folder(self._user_folder, create=create)
            info = _private_folder(self.folder, create=create)
        except FileNotFoundError:
            if create:
                self._fall_back("the wake-up folder vanished while it was made")
            return False  # when only notifying: nobody has waited on this database yet
        except OSError as exc:
            self._fall_back(str(exc))
            return False
        self._checked = (info.st_dev, info.st_ino)
        return True

    def _still_checked(self) -> bool:
        """Whether ``folder`` is the very folder last found safe, still ours and private.

        The folders above it were safe then, so nobody else can move it or swap it since:
        one look at the folder itself replaces the walk from the root.
        """
        if self._checked is None:
            return False
        try:
            info = os.lstat(self.folder)
        except OSError:
            return False
        return ((info.st_dev, info.st_ino) == self._checked and stat.S_ISDIR(info.st_mode)
                and info.st_uid == os.geteuid()
                and not info.st_mode & (stat.S_IWGRP | stat.S_IWOTH))

    def _fall_back(self, why: str) -> None:
        if not self._warned:
            self._warned = True
            log.warning("queen_sync: waiters on %s are not woken on release, they poll: %s",
                        self.folder, why)

    def waiting_on(self, names: Iterable[str]) -> bool:
        """Whether a waiter of this process is armed on one of ``names``."""
        return bool(self._waiting) and any(name in self._waiting for name in names)

    @contextlib.contextmanager
    def subscribe(self, name: str) -> Iterator[Union[_SocketWaiter, _PollingWaiter]]:
        mark = object()
        marks = self._waiting.setdefault(name, [])
        marks.append(mark)
        try:
            with self._armed(name) as waiter:
                yield waiter
        finally:
            marks.remove(mark)
            if not marks:
                # A waiter arming meanwhile may lose its mark: it then only takes the write
                # lock at each attempt, as every waiter used to.
                self._waiting.pop(name, None)

    @contextlib.contextmanager
    def _armed(self, name: str) -> Iterator[Union[_SocketWaiter, _PollingWaiter]]:
        if not self._usable(create=True):
            yield _PollingWaiter()
            return
        # Only this user can make entries in our private folder, but a stray symlink or
        # loose folder of its own there must not take the socket elsewhere: it is checked.
        name_folder = os.path.join(self.folder, _digest(name))
        path = os.path.join(name_folder, f"{os.getpid()}.{secrets.token_hex(4)}")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            try:
                _bind_in(sock, name_folder, path)
            except FileNotFoundError:  # waiters of the name kept leaving: not a lasting state
                log.debug("queen_sync: a waiter on %s polls: its folder kept vanishing", name)
                waiter: Union[_SocketWaiter, _PollingWaiter] = _PollingWaiter()
            except OSError as exc:  # e.g. a path longer than a socket address can hold
                self._fall_back(str(exc))
                waiter = _PollingWaiter()
            else:
                waiter = _SocketWaiter(sock)
            yield waiter
        finally:
            sock.close()
            with contextlib.suppress(OSError):
                os.unlink(path)
            _remove_if_empty(name_folder)

    def notify(self, names: Sequence[str]) -> None:
        if not self._usable(create=False):
            return  # nobody has waited on this database yet, or the folder is not ours alone
        for name in names:
            name_folder = os.path.join(self.folder, _digest(name))
            try:
                # Never through a symlink: its target's files would be taken for sockets.
                folder_fd = os.open(name_folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
            except OSError:
                continue  # no subfolder: nobody waits on this name (or it is no folder)
            try:
                self._notify_folder(name_folder, folder_fd)
            finally:
                os.close(folder_fd)

    def _notify_folder(self, name_folder: str, folder_fd: int) -> None:
        with os.scandir(folder_fd) as entries:
            leaves = [entry.name for entry in entries
                      if not entry.is_symlink() and not entry.is_dir(follow_symlinks=False)]
        for leaf in leaves:
            self._send(name_folder, folder_fd, leaf)

    def _send(self, name_folder: str, folder_fd: int, leaf: str) -> None:
        sender = self._sender_socket()
        try:
            sender.sendto(b"!", os.path.join(name_folder, leaf))
        except (ConnectionRefusedError, FileNotFoundError):
            _remove_dead_socket(folder_fd, leaf)
            _remove_if_empty(name_folder)
        except OSError:
            pass  # its queue is full: it is awake already

    def _sender_socket(self) -> socket.socket:
        if self._sender is None or self._sender_pid != os.getpid():
            self._sender = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            self._sender.setblocking(False)
            self._sender_pid = os.getpid()
        return self._sender

    def after_fork(self) -> None:
        """In a forked child: the parent's waiters are not this process's."""
        self._waiting = {}

    def close(self) -> None:
        if self._sender is not None and self._sender_pid == os.getpid():
            self._sender.close()
        self._sender = None
