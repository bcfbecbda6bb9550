"""The recipes' check on a function they will call: it must run its body when called."""

from __future__ import annotations

import inspect
from typing import Any


def check_function(fn: Any, what: str) -> Any:
    """``fn``, refused before any I/O when it cannot be called, or when calling it would
    only return a coroutine or generator (its body would never run, or run unfenced).

    Raises:
        TypeError: naming ``what``.
    """
    if not callable(fn):
        raise TypeError(f"{what} must be callable, got {type(fn).__name__}")
    if (inspect.iscoroutinefunction(fn) or inspect.isasyncgenfunction(fn)
            or inspect.isgeneratorfunction(fn)):
        raise TypeError(f"{what} must be a plain function: {fn!r} is a generator or async "
                        "function, whose call returns before its body runs")
    return fn
