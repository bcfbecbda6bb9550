"""``FakeBroker``: the Queen routes in-process, through a ``requests`` transport of its own.

No socket is opened: while it runs, every ``requests`` session sends what is addressed
to its URL to a transport adapter that answers from the embedded engine on an SQLite
file, whenever that session was made. Other URLs go to the network as usual.
"""

from __future__ import annotations

import contextlib
import http.client
import io
import threading
import time
from typing import Any, Callable, Optional

import requests
from requests.adapters import BaseAdapter
from requests.structures import CaseInsensitiveDict
from urllib3.exceptions import MaxRetryError, NewConnectionError
from urllib3.exceptions import ProtocolError as Urllib3ProtocolError
from urllib3.util import Timeout as SocketTimeout

from ._core import FAULT_KINDS, BrokerStopped, BrokerTools, Fault, Reply


class FakeBroker(BrokerTools):
    """An in-process, stateful Queen broker for tests; it needs nothing beyond ``requests``.

    ```python
    with FakeBroker() as broker:
        q = broker.client()
        broker.faults.fail_next(2, status=503)   # the next two calls fail; locks retry
        assert q.lock("job", ttl=30).acquire()
    ```

    Args:
        url: the broker URL it answers for (no socket is opened). One running fake
            answers a URL at a time.
        path: the SQLite file behind it; None: a temporary one.
        token: when given, calls must carry ``Authorization: Bearer <token>``.
        clock: the epoch-seconds clock the store judges expiry by (default
            ``time.time``); a test advances it past a TTL instead of sleeping.
    """

    def __init__(self, url: str = "http://queen.test:6632", *, path: Optional[str] = None,
                 token: Optional[str] = None, clock: Callable[[], float] = time.time) -> None:
        self._url = url.rstrip("/")
        super().__init__(path, token=token, kinds=FAULT_KINDS, prefix="queen-fake-broker-",
                         clock=clock)
        self._transport: Optional[_Transport] = None

    @property
    def url(self) -> str:
        """The broker URL its clients are given (no socket listens on it)."""
        return self._url

    def start(self) -> FakeBroker:
        """Start answering its URL, for every ``requests`` session, until ``stop``.

        Raises:
            ValueError: another running ``FakeBroker`` answers this URL already.
            RuntimeError: the broker was closed, and the store it made removed.
        """
        if self._transport is not None:
            return self
        self._refuse_if_removed()
        transport = _Transport(self)
        _ROUTER.add(self._url, transport)  # first: a refused start opens nothing
        try:
            self._core.open()
        except BaseException:
            _ROUTER.remove(self._url, transport)
            raise
        self._transport = transport
        return self

    def stop(self) -> None:
        """Stop answering: its URL then reaches nothing, as an unknown host would."""
        transport, self._transport = self._transport, None
        if transport is not None:
            _ROUTER.remove(self._url, transport)
        self._core.close()

    def answer(self, request: requests.PreparedRequest,
               read_timeout: Optional[float] = None) -> Reply:
        """The reply to ``request``, faults included; a transport fault raises.

        A delay past ``read_timeout`` raises the client's read timeout when it runs out,
        and the call lands when the delay ends, as on a broker behind a socket.
        """
        path = "/" + (request.path_url or "").lstrip("/")
        method = request.method or "POST"
        raw = request.body if isinstance(request.body, bytes) else (request.body or "").encode()
        headers = dict(request.headers)
        fault = self._core.faults.take(self._core.route_of(path))
        if fault is not None and fault.kind == "delay" and read_timeout is not None \
                and fault.seconds > read_timeout:
            time.sleep(read_timeout)
            late = threading.Timer(fault.seconds - read_timeout, self._answer_late,
                                   (method, path, headers, raw))
            late.daemon = True
            late.start()
            raise requests.exceptions.ReadTimeout(
                f"{request.url}: no answer within {read_timeout}s (a delay injected)")
        if fault is None or fault.kind == "delay":
            if fault is not None:
                time.sleep(fault.seconds)
            return self._core.answer(method, path, headers, raw)
        if fault.applied:
            self._core.answer(method, path, dict(request.headers), raw)
        if fault.kind == "status":
            return fault.reply()
        raise _transport_fault(fault, request.url or self._url)

    def _answer_late(self, method: str, path: str, headers: dict[str, str], raw: bytes) -> None:
        """A delayed call whose client gave up: it lands all the same, unless stopped."""
        with contextlib.suppress(BrokerStopped):
            self._core.answer(method, path, headers, raw)

    def __repr__(self) -> str:
        return f"<FakeBroker {self._url} {'running' if self._transport else 'stopped'}>"


