"""``FakeBroker``: the Queen routes in-process, through ``responses``, with injectable faults.

No socket is opened: while it runs, ``requests`` calls to its URL are answered by
the embedded engine on an SQLite file, and calls to any other URL fail.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Optional, Union

import requests
from urllib3.exceptions import MaxRetryError, NewConnectionError
from urllib3.exceptions import ProtocolError as Urllib3ProtocolError

from ._core import FAULT_KINDS, PATHS, BrokerTools, Fault, Reply

_Answer = Union[Exception, tuple[int, dict[str, str], bytes]]


class FakeBroker(BrokerTools):
    """An in-process, stateful Queen broker for tests, built on ``responses``.

    ```python
    with FakeBroker() as broker:
        q = broker.client()
        broker.faults.fail_next(2, status=503)   # the next two calls fail; locks retry
        assert q.lock("job", ttl=30).acquire()
    ```

    Args:
        url: the broker URL it answers for (no socket is opened).
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
        self._mock: Any = None

    @property
    def url(self) -> str:
        return self._url

    def start(self) -> FakeBroker:
        """Start answering (``requests`` is patched until ``stop``)."""
        import responses

        if self._mock is not None:
            return self
        self._core.open()
        mock = responses.RequestsMock(assert_all_requests_are_fired=False)
        for path in PATHS:
            for method in (responses.POST, responses.GET):
                mock.add_callback(method, self._url + path, callback=self._callback)
        mock.start()
        self._mock = mock
        return self

    def stop(self) -> None:
        """Stop answering and un-patch ``requests``."""
        mock, self._mock = self._mock, None
        if mock is not None:
            mock.stop()
            mock.reset()
        self._core.close()

    def _callback(self, request: requests.PreparedRequest) -> _Answer:
        path = "/" + (request.path_url or "").lstrip("/")
        method = request.method or "POST"
        raw = request.body if isinstance(request.body, bytes) else (request.body or "").encode()
        fault = self._core.faults.take(self._core.route_of(path))
        if fault is None or fault.kind == "delay":
            if fault is not None:
                time.sleep(fault.seconds)
            return _tuple(self._core.answer(method, path, dict(request.headers), raw))
        if fault.applied:
            self._core.answer(method, path, dict(request.headers), raw)
        if fault.kind == "status":
            return _tuple(fault.reply())
        return _transport_fault(fault, request.url or self._url)

    def __repr__(self) -> str:
        return f"<FakeBroker {self._url} {'running' if self._mock else 'stopped'}>"


def _tuple(reply: Reply) -> tuple[int, dict[str, str], bytes]:
    return reply.status, dict(reply.headers), reply.body


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
