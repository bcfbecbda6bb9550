"""Another user who may create files beside the database (a sticky shared folder such as
/tmp) must never get a client onto a store of that user's making.

SQLite opens ``-wal``, ``-shm`` and ``-journal`` by name, creating them when missing, and
reads what it finds: a log another user planted there, even after every check the client
made, would be taken for the store's own. Run as root, acting as a second user.
"""

from __future__ import annotations

import os
import pwd
import shutil
import sqlite3
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

import queen_sync as qs
import queen_sync._engines.sqlite as sqlite_engine

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None,
    reason="needs root (and setpriv) to act as a second user")

OTHER_USER = "rt1user"


def _other_user() -> pwd.struct_passwd:
    try:
        return pwd.getpwnam(OTHER_USER)
    except KeyError:
        subprocess.run(["useradd", "-M", OTHER_USER], check=True)
        return pwd.getpwnam(OTHER_USER)


def _as(user: pwd.struct_passwd, *argv: str, check: bool = True) -> bool:
    """Run ``argv`` as ``user``; whether it succeeded."""
    done = subprocess.run(["setpriv", f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}",
                           "--clear-groups", *argv], env={}, capture_output=True, check=check)
    return done.returncode == 0


def _made_by(user: pwd.struct_passwd, folder: Path, script: str) -> None:
    """Run the Python ``script`` as ``user`` in ``folder`` (theirs); ``SCHEMA`` is the store's."""
    folder.mkdir()
    os.chown(folder, user.pw_uid, user.pw_gid)
    prelude = f"import os, shutil, sqlite3\nos.chdir({str(folder)!r})\n"
    prelude += f"SCHEMA = {sqlite_engine._SCHEMA!r}\n"
    _as(user, sys.executable, "-c", prelude + script)


def _planted_wal(user: pwd.struct_passwd, folder: Path) -> Path:
    """A -wal made by ``user``, holding a fresh store of its own (every page, counter 0)."""
    _made_by(user, folder, (
        "c = sqlite3.connect('b.db', isolation_level=None)\n"
        "c.execute('PRAGMA journal_mode=WAL'); c.execute('PRAGMA wal_autocheckpoint=0')\n"
        "c.executescript('BEGIN IMMEDIATE;' + SCHEMA + 'COMMIT;')\n"
        "shutil.copy('b.db-wal', 'planted'); os.chmod('planted', 0o644)\n"))
    return folder / "planted"


def _planted_journal(user: pwd.struct_passwd, folder: Path) -> Path:
    """A hot rollback journal made by ``user``: replayed, it sets the counter back to 0."""
    _made_by(user, folder, (
        "c = sqlite3.connect('b.db', isolation_level=None)\n"
        "c.executescript(SCHEMA)\n"
        "c.execute('PRAGMA synchronous=OFF')  # the journal then counts its own records\n"
        "c.execute('BEGIN IMMEDIATE')\n"
        "c.execute(\"UPDATE queen_meta SET value = 99 WHERE name = 'version'\")\n"
        "shutil.copy('b.db-journal', 'planted'); os.chmod('planted', 0o644)\n"
        "os._exit(0)\n"))
    return folder / "planted"


def _counter_in_file(db: Path) -> int:
    """The version counter the database FILE holds, whatever lies beside it."""
    conn = sqlite3.connect(f"file:{db}?mode=ro&immutable=1", uri=True)
    try:
        return int(conn.execute("SELECT value FROM queen_meta WHERE name = 'version'")
                   .fetchone()[0])
    finally:
        conn.close()


def _neighbour_closes_last(db: Path) -> None:
    """A process of ours opens the store, reads, and closes: alone, SQLite then deletes the
    -wal and -shm, and the names are free again."""
    subprocess.run([sys.executable, "-c", (
        "import sqlite3, sys\nc = sqlite3.connect(sys.argv[1])\n"
        "c.execute('SELECT count(*) FROM queen_kv').fetchone()\nc.close()\n"), str(db)],
        check=True)


def _issue_tokens(db: Path, count: int) -> int:
    """Take and release ``x`` ``count`` times; the highest token issued."""
    highest = 0
    with qs.Queen(f"sqlite://{db}", renew_thread=False) as q:
        for _ in range(count):
            lock = q.lock("x", ttl=60)
            assert lock.acquire(), "nobody else holds x"
            highest = int(lock.token or 0)
            lock.release()
    return highest


def _next_token_or_refusal(db: Path) -> Any:
    """The token a new client gets for ``x``, or the error refusing it."""
    try:
        with qs.Queen(f"sqlite://{db}", renew_thread=False) as q:
            lock = q.lock("x", ttl=60)
            assert lock.acquire(), "nobody else holds x"
            token = lock.token
            lock.release()
            return token
    except qs.QueenError as exc:
        return exc


@pytest.fixture
def shared_folder() -> Iterator[Path]:
    """A sticky, world-writable folder like /tmp, inside one the other user may enter."""
    top = Path(tempfile.mkdtemp(prefix="qs-planted-", dir="/tmp"))
    top.chmod(0o755)
    (top / "shared").mkdir()
    (top / "shared").chmod(0o1777)
    yield top / "shared"
    shutil.rmtree(top, ignore_errors=True)


