"""Recipes: the registry of training recipes (a plain dict; see docs/DESIGN.md "Recipes and the module")."""

from recipes.grpo import GRPORecipe
from recipes.ppo import PPORecipe
from recipes.sft import SFTRecipe

RECIPES = {"sft": SFTRecipe, "grpo": GRPORecipe, "ppo": PPORecipe}
