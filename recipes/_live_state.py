"""The recipes' objects that hold live state: threads, leases. They refuse to be copied."""

from __future__ import annotations

from typing import Any, NoReturn


class NotCopied:
    """Refuses ``copy.copy``, ``copy.deepcopy`` and pickling with a ``TypeError``.

    A shallow copy would share the original's lease handle and thread events, so that
    stopping one stops the other, and two objects would speak for one term or claim.
    """

    _remake = "make another"

    def _refuse(self) -> NoReturn:
        kind = type(self).__name__
        raise TypeError(f"a {kind} cannot be copied or pickled: it holds this process's live "
                        f"lease and threads; {self._remake}")

    def __copy__(self) -> NoReturn:
        self._refuse()

    def __deepcopy__(self, memo: Any) -> NoReturn:
        self._refuse()

    def __reduce_ex__(self, protocol: Any) -> NoReturn:
        self._refuse()
