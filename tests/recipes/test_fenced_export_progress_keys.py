"""Fenced export progress: each export's checkpoints are its own, whatever the export names."""

from __future__ import annotations

import secrets
from typing import Any, Optional

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import queen_sync as qs
from queen_sync.recipes.fenced_export import PROGRESS_NS, FencedExport, FencedKv


class DictSink:
    """A sink that keeps what it is given, by name (fencing is not what these tests test)."""

    def __init__(self) -> None:
        self.written: dict[str, Any] = {}

    def write(self, name: str, data: Any, *, token: int, lock: Optional[qs.Lock] = None) -> None:
        self.written[name] = data


#: Export names that nest in each other ("sales", "sales/eu", "sales/") and partitions.
export_names = st.text(alphabet="ab/", min_size=1, max_size=4)
partitions = st.lists(st.text(alphabet="abp1", min_size=1, max_size=3), max_size=4, unique=True)


class TestExportsWhoseNamesShareAPrefix:
    @settings(max_examples=25, deadline=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(first=export_names, second=export_names, first_parts=partitions,
           second_parts=partitions)
    @example(first="a", second="a/b", first_parts=["p"], second_parts=["p"])
    @example(first="a/b", second="a", first_parts=["p"], second_parts=["b"])
    def test_neither_sees_the_others_progress_nor_loses_its_own_to_the_others_reset(
            self, q: qs.Queen, first: str, second: str, first_parts: list[str],
            second_parts: list[str]) -> None:
        if first == second:
            return
        base = f"exp-{secrets.token_hex(4)}/"
        one = FencedExport(q, base + first, DictSink(), ttl=30)
        two = FencedExport(q, base + second, DictSink(), ttl=30)
        one.run(first_parts, str)
        second_report = two.run(second_parts, str)

        assert second_report.skipped == [], (
            f"{base + second!r} skipped {second_report.skipped} as finished by "
            f"{base + first!r}")
        assert (one.finished(), two.finished()) == (sorted(first_parts), sorted(second_parts)), (
            f"progress of {base + first!r} and {base + second!r} is mixed up")
        removed = one.reset()
        assert removed == len(first_parts), (
            f"reset of {base + first!r} removed {removed} checkpoints, not {len(first_parts)}")
        assert two.finished() == sorted(second_parts), (
            f"reset of {base + first!r} wiped the progress of {base + second!r}")

    def test_a_reset_of_one_keeps_the_checkpoints_of_an_export_named_within_it(
            self, client: qs.Queen) -> None:
        sales = FencedExport(client, "sales", DictSink(), ttl=30)
        europe = FencedExport(client, "sales/eu", DictSink(), ttl=30)
        sales.run(["2024-01-01"], str)
        europe.run(["2024-01-01", "2024-01-02"], str)
        removed = sales.reset()

        assert removed == 1, f"reset of 'sales' removed {removed} checkpoints, not its 1"
        assert europe.finished() == ["2024-01-01", "2024-01-02"], (
            f"reset of 'sales' wiped the progress of 'sales/eu': {europe.finished()}")

    def test_progress_stored_before_keys_were_checked_is_still_read_and_resumed_from(
            self, client: qs.Queen) -> None:
        client.kv.put(PROGRESS_NS, "sales/2024-01-01", {"token": 5}, forever=True)
        client.kv.put(PROGRESS_NS, "sales/eu/2024-01-01", {"token": 6}, forever=True)
        report = FencedExport(client, "sales", DictSink(), ttl=30).run(
            ["2024-01-01", "2024-01-02"], str)

        assert (report.skipped, report.written) == (["2024-01-01"], ["2024-01-02"]), (
            f"the stored checkpoint was not resumed from: {report}")
        assert FencedExport(client, "sales/eu", DictSink(), ttl=30).finished() == [
            "2024-01-01"], "the nested export's stored checkpoint is not its own"


class TestAPartitionNameWithAPathSeparator:
    @pytest.mark.parametrize("bad", ["eu/2024-01-01", "/", "a/"])
    def test_is_refused_by_the_export_before_the_lock_is_taken_and_by_the_kv_sink(
            self, client: qs.Queen, bad: str) -> None:
        sink = FencedKv(client, "out")
        export = FencedExport(client, "sales", sink, ttl=30)
        with pytest.raises(ValueError, match="partition name"):
            export.run(["2024-01-01", bad], str)
        lock = client.lock("sales", ttl=30)
        assert lock.acquire(), "the refused run left the export's lock taken"
        token = lock.token
        assert token is not None
        with pytest.raises(ValueError, match="partition name"):
            sink.write(bad, "data", token=token, lock=lock)
        lock.release()

        assert export.finished() == [], f"a refused run checkpointed {export.finished()}"
        written = [key for key in ("2024-01-01", bad) if client.kv.get("out", key)]
        assert not written, f"a refused run wrote {written}"
