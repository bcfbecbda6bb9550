"""Which SQLite files a client trusts: this user's alone, with one name, in a safe folder.

Another user who may write the database, its ``-wal`` or ``-shm``, or a folder holding
them, can rewind the token counter or swap the file, and two holders then share a token.
A file with a second hard link has a second pair of ``-wal``/``-shm`` names (SQLite
derives them from the path), so a process using the other name keeps a log of its own.
Symlinks are followed, as SQLite follows them to name its files, but only links nobody
else may replace. These checks run before SQLite opens anything: opening would already
replay a planted ``-wal`` into the file. Root gets no exemption: a root job using another
user's file is exactly the job that user can mislead.

SQLite itself opens the ``-wal``, ``-shm`` and ``-journal`` by name later, creating any
that is missing, so in a sticky shared folder another user could create one after the
checks. A client therefore claims them first (``claim_side_files``: the missing ones are
made its own), holds SQLite's shared lock meanwhile so no neighbour closing the file
last deletes them (``anchor_store``), and checks after the open that SQLite found those
(``refuse_moved_files``).

Once connected, a client remembers which ``-wal`` and ``-shm`` it has, so an operator
deleting them as leftovers (the holder would go on in an unlinked log) is noticed.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import threading
from typing import Optional

from .._errors import UnsupportedOperationError

SIDE_SUFFIXES = ("-wal", "-shm")
_SHARED_WRITE = stat.S_IWGRP | stat.S_IWOTH

SideFiles = tuple[tuple[str, tuple[int, int]], ...]


def _refused(message: str, *, capability: str = "private_store") -> UnsupportedOperationError:
    return UnsupportedOperationError(message, capability=capability)


def refuse_unsafe_store(path: str) -> None:
    """Raise ``UnsupportedOperationError`` unless only this user (or root) can change the store.

    ``path`` is absolute and normalized; the files may not exist yet.
    """
    uid = os.geteuid()
    _refuse_unsafe_links(path, uid)
    real = os.path.realpath(path)
    refuse_unsafe_folders(os.path.dirname(real), uid)
    _refuse_unsafe_file(real, uid, follow=True)
    for suffix in CLAIMED_SUFFIXES:
        _refuse_unsafe_file(real + suffix, uid, follow=False)


def refuse_unsafe_folders(folder: str, uid: int) -> None:
    """Each folder from ``folder`` up to ``/``: root's or ours; if others may write, sticky."""
    here = folder
    while True:
        info = os.stat(here)
        shared = info.st_mode & _SHARED_WRITE and not info.st_mode & stat.S_ISVTX
        if info.st_uid not in (0, uid) or shared:
            raise _refused(
                f"the folder {here} (owner uid {info.st_uid}, mode {_mode(info)}) may be changed "
                f"by another user, who could swap the SQLite database in it: keep the database "
                f"in a folder only you (uid {uid}) or root may write, e.g. chmod 700 {here}")
        parent = os.path.dirname(here)
        if parent == here:
            return
        here = parent


def _refuse_unsafe_links(path: str, uid: int) -> None:
    """Each symlink on ``path`` as written: root's or ours, in a folder nobody else changes."""
    here = "/"
    for part in path.strip("/").split("/"):
        here = os.path.join(here, part)
        try:
            info = os.lstat(here)
        except FileNotFoundError:
            return
        if not stat.S_ISLNK(info.st_mode):
            continue
        if info.st_uid not in (0, uid):
            raise _refused(
                f"{here} is a symlink owned by uid {info.st_uid}, who could point it at another "
                f"SQLite database: use the target's path, or a link of your own (uid {uid})")
        refuse_unsafe_folders(os.path.realpath(os.path.dirname(here)), uid)


def _refuse_unsafe_file(name: str, uid: int, *, follow: bool) -> None:
    try:
        info = os.stat(name) if follow else os.lstat(name)
    except FileNotFoundError:
        return
    _refuse_unsafe_info(name, info, uid, follow=follow)


