"""A forked child that makes no call touches no store: no write, no connection, no request.

A notebook's ``!cmd`` forks the kernel for every command, and a worker pool forks for
every worker, so a client reconnects only at a child's first call. Each test runs
``fork_probe.py`` (a parent holding a lease) and looks at the store from outside while
the child exists and after it ends: SQLite's files, the broker's request count, and the
connections a counting proxy in front of PostgreSQL accepted.
"""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Callable, Iterator, NamedTuple

import pytest

from queen_sync.testing import LocalBroker

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")

PROBE = Path(__file__).with_name("fork_probe.py")
ROOT = PROBE.parents[2]
PATTERNS = ("os-exit", "interpreter-exit", "pty-exec")


class Store(NamedTuple):
    url: str
    look: Callable[[], object]  # what an outsider sees of the store; equal means untouched


class CountingProxy:
    """A TCP forwarder that counts the connections it accepts and those that ended.

    A session ends when either side hangs up: a child saying goodbye to the server on
    a socket inherited from its parent ends the parent's session.
    """

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.accepted = 0
        self.ended = 0
        self._mutex = threading.Lock()
        self._server = socket.create_server(("127.0.0.1", 0))
        self.port = self._server.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._server.accept()
            except OSError:
                return  # closed
            self.accepted += 1
            server = socket.create_connection(self.upstream)
            for source, sink in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while chunk := source.recv(65536):
                sink.sendall(chunk)
        except OSError:
            pass
        finally:
            with self._mutex:
                if sink.fileno() != -1:  # the first of the two pumps to stop counts it
                    self.ended += 1
                for end in (source, sink):
                    end.close()

    def look(self) -> tuple[int, int]:
        with self._mutex:
            return self.accepted, self.ended

    def close(self) -> None:
        self._server.close()


def _sqlite_files(path: Path) -> object:
    """Size and modification time of the database and its -wal and -shm, or None."""
    looks = []
    for name in (path, Path(f"{path}-wal"), Path(f"{path}-shm")):
        info = os.stat(name) if name.exists() else None
        looks.append(None if info is None else (info.st_size, info.st_mtime_ns))
    return looks


@pytest.fixture(params=["sqlite", "http", "postgres"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    if request.param == "sqlite":
        path = tmp_path / "queen.db"
        yield Store("sqlite://" + str(path), lambda: _sqlite_files(path))
    elif request.param == "http":
        with LocalBroker(str(tmp_path / "broker.db")) as broker:
            yield Store(broker.url, lambda: dict(broker.calls))
    else:
        url: str = request.getfixturevalue("pg_url")
        where = url.rsplit("@", 1)[1].split("/", 1)[0]
        host, port = where.rsplit(":", 1)
        proxy = CountingProxy((host, int(port)))
        proxied = url.replace(f"@{where}/", f"@127.0.0.1:{proxy.port}/")
        yield Store(f"{proxied}?schema=t_{secrets.token_hex(6)}", proxy.look)
        proxy.close()


class Probe:
    """The probe script, driven one step at a time."""

    def __init__(self, url: str, pattern: str) -> None:
        path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
        self._proc = subprocess.Popen(
            [sys.executable, str(PROBE), url, pattern], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=PROBE.parent,
            env={**os.environ, "PYTHONPATH": path})
        self.expect("ready")

    def step(self, what: str) -> str:
        assert self._proc.stdin is not None
        self._proc.stdin.write(what + "\n")
        self._proc.stdin.flush()
        return self._read()

    def expect(self, line: str) -> None:
        got = self._read()
        assert got == line, f"the probe said {got!r}, not {line!r}"

    def _read(self) -> str:
        assert self._proc.stdout is not None
        line = self._proc.stdout.readline().strip()
        if not line:
            pytest.fail(f"the probe stopped:\n{self.finish()[-3000:]}")
        return line

    def finish(self) -> str:
        """Let the probe end; returns what it wrote to stderr."""
        proc = self._proc
        if proc.returncode is not None:
            return ""
        _, errors = proc.communicate(timeout=30)
        return errors


@pytest.fixture
def probe_for(store: Store) -> Iterator[Callable[[str], Probe]]:
    probes: list[Probe] = []

    def start(pattern: str) -> Probe:
        probes.append(Probe(store.url, pattern))
        return probes[-1]

    yield start
    for probe in probes:
        probe.finish()


class TestAForkedChildThatMakesNoCall:
    @pytest.mark.parametrize("pattern", PATTERNS)
    def test_touches_the_store_neither_while_it_lives_nor_as_it_ends(
        self, store: Store, probe_for: Callable[[str], Probe], pattern: str
    ) -> None:
        probe = probe_for(pattern)
        assert probe.step("fork") == "forked"
        at_fork = store.look()
        reaped = probe.step("go")
        after = store.look()

        assert reaped == "reaped 0", f"the child ended badly: {reaped}"
        assert after == at_fork, (
            f"a child that made no call touched the store ({pattern}): {at_fork} -> {after}")

    def test_a_child_that_reads_once_is_seen_so_these_looks_can_fail(
        self, store: Store, probe_for: Callable[[str], Probe]
    ) -> None:
        probe = probe_for("one-read")
        assert probe.step("fork") == "forked"
        at_fork = store.look()
        probe.step("go")

        assert store.look() != at_fork, f"a child's read left no trace in the store: {at_fork}"

    def test_connects_at_its_first_call_and_that_call_works(
        self, store: Store, probe_for: Callable[[str], Probe]
    ) -> None:
        report = probe_for("os-exit").step("first-call")

        assert report == '{"took": true, "released": true}', (
            f"a forked child's first call did not work: {report}")
