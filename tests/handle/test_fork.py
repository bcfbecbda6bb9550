"""A handle inherited through ``os.fork()`` is a different holder in the child."""

from __future__ import annotations

import errno
import json
import os
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

import queen_sync as qs
from queen_sync._engines.sqlite import SqliteEngine

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")


@pytest.fixture
def q(sqlite_url: str) -> Iterator[qs.Queen]:
    # No renewer thread: forking a process with threads is deprecated on Python 3.12+.
    client = qs.Queen(sqlite_url, renew_thread=False)
    yield client
    client.close()


def fork_child(work: Callable[[], dict[str, Any]]) -> tuple[dict[str, Any], Callable[[], None]]:
    """Fork; the child runs ``work``, reports its answer, and exits when told to.

    Returns the child's report and the function that lets it exit (and reaps it), so the
    parent can look while the child still holds whatever it took.
    """
    report_r, report_w = os.pipe()
    go_r, go_w = os.pipe()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # forking a multi-threaded process
        pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child
        try:
            report = work()
        except BaseException as exc:  # the parent must see it, not hang
            report = {"error": repr(exc)}
        os.write(report_w, json.dumps(report, default=str).encode() + b"\n")
        os.read(go_r, 1)
        os._exit(0)
    os.close(report_w)
    os.close(go_r)
    with os.fdopen(report_r) as reader:
        line = reader.readline()

    def finish() -> None:
        os.write(go_w, b"x")
        os.close(go_w)
        os.waitpid(pid, 0)

    return (json.loads(line) if line else {"error": "the child reported nothing"}), finish


def guarded_put(q: qs.Queen, lock: qs.Lock, key: str, value: str) -> bool:
    return bool(q.transaction().guard(lock).kv.put("ns", key, value, forever=True).commit())


class TestForkedChild:
    def test_a_child_cannot_enter_the_block_its_parent_is_inside(self, q: qs.Queen) -> None:
        lock = q.lock("job", ttl=30)
        with lock:
            parent_owner = lock.owner

            def child() -> dict[str, Any]:
                report: dict[str, Any] = {"held_at_fork": lock.held}
                try:
                    with lock:
                        report["entered"] = True
                        report["wrote"] = guarded_put(q, lock, "k", "child")
                except qs.LockNotHeldError as exc:
                    report["entered"] = False
                    report["holders"] = [h.owner for h in exc.holders]
                lock.__exit__(None, None, None)  # the child leaves the inherited block
                report["released"] = lock.release()
                report["owner"] = lock.owner
                return report

            report, finish = fork_child(child)
            finish()
            assert "error" not in report, report
            assert not report["held_at_fork"], f"the child believes it holds: {report}"
            assert report["entered"] is False, f"the child got into the parent's lease: {report}"
            assert report["holders"] == [parent_owner], report
            assert report["owner"] != parent_owner, "the child kept the parent's owner"
            assert not report["released"], f"the child's exit released something: {report}"
            assert lock.held and guarded_put(q, lock, "k", "parent"), (
                "the parent's guarded write must still commit after the child left")
            assert [h["owner"] for h in q.locks.get("job")["holders"]] == [parent_owner], (
                "the child's exit gave away the parent's permit")

    def test_a_handle_not_held_at_fork_gets_a_fresh_owner_in_the_child(
        self, q: qs.Queen
    ) -> None:
        lock = q.lock("job", ttl=30)
        parent_owner = lock.owner

        def child() -> dict[str, Any]:
            took = lock.acquire()
            return {"took": took, "owner": lock.owner}

        report, finish = fork_child(child)
        try:
            assert report.get("took") is True, report
            assert report["owner"] != parent_owner, "the child kept the parent's owner"
            assert not lock.acquire(), "the parent got in while its child holds the lease"
            assert [h.owner for h in lock.holders] == [report["owner"]], lock.holders
        finally:
            finish()

    def test_a_handle_given_an_owner_is_refused_in_a_forked_child(self, q: qs.Queen) -> None:
        lock = q.lock("job", ttl=30, owner="worker-a")

        def child() -> dict[str, Any]:
            try:
                lock.acquire()
            except qs.LockError as exc:
                return {"refused": str(exc), "type": type(exc).__name__}
            return {"refused": None, "held": lock.held}

        report, finish = fork_child(child)
        finish()
        assert report.get("refused"), f"an inherited owner= acquired in the child: {report}"
        assert "fork" in report["refused"] and "worker-a" in report["refused"], report
        assert lock.acquire(), "the parent must still be able to use its handle"
        lock.release()


class _EngineOutOfDescriptorsAtFork(SqliteEngine):
    """An SQLite engine whose fork hook fails as one does in a process out of descriptors."""

    def after_fork(self) -> None:
        super().after_fork()
        raise OSError(errno.EMFILE, "Too many open files")


class TestAFailingForkHook:
    def test_a_client_whose_fork_hook_fails_does_not_leave_the_next_client_holding(
        self, tmp_path: Path, sqlite_url: str
    ) -> None:
        failing = qs.Queen(engine=_EngineOutOfDescriptorsAtFork.from_url(
            "sqlite://" + str(tmp_path / "other.db")), renew_thread=False)
        q = qs.Queen(sqlite_url, renew_thread=False)
        lock = q.lock("job", ttl=30)
        assert lock.acquire()

        def child() -> dict[str, Any]:
            report: dict[str, Any] = {"held": lock.held, "token": lock.token}
            try:
                report["guard"] = lock.guard()
            except qs.LockNotHeldError:
                report["guard"] = None
            try:
                report["wrote"] = guarded_put(q, lock, "k", "child")
            except qs.LockNotHeldError:
                report["wrote"] = False
            return report

        try:
            report, finish = fork_child(child)
            finish()
            assert "error" not in report, report
            assert report == {"held": False, "token": None, "guard": None, "wrote": False}, (
                f"another client's failed fork hook left this one holding in the child, "
                f"with the parent's token: {report}")
            assert lock.held, "the parent lost its lease"
        finally:
            lock.release()
            q.close()
            failing.close()
