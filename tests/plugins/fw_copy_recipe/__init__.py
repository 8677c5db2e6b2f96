"""A recipe from outside fw, installed through the `fw.recipes` entry-point group (tests/test_recipe_plugin.py).

It teaches the policy to copy: each row is random tokens followed by the same tokens again, and the loss is
the cross-entropy of the second half only. It uses nothing of fw but the recipe contract.
"""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, IterableDataset

from framework.recipe import Requirements, StepContext


class _CopyRows(IterableDataset):
    def __init__(self, vocab: int, half: int, rows: int, seed: int):
        self.vocab, self.half, self.rows, self.seed = vocab, half, rows, seed

    def __iter__(self):
        gen = torch.Generator().manual_seed(self.seed)
        while True:
            first = torch.randint(3, self.vocab, (self.rows, self.half), generator=gen)
            yield torch.cat([first, first], dim=1)


class CopyRecipe:
    """Automatic optimization: the framework steps the policy's optimizer; the recipe returns the loss."""

    HALF = 6

    @classmethod
    def requirements(cls, cfg: dict) -> Requirements:
        return Requirements(automatic_optimization=True)

    def __init__(self, cfg: dict, tokenizer):
        self.cfg = cfg
        self.vocab = min(tokenizer.vocab_size, 24)
        self.batches = 0

    def train_dataloader(self, ctx: StepContext) -> DataLoader:
        dataset = _CopyRows(self.vocab, self.HALF, self.cfg["data"]["batch_size"], self.cfg["seed"] + ctx.rank)
        return DataLoader(dataset, batch_size=None)

    def training_step(self, ctx: StepContext, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        logits = ctx.policy(batch[:, :-1])[:, self.HALF - 1:]
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), batch[:, self.HALF:].flatten())
        ctx.log("loss", loss.detach())
        self.batches += 1
        return loss

    def state_dict(self) -> dict:
        return {"batches": self.batches}

    def load_state_dict(self, state: dict) -> None:
        self.batches = int(state["batches"])
