"""Where no nameless file can be made (no O_TMPFILE: macOS, overlayfs before Linux 6.6,
vfat), a new store is an empty file its first client switches to WAL. Clients of other
processes opening it at that moment must connect, not be refused."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import queen_sync as qs
import queen_sync._engines.sqlite as sqlite_engine

_OPEN_AND_CLOSE_TWICE = """
import os, sys
del os.O_TMPFILE
import queen_sync as qs
for _ in range(2):
    qs.Queen(f"sqlite://{sys.argv[1]}", renew_thread=False).close()
"""


class TestANewStoreWithoutNamelessFiles:
    def test_opens_while_another_process_switches_it_to_wal_and_a_third_claims_a_new_journal(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.delattr(os, "O_TMPFILE")
        path = tmp_path / "q.db"
        real_open = sqlite_engine.SqliteStorage._open

        def open_after_neighbours(storage: sqlite_engine.SqliteStorage) -> Any:
            # This client has claimed its side files; a neighbour process now makes the
            # empty file a WAL store (SQLite deletes the -journal as it switches) and opens
            # it again (claiming a -journal anew), as happens when processes start together.
            subprocess.run([sys.executable, "-c", _OPEN_AND_CLOSE_TWICE, str(path)],
                           check=True, env={**os.environ})
            return real_open(storage)

        monkeypatch.setattr(sqlite_engine.SqliteStorage, "_open", open_after_neighbours)
        try:
            client = qs.Queen(f"sqlite://{path}", renew_thread=False)
        except qs.UnsupportedOperationError as exc:
            pytest.fail(f"a store of this user's alone, in a private folder, was refused: {exc}")
        with client:
            assert client.kv.put("app", "k", 1, forever=True), "the store takes no write"
