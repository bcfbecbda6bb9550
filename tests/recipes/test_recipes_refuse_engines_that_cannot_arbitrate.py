"""Each recipe refuses, when it is built, a client whose engine cannot arbitrate a lease."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

import queen_sync as qs
from queen_sync.recipes.fenced_export import FencedExport, FencedKv
from queen_sync.recipes.leader_election import LeaderElection
from queen_sync.recipes.run_queue import RunQueue
from queen_sync.testing import FaultyEngine


class _Lacking(FaultyEngine):
    """A SQLite store that says it lacks one capability, as a weaker store would."""

    def __init__(self, url: str, **lacks: bool) -> None:
        super().__init__(url)
        self.capabilities = qs.Capabilities(**lacks)


RECIPES: dict[str, Callable[[qs.Queen], Any]] = {
    "RunQueue": lambda q: RunQueue(q, "jobs"),
    "LeaderElection": lambda q: LeaderElection(q, "leader", ttl=30),
    "FencedExport": lambda q: FencedExport(q, "export", FencedKv(q, "out"), ttl=30),
}


@pytest.fixture(params=["fencing", "engine_clock_expiry"])
def lacking(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[qs.Queen, str]]:
    missing = str(request.param)
    with qs.Queen(engine=_Lacking("sqlite://" + str(tmp_path / "q.db"),
                                  **{missing: False})) as q:
        yield q, missing


class TestARecipeOnAnEngineThatCannotArbitrate:
    @pytest.mark.parametrize("recipe", sorted(RECIPES))
    def test_it_is_refused_at_construction_naming_the_missing_capability(
            self, recipe: str, lacking: tuple[qs.Queen, str]) -> None:
        q, missing = lacking
        with pytest.raises(qs.UnsupportedOperationError) as refused:
            RECIPES[recipe](q)
        assert refused.value.capability == missing, (
            f"{recipe} was refused for {refused.value.capability!r}, not {missing!r}")
        assert missing in str(refused.value), (
            f"the message does not name {missing}: {refused.value}")

    @pytest.mark.parametrize("recipe", sorted(RECIPES))
    def test_it_is_built_on_an_engine_that_can(self, recipe: str, tmp_path: Path) -> None:
        with qs.Queen(engine=_Lacking("sqlite://" + str(tmp_path / "q.db"))) as q:
            assert RECIPES[recipe](q) is not None, f"{recipe} was not built on a capable engine"
