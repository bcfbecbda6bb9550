"""Supervision: a singleton job's status, published into KV for whoever watches the fleet.

Off by default. With ``@singleton_job(..., supervision="nightly")`` each call that
runs the body starts one thread that writes the job's status to the KV namespace
``queen-supervisor`` under ``<group>/<instance>`` at once and every 10 s with a
60 s lifetime, and a final ``stopped`` record when the body ends. Publishing is
best effort: a failed write is logged at debug level and never reaches the job,
and the final write waits at most 2 s. A record that stops being refreshed
expires, so a vanished instance disappears from listings by itself.

A record's value::

    {"group", "job", "instance", "host", "pid", "state": "running" | "stopped",
     "started", "last_completed" (epoch ms or null), "runs_ok", "runs_failed",
     "updated" (epoch ms)}
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from typing import TYPE_CHECKING, Any, Iterator, Optional

from .._ops import mint_owner

if TYPE_CHECKING:
    from .._client import Queen

log = logging.getLogger("queen_sync")

NAMESPACE = "queen-supervisor"
PUBLISH_EVERY = 10.0
RECORD_TTL_SECONDS = 60
DEADLINE = 2.0


def _now_ms() -> int:
    return int(time.time() * 1000)


class Supervisor:
    """One job's status in one process, and the thread that publishes it while the job runs."""

    def __init__(self, group: str, job: str) -> None:
        self.group = group
        self.job = job
        self.runs_ok = 0
        self.runs_failed = 0
        self.started: Optional[int] = None
        self.last_completed: Optional[int] = None
        self._instance = ""
        self._pid = -1

    @property
    def instance(self) -> str:
        """This process's instance id (a new one in a forked child)."""
        if self._pid != os.getpid():
            self._pid, self._instance = os.getpid(), mint_owner()
        return self._instance

    @property
    def key(self) -> str:
        return f"{self.group}/{self.instance}"

    def status(self, state: str) -> dict[str, Any]:
        return {
            "group": self.group, "job": self.job, "instance": self.instance,
            "host": socket.gethostname(), "pid": os.getpid(), "state": state,
            "started": self.started, "last_completed": self.last_completed,
            "runs_ok": self.runs_ok, "runs_failed": self.runs_failed, "updated": _now_ms(),
        }

    @contextlib.contextmanager
    def running(self, client: Queen) -> Iterator[None]:
        """Publish ``running`` now and every ``PUBLISH_EVERY`` s, then one ``stopped`` record."""
        self.started = _now_ms()
        stop = threading.Event()
        thread = threading.Thread(target=self._loop, args=(client, stop),
                                  name="queen_sync-supervisor", daemon=True)
        thread.start()
        ok = False
        try:
            yield
            ok = True
        finally:
            if ok:
                self.runs_ok += 1
                self.last_completed = _now_ms()
            else:
                self.runs_failed += 1
            stop.set()
            thread.join(DEADLINE)
            self._publish_bounded(client, "stopped")

    def _loop(self, client: Queen, stop: threading.Event) -> None:
        while True:
            self._publish(client, "running")
            if stop.wait(PUBLISH_EVERY):
                return

    def _publish(self, client: Queen, state: str) -> None:
        try:
            client.kv.put(NAMESPACE, self.key, self.status(state),
                          ttl_seconds=RECORD_TTL_SECONDS)
        except Exception as exc:
            log.debug("supervision: could not publish %s for job %r: %s", state, self.job, exc)

    def _publish_bounded(self, client: Queen, state: str) -> None:
        worker = threading.Thread(target=self._publish, args=(client, state),
                                  name="queen_sync-supervisor", daemon=True)
        worker.start()
        worker.join(DEADLINE)
