"""The recipe contract: what a training recipe declares, the step context it trains through, and where
recipes are found.

A recipe owns its data and its loss; the framework owns the models, optimizers, clipping, the
optimizer-step hooks, metrics and checkpoints. Recipes are installed under the entry-point group
`fw.recipes` (name = the config's `recipe:` value, object = the recipe class), so a package of your own
adds one exactly as fw adds its built-ins (see pyproject.toml).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib.metadata import EntryPoint, entry_points
from typing import TYPE_CHECKING, Any, Protocol

from framework.errors import FwError

if TYPE_CHECKING:   # annotations only: listing the installed recipes imports no torch
    import torch
    from torch.utils.data import DataLoader

ENTRY_POINT_GROUP = "fw.recipes"


@dataclass(frozen=True)
class OptimizerRole:
    """One optimizer of a recipe: its role name, the model it trains and the config section holding its
    `lr`, `weight_decay` and `max_grad_norm` (betas, eps and fused always come from `optimizer:`)."""

    name: str
    model: str                   # "policy" | "value"
    section: tuple[str, ...]     # path into the config, e.g. ("optimizer",) or ("ppo", "critic")


POLICY = OptimizerRole("policy", "policy", ("optimizer",))


@dataclass(frozen=True)
class Requirements:
    """What a recipe needs from the framework, declared before any model is built."""

    automatic_optimization: bool
    optimizers: tuple[OptimizerRole, ...] = (POLICY,)
    value_model: bool = False
    reference_model: bool = False
    # DDP must look for parameters without gradients (e.g. separate policy and critic backwards).
    find_unused_parameters: bool = False
    # trainer.precision values this recipe cannot train under, each with the reason.
    unsupported_precisions: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        names = [r.name for r in self.optimizers]
        problem = None
        if len(set(names)) != len(names):
            problem = f"optimizer roles {names} repeat a name"
        elif [r.name for r in self.optimizers if r.model == "policy"] != ["policy"]:
            problem = "exactly one optimizer role trains the policy model, and it is named 'policy'"
        elif any(r.model not in ("policy", "value") for r in self.optimizers):
            problem = "an optimizer role's model is 'policy' or 'value'"
        elif any(r.model == "value" for r in self.optimizers) and not self.value_model:
            problem = "an optimizer role trains the value model, but value_model is False"
        elif self.automatic_optimization and len(self.optimizers) != 1:
            problem = "automatic optimization steps one optimizer: the policy's"
        if problem:
            raise FwError(f"recipe requirements: {problem}")


@dataclass(frozen=True)
class BatchShapes:
    """The tensor shapes of one training step on one process, for the memory plan (framework/memory_plan.py).

    Upper bounds: the plan must hold for the largest micro-batch the recipe can form under `cfg`.
    """

    rows: int                # sequences in the largest training micro-batch
    seq_len: int             # tokens of its longest row (the model's input width)
    loss_tokens: int         # rows of the loss's hidden states (tokens whose logprob the loss takes)
    packed: bool = False     # the model gets position_ids: attention holds a [seq_len, seq_len] mask per row
    rollout_rows: int = 0    # sequences generated per step (0: the recipe does not generate)
    prompt_len: int = 0      # the longest prompt, in tokens (the KV cache holds prompt_len + new_tokens)
    new_tokens: int = 0      # the longest completion, in tokens
    scoring_rows: int = 0    # rows of a no-grad forward over the rollout batch at once (reference, old values)
    tokens: int = 0          # the micro-batch's tokens where fewer than rows x seq_len (shared prompts);
                             # 0: rows x seq_len

    def __post_init__(self) -> None:
        if min(self.rows, self.seq_len) < 1 or min(self.loss_tokens, self.rollout_rows, self.prompt_len,
                                                     self.new_tokens, self.scoring_rows, self.tokens) < 0:
            raise FwError(f"recipe batch shapes: rows and seq_len must be >= 1 and the counts >= 0, got {self}")


class StepContext(Protocol):
    """The narrow view of the training module that a recipe trains through (framework/module.py's
    `ModuleContext` provides it).

    `backward` and `step` are for manual optimization; under automatic optimization the recipe returns
    its loss from `training_step` and Lightning does both.
    """

    @property
    def policy(self) -> torch.nn.Module: ...

    @property
    def value(self) -> torch.nn.Module | None:
        """The value model, when `Requirements.value_model`."""

    @property
    def reference(self) -> torch.nn.Module | None:
        """The frozen reference model (eval mode), when `Requirements.reference_model`."""

    @property
    def device(self) -> torch.device: ...

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    @property
    def policy_version(self) -> int:
        """Policy optimizer steps taken so far (saved in checkpoints)."""

    def steps_left(self) -> bool:
        """False once `trainer.max_steps` policy optimizer steps are done."""

    def backward(self, loss: torch.Tensor) -> None:
        """Backpropagate `loss` (precision plugin and DDP included); gradients accumulate until `step`."""

    def step(self, role: str) -> None:
        """One optimizer step of `role`: clip to its `max_grad_norm`, `before_optimizer_step`, step,
        `after_optimizer_step`, zero the gradients, then the LR schedule (policy)."""

    def log(self, name: str, value: torch.Tensor | float, weight: torch.Tensor | float | None = None,
            reduce: str = "mean") -> None:
        """Record a metric for the logging interval (see `FwModule.log_metric`)."""

    def logging_this_step(self) -> bool:
        """Whether the optimizer step in progress will be logged (for metrics too costly for every step)."""


class Recipe(Protocol):
    """A training recipe: constructed as `Recipe(cfg, tokenizer)` after `requirements(cfg)` was honoured."""

    @classmethod
    def requirements(cls, cfg: dict) -> Requirements: ...

    # Optional: without it the memory plan counts no activations, logits or KV cache for the recipe.
    @classmethod
    def batch_shapes(cls, cfg: dict, tokenizer: Any) -> BatchShapes:
        """The step's shapes under `cfg` (read before any model is built), for the memory plan."""

    # Optional: `fw validate` and `fw fit` report these (besides the schema's) before anything is built.
    @classmethod
    def config_problems(cls, cfg: dict) -> list[str]:
        """What the schema cannot check of `cfg`'s settings for this recipe, one line each starting with the key."""

    # Optional: without it every policy step counts as drawing a new batch (for the held-out eval bound).
    @classmethod
    def steps_per_batch(cls, cfg: dict) -> int:
        """The policy steps one batch of drawn training samples trains for (RL: a rollout batch's steps)."""

    # Optional: without it a resumed run counts as drawing a new batch at its first step.
    def continuing_steps(self, world_size: int) -> int:
        """The policy steps a resumed run first spends finishing the batch its checkpoint's run was cut inside."""

    def train_dataloader(self, ctx: StepContext) -> DataLoader: ...

    def training_step(self, ctx: StepContext, batch: Any, batch_idx: int) -> torch.Tensor | None: ...

    def state_dict(self) -> dict:
        """What a resume needs (saved in every checkpoint): tensors, Python numbers, strings, None, and lists,
        tuples, sets and dicts of them, which a weights-only load takes; anything else stops the save."""

    def load_state_dict(self, state: dict) -> None: ...


