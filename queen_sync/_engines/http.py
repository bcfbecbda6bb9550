"""The Queen broker over HTTP: ``http(s)://host:6632[,host2:6632]``.

The engine only carries bodies: it POSTs each call's body to ``/api/v1/<route>``
as compact JSON (the bytes the official Queen clients send for the same call)
on one ``requests.Session`` per client, shared by the caller and the renewer.

What it resends, and why that cannot apply a call twice:

- a lock call whose every acquire and renew names its owner, and a KV call made
  only of reads (``get``, ``getMany``, ``getPrefix``, ``check``): resent on a
  connection failure, a timeout or a 502/503/504, within ``retries``. The owner
  makes a resent acquire answer the same permit and a resent renew renew again
  (with a new, higher token), and a resent release of a token already released
  frees nothing. What it cannot stop is a stalled first send applied after the
  resend was answered: a renew then moves the permit on (the owner's tokens since
  still renew, and the handle releases by owner), and an acquire landing after the
  release takes the permit for nobody until its TTL, unless the handle's client
  closes first (``left_strays``);
- anything else (KV writes, ``incr``, transactions, owner-less lock ops): resent
  only when the request provably never reached the broker (the connection was
  never opened); otherwise the error surfaces, because the broker may have
  applied it;
- a ``429`` means the call was turned away unapplied: it is resent after its
  ``Retry-After``, within ``retries``, whatever the route.

A connection failure or a 502/503/504 moves on to the next broker of the list.
The bearer token is kept out of every log line, ``repr`` and error message.

How long a call can take: ``timeout`` is each request's ``(connect, read)`` socket
timeout; ``call_timeout`` (default: the larger of the two, so ``timeout=2`` bounds a
call by 2 s) is the budget of the WHOLE call, every resend, backoff and
``Retry-After`` wait included. Each request's socket timeouts are cut to what is left
of it, a wait that would outlast it is not made, and when it is spent the last
failure surfaces (a stalled broker: ``EngineUnavailableError``). A resend after a
stalled request therefore needs ``call_timeout`` above the read timeout. The one
case the budget cannot cut short is a broker that keeps trickling bytes, each
sooner than the socket timeout; the handles signal loss at their deadline anyway.
"""

from __future__ import annotations

import json
import logging
import os
import random
import threading
import time
from typing import Any, Mapping, Optional, Sequence, Union
from urllib.parse import SplitResult, urlsplit

import requests
from urllib3.util import Timeout as SocketTimeouts

from .._errors import QueenError, QueenHttpError, RequestError
from .._ops import KV_READ_OPS, check_kv_op, check_lock_op
from .base import Capabilities, Engine, parse_timeout, positive_seconds, redact_url_for_error
from .http_errors import http_error, never_sent, read_answer, transport_error

log = logging.getLogger("queen_sync")

ROUTES = {"locks": "/api/v1/locks", "kv": "/api/v1/kv", "transaction": "/api/v1/transaction"}
DEFAULT_TIMEOUT = (5.0, 15.0)
_GATEWAY_STATUSES = frozenset({502, 503, 504})
_MAX_RETRY_AFTER = 10.0
_MAX_BACKOFF = 1.0
_MIN_ATTEMPT = 0.01  # seconds: less than this left of a call's budget is not worth a request
_READ_ONLY_KV = KV_READ_OPS | {"check"}

Timeout = Union[float, tuple[float, float], None]


class _Secret:
    """A bearer token that never prints."""

    __slots__ = ("_value",)

    def __init__(self, value: str) -> None:
        self._value = value

    def reveal(self) -> str:
        return self._value

    def __repr__(self) -> str:
        return "<secret>"

    __str__ = __repr__


def parse_bases(url: str) -> list[str]:
    """The broker base URLs in ``url`` (comma-separated), checked before any I/O."""
    bases = [part.strip() for part in url.split(",") if part.strip()]
    if not bases:
        raise RequestError("no broker URL given", code="bad_url")
    return [_base(part) for part in bases]


def _base(url: str) -> str:
    parts = urlsplit(url)
    shown = repr(redact_url_for_error(url))  # a refused URL may hold a token anywhere
    if parts.scheme.lower() not in ("http", "https"):
        raise RequestError(f"{shown} is not an http:// or https:// URL", code="bad_url")
    if parts.username is not None or parts.password is not None:
        raise RequestError(f"a broker URL must not carry credentials ({shown}); pass "
                           "bearer_token= or set QUEEN_TOKEN", code="bad_url")
    if not parts.hostname:
        raise RequestError(f"broker URL {shown} has no host", code="bad_url")
    if parts.query or parts.fragment:
        raise RequestError(f"broker URL {shown} must not have a query or fragment",
                           code="bad_url")
    if not _has_a_good_port(parts):
        raise RequestError(f"broker URL {shown} has a bad port (a number 0..65535)",
                           code="bad_url")
    return f"{parts.scheme.lower()}://{parts.netloc}{parts.path.rstrip('/')}"


