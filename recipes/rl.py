"""What GRPO and PPO share: the prompt stream, one scored rollout batch, and trainer-side logprobs.

Data position: ``prompt_position`` counts the task samples consumed by all ranks together. A rollout
batch on rank ``r`` of ``W`` uses samples ``prompt_position + r * P .. + P - 1``
(``P = rollout.prompts_per_step``, per rank) with sampling seed ``(seed, first sample // P)``, then
every rank advances ``prompt_position`` by ``W * P``. With an unchanged world size batch ``k`` uses
samples ``(k * W + r) * P ..``, and a resumed run draws exactly the prompts and tokens it would have
drawn. Resuming on a different number of processes continues at the first unused sample: keep
``W * P`` (the global batch) to see the same prompts as the uninterrupted run would have, e.g.
2 ranks x 16 prompts -> 1 process x 32 prompts (each rank's groups are sampled in one batch, so the
tokens differ). A step of GRPO's dynamic sampling draws rounds of ``W * P`` samples, round ``j`` at
``prompt_position + (j * W + r) * P``, and advances by all of them: the position and the seeds it
implies are all a resume needs. Lightning is fed an endless stream of placeholder batches; the recipe
picks the prompts itself, so Lightning's one-batch prefetch can never move the data position.

A rollout batch trains for ``epochs x minibatches`` policy steps. When ``trainer.max_steps`` stops a run inside
them, the batch is cut (``CutBatch``): the checkpoint keeps each rank's rows and what the loss reads of them, pinned
before the batch's first update (advantages, the loss mask, old and reference logprobs, importance weights, the
critic's old values and returns), and how many of its steps were taken. A run resumed from it with a larger
``max_steps`` trains the rest of that batch first, in the order the uninterrupted run would have, then draws the
next; it continues as that run would, provided the learning-rate schedule does not depend on ``max_steps``. The
rest of a cut batch reads its pinned tensors, and the settings read at every step (clipping, ``loss_agg``,
coefficients) as configured. Resumed on another number of processes, or with other ``epochs``, ``minibatches``
or ``shared_prompt``, the rest of the cut batch is dropped (with a line on stderr) and the run continues with a
new rollout batch. A checkpoint without a cut batch holds the data position only, as before.

Statistics over the rollout batch are global: the ``scale_rewards: batch`` std and ``reward/std`` come
from one all-reduce of (count, sum, sum of squares), token-mean losses divide by the minibatch's token
count over all ranks, and metrics go through torchmetrics, which reduces over ranks.
"""
from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import DataLoader, IterableDataset

from framework.allocator import to_device
from framework.config import uses_cuda
from framework.console import say
from framework.errors import FwError
from framework.memory_plan import compute_dtype, estimate
from framework.models import Packing, SharedPrompts
from framework.models.modes import eval_mode
from framework.recipe import BatchShapes, StepContext
from framework.rollout import SamplingParams
from framework.spans import span
from recipes.advantages import all_reduce_sum, batch_reward_std
from recipes.losses import LossInputs, aggregate_weights, loss_inputs, minibatch_count


class _Ticks(IterableDataset):
    """An endless stream of step placeholders: RL batches are produced inside training_step."""

    def __iter__(self):
        while True:
            yield 0


@dataclass
class ScoredRollout:
    """One rollout batch of ``B = prompts * samples`` sequences, scored and laid out for training."""

    tokens: Tensor           # [B, T] prompt + completion, right-padded
    prompt_lens: Tensor      # [B]
    completion_lens: Tensor  # [B]
    old_logp: Tensor         # [B, Tc] behaviour logprobs (pi_old), 0 past each row's end
    mask: Tensor             # [B, Tc] float, 1 on completion tokens
    rewards: Tensor          # [B] fp32
    correct: Tensor          # [B] bool: full-credit reward (>= 1)
    n_reward_errors: int
    eos_frac: float          # share of rows that ended on EOS or a stop string
    truncated: Tensor        # [B] bool: cut at max_new_tokens (ended neither on EOS nor on a stop string)
    gen_seconds: float
    texts: list[str]
    # (prompt_lens, completion_lens) on the host, copied on first use: one sync per batch
    _host_lens: tuple[Tensor, Tensor] | None = dataclasses.field(default=None, init=False, repr=False, compare=False)

    def host_lengths(self) -> tuple[Tensor, Tensor]:
        """(prompt_lens, completion_lens) on the host: what lays micro-batches out without a device sync."""
        if self._host_lens is None:
            self._host_lens = (self.prompt_lens.cpu(), self.completion_lens.cpu())
        return self._host_lens


@dataclass(frozen=True)
class MicroBatch:
    """Rows of the rollout batch trained together, on the batch's device and on the host (not a tuple: a
    loss that indexes a tensor with it fails instead of indexing two dimensions)."""

    rows: Tensor       # [b] int64 on the batch's device: indexes the batch's tensors
    host_rows: Tensor  # [b] the same on the host: lays the micro-batch out without a device sync


@dataclass
class CutBatch:
    """A rollout batch whose update ``trainer.max_steps`` cut short: what the rest of it trains on."""

    rollout_step: int           # the batch's index: it seeds the batch's minibatch shuffles
    taken: int                  # its minibatch steps taken, over its epochs
    layout: dict[str, Any]      # what split the batch into those steps (``RLRecipe.update_layout``)
    pinned: dict[str, Any]      # this rank's share: "rollout" (a ScoredRollout) and the tensors its loss reads


def _on(x: Any, device: torch.device | str) -> Any:
    """``x`` (a tensor, or a dict or list of them and plain values) with its tensors on ``device``."""
    if isinstance(x, Tensor):
        return x.to(device)
    if isinstance(x, dict):
        return {k: _on(v, device) for k, v in x.items()}
    if isinstance(x, list):
        return [_on(v, device) for v in x]
    return x


def pinned_state(pinned: dict[str, Any]) -> dict[str, Any]:
    """A rank's pinned tensors as a checkpoint holds them: on the CPU, the rollout as a dict of its fields."""
    rollout = pinned["rollout"]
    fields = {f.name: getattr(rollout, f.name) for f in dataclasses.fields(rollout) if f.init}
    return _on({**pinned, "rollout": fields}, "cpu")


