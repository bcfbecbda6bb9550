"""Requests no engine can carry are refused alike at the call, with a typed error, writing nothing.

Every engine stores tokens and versions as 64-bit signed integers and carries values as
UTF-8 JSON, so a token past 2**63 - 1 or a value holding a lone surrogate is the caller's
mistake on each of them: it must not reach one engine as an overflow, a 500 or a stored value.
"""

from __future__ import annotations

from typing import Any

import pytest

import queen_sync as qs
from queen_sync import RequestError

PAST_INT64 = 1 << 63
LONE_SURROGATES: list[Any] = ["\ud800", {"\udfff": 1}, ["ok", "a\ud83d"]]


class TestATokenPastSixtyFourBits:
    @pytest.mark.parametrize("call", ["release", "release_at_slot", "renew"])
    def test_is_refused_as_a_value_error_naming_the_bound(self, q: qs.Queen, call: str) -> None:
        with pytest.raises(ValueError, match="9223372036854775807") as caught:
            if call == "release":
                q.locks.release("job", token=PAST_INT64)
            elif call == "release_at_slot":
                q.locks.release("job", token=PAST_INT64, slot=0)
            else:
                q.locks.renew("job", token=PAST_INT64, ttl_seconds=5, slot=0, owner="o")
        assert type(caught.value) is ValueError, f"a plain ValueError, not {caught.value!r}"

    def test_the_largest_token_is_answered_as_not_live(self, q: qs.Queen) -> None:
        answer = q.locks.release("job", token=PAST_INT64 - 1, slot=0)
        assert answer["released"] is False, f"no such permit: {answer}"

    def test_an_expected_version_past_sixty_four_bits_is_refused(self, q: qs.Queen) -> None:
        with pytest.raises(ValueError, match="expect"):
            q.kv.put("app", "k", 1, forever=True, expect=PAST_INT64)
        assert not q.kv.get("app", "k"), "the refused put wrote nothing"


class TestAValueWithALoneSurrogate:
    @pytest.mark.parametrize("value", LONE_SURROGATES, ids=["lone", "in-a-key", "in-a-list"])
    def test_is_a_request_error_saying_utf8_and_writes_nothing(self, q: qs.Queen,
                                                               value: Any) -> None:
        with pytest.raises(RequestError, match="UTF-8"):
            q.kv.put("app", "k", value, forever=True)
        assert not q.kv.get("app", "k"), "the refused put wrote nothing"

    def test_refuses_the_whole_transaction_before_anything_commits(self, q: qs.Queen) -> None:
        with pytest.raises(RequestError, match="UTF-8"):
            (q.transaction().kv.put("app", "a", 1, forever=True)
             .kv.put("app", "b", "\ud800", forever=True).commit())
        assert not q.kv.get("app", "a"), "nothing of the refused transaction is written"
