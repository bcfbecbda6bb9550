"""Fixtures for the recipes' tests: real worker processes on one embedded SQLite file."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import pytest
from recipe_workers import Spawn, Worker


@pytest.fixture
def spawn(tmp_path: Path) -> Iterator[Spawn]:
    """Start a worker process: ``spawn(role, me=..., **args)``; all are killed at teardown."""
    started: list[Worker] = []

    def start(role: str, **args: Any) -> Worker:
        name = str(args.pop("me", f"{role}-{len(started)}"))
        worker = Worker(role, tmp_path / f"{name}.events", me=name, **args)
        started.append(worker)
        return worker

    yield start
    for worker in started:
        worker.stop()