def _has_a_good_port(parts: SplitResult) -> bool:
    # Not raised from the parser's error: it quotes the port, which may be a misplaced secret.
    try:
        parts.port  # noqa: B018 - reading it validates it
    except ValueError:
        return False
    return True


def parse_call_timeout(call_timeout: Any, timeout: tuple[float, float]) -> float:
    """The budget of one whole call: ``call_timeout`` seconds, else the larger socket timeout."""
    return max(timeout) if call_timeout is None else positive_seconds(call_timeout,
                                                                      "call_timeout")


def _check_header(name: Any, value: Any) -> None:
    if not isinstance(name, str) or not isinstance(value, str):
        raise TypeError("headers must map str to str")
    if any(c in name + value for c in "\r\n\0"):
        raise ValueError(f"header {name!r} contains a line break")
    # What the HTTP layer would refuse later, quoting the value (which may be a secret).
    if not name or ":" in name or name[0].isspace() or max(map(ord, name)) > 0x7F:
        raise ValueError(f"header name {name!r} is not one HTTP can carry")
    if value[:1].isspace() or (value and max(map(ord, value)) > 0xFF):
        raise ValueError(f"header {name!r}: its value starts with a space, or holds a "
                         "character an HTTP header cannot carry (the value is not shown)")


def _check_token(token: Any) -> Optional[_Secret]:
    if token is None or token == "":
        return None
    if not isinstance(token, str):
        raise TypeError(f"bearer_token must be a str, got {type(token).__name__}")
    if any(c.isspace() for c in token):
        raise ValueError("bearer_token must not contain whitespace")
    if max(map(ord, token)) > 0xFF:  # checked, not encoded: the encode error quotes it
        raise ValueError("bearer_token must hold only characters an HTTP header can carry "
                         "(Latin-1)")
    return _Secret(token)


def encode_body(route: str, body: Mapping[str, Any]) -> bytes:
    """The request bytes: every op validated as the embedded engines would, then compact JSON."""
    if not isinstance(body, Mapping):
        raise TypeError(f"a {route} body must be a dict, got {type(body).__name__}")
    if route in ("locks", "kv"):
        ops = body.get("operations")
        if not isinstance(ops, list):
            raise RequestError(f"a {route} body needs an 'operations' list", code="bad_request")
        check = check_lock_op if route == "locks" else check_kv_op
        for op in ops:
            check(op)
    else:
        kv_ops = body.get("kv", [])
        if not isinstance(kv_ops, list):
            raise RequestError("a transaction's 'kv' must be a list", code="bad_request")
        for op in kv_ops:
            check_kv_op(op, in_transaction=True)
    try:
        text = json.dumps(body, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"a {route} body must be JSON-serialisable: {exc}") from exc
    return text.encode("utf-8")


def resendable(route: str, body: Mapping[str, Any]) -> bool:
    """True when sending ``body`` twice cannot apply anything twice (see the module docs)."""
    if route == "locks":
        return all(op["op"] in ("get", "release") or "owner" in op for op in body["operations"])
    if route == "kv":
        return all(op["op"] in _READ_ONLY_KV for op in body["operations"])
    return False


