"""A forked child's copy of a leading election holds nothing and tells nothing of the
parent's term: its own campaign, if started, begins from scratch."""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import time
import warnings
from typing import Any

import pytest

import queen_sync as qs
from queen_sync.recipes.leader_election import LeaderElection

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")


def _seen_in_the_child(election: LeaderElection, deposed: list[str]) -> dict[str, Any]:
    seen: dict[str, Any] = {
        "wait_elected(0)": election.wait_elected(0), "is_leader": election.is_leader,
        "health": dataclasses.asdict(election.health())}
    election.start()  # the handle's owner is the parent's: the campaign ends, saying why
    deadline = time.monotonic() + 5
    while election.health().campaigning and time.monotonic() < deadline:
        time.sleep(0.01)
    seen["deposed after start()"] = list(deposed)
    seen["wait_elected(0) after start()"] = election.wait_elected(0)
    return seen


def _fork_and_look(election: LeaderElection, deposed: list[str]) -> dict[str, Any]:
    read, write = os.pipe()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads
        pid = os.fork()
    if pid == 0:
        try:
            os.close(read)
            answer: dict[str, Any] = _seen_in_the_child(election, deposed)
        except BaseException as exc:  # the parent's assertion shows it
            answer = {"child failed": repr(exc)}
        os.write(write, json.dumps(answer).encode())
        os._exit(0)
    os.close(write)
    chunks = []
    while chunk := os.read(read, 65536):
        chunks.append(chunk)
    os.close(read)
    os.waitpid(pid, 0)
    seen: dict[str, Any] = json.loads(b"".join(chunks))
    return seen


class TestTheForkedChildOfALeader:
    def test_holds_nothing_reports_nothing_of_the_parents_term_and_calls_no_callback(
            self, client: qs.Queen) -> None:
        deposed: list[str] = []
        election = LeaderElection(client, f"election-{secrets.token_hex(4)}", ttl=30,
                                  on_deposed=deposed.append).start()
        assert election.wait_elected(5), "never elected"
        child = _fork_and_look(election, deposed)
        parent_leads = election.is_leader
        election.stop()

        fresh = {"leading": False, "token": None, "seconds_left": 0.0, "renewed_ago": None,
                 "renew_every": election.retry_every, "campaigning": False, "terms": 0,
                 "last_error": None}
        assert "child failed" not in child, child["child failed"]
        assert (child["wait_elected(0)"], child["is_leader"]) == (False, False), (
            f"the child believes it leads the parent's term: {child}")
        assert child["health"] == fresh, f"the child reports the parent's term: {child['health']}"
        assert child["deposed after start()"] == [], (
            f"the child ended the parent's term: on_deposed{child['deposed after start()']}")
        assert not child["wait_elected(0) after start()"], f"after start(): {child}"
        assert parent_leads and deposed == ["resigned"], (
            f"the parent's term was touched: leads={parent_leads}, deposed={deposed}")
