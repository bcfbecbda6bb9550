"""The built docs site renders in a real headless browser: no errors, and the figures load.

Chromium (the distribution's package; ``.ci/install-chromium.sh`` installs it) loads
the home page and a recipe page from a local HTTP server, driven over the DevTools
protocol on a pipe (``--remote-debugging-pipe``: JSON messages ending in a NUL byte),
so no websocket client or browser download is needed. A page passes when it logs no
console error and no uncaught exception, every request to the site succeeds, and every
image has loaded with a width. The site makes no request to another host but one, the
repository facts (stars, forks) the theme asks GitHub for, and that one is blocked, so
the check never depends on the network. Each page's screenshot is written to the
test's folder, or to ``QUEEN_SYNC_SCREENSHOTS`` when set.

Skipped when no Chromium is installed, unless ``QUEEN_SYNC_REQUIRE_BROWSER=1`` (CI sets
it): then it fails.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import functools
import http.server
import json
import os
import select
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGE_BUDGET = 15.0  # seconds for one page to load and settle, far above what it needs
THIRD_PARTY_ALLOWED = ("https://api.github.com/repos/",)


def chromium() -> str:
    """The Chromium executable, or a skip (a failure under QUEEN_SYNC_REQUIRE_BROWSER=1)."""
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found:
        return found
    reason = "no chromium on PATH (.ci/install-chromium.sh installs it)"
    if os.environ.get("QUEEN_SYNC_REQUIRE_BROWSER") == "1":
        pytest.fail(f"QUEEN_SYNC_REQUIRE_BROWSER=1 but {reason}", pytrace=False)
    pytest.skip(reason)


class DevTools:
    """A DevTools protocol session over Chromium's debugging pipe (fds 3 and 4)."""

    def __init__(self, executable: str, profile: Path) -> None:
        to_browser_r, self._to_browser = os.pipe()
        self._from_browser, from_browser_w = os.pipe()
        # A small Python trampoline moves the child's two pipe ends onto fds 3 and 4, where
        # Chromium expects them (a shell cannot: dash redirects only fds 0-9). They are
        # moved above 4 first, so that placing one cannot overwrite the other.
        to_browser_r, from_browser_w = _above_four(to_browser_r), _above_four(from_browser_w)
        self._process = subprocess.Popen(
            [sys.executable, "-c", _TRAMPOLINE, str(to_browser_r), str(from_browser_w),
             executable,
             "--headless", "--no-sandbox", "--disable-gpu", "--remote-debugging-pipe",
             "--no-first-run", "--no-default-browser-check", "--disable-extensions",
             "--disable-background-networking", "--disable-sync", "--mute-audio",
             "--hide-scrollbars", "--window-size=1280,900", f"--user-data-dir={profile}",
             "about:blank"],
            pass_fds=(to_browser_r, from_browser_w),
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.close(to_browser_r)
        os.close(from_browser_w)
        self._buffer = b""
        self._next_id = 0
        self.events: list[dict[str, Any]] = []

    def send(self, method: str, params: dict[str, Any] | None = None,
             session: str | None = None, timeout: float = PAGE_BUDGET) -> dict[str, Any]:
        """Send one command and return its result, keeping the events read meanwhile."""
        self._next_id += 1
        message: dict[str, Any] = {"id": self._next_id, "method": method,
                                   "params": params or {}}
        if session is not None:
            message["sessionId"] = session
        os.write(self._to_browser, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            reply = self._read(deadline)
            if reply.get("id") == self._next_id:
                assert "error" not in reply, f"{method} failed: {reply['error']}"
                result: dict[str, Any] = reply.get("result", {})
                return result
            self.events.append(reply)

    def wait_for(self, method: str, name: str, timeout: float = PAGE_BUDGET) -> None:
        """Read events until ``method`` arrives with ``params.name == name``."""
        deadline = time.monotonic() + timeout
        while True:
            event = self._read(deadline)
            self.events.append(event)
            if event.get("method") == method and event["params"].get("name") == name:
                return

    def _read(self, deadline: float) -> dict[str, Any]:
        while b"\0" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("Chromium did not answer in time")
            ready, _, _ = select.select([self._from_browser], [], [], left)
            if ready:
                chunk = os.read(self._from_browser, 1 << 20)
                assert chunk, "Chromium closed its debugging pipe"
                self._buffer += chunk
        raw, self._buffer = self._buffer.split(b"\0", 1)
        message: dict[str, Any] = json.loads(raw)
        return message

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.send("Browser.close", timeout=5)
        try:
            self._process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        os.close(self._to_browser)
        os.close(self._from_browser)


_TRAMPOLINE = ("import os, sys; os.dup2(int(sys.argv[1]), 3); os.dup2(int(sys.argv[2]), 4); "
               "os.execv(sys.argv[3], sys.argv[3:])")


def _above_four(fd: int) -> int:
    """``fd`` moved to a descriptor numbered 5 or more."""
    moved = fcntl.fcntl(fd, fcntl.F_DUPFD, 5)
    os.close(fd)
    return moved


@dataclass
class PageReport:
    """What one page load showed: problems found, its images, the screenshot."""

    problems: list[str] = field(default_factory=list)
    images: list[dict[str, Any]] = field(default_factory=list)
    screenshot: bytes = b""


def load(tools: DevTools, url: str, site: str) -> PageReport:
    """Open ``url`` in a new tab, wait until its network is idle, and report on it."""
    target = tools.send("Target.createTarget", {"url": "about:blank"})["targetId"]
    session = tools.send("Target.attachToTarget",
                         {"targetId": target, "flatten": True})["sessionId"]
    for domain in ("Page", "Runtime", "Log", "Network"):
        tools.send(f"{domain}.enable", session=session)
    tools.send("Page.setLifecycleEventsEnabled", {"enabled": True}, session=session)
    # The site is served over plain HTTP, so this blocks every other host it might call.
    tools.send("Network.setBlockedURLs", {"urls": ["https://*"]}, session=session)
    tools.events.clear()
    tools.send("Page.navigate", {"url": url}, session=session)
    tools.wait_for("Page.lifecycleEvent", "networkIdle")
    report = PageReport(problems=problems_in(tools.events, site))
    report.images = tools.send("Runtime.evaluate", {
        "expression": "Array.from(document.images).map(i => ({src: i.src.slice(0, 60), "
                      "complete: i.complete, width: i.naturalWidth}))",
        "returnByValue": True}, session=session)["result"]["value"]
    shot = tools.send("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True},
                      session=session)
    report.screenshot = base64.b64decode(shot["data"])
    tools.send("Target.closeTarget", {"targetId": target})
    return report


def problems_in(events: list[dict[str, Any]], site: str) -> list[str]:
    """Console errors, uncaught exceptions, and failed requests, as lines for a message."""
    urls = {e["params"]["requestId"]: e["params"]["request"]["url"]
            for e in events if e.get("method") == "Network.requestWillBeSent"}
    found = [f"third-party request: {url}" for url in urls.values()
             if not url.startswith((site, "data:", "about:", *THIRD_PARTY_ALLOWED))]
    for event in events:
        method, params = event.get("method"), event.get("params", {})
        if method == "Runtime.exceptionThrown":
            found.append(f"uncaught: {params['exceptionDetails'].get('text')}")
        elif method == "Runtime.consoleAPICalled" and params.get("type") == "error":
            found.append(f"console.error: {[a.get('value') for a in params.get('args', [])]}")
        elif method == "Log.entryAdded" and params["entry"].get("level") == "error":
            entry = params["entry"]
            if not str(entry.get("url", "")).startswith(THIRD_PARTY_ALLOWED):
                found.append(f"log error: {entry.get('text')} {entry.get('url', '')}")
        elif method == "Network.loadingFailed":
            url = urls.get(params["requestId"], "?")
            if url.startswith(site):
                found.append(f"request failed: {url} ({params.get('errorText')})")
        elif method == "Network.responseReceived" and params["response"]["status"] >= 400:
            found.append(f"HTTP {params['response']['status']}: {params['response']['url']}")
    return found


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def served_site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The site as ``mkdocs build --strict`` builds it, served on 127.0.0.1."""
    chromium()
    folder = tmp_path_factory.mktemp("site")
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(folder),
         "--config-file", str(ROOT / "mkdocs.yml")],
        cwd=ROOT, capture_output=True, text=True, timeout=110,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stderr[-3000:]}"
    handler = functools.partial(_QuietHandler, directory=str(folder))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DevTools]:
    """One headless Chromium for the module's pages."""
    tools = DevTools(chromium(), tmp_path_factory.mktemp("chromium-profile"))
    try:
        tools.send("Browser.getVersion")
        yield tools
    finally:
        tools.close()


def keep_screenshot(report: PageReport, name: str, tmp_path: Path) -> Path:
    folder = Path(os.environ.get("QUEEN_SYNC_SCREENSHOTS") or tmp_path)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.png"
    path.write_bytes(report.screenshot)
    return path


@pytest.mark.timeout(90)
@pytest.mark.parametrize(("page", "figures"), [
    ("", 0), ("recipes/03-leader-election/", 1), ("recipes/06-notebook-locks/", 0)],
    ids=["home", "leader-election-recipe", "notebook-locks-recipe"])
def test_the_page_renders_without_errors_and_with_its_figures_loaded(
        served_site: str, browser: DevTools, tmp_path: Path, page: str, figures: int) -> None:
    report = load(browser, served_site + page, served_site)
    shot = keep_screenshot(report, page.strip("/").replace("/", "-") or "home", tmp_path)
    assert not report.problems, f"{page or 'home'} page: " + "\n".join(report.problems)
    broken = [image for image in report.images if not image["complete"] or image["width"] == 0]
    assert not broken, f"{page or 'home'} page: images not loaded: {broken}"
    plots = [image for image in report.images if image["src"].startswith("data:image/png")]
    assert len(plots) >= figures, (
        f"{page or 'home'} page shows {len(plots)} figures, expected {figures}: {report.images}")
    assert report.screenshot.startswith(b"\x89PNG") and len(report.screenshot) > 10_000, (
        f"the screenshot at {shot} is not a rendered page ({len(report.screenshot)} bytes)")


def test_the_problem_finder_reports_console_errors_and_failed_site_requests() -> None:
    site = "http://127.0.0.1:1/"
    events = [
        {"method": "Network.requestWillBeSent",
         "params": {"requestId": "1", "request": {"url": site + "missing.css"}}},
        {"method": "Network.loadingFailed", "params": {"requestId": "1", "errorText": "x"}},
        {"method": "Network.requestWillBeSent",
         "params": {"requestId": "2", "request": {"url": "https://api.github.com/repos/a/b"}}},
        {"method": "Network.loadingFailed", "params": {"requestId": "2", "errorText": "blocked"}},
        {"method": "Network.requestWillBeSent",
         "params": {"requestId": "3", "request": {"url": "https://fonts.example/f.css"}}},
        {"method": "Runtime.consoleAPICalled",
         "params": {"type": "error", "args": [{"value": "boom"}]}},
    ]
    found = problems_in(events, site)
    assert found == ["third-party request: https://fonts.example/f.css",
                     f"request failed: {site}missing.css (x)", "console.error: ['boom']"], (
        f"found {found}")