def installed_recipes() -> dict[str, EntryPoint]:
    """The recipes installed under the `fw.recipes` entry-point group, by name (nothing is imported)."""
    found: dict[str, EntryPoint] = {}
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        other = found.get(ep.name)
        if other is not None and other.value != ep.value:
            raise FwError(f"recipe '{ep.name}' is installed twice: {other.value} and {ep.value} "
                          f"(entry-point group {ENTRY_POINT_GROUP}); uninstall one of them")
        found[ep.name] = ep
    return found


def recipe_class(name: str) -> type[Recipe]:
    """The recipe class installed as `name`, imported and checked to be a recipe."""
    installed = installed_recipes()
    if name not in installed:
        known = ", ".join(sorted(installed)) or "none: is fw installed (pip install -e .)?"
        raise FwError(f"recipe: unknown recipe '{name}' (installed: {known})")
    target = installed[name].value
    try:
        cls = installed[name].load()
    except Exception as e:  # any import failure of a user package is reported the same way
        raise FwError(f"recipe: cannot import recipe '{name}' ({target}): {type(e).__name__}: {e}") from e
    missing = [m for m in ("requirements", "train_dataloader", "training_step", "state_dict", "load_state_dict")
               if not callable(getattr(cls, m, None))]
    if missing:
        raise FwError(f"recipe: '{name}' ({target}) is not a recipe: it has no {', '.join(missing)} "
                      "(see framework.recipe.Recipe)")
    return cls
