"""Guarded transactions every engine keeps: atomic, guards first, failures returned."""

from __future__ import annotations

import itertools
import os
import threading
from typing import Any, Callable, Mapping

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import queen_sync as qs
from queen_sync.testing import FaultyEngine

_NAMESPACES = itertools.count()
Adder = Callable[[qs.Transaction, str], qs.Transaction]

# One op of each kind that a bundle can carry, each set up to lose, and the reason it loses
# with: a required one of them must roll back whatever is around it.
LOSING: dict[str, tuple[Adder, str]] = {
    "put with a stale expect": (
        lambda t, ns: t.kv.put(ns, "seed", 2, forever=True, expect=10**9, required=True),
        "version"),
    "put that must not find a present key": (
        lambda t, ns: t.kv.put(ns, "seed", 2, forever=True, expect=0, required=True), "exists"),
    "putIfAbsent on a present key": (
        lambda t, ns: t.kv.put_if_absent(ns, "seed", 2, forever=True, required=True), "exists"),
    "delete of an absent key": (
        lambda t, ns: t.kv.delete(ns, "nothing", required=True), "absent"),
    "incr past its max": (
        lambda t, ns: t.kv.incr(ns, "seed", delta=5, max=3, forever=True, required=True),
        "limit"),
    "check of a stale version": (
        lambda t, ns: t.kv.check(ns, "seed", expect=10**9, required=True), "version"),
    "check for absence of a present key": (
        lambda t, ns: t.kv.check(ns, "seed", expect=0, required=True), "exists"),
}
# The writes around it leave "seed" alone, so the op set up to lose does lose.
_WRITES = st.lists(st.tuples(st.sampled_from(["put", "incr", "delete"]),
                             st.sampled_from(["k0", "k1"])), max_size=4)


def _add_write(txn: qs.Transaction, ns: str, kind: str, key: str) -> qs.Transaction:
    if kind == "put":
        return txn.kv.put(ns, key, "new", forever=True)
    if kind == "incr":
        return txn.kv.incr(ns, key, forever=True)
    return txn.kv.delete(ns, key)