def pinned_from_state(state: dict[str, Any], device: torch.device | str) -> dict[str, Any]:
    """``pinned_state``'s inverse, on ``device``."""
    state = _on(state, device)
    return {**state, "rollout": ScoredRollout(**state["rollout"])}


def _on_rank_zero(obj: Any) -> list[Any] | None:
    """Every rank's ``obj`` in rank order on rank 0, None on the other ranks (a collective under torch.distributed:
    every rank calls it); ``[obj]`` on one process."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [obj]
    if dist.get_rank() != 0:
        dist.gather_object(obj, None, dst=0)
        return None
    out: list[Any] = [None] * dist.get_world_size()
    dist.gather_object(obj, out, dst=0)
    return out


# Packing must remove at least this share of a micro-batch's tokens for packed=None to pack. On equal rows both
# layouts do the same math and the packed one costs more per token (varlen attention and its bookkeeping), so a
# saving smaller than that extra cost makes the update slower: this is the share at which the two break even on
# an H200 with Qwen3-0.6B, which `python -m benchmarks.packed_update --equal` prints.
PACK_MIN_SAVING = 0.08


def packs(prompt_lens: Tensor, completion_lens: Tensor, packed: bool | None = None) -> bool:
    """Whether rows of these host lengths are laid out packed: ``packed`` when given, else whether packing
    removes at least ``PACK_MIN_SAVING`` of the padded layout's tokens."""
    return _packs([a + b for a, b in zip(prompt_lens.tolist(), completion_lens.tolist(), strict=True)], packed)


def _packs(lens: list[int], packed: bool | None) -> bool:
    if packed is not None:
        return packed
    return sum(lens) <= (1.0 - PACK_MIN_SAVING) * len(lens) * max(lens, default=0)


@dataclass(frozen=True)
class ResponseLayout:
    """A micro-batch as the model reads it, and where the state predicting each completion token sits.

    Packed: the sequences (prompt + completion) end to end in one row, positions restarting at 0 for each,
    so attention stays inside each sequence (ops_cuda.varlen_attention) and no pad token is computed; the
    sequence bounds (``packing``) come from the host lengths, so the model's forward finds none on the
    device. Padded: the rows right-padded to the longest sequence, plain causal attention.
    """

    input_ids: Tensor            # [1, N] packed, [B, longest] padded
    position_ids: Tensor | None  # [1, N] packed, None padded
    packing: Packing | SharedPrompts | None   # packed: the sequence bounds (on the device); None padded
    rows: Tensor                 # [M] the batch row of each completion token
    cols: Tensor                 # [M] its completion column
    source: Tensor               # [M] flat index (into input_ids.reshape(-1)) of the state predicting it
    targets: Tensor              # [M] the token itself


def response_layout(tokens: Tensor, prompt_lens: Tensor, completion_lens: Tensor, width: int,
                    packed: bool | None = None, groups: Tensor | None = None) -> ResponseLayout:
    """The model input of rows ``tokens`` [B, T] (prompt + completion, right-padded) and the completion tokens.

    Completion token ``j`` of row ``b`` sits at ``prompt_lens[b] + j`` of its sequence and is predicted from
    the state at ``prompt_lens[b] + j - 1``. The layout is planned on the host from the host lengths, a few numbers
    a run of tokens, which become an index a token on ``tokens``' device (``_expand_runs``): no torch kernel runs on
    the host, whose thread pool other work of a training run may keep busy, and the device is not waited for.
    ``packed``: True packs, False pads, None packs when ``packs`` says it pays. ``groups`` (host, one id a row): rows
    with the same id have the same prompt, which is then laid out once (``shared_prompt_layout``).
    """
    if groups is not None:
        return shared_prompt_layout(tokens, prompt_lens, completion_lens, width, groups)
    p, c = prompt_lens.tolist(), completion_lens.tolist()
    lens = [a + b for a, b in zip(p, c, strict=True)]
    longest, index = max(lens, default=0), list(range(len(lens)))
    behind = [-d for d in _exclusive_cumsum(c)]   # less the completion tokens of the rows before
    if not _packs(lens, packed):
        # a run a row's completion: its row, its tokens' column less their index, its prompt's length
        [(answer, t)], _ = _expand_runs(tokens.device, [(c, [index, behind, p])])
        rows, cols = answer[:, 0], t + answer[:, 1]
        at = cols + answer[:, 2]
        return ResponseLayout(tokens[:, :longest], None, None, rows, cols, rows * longest + at - 1, tokens[rows, at])
    starts = _exclusive_cumsum(lens)   # each sequence's first index in the packed row
    # a run a sequence (its row, its positions less their index in the packed row), and a run a completion (as
    # above, and where its sequence starts)
    [(sequence, t_seq), (answer, t)], cu = _expand_runs(
        tokens.device, [(lens, [index, [-s for s in starts]]), (c, [index, behind, p, starts])],
        extra=_bounds(lens))
    seq, pos = sequence[:, 0], t_seq + sequence[:, 1]
    rows, cols = answer[:, 0], t + answer[:, 1]
    at = cols + answer[:, 2]
    return ResponseLayout(tokens[seq, pos][None], pos[None], Packing(cu.to(torch.int32), longest), rows, cols,
                          answer[:, 3] + at - 1, tokens[rows, at])


