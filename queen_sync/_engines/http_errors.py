"""What went wrong on an HTTP call, translated to queen_sync's errors at the engine boundary.

Two questions decide what the engine does with a failure:

- did the request provably never reach the broker? Only a connection that was
  never opened (refused, unresolvable, connect timeout) proves it; anything after
  the bytes left (a reset, a read timeout, a body cut short) may have been applied;
- what does the answer say? The broker's envelope is
  ``{"error": code, "reason": id, "detail": prose}``; a proxy's is
  ``{"error": prose, "code": code}``, often with ``Retry-After``.

The API never sees a ``requests`` exception: each is mapped here, most specific
type first, and chained with ``raise ... from``.
"""

from __future__ import annotations

import email.utils
import json
import re
import time
from typing import Any, Callable, Optional
from urllib.parse import quote

import requests
from urllib3.exceptions import NewConnectionError

from .._errors import (
    EngineError,
    EngineUnavailableError,
    ProtocolError,
    QueenError,
    QueenHttpError,
    QueenHttpRequestError,
    UnsupportedOperationError,
)

_SNIPPET = 120

# (requests exception, how to describe it) -- most specific first.
_TRANSPORT: tuple[tuple[type[BaseException], str], ...] = (
    (requests.exceptions.SSLError, "TLS failed"),
    (requests.exceptions.ConnectTimeout, "connect timed out"),
    (requests.exceptions.ReadTimeout, "no answer in time"),
    (requests.exceptions.ProxyError, "the proxy failed"),
    (requests.exceptions.ChunkedEncodingError, "the answer was cut short"),
    (requests.exceptions.ContentDecodingError, "the answer could not be decoded"),
    (requests.exceptions.ConnectionError, "connection failed"),
    (requests.exceptions.RequestException, "the request failed"),
)


def never_sent(exc: BaseException) -> bool:
    """True when the request provably never reached the broker (no connection was made)."""
    if isinstance(exc, requests.exceptions.ConnectTimeout):
        return True
    if isinstance(exc, (requests.exceptions.ProxyError, requests.exceptions.SSLError)):
        return False
    if isinstance(exc, requests.exceptions.ConnectionError) and exc.args:
        return isinstance(getattr(exc.args[0], "reason", None), NewConnectionError)
    return False


def transport_error(route: str, base: str, exc: requests.exceptions.RequestException
                    ) -> QueenError:
    """The queen_sync error for a ``requests`` exception raised while calling ``route``."""
    what = next(text for kind, text in _TRANSPORT if isinstance(exc, kind))
    message = f"{route} at {base}: {what} ({type(exc).__name__})"
    error: QueenError
    if isinstance(exc, (requests.exceptions.ChunkedEncodingError,
                        requests.exceptions.ContentDecodingError)):
        error = ProtocolError(message, route=route)
    elif isinstance(exc, requests.exceptions.SSLError):
        error = EngineError(message + "; check verify= (a CA bundle path) and the URL's host")
    else:
        error = EngineUnavailableError(message)
    error.__cause__ = exc
    return error


def retry_after(response: requests.Response) -> Optional[float]:
    """Seconds from ``Retry-After`` (a number or an HTTP date), None when absent or unreadable."""
    raw = response.headers.get("Retry-After")
    if raw is None:
        return None
    try:
        return max(0.0, float(raw))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(raw)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


def snippet(response: requests.Response) -> str:
    """What came back, short and on one line, for an error message."""
    scrub = token_scrubber(response)
    kind = scrub(response.headers.get("Content-Type", "no content type"))
    whole = scrub(response.text)
    text = " ".join(whole[:_SNIPPET].split())
    more = "..." if len(whole) > _SNIPPET else ""
    return f"{kind} {text!r}{more}" if text else f"{kind}, empty body"


# A token this long is masked wherever it stands; a shorter one only where it follows
# "Bearer ", so a one-letter token cannot garble every message that holds its letter.
_LONG_TOKEN = 8
_TOKEN_CHARACTER = r"[\w.~+/=%-]"


