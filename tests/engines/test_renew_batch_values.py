"""A renewal batch parses each permit's stored JSON text itself, by the decoder's scan.

The scan alone reads text with nothing around the value (what the engine stores); the
answer must be the full decode's for any text, and a text that is not JSON must still
raise the decoder's error.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from queen_sync._engines.postgres.renew_batch import _parsed

_JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=5)
                     | st.floats(allow_nan=False, allow_infinity=False),
                     lambda inner: st.lists(inner, max_size=3)
                     | st.dictionaries(st.text(max_size=3), inner, max_size=3), max_leaves=8)


class TestAStoredValueParsesAsTheFullDecodeWould:
    @given(value=_JSON, before=st.sampled_from(["", " ", "\n\t"]),
           after=st.sampled_from(["", " ", "\r\n"]), compact=st.booleans())
    def test_whatever_whitespace_surrounds_or_fills_it(self, value: Any, before: str,
                                                       after: str, compact: bool) -> None:
        text = before + json.dumps(value, separators=(",", ":") if compact else None) + after
        assert _parsed(text) == json.loads(text), f"{text!r} parsed apart from json.loads"

    def test_a_key_stored_twice_keeps_the_last_as_json_loads_does(self) -> None:
        text = '{"owner":"alice","owner":"me","limit":1}'
        assert _parsed(text) == {"owner": "me", "limit": 1}, _parsed(text)

    @pytest.mark.parametrize("text", ['{"owner":"me"} x', '{"owner":', "", "  "])
    def test_a_text_that_is_not_one_json_value_raises_the_decoders_error(
            self, text: str) -> None:
        with pytest.raises(json.JSONDecodeError):
            _parsed(text)