def shared_prompt_layout(tokens: Tensor, prompt_lens: Tensor, completion_lens: Tensor, width: int,
                         groups: Tensor) -> ResponseLayout:
    """``response_layout`` with each group's prompt once: rows with the same ``groups`` id (host) share their
    prompt, read from the group's first row. One packed row holds every group's prompt, then every row's
    completion, group after group (SharedPrompts); a completion's first token is predicted from its prompt's last
    state. Raises FwError when rows of one group differ in prompt length."""
    p, c, ids = prompt_lens.tolist(), completion_lens.tolist(), groups.tolist()
    B = len(p)
    number = {key: i for i, key in enumerate(sorted(set(ids)))}
    group = [number[key] for key in ids]
    G = len(number)
    first = [B] * G   # each group's first row
    for r in range(B - 1, -1, -1):
        first[group[r]] = r
    pg = [p[r] for r in first]
    if any(p[r] != pg[group[r]] for r in range(B)):
        raise FwError("shared_prompt: rows of one group have prompts of different lengths; a group's rows must "
                      "hold the same prompt")
    n = sum(pg)
    p_start = _exclusive_cumsum(pg)
    last = [s + length - 1 for s, length in zip(p_start, pg, strict=True)]   # each prompt's last state
    # the completions, group after group (a group's rows in batch order), so that each group's tokens are one span
    # of the attention's queries
    order = sorted(range(B), key=group.__getitem__)
    c_order = [c[r] for r in order]
    before = _exclusive_cumsum(c_order)
    per_group = [0] * G
    for r in range(B):
        per_group[group[r]] += c[r]
    live = [x for x in c_order if x > 0]   # the attention's sequences: each prompt, then each non-empty completion
    # one packed row: a run a group's prompt, then a run a completion; each run's row, its positions less their
    # index in the packed row, its prompt's length (0 for a prompt's run) and the state its first token is
    # predicted from (a completion's: its prompt's last)
    runs = (pg + c_order, [first + order,
                           [-s for s in p_start] + [p[r] - n - b for r, b in zip(order, before, strict=True)],
                           [0] * G + [p[r] for r in order],
                           [0] * G + [last[group[r]] for r in order]])
    [(row, t)], cu = _expand_runs(tokens.device, [runs], extra=_bounds(pg) + _bounds(per_group) + _bounds(pg + live))
    seq, pos = row[:, 0], t + row[:, 1]
    rows, at = seq[n:], pos[n:]
    cols = at - row[n:, 2]
    source = torch.where(cols == 0, row[n:, 3], t[n:] - 1)
    cu_p, cu_g, cu_s = cu.to(torch.int32).split([G + 1, G + 1, G + len(live) + 1])
    packing = SharedPrompts(n, cu_p, max(pg, default=0), cu_g, max(per_group, default=0), cu_s,
                            max(pg + live, default=0))
    return ResponseLayout(tokens[seq, pos][None], pos[None], packing, rows, cols, source, tokens[rows, at])


def _exclusive_cumsum(xs: list[int]) -> list[int]:
    out, total = [], 0
    for x in xs:
        out.append(total)
        total += x
    return out


def _bounds(lengths: list[int]) -> list[int]:
    """cu_seqlens of runs of `lengths`: 0, then each run's end."""
    return [*_exclusive_cumsum(lengths), sum(lengths)]


def _expand_runs(device: torch.device, plans: Sequence[tuple[list[int], list[list[int]]]],
                 extra: Sequence[int] = ()) -> tuple[list[tuple[Tensor, Tensor]], Tensor]:
    """Per-token tables on ``device`` from per-run numbers planned on the host, in one non-blocking copy. A plan
    (lengths, columns) is runs of consecutive tokens: each token of run k gets (columns[0][k], columns[1][k], ...).
    Returns each plan's [tokens, len(columns)] table and its tokens' indices (0, 1, ...), and ``extra`` on the
    device. Sizes come from the host, so nothing is read back."""
    flat: list[int] = []
    shapes = []
    for lengths, columns in plans:
        flat += lengths
        for numbers in zip(*columns, strict=True):   # row-major: a run's numbers side by side
            flat += numbers
        shapes.append((len(lengths), len(columns), sum(lengths)))
    values = to_device(torch.tensor([*flat, *extra], dtype=torch.long), device)
    tables, i = [], 0
    for runs, k, total in shapes:
        lengths, table = values[i:i + runs], values[i + runs:i + runs + k * runs].view(runs, k)
        i += runs + k * runs
        tables.append((table.repeat_interleave(lengths, dim=0, output_size=total),
                       torch.arange(total, device=device)))
    return tables, values[i:]