def _read_timeout(timeout: Any) -> Optional[float]:
    """How long the client waits for an answer, as ``requests`` passes it on: a number, a
    (connect, read) pair, or urllib3's ``Timeout`` (which counts a total too); None: forever."""
    if isinstance(timeout, tuple):
        timeout = timeout[1]
    if isinstance(timeout, SocketTimeout):
        timer = timeout.clone()
        timer.start_connect()  # connected at once: no socket to wait for
        timeout = timer.read_timeout
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        return None
    return float(timeout)


class _Transport(BaseAdapter):
    """A ``requests`` transport adapter that answers from one ``FakeBroker``, socket-free."""

    def __init__(self, broker: FakeBroker) -> None:
        super().__init__()
        self._broker = broker

    def send(self, request: requests.PreparedRequest, stream: bool = False,
             timeout: Any = None, verify: Any = True, cert: Any = None,
             proxies: Any = None) -> requests.Response:
        try:
            reply = self._broker.answer(request, _read_timeout(timeout))
        except BrokerStopped:  # stopped while this call was in flight: it reaches nothing
            raise requests.exceptions.ConnectionError(
                f"{request.url}: the broker stopped while the call was in flight") from None
        response = requests.Response()
        response.status_code = reply.status
        response.reason = http.client.responses.get(reply.status, "")
        response.headers = CaseInsensitiveDict(dict(reply.headers))
        response.encoding = requests.utils.get_encoding_from_headers(response.headers)
        response.raw = io.BytesIO(reply.body)  # read as a socket's body would be
        response.url = request.url or ""
        response.request = request
        return response

    def close(self) -> None:
        """Nothing to close: no connection was opened."""


class _Router:
    """Sends each ``requests`` session's calls for a running fake's URL to its transport.

    A session picks its transport in ``Session.get_adapter``; while any fake runs, that
    method first looks here, so sessions made before the fake started are answered too,
    and a URL no fake answers gets the session's own adapter as usual.
    """

    def __init__(self) -> None:
        self._mutex = threading.Lock()
        self._routes: dict[str, _Transport] = {}  # "http://host:port/" -> its transport
        self._plain: Any = None  # Session.get_adapter as the hook found it, while it is in

    def add(self, url: str, transport: _Transport) -> None:
        prefix = url.lower() + "/"
        with self._mutex:
            if prefix in self._routes:
                raise ValueError(f"another FakeBroker already answers {url}: stop it first, "
                                 "or give this one another URL")
            # Copied, not changed in place: a session picking its transport reads no lock.
            self._routes = {**self._routes, prefix: transport}
            if requests.Session.get_adapter is not _route:
                # A class attribute: the one way in for every session, however it was made.
                # When the hook is still in (another tool patched over it, then put it
                # back), what it found then is still what it passes other URLs on to.
                self._plain = requests.Session.get_adapter
                requests.Session.get_adapter = _route  # type: ignore[method-assign,assignment]

    def remove(self, url: str, transport: _Transport) -> None:
        prefix = url.lower() + "/"
        with self._mutex:
            if self._routes.get(prefix) is not transport:
                return
            self._routes = {k: v for k, v in self._routes.items() if k != prefix}
            self._leave_if_ours()

    def _leave_if_ours(self) -> None:
        """Put back what the hook found, if it is the hook in place and no fake runs.

        A tool that patched over the hook keeps its patch; when it stops it hands the hook
        back, which passes every URL on and leaves at its first call.
        """
        if not self._routes and requests.Session.get_adapter is _route:
            requests.Session.get_adapter = self._plain  # type: ignore[method-assign]
            self._plain = None

    def pick(self, session: requests.Session, url: str) -> BaseAdapter:
        wanted = url.lower()
        for prefix, transport in self._routes.items():
            if wanted.startswith(prefix):
                return transport
        plain = self._plain or _PLAIN_GET_ADAPTER  # the router may be leaving meanwhile
        if not self._routes and self._plain is not None:
            with self._mutex:
                self._leave_if_ours()
        adapter: BaseAdapter = plain(session, url)
        return adapter


_PLAIN_GET_ADAPTER = requests.Session.get_adapter
_ROUTER = _Router()


def _route(session: requests.Session, url: str) -> BaseAdapter:
    return _ROUTER.pick(session, url)


def _transport_fault(fault: Fault, url: str) -> Exception:
    """The ``requests`` exception a real network would raise for this fault."""
    if fault.kind == "timeout":
        time.sleep(min(fault.seconds, 0.05))
        return requests.exceptions.ReadTimeout(f"injected: no answer from {url}")
    if fault.kind == "reset":
        reset = ConnectionResetError(104, "Connection reset by peer (injected)")
        return requests.exceptions.ConnectionError(
            Urllib3ProtocolError("Connection aborted.", reset))
    refused = NewConnectionError(None, f"injected: connection to {url} refused")  # type: ignore[arg-type]  # urllib3 accepts no connection for a refused one
    return requests.exceptions.ConnectionError(MaxRetryError(None, url, refused))  # type: ignore[arg-type]  # no pool: the request never got one
