"""``LocalBroker``: the Queen routes over a real socket on 127.0.0.1, from an SQLite file.

A test and demo tool, not a production broker: one process, one file, a thread
per connection, TLS only when a test hands it a context. It exists so tests
cross a real socket, stop and restart "the broker" (same port, same file: tokens
keep rising), and run several client processes against one store.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import struct
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any, Callable, Optional

from ._core import BrokerCore, BrokerStopped, BrokerTools, Fault, Reply

if TYPE_CHECKING:
    import ssl

log = logging.getLogger("queen_sync")

LOCAL_FAULTS = ("status", "timeout", "reset", "delay")


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, port: int, core: BrokerCore, tls: Optional[ssl.SSLContext]) -> None:
        self.core = core
        self._open: set[socket.socket] = set()
        self._open_lock = threading.Lock()
        super().__init__(("127.0.0.1", port), _Handler)
        if tls is not None:
            # The handshake happens on the connection's first read, in its own thread,
            # so a client that never completes one cannot stall the accept loop.
            self.socket = tls.wrap_socket(self.socket, server_side=True,
                                          do_handshake_on_connect=False)

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._open_lock:
            self._open.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request: Any) -> None:
        with self._open_lock:
            self._open.discard(request)
        super().shutdown_request(request)

    def drop_connections(self) -> None:
        """Cut every open connection, so a stopped broker answers nobody."""
        with self._open_lock:
            sockets, self._open = list(self._open), set()
        for sock in sockets:
            with contextlib.suppress(OSError):  # already closed by its peer
                sock.shutdown(socket.SHUT_RDWR)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body go out as two writes: no 40 ms stall
    server: _Server

    def do_POST(self) -> None:
        self._serve("POST")

    def do_GET(self) -> None:
        self._serve("GET")

    def _serve(self, method: str) -> None:
        raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        core = self.server.core
        fault = core.faults.take(core.route_of(self.path))
        if fault is not None and fault.kind != "delay":
            self._fault(fault, method, raw)
            return
        if fault is not None:
            time.sleep(fault.seconds)
        self._reply(self._answer(method, raw))

    def _answer(self, method: str, raw: bytes) -> Optional[Reply]:
        try:
            return self.server.core.answer(method, self.path, dict(self.headers), raw)
        except BrokerStopped:  # stopped while this request was in flight
            return None

    def _fault(self, fault: Fault, method: str, raw: bytes) -> None:
        if fault.applied:
            self._answer(method, raw)
        if fault.kind == "status":
            self._reply(fault.reply())
            return
        if fault.kind == "timeout":
            time.sleep(fault.seconds)
        else:  # reset: abort the connection so the peer sees a reset, not a clean close
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                                       struct.pack("ii", 1, 0))
        self.close_connection = True

    def _reply(self, reply: Optional[Reply]) -> None:
        if reply is None:
            self.close_connection = True
            return
        self.send_response(reply.status)
        for name, value in reply.headers.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(reply.body)))
        self.end_headers()
        self.wfile.write(reply.body)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("local broker: " + format, *args)


class LocalBroker(BrokerTools):
    """A real HTTP server on 127.0.0.1 answering the Queen routes from an SQLite file.

    ```python
    with LocalBroker() as broker:            # an ephemeral port and a fresh file
        with Queen(broker.url) as q:
            assert q.lock("job", ttl=30).acquire()
        broker.stop()                        # clients now get connection refused
        broker.start()                       # same port, same file
    ```

    For tests and demos only: not a production broker.

    Args:
        path: the SQLite file (kept after ``close``); None: a temporary one (removed).
        port: the port to listen on; 0 picks a free one (kept across restarts).
        token: when given, calls must carry ``Authorization: Bearer <token>``.
        tls: a server-side ``ssl.SSLContext``; the broker then serves ``https://``
            (clients trust its certificate with ``verify="ca.pem"``).
        clock: the epoch-seconds clock the store judges expiry by (default
            ``time.time``); a test advances it past a TTL instead of sleeping.
    """

    def __init__(self, path: Optional[str] = None, *, port: int = 0,
                 token: Optional[str] = None, tls: Optional[ssl.SSLContext] = None,
                 clock: Callable[[], float] = time.time) -> None:
        # Checked before the base makes a temporary folder a refusal would leak.
        if isinstance(port, bool) or not isinstance(port, int):
            raise TypeError(f"port must be an int, got {type(port).__name__}")
        if not 0 <= port <= 65535:
            raise ValueError(f"port must be within 0..65535 (0: a free one), got {port}")
        super().__init__(path, token=token, kinds=LOCAL_FAULTS, prefix="queen-local-broker-",
                         clock=clock)
        self._port = port
        self._tls = tls
        self._server: Optional[_Server] = None
        self._thread: Optional[threading.Thread] = None

    @property
    def url(self) -> str:
        """``http(s)://127.0.0.1:PORT``; the port stays the same across ``stop``/``start``.

        Raises:
            RuntimeError: the broker was never started, so it has no port yet.
        """
        if not self._port:
            raise RuntimeError("the broker has not been started yet")
        scheme = "http" if self._tls is None else "https"
        return f"{scheme}://127.0.0.1:{self._port}"

    @property
    def running(self) -> bool:
        """True between ``start`` and ``stop``: the port answers."""
        return self._server is not None

    def start(self) -> LocalBroker:
        """Listen (again) on the same port, serving the same file."""
        if self._server is not None:
            return self
        self._refuse_if_removed()
        self._core.open()
        try:
            self._server = _Server(self._port, self._core, self._tls)
        except BaseException:
            self._core.close()  # the port is taken, say: nothing is left open
            raise
        self._port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        kwargs={"poll_interval": 0.05},
                                        name=f"queen-local-broker-{self._port}", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop answering: the port is closed and every open connection is cut."""
        server, self._server = self._server, None
        if server is None:
            return
        server.shutdown()
        server.server_close()
        server.drop_connections()
        if self._thread is not None:
            self._thread.join(5)
        self._core.close()

    def __repr__(self) -> str:
        state = f"on {self.url}" if self.running else "stopped"
        return f"<LocalBroker {state} file={self.path}>"
