"""What ``pip install`` puts on a user's path: ``queen_sync`` with its recipes inside, typed.

The recipes live in the repository's top-level ``recipes/`` folder but install as
``queen_sync.recipes``, so no generic top-level ``recipes`` package reaches a user's
environment. A copy of the sources is built with the project's own build backend
(a regular and an editable wheel), each wheel installed with pip into a folder of its
own, and imported from a fresh interpreter outside the repository.

The wheel's metadata is what a maintainer reviews (an SPDX licence with its text,
classifiers, project URLs, dependencies). Last, ``pip install .`` into a fresh virtual
environment, as a user does: the command line, both test brokers and the recipes work
there with nothing but the declared dependencies.
"""

from __future__ import annotations

import email
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from email.message import Message
from pathlib import Path
from typing import Optional

import pytest
import typing_extensions

ROOT = Path(__file__).resolve().parents[1]
# Calls one PEP 517 hook of the project's backend (build_wheel or build_editable).
BUILD = ("import sys; from setuptools import build_meta as backend; "
         "print(getattr(backend, sys.argv[1])(sys.argv[2]))")
PROBE = r"""
import importlib.util, json, os, site, sys
if len(sys.argv) > 1:
    site.addsitedir(sys.argv[1])  # runs the editable install's .pth hook
from queen_sync.recipes.run_queue import RunQueue
import queen_sync.recipes
here = os.path.dirname(queen_sync.recipes.__file__)
print(json.dumps({"top_level_recipes": importlib.util.find_spec("recipes") is not None,
                  "recipes_dir": here, "typed": os.path.exists(os.path.join(here, "py.typed")),
                  "run_queue": RunQueue.__module__}))
"""


