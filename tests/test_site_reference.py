"""The API reference is complete: every public callable has a docstring the site renders.

mkdocstrings renders a member without a docstring as a bare signature, or not at all,
so a missing docstring is a hole in the reference. The walk covers what a user can
import: ``queen_sync.__all__``, ``queen_sync.testing.__all__`` and the ``__all__`` of
each public ``queen_sync.recipes`` module, each exported class's own members, and the
classes they hand out as attributes (``q.kv.op``, ``q.locks.op``).

The built site is checked too: the API and testing pages list what the walk found,
``Lock``'s package-internal interface is left out, the changelog page carries
``CHANGELOG.md``, the sitemap has addresses (mkdocs' ``site_url``, which pyproject's URLs
must agree with), and each recipe page shows its notebook's stored outputs and figures.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
import os
import pkgutil
import re
import subprocess
import sys
from functools import cached_property
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

import queen_sync
import queen_sync.testing

ROOT = Path(__file__).resolve().parents[1]


def public_modules() -> list[ModuleType]:
    """The modules whose ``__all__`` is what a user imports."""
    recipes = importlib.import_module("queen_sync.recipes")
    found = [queen_sync, queen_sync.testing]
    for info in pkgutil.iter_modules(recipes.__path__):
        if not info.name.startswith("_"):
            found.append(importlib.import_module(f"queen_sync.recipes.{info.name}"))
    return found


def own_doc(member: Any) -> str | None:
    """The docstring written on ``member`` itself, not one inherited or generated."""
    if isinstance(member, (staticmethod, classmethod)):
        member = member.__func__
    if isinstance(member, property):
        member = member.fget
    if isinstance(member, cached_property):
        member = member.func
    doc = getattr(member, "__doc__", None)
    return doc if isinstance(doc, str) else None


def documented_members(cls: type) -> dict[str, Any]:
    """The public methods and properties ``cls`` defines itself (what the reference lists)."""
    kinds = (staticmethod, classmethod, property, cached_property)
    return {name: value for name, value in vars(cls).items()
            if not name.startswith("_") and (inspect.isfunction(value) or isinstance(value, kinds))}


def public_classes() -> dict[str, type]:
    """Every exported class, and the classes they hand out as attributes (``Kv.op``)."""
    found: dict[str, type] = {}
    for module in public_modules():
        for name in module.__all__:
            obj = getattr(module, name)
            if inspect.isclass(obj):
                found[f"{module.__name__}.{name}"] = obj
    for where, cls in list(found.items()):
        for name, value in vars(cls).items():
            if (not name.startswith("_") and inspect.isclass(value)
                    and value.__module__.startswith("queen_sync")):
                found[f"{where}.{name}"] = value
    return found


def docstring_problems() -> list[str]:
    """Every exported function, class and class member whose docstring is missing or bad."""
    problems: list[str] = []
    for where, cls in public_classes().items():
        problems += [f"{where}: {p}" for p in [first_line_problem(cls.__doc__)] if p]
        for member, value in documented_members(cls).items():
            problem = first_line_problem(own_doc(value))
            if problem:
                problems.append(f"{where}.{member}: {problem}")
    for module in public_modules():
        for name in module.__all__:
            obj = getattr(module, name)
            if inspect.isfunction(obj):
                problem = first_line_problem(obj.__doc__)
                if problem:
                    problems.append(f"{module.__name__}.{name}: {problem}")
    return problems


def first_line_problem(doc: str | None) -> str | None:
    """Why ``doc`` does not open with a one-line sentence (None when it does)."""
    if doc is None or not doc.strip():
        return "no docstring"
    first = inspect.cleandoc(doc).splitlines()[0]
    if not re.match(r"^[A-Z`(\"']", first) or not first.rstrip().endswith((".", ":")):
        return f"first line is not a sentence: {first!r}"
    return None


class TestEveryPublicCallableIsDocumented:
    def test_every_exported_function_class_and_method_opens_with_a_sentence(self) -> None:
        problems = docstring_problems()
        assert not problems, (
            f"{len(problems)} public names have no docstring, or one whose first line is not "
            "a sentence (Google style: one line, capitalised, ending in a full stop):\n"
            + "\n".join(problems))

    def test_the_walk_finds_a_missing_docstring_and_a_first_line_that_is_not_a_sentence(
            self) -> None:
        class Probe:
            """A probe."""

            def bare(self) -> None:
                pass

            @property
            def lowercase(self) -> int:
                """the value"""
                return 1

        found = {name: first_line_problem(own_doc(value))
                 for name, value in documented_members(Probe).items()}
        assert found["bare"] == "no docstring", f"a bare method passed: {found}"
        assert found["lowercase"] and "not a sentence" in found["lowercase"], (
            f"a lowercase first line passed: {found}")

    def test_the_walk_covers_the_testing_kit_and_the_recipes(self) -> None:
        names = {module.__name__ for module in public_modules()}
        assert {"queen_sync.testing", "queen_sync.recipes.run_queue",
                "queen_sync.recipes.leader_election",
                "queen_sync.recipes.fenced_export"} <= names, f"walked only {sorted(names)}"


def mkdocs_setting(key: str) -> str:
    """A top-level ``key: value`` of mkdocs.yml (empty when absent)."""
    text = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    found = re.search(rf"^{key}:[ \t]*[\"']?([^\"'\n]*)", text, re.M)
    return found.group(1).strip() if found else ""


def pyproject_urls() -> dict[str, str]:
    """``[project.urls]`` of pyproject.toml, keys lowercased, trailing slashes dropped."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:
        tomllib = pytest.importorskip("tomli")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    return {key.lower(): str(value).rstrip("/") for key, value in project.get("urls", {}).items()}


