"""A Griffe extension for the API pages: read ``recipes/`` as ``queen_sync.recipes``.

The recipes install as ``queen_sync.recipes`` through a setuptools ``package-dir``
mapping, which a static reading of the source tree cannot see: Griffe finds
``queen_sync/`` and walks only its own folder. This mounts the ``recipes`` package,
read from the repository's top-level folder, as a member of ``queen_sync`` once the
package face is read, so ``::: queen_sync.recipes.run_queue`` resolves.
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