class HttpEngine(Engine):
    """The Queen broker (or several, with failover) over ``requests``.

    Args:
        timeout: each request's socket timeouts: seconds, or ``(connect, read)``
            (default ``(5, 15)``).
        call_timeout: the budget of one whole call, resends and waits included
            (default: the larger socket timeout); see the module docs.
        retries: resends after the first request, within ``call_timeout``.
        backoff: the first wait between resends to one broker (doubling, jittered).
    """

    kind = "http"
    capabilities = Capabilities(queue_operations=True, multi_host=True, wake_on_release=False)

    def __init__(self, bases: Sequence[str], *, bearer_token: Optional[str] = None,
                 timeout: Timeout = None, call_timeout: Optional[float] = None,
                 headers: Optional[Mapping[str, str]] = None,
                 verify: Union[bool, str] = True, retries: int = 3,
                 backoff: float = 0.05) -> None:
        self._bases = [_base(b) for b in bases]
        if not self._bases:
            raise RequestError("no broker URL given", code="bad_url")
        self._token = _check_token(bearer_token if bearer_token is not None
                                   else os.environ.get("QUEEN_TOKEN"))
        self._timeout = parse_timeout(timeout, DEFAULT_TIMEOUT)
        self._call_timeout = parse_call_timeout(call_timeout, self._timeout)
        self._headers = dict(headers or {})
        for name, value in self._headers.items():
            _check_header(name, value)
        if not isinstance(verify, (bool, str)):
            raise TypeError("verify must be True, False or the path of a CA bundle")
        if isinstance(verify, str) and not os.path.exists(verify):
            raise ValueError(f"verify={verify!r}: no such CA bundle file")
        self._verify = verify
        if isinstance(retries, bool) or not isinstance(retries, int) or not 0 <= retries <= 10:
            raise ValueError(f"retries must be an int 0..10, got {retries!r}")
        if isinstance(backoff, bool) or not isinstance(backoff, (int, float)) or backoff < 0:
            raise ValueError(f"backoff must be seconds >= 0, got {backoff!r}")
        self._attempts = max(retries + 1, len(self._bases))
        self._backoff = float(backoff)
        self._current = 0
        self._count_lock = threading.Lock()
        self.requests_sent = 0
        self._strays = threading.local()  # see ``left_strays``
        self._session = self._new_session()

    @classmethod
    def from_url(cls, url: str, **options: Any) -> HttpEngine:
        """The engine for ``http(s)://host:port`` (several comma-separated)."""
        return cls(parse_bases(url), **options)

    def _new_session(self) -> requests.Session:
        from .._version import __version__

        session = requests.Session()
        session.headers.update({"Content-Type": "application/json",
                                "Accept": "application/json",
                                "User-Agent": f"queen-sync/{__version__}", **self._headers})
        if self._token is not None:
            session.headers["Authorization"] = f"Bearer {self._token.reveal()}"
        # The environment is read once here, not on every call, and never for .netrc
        # credentials, which requests would otherwise put in place of the bearer header.
        session.trust_env = False
        self._proxies = {base: requests.utils.get_environ_proxies(base) for base in self._bases}
        env_ca = os.environ.get("REQUESTS_CA_BUNDLE") or os.environ.get("CURL_CA_BUNDLE")
        session.verify = (env_ca or True) if self._verify is True else self._verify
        return session

    @property
    def url(self) -> str:
        return ",".join(self._bases)

    def call(self, route: str, body: Mapping[str, Any]) -> dict[str, Any]:
        path = ROUTES.get(route)
        if path is None:
            raise RequestError(f"unknown route {route!r}", code="bad_request")
        payload = encode_body(route, body)
        safe = resendable(route, body)
        deadline = time.monotonic() + self._call_timeout
        failure: Optional[QueenError] = None
        self._strays.left = False
        for attempt in range(self._attempts):
            if failure is not None:
                self._pause(attempt, failure, deadline)
            base = self._bases[self._current]
            try:
                response = self._post(base, path, payload, deadline)
            except requests.exceptions.RequestException as exc:
                failure = transport_error(route, base, exc)
                if isinstance(exc, requests.exceptions.SSLError):
                    raise failure from exc
                self._fail_over(base)
                if not (safe or never_sent(exc)):
                    raise failure from exc
                self._strays.left = self._strays.left or not never_sent(exc)
                log.info("%s; %s", failure, "trying again")
                continue
            status = response.status_code
            if status == 429 or (safe and status in _GATEWAY_STATUSES):
                failure = http_error(route, response)
                if status != 429:  # a gateway may have passed the request on
                    self._strays.left = True
                    self._fail_over(base)
                log.info("%s; trying again", failure)
                continue
            if status >= 300:
                raise http_error(route, response)
            return read_answer(route, response)
        assert failure is not None
        raise failure

    def left_strays(self) -> bool:
        """Whether this thread's last call was resent after a request that may still land.

        A stalled request is given up on, not recalled: the broker may apply it after the
        resend was answered. An owner's acquire landing so, after its permit was released,
        takes the permit again for nobody; the handle then gives it back when its client
        closes.
        """
        return bool(getattr(self._strays, "left", False))

    def _post(self, base: str, path: str, payload: bytes, deadline: float
              ) -> requests.Response:
        with self._count_lock:
            self.requests_sent += 1
        # ``total`` makes the read wait only what the connect left of the budget.
        left = max(_MIN_ATTEMPT, deadline - time.monotonic())
        timeouts = SocketTimeouts(connect=min(self._timeout[0], left),
                                  read=min(self._timeout[1], left), total=left)
        # requests hands a urllib3 Timeout through as it is; its stubs list only numbers.
        return self._session.post(base + path, data=payload,
                                  timeout=timeouts,  # type: ignore[arg-type]
                                  proxies=self._proxies[base], allow_redirects=False)

    def _fail_over(self, base: str) -> None:
        if len(self._bases) > 1 and self._bases[self._current] == base:
            self._current = (self._current + 1) % len(self._bases)
            log.info("broker %s failed; next: %s", base, self._bases[self._current])

    def _pause(self, attempt: int, failure: QueenError, deadline: float) -> None:
        """Wait before resending: the broker's ``Retry-After``, else a jittered backoff.

        Raises ``failure`` instead when the wait would leave no time for the resend.
        """
        told = failure.retry_after if isinstance(failure, QueenHttpError) else None
        if told is not None and told > _MAX_RETRY_AFTER:
            raise failure
        if told is not None:
            wait = told
        elif attempt < len(self._bases):
            wait = 0.0  # a broker not tried yet in this call: go at once
        else:
            wait = (min(_MAX_BACKOFF, self._backoff * 2 ** (attempt - 1))
                    * (0.5 + random.random()))
        if deadline - time.monotonic() - wait < _MIN_ATTEMPT:
            log.info("%s; the call's %gs budget is spent", failure, self._call_timeout)
            raise failure
        time.sleep(wait)

    def after_fork(self) -> None:
        # The parent's pooled sockets are the parent's: a child opens its own.
        self._session = self._new_session()

    def close(self) -> None:
        self._session.close()
