"""Notebooks: displays, interrupts, re-run cells, threads, and the ``%%lock`` magic in a kernel."""

from __future__ import annotations

import logging
import signal
import sys
import threading
import time
import types
from typing import Any

import pytest

import queen_sync as qs


class FakeCells:
    """Stands in for IPython: ``get_ipython().execution_count`` is the running cell."""

    def __init__(self) -> None:
        self.execution_count = 1
        self.user_ns: dict[str, Any] = {}
        self.user_ns_hidden: dict[str, Any] = {"Out": None}

    def next_cell(self) -> None:
        self.execution_count += 1


@pytest.fixture
def cells(monkeypatch: pytest.MonkeyPatch) -> FakeCells:
    shell = FakeCells()
    module = types.ModuleType("IPython")
    module.get_ipython = lambda: shell  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "IPython", module)
    return shell


def _settle(expected: int, timeout: float = 5.0) -> int:
    """The thread count once it has come down to ``expected`` (or the timeout passed)."""
    deadline = time.monotonic() + timeout
    while threading.active_count() > expected and time.monotonic() < deadline:
        time.sleep(0.02)
    return threading.active_count()


class TestDisplays:
    def test_a_lock_shows_name_held_token_slot_owner_and_expiry(self, client: qs.Queen) -> None:
        lock = client.lock("retrain", ttl="10m")
        idle_html = lock._repr_html_()
        assert lock.acquire()
        text, html = repr(lock), lock._repr_html_()
        for part in ("retrain", "held", str(lock.token), lock.owner):
            assert part in text and part in html, f"{part!r} missing: {text} / {html}"
        assert "expires_in=" in text and "expires in" in html, (text, html)
        assert "not held" in idle_html, idle_html

    def test_holder_listings_and_run_results_render_tables(self, client: qs.Queen,
                                                           sqlite_url: str) -> None:
        with qs.Queen(sqlite_url) as other:
            holder = other.lock("busy", ttl="1m")
            assert holder.acquire()
            busy = client.lock("busy", ttl="1m").run(lambda: 1)
            listing = client.lock("busy", ttl="1m")
            assert not listing.acquire()
            ran = client.lock("free", ttl="1m").run(lambda: "value")
        html = busy._repr_html_()
        assert "busy" in html and holder.owner in html and "<table" in html, html
        assert holder.owner in listing.holders._repr_html_(), "a holder listing is a table"  # type: ignore[attr-defined]
        assert holder.owner in listing.holders[0]._repr_html_()
        assert "acquired" in ran._repr_html_() and "value" in ran._repr_html_()

    def test_html_escapes_what_it_shows(self, client: qs.Queen) -> None:
        lock = client.lock("<script>", ttl="1m", owner="<b>me</b>")
        html = lock._repr_html_()
        assert "<script>" not in html and "<b>me" not in html, html
        assert "&lt;script&gt;" in html, html


class TestInterrupts:
    def test_an_interrupt_inside_a_locked_block_leaves_nothing_held(self,
                                                                   client: qs.Queen) -> None:
        lock = client.lock("cell", ttl="1m")
        with pytest.raises(KeyboardInterrupt), lock:
            raise KeyboardInterrupt
        assert client.locks.get("cell").get("holders") == [], "nothing may stay held"

    def test_an_interrupt_during_a_wait_leaves_nothing_held(self, client: qs.Queen,
                                                            sqlite_url: str) -> None:
        main = threading.main_thread().ident
        assert main is not None and threading.current_thread() is threading.main_thread()
        with qs.Queen(sqlite_url) as other:
            holder = other.lock("cell", ttl="1m")
            assert holder.acquire()
            waiter = client.lock("cell", ttl="1m")
            timer = threading.Timer(0.3, signal.pthread_kill, (main, signal.SIGINT))
            timer.start()
            with pytest.raises(KeyboardInterrupt):
                waiter.acquire(wait="20s")
            timer.join()
            owners = [h["owner"] for h in client.locks.get("cell")["holders"]]
        assert owners == [holder.owner], f"only the holder may hold it: {owners}"
        assert not waiter.held and client.held() == []


