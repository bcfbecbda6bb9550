"""A client, a handle and a transaction are this process's bookkeeping: never copied.

A shallow copy of a held handle was a second handle of the same permit whose state
moved apart from the first: the copy released the lease while the original went on
believing it held it (and writing under a guard the store now refuses, or worse,
reporting ``held`` to a caller that skips the guard). Pickling raised
``cannot pickle '_thread.lock' object``, which says nothing of what to do instead.
"""

from __future__ import annotations

import copy
import pickle
from typing import Any, Callable

import pytest

import queen_sync as qs

_WAYS: dict[str, Callable[[Any], Any]] = {
    "copy": copy.copy,
    "deepcopy": copy.deepcopy,
    "pickle": pickle.dumps,
    "pickle protocol 0": lambda obj: pickle.dumps(obj, protocol=0),
}


def _objects(q: qs.Queen) -> dict[str, Any]:
    return {"Queen": q, "Lock": q.lock("job", ttl=30),
            "semaphore": q.semaphore("pool", 3, ttl=30), "Transaction": q.transaction()}


@pytest.mark.parametrize("way", sorted(_WAYS))
@pytest.mark.parametrize("kind", ["Queen", "Lock", "semaphore", "Transaction"])
def test_copying_or_pickling_raises_a_type_error_that_says_what_to_do(
    client: qs.Queen, kind: str, way: str
) -> None:
    obj = _objects(client)[kind]
    with pytest.raises(TypeError) as caught:
        _WAYS[way](obj)
    message = str(caught.value)
    assert type(obj).__name__ in message and "cannot be copied or pickled" in message, message
    assert "_thread" not in message, message
    assert "q." in message or "Queen(" in message, f"says how to make another: {message}"


def test_a_held_handle_stays_the_one_holder_after_a_refused_copy(client: qs.Queen) -> None:
    lock = client.lock("job", ttl=30)
    assert lock.acquire()
    token = lock.token
    with pytest.raises(TypeError):
        copy.copy(lock)
    assert lock.held and lock.token == token
    holders = client.locks.get("job")["holders"]
    assert [h["token"] for h in holders] == [token], holders
    lock.release()
    assert not client.locks.get("job")["held"]


def test_a_client_used_after_a_refused_copy_still_works(client: qs.Queen) -> None:
    with pytest.raises(TypeError):
        copy.copy(client)
    with client.lock("job", ttl=30) as lock:
        assert lock.held
