"""fw's built-in recipes (sft, grpo, ppo), registered under the `fw.recipes` entry-point group in
pyproject.toml; `framework.recipe` holds the contract they implement."""
