"""PostgreSQL URLs: read as libpq reads them, our options taken out, shown without secrets.

libpq, not ``urllib``, decides what a URL means: its userinfo ends at the first ``@``
(so a password may hold ``?``, ``#`` and ``:``), and ``#`` is data everywhere. Every
function here cuts the URL the same way (``split_userinfo``), so what is masked is
exactly what libpq sends as the password.
"""

from __future__ import annotations

import math
from typing import Any, Optional
from urllib.parse import unquote

import psycopg
import psycopg.conninfo

from ..._errors import RequestError
from ..base import redact_url, split_userinfo
from .errors import detail_of

DEFAULT_SCHEMA = "queen_sync"
_OWN_QUERY = frozenset({"schema", "timeout", "pool_min_size", "pool_max_size"})
_MISREAD = ("the PostgreSQL URL's address would be misread (the URL is not shown, as it may "
            "hold a password): write '@' as %40 and '/' as %2F in a user name, password or "
            "database name")


def public_url(url: str) -> str:
    """``url`` without its password (in the address or the query), safe to print and log."""
    return redact_url(url)


def split_url(url: str) -> tuple[str, dict[str, str]]:
    """The libpq URL and this engine's own query options, taken out of it.

    libpq's options stay exactly as written: decoding and encoding them again would
    turn a ``%20`` into a ``+``, which libpq reads as a plus sign.
    """
    prefix, userinfo, at, rest = split_userinfo(url)
    if prefix.lower() not in ("postgresql://", "postgres://"):
        raise RequestError(f"not a PostgreSQL URL: {public_url(url)}", code="bad_url")
    address, _, query = rest.partition("?")
    fields = [field for field in query.split("&") if field]
    _refuse_a_misread_password(at, address, fields)
    ours: dict[str, str] = {}
    theirs = []
    for field in fields:
        key = unquote(field.partition("=")[0])
        if key in _OWN_QUERY:
            ours[key] = unquote(field.partition("=")[2])
        else:
            theirs.append(field)
    libpq = prefix + userinfo + at + address + ("?" + "&".join(theirs) if theirs else "")
    return libpq, ours


def _refuse_a_misread_password(at: str, address: str, fields: list[str]) -> None:
    """Refuse a URL whose ``@`` or ``/`` inside a password would make libpq misread it.

    libpq would quote the misread pieces (a "host", a "port", a query "key") in its
    error, and they are pieces of the password.
    """
    if "@" in address:  # the password (or a user name) held an '@' of its own, or a '/'
        raise RequestError(_MISREAD, code="bad_url")
    if at or not any("@" in field for field in fields):
        return
    hosts = address.partition("/")[0]
    if any("@" in field.partition("=")[0] for field in fields) or not _ports_are_numbers(hosts):
        raise RequestError(_MISREAD, code="bad_url")


def _ports_are_numbers(hosts: str) -> bool:
    for host in hosts.split(","):
        port = host.rpartition("]")[2] if host.startswith("[") else host
        digits = port.partition(":")[2]
        if digits and not digits.isdigit():
            return False
    return True


def engine_url(libpq_url: str, schema: str) -> str:
    """The URL a client shows: libpq's, without secrets, with a chosen schema."""
    url = public_url(libpq_url)
    if schema != DEFAULT_SCHEMA:
        url += ("&" if "?" in split_userinfo(url)[3] else "?") + f"schema={schema}"
    return url


def _session_options(existing: Optional[str], call_timeout: float) -> str:
    """Server settings for our sessions: no statement or lock wait outlives the call timeout.

    The user's own ``options`` come last, so a setting they chose wins over ours.
    """
    ms = int(call_timeout * 1000)
    ours = (f"-c statement_timeout={ms} -c lock_timeout={ms} "
            f"-c idle_in_transaction_session_timeout={max(ms, 5000)}")
    return f"{ours} {existing}" if existing else ours


def build_conninfo(libpq_url: str, connect_timeout: float, call_timeout: float,
                   where: str, secrets: frozenset[str] = frozenset()) -> str:
    """A libpq connection string with this engine's defaults added to the user's settings."""
    try:
        params: dict[str, Any] = psycopg.conninfo.conninfo_to_dict(libpq_url)
    except psycopg.Error as exc:
        raise RequestError(f"bad PostgreSQL URL {where}: {detail_of(exc, secrets)}",
                           code="bad_url") from exc
    except UnicodeDecodeError:  # the exception holds the raw bytes: it is not chained
        raise RequestError(f"bad PostgreSQL URL {where}: a percent-escape decodes to bytes "
                           "that are not UTF-8", code="bad_url") from None
    params.setdefault("application_name", "queen_sync")
    params.setdefault("connect_timeout", str(max(1, math.ceil(connect_timeout))))
    params.setdefault("tcp_user_timeout", str(int(call_timeout * 1000)))
    params.setdefault("keepalives_idle", "30")
    params["options"] = _session_options(params.get("options"), call_timeout)
    return psycopg.conninfo.make_conninfo(**params)
