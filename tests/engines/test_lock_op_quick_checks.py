"""Every lock op's quick acceptance refuses exactly what the full check refuses.

A handle's acquire and release (each pair) and a renewer's renews are copies of ops built
and checked before, so ``check_lock_op`` accepts them in a few comparisons once their
name and owner were found valid. The property draws acquire, release, renew and get ops
with fields good, bad, oddly typed or left out, and checks the quick path never lets
through an op the full check refuses, nor changes what it raises.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import queen_sync._ops as ops_module
from queen_sync._durations import MAX_TTL_SECONDS
from queen_sync._ops import MAX_LIMIT, check_lock_op

GOOD_NAMES = ("tick-00001", "report")
GOOD_OWNERS = ("host:1:abcd", "me")


class Text(str):
    """A str subclass: equal to a known name, yet not the exact type the quick path trusts."""


def _spoiled_numbers(low: int, high: int) -> list[Any]:
    return [low - 1, high + 1, True, float(low), str(low), None]


GOOD: dict[str, tuple[Any, ...]] = {
    "name": GOOD_NAMES, "owner": GOOD_OWNERS, "token": (1, 2**62),
    "ttlSeconds": (1, MAX_TTL_SECONDS), "slot": (0, MAX_LIMIT - 1), "limit": (1, MAX_LIMIT),
}
SPOILED: dict[str, list[Any]] = {
    "name": ["a#b", "", "bad\x00name", Text("report"), 5, None],
    "owner": ["", "tab\there", Text("me"), 7, None],
    "token": [*_spoiled_numbers(1, 2**62), 2**63, 2**64],  # past any engine's 64-bit token
    "ttlSeconds": _spoiled_numbers(1, MAX_TTL_SECONDS),
    "slot": _spoiled_numbers(0, MAX_LIMIT - 1),
    "limit": _spoiled_numbers(1, MAX_LIMIT),
}
FIELDS = {
    "acquire": ("name", "ttlSeconds", "owner", "limit"),
    "release": ("name", "token", "slot"),
    "renew": ("name", "token", "ttlSeconds", "slot", "owner"),
    "get": ("name",),
}
ABSENT = object()


@st.composite
def lock_ops(draw: Callable[..., Any]) -> dict[str, Any]:
    """A handle's op with one or two fields spoiled or left out, or none; now and then
    a field another kind carries."""
    kind = draw(st.sampled_from(sorted(FIELDS)))
    fields = FIELDS[kind]
    spoiled = draw(st.sets(st.sampled_from(fields), max_size=2))
    op: dict[str, Any] = {"op": kind}
    for field in fields:
        value = draw(st.sampled_from([*SPOILED[field], ABSENT]) if field in spoiled
                     else st.sampled_from(GOOD[field]))
        if value is not ABSENT:
            op[field] = value
    stray = draw(st.none() | st.sampled_from(sorted(GOOD)))
    if stray is not None and stray not in op:
        op[stray] = draw(st.sampled_from([*GOOD[stray], *SPOILED[stray]]))
    return op


def _outcome(op: dict[str, Any]) -> Optional[tuple[type, str]]:
    try:
        check_lock_op(dict(op))
    except Exception as exc:  # the verdict compared is the exception's type and text
        return type(exc), str(exc)
    return None


@pytest.fixture(autouse=True)
def known_names_and_owners() -> None:
    """The names and owners a handle's ops carry were all checked once before."""
    for name, owner in zip(GOOD_NAMES, GOOD_OWNERS):
        check_lock_op({"op": "acquire", "name": name, "owner": owner, "ttlSeconds": 1})


class TestTheQuickLockOpCheckAgreesWithTheFullCheck:
    @settings(max_examples=600, deadline=None)
    @given(op=lock_ops())
    @example(op={"op": "release", "name": GOOD_NAMES[0], "token": 2**63})
    @example(op={"op": "renew", "name": GOOD_NAMES[0], "token": 2**63, "ttlSeconds": 30})
    def test_an_op_is_accepted_or_refused_alike_with_and_without_the_quick_path(
            self, op: dict[str, Any]) -> None:
        quick = _outcome(op)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(ops_module, "_known_good", lambda op: False)
            full = _outcome(op)
        assert quick == full, f"{op}: the quick path answered {quick}, the full check {full}"

    @pytest.mark.parametrize("op", [
        {"op": "acquire", "name": GOOD_NAMES[0], "owner": GOOD_OWNERS[0], "ttlSeconds": 30},
        {"op": "acquire", "name": GOOD_NAMES[1], "owner": GOOD_OWNERS[1], "ttlSeconds": 30,
         "limit": 3},
        {"op": "release", "name": GOOD_NAMES[0], "token": 9, "slot": 0},
        {"op": "release", "name": GOOD_NAMES[0], "token": 9},
        {"op": "renew", "name": GOOD_NAMES[0], "owner": GOOD_OWNERS[0], "token": 9,
         "ttlSeconds": 30, "slot": 0},
    ], ids=["acquire", "acquire-semaphore", "release", "release-no-slot", "renew"])
    def test_the_quick_path_accepts_a_handle_s_op_without_the_full_check(
            self, op: dict[str, Any]) -> None:
        calls: list[Any] = []
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(ops_module, "check_name", calls.append)
            patch.setattr(ops_module, "check_int", lambda *a, **k: calls.append(a))
            assert check_lock_op(op) is op, "a well-formed op is accepted as it is"
        assert calls == [], f"a field of a known {op['op']} was checked again: {calls}"