def multi_item_returns() -> list[str]:
    """Public members whose Returns section Griffe reads as several values, one per line.

    Google style reads each unindented line of a Returns section as one more returned
    value; a description that goes on for lines must indent its continuation.
    """
    import griffe

    found: list[str] = []
    pending: list[griffe.Object | griffe.Alias] = [
        griffe.load(name, search_paths=[str(ROOT)], docstring_parser="google")
        for name in ("queen_sync", "recipes")]
    while pending:
        obj = pending.pop()
        for name, member in obj.members.items():
            if name.startswith("_") or member.is_alias:
                continue
            if member.docstring is not None:
                found += [f"{member.path}: {len(section.value)} values"
                          for section in member.docstring.parsed
                          if section.kind.value in ("returns", "yields") and len(section.value) > 1]
            if member.is_class or member.is_module:
                pending.append(member)
    return found


class TestDocstringShape:
    def test_every_returns_section_describes_one_value(self) -> None:
        found = multi_item_returns()
        assert not found, (
            "these Returns sections render as several rows (indent the description's "
            "continuation lines):\n" + "\n".join(found))


class TestRepositoryUrls:
    def test_mkdocs_sets_the_repository_and_site_urls(self) -> None:
        for key in ("repo_url", "site_url"):
            assert mkdocs_setting(key).startswith("https://"), (
                f"mkdocs.yml sets no {key}: no repository link, and an empty sitemap")

    def test_pyproject_names_the_repository_and_docs_mkdocs_names(self) -> None:
        urls = pyproject_urls()
        assert "source" in urls or "repository" in urls, (
            f"pyproject's [project.urls] names no Source: {urls}")
        repo, site = mkdocs_setting("repo_url").rstrip("/"), mkdocs_setting("site_url").rstrip("/")
        for key in ("source", "repository", "issues", "changelog", "homepage"):
            if key in urls:
                assert urls[key].startswith(repo) or urls[key] == site, (
                    f"pyproject's {key} is {urls[key]}, outside mkdocs' repo_url {repo}")
        if "documentation" in urls:
            assert urls["documentation"] == site, (
                f"pyproject's documentation is {urls['documentation']}, mkdocs' site {site}")


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site as ``mkdocs build --strict`` builds it, once for this module."""
    folder = tmp_path_factory.mktemp("site")
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(folder),
         "--config-file", str(ROOT / "mkdocs.yml")],
        cwd=ROOT, capture_output=True, text=True, timeout=110,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stderr[-3000:]}"
    return folder


def lock_internals() -> frozenset[str]:
    """The names the API pages hide from ``Lock`` (kept in the site's Griffe extension)."""
    spec = importlib.util.spec_from_file_location("docs_griffe_recipes",
                                                  ROOT / "docs_griffe_recipes.py")
    assert spec is not None and spec.loader is not None, "docs_griffe_recipes.py is missing"
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    names: frozenset[str] = module.LOCK_INTERNALS
    return names


# What an application may call on a Lock: the API page documents exactly these.
LOCK_API = frozenset({
    "name", "owner", "ttl", "token", "ttl_seconds", "slot", "held", "remaining", "holders",
    "last_token", "engine_url",
    "acquire", "renew", "release", "on_lost", "guard", "check", "verify", "fence", "run",
})


class TestTheBuiltReference:
    def test_the_api_page_documents_every_kv_method_and_the_testing_kit(self, site: Path) -> None:
        api = (site / "reference" / "api" / "index.html").read_text(encoding="utf-8")
        kv = [name for name in documented_members(queen_sync.Kv)
              if f'id="queen_sync.Kv.{name}"' not in api]
        assert not kv, f"the API page has no entry for Kv.{kv}"
        testing = (site / "reference" / "testing" / "index.html").read_text(encoding="utf-8")
        missing = [name for name in queen_sync.testing.__all__
                   if f'id="queen_sync.testing.{name}"' not in testing]
        assert not missing, f"the testing page has no entry for {missing}"

    def test_the_api_page_hides_the_locks_internal_interface(self, site: Path) -> None:
        internals = sorted(lock_internals())
        stale = [name for name in internals if name not in vars(queen_sync.Lock)]
        assert not stale, f"hidden names that Lock no longer has: {stale}"
        api = (site / "reference" / "api" / "index.html").read_text(encoding="utf-8")
        shown = [name for name in internals if f'id="queen_sync.Lock.{name}"' in api]
        assert not shown, f"the API page documents Lock's internal interface: {shown}"
        assert 'id="queen_sync.Lock.release"' in api, "the API page lost Lock.release"

    def test_every_public_lock_member_is_either_api_or_internal(self) -> None:
        members, internals = set(documented_members(queen_sync.Lock)), lock_internals()
        unsorted = sorted(members - LOCK_API - internals)
        assert not unsorted, (
            f"Lock has new public members {unsorted}: add each to LOCK_API here, or to "
            "LOCK_INTERNALS in docs_griffe_recipes.py if only the package calls it")
        both = sorted(LOCK_API & internals)
        assert not both, f"{both} are listed both as API and as internal"

    def test_lock_release_returns_one_bool(self, site: Path) -> None:
        api = (site / "reference" / "api" / "index.html").read_text(encoding="utf-8")
        start = api.index('id="queen_sync.Lock.release"')
        entry = api[start:api.index('id="queen_sync.Lock.', start + 1)]
        returns = entry[entry.index("Returns:"):]
        returns = returns[:returns.index("</table>")]
        rows = returns.count("<tr")
        assert rows == 2, f"Lock.release's Returns renders {rows - 1} rows, not one"

    def test_the_changelog_page_carries_the_changelog(self, site: Path) -> None:
        page = site / "changelog" / "index.html"
        assert page.exists(), "the site has no changelog page"
        changelog = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
        headings = [line for line in changelog.splitlines() if line.startswith("## ")]
        shown = page.read_text(encoding="utf-8")
        missing = [h for h in headings if re.sub(r"[\[\]#`]", "", h).split()[0] not in shown]
        assert headings and not missing, (
            f"the changelog page does not show CHANGELOG.md's sections {missing or headings}")

    def test_the_sitemap_lists_the_pages_under_the_site_url(self, site: Path) -> None:
        sitemap = (site / "sitemap.xml").read_text(encoding="utf-8")
        assert "<loc>https://" in sitemap, f"the sitemap lists no page: {sitemap[:300]}"


def stored_figures(notebook: Path) -> int:
    """How many PNG figures the stored notebook shows."""
    cells = json.loads(notebook.read_text(encoding="utf-8"))["cells"]
    return sum("image/png" in out.get("data", {}) for cell in cells
               for out in cell.get("outputs", []))


class TestTheBuiltRecipePages:
    @pytest.mark.parametrize("notebook", sorted((ROOT / "notebooks").glob("0*.ipynb")),
                             ids=lambda p: p.stem)
    def test_the_recipe_page_shows_the_notebooks_outputs_and_figures(
            self, site: Path, notebook: Path) -> None:
        page = (site / "recipes" / notebook.stem / "index.html").read_text(encoding="utf-8")
        assert "In&nbsp;[&nbsp;]" not in page and "In [ ]" not in page, (
            f"{notebook.stem}'s page shows cells that never ran")
        figures = page.count('<img alt="No description has been provided for this image"')
        assert figures == stored_figures(notebook), (
            f"{notebook.stem}'s page shows {figures} figures, the notebook holds "
            f"{stored_figures(notebook)}")
        assert "jp-OutputArea-output" in page, f"{notebook.stem}'s page shows no output"