class TestRerunningACell:
    def test_a_rerun_cell_takes_over_its_own_earlier_handle_at_once(
            self, client: qs.Queen, cells: FakeCells, caplog: pytest.LogCaptureFixture) -> None:
        first = client.lock("train", ttl="1m")
        assert first.acquire()
        cells.next_cell()
        second = client.lock("train", ttl="1m")
        started = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="queen_sync"):
            assert second.acquire(wait="10s"), "the re-run cell must get the lock"
        assert time.monotonic() - started < 1.0, "it must not wait on its own kernel"
        assert not first.held and second.held
        assert first.owner in caplog.text and "supersedes" in caplog.text, caplog.text

    def test_a_cell_that_builds_its_own_client_takes_over_too(
            self, sqlite_url: str, cells: FakeCells) -> None:
        earlier = qs.Queen(sqlite_url)
        assert earlier.lock("train", ttl="1m").acquire()
        cells.next_cell()
        with qs.Queen(sqlite_url) as later:
            assert later.lock("train", ttl="1m").acquire(), "same engine URL, same kernel"
        assert earlier.held() == []
        earlier.close()

    def test_a_handle_kept_in_a_notebook_variable_is_never_taken_over(
            self, client: qs.Queen, cells: FakeCells) -> None:
        blocker = client.lock("train", ttl="1m")
        cells.user_ns["blocker"] = blocker
        cells.user_ns["jobs"] = types.SimpleNamespace(lock=client.lock("report", ttl="1m"))
        assert blocker.acquire() and cells.user_ns["jobs"].lock.acquire()
        cells.next_cell()
        assert not client.lock("train", ttl="1m").acquire(), "a variable keeps its lock"
        assert not client.lock("report", ttl="1m").acquire(), "so does an attribute of one"
        assert blocker.held and cells.user_ns["jobs"].lock.held

    def test_output_history_does_not_keep_a_handle(self, client: qs.Queen,
                                                   cells: FakeCells) -> None:
        shown = client.lock("train", ttl="1m")
        cells.user_ns["Out"] = {1: shown}
        assert shown.acquire()
        cells.next_cell()
        assert client.lock("train", ttl="1m").acquire(), "Out[1] is history, not a variable"

    def test_two_handles_in_one_cell_still_contend(self, client: qs.Queen,
                                                   cells: FakeCells) -> None:
        assert client.lock("train", ttl="1m").acquire()
        assert not client.lock("train", ttl="1m").acquire(), "one cell: an ordinary busy lock"

    def test_a_handle_held_by_another_thread_is_never_taken_over(self, client: qs.Queen,
                                                                 cells: FakeCells) -> None:
        results: list[bool] = []
        worker = threading.Thread(target=lambda: results.append(
            client.lock("train", ttl="1m").acquire()))
        worker.start()
        worker.join()
        cells.next_cell()
        assert results == [True] and not client.lock("train", ttl="1m").acquire()

    def test_a_handle_inside_a_running_block_is_never_taken_over(self, client: qs.Queen,
                                                                 cells: FakeCells) -> None:
        with client.lock("train", ttl="1m") as outer:
            cells.next_cell()
            assert not client.lock("train", ttl="1m").acquire()
            assert outer.held

    def test_outside_ipython_two_handles_contend_as_usual(self, client: qs.Queen) -> None:
        assert client.lock("train", ttl="1m").acquire()
        assert not client.lock("train", ttl="1m").acquire()

    def test_rerunning_a_cell_that_builds_a_client_and_takes_a_lock_leaks_no_threads(
            self, sqlite_url: str, cells: FakeCells) -> None:
        before = threading.active_count()
        clients = []
        for _ in range(5):
            q = qs.Queen(sqlite_url)  # the cell, as a user writes it: no close, no release
            clients.append(q)
            assert q.lock("train", ttl="1m").acquire(wait="5s")
            cells.next_cell()
        after = _settle(before + 1)
        assert after <= before + 1, f"{before} threads before 5 runs, {after} after"
        for q in clients:
            q.close()


class PlainShell:
    """The parts of an IPython shell the magic uses, without IPython."""

    def __init__(self) -> None:
        self.user_ns: dict[str, Any] = {"qs": qs}

    def transform_cell(self, cell: str) -> str:
        return cell


