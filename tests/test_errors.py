"""Errors carry data, read well, pickle, and form one tree."""

from __future__ import annotations

import pickle

import pytest

import queen_sync as qs

SAMPLES = [
    qs.LockNotHeldError("busy", name="job", holders=[{"owner": "a"}]),
    qs.LockBusyError("busy", name="job", holders=()),
    qs.LockLostError("gone", name="job", reason="renew", token=7),
    qs.FencedOutError("stale", presented=3, current=5),
    qs.RequestError("bad key", code="kv_bad_request"),
    qs.UnsupportedOperationError("no queues", capability="queue_operations"),
    qs.EngineUnavailableError("down"),
    qs.QueenHttpError("503", status=503, code="unavailable", retry_after=1.5),
    qs.ProtocolError("html", route="locks"),
]


@pytest.mark.parametrize("error", SAMPLES, ids=lambda e: type(e).__name__)
def test_every_error_pickles_with_its_fields(error: qs.QueenError) -> None:
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is type(error) and str(copy) == str(error)
    assert copy._fields == error._fields, (copy._fields, error._fields)


@pytest.mark.parametrize("error", SAMPLES, ids=lambda e: type(e).__name__)
def test_every_error_repr_shows_its_fields(error: qs.QueenError) -> None:
    text = repr(error)
    assert text.startswith(type(error).__name__ + "(")
    for key, value in error._fields.items():
        assert f"{key}={value!r}" in text, text


def test_the_tree_has_one_root_and_the_documented_branches() -> None:
    assert issubclass(qs.LockBusyError, qs.LockNotHeldError)
    assert issubclass(qs.LockNotHeldError, qs.LockError)
    assert issubclass(qs.LockLostError, qs.LockError)
    assert issubclass(qs.RequestError, ValueError) and issubclass(qs.RequestError, qs.QueenError)
    for leaf in (qs.EngineUnavailableError, qs.QueenHttpError, qs.ProtocolError):
        assert issubclass(leaf, qs.EngineError)
    for cls in (qs.LockError, qs.FencedOutError, qs.UnsupportedOperationError, qs.EngineError):
        assert issubclass(cls, qs.QueenError)


def test_lock_errors_name_their_lock_and_code_errors_their_code() -> None:
    lost = qs.LockLostError("gone", name="job", reason="expired", token=9)
    assert (lost.name, lost.reason, lost.token) == ("job", "expired", 9)
    assert qs.RequestError("x", code="kv_bad_request").code == "kv_bad_request"
