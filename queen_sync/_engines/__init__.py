"""The engines: what answers the wire's bodies, chosen by URL.

``base`` holds what every engine offers; ``embedded`` the lock and key/value semantics the
SQL engines share over ``storage``; ``sqlite``, ``postgres`` and ``http`` the engines. Each
engine module is imported only when its URL is used, so the chooser below is the one place
that knows them all.
"""

from __future__ import annotations

import re
from typing import Any, Mapping

from .._errors import RequestError
from .base import Engine

_SCHEME = re.compile(r"[a-z][a-z0-9+.-]{0,30}")


def engine_from_url(url: str, options: Mapping[str, Any]) -> Engine:
    """The engine for a URL: ``sqlite://``, ``http(s)://`` or ``postgresql://``."""
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "sqlite":
        from .sqlite import SqliteEngine

        return SqliteEngine.from_url(url, **_only(options, SqliteEngine.OPTIONS))
    if scheme in ("http", "https"):
        from .http import HttpEngine  # type: ignore[import-not-found,unused-ignore]

        engine: Engine = HttpEngine.from_url(url, **options)
        return engine
    if scheme in ("postgresql", "postgres"):
        from .postgres.engine import PostgresEngine  # type: ignore[import-not-found,unused-ignore]

        engine = PostgresEngine.from_url(url, **_only(options, PostgresEngine.OPTIONS))
        return engine
    # Only a word that can be a scheme is quoted: text before a ':' that is not one (a
    # connection string's ``password=a:b``) may be a secret.
    named = f"scheme {scheme!r}" if _SCHEME.fullmatch(scheme) else "text (no scheme; not shown)"
    raise RequestError(
        f"unknown engine URL {named}: use sqlite:///path, http(s)://host:port "
        "or postgresql://user@host/db",
        code="bad_url",
    )


def _only(options: Mapping[str, Any], allowed: frozenset[str]) -> dict[str, Any]:
    extra = {k for k, v in options.items() if v is not None} - allowed
    if extra:
        raise TypeError(f"options {sorted(extra)} do not apply to this engine")
    return {k: v for k, v in options.items() if v is not None}
