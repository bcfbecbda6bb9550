"""A throwaway PostgreSQL server for tests and benchmarks.

``PgServer`` runs ``initdb`` and ``pg_ctl`` in a temporary directory, on a free
127.0.0.1 port, as an unprivileged user when run as root (PostgreSQL refuses to
run as root), and removes everything when stopped. The session fixture
``pg_url`` shares one server among all tests; fault tests that restart or stop
a server make their own with ``PgServer.start_new()``.

The binaries come from the system (PATH, then Debian's layout) or, failing that,
from the ``pgserver`` wheel in the test extra, so the README's test command needs
no system package. When none are found the tests skip, unless the environment
sets ``QUEEN_SYNC_REQUIRE_PG=1`` (CI does): then they fail.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import importlib.util
import os
import pwd
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from typing import Iterator, Optional, Sequence

import pytest

SUPERUSER = "queen"
_SYSTEM_USERS = ("postgres", "queen_sync_pg")
_shared: Optional[PgServer] = None
_shared_users = 0
_shared_mutex = threading.Lock()


def require_pg() -> bool:
    return os.environ.get("QUEEN_SYNC_REQUIRE_PG") == "1"


def missing(reason: str) -> None:
    """Skip, or fail when CI requires PostgreSQL."""
    if require_pg():
        pytest.fail(f"QUEEN_SYNC_REQUIRE_PG=1 but {reason}", pytrace=False)
    pytest.skip(reason)


def find_bin_dir() -> Optional[str]:
    """The folder holding ``initdb`` and ``pg_ctl``: ``QUEEN_SYNC_PG_BIN_DIR`` when set,
    else PATH, Debian's layout, then pgserver's."""
    chosen = os.environ.get("QUEEN_SYNC_PG_BIN_DIR")
    if chosen:
        return chosen
    initdb = shutil.which("initdb")
    if initdb and shutil.which("pg_ctl"):
        return os.path.dirname(os.path.realpath(initdb))
    candidates = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"),
                        key=lambda p: _version_key(p.split("/")[-3]), reverse=True)
    if candidates:
        return os.path.dirname(candidates[0])
    return bundled_bin_dir()


def bundled_bin_dir() -> Optional[str]:
    """The server binaries shipped in the ``pgserver`` wheel, None when it is not installed.

    As root the server runs as another user, who may not reach a ``site-packages``
    under ``/root``; the installation is then copied once to a shared folder.
    """
    spec = importlib.util.find_spec("pgserver")
    if spec is None or not spec.submodule_search_locations:
        return None
    package = next(iter(spec.submodule_search_locations))
    install = os.path.join(package, "pginstall")
    if not os.path.exists(os.path.join(install, "bin", "initdb")):
        return None
    if os.geteuid() != 0:
        return os.path.join(install, "bin")
    with open(os.path.join(install, "bin", "initdb"), "rb") as handle:
        digest = hashlib.sha256(handle.read()).hexdigest()[:12]
    shared = os.path.join("/tmp", f"queen_sync_pgserver_{digest}")
    if os.path.isdir(shared):
        found = os.lstat(shared)
        if found.st_uid != 0 or found.st_mode & 0o022:
            raise RuntimeError(f"{shared} is not root's alone: refusing to run binaries from it")
    else:
        # The binaries find their libraries at $ORIGIN/../../../pgserver.libs: keep that shape.
        staging = tempfile.mkdtemp(prefix="queen_sync_pgserver_", dir="/tmp")
        for part in ("bin", "lib", "share"):
            shutil.copytree(os.path.join(install, part),
                            os.path.join(staging, "pgserver", "pginstall", part))
        libs = os.path.join(os.path.dirname(package), "pgserver.libs")
        if os.path.isdir(libs):
            shutil.copytree(libs, os.path.join(staging, "pgserver.libs"))
        os.chmod(staging, 0o755)
        try:
            os.rename(staging, shared)
        except OSError:  # another test process published it first
            shutil.rmtree(staging, ignore_errors=True)
    return os.path.join(shared, "pgserver", "pginstall", "bin")


def _version_key(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(".") if part.isdigit())


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _unprivileged_user() -> Optional[str]:
    """None when not root; else a system user to run the server as (created if needed)."""
    if os.geteuid() != 0:
        return None
    for name in _SYSTEM_USERS:
        with contextlib.suppress(KeyError):
            pwd.getpwnam(name)
            return name
    subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/bin/sh",
                    _SYSTEM_USERS[-1]], check=True, capture_output=True)
    return _SYSTEM_USERS[-1]


class PgServer:
    """One PostgreSQL cluster in a temporary folder; ``url`` carries a real password."""

    def __init__(self, bin_dir: str, *, fsync: bool = False) -> None:
        self.bin_dir = bin_dir
        self.fsync = fsync
        self.user = _unprivileged_user()
        # The server's user must reach the folder: a root-only TMPDIR would not do.
        self.root = tempfile.mkdtemp(prefix="queen_sync_pg_",
                                     dir="/tmp" if self.user is not None else None)
        self.data = os.path.join(self.root, "data")
        self.log = os.path.join(self.root, "server.log")
        self.port = free_port()
        self.password = "pw-" + secrets.token_hex(8)
        if self.user is not None:
            entry = pwd.getpwnam(self.user)
            os.chown(self.root, entry.pw_uid, entry.pw_gid)
        os.chmod(self.root, 0o700)

    @classmethod
    def start_new(cls, *, fsync: bool = False, bin_dir: Optional[str] = None) -> PgServer:
        """Initialise and start a server, or skip/fail when PostgreSQL is not installed."""
        bin_dir = bin_dir or find_bin_dir()
        if bin_dir is None:
            missing("PostgreSQL server binaries (initdb, pg_ctl) were not found")
        assert bin_dir is not None
        server = cls(bin_dir, fsync=fsync)
        try:
            server.initdb()
            for attempt in range(3):
                try:
                    server.start()
                    break
                except RuntimeError:
                    if attempt == 2:
                        raise
                    server.port = free_port()  # another process took the port meanwhile
        except BaseException:
            server.destroy()
            raise
        return server

    @property
    def url(self) -> str:
        return f"postgresql://{SUPERUSER}:{self.password}@127.0.0.1:{self.port}/postgres"

    def _run(self, args: Sequence[str], *, check: bool = True) -> subprocess.CompletedProcess[str]:
        command = [os.path.join(self.bin_dir, args[0]), *args[1:]]
        if self.user is not None and shutil.which("runuser"):
            command = ["runuser", "-u", self.user, "--", *command]
        elif self.user is not None:
            command = ["su", "-s", "/bin/sh", self.user, "-c", shlex.join(command)]
        return subprocess.run(command, check=check, capture_output=True, text=True,
                              cwd=self.root, timeout=120)

    def initdb(self) -> None:
        pwfile = os.path.join(self.root, "pw")
        with open(pwfile, "w", encoding="utf-8") as handle:
            handle.write(self.password + "\n")
        if self.user is not None:
            entry = pwd.getpwnam(self.user)
            os.chown(pwfile, entry.pw_uid, entry.pw_gid)
        try:
            self._run(["initdb", "-D", self.data, "-U", SUPERUSER, "--pwfile", pwfile,
                       "--auth-local=trust", "--auth-host=scram-sha-256", "-E", "UTF8",
                       "--no-sync"])
        finally:
            os.unlink(pwfile)

    def start(self) -> None:
        durable = "on" if self.fsync else "off"
        options = (f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 "
                   f"-c max_connections=300 -c fsync={durable} -c full_page_writes={durable}")
        result = self._run(["pg_ctl", "-D", self.data, "-l", self.log, "-o", options,
                            "-w", "-t", "60", "start"], check=False)
        if result.returncode != 0:
            raise RuntimeError(f"pg_ctl start failed: {result.stderr}\n{self.server_log()}")

    def stop(self, mode: str = "fast") -> None:
        """Stop the server (``fast``: disconnect clients; ``immediate``: like a crash)."""
        self._run(["pg_ctl", "-D", self.data, "-m", mode, "-w", "-t", "60", "stop"],
                  check=False)

    def restart(self, mode: str = "fast") -> None:
        self.stop(mode)
        self.start()

    def server_log(self) -> str:
        with contextlib.suppress(OSError), open(self.log, encoding="utf-8") as handle:
            return handle.read()[-4000:]
        return ""

    def terminate_backends(self, application_name: str) -> int:
        """``pg_terminate_backend`` every session with this application name; how many."""
        import psycopg

        with psycopg.connect(self.url, autocommit=True) as conn:
            rows = conn.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                " WHERE application_name = %s AND pid <> pg_backend_pid()",
                (application_name,)).fetchall()
        return sum(1 for (done,) in rows if done)

    def destroy(self) -> None:
        """Stop the server if running and remove its folder."""
        if os.path.exists(os.path.join(self.data, "postmaster.pid")):
            self.stop("immediate")
        shutil.rmtree(self.root, ignore_errors=True)


@contextlib.contextmanager
def shared_server() -> Iterator[PgServer]:
    """The one server shared by every user in this process, stopped after the last one."""
    global _shared, _shared_users
    try:
        import psycopg  # noqa: F401
        import psycopg_pool  # noqa: F401
    except ImportError:
        missing("psycopg and psycopg_pool are not installed (pip install 'queen-sync[postgres]')")
    with _shared_mutex:
        if _shared is None:
            _shared = PgServer.start_new()
        _shared_users += 1
        server = _shared
    try:
        yield server
    finally:
        with _shared_mutex:
            _shared_users -= 1
            if _shared_users == 0 and _shared is not None:
                _shared.destroy()
                _shared = None


@pytest.fixture(scope="session")
def pg_server() -> Iterator[PgServer]:
    """The session's shared PostgreSQL server (do not stop or restart it: use your own)."""
    with shared_server() as server:
        yield server


