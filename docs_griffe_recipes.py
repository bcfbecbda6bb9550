"""Griffe extensions for the API pages: mount the recipes, hide the handle's internals.

The recipes install as ``queen_sync.recipes`` through a setuptools ``package-dir``
mapping, which a static reading of the source tree cannot see: Griffe finds
``queen_sync/`` and walks only its own folder. ``MountRecipes`` mounts the ``recipes``
package, read from the repository's top-level folder, as a member of ``queen_sync``
once the package face is read, so ``::: queen_sync.recipes.run_queue`` resolves.

``HideLockInternals`` drops from ``Lock`` the members its renewer, transactions and
notebook layer call. They carry public names so that no module reaches into another's
privates (``tests/test_layout.py``), but an application never calls them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import griffe

ROOT = Path(__file__).resolve().parent


class MountRecipes(griffe.Extension):
    """Graft the ``recipes`` package onto ``queen_sync`` as its ``recipes`` member."""

    def on_module_members(self, *, mod: griffe.Module, **kwargs: Any) -> None:
        if mod.path != "queen_sync":
            return
        recipes = griffe.load("recipes", search_paths=[str(ROOT)], docstring_parser="google")
        if isinstance(recipes, griffe.Module):
            mod.set_member("recipes", recipes)


# What Lock offers its renewer, transactions and the notebook layer, and no app calls.
LOCK_INTERNALS = frozenset({
    "deadline", "renew_due", "try_begin_call", "end_call", "await_renewal", "taken_in",
    "in_block", "renew_op", "apply_renewal", "renewal_failed", "mark_lost", "forget_after_fork",
    "begin_release", "end_release", "take_renewal", "release_strays", "store",
})


class HideLockInternals(griffe.Extension):
    """Remove ``LOCK_INTERNALS`` from ``Lock`` before the API page renders it."""

    def on_class_members(self, *, cls: griffe.Class, **kwargs: Any) -> None:
        if cls.path != "queen_sync._handle.lock.Lock":
            return
        for name in LOCK_INTERNALS & set(cls.members):
            cls.del_member(name)
