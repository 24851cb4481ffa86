"""The code location ``workspace.yaml`` loads: the recipe in ``$TOKENMILL_RECIPE``
(default ``recipes/demo.yaml``, relative to the repo root) turned into definitions."""

from __future__ import annotations

from pathlib import Path

from pipelines.build import build_definitions
from tokenmill.recipe import load_recipe, recipe_path

REPO_ROOT = Path(__file__).resolve().parents[1]

defs = build_definitions(load_recipe(recipe_path(root=REPO_ROOT)))
