"""Batched generation with the KV cache: prefill all prompts, then one forward per decode step.

Stopping, per row: an EOS id (the EOS token is kept as the row's last completion token, with its
logprob, so the trainer learns to emit it; it is left out of the text), a stop string (the token
whose text completes it is the row's last token; the text keeps the stop string and is cut right
after it), or ``max_new_tokens`` (one limit for all rows, or one per row). Finished rows are still
fed a pad token so the batch stays one tensor, but they are masked out: nothing they produce enters
the result, and their attention reads one cache slot instead of their context. The loop ends once
every row has finished (checked each step on CPU or with stop strings, every ``SYNC_EVERY`` steps on
GPU). Under autocast the KV cache takes the autocast dtype. On CUDA the decode step (a few hundred
small kernels at rollout batch sizes, which Python cannot launch as fast as the GPU runs them) is
replayed as one CUDA graph, captured afresh in every call; sampling stays outside it, since its seed
changes per step.

Behaviour logprobs are the chosen tokens' log probabilities under the temperature-scaled FULL
softmax, as ``ops_cuda.sample`` returns them (top-k/top-p/min-p only restrict which token may be
drawn), i.e. what the trainer recomputes: a distribution renormalised over the allowed tokens would
bias the importance ratio. At temperature 0 (greedy) they are under the unscaled softmax.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

import ops_cuda
from framework.allocator import release_cached
from framework.errors import FwError
from framework.rollout.sampling import SamplingParams

FINISH_REASONS = ("eos", "stop", "length")
_REASON_OF_CODE = ("length", "stop", "eos")   # finish reasons as codes on the device
_STOP, _EOS = 1, 2
SYNC_EVERY = 8          # decode steps between host checks for "every row finished" (GPU)
GRAPH_MIN_STEPS = 8     # shorter generations decode eagerly: too few replays to repay a capture
_MASK63 = (1 << 63) - 1


@dataclass
class Rollout:
    """The result of ``generate`` for B prompts (tensors on the model's device)."""

    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    tokens: Tensor            # LongTensor [B, T]: prompt + completion, right-padded with the pad id
    prompt_lens: Tensor       # LongTensor [B]
    completion_lens: Tensor   # LongTensor [B]
    logprobs: Tensor          # float32 [B, Tc]: behaviour logprob of completion token j, 0 past the end
    finish_reasons: list[str]  # "eos" | "stop" | "length"
    texts: list[str]          # decoded completions ([] when generate got no tokenizer)
    policy_version: int

    @property
    def completion_mask(self) -> Tensor:
        """bool [B, Tc]: True at real completion tokens (aligned with ``logprobs``)."""
        steps = torch.arange(self.logprobs.shape[1], device=self.logprobs.device)
        return steps[None, :] < self.completion_lens[:, None]


class _DecodeGraph:
    """``model.decode(tokens, cache)`` captured once and replayed per step, reading ``tokens`` from a static
    buffer and leaving the logits in a static one (overwritten by the next replay).

    Capture it only after an eager decode step with the same shapes: that step has done the lazy set-up
    (cuBLAS handles, the decode-attention counters, autocast's cached casts of the weights that require
    grad), so the graph reads the cast weights autocast keeps until its region ends, after this
    ``generate`` call; casts of frozen weights are recorded in the graph and rerun on each replay. The
    capture is by hand rather than ``torch.cuda.graph``, whose entry empties the allocator cache: in an
    RL loop that would hand every training step's memory back to the driver at each rollout.
    """

    def __init__(self, model: Any, tokens: Tensor, cache: Any) -> None:
        self.device = tokens.device
        self.tokens = tokens.clone()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.device(self.device):   # the model's device, whichever one is current
            stream, current = torch.cuda.Stream(), torch.cuda.current_stream()
            stream.wait_stream(current)
            with torch.cuda.stream(stream):
                # thread_local: CUDA calls of other threads (a DataLoader's pin-memory thread, a checkpoint
                # writer) stay legal during the capture; only this thread's are restricted.
                self.graph.capture_begin(capture_error_mode="thread_local")
                try:
                    self.logits = model.decode(self.tokens, cache)   # recorded, not run: the cache is untouched
                finally:
                    self.graph.capture_end()
            current.wait_stream(stream)

    def __call__(self, tokens: Tensor) -> Tensor:
        self.tokens.copy_(tokens)
        with torch.cuda.device(self.device):
            self.graph.replay()
        return self.logits


def stop_token_ids(tokenizer: Any, model_config: Any) -> list[int]:
    """The tokenizer's EOS and the model's own (config.json's eos_token_id: one id or a list; Qwen3
    lists <|im_end|> and <|endoftext|>): a row ends on any of them."""
    model_eos = model_config.eos_token_id
    ids = model_eos if isinstance(model_eos, list) else [] if model_eos is None else [model_eos]
    return sorted({tokenizer.eos_id, *ids} - {None})


def step_seed(seed: int, step: int) -> int:
    """The sampler seed of decode step ``step``: distinct per step, a pure function of (seed, step)."""
    # splitmix64-style mixing, kept below 2**63 so it fits the op's int64 seed argument.
    z = (seed * 0x9E3779B97F4A7C15 + (step + 1) * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
    z = ((z ^ (z >> 31)) * 0x94D049BB133111EB) & ((1 << 64) - 1)
    return (z ^ (z >> 29)) & _MASK63


def _check_prompts(prompts: list[list[int]], params: SamplingParams, tokenizer: Any) -> None:
    if not prompts:
        raise FwError("generate: no prompts")
    for i, prompt in enumerate(prompts):
        if len(prompt) == 0:
            raise FwError(f"generate: prompt {i} is empty (a prompt needs at least one token)")
    if params.stop and tokenizer is None:
        raise FwError("generate: stop strings need a tokenizer to decode the completions")


def _find_stop(text: str, stop: Sequence[str]) -> int | None:
    """End offset of the earliest-ending first occurrence of a stop string in ``text``, or None."""
    ends = [i + len(s) for s in stop if (i := text.find(s)) != -1]
    return min(ends) if ends else None


@torch.no_grad()
def generate(model: Any, prompts: list[list[int]], params: SamplingParams, *, eos_ids: Sequence[int] = (),
             tokenizer: Any = None, seed: int = 0, policy_version: int = 0, cuda_graph: bool = True) -> Rollout:
    """Sample completions of ``prompts`` (token id lists) in one batch as ``params`` says.

    Same (model, prompts, params, seed) give the same tokens. ``tokenizer`` (for ``texts``, stop
    strings and the pad id; pad id 0 without one) is optional. The model runs in eval mode and gets
    its previous mode back. ``cuda_graph=False`` runs every CUDA decode step eagerly (same tokens).
    """
    _check_prompts(prompts, params, tokenizer)
    stop = params.stop
    row_limits = params.row_limits(len(prompts))
    per_row = row_limits is not None
    max_new_tokens = params.longest
    temperature, top_k, top_p, min_p = params.temperature, params.top_k, params.top_p, params.min_p
    device = model.lm_head_weight.device
    pad_id = tokenizer.pad_id if tokenizer is not None and tokenizer.pad_id is not None else 0
    B = len(prompts)
    prompt_lens = torch.tensor([len(p) for p in prompts], dtype=torch.long)
    width = int(prompt_lens.max())
    ids = torch.full((B, width), pad_id, dtype=torch.long)
    for b, prompt in enumerate(prompts):
        ids[b, :len(prompt)] = torch.as_tensor(prompt, dtype=torch.long)

    was_training = model.training
    model.eval()
    try:
        # Under autocast (e.g. Lightning's bf16-mixed) keys/values come out in the autocast dtype:
        # keep the cache in it, as the computation that fills it does.
        autocast = torch.is_autocast_enabled(device.type)
        cache_dtype = torch.get_autocast_dtype(device.type) if autocast else None
        cache = model.new_kv_cache(B, width + max_new_tokens, device=device, dtype=cache_dtype)
        logits = model.prefill(ids.to(device), prompt_lens.to(device), cache)
        # Per-row state stays on the model's device: without stop strings the host syncs only every
        # SYNC_EVERY steps (to end the loop once every row finished), so it can queue work ahead.
        out_tokens = torch.full((B, max_new_tokens), pad_id, dtype=torch.long, device=device)
        out_logprobs = torch.zeros(B, max_new_tokens, dtype=torch.float32, device=device)
        finished = torch.zeros(B, dtype=torch.bool, device=device)
        reason = torch.zeros(B, dtype=torch.long, device=device)    # index into _REASON_OF_CODE
        completion_lens = torch.zeros(B, dtype=torch.long, device=device)
        limits = torch.tensor(row_limits, dtype=torch.long, device=device) if per_row else None
        eos = torch.tensor(sorted(set(eos_ids)), dtype=torch.long, device=device)
        # Stop strings are searched in the text of the last few tokens only: earlier steps already
        # searched everything before, and a stop string of n characters spans at most 4n tokens
        # (a token holds at least one UTF-8 byte).
        window = 4 * max(map(len, stop), default=0) + 4
        sync_every = 1 if stop or device.type == "cpu" else SYNC_EVERY
        steps = 0
        # Graphs need the CUDA kernels: the torch references (used when the extension cannot build)
        # copy host tensors to the device, which a capture forbids. Prefill has loaded them by now.
        graphed = (cuda_graph and device.type == "cuda" and max_new_tokens >= GRAPH_MIN_STEPS
                   and ops_cuda.cuda_backend() == "kernels")
        decode_graph = None
        for step in range(max_new_tokens):
            tokens, logprobs = ops_cuda.sample(logits, temperature, top_k, top_p, min_p, step_seed(seed, step))
            active = ~finished
            out_tokens[:, step] = torch.where(active, tokens, pad_id)
            out_logprobs[:, step] = torch.where(active, logprobs.float(), 0.0)
            completion_lens += active
            steps = step + 1
            hit_eos = active & torch.isin(tokens, eos)
            reason.masked_fill_(hit_eos, _EOS)
            finished |= hit_eos
            if stop:
                tails = out_tokens[:, max(0, steps - window):steps].tolist()
                for b in (~finished).nonzero().flatten().tolist():
                    if any(s in tokenizer.decode(tails[b]) for s in stop):
                        finished[b], reason[b] = True, _STOP
            if per_row:   # a row at its own limit (and not ended by EOS or a stop string) ends as "length"
                finished |= completion_lens >= limits
            if step == max_new_tokens - 1 or (steps % sync_every == 0 and bool(finished.all())):
                break
            feed = torch.where(finished, pad_id, tokens)
            # A finished row's cache is no longer needed: at length 0 its attention reads one slot, not
            # its whole context, while the batch keeps its shape (and its graph).
            cache.lengths.masked_fill_(finished, 0)
            if decode_graph is None and graphed and step >= 1:   # step 0 decoded eagerly: the warm-up
                decode_graph = _DecodeGraph(model, feed, cache)
            logits = decode_graph(feed) if decode_graph is not None else model.decode(feed, cache)
    finally:
        model.train(was_training)
    # The KV cache and the graph's private pool go back before the caller trains on the result.
    del cache, decode_graph, logits
    release_cached(device)

    lens = completion_lens.tolist()
    reasons = [_REASON_OF_CODE[r] for r in reason.tolist()]
    rows = out_tokens[:, :steps].tolist()
    completion_ids = [row[:n] for row, n in zip(rows, lens)]
    texts = []
    if tokenizer is not None:
        for b, completion in enumerate(completion_ids):
            text = tokenizer.decode(completion[:-1] if reasons[b] == "eos" else completion)
            texts.append(text[:_find_stop(text, stop)] if reasons[b] == "stop" else text)
    seq = torch.full((B, max(len(p) + n for p, n in zip(prompts, lens))), pad_id, dtype=torch.long)
    for b, (prompt, completion) in enumerate(zip(prompts, completion_ids)):
        seq[b, :len(prompt) + len(completion)] = torch.as_tensor(list(prompt) + completion, dtype=torch.long)
    return Rollout(
        prompt_ids=[list(map(int, p)) for p in prompts], completion_ids=completion_ids,
        tokens=seq.to(device), prompt_lens=prompt_lens.to(device), completion_lens=completion_lens,
        logprobs=out_logprobs[:, :max(lens)].contiguous(), finish_reasons=reasons, texts=texts,
        policy_version=int(policy_version))
