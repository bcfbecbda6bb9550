"""Re-running a notebook cell: a new handle supersedes the kernel's own forgotten one.

A cell such as ``lk = q.lock("retrain", ttl="10m"); lk.acquire()`` run twice
makes a second handle while the first (no longer bound to any name, still
renewed) holds the permit, so the second would wait on its own kernel. Instead,
when a handle acquires inside an IPython cell, it first releases every earlier
handle that

- is on the same engine URL (any client of this process) with the same name and limit,
- was acquired by this same thread in an EARLIER cell execution,
- is not inside a ``with`` block, ``run`` or ``@singleton_job`` call right now, and
- is no longer reachable from the notebook: not the value of a variable, nor an
  item or attribute of one (history such as ``Out`` and ``_`` does not count),

with a warning naming the superseded owner. A handle you kept in a variable
(``blocker = q.lock(...)``) is never taken over, so holding a lock across cells
and showing contention inside one kernel work as usual. Outside IPython nothing
changes: two handles on one name contend as usual, in any thread.
"""

from __future__ import annotations

import itertools
import logging
import sys
import threading
import types
from typing import TYPE_CHECKING, Any, Iterable, Optional

from .._process import clients

if TYPE_CHECKING:
    from .._handle.lock import Lock

log = logging.getLogger("queen_sync")


_SCAN_LIMIT = 1000  # items looked at inside one variable


def _shell() -> Any:
    module = sys.modules.get("IPython")
    get_ipython = getattr(module, "get_ipython", None)
    return get_ipython() if get_ipython is not None else None


def cell_number() -> Optional[int]:
    """The running IPython cell's execution count, or None outside IPython (imports nothing)."""
    count = getattr(_shell(), "execution_count", None)
    return count if isinstance(count, int) else None


def _inside(value: Any) -> Iterable[Any]:
    if isinstance(value, dict):
        return itertools.islice(value.values(), _SCAN_LIMIT)
    if isinstance(value, (list, tuple, set, frozenset)):
        return itertools.islice(value, _SCAN_LIMIT)
    if isinstance(value, (type, types.ModuleType, types.FunctionType)):
        return ()
    attributes = getattr(value, "__dict__", None)
    return itertools.islice(attributes.values(), _SCAN_LIMIT) if isinstance(attributes,
                                                                             dict) else ()


def reachable_from_notebook(lock: Lock) -> bool:
    """True when a notebook variable, or an item or attribute of one, is ``lock``."""
    shell = _shell()
    namespace = getattr(shell, "user_ns", None)
    if not isinstance(namespace, dict):
        return True  # cannot tell: never take it over
    hidden = getattr(shell, "user_ns_hidden", None) or {}
    for name, value in list(namespace.items()):
        if name in hidden:
            continue
        if value is lock or any(item is lock for item in _inside(value)):
            return True
    return False


def supersede_earlier(lock: Lock) -> None:
    """Release this thread's handles from earlier cells on ``lock``'s permits (see module doc)."""
    cell = cell_number()
    if cell is None:
        return
    me = threading.get_ident()
    for client in clients():  # closed clients have left the registry
        if client.url != lock.engine_url:
            continue
        for other in client.renewer.held():
            thread, taken_in_cell = other.taken_in
            if (other is not lock and other.name == lock.name and other.limit == lock.limit
                    and thread == me and taken_in_cell is not None
                    and taken_in_cell != cell and not other.in_block
                    and not reachable_from_notebook(other)):
                log.warning("lock %r: re-run cell %d supersedes the handle taken in cell %d "
                            "(owner %s), which is released", lock.name, cell, taken_in_cell,
                            other.owner)
                other.release()
