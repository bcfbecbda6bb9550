"""Which SQLite files a client trusts: this user's alone, with one name, in a safe folder.

Another user who may write the database, its ``-wal`` or ``-shm``, or a folder holding
them, can rewind the token counter or swap the file, and two holders then share a token.
A file with a second hard link has a second pair of ``-wal``/``-shm`` names (SQLite
derives them from the path), so a process using the other name keeps a log of its own.
Symlinks are followed, as SQLite follows them to name its files, but only links nobody
else may replace. These checks run before SQLite opens anything: opening would already
replay a planted ``-wal`` into the file. Root gets no exemption: a root job using another
user's file is exactly the job that user can mislead.

Once connected, a client remembers which ``-wal`` and ``-shm`` it has, so an operator
deleting them as leftovers (the holder would go on in an unlinked log) is noticed.
"""

from __future__ import annotations

import os
import stat
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
    for suffix in SIDE_SUFFIXES:
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
