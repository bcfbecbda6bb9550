"""The recipes' behaviour within one process: examples, arguments, sinks, cooldown, release."""

from __future__ import annotations

import ast
import re
import threading
import time
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

import pytest

import queen_sync as qs
from queen_sync.recipes import fenced_export, leader_election, run_queue
from queen_sync.recipes.fenced_export import FencedDirectory, FencedExport, FencedKv
from queen_sync.recipes.leader_election import LeaderElection
from queen_sync.recipes.run_queue import RunQueue


def _example(module: ModuleType) -> str:
    found = re.search(r"```python\n(.*?)```", module.__doc__ or "", re.S)
    assert found, f"{module.__name__} does not open with a python example"
    return found.group(1)


class TestEachRecipeOpensWithARunnableExample:
    @pytest.mark.parametrize("module", [leader_election, fenced_export, run_queue],
                             ids=lambda m: m.__name__)
    def test_the_docstring_example_runs_as_written(
            self, module: ModuleType, sqlite_url: str, monkeypatch: pytest.MonkeyPatch,
            capsys: pytest.CaptureFixture[str]) -> None:
        monkeypatch.setenv("QUEEN_URL", sqlite_url)
        exec(compile(_example(module), f"<{module.__name__} example>", "exec"), {})
        assert capsys.readouterr().out, f"the {module.__name__} example printed nothing"


class TestBadArgumentsAreRefusedBeforeAnyIo:
    def test_each_recipe_raises_a_typed_error_at_the_call(self, sqlite_url: str,
                                                          tmp_path: Path) -> None:
        with qs.Queen(sqlite_url) as q:
            calls: list[tuple[type[Exception], Callable[[], object]]] = [
                (TypeError, lambda: LeaderElection(q, "x", ttl=True)),
                (ValueError, lambda: LeaderElection(q, "x", ttl="soon")),
                (ValueError, lambda: LeaderElection(q, "a#b", ttl=1)),
                (TypeError, lambda: LeaderElection(q, "x", ttl=1, on_elected=3)),  # type: ignore[call-overload]
                (ValueError, lambda: FencedExport(q, "x", FencedKv(q, "ns"), ttl=-1)),
                (TypeError, lambda: FencedDirectory(tmp_path).write("a", b"", token="7")),  # type: ignore[arg-type]
                (ValueError, lambda: FencedDirectory(tmp_path).write("../a", b"", token=1)),
                (TypeError, lambda: FencedDirectory(tmp_path).write("a", 3, token=1)),
                (ValueError, lambda: RunQueue(q, "a/b")),
                (ValueError, lambda: RunQueue(q, "ok").submit("")),
                (ValueError, lambda: RunQueue(q, "ok").claim(ttl="never")),
                (TypeError, lambda: RunQueue(q, "ok").list(claimed="yes")),  # type: ignore[arg-type]
            ]
            for error, call in calls:
                with pytest.raises(error):
                    call()
            assert not q.kv.list_all("queen-sync.runs", "ok/"), "a refused call wrote something"
        assert FencedDirectory(tmp_path).token() == 0, "a refused write raised the mark"


def _read_nothing(sink: FencedKv) -> None:
    with pytest.raises(KeyError):
        sink.read("none")


#: Each recipe built from a client given as ``**how``, and a call that needs that client.
BUILDERS: dict[str, tuple[Callable[..., Any], Callable[[Any], object]]] = {
    "RunQueue": (lambda **how: RunQueue(name="jobs", **how), lambda made: made.list()),
    "FencedKv": (lambda **how: FencedKv(ns="ns", **how), _read_nothing),
    "FencedExport": (lambda **how: FencedExport(name="exp", sink=FencedDirectory("."), ttl=5,
                                                **how),
                     lambda made: made.finished()),
    "LeaderElection": (lambda **how: LeaderElection(name="el", ttl=5, **how),
                       lambda made: made.leader()),
}