@pytest.fixture(scope="session")
def pg_url(pg_server: PgServer) -> str:
    """URL of the session's shared PostgreSQL server, with a real password."""
    return pg_server.url


def _postmaster_pid(server: PgServer) -> int:
    with open(os.path.join(server.data, "postmaster.pid"), encoding="utf-8") as handle:
        return int(handle.readline())


def _stat_fields(pid: int) -> Optional[list[str]]:
    """The fields of ``/proc/PID/stat`` after the command name (None: no such process)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as handle:
            return handle.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _children(parent: int) -> list[int]:
    children = []
    for entry in os.listdir("/proc"):
        fields = _stat_fields(int(entry)) if entry.isdigit() else None
        if fields is not None and int(fields[1]) == parent:
            children.append(int(entry))
    return children


def server_pids(server: PgServer) -> list[int]:
    """The postmaster and every process it started (backends, checkpointer, ...)."""
    postmaster = _postmaster_pid(server)
    return [postmaster, *_children(postmaster)]


def _stop(pids: Sequence[int], timeout: float = 5.0) -> None:
    """SIGSTOP each process and wait until each is stopped or gone: the signal is delivered
    when the process next runs, not when ``kill`` returns."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):  # one that ended meanwhile
            os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout
    for pid in pids:
        while True:
            fields = _stat_fields(pid)
            if fields is None or fields[0] in "TtZX":
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"server process {pid} did not stop (state {fields[0]})")
            time.sleep(0.001)


@contextlib.contextmanager
def stopped(pids: Sequence[int], resume_after: Optional[float] = None) -> Iterator[None]:
    """These server processes stopped (the kernel still ACKs, they answer nothing), and
    always resumed; with ``resume_after``, also by a process of their own after that many
    seconds, so a client stuck with the GIL held cannot keep them stopped (and the test
    from failing)."""
    resumer = None
    try:
        _stop(pids)
        if resume_after is not None:
            resumer = subprocess.Popen(["sh", "-c", f"sleep {resume_after}; kill -CONT "
                                        f"{shlex.join(map(str, pids))} 2>/dev/null"])
        yield
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        if resumer is not None:
            resumer.kill()
            resumer.wait()


@contextlib.contextmanager
def frozen(server: PgServer) -> Iterator[None]:
    """Every process of ``server`` stopped: the postmaster first, so it forks no backend
    that a list of its children taken before would miss."""
    postmaster = _postmaster_pid(server)
    with stopped([postmaster]), stopped(_children(postmaster)):
        yield