def _refuse_unsafe_info(name: str, info: os.stat_result, uid: int, *, follow: bool) -> None:
    if not stat.S_ISREG(info.st_mode):
        raise _refused(f"{name} is not a regular file; SQLite must not write through it: "
                       "remove it (with no client open)")
    if info.st_uid != uid:
        raise _refused(
            f"{name} is owned by uid {info.st_uid}, who could rewrite its tokens, not by this "
            f"process's user (uid {uid}): remove it with no client open, or make it yours "
            f"alone (chown {uid} {name}; chmod 600 {name})")
    if info.st_mode & _SHARED_WRITE:
        raise _refused(
            f"{name} (mode {_mode(info)}) may be written by group or others, who could rewrite "
            f"its tokens: chmod 600 {name}")
    if follow and info.st_nlink > 1:
        raise _refused(
            f"{name} has {info.st_nlink} names (a hard link): SQLite keeps one -wal per name, so "
            "clients using different names would hold the same lease. Remove the other names, "
            "or use a symlink", capability="single_link")


def _mode(info: os.stat_result) -> str:
    return oct(stat.S_IMODE(info.st_mode))


def side_files(path: str) -> SideFiles:
    """The ``-wal`` and ``-shm`` an open connection on ``path`` uses, checked, by identity."""
    uid = os.geteuid()
    real = os.path.realpath(path)
    found = []
    for suffix in SIDE_SUFFIXES:
        _refuse_unsafe_file(real + suffix, uid, follow=False)
        try:
            info = os.lstat(real + suffix)
        except FileNotFoundError:
            continue  # not made yet: nothing to compare with
        found.append((real + suffix, (info.st_dev, info.st_ino)))
    return tuple(found)


def changed_side_file(sides: SideFiles) -> Optional[str]:
    """How the first of ``sides`` that is gone or replaced changed, or None when all are intact."""
    for name, identity in sides:
        try:
            info = os.lstat(name)
        except FileNotFoundError:
            return f"{name} was deleted"
        if (info.st_dev, info.st_ino) != identity:
            return f"{name} was replaced by another file"
    return None


# Every file SQLite opens by a name made from the database's, creating it when missing:
# whoever creates one first owns it, and SQLite reads what it finds there as the store's
# log (a ``-journal`` it even copies into the database when nobody else has it open).
CLAIMED_SUFFIXES = ("-journal", *SIDE_SUFFIXES)
# SQLite's shared lock on a database file (os_unix.c): a read lock on these bytes.
_SHARED_FIRST = 0x40000000 + 2
_SHARED_SIZE = 510

FileKey = tuple[int, int]


