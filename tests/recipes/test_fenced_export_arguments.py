"""A fenced export refuses bad arguments at the call that takes them, and writes nothing then."""

from __future__ import annotations

from typing import Any, Optional

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from manual_clock import ManualClock

import queen_sync as qs
from queen_sync.recipes.fenced_export import FencedExport
from queen_sync.testing import FaultyEngine


class ListSink:
    """A sink that notes every write it is given, in order."""

    def __init__(self) -> None:
        self.writes: list[str] = []

    def write(self, name: str, data: Any, *, token: int, lock: Optional[qs.Lock] = None) -> None:
        self.writes.append(name)


def _assert_untouched(client: qs.Queen, export: FencedExport, sink: ListSink) -> None:
    assert sink.writes == [], f"a refused run wrote {sink.writes}"
    assert export.finished() == [], f"a refused run checkpointed {export.finished()}"
    assert not client.locks.get(export.name).get("holders"), "a refused run kept the lock"


class TestRunWithThePartitionsGivenAsOneStr:
    @pytest.mark.parametrize("partitions", ["2024-01-01", b"2024-01-01"], ids=["str", "bytes"])
    def test_is_refused_with_a_type_error_before_the_lock_is_taken(
            self, client: qs.Queen, partitions: Any) -> None:
        sink = ListSink()
        export = FencedExport(client, "sales", sink, ttl=30)
        with pytest.raises(TypeError, match="partitions"):
            export.run(partitions, str)
        _assert_untouched(client, export, sink)


class TestRunWithAPartitionListedTwice:
    @settings(max_examples=25, deadline=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(parts=st.lists(st.sampled_from(["a", "b", "c", "d"]), min_size=2, max_size=6)
           .filter(lambda parts: len(set(parts)) < len(parts)))
    def test_is_refused_naming_it_before_anything_is_written(
            self, client: qs.Queen, parts: list[str]) -> None:
        sink = ListSink()
        export = FencedExport(client, "sales", sink, ttl=30)
        twice = sorted({p for p in parts if parts.count(p) > 1})
        with pytest.raises(ValueError, match="more than once") as refused:
            export.run(parts, str)
        _assert_untouched(client, export, sink)
        assert all(repr(p) in str(refused.value) for p in twice), (
            f"the refusal does not name {twice}: {refused.value}")


class TestRunWithAPartitionNoSinkCanStore:
    """A name the progress key or a sink would refuse halfway (after earlier partitions
    were written, with this one published) is refused before the lock is taken."""

    @settings(max_examples=30, deadline=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(bad=st.builds(lambda head, control, tail: head + control + tail,
                         st.text("ab-0", max_size=5),
                         st.sampled_from(["\t", "\n", "\x1b", "\x7f", "\x85", "\ud800"]),
                         st.text("ab-0", max_size=5)))
    def test_a_control_character_or_a_lone_surrogate_is_refused_naming_it(
            self, client: qs.Queen, bad: str) -> None:
        sink = ListSink()
        export = FencedExport(client, "sales", sink, ttl=30)
        with pytest.raises(ValueError) as refused:
            export.run(["2024-01-01", bad, "2024-01-03"], str)
        _assert_untouched(client, export, sink)
        assert repr(bad) in str(refused.value), f"the refusal does not name it: {refused.value}"


class TestALeaseLostBetweenTwoPartitions:
    def test_is_raised_as_the_fenced_out_error_the_docs_promise_and_the_next_is_not_written(
            self, faulty_mq: qs.Queen, sqlite_faults: FaultyEngine, clock: ManualClock) -> None:
        sink = ListSink()
        export = FencedExport(faulty_mq, "sales", sink, ttl=5)
        # The first checkpoint lands, then the lease runs out before the next partition.
        sqlite_faults.hook_next(hook=lambda route, body: clock.advance(10),
                                route="transaction", applied=True)
        with pytest.raises(qs.FencedOutError) as refused:
            export.run(["a", "b"], str)

        assert (sink.writes, export.finished()) == (["a"], ["a"]), (
            f"wrote {sink.writes}, checkpointed {export.finished()}")
        assert refused.value.presented is not None and refused.value.presented > 0, (
            f"the refusal does not name the lost token: {refused.value!r}")
        cause = refused.value.__cause__
        assert isinstance(cause, qs.LockLostError) and cause.reason == "expired", (
            f"the refusal does not carry why the lease was lost: {cause!r}")
