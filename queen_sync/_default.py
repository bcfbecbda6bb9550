"""The process-wide default client, for callers that name no ``Queen``."""

from __future__ import annotations

import threading
from typing import Optional

from ._client import Queen, default_url
from ._process import tracked

_mutex = threading.Lock()
_client: Optional[Queen] = None
_built_for: Optional[str] = None


def default_client() -> Queen:
    """The client ``@singleton_job`` and ``%%lock`` use when given none.

    Built on first use from ``QUEEN_URL``, else the embedded SQLite file in the
    user's state directory. It is built again when it was closed, or when
    ``QUEEN_URL`` names another engine than it was built for (the previous one is
    closed then if it holds nothing, else left to finish and close at exit).

    Returns:
        The same ``Queen`` on every call while ``QUEEN_URL`` stays the same.
    """
    global _client, _built_for
    url = default_url()
    with _mutex:
        current = _client
        if current is not None and tracked(current) and _built_for == url:
            return current
        _client, _built_for = Queen(url), url
        fresh = _client
    if current is not None and tracked(current) and not current.renewer.held():
        current.close()
    return fresh
