"""Config: compose (Hydra, once, in the launcher), the typed schema, and validation."""

from partrain.config.compose import compose_config, find_recipe, known_recipes
from partrain.config.validate import World, check_startable, resolve_and_validate, resolve_world

__all__ = ["compose_config", "find_recipe", "known_recipes", "World",
           "check_startable", "resolve_and_validate", "resolve_world"]
