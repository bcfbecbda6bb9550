"""A child forked while another thread is taking or giving back a lease never believes it
holds it."""

from __future__ import annotations

import os
from typing import Any, Callable, Optional

import pytest

import queen_sync as qs


def child_believes_it_holds(lock: qs.Lock) -> bool:
    """Fork; the child reports whether it believes it holds ``lock`` (by exit status)."""
    pid = os.fork()
    if pid == 0:  # the child: report, then leave without running the parent's cleanup
        code = 2
        try:
            code = 1 if lock.held or lock.token is not None else 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    assert code in (0, 1), f"the child failed to report (exit {code})"
    return code == 1


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
class TestAForkWhileALeaseIsTaken:
    @pytest.mark.parametrize("when", ["before", "after"])
    def test_leaves_the_child_holding_nothing_whenever_the_renewer_learns_of_it(
        self, mq: qs.Queen, when: str, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        lock = mq.lock("job", ttl=30)
        register: Callable[[qs.Lock], None] = mq.renewer.register
        seen: list[bool] = []

        def fork_around_register(handle: qs.Lock) -> None:
            if when == "before":
                seen.append(child_believes_it_holds(handle))
            register(handle)
            if when == "after":
                seen.append(child_believes_it_holds(handle))

        monkeypatch.setattr(mq.renewer, "register", fork_around_register)
        assert lock.acquire(), "a fresh store must grant the lease"
        assert seen == [False], (
            f"a child forked {when} the renewer registered the lease believes it holds "
            "its parent's lease, with the parent's token")
        assert lock.held, f"the parent must still hold: {lock!r}"


class TestAnInterruptWhileALeaseIsTaken:
    def test_leaves_no_registration_behind_when_it_lands_inside_the_renewers_register(
        self, mq: qs.Queen, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        lock = mq.lock("job", ttl=30)
        register: Callable[[qs.Lock], None] = mq.renewer.register

        def register_then_interrupt(handle: qs.Lock) -> None:
            register(handle)
            raise KeyboardInterrupt  # Ctrl-C once the renewer knows of it, before it holds

        monkeypatch.setattr(mq.renewer, "register", register_then_interrupt)
        with pytest.raises(KeyboardInterrupt):
            lock.acquire()
        assert lock not in mq.renewer.held(), "an acquire cut short left the handle registered"
        assert not lock.held, f"{lock!r} believes it holds after an interrupted acquire"


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
class TestAForkWhileALeaseIsReleased:
    @pytest.mark.parametrize("how", ["release", "begin_release"])
    def test_leaves_the_child_holding_nothing_when_it_lands_as_the_renewer_forgets_it(
        self, mq: qs.Queen, how: str, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        lock = mq.lock("job", ttl=30)
        assert lock.acquire(), "a fresh store must grant the lease"
        unregister: Callable[[qs.Lock], None] = mq.renewer.unregister
        seen: list[bool] = []

        def unregister_then_fork(handle: qs.Lock) -> None:
            unregister(handle)
            seen.append(child_believes_it_holds(handle))  # the renewer's reset misses it now

        monkeypatch.setattr(mq.renewer, "unregister", unregister_then_fork)
        op: Optional[dict[str, Any]] = None
        if how == "release":
            assert lock.release(), "the engine should give the permit back"
        else:
            op = lock.begin_release()
        assert op is not None or how == "release", "begin_release must build the release op"
        assert seen and not any(seen), (
            f"a child forked as {how}() unregistered the lease believes it holds its "
            f"parent's lease, with the parent's token ({seen})")
        monkeypatch.undo()
        if op is not None:
            assert lock.release(), "the release begun should be retried and land"