class TestBundles:
    def test_a_guarded_bundle_applies_every_write(self, q: qs.Queen) -> None:
        lock = q.lock("job", ttl=30)
        assert lock.acquire()
        answer = (q.transaction().guard(lock)
                  .kv.put("out", "a", 1, forever=True)
                  .kv.incr("out", "n", forever=True)
                  .commit())
        assert answer and answer["success"] is True, answer
        assert q.kv.get("out", "a")["value"] == 1 and q.kv.get("out", "n")["value"] == 1
        lock.release()

    def test_a_lost_required_op_rolls_the_whole_bundle_back(self, q: qs.Queen) -> None:
        q.kv.put("out", "taken", "x", forever=True)
        answer = (q.transaction()
                  .kv.put("out", "a", 1, forever=True)
                  .kv.put_if_absent("out", "taken", "y", forever=True, required=True)
                  .commit())
        assert not answer and answer["reason"] == "kv_precondition", answer
        assert answer["failedIndex"] == 1 and answer["kvReason"] == "exists", answer
        assert answer["value"] == "x" and answer["version"] > 0, answer
        assert not q.kv.get("out", "a"), "the earlier write must be rolled back"

    def test_a_lost_optional_op_does_not_roll_back_the_others(self, q: qs.Queen) -> None:
        q.kv.put("out", "taken", "x", forever=True)
        answer = (q.transaction()
                  .kv.put("out", "a", 1, forever=True)
                  .kv.put_if_absent("out", "taken", "y", forever=True)
                  .commit())
        assert answer, answer
        assert q.kv.get("out", "a")["value"] == 1

    def test_once_commits_the_first_time_only(self, q: qs.Queen) -> None:
        first = q.transaction().once("runs", "2026-11-30", ttl="1d").commit()
        second = q.transaction().once("runs", "2026-11-30", ttl="1d").commit()
        assert first and not second and second["kvReason"] == "exists", (first, second)

    @settings(max_examples=20, deadline=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(kind=st.sampled_from(sorted(LOSING)), before=_WRITES, after=_WRITES)
    def test_any_required_op_that_loses_rolls_back_the_writes_around_it(
        self, q: qs.Queen, kind: str, before: list[tuple[str, str]],
        after: list[tuple[str, str]],
    ) -> None:
        ns = f"req{next(_NAMESPACES)}"
        seed = q.kv.put(ns, "seed", 1, forever=True)
        txn = q.transaction()
        for spec in before:
            _add_write(txn, ns, *spec)
        add, reason = LOSING[kind]
        add(txn, ns)
        for spec in after:
            _add_write(txn, ns, *spec)
        answer = txn.commit()
        assert not answer and answer["reason"] == "kv_precondition", answer
        assert answer["failedIndex"] == len(before) and answer["kvReason"] == reason, (
            f"{kind}: {answer}")
        rows = [(r["key"], r["value"], r["version"])
                for r in q.kv.get_many(ns, ["k0", "k1", "seed"])["rows"]]
        assert rows == [("seed", 1, seed["version"])], f"{kind} left writes behind: {rows}"

    def test_a_prefix_read_inside_a_bundle_is_refused(self, q: qs.Queen) -> None:
        with pytest.raises(ValueError, match="inside a transaction"):
            q.transaction().kv.get_prefix("out", "a")
        raw = {"kv": [{"op": "put", "ns": "out", "key": "a", "value": 1, "forever": True},
                      {"op": "getPrefix", "ns": "out", "prefix": "a"}]}
        with pytest.raises(qs.RequestError, match="getPrefix"):
            q.engine.call("transaction", raw)
        assert not q.kv.get("out", "a"), "a refused bundle writes nothing"



def _lose_on(txn: qs.Transaction, ns: str, kind: str, key: str) -> qs.Transaction:
    """A required op on ``key`` that loses to what the bundle did before it, or to the store
    (a "must be absent" op where the key is present; the stale ones always)."""
    if kind == "put stale":
        return txn.kv.put(ns, key, "late", forever=True, expect=10**9, required=True)
    if kind == "putIfAbsent":
        return txn.kv.put_if_absent(ns, key, "late", forever=True, required=True)
    return txn.kv.check(ns, key, expect=0 if kind == "check absent" else 10**9, required=True)


class TestRolledBackBundleAnswers:
    """A rolled-back bundle reports the failed op's key as committed, never a row it undid."""

    def test_a_check_losing_to_its_own_bundle_reports_the_key_as_stored(
            self, q: qs.Queen) -> None:
        answer = (q.transaction().kv.put("app", "k", "mine", forever=True)
                  .kv.check("app", "k", expect=0, required=True).commit())
        assert not answer and answer["kvReason"] == "exists", answer
        assert not q.kv.get("app", "k"), f"the bundle was rolled back: {answer}"
        assert (answer["version"], answer["value"]) == (0, None), (
            f"the key is absent, yet the bundle reported the row it undid: {answer}")

    def test_a_version_a_rolled_back_bundle_reported_is_never_issued_again(
            self, q: qs.Queen) -> None:
        answer = (q.transaction().kv.put("app", "k", "mine", forever=True)
                  .kv.check("app", "k", expect=0, required=True).commit())
        reported = answer["version"]
        other = q.kv.put("app", "k", "someone else's", forever=True)
        assert other["version"] != reported, (
            f"version {reported}, from the rolled-back bundle {answer}, was issued again: "
            f"{other}")
        clobber = q.kv.put("app", "k", "clobber", forever=True, expect=reported)
        assert not clobber, (f"a put expecting version {reported}, seen only in a rolled-back "
                             f"answer, overwrote a value its caller never saw: {clobber}")

    @settings(max_examples=30, deadline=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(seed=_WRITES, before=_WRITES, key=st.sampled_from(["k0", "k1"]),
           kind=st.sampled_from(["check stale", "put stale", "check absent", "putIfAbsent"]))
    def test_a_losing_required_op_reports_its_key_as_committed_whatever_came_before(
        self, q: qs.Queen, seed: list[tuple[str, str]], before: list[tuple[str, str]],
        key: str, kind: str,
    ) -> None:
        ns = f"undo{next(_NAMESPACES)}"
        for spec in seed:
            _add_write(q.transaction(), ns, *spec).commit()
        txn = q.transaction()
        for spec in before:
            _add_write(txn, ns, *spec)
        answer = _lose_on(txn, ns, kind, key).commit()
        assume(not answer)  # a "must be absent" op on an absent key applies: nothing undone
        assert answer["failedIndex"] == len(before), answer
        row = q.kv.get(ns, key)
        committed = (row["version"], row["value"]) if row else (0, None)
        assert (answer["version"], answer["value"]) == committed, (
            f"the bundle reported {answer}, the store holds {committed}: {kind} after {before}")

class TestReadsInBundles:
    def test_a_read_answers_the_value_as_of_its_step_in_the_bundle(self, q: qs.Queen) -> None:
        ns = f"reads-{next(_NAMESPACES)}"
        q.kv.put(ns, "k", "old", forever=True)
        lock = q.lock("job", ttl=30)
        assert lock.acquire()
        answer = (q.transaction().guard(lock)
                  .kv.get(ns, "k")
                  .kv.put(ns, "k", "new", forever=True)
                  .kv.get(ns, "k")
                  .kv.get_many(ns, ["k", "absent"])
                  .commit())
        assert answer and answer["success"] is True, answer
        before, put, after, many = answer["kv"][1:]
        assert before["found"] is True and before["value"] == "old", before
        assert after["found"] is True and after["value"] == "new", after
        assert after["version"] == put["version"], (put, after)
        assert [r["value"] for r in many["rows"]] == ["new"], many
        assert many["missing"] == ["absent"], many
        assert [r["index"] for r in answer["kv"]] == [0, 1, 2, 3, 4], answer
        lock.release()

    def test_a_read_of_an_absent_key_does_not_fail_its_bundle(self, q: qs.Queen) -> None:
        ns = f"reads-{next(_NAMESPACES)}"
        answer = (q.transaction().kv.get(ns, "absent").kv.get_many(ns, ["absent"])
                  .kv.put(ns, "k", 1, forever=True).commit())
        assert answer, f"a read that finds nothing is an answer, not a loss: {answer}"
        assert answer["kv"][0]["found"] is False, answer
        assert q.kv.get(ns, "k")["value"] == 1, "the write beside the reads must land"

    def test_a_rolled_back_bundle_counts_its_reads_and_answers_none_of_them(
            self, q: qs.Queen) -> None:
        ns = f"reads-{next(_NAMESPACES)}"
        q.kv.put(ns, "taken", "x", forever=True)
        answer = (q.transaction()
                  .kv.put(ns, "a", 1, forever=True)
                  .kv.get(ns, "a")
                  .kv.get_many(ns, ["a", "taken"])
                  .kv.put_if_absent(ns, "taken", "y", forever=True, required=True)
                  .commit())
        assert not answer and answer["reason"] == "kv_precondition", answer
        assert answer["failedIndex"] == 3, f"each read counts as one op before the gate: {answer}"
        assert "kv" not in answer, f"a rolled-back bundle answers no reads: {answer}"
        assert not q.kv.get(ns, "a"), "the write the reads saw must be rolled back"


class TestGuards:
    def test_a_guard_on_a_lock_not_held_raises_before_sending(self, q: qs.Queen) -> None:
        lock = q.lock("job", ttl=30)
        with pytest.raises(qs.LockNotHeldError):
            q.transaction().guard(lock).kv.put("out", "a", 1, forever=True).commit()
        assert not q.kv.get("out", "a")

    def test_a_guard_lost_to_another_holder_is_returned_and_marks_the_lock_lost(
        self, q: qs.Queen
    ) -> None:
        lock = q.lock("job", ttl=30, auto_renew=False)
        assert lock.acquire()
        q.kv.delete("queen-locks", "job#0")  # an operator's break-glass
        assert q.locks.acquire("job", ttl_seconds=30, owner="intruder")
        answer = q.transaction().guard(lock).kv.put("out", "a", 1, forever=True).commit()
        assert not answer and answer["failedIndex"] == 0, answer
        assert lock.lost.is_set() and lock.lost_reason == "guard", repr(lock)
        assert not q.kv.get("out", "a"), "the fenced write must not land"

    def test_a_guard_that_lost_only_to_its_own_renewal_is_resent(
            self, faulty_q: qs.Queen, faults: FaultyEngine) -> None:
        q = faulty_q
        lock = q.lock("job", ttl=30, auto_renew=False)
        assert lock.acquire()
        sent: list[Any] = []

        def renew_first(route: str, body: Mapping[str, Any]) -> None:
            if not sent:
                assert lock.renew(), "the renew underneath must succeed"
            sent.append(body["kv"][0]["expect"])

        faults.hook_next(None, hook=renew_first, route="transaction")
        answer = q.transaction().guard(lock).kv.incr("out", "n", forever=True).commit()
        faults.clear()
        assert answer, f"the bundle must commit on the renewed token: {answer}"
        assert len(sent) == 2 and sent[1] > sent[0], f"one resend, new token: {sent}"
        assert not lock.lost.is_set(), "losing to our own renewal is not a loss"
        assert q.kv.get("out", "n")["value"] == 1, "applied exactly once"


class TestQueueRidersOnTheEmbeddedEngines:
    @pytest.mark.parametrize("rider", [
        {"operations": [{"type": "push", "items": [{"queue": "q", "payload": 1,
                                                    "transactionId": "t1"}]}]},
        {"requiredLeases": ["lease-1"]},
        {"timers": [{"op": "schedule", "queue": "q", "key": "k", "delayMs": 10}]},
    ], ids=["push", "lease", "timer"])
    def test_a_raw_body_with_a_queue_rider_is_refused_and_writes_nothing(
        self, q: qs.Queen, rider: dict[str, Any]
    ) -> None:
        if q.engine.kind == "http":
            pytest.skip("a Queen broker carries queue riders")
        body = {"operations": [], "requiredLeases": [],
                "kv": [{"op": "put", "ns": "out", "key": "a", "value": 1, "forever": True}],
                **rider}
        with pytest.raises(qs.UnsupportedOperationError) as caught:
            q.engine.call("transaction", body)
        assert caught.value.capability == "queue_operations", repr(caught.value)
        assert not q.kv.get("out", "a"), "a refused bundle must write nothing of its kv"



class TestTheAnswersOfACommittedBundle:
    """Each op's answer in ``kv`` is a Result, as ``q.kv.batch`` answers it: its truth is its
    verdict, so a lost compare-and-set that was not required reads as lost."""

    @settings(max_examples=20, deadline=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(ops=st.lists(st.sampled_from(["stale put", "fresh put", "get present", "get absent",
                                         "incr", "delete absent", "check stale"]),
                        min_size=1, max_size=6))
    def test_each_answer_is_a_result_whose_truth_is_its_verdict(
            self, q: qs.Queen, ops: list[str]) -> None:
        ns = f"verdicts-{next(_NAMESPACES)}"
        q.kv.put(ns, "seed", 1, forever=True)
        txn = q.transaction()
        for kind in ops:
            if kind == "stale put":
                txn = txn.kv.put(ns, "seed", 2, forever=True, expect=10**9)
            elif kind == "fresh put":
                txn = txn.kv.put(ns, "other", 2, forever=True)
            elif kind == "get present":
                txn = txn.kv.get(ns, "seed")
            elif kind == "get absent":
                txn = txn.kv.get(ns, "absent")
            elif kind == "incr":
                txn = txn.kv.incr(ns, "n", forever=True)
            elif kind == "delete absent":
                txn = txn.kv.delete(ns, "absent")
            else:
                txn = txn.kv.check(ns, "seed", expect=10**9, required=False)
        done = txn.commit()
        assert done and len(done["kv"]) == len(ops), done
        for kind, answer in zip(ops, done["kv"]):
            assert isinstance(answer, qs.Result), f"{kind}: a plain {type(answer).__name__}"
            verdict = answer.get("applied", answer.get("found"))
            assert isinstance(verdict, bool) and bool(answer) is verdict, (kind, answer)
            expected = kind in ("fresh put", "get present", "incr")
            assert verdict is expected, f"{kind}: {answer}"


class TestABundleCommitsAtMostOnce:
    """A bundle whose writes landed, or may have landed, is spent: committing it again, or
    adding to it, is refused (``code == "transaction_spent"``) and sends nothing. One that
    lost a precondition applied nothing, so it may be committed again."""

    def test_a_second_commit_of_an_applied_bundle_is_refused_and_applies_nothing(
            self, q: qs.Queen) -> None:
        txn = q.transaction().kv.incr("spent", "n", forever=True)
        assert txn.commit()
        with pytest.raises(qs.RequestError) as refused:
            txn.commit()
        assert refused.value.code == "transaction_spent", refused.value
        assert q.kv.get("spent", "n")["value"] == 1, "the bundle applied twice"

    @pytest.mark.parametrize("add", [
        lambda t: t.kv.put("spent", "late", 1, forever=True),
        lambda t: t.once("spent", "late", ttl="1h"),
        lambda t: t.kv.incr("spent", "late", forever=True),
    ], ids=["put", "once", "incr"])
    def test_adding_to_an_applied_bundle_is_refused(
            self, q: qs.Queen, add: Callable[[qs.Transaction], qs.Transaction]) -> None:
        txn = q.transaction().kv.incr("spent", "n", forever=True)
        assert txn.commit()
        with pytest.raises(qs.RequestError) as refused:
            add(txn)
        assert refused.value.code == "transaction_spent", refused.value
        assert not q.kv.get("spent", "late"), "a write added after the commit landed"

    def test_a_guard_added_to_an_applied_bundle_is_refused(self, q: qs.Queen) -> None:
        lock = q.lock("job", ttl=30)
        assert lock.acquire()
        txn = q.transaction().guard(lock).kv.incr("spent", "n", forever=True)
        assert txn.commit()
        with pytest.raises(qs.RequestError, match="already committed"):
            txn.guard(lock)

    def test_a_bundle_that_lost_a_precondition_may_be_committed_again_and_applies_once(
            self, q: qs.Queen) -> None:
        q.kv.put("spent", "gate", "closed", forever=True)
        txn = (q.transaction().kv.check("spent", "gate", expect=0, required=True)
               .kv.incr("spent", "n", forever=True))
        lost = txn.commit()
        assert not lost and q.kv.get("spent", "n").get("value") is None, lost
        q.kv.delete("spent", "gate")
        assert txn.commit(), "the retried bundle did not commit"
        assert q.kv.get("spent", "n")["value"] == 1
        with pytest.raises(qs.RequestError, match="already committed"):
            txn.commit()
        assert q.kv.get("spent", "n")["value"] == 1, "the bundle applied twice"

    def test_a_bundle_whose_answer_was_lost_is_spent(
            self, faults: FaultyEngine, faulty_q: qs.Queen) -> None:
        txn = faulty_q.transaction().kv.incr("spent", "n", forever=True)
        faults.fail_next(route="transaction", applied=True)  # it lands; the answer is lost
        with pytest.raises(qs.EngineError):
            txn.commit()
        with pytest.raises(qs.RequestError) as refused:
            txn.commit()
        assert refused.value.code == "transaction_spent", refused.value
        assert "may have" in str(refused.value), f"the outcome is not told: {refused.value}"
        assert faulty_q.kv.get("spent", "n")["value"] == 1, "the bundle applied twice"

    def test_threads_committing_one_bundle_apply_it_once(self, q: qs.Queen) -> None:
        txn = q.transaction().kv.incr("spent", "n", forever=True)
        start = threading.Barrier(4)
        outcomes: list[str] = []

        def commit() -> None:
            start.wait()
            try:
                outcomes.append("committed" if txn.commit() else "lost")
            except qs.RequestError as exc:
                outcomes.append(str(exc.code))

        threads = [threading.Thread(target=commit) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        assert sorted(outcomes) == ["committed"] + ["transaction_spent"] * 3, outcomes
        assert q.kv.get("spent", "n")["value"] == 1, "the bundle applied more than once"

    @pytest.mark.parametrize("error", [KeyboardInterrupt, SystemExit, TimeoutError])
    def test_a_bundle_interrupted_after_it_applied_is_spent(
            self, faults: FaultyEngine, faulty_q: qs.Queen, error: type[BaseException]) -> None:
        txn = faulty_q.transaction().kv.incr("spent", "n", forever=True)
        faults.fail_next(route="transaction", applied=True, error=error)  # Ctrl-C, a signal
        with pytest.raises(error):
            txn.commit()
        with pytest.raises(qs.RequestError) as refused:
            txn.commit()
        assert refused.value.code == "transaction_spent", refused.value
        assert faulty_q.kv.get("spent", "n")["value"] == 1, "the bundle applied twice"

    def test_a_commit_from_inside_its_own_commit_is_refused_not_deadlocked(
            self, faults: FaultyEngine, faulty_q: qs.Queen) -> None:
        # As a signal handler on the committing thread would: the same thread, mid-commit.
        txn = faulty_q.transaction().kv.incr("spent", "n", forever=True)
        inner: list[str] = []

        def commit_again(route: str, body: Mapping[str, Any]) -> None:
            for again in (txn.commit, lambda: txn.kv.put("spent", "late", 1, forever=True)):
                try:
                    again()
                    inner.append("went through")
                except qs.RequestError as exc:
                    inner.append(str(exc.code))

        faults.hook_next(hook=commit_again, route="transaction")
        outcome: list[Any] = []
        worker = threading.Thread(target=lambda: outcome.append(txn.commit()), daemon=True)
        worker.start()
        worker.join(20)
        assert not worker.is_alive(), "a commit from inside the commit deadlocked"
        assert inner == ["transaction_in_progress"] * 2, inner
        assert outcome and outcome[0], outcome
        assert faulty_q.kv.get("spent", "n")["value"] == 1
        assert not faulty_q.kv.get("spent", "late")


class TestABundleRefusedByTheBroker:
    def test_may_be_committed_again_as_it_applied_nothing(self) -> None:
        from queen_sync.testing import FakeBroker

        with FakeBroker() as broker:
            q = broker.client()
            txn = q.transaction().kv.incr("ns", "n", forever=True)
            broker.faults.fail_next(status=400, route="transaction")
            with pytest.raises(qs.RequestError) as refused:
                txn.commit()
            assert refused.value.code != "transaction_spent", refused.value
            assert txn.commit(), "a refused bundle could not be sent again"
            assert q.kv.get("ns", "n")["value"] == 1
            q.close()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
class TestABundleAfterAFork:
    def test_the_child_may_not_commit_the_parents_bundle(self, sqlite_url: str) -> None:
        with qs.Queen(sqlite_url) as q:
            txn = q.transaction().kv.incr("spent", "n", forever=True)
            pid = os.fork()
            if pid == 0:  # the child: report by exit code only
                code = 3
                try:
                    txn.commit()
                    code = 1
                except qs.RequestError as exc:
                    code = 0 if exc.code == "transaction_forked" else 2
                finally:
                    os._exit(code)
            _, status = os.waitpid(pid, 0)
            assert os.waitstatus_to_exitcode(status) == 0, "the child committed or erred"
            assert txn.commit(), "the parent's own commit"
            assert q.kv.get("spent", "n")["value"] == 1, "parent and child both applied it"


def _interrupted_once(q: qs.Queen, at: int, outer: str, inner: str) -> tuple[bool, list[str]]:
    """Run ``outer`` on a fresh bundle, calling ``inner`` as a signal handler would at the
    ``at``-th line event of the guarded section; whether it fired, and what each answered."""
    import sys

    from queen_sync._handle.transaction import Transaction

    code = Transaction._alone.__wrapped__.__code__  # type: ignore[attr-defined]
    txn = q.transaction().kv.incr("sig", "n", forever=True)
    seen, fired, answers = 0, False, []

    def call(which: str) -> None:
        if which == "add":
            txn.kv.incr("sig", "m", forever=True)
        else:
            txn.commit()

    def trace(frame: Any, event: str, arg: Any) -> Any:
        nonlocal seen, fired
        if frame.f_code is code and event == "line":
            seen += 1
            if seen == at and not fired:
                fired = True
                sys.settrace(None)
                try:
                    call(inner)
                    answers.append("done")
                except qs.RequestError as exc:
                    answers.append(str(exc.code))
        return trace

    def run() -> None:
        sys.settrace(trace)
        try:
            call(outer)
            answers.append("outer done")
        except qs.RequestError as exc:
            answers.append(f"outer {exc.code}")
        finally:
            sys.settrace(None)

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(10)
    assert not worker.is_alive(), f"{inner} from a handler at line event {at} of {outer} hung"
    return fired, answers


class TestASignalHandlerThatUsesTheBundle:
    """A handler runs on the thread it interrupts, between any two lines: whatever it does
    with the bundle that thread is adding to or committing must answer, never hang."""

    @pytest.mark.parametrize("outer", ["add", "commit"])
    @pytest.mark.parametrize("inner", ["add", "commit"])
    def test_never_hangs_at_any_line_of_the_interrupted_call(
            self, sqlite_url: str, outer: str, inner: str) -> None:
        with qs.Queen(sqlite_url, renew_thread=False) as q:
            at, fired = 0, True
            while fired:  # one run per line of the guarded section, until none is left
                at += 1
                fired, answers = _interrupted_once(q, at, outer, inner)
                if outer == inner == "commit":
                    assert answers.count("done") + answers.count("outer done") <= 1, (
                        f"one bundle committed twice at line event {at}: {answers}")
            assert at > 3, "the trace saw no lines of the guarded section"
