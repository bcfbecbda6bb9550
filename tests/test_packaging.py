"""What ``pip install`` puts on a user's path: ``queen_sync`` with its recipes inside, typed.

The recipes live in the repository's top-level ``recipes/`` folder but install as
``queen_sync.recipes``, so no generic top-level ``recipes`` package reaches a user's
environment. A copy of the sources is built with the project's own build backend
(a regular and an editable wheel), each wheel installed with pip into a folder of its
own, and imported from a fresh interpreter outside the repository.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

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
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, into / name)
    return into


def _build(tree: Path, hook: str) -> Path:
    dist = tree / "dist"
    dist.mkdir(exist_ok=True)
    done = subprocess.run([sys.executable, "-c", BUILD, hook, str(dist)], cwd=tree,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"{hook} failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
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
def wheel(tree: Path) -> Path:
    return _build(tree, "build_wheel")


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
