"""Fenced export under faults: a paused exporter replaced by a new holder (real processes)."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
from recipe_workers import Spawn

import queen_sync as qs
from queen_sync.recipes.fenced_export import PROGRESS_NS, FencedDirectory

TTL = 1.0
PARTITIONS = 8

pytestmark = pytest.mark.realtime


class TestAnExporterPausedMidExportAndReplaced:
    def test_every_partition_ends_up_once_by_its_newest_token_and_the_old_writes_are_refused(
            self, spawn: Spawn, tmp_path: Path, sqlite_url: str) -> None:
        out = tmp_path / "out"
        common = {"url": sqlite_url, "name": "sales", "out": str(out), "ttl": TTL,
                  "partitions": PARTITIONS}
        old = spawn("exporter", me="old", delay=0.15, stall_at="p03", **common)
        paused_on = old.wait_for("producing", where=lambda e: e["partition"] == "p03")
        time.sleep(TTL + 0.2)  # past the old holder's lease, by the engine's clock too

        new = spawn("exporter", me="new", delay=0.01, wait=10, **common)
        finished = new.wait_for("finished")
        resumed_at = old.signal(signal.SIGCONT)
        fenced = old.wait_for("fenced", where=lambda e: e["at"] > resumed_at)

        assert finished["skipped"] == ["p00", "p01", "p02"], (
            f"the new holder did not resume after the old one's finished partitions: {finished}")
        assert fenced["presented"] == paused_on["token"], f"refusal names another token: {fenced}"
        assert fenced["current"] > fenced["presented"], f"not refused by a newer token: {fenced}"

        files = sorted(n for n in os.listdir(out) if not n.startswith("."))
        names = [n.rpartition("@")[0] for n in files]
        assert names == [f"p{n:02d}" for n in range(PARTITIONS)], (
            f"the directory does not hold every partition exactly once: {files}")
        with qs.Queen(sqlite_url) as q:
            progress = {row["key"].split("/", 1)[1]: row["value"]["token"]
                        for row in q.kv.list_all(PROGRESS_NS, "sales/")}
        for name, (token, path) in FencedDirectory(out).files().items():
            by = json.loads(path.read_text())["by"]
            expected = "old" if name in finished["skipped"] else "new"
            assert by == expected, f"{name} was written by {by}, expected {expected}"
            assert token == progress[name], (
                f"{name} holds token {token}, but its checkpointed writer had {progress[name]}")
        assert progress["p03"] > paused_on["token"], "p03 was not rewritten by a newer token"
