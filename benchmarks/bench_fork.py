"""What a client costs a process that forks, as a notebook's ``!cmd`` does for every command.

Each round starts ``/bin/true`` the way IPython starts a shell command (``pty.fork()``,
then ``exec``, then wait) in a process with no client, then in one with an idle client
of SQLite, then of a broker in another process, that has made one call. It prints the
median time per command beside the no-client figure, how often the SQLite file changed
across a fork (its size or modification time), and the time of the parent's next call
after a fork beside one after an idle pause as long as a fork (the parent reconnects to
SQLite then: no connection of its stays open across a fork). That a child which makes
no call touches no store is tested (tests/handle/test_fork_touches_nothing.py).

The file changes because closing the last connection of a WAL database checkpoints the
WAL into it (and removes the WAL). The script shows what that costs: the parent's
``os.fork()`` with its client the file's only user, beside the same while another
process keeps a connection open (no checkpoint then), in interleaved rounds.

    python benchmarks/bench_fork.py [--rounds N]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import pty
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from typing import Callable, Iterator, Optional

import queen_sync as qs


def run_true() -> None:
    """``!true``: fork with a terminal, exec, wait."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # a threaded parent, on 3.12+
        pid, terminal = pty.fork()
    if pid == 0:
        os.execv("/bin/true", ["true"])
    os.waitpid(pid, 0)
    os.close(terminal)


def timed_ms(step: Callable[[], object]) -> float:
    started = time.perf_counter()
    step()
    return (time.perf_counter() - started) * 1000


def file_look(path: str) -> tuple[int, int]:
    info = os.stat(path)
    return info.st_size, info.st_mtime_ns


class Figures:
    """One engine's samples, one per round."""

    def __init__(self) -> None:
        self.command: list[float] = []  # !true with an idle client
        self.call_after_fork: list[float] = []
        self.call_after_pause: list[float] = []
        self.file_changed = 0  # SQLite: forks across which the database file changed


def one_round(q: qs.Queen, figures: Figures, pause_s: float, path: Optional[str]) -> None:
    """Time one ``!true`` with ``q`` idle, and its next call after a fork and after a pause."""
    lease = q.lock("probe-written", ttl=60)
    lease.acquire()  # a write, as a renewal of a held lease is
    lease.release()
    before = file_look(path) if path else None
    figures.command.append(timed_ms(run_true))
    if path and file_look(path) != before:
        figures.file_changed += 1
    figures.call_after_fork.append(timed_ms(lambda: q.locks.get("probe")))
    time.sleep(pause_s)
    figures.call_after_pause.append(timed_ms(lambda: q.locks.get("probe")))


def report(label: str, figures: Figures, bare_ms: float, rounds: int) -> None:
    command = statistics.median(figures.command)
    after_fork = statistics.median(figures.call_after_fork)
    after_pause = statistics.median(figures.call_after_pause)
    line = (f"{label:<7} !true {command:6.2f} ms ({command / bare_ms:4.2f}x no client); "
            f"next call {after_fork:5.2f} ms after a fork, {after_pause:5.2f} ms after a "
            f"pause ({after_fork / after_pause:4.2f}x)")
    if label == "sqlite":
        line += f"; database file changed across {figures.file_changed / rounds:.0%} of forks"
    print(line)


@contextlib.contextmanager
def broker_elsewhere(path: str) -> Iterator[str]:
    """A LocalBroker in a process of its own, so its store is not this process's."""
    code = ("import sys; from queen_sync.testing import LocalBroker; "
            "b = LocalBroker(sys.argv[1]).start(); print(b.url, flush=True); sys.stdin.read()")
    proc = subprocess.Popen([sys.executable, "-c", code, path], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        yield proc.stdout.readline().strip()
    finally:
        proc.communicate(timeout=10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=60)
    rounds = parser.parse_args().rounds
    print(f"load average before: {os.getloadavg()}")
    bare: list[float] = []
    figures = {"sqlite": Figures(), "http": Figures()}
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "queen.db")
        with broker_elsewhere(os.path.join(folder, "broker.db")) as broker_url:
            urls = {"sqlite": "sqlite://" + path, "http": broker_url}
            # Interleaved: each round forks once with no client, then once beside each
            # engine's client, so a slow spell of the machine slows all alike. A client
            # closed is forgotten: no fork hook of queen_sync's runs for "no client".
            for _ in range(rounds):
                bare.append(timed_ms(run_true))
                for kind, url in urls.items():
                    with qs.Queen(url, renew_thread=False) as q:
                        one_round(q, figures[kind], bare[-1] / 1000,
                                  path if kind == "sqlite" else None)
    bare_ms = statistics.median(bare)
    print(f"no client !true {bare_ms:6.2f} ms (median of {rounds} rounds)")
    for kind, found in figures.items():
        report(kind, found, bare_ms, rounds)
    report_checkpoint_share(rounds)
    print(f"load average after: {os.getloadavg()}")


def fork_ms(q: qs.Queen, path: str) -> tuple[float, bool]:
    """One ``os.fork()`` in the parent after a write, and whether the file changed across it."""
    lease = q.lock("probe-written", ttl=60)
    lease.acquire()
    lease.release()
    before = file_look(path)
    started = time.perf_counter()
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    taken = (time.perf_counter() - started) * 1000
    os.waitpid(pid, 0)
    return taken, file_look(path) != before


@contextlib.contextmanager
def connection_elsewhere(path: str) -> Iterator[None]:
    """Another process with an idle connection open on ``path``, until the block ends."""
    code = ("import sqlite3, sys; c = sqlite3.connect(sys.argv[1]); "
            "c.execute('SELECT count(*) FROM queen_kv').fetchone(); print(flush=True); "
            "sys.stdin.read()")
    proc = subprocess.Popen([sys.executable, "-c", code, path], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        proc.stdout.readline()  # connected
        yield
    finally:
        proc.communicate(timeout=10)


def report_checkpoint_share(rounds: int) -> None:
    """The parent's fork as the file's only user (checkpoint) beside one with a neighbour."""
    alone: list[tuple[float, bool]] = []
    beside: list[tuple[float, bool]] = []
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "queen.db")
        with qs.Queen("sqlite://" + path, renew_thread=False) as q:
            for _ in range(max(1, rounds // 10)):  # interleaved: ten forks each way per round
                alone.extend(fork_ms(q, path) for _ in range(10))
                with connection_elsewhere(path):
                    beside.extend(fork_ms(q, path) for _ in range(10))
    alone_ms = statistics.median(t for t, _ in alone)
    beside_ms = statistics.median(t for t, _ in beside)
    print(f"sqlite  os.fork() {alone_ms:5.2f} ms as the file's only user (file changed across "
          f"{sum(c for _, c in alone) / len(alone):.0%} of forks), {beside_ms:5.2f} ms while "
          f"another process keeps a connection open ({sum(c for _, c in beside) / len(beside):.0%}"
          f"): the checkpoint on close costs {alone_ms - beside_ms:4.2f} ms per fork")


if __name__ == "__main__":
    main()
