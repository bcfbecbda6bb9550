"""A handle's name and owner: checked when set, and kept as plain ``str`` whatever was given."""

from __future__ import annotations

import pytest

import queen_sync as qs


class _Anyone(str):
    """A str subclass that claims to equal everything (an adversary's owner)."""

    def __eq__(self, other: object) -> bool:
        return True

    def __hash__(self) -> int:
        return str.__hash__(self)


class TestTextGivenAsAStrSubclass:
    def test_an_owner_is_kept_as_a_plain_str(self, mq: qs.Queen) -> None:
        lock = mq.lock("job", ttl=30, owner=_Anyone("worker-1"))
        assert type(lock.owner) is str, f"the owner kept its subclass: {type(lock.owner)!r}"
        assert str.__eq__(lock.owner, "worker-1"), f"the owner changed: {lock.owner!r}"
        assert lock.owner != "worker-2", "a permissive __eq__ reached the handle's owner"

    def test_a_name_is_kept_as_a_plain_str(self, mq: qs.Queen) -> None:
        lock = mq.lock(_Anyone("job"), ttl=30)
        assert type(lock.name) is str, f"the name kept its subclass: {type(lock.name)!r}"

    def test_a_name_whose_str_differs_from_its_text_keeps_the_text_checked(
        self, mq: qs.Queen
    ) -> None:
        class Sly(str):
            def __str__(self) -> str:
                return "other#0"  # a name the check would refuse ('#')

        lock = mq.lock(Sly("job"), ttl=30)
        assert str.__eq__(lock.name, "job"), f"the handle took an unchecked name: {lock.name!r}"


class TestANameOrOwnerAssignedToAHandle:
    @pytest.mark.parametrize("attribute, garbage, error", [
        ("name", 7, TypeError), ("name", "a#0", qs.RequestError), ("name", "", qs.RequestError),
        ("owner", "", qs.RequestError), ("owner", b"me", TypeError),
        ("owner", "a\nb", qs.RequestError)])
    def test_garbage_is_refused_at_the_assignment_and_the_handle_keeps_holding(
        self, mq: qs.Queen, attribute: str, garbage: object, error: type[Exception]
    ) -> None:
        lock = mq.lock("job", ttl=30, owner="worker-1")
        assert lock.acquire(), "a fresh store must grant the lease"
        with pytest.raises(error):
            setattr(lock, attribute, garbage)
        assert (lock.name, lock.owner) == ("job", "worker-1"), f"a refused value stuck: {lock!r}"
        assert lock.renew(), f"a refused value broke the lease: {lock!r}"

    def test_a_valid_owner_is_kept_as_a_plain_str(self, mq: qs.Queen) -> None:
        lock = mq.lock("job", ttl=30)
        lock.owner = _Anyone("worker-2")
        assert type(lock.owner) is str, f"the owner kept its subclass: {type(lock.owner)!r}"