class TestTheMagicWithoutAKernel:
    @pytest.fixture(autouse=True)
    def _default_url(self, sqlite_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv("QUEEN_URL", sqlite_url)

    def test_the_cell_runs_in_the_namespace_and_its_last_value_comes_back(self) -> None:
        from queen_sync._front.magic import run_locked_cell

        shell = PlainShell()
        value = run_locked_cell(shell, "job --ttl 1m --wait 0s",
                                "x = qs.current_lock().name\nx.upper()")
        assert value == "JOB" and shell.user_ns["x"] == "job", (value, shell.user_ns)

    def test_a_busy_lock_prints_the_holder_and_skips_the_cell(
            self, sqlite_url: str, capsys: pytest.CaptureFixture[str]) -> None:
        from queen_sync._front.magic import run_locked_cell

        shell = PlainShell()
        with qs.Queen(sqlite_url) as other, other.lock("job", ttl="1m") as holder:
            assert run_locked_cell(shell, "job --ttl 1m", "ran = True") is None
        out = capsys.readouterr().out
        assert "busy" in out and holder.owner in out and "ran" not in shell.user_ns, out

    @pytest.mark.parametrize("line", ["", "job --ttl soon", "job --wait later", "job --bogus"])
    def test_a_bad_line_is_a_value_error_naming_an_example(self, line: str) -> None:
        from queen_sync._front.magic import run_locked_cell

        with pytest.raises(ValueError, match="%%lock"):
            run_locked_cell(PlainShell(), line, "pass")


NOTEBOOK_CELLS: list[tuple[str, list[str]]] = [
    ("import os, threading, time\nos.environ['QUEEN_URL'] = {url!r}\nimport queen_sync as qs\n"
     "%load_ext queen_sync", []),
    ("%%lock nb-demo --ttl 1m\nlk = qs.current_lock()\nprint('inside', lk.name, lk.held)\n"
     "lk.token > 0", []),
    ("other = qs.Queen()\nblocker = other.lock('nb-busy', ttl='1m')\nassert blocker.acquire()\n"
     "print('blocker', blocker.owner)", []),
    ("%%lock nb-busy --ttl 1m\nprint('should not run')", []),
    ("%%lock nb-busy --ttl 1m --wait 60s\nprint('should not run')",
     ["raises-exception", "interrupt-me"]),
    ("mine = qs.default_client()\nowners = [h['owner'] for h in mine.locks.get('nb-busy')"
     "['holders']]\nassert owners == [blocker.owner], owners\nassert mine.held() == []\n"
     "print('nothing held')", []),
    ("blocker", []),
    ("qs.default_client().lock('nb-busy', ttl='1m').run(lambda: 1)", []),
    ("lk = qs.default_client().lock('nb-rerun', ttl='1m')\nt0 = time.monotonic()\n"
     "assert lk.acquire(wait='10s')\nprint('waited', round(time.monotonic() - t0, 3))", []),
    ("lk = qs.default_client().lock('nb-rerun', ttl='1m')\nt0 = time.monotonic()\n"
     "assert lk.acquire(wait='10s')\nprint('waited', round(time.monotonic() - t0, 3))", []),
    ("counts = []", []),
    *[("q = qs.Queen()\nh = q.lock('nb-threads', ttl='1m')\nassert h.acquire(wait='10s')\n"
       "counts.append(threading.active_count())", [])] * 4,
    ("deadline = time.monotonic() + 5\n"
     "while threading.active_count() > counts[0] and time.monotonic() < deadline:\n"
     "    time.sleep(0.05)\nprint('threads', counts[0], threading.active_count())", []),
]


def _text(cell: Any) -> str:
    return "".join(o.get("text", "") for o in cell.outputs
                   if o.get("output_type") == "stream" and o.get("name") == "stdout")


class TestInAJupyterKernel:
    def test_the_magic_displays_interrupts_and_reruns_under_a_real_kernel(
            self, sqlite_url: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
        nbformat = pytest.importorskip("nbformat")
        nbclient = pytest.importorskip("nbclient")
        pytest.importorskip("ipykernel")
        monkeypatch.setenv("JUPYTER_PLATFORM_DIRS", "1")
        notebook = nbformat.v4.new_notebook()
        for source, tags in NOTEBOOK_CELLS:
            cell = nbformat.v4.new_code_cell(source.replace("{url!r}", repr(sqlite_url)))
            cell.metadata["tags"] = tags
            notebook.cells.append(cell)
        client = nbclient.NotebookClient(
            notebook, timeout=60, kernel_name="python3", interrupt_on_timeout=True,
            timeout_func=lambda cell: 2 if "interrupt-me" in cell.metadata.get("tags", [])
            else 60,
            resources={"metadata": {"path": str(tmp_path)}})
        client.execute()
        cells = notebook.cells
        blocker = _text(cells[2]).split()[1]
        assert "inside nb-demo True" in _text(cells[1]), cells[1].outputs
        assert cells[1].outputs[-1]["data"]["text/plain"] == "True", "the last value is shown"
        assert "is busy" in _text(cells[3]) and blocker in _text(cells[3]), cells[3].outputs
        assert "should not run" not in _text(cells[3]) + _text(cells[4])
        assert [o.get("ename") for o in cells[4].outputs] == ["KeyboardInterrupt"], \
            cells[4].outputs
        assert "nothing held" in _text(cells[5]), cells[5].outputs
        lock_html = cells[6].outputs[0]["data"]["text/html"]
        assert "nb-busy" in lock_html and "token" in lock_html and blocker in lock_html
        result_html = cells[7].outputs[0]["data"]["text/html"]
        assert "busy" in result_html and blocker in result_html, result_html
        rerun_wait = float(_text(cells[9]).split()[1])
        assert rerun_wait < 1.0, f"the re-run cell waited {rerun_wait}s on its own kernel"
        first, settled = (int(n) for n in _text(cells[-1]).split()[1:])
        assert settled <= first, f"threads grew across 4 runs: {first} -> {settled}"
