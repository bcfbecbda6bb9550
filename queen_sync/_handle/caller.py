"""``Caller``: what a handle needs from the client that made it, and nothing more.

Handles (``Lock``, ``Kv``, ``Transaction``) and the ``Renewer`` are written against
this protocol instead of ``Queen``, so they sit below the client in the layers and
a test can hand them any object that keeps these promises.
"""

from __future__ import annotations

from _thread import LockType
from typing import TYPE_CHECKING, Any, Callable, Optional, Protocol

if TYPE_CHECKING:
    from .._clock import Clock
    from .._engines.base import Engine
    from .._errors import QueenError
    from .._metrics import Metrics
    from .._results import Result
    from .renewer import Renewer


class Caller(Protocol):
    """The client as its handles see it.

    The ``call_*`` methods check that an answer keeps the route's promise (one result
    per op, objects only) and raise ``ProtocolError`` otherwise, and refuse to send
    once the client is closed.
    """

    @property
    def url(self) -> str:
        """The engine's URL without credentials (for display and for telling engines apart)."""

    @property
    def clock(self) -> Clock:
        """The monotonic clock local deadlines are counted on."""

    @property
    def metrics(self) -> Metrics: ...

    @property
    def renewer(self) -> Renewer: ...

    @property
    def renew_thread(self) -> bool:
        """Whether the renewer may run its own thread (False: a test drives ``tick()``)."""

    @property
    def engine(self) -> Engine:
        """For what only the engine knows: capabilities, wake-ups on release, fencing."""

    @property
    def closing(self) -> bool:
        """Whether ``close()`` has begun: from then on no acquire may report a lease."""

    def closed_error(self) -> QueenError:
        """The "closed" error an acquire on a closing client raises."""

    def take_off(self, flight: LockType) -> None:
        """List an acquire in flight by ``flight``, a lock its attempt holds while it runs.

        Raises the "closed" ``QueenError`` once the client is closing, so that ``close()``
        can wait for the acquires in flight and then release everything they took.
        """

    def land(self, flight: LockType) -> None:
        """Unlist ``flight``: its attempt has ended (and its lease, if any, is registered)."""

    def call_locks(self, ops: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The answers to ``ops``, one object per op, for the handle to read (never to hand
        out: they are the engine's own objects, not ``Result`` copies)."""

    def call_kv(self, ops: list[dict[str, Any]]) -> list[Result]: ...

    def call_transaction(self, body: dict[str, Any]) -> Result: ...

    def dispatch(self, handler: Callable[[str], Any], reason: str,
                 lease: Optional[object] = None) -> None:
        """Run ``handler(reason)`` soon on another thread, after ``lease``'s earlier ones.

        Never on the calling thread; ``queen_sync._handle.losses`` says where and when.
        """