def _any_case_escapes(token: str) -> str:
    """A pattern for ``token`` percent-encoded, its hex digits in either case."""
    parts = re.split("(%[0-9A-F]{2})", quote(token, safe=""))
    return "".join(f"(?i:{part})" if part.startswith("%") else re.escape(part)
                   for part in parts if part)


def token_scrubber(response: requests.Response) -> Callable[[str], str]:
    """Masks the bearer token the request carried wherever the answer quotes it back.

    A proxy or a debugging broker may echo the request's headers into its error body,
    as written, JSON-escaped or percent-encoded.
    """
    request = response.request
    auth = request.headers.get("Authorization") if request is not None else None
    if not isinstance(auth, str) or auth[:7].lower() != "bearer " or not auth[7:].strip():
        return lambda text: text
    token = auth[7:].strip()
    escaped = json.dumps(token)[1:-1]
    # JSON may escape '/' as '\/' (PHP, some Java), and percent-escapes come in either case.
    forms = sorted({token, escaped, escaped.replace("/", "\\/")}, key=len, reverse=True)
    pattern = "|".join([*(re.escape(form) for form in forms), _any_case_escapes(token)])
    if len(token) < _LONG_TOKEN:
        found = re.compile(f"((?i:bearer)(?:\\s+|%20|\\+))(?:{pattern})(?!{_TOKEN_CHARACTER})")
        return lambda text: found.sub(r"\1***", text)
    found = re.compile(pattern)
    return lambda text: found.sub("***", text)


def _envelope(response: requests.Response) -> dict[str, Optional[str]]:
    """code/reason/detail from either envelope; empty when the body is not one."""
    try:
        body = response.json()
    except ValueError:
        return {}
    if not isinstance(body, dict):
        return {}
    scrub = token_scrubber(response)

    def text(key: str) -> Optional[str]:
        value = body.get(key)
        return scrub(value) if isinstance(value, str) else None

    if "code" in body:  # a proxy's: {"error": prose, "code": code}
        return {"code": text("code"), "reason": text("reason"), "detail": text("error")}
    return {"code": text("error"), "reason": text("reason"), "detail": text("detail")}


def http_error(route: str, response: requests.Response) -> QueenError:
    """The error for an answer with an HTTP error status.

    A ``501`` whose code is ``unsupported_operation`` is the broker saying it lacks a
    capability (``reason`` names it): that is ``UnsupportedOperationError``, as on
    the embedded engines. A ``400`` is a refusal of the request itself, raised as
    ``QueenHttpRequestError``: a ``RequestError``, as the embedded engines raise it. Every
    other status is ``QueenHttpError``; when the body carries no code, ``code`` is
    ``"http_<status>"`` so callers can always branch on it.
    """
    status = response.status_code
    fields = _envelope(response)
    code = fields.get("code") or f"http_{status}"
    detail = fields.get("detail")
    if status == 501 and code == "unsupported_operation":
        return UnsupportedOperationError(detail or f"{route}: the broker cannot do this",
                                         capability=fields.get("reason") or "unknown")
    told = detail if detail else snippet(response)
    kind = QueenHttpRequestError if status == 400 else QueenHttpError
    return kind(f"{route}: HTTP {status} {code}: {told}", status=status, code=code,
                          reason=fields.get("reason"), detail=detail,
                          retry_after=retry_after(response))


def read_answer(route: str, response: requests.Response) -> dict[str, Any]:
    """The JSON object a 2xx answer must be, or a ``ProtocolError`` naming what came back."""
    try:
        answer = response.json()
    except (ValueError, json.JSONDecodeError):
        raise ProtocolError(
            f"{route}: HTTP {response.status_code} answered {snippet(response)}, "
            "which is not JSON", route=route) from None
    if not isinstance(answer, dict):
        raise ProtocolError(f"{route}: HTTP {response.status_code} answered a JSON "
                            f"{type(answer).__name__}, not an object", route=route)
    return answer