WINDOWS: dict[str, Callable[[Path, Path, pwd.struct_passwd], None]] = {
    "the other user plants a -wal": lambda db, planted, user: None,
    "a neighbour of ours closes the store last, then the other user plants a -wal":
        lambda db, planted, user: _neighbour_closes_last(db),
}


class TestAWalPlantedBetweenTheChecksAndSqlitesOpen:
    @pytest.mark.parametrize("window", sorted(WINDOWS))
    def test_a_client_never_runs_on_nor_checkpoints_a_wal_another_user_planted(
        self, shared_folder: Path, monkeypatch: pytest.MonkeyPatch, window: str
    ) -> None:
        other = _other_user()
        db = shared_folder / "q.db"
        highest = _issue_tokens(db, 5)
        planted = _planted_wal(other, shared_folder.parent / "other")
        real_open = sqlite_engine.SqliteStorage._open
        attempts: list[bool] = []

        def other_user_races_in(self: sqlite_engine.SqliteStorage) -> sqlite3.Connection:
            # The latest moment: every check of the client is done, SQLite opens next.
            WINDOWS[window](db, planted, other)
            attempts.append(_as(other, "ln", str(planted), f"{db}-wal", check=False))
            return real_open(self)

        monkeypatch.setattr(sqlite_engine.SqliteStorage, "_open", other_user_races_in)
        answer = _next_token_or_refusal(db)
        assert attempts, "the race was never run"
        assert isinstance(answer, qs.QueenError) or answer > highest, (
            f"the client ran on the other user's store: token {answer} after {highest} "
            f"was already issued for x")
        assert _counter_in_file(db) >= highest, (
            f"the other user's -wal was written into the database file: its counter is "
            f"{_counter_in_file(db)}, {highest} tokens were issued")
        monkeypatch.undo()
        after = _next_token_or_refusal(db)
        assert isinstance(after, qs.QueenError) or after > highest, (
            f"the next client ran on the other user's store: token {after} after {highest}")


class TestAJournalPlantedBesideAnIdleStore:
    @pytest.mark.parametrize("removed_first", [False, True],
                             ids=["as the store was left", "after an operator removed its journal"])
    def test_a_hot_journal_another_user_left_is_never_replayed(
        self, shared_folder: Path, removed_first: bool
    ) -> None:
        other = _other_user()
        db = shared_folder / "q.db"
        highest = _issue_tokens(db, 5)
        planted = _planted_journal(other, shared_folder.parent / "other")
        if removed_first:
            Path(f"{db}-journal").unlink(missing_ok=True)
        landed = _as(other, "cp", str(planted), f"{db}-journal", check=False)
        answer = _next_token_or_refusal(db)
        if landed:
            assert isinstance(answer, qs.UnsupportedOperationError), (
                f"a client opened a store beside another user's journal: {answer!r}")
            assert f"{db}-journal" in str(answer), f"the error must name the journal: {answer}"
        else:
            assert not isinstance(answer, Exception) and answer > highest, (
                f"the journal could not be planted, yet the client got {answer!r} after "
                f"{highest} tokens")
        assert _counter_in_file(db) >= highest, (
            f"the other user's journal was replayed into the database file: its counter is "
            f"{_counter_in_file(db)}, {highest} tokens were issued")


RACE_ROUNDS = int(os.environ.get("QUEEN_SYNC_PLANTED_WAL_ROUNDS", "40"))
_RACER = """
import os, sys
planted, target, stop = sys.argv[1:4]
while not os.path.exists(stop):
    for step in (lambda: os.link(planted, target), lambda: os.unlink(target)):
        try:
            step()
        except OSError:
            pass
"""


class TestAUserRacingAWalInAndOut:
    def test_never_gets_a_client_onto_it_nor_into_the_database_file(
        self, shared_folder: Path
    ) -> None:
        other = _other_user()
        db = shared_folder / "q.db"
        highest = _issue_tokens(db, 5)
        planted = _planted_wal(other, shared_folder.parent / "other")
        stop = shared_folder.parent / "other" / "stop"
        racer = subprocess.Popen(
            ["setpriv", f"--reuid={other.pw_uid}", f"--regid={other.pw_gid}", "--clear-groups",
             sys.executable, "-c", _RACER, str(planted), f"{db}-wal", str(stop)], env={})
        answers: list[Any] = []
        try:
            for _ in range(RACE_ROUNDS):  # real opens, no simulation: the racer picks its moments
                answers.append(_next_token_or_refusal(db))
        finally:
            stop.touch()
            racer.wait(10)
        tokens = [a for a in answers if not isinstance(a, Exception)]
        assert all(isinstance(a, qs.QueenError) for a in answers if a not in tokens), answers
        assert tokens == sorted(tokens) and all(t > highest for t in tokens), (
            f"a client ran on the other user's store: tokens {tokens} after {highest}")
        assert len(set(tokens)) == len(tokens), f"a token was issued twice: {tokens}"
        assert _counter_in_file(db) >= max(tokens, default=highest), (
            f"the other user's -wal reached the database file: counter {_counter_in_file(db)}")
