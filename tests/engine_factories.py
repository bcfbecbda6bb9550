"""Engines the conformance suite runs over: kind -> a function returning a URL to a FRESH store.

Each function takes the pytest ``request`` (to reach fixtures such as ``tmp_path``).
"""

from __future__ import annotations

from typing import Callable

import pytest

EngineFactory = Callable[[pytest.FixtureRequest], str]


def _sqlite(request: pytest.FixtureRequest) -> str:
    return "sqlite://" + str(request.getfixturevalue("tmp_path") / "queen.db")


ENGINE_FACTORIES: dict[str, EngineFactory] = {
    "sqlite": _sqlite,
}
