"""Cross-process wake-up on release for the SQLite engine.

A waiter binds a Unix datagram socket in a folder private to this user and
database; a process that frees a permit sends one byte to every socket bound for
that lock name. That turns a hand-off into a wake-up instead of a poll period,
while waiters still time out and retry, so a lost datagram only costs latency.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
import socket
import tempfile
from typing import Iterator, Optional, Sequence


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


class _SocketWaiter:
    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock

    def wait(self, timeout: float) -> bool:
        self._sock.settimeout(max(timeout, 0.0005))
        try:
            self._sock.recv(16)
        except (socket.timeout, BlockingIOError):
            return False
        self._sock.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            while self._sock.recv(16):
                pass
        return True


class WakeChannel:
    """Wake-ups keyed by lock name among the processes sharing one database file."""

    supported = hasattr(socket, "AF_UNIX")

    def __init__(self, db_path: str) -> None:
        base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
        self.folder = os.path.join(base, f"queen_sync-{os.getuid()}", _digest(db_path))
        self._sender: Optional[socket.socket] = None
        self._sender_pid = 0

    @contextlib.contextmanager
    def subscribe(self, name: str) -> Iterator[_SocketWaiter]:
        os.makedirs(self.folder, mode=0o700, exist_ok=True)
        path = os.path.join(self.folder, f"{_digest(name)}.{os.getpid()}.{secrets.token_hex(4)}")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            sock.bind(path)
            yield _SocketWaiter(sock)
        finally:
            sock.close()
            with contextlib.suppress(OSError):
                os.unlink(path)

    def notify(self, names: Sequence[str]) -> None:
        try:
            entries = list(os.scandir(self.folder))
        except OSError:
            return  # nobody has ever waited on this database
        prefixes = tuple(f"{_digest(n)}." for n in names)
        for entry in entries:
            if entry.name.startswith(prefixes):
                self._send(entry.path)

    def _send(self, path: str) -> None:
        sender = self._sender_socket()
        try:
            sender.sendto(b"!", path)
        except (ConnectionRefusedError, FileNotFoundError):
            with contextlib.suppress(OSError):
                os.unlink(path)  # a waiter that died without cleaning up
        except OSError:
            pass  # its queue is full: it is awake already

    def _sender_socket(self) -> socket.socket:
        if self._sender is None or self._sender_pid != os.getpid():
            self._sender = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            self._sender.setblocking(False)
            self._sender_pid = os.getpid()
        return self._sender

    def close(self) -> None:
        if self._sender is not None and self._sender_pid == os.getpid():
            self._sender.close()
        self._sender = None
