"""SFT: token-mean cross-entropy on the assistant / completion tokens of packed JSONL (or task) data."""

from __future__ import annotations

from typing import Any

import torch

import ops_cuda
from framework.data import IGNORE, ExampleStream, sft_dataloader
from framework.evaluation import ACCURACY_CHUNK, count_correct
from framework.models import Packing
from framework.recipe import BatchShapes, Requirements, StepContext


class SFTRecipe:
    """Supervised fine-tuning under Lightning's automatic optimization (accumulation and clipping included).

    Loss = − Σ log p(target) / (number of target tokens of the whole optimizer step: every micro-batch
    of the accumulation window on every rank), scaled to undo Lightning's 1/accumulate and DDP's 1/world
    averaging: the gradient is that of the exact token mean over the step's global batch.
    Token accuracy needs the argmax over the vocabulary, i.e. the full logits; it is computed without
    gradients, chunked, and only on steps that are logged.
    """

    ACCURACY_CHUNK = ACCURACY_CHUNK   # target tokens per logits chunk (the memory plan reads it here)

    def __init__(self, cfg: dict, tokenizer: Any):
        self.cfg = cfg
        self.tokenizer = tokenizer
        # reads and tokenizes the data now: errors come early
        self.stream = ExampleStream(cfg, tokenizer, train_on_prompt=cfg["sft"]["train_on_prompt"])
        self.position = 0                             # stream position after the last consumed batch

    @classmethod
    def requirements(cls, cfg: dict) -> Requirements:
        return Requirements(automatic_optimization=True)

    @classmethod
    def batch_shapes(cls, cfg: dict, tokenizer: Any) -> BatchShapes:
        # data.batch_size rows of at most data.max_seq_len tokens (exactly that when packed), every token
        # possibly a target; the sequences of a packed row go to varlen attention.
        d = cfg["data"]
        return BatchShapes(rows=d["batch_size"], seq_len=d["max_seq_len"],
                           loss_tokens=d["batch_size"] * d["max_seq_len"], packed=True)

    def train_dataloader(self, ctx: StepContext) -> torch.utils.data.DataLoader:
        return sft_dataloader(self.stream, self.position, self.cfg, self.tokenizer.pad_id, ctx.rank, ctx.world_size,
                              self.cfg["trainer"]["accumulate_grad_batches"], pin_memory=ctx.device.type == "cuda")

    def training_step(self, ctx: StepContext, batch: dict, batch_idx: int) -> torch.Tensor:
        policy = ctx.policy
        # the batch's sequence bounds come from the host, so the forward need not find them on the device
        packing = Packing(batch["cu_seqlens"], batch["max_seqlen"])
        hidden = policy(batch["input_ids"], position_ids=batch["position_ids"], return_hidden=True, packing=packing)
        targets = batch["targets"]
        # The loss tokens by the index the batch brings (those of `targets != IGNORE`, in order): a boolean
        # mask would make the host wait for the GPU to learn how many there are.
        index = batch["loss_index"]
        h, t = hidden.flatten(0, 1)[index], targets.flatten()[index]
        # Under autocast, fw::linear_logprob's autocast rule casts both operands to the region's dtype. The logits
        # are kept for the backward (one GEMM fewer) unless model.policy.keep_logits says otherwise.
        logprob, _ = ops_cuda.linear_logprob(h, policy.lm_head_weight, t, save_logits=policy.saves_logits)
        n_local = (targets != IGNORE).sum()
        nll = -logprob.sum()
        accumulate = self.cfg["trainer"]["accumulate_grad_batches"]
        loss = nll * (ctx.world_size * accumulate / max(batch["step_targets"], 1))
        # Reported loss: the token mean over micro-batches and ranks (weights = token counts).
        ctx.log("loss", nll.detach() / n_local.clamp(min=1), weight=n_local)
        ctx.log("tokens", batch["num_tokens"], reduce="sum")
        if ctx.logging_this_step():
            accuracy = self._accuracy(h.detach(), policy.lm_head_weight.detach(), t)
            ctx.log("token_accuracy", accuracy, weight=n_local)
        self.position = batch["next_position"]
        return loss

    @torch.no_grad()
    def _accuracy(self, h: torch.Tensor, weight: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return count_correct(h, weight, t).double() / max(h.shape[0], 1)

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.position = int(state["position"])
