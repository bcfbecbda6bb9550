"""A renew op's quick acceptance (a renewer's tick) refuses exactly what the full check refuses.

``check_lock_op`` accepts a renew of plain types whose name and owner were found valid
before in one expression, without a call per field. The property draws renews with
every field good, bad or oddly typed, and checks the quick path never lets through an
op the full check refuses, nor changes what it raises.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import queen_sync._ops as ops_module
from queen_sync._durations import MAX_TTL_SECONDS
from queen_sync._ops import MAX_LIMIT, check_lock_op

GOOD_NAMES = ("tick-00001", "report")
GOOD_OWNERS = ("host:1:abcd", "me")


class Text(str):
    """A str subclass: equal to a known name, yet not the exact type the quick path trusts."""


class Liar(str):
    """A bad text that hashes and compares as a known good one (``posing_as``)."""

    posing_as = ""

    def __hash__(self) -> int:
        return hash(self.posing_as)

    def __eq__(self, other: object) -> bool:
        return other == self.posing_as


def _liar(text: str, posing_as: str) -> Liar:
    liar = Liar(text)
    liar.posing_as = posing_as
    return liar


GOOD = {"name": GOOD_NAMES, "owner": GOOD_OWNERS, "token": (1, 2**62),
        "ttlSeconds": (1, MAX_TTL_SECONDS), "slot": (0, MAX_LIMIT - 1)}


def _spoiled_numbers(low: int, high: int) -> list[Any]:
    return [low - 1, high + 1, True, float(low), str(low), None]


SPOILED = {
    "name": ["a#b", "", "bad\x00name", Text("report"), _liar("a#b", GOOD_NAMES[1]), 5, None],
    "owner": ["", "tab\there", Text("me"), _liar("tab\there", GOOD_OWNERS[1]), 7, None],
    "token": _spoiled_numbers(1, 2**62),
    "ttlSeconds": _spoiled_numbers(1, MAX_TTL_SECONDS),
    "slot": _spoiled_numbers(0, MAX_LIMIT - 1),
}
ABSENT = object()


@st.composite
def renews(draw: Callable[..., Any]) -> dict[str, Any]:
    """A tick's renew with one or two fields spoiled or left out, or none."""
    spoiled = draw(st.sets(st.sampled_from(sorted(GOOD)), max_size=2))
    op: dict[str, Any] = {"op": "renew"}
    for field, good in GOOD.items():
        value = draw(st.sampled_from([*SPOILED[field], ABSENT]) if field in spoiled
                     else st.sampled_from(good))
        if value is not ABSENT:
            op[field] = value
    return op


def _outcome(op: dict[str, Any]) -> Optional[tuple[type, str]]:
    try:
        check_lock_op(dict(op))
    except Exception as exc:  # the verdict compared is the exception's type and text
        return type(exc), str(exc)
    return None


@pytest.fixture(autouse=True)
def known_names_and_owners() -> None:
    """The names and owners a tick's renews carry were all checked once before."""
    for name, owner in zip(GOOD_NAMES, GOOD_OWNERS):
        check_lock_op({"op": "renew", "name": name, "owner": owner, "token": 1,
                       "ttlSeconds": 1})


class TestTheQuickRenewCheckAgreesWithTheFullCheck:
    @settings(max_examples=400, deadline=None)
    @given(op=renews())
    def test_a_renew_is_accepted_or_refused_alike_with_and_without_the_quick_path(
            self, op: dict[str, Any]) -> None:
        quick = _outcome(op)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(ops_module, "_known_good", lambda op: False)
            full = _outcome(op)
        assert quick == full, f"{op}: the quick path answered {quick}, the full check {full}"

    def test_the_quick_path_accepts_a_tick_s_renew_without_the_full_check(self) -> None:
        calls: list[Any] = []
        op = {"op": "renew", "name": GOOD_NAMES[0], "owner": GOOD_OWNERS[0], "token": 9,
              "ttlSeconds": 30, "slot": 0}
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(ops_module, "check_name", calls.append)
            assert check_lock_op(op) is op, "a well-formed renew is accepted as it is"
        assert calls == [], f"the name of a known renew was checked again: {calls}"
