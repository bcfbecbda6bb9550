"""The SQLite engine on a disk that really fills: a small tmpfs mounted for the test.

The store's own log must not be what fills it, and a full disk is told as one, whichever of
SQLite's files could not grow. Mounting needs root (or CAP_SYS_ADMIN): elsewhere these skip.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Iterator

import pytest

import queen_sync as qs


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 2 MiB file system of this test's own."""
    mount_point = tmp_path / "small"
    mount_point.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount_point)],
                             capture_output=True, text=True, check=False)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield mount_point
    finally:
        if subprocess.run(["umount", str(mount_point)], capture_output=True,
                          check=False).returncode != 0:
            subprocess.run(["umount", "-l", str(mount_point)], capture_output=True, check=False)


def fill(folder: Path, leave: int) -> None:
    """Take the disk's free space, but for about ``leave`` bytes."""
    with open(folder / "filler", "ab") as filler:
        while True:
            stats = os.statvfs(folder)
            free = stats.f_bavail * stats.f_frsize
            if free <= leave:
                return
            try:
                filler.write(b"\0" * min(65536, max(4096, free - leave)))
                filler.flush()
            except OSError:
                return


class TestAStoreAloneOnASmallDisk:
    def test_never_fills_it_with_its_own_log(self, small_disk: Path) -> None:
        tokens: list[int] = []
        with qs.Queen(f"sqlite://{small_disk}/q.db") as q:
            lock = q.lock("job", ttl=30)
            for _ in range(600):  # its log grew past the 2 MiB disk after 99 of these
                assert lock.acquire()
                assert lock.token is not None
                tokens.append(lock.token)
                lock.release()
        assert tokens == sorted(set(tokens)), "tokens did not strictly rise"


class TestAFullDisk:
    def test_is_told_as_one_when_a_new_store_cannot_make_its_files(
            self, small_disk: Path) -> None:
        fill(small_disk, leave=16384)
        with pytest.raises(qs.EngineError) as raised, \
                qs.Queen(f"sqlite://{small_disk}/new.db") as q:
            q.lock("job", ttl=30).acquire()
        assert "cannot grow" in str(raised.value) and "disk" in str(raised.value), (
            f"a full disk was told as: {raised.value}")
        (small_disk / "filler").unlink()
        with qs.Queen(f"sqlite://{small_disk}/new.db") as q:
            assert q.lock("job", ttl=30).acquire(), "the store did not work once space was back"

