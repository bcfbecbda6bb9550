"""Each recipe checks what it is built with, and says what is wrong there, not at a later use."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Optional

import pytest

import queen_sync as qs
from queen_sync.recipes.fenced_export import FencedExport, FencedKv, FencedTable
from queen_sync.recipes.leader_election import LeaderElection, LeaderObserver
from queen_sync.recipes.run_queue import RunQueue

#: Each recipe built with ``not_a_client`` where its client goes.
BUILT_WITH: dict[str, Callable[[Any], object]] = {
    "RunQueue": lambda not_a_client: RunQueue(not_a_client, "jobs"),
    "LeaderElection": lambda not_a_client: LeaderElection(not_a_client, "leader", ttl=30),
    "LeaderObserver": lambda not_a_client: LeaderObserver(not_a_client, "leader"),
    "FencedExport": lambda not_a_client: FencedExport(not_a_client, "export", _Sink(), ttl=30),
    "FencedKv": lambda not_a_client: FencedKv(not_a_client, "out"),
    "FencedTable": lambda not_a_client: FencedTable(not_a_client, None, "exports"),
}


class _Sink:
    def write(self, name: str, data: Any, *, token: int, lock: Optional[qs.Lock] = None) -> None:
        pass


class TestARecipeGivenSomethingElseThanAClient:
    @pytest.mark.parametrize("recipe", sorted(BUILT_WITH))
    @pytest.mark.parametrize("not_a_client", ["sqlite:///tmp/queen.db", object()],
                             ids=["a URL", "an object"])
    def test_is_refused_at_construction_with_a_type_error_naming_the_client(
            self, recipe: str, not_a_client: Any) -> None:
        with pytest.raises(TypeError, match="client") as refused:
            BUILT_WITH[recipe](not_a_client)
        assert "Queen" in str(refused.value), f"the refusal does not say what it needs: {refused}"


class TestAFencedKvWithABadNamespaceOrPrefix:
    @pytest.mark.parametrize(("ns", "prefix", "error"), [
        ("bad ns", "", ValueError),
        ("", "", ValueError),
        (3, "", TypeError),
        ("out", 3, TypeError),
        ("out", None, TypeError),
        ("out", "day\x01", ValueError),
        ("out", "p" * 825, ValueError),  # no room left for a partition name of 200 bytes
    ], ids=["space in ns", "empty ns", "int ns", "int prefix", "None prefix",
            "control character", "too long"])
    def test_is_refused_at_construction(self, client: qs.Queen, ns: Any, prefix: Any,
                                        error: type[Exception]) -> None:
        with pytest.raises(error, match=r"namespace|prefix"):
            FencedKv(client, ns, prefix=prefix)

    def test_the_longest_prefix_leaves_room_for_the_longest_partition_name(
            self, client: qs.Queen) -> None:
        sink = FencedKv(client, "out", prefix="p" * 824)
        lock = client.lock("export", ttl=30)
        assert lock.acquire()
        token = lock.token
        assert token is not None
        sink.write("n" * 200, {"rows": 1}, token=token, lock=lock)
        lock.release()
        assert sink.read("n" * 200) == {"rows": 1}, "the longest key was not stored"


async def _async_produce(partition: str) -> str:
    return partition


class TestAFencedExportWithABadSinkOrProduce:
    @pytest.mark.parametrize("sink", [object(), "out/", type("WriteIsData", (), {"write": 3})()],
                             ids=["no write", "a path", "write is no method"])
    def test_a_sink_without_a_write_method_is_refused_at_construction(
            self, client: qs.Queen, sink: Any) -> None:
        with pytest.raises(TypeError, match="sink"):
            FencedExport(client, "export", sink, ttl=30)

    @pytest.mark.parametrize("produce", [None, "csv", _async_produce],
                             ids=["None", "str", "async"])
    def test_a_produce_that_cannot_make_a_partition_is_refused_before_the_lock_is_taken(
            self, client: qs.Queen, tmp_path: Path, produce: Any) -> None:
        sink = FencedKv(client, "out")
        export = FencedExport(client, "export", sink, ttl=30)
        with pytest.raises(TypeError, match="produce"):
            export.run(["2024-01-01"], produce)

        assert export.finished() == [], f"a refused run checkpointed {export.finished()}"
        assert not client.locks.get("export").get("holders"), "a refused run kept the lock"
        assert not client.kv.get("out", "2024-01-01"), "a refused run wrote the partition"


class TestARecipeObjectWithLiveState:
    """A leader's campaign, an observer and a claim hold a live lease or thread: a copy
    would share them, so each refuses to be copied or pickled."""

    @staticmethod
    def _made(client: qs.Queen, which: str) -> Any:
        if which == "LeaderElection":
            return LeaderElection(client, "leader", ttl=30)
        if which == "LeaderObserver":
            return LeaderObserver(client, "leader")
        queue = RunQueue(client, "jobs")
        queue.submit("run-1")
        claim = queue.claim(ttl=30)
        assert claim is not None
        return claim

    @pytest.mark.parametrize("how", ["copy", "deepcopy", "pickle"])
    @pytest.mark.parametrize("which", ["LeaderElection", "LeaderObserver", "Claim"])
    def test_refuses_to_be_copied_naming_itself(self, client: qs.Queen, which: str,
                                                 how: str) -> None:
        import copy
        import pickle

        thing = self._made(client, which)
        duplicate: dict[str, Callable[[Any], Any]] = {
            "copy": copy.copy, "deepcopy": copy.deepcopy,
            "pickle": lambda x: pickle.loads(pickle.dumps(x))}
        with pytest.raises(TypeError, match=f"a {which} cannot be copied"):
            duplicate[how](thing)