def completion_logprobs(model: Any, tokens: Tensor, prompt_lens: Tensor, completion_lens: Tensor, width: int,
                        temperature: float, with_entropy: bool = False, packed: bool | None = None,
                        groups: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    """Per-token logprobs ``[B, width]`` (and entropies) of the completion tokens under ``model``.

    Uses the model's hidden states and the fused ``ops_cuda.linear_logprob`` on the response
    positions only, at the rollout's temperature, so the values are comparable with the behaviour
    logprobs. 0 past each row's end. ``packed``, ``groups``: see ``response_layout``; the values are the
    same. Lengths on the host keep the whole forward free of device syncs.
    """
    import ops_cuda

    x = response_layout(tokens, prompt_lens, completion_lens, width, packed, groups)
    hidden = model(x.input_ids, position_ids=x.position_ids, return_hidden=True, packing=x.packing)
    # The logits are kept for the backward (when there is one) as model.policy.keep_logits says.
    logp, entropy = ops_cuda.linear_logprob(hidden.reshape(-1, hidden.shape[-1])[x.source], model.lm_head_weight,
                                            x.targets, temperature=temperature, return_entropy=with_entropy,
                                            save_logits=model.saves_logits)
    # float32 (float64 for a float64 model: linear_logprob's accumulation dtype)
    out = hidden.new_zeros(tokens.shape[0], width, dtype=logp.dtype).index_put((x.rows, x.cols), logp)
    ent = None
    if with_entropy:
        ent = torch.zeros_like(out).index_put((x.rows, x.cols), entropy.detach().to(out.dtype))
    return out, ent


def completion_values(value_model: Any, tokens: Tensor, prompt_lens: Tensor, completion_lens: Tensor,
                      width: int, packed: bool | None = None, groups: Tensor | None = None) -> Tensor:
    """Critic values ``[B, width]`` of the states before each completion token; 0 past each row's end."""
    x = response_layout(tokens, prompt_lens, completion_lens, width, packed, groups)
    values = value_model(x.input_ids, position_ids=x.position_ids, packing=x.packing).reshape(-1)
    out = values.new_zeros(tokens.shape[0], width, dtype=torch.float32)
    return out.index_put((x.rows, x.cols), values[x.source].float())


# The first samples of a procedural task that states no widest prompts: their prompts stand for its prompt length.
PLAN_PROMPTS = 256
# In the environment: a dataset's longest prompt as the process measured it, with what the figure depends on
# (``_dataset_key``), for the processes it starts (the other ranks of a multi-process job).
LONGEST_PROMPT_ENV = "FW_LONGEST_PROMPT"


def longest_prompt(cfg: dict, tokenizer: Any) -> int:
    """The longest prompt in tokens, rendered as ``RLRecipe.collect`` renders them: RL prompts are never truncated,
    so only the task bounds them. A task with a length (a dataset) is measured whole (`Tokenizer.most_tokens`), once
    per process for the same JSONL files, rendering and tokenizer, and once per multi-process job (``_shared``). A
    procedural task by the prompts its ``widest_prompts()`` states (framework.tasks.Task), else by its first
    ``PLAN_PROMPTS`` samples."""
    from framework.tasks import build_task, checked_sample, render_prompt

    key = _dataset_key(cfg, tokenizer)
    if key is not None:
        if key not in _LONGEST:
            found = _shared(key)
            if found is not None:
                _LONGEST[key] = found
        if key in _LONGEST:
            return _LONGEST[key]
    task = build_task(cfg["data"], seed=cfg["seed"])
    template, thinking = cfg["data"]["chat_template"], cfg["tokenizer"]["enable_thinking"]

    def render(prompt: Any) -> str:
        return render_prompt(prompt, tokenizer, template, thinking)

    if not hasattr(task, "__len__"):
        widest = getattr(task, "widest_prompts", None)
        prompts = widest() if callable(widest) else [checked_sample(task, i)["prompt"] for i in range(PLAN_PROMPTS)]
        return max(len(tokenizer.encode(render(p))) for p in prompts)
    longest = tokenizer.most_tokens({render(checked_sample(task, i)["prompt"]) for i in range(len(task))})
    if key is not None:
        _LONGEST[key] = longest
        _share(key, longest)
    return longest


# longest_prompt's results for JSONL prompt files: the memory plan asks again for each change it tries
_LONGEST: dict[tuple, int] = {}


def _dataset_key(cfg: dict, tokenizer: Any) -> tuple | None:
    """What longest_prompt's result depends on for JSONL prompts (each file's path, size and modification time, the
    keys read, the rendering, the tokenizer's contents), or None where it cannot say (a task, a tokenizer of
    another kind, a file it cannot stat: the task reports that)."""
    import os

    data = cfg["data"]
    fingerprint = getattr(tokenizer, "fingerprint", None)
    if not data["path"] or data["task"] or fingerprint is None:
        return None
    try:
        files = tuple((os.path.realpath(f), os.stat(f).st_mtime_ns, os.stat(f).st_size)
                      for f in ([data["path"]] if isinstance(data["path"], str) else data["path"]))
    except (OSError, TypeError):
        return None
    return (files, data["prompt_key"], data["answer_key"], data["chat_template"], cfg["tokenizer"]["enable_thinking"],
            fingerprint)


def _shared(key: tuple) -> int | None:
    """The longest prompt for ``key`` that the process which started this one measured (``_share``), or None.

    The memory plan first runs in ``fw fit`` before torch.distributed is initialised (``check_fits``), so no
    collective can carry the figure. Lightning's ``ddp`` launcher starts the other processes from rank 0, after its
    plan, with its environment: the figure travels there. Under a launcher that starts every process at once
    (torchrun, SLURM) each process measures the data itself. The plan's later runs inside the fit
    (``rollout.keep_engine: auto``) find the figure in the process's cache; a collective there would hang wherever
    ranks ask a different number of times (a plan that does not fit a rank's device asks again for each
    suggestion)."""
    import json

    try:
        saved = json.loads(os.environ.get(LONGEST_PROMPT_ENV, ""))
        found = saved["longest"] if saved["key"] == json.loads(json.dumps(key)) else None
    except (ValueError, TypeError, KeyError):   # none, or a value this code did not set
        return None
    return found if isinstance(found, int) and not isinstance(found, bool) else None


def _share(key: tuple, longest: int) -> None:
    """Hand ``longest`` for ``key`` to the processes this one starts (``_shared``)."""
    import json

    os.environ[LONGEST_PROMPT_ENV] = json.dumps({"key": key, "longest": longest})


# A micro-batch's loss: (its rows of the rollout batch, first minibatch of the rollout?) -> (the loss to
# backpropagate, the scalars to log under the phase's prefix).
MicroLoss = Callable[[MicroBatch, bool], tuple[Tensor, dict[str, Tensor]]]


def balanced_split(rows: Tensor, lengths: Tensor, parts: int) -> list[Tensor]:
    """``rows`` (host) in ``parts`` sets of at most ``ceil(len(rows) / parts)`` rows with even token counts
    (``lengths[row]``): longest first, each to the set with the fewest tokens that has room; a set keeps
    the order of ``rows``. The row cap keeps ``batch_shapes``' micro-batch bound."""
    cap = -(-len(rows) // parts)
    sizes = lengths[rows].tolist()
    members: list[list[int]] = [[] for _ in range(parts)]
    loads = [0] * parts
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        j = min((k for k in range(parts) if len(members[k]) < cap), key=lambda k: loads[k])
        members[j].append(i)
        loads[j] += sizes[i]
    return [rows[torch.tensor(sorted(m), dtype=torch.long)] for m in members]


@dataclass(frozen=True)
class Phase:
    """One optimizer's share of a minibatch: its micro-batch loss, then one step of `role`."""

    role: str
    prefix: str        # metrics prefix, e.g. "policy" -> policy/loss
    loss: MicroLoss


def shares_prompts(cfg: dict, section: str, samples_key: str) -> bool:
    """Whether the update lays each group's prompt out once (`<section>.shared_prompt`): with several completions a
    prompt, where the setting is true, or "auto" on CUDA with 16-bit matmuls (bf16 or fp16). There flash attention
    serves the layout in the compute dtype; on CPU and in float32 its reference attention gathers every completion's
    keys, which costs more than it saves."""
    sec = cfg[section]
    if sec[samples_key] < 2:
        return False
    if sec["shared_prompt"] == "auto":
        return uses_cuda(cfg["trainer"]) and compute_dtype(cfg) in ("bfloat16", "float16")
    return bool(sec["shared_prompt"])


class RLRecipe:
    """Base of the manual-optimization RL recipes: data position, rollouts, rewards, the update loop, logging."""

    section = ""  # "grpo" | "ppo": the config section holding epochs, minibatches, loss_agg, ...
    samples_key = ""  # the section's completions per prompt: "group_size" | "samples_per_prompt"

    @classmethod
    def scores_whole_batch(cls, cfg: dict) -> bool:
        """Whether a no-grad forward runs over the whole rollout batch at once (reference logprobs, values)."""
        return False

    @classmethod
    def batch_shapes(cls, cfg: dict, tokenizer: Any) -> BatchShapes:
        # update(): the batch splits into `minibatches` (torch.tensor_split), each into accumulate_grad_batches
        # micro-batches of at most ceil(rows / micro) rows (balanced_split, or under shared_prompt tensor_split of
        # the group-ordered rows); a row is its prompt + its completion.
        sec = cfg[cls.section]
        batch = cfg["rollout"]["prompts_per_step"] * sec[cls.samples_key]
        if sec["minibatches"] * cfg["trainer"]["accumulate_grad_batches"] > batch:   # as _check_batch_split
            raise FwError(f"{cls.section}.minibatches ({sec['minibatches']}) x trainer.accumulate_grad_batches "
                          f"({cfg['trainer']['accumulate_grad_batches']}) exceeds the {batch} sequences of one "
                          "rollout batch")
        per_minibatch = -(-batch // sec["minibatches"])
        rows = -(-per_minibatch // cfg["trainer"]["accumulate_grad_batches"])
        new = SamplingParams.from_config(cfg["rollout"]).longest
        prompt = longest_prompt(cfg, tokenizer)
        tokens = 0
        samples = sec[cls.samples_key]
        if shares_prompts(cfg, cls.section, cls.samples_key):
            # the cuts minibatches() makes in the group-ordered rows: each micro-batch lays out its completions and
            # the prompt of every group it reaches once
            for mb in torch.tensor_split(torch.arange(batch), sec["minibatches"]):
                for m in torch.tensor_split(mb, cfg["trainer"]["accumulate_grad_batches"]):
                    if len(m):
                        groups = int(m[-1]) // samples - int(m[0]) // samples + 1
                        tokens = max(tokens, len(m) * new + groups * prompt)
        # packed=True: the micro-batch's sequences are packed (response_layout), so the positions are kept
        return BatchShapes(rows=rows, seq_len=prompt + new, loss_tokens=rows * new, packed=True, rollout_rows=batch,
                           prompt_len=prompt, new_tokens=new,
                           scoring_rows=batch if cls.scores_whole_batch(cfg) else 0, tokens=tokens)

    def __init__(self, cfg: dict, tokenizer: Any):
        from framework.rewards import build_reward
        from framework.tasks import build_task

        self.cfg = cfg
        self.tokenizer = tokenizer
        if cfg["rollout"]["temperature"] <= 0:
            raise FwError(f"rollout.temperature: {cfg['recipe']} samples from the policy and needs a temperature "
                          f"> 0 (got {cfg['rollout']['temperature']}); the trainer's logprobs use the same one")
        self.sampling = SamplingParams.from_config(cfg["rollout"])
        self.task = build_task(cfg["data"], seed=cfg["seed"])
        self.reward_fn = build_reward(cfg["reward"], self.task)
        self.rollout_step = 0  # rollout batches drawn so far (a batch's index seeds its minibatch shuffles)
        self.prompt_position = 0  # task samples consumed by all ranks: the data position
        self.last_rollout: ScoredRollout | None = None  # the latest batch, for callbacks and inspection
        self.engine: Any = None   # the policy's RolloutEngine, kept from one rollout to the next if keep_engine
        self.keep_engine: bool | None = None   # rollout.keep_engine resolved at the first rollout
        self.shares_prompts = shares_prompts(cfg, self.section, self.samples_key)   # the update's layout
        self._said_all_truncated = False
        self.cut: CutBatch | None = None   # the batch max_steps stopped this run inside, this rank's share
        self._saved_cut: dict | None = None   # a checkpoint's cut batch, every rank's, until the first step

    # ---- protocol
    def train_dataloader(self, ctx: StepContext) -> DataLoader:
        return DataLoader(_Ticks(), batch_size=None)

    def state_dict(self) -> dict:
        """The data position and, when max_steps cut a rollout batch, that batch (``"cut"``). Its ``"ranks"``: on
        rank 0, whose checkpoint is the one written, every rank's share, gathered there (a collective under several
        processes, which every rank's checkpoint hook runs); on the other ranks None."""
        state: dict[str, Any] = {"rollout_step": self.rollout_step, "prompt_position": self.prompt_position}
        if self.cut is not None:
            c = self.cut
            state["cut"] = {"rollout_step": c.rollout_step, "taken": c.taken, "layout": dict(c.layout),
                            "ranks": _on_rank_zero(pinned_state(c.pinned))}
        elif self._saved_cut is not None:   # restored and not trained yet
            state["cut"] = self._saved_cut
        return state

    def load_state_dict(self, d: dict) -> None:
        self.rollout_step = int(d["rollout_step"])
        self.prompt_position = int(d["prompt_position"])
        self.cut = None
        self._saved_cut = d.get("cut")   # absent from the checkpoints of runs that ended between batches

    def release(self) -> None:
        """Hand the rollout engine's KV cache and decode graphs back (the end of a fit)."""
        if self.engine is not None:
            self.engine.release()
            self.engine = None

    def rollout_engine(self, policy: torch.nn.Module) -> Any:
        """The engine the rollouts of `policy` run on, one per run. rollout.keep_engine says whether its KV cache and
        graphs stay between rollouts ("auto": when the memory plan fits with the cache held through the update);
        when not, `collect` hands them back after each rollout."""
        from framework.rollout import RolloutEngine
        from framework.rollout.kv_cache import CacheSettings

        if self.keep_engine is None:
            keep = self.cfg["rollout"]["keep_engine"]
            if keep == "auto":
                keep = bool(estimate(self.cfg).keeps_engine)
            self.keep_engine = keep
        if self.engine is None or self.engine.model is not policy:
            self.engine = RolloutEngine(policy, CacheSettings.from_config(self.cfg["rollout"]))
        return self.engine

    # ---- shared steps
    def _check_batch_split(self, batch_size: int) -> None:
        sec = self.cfg[self.section]
        micro = self.cfg["trainer"]["accumulate_grad_batches"]
        if sec["minibatches"] * micro > batch_size:
            raise FwError(f"{self.section}.minibatches ({sec['minibatches']}) x trainer.accumulate_grad_batches "
                          f"({micro}) exceeds the {batch_size} sequences of one rollout batch")

    def update_layout(self) -> dict[str, Any]:
        """What splits a rollout batch into its policy steps; a cut batch continues only under the same."""
        sec = self.cfg[self.section]
        return {"epochs": sec["epochs"], "minibatches": sec["minibatches"], "shared_prompt": self.shares_prompts}

    @classmethod
    def steps_per_batch(cls, cfg: dict) -> int:
        """The policy steps one rollout batch trains for: its ``epochs`` x ``minibatches``."""
        sec = cfg[cls.section]
        return sec["epochs"] * sec["minibatches"]

    def continuing_steps(self, world_size: int) -> int:
        """The policy steps this run first spends on the rest of the rollout batch its checkpoint's run was cut
        inside (``resume_cut`` continues it), drawing no prompts; 0 when it starts with a new batch."""
        saved = self._saved_cut
        if saved is None or self._cut_mismatch(saved, world_size) is not None:
            return 0
        return max(self.steps_per_batch(self.cfg) - int(saved["taken"]), 0)

    def _cut_mismatch(self, saved: dict, world_size: int) -> str | None:
        """Why the restored cut batch ``saved`` cannot be continued by this run, or None when it can."""
        layout = self.update_layout()
        if len(saved["ranks"]) != world_size:
            return f"it was drawn by {len(saved['ranks'])} processes and this run has {world_size}"
        if saved["layout"] != layout:
            changed = [f"{self.section}.{k} was {saved['layout'].get(k)!r}, now {v!r}" for k, v in layout.items()
                       if saved["layout"].get(k) != v]
            return "its steps were counted in another split (" + "; ".join(changed) + ")"
        return None

    def resume_cut(self, ctx: StepContext) -> CutBatch | None:
        """The rollout batch the checkpoint's run was cut inside, this rank's share on its device, when this run
        continues it (the first step after a resume); else None."""
        saved, self._saved_cut = self._saved_cut, None
        if saved is None:
            return None
        why = self._cut_mismatch(saved, ctx.world_size)
        if why is not None:
            if ctx.rank == 0:
                say(f"fw: warning: the checkpoint's run stopped after {saved['taken']} policy steps of rollout batch "
                    f"{saved['rollout_step']}; {why}, so the rest of that batch is dropped and training continues "
                    "with a new rollout batch", flush=True)
            return None
        return CutBatch(int(saved["rollout_step"]), int(saved["taken"]), self.update_layout(),
                        pinned_from_state(saved["ranks"][ctx.rank], ctx.device))

    @staticmethod
    def pin(data: ScoredRollout, inputs: LossInputs, **tensors: Tensor | None) -> dict[str, Any]:
        """What a rollout batch's update reads, fixed before its first step: the rollout, the loss inputs and the
        recipe's ``tensors`` (advantages, ...). A cut batch's checkpoint holds exactly this."""
        return {"rollout": data, "old_logp": inputs.old_logp, "loss_mask": inputs.mask, "weight": inputs.weight,
                **tensors}

    @staticmethod
    def pinned_loss(pinned: dict[str, Any]) -> tuple[LossInputs, ScoredRollout]:
        """``loss_batch``'s pair from pinned tensors: the loss inputs and the rollout with the loss's mask."""
        return RLRecipe.loss_pair(pinned["rollout"],
                                  LossInputs(pinned["old_logp"], pinned["loss_mask"], pinned["weight"], {}))

    @staticmethod
    def loss_pair(data: ScoredRollout, inputs: LossInputs) -> tuple[LossInputs, ScoredRollout]:
        """``inputs`` and the rollout ``data`` with the loss's mask, which the loss weighting also sees."""
        train = dataclasses.replace(data, mask=inputs.mask)
        train._host_lens = data._host_lens   # the same lengths: no second copy
        return inputs, train

    def train_batch(self, ctx: StepContext, train: ScoredRollout, phases: Sequence[Phase], pinned: dict[str, Any],
                    cut: CutBatch | None, rounds: int = 1) -> None:
        """The rollout batch's update, or the rest of ``cut``'s, then the end of the training step: a new batch
        advances the data position past its ``rounds`` (``finish_rollout``; a continued one did so in its first
        run), and a batch that max_steps stops inside is kept as ``self.cut`` for the checkpoint."""
        rollout_step = self.rollout_step if cut is None else cut.rollout_step
        taken = self.update(ctx, train, phases, rollout_step=rollout_step, start=0 if cut is None else cut.taken)
        self.cut = None if taken is None else CutBatch(rollout_step, taken, self.update_layout(), pinned)
        if cut is None:
            self.finish_rollout(ctx, rounds)
        else:
            ctx.log("policy_version", ctx.policy_version, reduce="last")

    def collect(self, ctx: StepContext, samples_per_prompt: int, round_index: int = 0) -> ScoredRollout:
        """Generate ``samples_per_prompt`` completions for each prompt of this step and score them.

        ``round_index`` > 0 draws the step's further rounds (GRPO's dynamic sampling): the prompts after
        those of every rank's earlier rounds, which ``finish_rollout(ctx, rounds)`` then skips."""
        from framework.rewards import check_metadata, score_rollout
        from framework.rollout import stop_token_ids
        from framework.tasks import checked_sample, render_prompt

        cfg, tok = self.cfg, self.tokenizer
        n_prompts = cfg["rollout"]["prompts_per_step"]
        first = self.prompt_position + (round_index * ctx.world_size + ctx.rank) * n_prompts
        with span("fw.rl.prompts"):
            samples = [checked_sample(self.task, first + i) for i in range(n_prompts)]
            try:   # raised at scoring, on every rank as a failed reward is: one rank alone would leave the rest waiting
                for i, sample in enumerate(samples):
                    check_metadata(self.task, first + i, sample, self.reward_fn)
                unread = None
            except FwError as exc:
                unread = exc
            texts = [render_prompt(s["prompt"], tok, cfg["data"]["chat_template"],
                                   cfg["tokenizer"]["enable_thinking"]) for s in samples]
            ids = [tok.encode(t) for t in texts]
        prompts = [p for p in ids for _ in range(samples_per_prompt)]
        seed = (cfg["seed"] * 1_000_003 + first // n_prompts) % (2**31 - 1)
        start = time.perf_counter()
        engine = self.rollout_engine(ctx.policy)
        try:
            with span("fw.rl.generate"):
                ro = engine.generate(prompts, self.sampling, eos_ids=stop_token_ids(tok, ctx.policy),
                                     tokenizer=tok, seed=seed, policy_version=int(ctx.policy_version))
        finally:
            if not self.keep_engine:   # its memory is the update's
                self.engine.release()
        gen_seconds = time.perf_counter() - start
        with span("fw.rl.reward"):
            rep_texts = [t for t in texts for _ in range(samples_per_prompt)]
            metadatas = [s["metadata"] for s in samples for _ in range(samples_per_prompt)]
            # every rank scores its rollouts here: a reward's failure on one of them stops them all
            rewards, n_err = score_rollout(self.reward_fn, rep_texts, ro.texts, metadatas, cfg["reward"],
                                           collective=True, failed=unread)
            device = ctx.device
            width = ro.logprobs.shape[1]
            clens = ro.completion_lens.to(device)
            mask = (torch.arange(width, device=device)[None, :] < clens[:, None]).float()
            return ScoredRollout(
                tokens=ro.tokens.to(device), prompt_lens=ro.prompt_lens.to(device), completion_lens=clens,
                old_logp=ro.logprobs.to(device=device, dtype=torch.float32), mask=mask, rewards=rewards.to(device),
                correct=(rewards >= 1.0).to(device), n_reward_errors=n_err,
                eos_frac=sum(r != "length" for r in ro.finish_reasons) / len(ro.finish_reasons),
                truncated=torch.tensor([r == "length" for r in ro.finish_reasons], device=device),
                gen_seconds=gen_seconds, texts=list(ro.texts))

    def finish_rollout(self, ctx: StepContext, rounds: int = 1) -> None:
        """Advance the data position past this step's ``rounds`` rollout rounds of every rank (end of a
        training step)."""
        self.rollout_step += 1
        self.prompt_position += rounds * ctx.world_size * self.cfg["rollout"]["prompts_per_step"]
        ctx.log("policy_version", ctx.policy_version, reduce="last")

    @staticmethod
    def full_count(ctx: StepContext, mb_mask: Tensor, mode: str) -> float | None:
        """``aggregate_weight``'s ``full_count`` under several processes: what the minibatch's loss divides by
        (``recipes.losses.minibatch_count``), summed over ranks and divided by the world size (DDP averages
        gradients); None otherwise (no communication). A collective under DDP: call it on every rank for
        every minibatch."""
        count = minibatch_count(mb_mask, mode)
        if count is None or ctx.world_size == 1:
            return None
        return float(all_reduce_sum(count)) / ctx.world_size

    def logprobs(self, model: Any, batch: ScoredRollout, rows: MicroBatch | None = None,
                 with_entropy: bool = False) -> tuple[Tensor, Tensor | None]:
        """``completion_logprobs`` of the micro-batch ``rows`` (None: every row), laid out from the host
        lengths: no device sync."""
        tokens, prompt_lens, completion_lens = self._rows(batch, rows)
        return completion_logprobs(model, tokens, prompt_lens, completion_lens, batch.mask.shape[1],
                                   self.cfg["rollout"]["temperature"], with_entropy,
                                   groups=self._groups(batch, rows))

    def scored_logprobs(self, model: Any, batch: ScoredRollout) -> Tensor:
        """No-grad logprobs of every row of ``batch`` under ``model`` in eval mode, its mode restored after: the
        policy itself, as pi_old and the KL read it, and as the rollout sampled from it; a training forward's
        dropout (LoRA's) would make them one noisy draw of it."""
        with torch.no_grad(), eval_mode(model):
            return self.logprobs(model, batch)[0]

    def values(self, value_model: Any, batch: ScoredRollout, rows: MicroBatch | None = None) -> Tensor:
        """``completion_values`` of the micro-batch ``rows`` (None: every row); no device sync."""
        tokens, prompt_lens, completion_lens = self._rows(batch, rows)
        return completion_values(value_model, tokens, prompt_lens, completion_lens, batch.mask.shape[1],
                                 groups=self._groups(batch, rows))

    @staticmethod
    def _rows(batch: ScoredRollout, rows: MicroBatch | None) -> tuple[Tensor, Tensor, Tensor]:
        prompt_lens, completion_lens = batch.host_lengths()
        if rows is None:
            return batch.tokens, prompt_lens, completion_lens
        return batch.tokens[rows.rows], prompt_lens[rows.host_rows], completion_lens[rows.host_rows]

    def _groups(self, batch: ScoredRollout, rows: MicroBatch | None) -> Tensor | None:
        """The prompt group of each row (host) under ``shared_prompt``, else None. A rollout batch holds its
        groups' rows together, ``samples`` rows a group (``collect``; dynamic sampling keeps whole groups)."""
        if not self.shares_prompts:
            return None
        index = torch.arange(batch.mask.shape[0]) if rows is None else rows.host_rows
        return index // self.cfg[self.section][self.samples_key]

    def minibatches(self, batch_size: int, epoch: int, lengths: Tensor | None = None,
                    rollout_step: int | None = None) -> list[list[Tensor]]:
        """Seeded shuffled split of ``range(batch_size)``: ``minibatches`` lists of micro-batch index sets
        (host tensors). With ``lengths`` (each row's tokens, host) a minibatch's micro-batches hold even
        token counts (``balanced_split``), else even row counts. The seed is the batch's index ``rollout_step``
        (None: the current one) and the epoch."""
        sec = self.cfg[self.section]
        step = self.rollout_step if rollout_step is None else rollout_step
        gen = torch.Generator().manual_seed(((self.cfg["seed"] * 1_000_003 + step) * 101 + epoch) % 2**63)
        micro = self.cfg["trainer"]["accumulate_grad_batches"]
        if self.shares_prompts:
            # whole groups shuffled, then cut in order into micro-batches of the usual row counts (what the memory
            # plan bounds): a group's prompt is laid out once per micro-batch it reaches, twice where a cut falls
            # inside it
            samples = sec[self.samples_key]
            groups = torch.randperm(batch_size // samples, generator=gen)
            perm = (groups[:, None] * samples + torch.arange(samples)).reshape(-1)
            return [list(torch.tensor_split(mb, micro)) for mb in torch.tensor_split(perm, sec["minibatches"])]
        perm = torch.randperm(batch_size, generator=gen)
        split = (lambda mb: list(torch.tensor_split(mb, micro))) if lengths is None else (
            lambda mb: balanced_split(mb, lengths, micro))
        return [split(mb) for mb in torch.tensor_split(perm, sec["minibatches"])]

    def update(self, ctx: StepContext, batch: ScoredRollout, phases: Sequence[Phase], rollout_step: int | None = None,
               start: int = 0) -> int | None:
        """``epochs`` x ``minibatches`` over the rollout batch; in each minibatch every phase accumulates its
        micro-batch losses (each weighted by its share of the minibatch under ``loss_agg``) and then steps
        its optimizer once. Stops as soon as ``trainer.max_steps`` policy steps are done.

        ``rollout_step``: the batch's index, which seeds its shuffles (None: the current one); ``start``: its
        minibatch steps already taken (a cut batch continued), skipped. Returns None when the batch's last step
        is taken, else the number of its steps taken when max_steps stopped it.

        The micro-batches of a minibatch hold even token counts; their row indices reach the device in
        non-blocking copies and their weights in one host read, so the only device syncs per minibatch are
        that read and what the losses log (``ctx.log``)."""
        sec = self.cfg[self.section]
        device = batch.mask.device
        prompt_lens, completion_lens = batch.host_lengths()
        taken = 0
        for epoch in range(sec["epochs"]):
            for mb_index, host_rows in enumerate(self.minibatches(batch.mask.shape[0], epoch,
                                                                  prompt_lens + completion_lens, rollout_step)):
                if taken < start:
                    taken += 1
                    continue
                if not ctx.steps_left():
                    return taken
                first = epoch == 0 and mb_index == 0
                micro = [MicroBatch(to_device(rows, device), rows) for rows in host_rows]
                mb_mask = batch.mask[torch.cat([m.rows for m in micro])]
                mb_count = self.full_count(ctx, mb_mask, sec["loss_agg"])
                weights = aggregate_weights([batch.mask[m.rows] for m in micro], mb_mask, sec["loss_agg"],
                                            mb_count)
                for phase in phases:
                    for m, weight in zip(micro, weights, strict=True):
                        with span("fw.rl.loss"):   # the micro-batch's forward and loss
                            loss, logged = phase.loss(m, first)
                        # Logged before the backward is queued: a metric that reads the device then waits
                        # for the forward only, and the next micro-batch's layout is built while the
                        # device runs this backward.
                        self.log_weighted(ctx, phase.prefix, logged, weight)
                        ctx.backward(loss * weight)
                    ctx.step(phase.role)
                taken += 1
        return None

    def loss_batch(self, ctx: StepContext, section: dict, data: ScoredRollout,
                   trainer_logprobs: Callable[[], Tensor]) -> tuple[LossInputs, ScoredRollout]:
        """What the loss trains on (``section``'s overlong masking and off-policy correction applied, their
        metrics logged) and the rollout batch with the loss's mask, which the loss weighting also sees."""
        inputs = loss_inputs(section, data.old_logp, data.mask, data.truncated, trainer_logprobs)
        for name, value in inputs.metrics.items():
            ctx.log(name, value)
        self._say_all_truncated(ctx, section, data)
        return RLRecipe.loss_pair(data, inputs)

    def _say_all_truncated(self, ctx: StepContext, section: dict, data: ScoredRollout) -> None:
        """One line, the first time a rollout batch's completions (global rank 0's share) are all cut at
        max_new_tokens while overlong.mask_truncated leaves them out of the loss: the update then trains on no token,
        which its metrics show only as a zero gradient."""
        if (self._said_all_truncated or ctx.rank != 0 or not section["overlong"]["mask_truncated"]
                or data.truncated.numel() == 0 or not bool(data.truncated.all())):
            return
        self._said_all_truncated = True
        share = "" if ctx.world_size == 1 else " of this process's share"
        say(f"fw: warning: every completion{share} of the rollout batch after policy step {ctx.policy_version} was "
            f"cut at rollout.max_new_tokens ({self.cfg['rollout']['max_new_tokens']}), and "
            f"{self.section}.overlong.mask_truncated leaves such completions out of the loss, so this update trains "
            "on no token; raise rollout.max_new_tokens, or set mask_truncated: false (said once)", flush=True)

    def log_rollout(self, ctx: StepContext, batch: ScoredRollout) -> None:
        """Reward and rollout metrics of one rollout batch (averaged over the logging interval)."""
        lens = batch.completion_lens.float()
        rewards = batch.rewards
        n = rewards.numel()
        # weighted by the rank's sequence count, so the reduction over ranks is the global batch mean
        for name, value in (
            ("reward/mean", rewards.mean()),
            ("reward/accuracy", batch.correct.float().mean()),
            ("rollout/response_len", lens.mean()),
            ("rollout/eos_frac", batch.eos_frac),
        ):
            ctx.log(name, value, weight=n)
        # the global batch's std (a collective: every rank logs it); per-rank generation speed and time
        ctx.log("reward/std", batch_reward_std(rewards) if ctx.world_size * n > 1 else 0.0)
        ctx.log("rollout/tokens_per_s", float(lens.sum()) / max(batch.gen_seconds, 1e-9))
        ctx.log("rollout/seconds", batch.gen_seconds)
        ctx.log("reward/errors", batch.n_reward_errors, reduce="sum")
        ctx.log("tokens", float((batch.prompt_lens + batch.completion_lens).sum()), reduce="sum")

    def log_first_update(self, ctx: StepContext, logp: Tensor, entropy: Tensor, batch: ScoredRollout,
                         rows: Tensor) -> None:
        """Rollout-vs-trainer logprob mismatch and entropy, on the first minibatch before any update."""
        mask = batch.mask[rows]
        diff = (logp.detach() - batch.old_logp[rows]).abs() * mask
        # one read of the three sums: the host waits for this micro-batch's forward once
        n_tokens, diff_sum, entropy_sum = torch.stack([mask.sum(), diff.sum(), (entropy * mask).sum()]).tolist()
        ctx.log("mismatch/mean", diff_sum / max(n_tokens, 1.0), weight=n_tokens)
        ctx.log("mismatch/max", diff.max(), reduce="max")
        ctx.log("policy/entropy", entropy_sum / max(n_tokens, 1.0), weight=n_tokens)

    @staticmethod
    def log_weighted(ctx: StepContext, prefix: str, values: dict[str, Tensor], weight: float) -> None:
        """Micro-batch values weighted by their share of the minibatch; divided by the world size so
        a minibatch weighs 1 in all, whatever the number of processes."""
        for name, value in values.items():
            ctx.log(f"{prefix}/{name}", value.detach(), weight=weight / ctx.world_size)