def _sources(into: Path) -> Path:
    """A copy of what a build reads, so building writes nothing into the repository."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for folder in ("queen_sync", "recipes"):
        shutil.copytree(ROOT / folder, into / folder, ignore=ignore)
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy2(ROOT / name, into / name)
    return into


def _build(tree: Path, hook: str, warnings: Optional[list[str]] = None) -> Path:
    """Run one build hook; what the backend warned is appended to ``warnings``."""
    dist = tree / "dist"
    dist.mkdir(exist_ok=True)
    done = subprocess.run([sys.executable, "-W", "always", "-c", BUILD, hook, str(dist)],
                          cwd=tree, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"{hook} failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
    if warnings is not None:
        warnings.extend(line for line in done.stderr.splitlines() if "Warning" in line)
    return dist / done.stdout.strip().splitlines()[-1]


def _install(wheel: Path, target: Path) -> Path:
    done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                           "--no-index", "--target", str(target), str(wheel)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"pip install {wheel.name} failed:\n{done.stderr[-3000:]}"
    return target


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _sources(tmp_path_factory.mktemp("src"))


@pytest.fixture(scope="module")
def build_warnings() -> list[str]:
    return []


@pytest.fixture(scope="module")
def wheel(tree: Path, build_warnings: list[str]) -> Path:
    return _build(tree, "build_wheel", build_warnings)


def _wheel_names(wheel: Path) -> set[str]:
    with zipfile.ZipFile(wheel) as archive:
        return set(archive.namelist())


class TestTheWheel:
    def test_it_ships_every_module_with_the_recipes_under_queen_sync_and_py_typed_twice(
            self, wheel: Path) -> None:
        names = _wheel_names(wheel)
        expected = {p.relative_to(ROOT).as_posix() for p in (ROOT / "queen_sync").rglob("*.py")}
        expected |= {f"queen_sync/recipes/{p.name}" for p in (ROOT / "recipes").glob("*.py")}
        expected |= {"queen_sync/py.typed", "queen_sync/recipes/py.typed"}
        top = {name.split("/", 1)[0] for name in names if ".dist-info/" not in name}

        assert not expected - names, f"the wheel misses {sorted(expected - names)}"
        assert top == {"queen_sync"}, f"the wheel installs top-level {sorted(top)}"

    def test_its_console_script_names_a_module_the_wheel_ships(self, wheel: Path) -> None:
        with zipfile.ZipFile(wheel) as archive:
            entry = next(n for n in archive.namelist() if n.endswith("entry_points.txt"))
            text = archive.read(entry).decode()
        target = text.split("queen-sync = ", 1)[1].split(":", 1)[0].strip()

        assert target.replace(".", "/") + ".py" in _wheel_names(wheel), (
            f"the queen-sync script points at {target}, which the wheel does not ship:\n{text}")


def _metadata(wheel: Path) -> Message:
    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        return email.message_from_bytes(archive.read(name))


def _setuptools_floor() -> tuple[int, ...]:
    """The lowest setuptools ``[build-system] requires`` admits, as a version tuple."""
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    requires = text.split("[build-system]", 1)[1].split("[", 2)[1]
    found = re.search(r"setuptools\s*>=\s*([0-9.]+)", requires)
    assert found, f"[build-system] sets no lower bound on setuptools: {requires!r}"
    return tuple(int(part) for part in found.group(1).split("."))


REPOSITORY = "https://github.com/queen-sync/queen-sync"
URL_LABELS = ("Homepage", "Documentation", "Source", "Issues", "Changelog")


class TestTheMetadata:
    def test_the_licence_is_an_spdx_expression_with_its_text_shipped_and_no_warning(
            self, wheel: Path, build_warnings: list[str]) -> None:
        meta = _metadata(wheel)
        licences = [n for n in _wheel_names(wheel) if ".dist-info/licenses/" in n]

        assert meta.get("License-Expression") == "Apache-2.0", (
            f"no SPDX licence expression: License-Expression={meta.get('License-Expression')}, "
            f"License={meta.get('License')}")
        assert meta.get_all("License-File") == ["LICENSE"], meta.get_all("License-File")
        assert [n.rsplit("/", 1)[1] for n in licences] == ["LICENSE"], licences
        with zipfile.ZipFile(wheel) as archive:
            text = archive.read(licences[0]).decode()
        assert "Apache License" in text and "Version 2.0" in text, text[:200]
        assert not [w for w in build_warnings if "licen" in w.lower()], build_warnings

    def test_the_build_asks_for_a_setuptools_that_reads_the_spdx_licence(self) -> None:
        # setuptools reads `license = "<SPDX>"` and `license-files` from version 77 on.
        assert _setuptools_floor() >= (77,), (
            f"[build-system] admits setuptools {_setuptools_floor()}, older than 77, which "
            "rejects the SPDX licence string")

    def test_the_classifiers_say_posix_beta_and_typed_and_leave_the_licence_to_spdx(
            self, wheel: Path) -> None:
        classifiers = _metadata(wheel).get_all("Classifier") or []

        for wanted in ("Operating System :: POSIX", "Development Status :: 4 - Beta",
                       "Intended Audience :: Developers", "Typing :: Typed"):
            assert wanted in classifiers, f"no {wanted!r} among {classifiers}"
        assert not [c for c in classifiers if c.startswith("License ::")], (
            f"a licence classifier beside the SPDX expression: {classifiers}")

    def test_the_project_urls_point_at_the_one_repository_and_its_docs_site(
            self, wheel: Path) -> None:
        urls = dict(entry.split(", ", 1) for entry in _metadata(wheel).get_all("Project-URL") or [])

        assert sorted(urls) == sorted(URL_LABELS), f"project URLs: {urls}"
        for label in ("Source", "Issues", "Changelog"):
            assert urls[label].startswith(REPOSITORY), f"{label} is {urls[label]}"
        assert urls["Changelog"].endswith("CHANGELOG.md"), urls["Changelog"]

    def test_it_depends_on_requests_typing_extensions_and_platformdirs_only(
            self, wheel: Path) -> None:
        needs = sorted(re.split(r"[ <>=!;\[]", entry, maxsplit=1)[0]
                       for entry in _metadata(wheel).get_all("Requires-Dist") or []
                       if "extra ==" not in entry)

        assert needs == ["platformdirs", "requests", "typing-extensions"], needs

    def test_the_source_archive_carries_the_licence_changelog_and_contributing_guide(
            self, tmp_path: Path) -> None:
        tree = _sources(tmp_path / "src")
        for name in ("CHANGELOG.md", "CONTRIBUTING.md", "MANIFEST.in"):
            assert (ROOT / name).exists(), f"the repository has no {name}"
            shutil.copy2(ROOT / name, tree / name)
        with tarfile.open(_build(tree, "build_sdist")) as archive:
            names = {member.name.split("/", 1)[1] for member in archive.getmembers()
                     if "/" in member.name}

        missing = {"LICENSE", "CHANGELOG.md", "CONTRIBUTING.md"} - names
        assert not missing, f"the sdist misses {sorted(missing)}"


def _probe(site_dir: Path, cwd: Path, *, editable: bool) -> dict[str, object]:
    """Import the recipes in a fresh interpreter that sees only the install and its deps."""
    # The one runtime dependency an import needs, copied alone: this environment's own
    # site-packages holds its own editable queen_sync, whose hook would answer instead.
    deps = cwd / "deps"
    deps.mkdir()
    shutil.copy2(typing_extensions.__file__, deps)
    path = [str(deps)] if editable else [str(site_dir), str(deps)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    # -S: no site-packages of this environment at all, only the install under test.
    argv = [sys.executable, "-S", "-c", PROBE, *([str(site_dir)] if editable else [])]
    done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, f"importing queen_sync.recipes failed:\n{done.stderr[-3000:]}"
    found: dict[str, object] = json.loads(done.stdout)
    return found


class TestAnInstall:
    def test_a_regular_install_has_queen_sync_recipes_typed_and_no_top_level_recipes(
            self, wheel: Path, tmp_path: Path) -> None:
        site_dir = _install(wheel, tmp_path / "site")
        found = _probe(site_dir, tmp_path, editable=False)

        assert found["top_level_recipes"] is False, f"`import recipes` still works: {found}"
        assert found["recipes_dir"] == str(site_dir / "queen_sync" / "recipes"), found
        assert found["typed"] is True, f"queen_sync/recipes has no py.typed: {found}"
        assert found["run_queue"] == "queen_sync.recipes.run_queue", found

    def test_an_editable_install_maps_queen_sync_recipes_onto_the_recipes_folder(
            self, tree: Path, tmp_path: Path) -> None:
        site_dir = _install(_build(tree, "build_editable"), tmp_path / "site")
        found = _probe(site_dir, tmp_path, editable=True)

        assert found["top_level_recipes"] is False, f"`import recipes` still works: {found}"
        assert found["recipes_dir"] == str(tree / "recipes"), (
            f"queen_sync.recipes is not the source folder, so edits would not show: {found}")
        assert found["run_queue"] == "queen_sync.recipes.run_queue", found


# Run by the fresh environment's interpreter, isolated (-I), outside the repository.
FRESH_PROBE = r"""
import importlib.util, json
from queen_sync.recipes.run_queue import RunQueue
from queen_sync.testing import FakeBroker, LocalBroker
report = {"top_level_recipes": importlib.util.find_spec("recipes") is not None,
          "responses": importlib.util.find_spec("responses") is not None,
          "run_queue": RunQueue.__module__}