class _Anchor:
    """One descriptor of a database file, holding SQLite's shared lock for this process."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.users = 0


_ANCHORS: dict[FileKey, _Anchor] = {}
_ANCHORS_LOCK = threading.Lock()


def anchor_store(real: str) -> FileKey:
    """Hold SQLite's shared lock on the database ``real`` for a connection about to open.

    Another process's SQLite deletes the ``-wal`` and ``-shm`` when it closes the file last,
    which it finds out by taking an exclusive lock: while this lock is held it cannot, so
    the side files this client claims stay the ones SQLite then opens. Raises
    ``BlockingIOError`` while another process holds the file exclusively (closing it).
    A file not yet in WAL mode is not locked: its first client switches it, under an
    exclusive lock that an anchor SQLite cannot see would stall.

    The caller holds the lock under which this process opens connections, and calls
    ``release_anchor`` once per call after closing the connection. The descriptor stays
    open while any connection of this process uses the file: closing it drops every lock
    the process holds on the file, SQLite's included.
    """
    with _ANCHORS_LOCK:
        info = os.stat(real)
        key = (info.st_dev, info.st_ino)
        anchor = _ANCHORS.get(key)
        if anchor is None:
            anchor = _Anchor(_open_anchor(real, key))
            _ANCHORS[key] = anchor
        try:
            if _in_wal_mode(anchor.fd):
                _lock_shared(anchor.fd)  # each time: SQLite unlocks all as it closes last
        except BaseException:
            if anchor.users == 0:
                del _ANCHORS[key]
                os.close(anchor.fd)
            raise
        anchor.users += 1
        return key


def _in_wal_mode(fd: int) -> bool:
    """Whether the header of the database open at ``fd`` says WAL (format versions 2)."""
    return os.pread(fd, 2, 18) == b"\x02\x02"


def _open_anchor(real: str, key: FileKey) -> int:
    # No connection of this process uses the file (none is anchored on it), so this new
    # descriptor's close can drop nobody's locks.
    fd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        info = os.fstat(fd)
        if (info.st_dev, info.st_ino) != key:
            raise _refused(f"{real} was replaced while this client opened it")
        _refuse_unsafe_info(real, info, os.geteuid(), follow=True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _lock_shared(fd: int) -> None:
    try:
        fcntl.lockf(fd, fcntl.LOCK_SH | fcntl.LOCK_NB, _SHARED_SIZE, _SHARED_FIRST)
    except OSError as exc:
        if exc.errno in (errno.EACCES, errno.EAGAIN):
            raise BlockingIOError(exc.errno, "another process holds it exclusively") from exc
        raise


def release_anchor(key: FileKey) -> None:
    """Undo one ``anchor_store``; the last one closes the descriptor (SQLite has closed the
    file's connections of this process by then, so no lock of theirs is left to drop)."""
    with _ANCHORS_LOCK:
        anchor = _ANCHORS[key]
        anchor.users -= 1
        if anchor.users == 0:
            del _ANCHORS[key]
            os.close(anchor.fd)


def claim_side_files(real: str) -> SideFiles:
    """Create (``0600``) each side file of the database ``real`` that is missing, check all
    are this user's alone, and return them by identity, for ``refuse_moved_files``.

    In a sticky folder nobody else can then replace them, so SQLite opens these and no
    other. A file made here is new: no connection can hold a lock on it, and closing the
    creating descriptor drops none.
    """
    uid = os.geteuid()
    claimed = []
    for suffix in CLAIMED_SUFFIXES:
        name = real + suffix
        info = _made_or_found(name)
        _refuse_unsafe_info(name, info, uid, follow=False)
        if info.st_nlink > 1:
            raise _refused(f"{name} has {info.st_nlink} names (a hard link), so another "
                           "name may change it: remove it (with no client open)")
        claimed.append((name, (info.st_dev, info.st_ino)))
    return tuple(claimed)


def _made_or_found(name: str) -> os.stat_result:
    """The file at ``name``, created first if missing (another may be gone just after the
    creation found it there: a few tries, then the last error)."""
    for _ in range(4):
        _create_missing(name)
        try:
            return os.lstat(name)
        except FileNotFoundError:
            continue
    return os.lstat(name)


def _create_missing(name: str) -> None:
    try:
        fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600)
    except FileExistsError:
        return
    try:
        os.fchmod(fd, 0o600)  # whatever the umask: SQLite must be able to write it
    finally:
        os.close(fd)


def refuse_moved_files(real: str, key: FileKey, claimed: SideFiles) -> None:
    """Raise ``UnsupportedOperationError`` unless the database ``real`` is still the file
    ``key`` and its claimed side files are still those ``claim_side_files`` found.

    A ``-journal`` may be gone, and any side file may be another of this user's alone:
    SQLite deletes the ``-journal`` as it switches a file to WAL, and the ``-wal`` and
    ``-shm`` as a neighbour process closes a store not yet anchored (one not in WAL mode
    when this client began), and a neighbour then claims new ones. Nobody else can make a
    file that is this user's, so such a one is as safe as the first.
    """
    info = os.stat(real)
    if (info.st_dev, info.st_ino) != key:
        raise _refused(f"{real} was replaced while this client opened it")
    for name, identity in claimed:
        try:
            info = os.lstat(name)
        except FileNotFoundError:
            if name.endswith("-journal"):
                continue
            raise _refused(f"{name} was deleted while this client opened the store, "
                           "and SQLite may have read another in its place") from None
        if (info.st_dev, info.st_ino) != identity:
            if _alone_ours(name, info):
                continue
            raise _refused(f"{name} was replaced while this client opened the store")


def _alone_ours(name: str, info: os.stat_result) -> bool:
    """Whether ``info`` is a plain file of this user's alone (one name, private mode)."""
    try:
        _refuse_unsafe_info(name, info, os.geteuid(), follow=False)
    except UnsupportedOperationError:
        return False
    return info.st_nlink == 1
