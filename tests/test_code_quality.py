"""The code stays typed and lint-clean: mypy strict on the SDK, recipes, tests and benchmarks
(the scope ``[tool.mypy] files`` sets, which ``python -m mypy`` checks), ruff on everything."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


# The configured run reaches the recipes only through what imports them, so they get a
# whole run of their own as well.
@pytest.mark.parametrize("target", [[], ["--strict", "recipes"]], ids=["configured", "recipes"])
def test_mypy_strict_finds_nothing(target: list[str]) -> None:
    done = subprocess.run([sys.executable, "-m", "mypy", *target], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"mypy {' '.join(target)}:\n{done.stdout}{done.stderr}"


def test_ruff_finds_nothing() -> None:
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "."], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"ruff:\n{done.stdout}{done.stderr}"