class TestTheClientParameter:
    @pytest.mark.parametrize("recipe", sorted(BUILDERS))
    def test_client_by_keyword_works_and_the_old_q_keyword_still_does_with_a_warning(
            self, recipe: str, sqlite_url: str, tmp_path: Path,
            monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.chdir(tmp_path)
        build, use = BUILDERS[recipe]
        with qs.Queen(sqlite_url) as q:
            use(build(client=q))
            with pytest.warns(DeprecationWarning, match=r"q=.*client=") as warned:
                use(build(q=q))
            with pytest.raises(TypeError, match="client"):
                build(client=q, q=q)
            with pytest.raises(TypeError, match="client"):
                build()

        assert len(warned) == 1, f"{recipe}(q=...) warned {len(warned)} times"
        assert warned[0].filename == __file__, (
            f"the warning points at {warned[0].filename}, not at the caller")


RECIPES = Path(__file__).resolve().parents[2] / "recipes"


def _private_uses(path: Path) -> list[str]:
    """Imports of queen_sync's private modules, and ``qs._name`` reads, in one recipe file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        names = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                 else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
        found += [name for name in names if name.startswith("queen_sync._")]
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id == "qs" and node.attr.startswith("_")):
            found.append(f"qs.{node.attr} (line {node.lineno})")
    return found


class TestTheRecipesUseOnlyThePublicApi:
    def test_no_recipe_imports_a_private_module_or_reads_a_private_name(self) -> None:
        files = sorted(RECIPES.glob("*.py"))
        private = {path.name: _private_uses(path) for path in files}

        assert len(files) >= 4, f"the recipes were not found in {RECIPES}: {files}"
        assert not any(private.values()), f"recipes reach past the public API: {private}"


#: Names every recipe module may bind for itself: its logger and its export list.
_OWN_NAMES = {"log", "__all__"}


def _top_level_names(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
    return names - _OWN_NAMES


class TestEachHelperIsWrittenOnce:
    def test_no_two_recipe_modules_define_the_same_top_level_name(self) -> None:
        defined: dict[str, list[str]] = {}
        for path in sorted(RECIPES.glob("*.py")):
            for name in _top_level_names(path):
                defined.setdefault(name, []).append(path.name)
        twice = {name: files for name, files in defined.items() if len(files) > 1}

        assert not twice, f"copied between recipe modules (share one definition): {twice}"


class TestFencedDirectory:
    def test_a_lower_token_is_refused_an_equal_one_accepted_and_the_mark_never_rewinds(
            self, tmp_path: Path) -> None:
        sink = FencedDirectory(tmp_path)
        sink.write("part", b"by 5", token=5)
        sink.write("other", "by 5 again", token=5)
        with pytest.raises(qs.FencedOutError) as refused:
            sink.write("part", b"by 4", token=4)
        for published in tmp_path.glob("*@*"):
            published.unlink()  # losing the data must not lose the high-water mark
        with pytest.raises(qs.FencedOutError):
            FencedDirectory(tmp_path).write("part", b"by 3", token=3)

        assert (refused.value.presented, refused.value.current) == (4, 5), repr(refused.value)
        assert FencedDirectory(tmp_path).token() == 5, "the mark moved"
        assert not list((tmp_path / ".tmp").iterdir()), "a refused write left a temporary file"

    def test_a_newer_token_replaces_a_partition_and_readers_see_one_whole_version(
            self, tmp_path: Path) -> None:
        sink = FencedDirectory(tmp_path)
        sink.write("part", b"old", token=3)
        sink.write("part", b"new", token=8)
        versions = sorted(p.name for p in tmp_path.glob("part@*"))

        assert versions == ["part@8"], f"older versions were left behind: {versions}"
        assert sink.read("part") == b"new", "the reader did not get the newest version"
        assert sink.files()["part"][0] == 8, f"files() reports {sink.files()}"


class TestFencedKvAndExportProgress:
    def test_a_replaced_holders_kv_write_and_checkpoint_are_refused(self, sqlite_url: str) -> None:
        with qs.Queen(sqlite_url) as q:
            sink = FencedKv(q, "exports")
            old = q.lock("sales", ttl=30)
            assert old.acquire(), "could not take the lock"
            stale_token = old.token
            assert stale_token is not None
            sink.write("p0", {"rows": 1}, token=stale_token, lock=old)
            q.locks.release("sales", token=stale_token)  # the engine hands the lock on
            new = q.lock("sales", ttl=30)
            assert new.acquire(), "the new holder could not take the lock"
            with pytest.raises(qs.FencedOutError) as refused:
                sink.write("p1", {"rows": 2}, token=stale_token, lock=old)
            new.release()

        assert refused.value.presented == stale_token, repr(refused.value)
        current = refused.value.current
        assert current is not None and current > stale_token, (
            f"the refusal does not name the newer token: {refused.value!r}")

    def test_a_second_run_skips_the_partitions_the_first_one_finished(
            self, sqlite_url: str, tmp_path: Path) -> None:
        with qs.Queen(sqlite_url) as q:
            export = FencedExport(q, "daily", FencedDirectory(tmp_path), ttl=30)
            first = export.run(["a", "b"], lambda p: p)
            second = export.run(["a", "b", "c"], lambda p: p)
            busy_lock = q.lock("daily", ttl=30)
            assert busy_lock.acquire()
            busy = export.run(["d"], lambda p: p)
            busy_lock.release()

        assert (first.written, second.written, second.skipped) == (["a", "b"], ["c"], ["a", "b"])
        assert not busy.acquired and not busy.written, f"ran while the lock was held: {busy}"


class TestLeaderElectionTerms:
    @pytest.mark.realtime
    def test_a_deposed_leader_waits_one_renew_interval_and_hears_of_it_once_off_the_renewer(
            self, sqlite_url: str) -> None:
        events: list[tuple[str, float, str]] = []

        def note(kind: str) -> None:
            events.append((kind, time.monotonic(), threading.current_thread().name))

        with qs.Queen(sqlite_url) as q:
            election = LeaderElection(q, "cooldown", ttl=1, on_elected=lambda _: note("elected"),
                                      on_deposed=lambda reason: note(reason))
            election.start()
            assert election.wait_elected(5), "never elected"
            token = election.token
            assert token is not None
            q.locks.release("cooldown", token=token)  # deposed: the next renew finds it gone
            deadline = time.monotonic() + 5
            while len(events) < 3 and time.monotonic() < deadline:
                time.sleep(0.01)
            election.stop()

        kinds = [kind for kind, _, _ in events]
        assert kinds[:3] == ["elected", "renew", "elected"], f"terms went {kinds}"
        assert kinds.count("renew") == 1, f"on_deposed fired more than once for one term: {kinds}"
        gap = events[2][1] - events[1][1]
        assert gap >= election.retry_every * 0.95, f"took the lease back after only {gap:.3f}s"
        threads = {thread for _, _, thread in events}
        assert "queen_sync-renewer" not in threads, f"a callback ran on the renewer: {threads}"


class TestRunQueueReleaseAndCompletion:
    def test_a_released_run_is_claimable_at_once_and_a_completed_one_never_again(
            self, sqlite_url: str) -> None:
        with qs.Queen(sqlite_url) as q:
            runs = RunQueue(q, "jobs")
            assert runs.submit("r1", {"x": 1}) and not runs.submit("r1", {"x": 2})
            first = runs.claim(holder="a", ttl=30)
            assert first is not None and runs.claim(holder="b", ttl=30) is None
            first.checkpoint({"half": True})
            assert first.release(), "release found nothing to release"
            listed = [(e.run_id, e.claim) for e in runs.list(claimed=False)]
            second = runs.claim(holder="b", ttl=30)
            assert second is not None, "a released run was not claimable at once"
            second.complete("ok")
            with pytest.raises(qs.FencedOutError):
                second.checkpoint({"after": "completion"})
            leftovers = (runs.list(), runs.claim(holder="c", ttl=30))
            result = runs.results()["r1"].result

        assert listed == [("r1", None)], f"after release the listing said {listed}"
        assert second.fence > first.fence, "the second claim's fence is not higher"
        assert second.state == {"half": True} and second.payload == {"x": 1}, (
            "the new claimer did not see the payload and the last checkpoint")
        assert leftovers == ([], None), f"a completed run is still offered: {leftovers}"
        assert result == "ok", f"the completion record holds {result!r}"
