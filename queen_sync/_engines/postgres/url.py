"""PostgreSQL URLs: read as libpq reads them, our options taken out, shown without secrets.

libpq, not ``urllib``, decides what a URL means: its userinfo ends at the first ``@``
(so a password may hold ``?``, ``#`` and ``:``), and ``#`` is data everywhere. Every
function here cuts the URL the same way (``split_userinfo``), so what is masked is
exactly what libpq sends as the password.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Optional
from urllib.parse import unquote

import psycopg
import psycopg.conninfo

from ..._errors import RequestError
from ..base import redact_url, redact_url_for_error, split_userinfo
from .errors import detail_of

DEFAULT_SCHEMA = "queen_sync"
_OWN_QUERY = frozenset({"schema", "timeout", "pool_min_size", "pool_max_size"})
_MISREAD = ("the PostgreSQL URL's address would be misread (the URL is not shown, as it may "
            "hold a password): write '@' as %40, '/' as %2F, '?' as %3F and '#' as %23 in a "
            "user name, password or database name")
_CUT_QUERY = ("a field after the password in the PostgreSQL URL's query is no libpq option (it "
              "is not shown, as it may be part of the password): write '&' as %26 and '=' as "
              "%3D in a password")


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
        raise RequestError(f"not a PostgreSQL URL: {redact_url_for_error(url)}", code="bad_url")
    user = userinfo.partition(":")[0]
    if at and ("?" in user or "#" in user):
        # libpq takes all before the '@' for the user part (a password holds them freely):
        # a person meant a query, or a fragment, there.
        raise RequestError(_MISREAD, code="bad_url")
    address, _, query = rest.partition("?")
    fields = [field for field in query.split("&") if field]
    _refuse_a_misread_password(at, address, fields)
    ours: dict[str, str] = {}
    theirs = []
    for field in fields:
        key = unquote(field.partition("=")[0])
        if key in _OWN_QUERY:
            if key in ours:  # which one was meant? Neither is taken.
                raise RequestError(f"the PostgreSQL URL gives {key} twice", code="bad_url")
            ours[key] = unquote(field.partition("=")[2])
        else:
            theirs.append(field)
    libpq = prefix + userinfo + at + address + ("?" + "&".join(theirs) if theirs else "")
    return libpq, ours


def _refuse_a_misread_password(at: str, address: str, fields: list[str]) -> None:
    """Refuse a URL whose password libpq could cut short, naming no part of it.

    libpq ends a password at its first ``@`` (or, when a ``/`` comes first, reads the
    password as a port), and a query password at its first ``&``; the pieces after the
    cut become a host, a port or a query key, which its errors and our address quote.
    """
    in_query = [field for field in fields if "@" in field]
    if "@" in address or (at and in_query):  # a second '@': which one ends the password?
        raise RequestError(_MISREAD, code="bad_url")
    if in_query and (_may_hold_a_password(address)  # a '/' in it cut the userinfo short
                     or any("@" in field.partition("=")[0] for field in in_query)):
        raise RequestError(_MISREAD, code="bad_url")
    _refuse_a_cut_query_password(fields)


def _may_hold_a_password(address: str) -> bool:
    """Whether a ``:`` before the first ``/`` could start a password (an IPv6 host aside)."""
    hosts = address.partition("/")[0]
    return ":" in (hosts.partition("]")[2] if hosts.startswith("[") else hosts)


def _refuse_a_cut_query_password(fields: list[str]) -> None:
    """Refuse a field after a query password that libpq would reject (and quote).

    Such a field is most likely the rest of a password holding ``&``; a field libpq
    accepts is taken as libpq takes it, an option of its own.
    """
    after_a_password = False
    for field in fields:
        key, equals, value = field.partition("=")
        if after_a_password and (not equals or "=" in value
                                 or unquote(key) not in _libpq_keywords() | _OWN_QUERY):
            raise RequestError(_CUT_QUERY, code="bad_url")
        after_a_password |= unquote(key) in ("password", "sslpassword")


@functools.lru_cache(maxsize=1)
def _libpq_keywords() -> frozenset[str]:
    return frozenset(option.keyword.decode() for option in psycopg.pq.Conninfo.get_defaults())


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
    undecodable = False
    try:
        params: dict[str, Any] = psycopg.conninfo.conninfo_to_dict(libpq_url)
    except psycopg.Error as exc:
        raise RequestError(f"bad PostgreSQL URL {where}: {detail_of(exc, secrets)}",
                           code="bad_url") from exc
    except UnicodeDecodeError:
        undecodable = True
    if undecodable:  # raised out here: the decode error holds the raw bytes, its context too
        raise RequestError(f"bad PostgreSQL URL {where}: a percent-escape decodes to bytes "
                           "that are not UTF-8", code="bad_url")
    params.setdefault("application_name", "queen_sync")
    params.setdefault("connect_timeout", str(max(1, math.ceil(connect_timeout))))
    params.setdefault("tcp_user_timeout", str(int(call_timeout * 1000)))
    params.setdefault("keepalives_idle", "30")
    params["options"] = _session_options(params.get("options"), call_timeout)
    return psycopg.conninfo.make_conninfo(**params)
