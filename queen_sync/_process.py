"""The process's clients: a registry, and what happens to them at exit and after ``fork``.

A client registers itself with the two things it does at those moments; the registry
keeps only weak references, so a client nobody uses any more is collected as usual.
"""

from __future__ import annotations

import atexit
import logging
import os
import weakref
from typing import Any, Callable, ClassVar, NoReturn, SupportsIndex

log = logging.getLogger("queen_sync")

EXIT_BUDGET = 3.0  # seconds all clients share to give their leases back at interpreter exit

_Hooks = tuple["weakref.WeakMethod[Callable[[float], None]]",
               "weakref.WeakMethod[Callable[[], None]]"]
_TRACKED: weakref.WeakKeyDictionary[Any, _Hooks] = weakref.WeakKeyDictionary()


class _Forks:
    """How many forks this process is from the one that imported the package (0: that one).

    A handle compares it with the count it was made under, which costs less than asking
    for the pid (a system call) on every acquire and release.
    """

    __slots__ = ("generation",)

    def __init__(self) -> None:
        self.generation = 0


forks = _Forks()


class ProcessBound:
    """An object made of this process's threads, connections and lease bookkeeping.

    A copy would be a second record of the same leases that drifts apart from the first
    (the copy releases, the original still believes it holds), and a pickle cannot carry
    threads or connections, so both are refused with what to do instead.
    """

    __slots__ = ()
    _remake: ClassVar[str] = "make another"  # how to get a second one, for the error

    def __reduce_ex__(self, protocol: SupportsIndex) -> NoReturn:
        # copy.copy, copy.deepcopy and pickle all come here when nothing else is defined.
        raise TypeError(
            f"a {type(self).__name__} cannot be copied or pickled: it is this process's "
            f"bookkeeping of live leases and connections; {self._remake}, and in another "
            "process open a Queen(...) of its own")


def track(client: Any, *, close: Callable[[float], None],
          after_fork_in_child: Callable[[], None]) -> None:
    """Remember ``client``: ``close(seconds)`` runs at exit, the other hook in a forked child."""
    _TRACKED[client] = (weakref.WeakMethod(close), weakref.WeakMethod(after_fork_in_child))


def forget(client: Any) -> None:
    _TRACKED.pop(client, None)


def tracked(client: Any) -> bool:
    """True from ``track`` until ``forget``: a client forgets itself as it closes."""
    return client in _TRACKED


def clients() -> list[Any]:
    """The clients alive in this process now."""
    return list(_TRACKED.keys())


def _close_all_at_exit() -> None:
    hooks = [close for close, _ in list(_TRACKED.values())]
    for ref in hooks:
        close = ref()
        if close is None:
            continue
        try:
            close(EXIT_BUDGET / max(1, len(hooks)))
        except Exception:
            log.warning("closing a client at exit failed; its leases expire by themselves",
                        exc_info=True)


def _after_fork_in_child() -> None:
    forks.generation += 1  # first: the clients' hooks reset handles to this generation
    for _, ref in list(_TRACKED.values()):
        hook = ref()
        if hook is None:
            continue
        # Each client on its own: a client whose hook raised must not leave the next ones
        # believing they hold their parent's leases, with the parent's tokens.
        try:
            hook()
        except BaseException:
            log.error("resetting a client in a forked child failed; do not use that client "
                      "in this process", exc_info=True)


atexit.register(_close_all_at_exit)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
