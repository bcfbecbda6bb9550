"""Reading a ``FencedDirectory`` while its writers publish newer versions of a name.

A newer version of a partition removes the older ones once it is published; a reader
that listed the versions just before must not take the removed one for "never
published", nor see a path vanish under it.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from queen_sync.recipes.fenced_export import FencedDirectory


class TestAReadRacingANewerVersion:
    def test_a_version_removed_between_the_listing_and_the_read_gives_the_newer_one(
            self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        sink = FencedDirectory(tmp_path / "out")
        sink.write("2024-01-01", b"first", token=1)
        listed = FencedDirectory._versions
        raced: list[bool] = []

        def listing_then_a_newer_version(self: FencedDirectory, name: str) -> Any:
            versions = listed(self, name)
            if not raced:  # the writer publishes token 2, and removes @1, right after
                raced.append(True)
                sink.write("2024-01-01", b"second", token=2)
            return versions

        monkeypatch.setattr(FencedDirectory, "_versions", listing_then_a_newer_version)
        assert sink.read("2024-01-01") == b"second"

    def test_readers_beside_a_writer_never_miss_a_published_name(self, tmp_path: Path) -> None:
        sink = FencedDirectory(tmp_path / "out")
        sink.write("day", b"0", token=1)
        stop, missed = threading.Event(), list[FileNotFoundError]()

        def read_while_written() -> None:
            while not stop.is_set():
                try:
                    sink.read("day")
                    list(sink.files().values())
                except FileNotFoundError as exc:
                    missed.append(exc)

        readers = [threading.Thread(target=read_while_written) for _ in range(2)]
        for reader in readers:
            reader.start()
        try:
            for token in range(2, 1500):
                sink.write("day", str(token).encode(), token=token)
        finally:
            stop.set()
            for reader in readers:
                reader.join(10)
        assert not missed, f"{len(missed)} reads missed a published name: {missed[0]}"
        assert sink.read("day") == b"1499"