for kind, broker in (("FakeBroker", FakeBroker()), ("LocalBroker", LocalBroker())):
    with broker, broker.client() as q:
        lock = q.lock("job", ttl=30)
        report[kind] = [lock.acquire(), not q.lock("job", ttl=30).acquire(), lock.release()]
print(json.dumps(report))
"""


class FreshEnv:
    """A virtual environment holding only ``pip install <copy of the tree>`` and its deps."""

    def __init__(self, folder: Path, tree: Path) -> None:
        self.folder = folder
        self.bin = folder / "bin"
        # No pip of its own (ensurepip is the slow part): this pip installs into it.
        made = subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(folder)],
                              capture_output=True, text=True, timeout=120)
        assert made.returncode == 0, f"python -m venv failed:\n{made.stderr[-3000:]}"
        done = subprocess.run([sys.executable, "-m", "pip", "--python", str(self.bin / "python"),
                               "install", "-q", str(tree)],
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, f"pip install . failed:\n{done.stderr[-3000:]}"

    def run(self, argv: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "QUEEN_URL")}
        env["QUEEN_URL"] = "sqlite://" + str(cwd / "queen.db")
        return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True,
                              timeout=60)


@pytest.fixture(scope="module")
def fresh(tmp_path_factory: pytest.TempPathFactory) -> FreshEnv:
    tree = _sources(tmp_path_factory.mktemp("fresh-src"))
    return FreshEnv(tmp_path_factory.mktemp("fresh") / "venv", tree)


class TestAFreshVirtualEnvironment:
    def test_queen_sync_version_prints_the_version(self, fresh: FreshEnv,
                                                   tmp_path: Path) -> None:
        from queen_sync import __version__

        done = fresh.run([str(fresh.bin / "queen-sync"), "--version"], tmp_path)

        assert done.returncode == 0, f"queen-sync --version failed:\n{done.stderr}"
        assert done.stdout.split() == ["queen-sync", __version__], done.stdout

    def test_queen_sync_run_exits_126_for_a_file_that_cannot_run_and_127_for_none(
            self, fresh: FreshEnv, tmp_path: Path) -> None:
        garbage = tmp_path / "not-a-program"
        garbage.write_bytes(b"\x00\x01 not a script, not an executable")
        garbage.chmod(0o755)
        queen_sync = str(fresh.bin / "queen-sync")

        cannot = fresh.run([queen_sync, "run", "job", "--ttl", "30s", "--", str(garbage)],
                           tmp_path)
        missing = fresh.run([queen_sync, "run", "job", "--ttl", "30s", "--",
                             str(tmp_path / "no-such-command")], tmp_path)

        for done, code in ((cannot, 126), (missing, 127)):
            assert done.returncode == code, (
                f"exit {done.returncode}, not {code}:\n{done.stdout}{done.stderr}")
            assert "Traceback" not in done.stderr, done.stderr
            assert len(done.stderr.strip().splitlines()) == 1, done.stderr

    def test_both_test_brokers_serve_a_lock_and_the_recipes_live_under_queen_sync(
            self, fresh: FreshEnv, tmp_path: Path) -> None:
        done = fresh.run([str(fresh.bin / "python"), "-I", "-c", FRESH_PROBE], tmp_path)

        assert done.returncode == 0, f"the fresh install failed:\n{done.stderr[-3000:]}"
        found = json.loads(done.stdout)
        assert found["responses"] is False, "the fresh environment has responses: no proof"
        assert found["FakeBroker"] == [True, True, True], f"FakeBroker: {found}"
        assert found["LocalBroker"] == [True, True, True], f"LocalBroker: {found}"
        assert found["top_level_recipes"] is False, f"`import recipes` works: {found}"
        assert found["run_queue"] == "queen_sync.recipes.run_queue", found
