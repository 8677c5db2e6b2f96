"""Evaluation on held-out data: while training (`framework.callbacks.EvalCallback`) and of a saved checkpoint
(`fw eval`).

The eval data is `eval.path` (JSONL in the training data's format) or samples of the training task drawn
with `eval.seed`; with `eval.held_out` a sample the run can train on is left out, so no eval prompt is a
training prompt. The run can train on the first `training_draws(...)` samples of its training stream (RL: one
rollout batch per `epochs` x `minibatches` policy steps, exact but for GRPO's dynamic sampling, whose rounds are
bounded by their most; SFT from a task: exactly the examples its packed rows take), and an eval sample whose
prompt, rendered as the policy reads it, is one of theirs is skipped; under several processes global rank 0 alone
counts them and gives the count to the others. The first eval candidates are compared with the training samples in
one pass that holds only the candidates; the training samples' prompts, which may be many, are held only when most
of those candidates are training samples.

The bound is fixed at a run's first start and kept in its checkpoints (`HELD_OUT_ENTRY`): a resumed
run keeps it, and raises it only when it can draw more than that start allowed for (a larger
`trainer.max_steps`, global batch or split of a rollout batch into policy steps); a checkpoint without it (an
older fw's, or a run's that did not hold out) gets a new one, with a warning. `fw eval` uses the bound of the
checkpoint's run, or, for a run that did not evaluate, the checkpoint's data position (what its policy trained
on).

RL: `eval.samples_per_prompt` completions per prompt from the rollout engine (batches of
`rollout.prompts_per_step` prompts), scored by the run's reward. SFT: the token-mean loss of the
examples' targets. Generation uses seeds of its own (the eval seed, and each sample's index in the eval set as its
row key: the same at every evaluation, and the same draws however many ranks share the set and however
`rollout.prompts_per_step` batches it, exactly where the model's outputs do not depend on the batch: fp32 on CPU)
and the global RNG states are restored afterwards, so training draws exactly what it would draw without
evaluation, and a resumed run evaluates exactly as the uninterrupted one did.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import math
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import torch

from framework.errors import FwError
from framework.models.modes import eval_mode
from framework.rng import rng_state, set_rng_state

EVAL_PREFIX = "eval/"
# Order of the summed statistics: RL (prompts, samples, reward, correct, pass@k, pass@1, mean@k, tokens).
_RL_SUMS = 8
ACCURACY_CHUNK = 4096   # SFT target tokens per logits chunk for eval/token_accuracy
POOL = 4               # eval candidates compared with the training samples in the first pass, per wanted one
POSITION_KEYS = ("prompt_position", "position")   # the data position in the RL and SFT recipes' state
EVAL_IMPORTS = ("data", "reward")   # the config sections whose class_path objects `fw eval` builds
HELD_OUT_ENTRY = "fw_held_out"   # the checkpoint entry of the held-out bound (`held_out_record`)
# how an eval sample is told apart from the training samples, kept in that entry: an older fw compared whole
# records, so a run it started may now evaluate on another set
HELD_OUT_KEY = "prompt"
T = TypeVar("T")


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of one prompt with `c` correct among `n` samples: 1 - C(n-c, k) / C(n, k)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def count_correct(h: torch.Tensor, weight: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """How many targets `t` are the argmax of `h @ weight.T`, as a device scalar. The argmax needs the full logits:
    a chunk of `ACCURACY_CHUNK` rows at a time bounds them, each chunk's freed before the next chunk's are made."""
    correct = torch.zeros((), dtype=torch.long, device=h.device)
    for i in range(0, h.shape[0], ACCURACY_CHUNK):
        j = i + ACCURACY_CHUNK
        correct += (h[i:j] @ weight.T).argmax(-1).eq(t[i:j]).sum()
    return correct


def eval_seed(cfg: dict) -> int:
    """`eval.seed`, or the run's seed + 1 when null."""
    seed = cfg["eval"]["seed"]
    return cfg["seed"] + 1 if seed is None else seed


def eval_enabled(cfg: dict) -> bool:
    """Whether training evaluates at all (`every_n_steps` or `at_start`)."""
    return cfg["eval"]["every_n_steps"] is not None or cfg["eval"]["at_start"]


def is_rl(cfg: dict) -> bool:
    """RL recipes evaluate generations; the others (SFT) the loss of examples."""
    from framework.recipe import recipe_class

    return not recipe_class(cfg["recipe"]).requirements(cfg).automatic_optimization


def step_draws(cfg: dict, world_size: int) -> int:
    """The most training-stream units one new batch takes over `world_size` processes: RL prompts of a rollout
    batch (`rollout.prompts_per_step` per rank and round, GRPO's dynamic sampling drawing up to
    `grpo.dynamic_sampling_max_rounds` rounds), SFT rows of a policy step's micro-batches (one example each
    unpacked)."""
    if is_rl(cfg):
        rounds = 1
        if cfg["recipe"] == "grpo" and cfg["grpo"]["dynamic_sampling"]:
            rounds = cfg["grpo"]["dynamic_sampling_max_rounds"]
        return cfg["rollout"]["prompts_per_step"] * world_size * rounds
    return cfg["trainer"]["accumulate_grad_batches"] * cfg["data"]["batch_size"] * world_size


def batch_steps(cfg: dict) -> int:
    """The policy steps one new batch of training samples trains for: the recipe's ``steps_per_batch`` (RL: a
    rollout batch's `epochs` x `minibatches`); 1 for a recipe that states none (SFT: a new batch every step)."""
    from framework.recipe import recipe_class

    steps = getattr(recipe_class(cfg["recipe"]), "steps_per_batch", None)
    return int(steps(cfg)) if callable(steps) else 1


def continued_steps(recipe: Any, world_size: int) -> int:
    """The policy steps a resumed run first spends finishing the batch its checkpoint's run was cut inside, drawing
    no samples: the recipe's ``continuing_steps``; 0 for a recipe that states none."""
    steps = getattr(recipe, "continuing_steps", None)
    return int(steps(world_size)) if callable(steps) else 0


def training_draws(cfg: dict, world_size: int, tokenizer: Any = None, step: int = 0, position: int = 0,
                   continued: int = 0) -> int:
    """The training-stream samples a run at policy step `step` and data position `position` has drawn by
    `trainer.max_steps`. RL: a new rollout batch every `batch_steps` policy steps after the `continued` ones that
    finish a cut batch; exact, but an upper bound under GRPO's dynamic sampling (every batch at its most rounds).
    SFT: exact, its packed rows filled here by training's packing rule from the examples' token counts
    (`tokenizer`, default the config's)."""
    steps = max(cfg["trainer"]["max_steps"] - step, 0)
    if is_rl(cfg):
        batches = -(-max(steps - continued, 0) // batch_steps(cfg))
        return position + batches * step_draws(cfg, world_size)
    units = steps * step_draws(cfg, world_size)
    if not cfg["data"]["pack"]:
        return position + units
    from framework.data import ExampleStream, packed_position
    from framework.tokenizer import build_tokenizer

    tokenizer = tokenizer or build_tokenizer(cfg)
    # `fw fit` counts a fresh run's draws twice in one process: its validation, then its first start
    key = (_config_key(cfg), world_size, step, position,
           getattr(tokenizer, "fingerprint", None) or id(tokenizer))
    if key in _PACKED_DRAWS:
        return _PACKED_DRAWS[key]
    # the rows are filled in stream order whatever the micro-batch they belong to: all of them at once
    stream = ExampleStream(cfg, tokenizer, train_on_prompt=False)
    position = packed_position(stream, position, units, cfg["data"]["max_seq_len"])
    _remember(_PACKED_DRAWS, key, position)
    return position


def _config_key(cfg: dict) -> str:
    """A resolved config as a key of this process's memos below."""
    return json.dumps(cfg, sort_keys=True, default=str)


# training_draws's packed SFT counts in this process, by config, processes, start and tokenizer
_PACKED_DRAWS: dict[tuple, int] = {}
# Evaluation's held-out samples in this process (and whether an earlier bound chose others), by config, kind, bound
# and earlier bound
_CHOSEN: dict[tuple, tuple[list[Any], bool]] = {}


def _remember(memo: dict, key: Any, value: Any) -> None:
    """`memo[key] = value` as the memo's only entry: what `fw fit` reuses is the one its validation made for its
    start. Every fit's config (its run_dir too) is a key of its own, so a process that fits again and again (a
    notebook, a sweep) would otherwise keep every run's config and eval samples until it exits."""
    memo.clear()
    memo[key] = value


def needs_draws(cfg: dict) -> bool:
    """Whether the held-out set depends on how many training samples the run draws: held out from a task's
    stream or RL prompts (an SFT run on a JSONL file never sees an eval example of that file's records)."""
    return bool(cfg["eval"]["held_out"]) and (is_rl(cfg) or bool(cfg["data"]["task"]))


def held_out_record(cfg: dict, tokenizer: Any, world_size: int, step: int = 0, position: int | None = None,
                    saved: dict | None = None, continued: int = 0) -> dict[str, Any]:
    """`{"draws", "step_draws", "batch_steps", "max_steps"}`: the training draws a run starting at `step` (data
    `position`, `continued` steps finishing a cut rollout batch) on `world_size` processes leaves out of its eval
    data. `saved`: the record of the run's earlier start, whose bound is kept, and raised only when this start can
    draw more (another max_steps, global batch or number of steps a batch trains for; a record without one of
    these, an older fw's, counts as another)."""
    record = {"step_draws": step_draws(cfg, world_size), "batch_steps": batch_steps(cfg),
              "max_steps": cfg["trainer"]["max_steps"], "key": HELD_OUT_KEY}
    earlier = saved.get("draws") if saved else None
    if earlier is not None and all(saved.get(k) == v for k, v in record.items()):
        return {**record, "draws": earlier}   # the same steps as the start that chose it: nothing more to draw
    if position is None:   # a recipe that states no data position: as if it started over
        step, position, continued = 0, 0, 0
    draws = training_draws(cfg, world_size, tokenizer, step, position, continued)
    return {**record, "draws": draws if earlier is None else max(draws, earlier)}


def from_rank_zero(compute: Callable[[], T]) -> T:
    """`compute()` on global rank 0 alone, its result given to every rank: a collective when a process group of
    several processes is initialised (call it on every rank); else `compute()` here."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return compute()
    box: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            box[0] = ("ok", compute())
        except Exception as e:
            # the other ranks raise too rather than wait for a result that never comes
            box[0] = ("fw", str(e)) if isinstance(e, FwError) else ("error", f"{type(e).__name__}: {e}")
            dist.broadcast_object_list(box, src=0)
            raise
    dist.broadcast_object_list(box, src=0)
    kind, value = box[0]
    if kind == "fw":
        raise FwError(value)
    if kind == "error":
        raise RuntimeError(f"global rank 0 failed: {value}")
    return value


def _key(value: Any) -> str:
    return json.dumps(value, sort_keys=True, ensure_ascii=False)


@functools.cache
def _renderer() -> Any:
    """The tokenizer the held-out prompts are rendered with: the chat template is the `Tokenizer` class's own, the
    same whatever the vocabulary, so the prompts (and the memo `_CHOSEN`, keyed by the config) do not depend on
    which tokenizer, if any, an `Evaluation` is given."""
    from framework.tokenizer import Tokenizer

    return Tokenizer.builtin()


def _eval_cfg(cfg: dict) -> dict:
    """`cfg` with `data.path` set to `eval.path` (for the readers of JSONL data), read in file order."""
    # data.shuffle orders the training stream; the eval set is the file's first `eval.max_prompts` held-out
    # records, as SFT's is
    return {**cfg, "data": {**cfg["data"], "path": cfg["eval"]["path"], "task": None, "shuffle": False}}


SOURCE_PROBLEM = ("the training data is a JSONL file (data.path), whose records the training stream visits again "
                  "and again; set eval.path to a held-out JSONL file")


def check_source(cfg: dict) -> None:
    """FwError when the config has no eval data: neither eval.path nor a training task to draw from."""
    if cfg["eval"]["path"] is None and not cfg["data"]["task"]:
        raise FwError(f"eval: {SOURCE_PROBLEM}")


def check_held_out(cfg: dict, world_size: int = 1) -> None:
    """The FwError a fresh run's first evaluation raises when holding out the samples it can train on leaves no
    eval sample, raised here without a model: the eval samples are chosen and nothing is tokenized (but an SFT
    task's examples are counted in tokens, to count the draws, with the config's tokenizer). `fw validate` runs
    it."""
    if eval_enabled(cfg) and cfg["eval"]["held_out"]:
        Evaluation(cfg, None, world_size, choose_only=True)


class Evaluation:
    """The held-out data of `cfg` and how to evaluate a policy on it (`run`).

    `draws`: the training samples to leave out (default: what a fresh run on `world_size` processes draws);
    `earlier`: the bound an earlier start of the run used, for `changed` (whether the larger `draws` changed
    the eval set); `choose_only`: stop once the eval samples are chosen, building no reward and encoding
    nothing (`tokenizer` may be None: `check_held_out`)."""

    def __init__(self, cfg: dict, tokenizer: Any, world_size: int = 1, *, draws: int | None = None,
                 earlier: int | None = None, choose_only: bool = False):
        check_source(cfg)
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.choose_only = choose_only
        self.rl = is_rl(cfg)
        self.seed = eval_seed(cfg)
        if draws is None:
            draws = training_draws(cfg, world_size, tokenizer) if needs_draws(cfg) else 0
        self.draws = draws
        self.changed = False
        self._earlier = earlier if earlier is not None and earlier < draws else None
        if self.rl:
            self._build_rl(draws)
        else:
            self._build_sft(draws)

    # ----------------------------------------------------------------- data
    def _build_rl(self, draws: int) -> None:
        from framework.rewards import NumericMatch, build_reward, check_metadata, check_references
        from framework.tasks import build_task, checked_sample, render_prompt

        cfg, e = self.cfg, self.cfg["eval"]
        train = build_task(cfg["data"], seed=cfg["seed"])
        if not self.choose_only:
            self.reward_fn = build_reward(cfg["reward"], train, check=False)   # the recipe's reward checked them
        source = (build_task(_eval_cfg(cfg)["data"], seed=self.seed, path_key="eval.path") if e["path"]
                  else build_task(cfg["data"], seed=self.seed))
        if e["path"] and not self.choose_only and isinstance(self.reward_fn, NumericMatch):
            check_references(source)   # the eval file's answers, as build_reward checked the training file's
        template, thinking = cfg["data"]["chat_template"], cfg["tokenizer"]["enable_thinking"]

        def prompt(sample: dict) -> str:   # what the policy reads: a string and its one-user-turn chat are one prompt
            return render_prompt(sample["prompt"], _renderer(), template, thinking)

        def sample(i: int) -> tuple[int, dict]:   # with its index, which names it
            return i, checked_sample(source, i)

        chosen = self._held_out(sample, _length(source), lambda s: (prompt(s[1]),) * 2,
                                lambda i: prompt(checked_sample(train, i)), _bounded(train, draws))
        if self.choose_only:
            return
        # what the reward reads of their metadata, checked here rather than while choosing: a choice made without a
        # reward (`check_held_out`, `fw fit`'s validation) is reused
        for i, s in chosen:
            check_metadata(source, i, s, self.reward_fn)
        samples = [s for _, s in chosen]
        self.texts = [render_prompt(s["prompt"], self.tokenizer, template, thinking) for s in samples]
        self.ids = [self.tokenizer.encode(t) for t in self.texts]
        self.metadatas = [s["metadata"] for s in samples]

    def _build_sft(self, draws: int) -> None:
        from framework.data import IGNORE, encode_record, record_prompt, truncate
        from framework.jsonl import read_jsonl
        from framework.tasks import build_task

        cfg, e = self.cfg, self.cfg["eval"]
        fmt = cfg["data"]["format"] if e["path"] else "prompt_completion"

        def records(paths: str | list[str], key: str) -> list[tuple[str, dict]]:   # (FILE:LINE, record)
            return [item for p in ([paths] if isinstance(paths, str) else paths) for item in read_jsonl(p, key)]

        def prompt(item: tuple[str, dict], fmt: str) -> str:
            return record_prompt(item[1], fmt, _renderer(), cfg, item[0])

        if not e["held_out"]:
            train_key, count = None, 0
        elif cfg["data"]["path"]:   # every record of the file, which training visits again and again
            keys = [prompt(item, cfg["data"]["format"]) for item in records(cfg["data"]["path"], "data.path")]
            train_key, count = keys.__getitem__, len(keys)
        else:
            train = build_task(cfg["data"], seed=cfg["seed"])

            def train_key(i: int) -> str:
                return prompt((f"data.task example {i}", train.sft_example(i)), "prompt_completion")

            count = draws
        if e["path"]:
            items = records(e["path"], "eval.path")
            if not items:   # else every sample would count as held out, as if the file held the training data
                raise FwError(f"eval.path {e['path']}: no records (every line is empty)")
            get, n = items.__getitem__, len(items)
        else:
            source = build_task(cfg["data"], seed=self.seed)
            get, n = (lambda i: (f"eval.seed sample {i} of data.task", source.sft_example(i))), _length(source)
        # an example is told apart by its whole record (SFT evaluates examples, some of one prompt), held out by its
        # prompt
        chosen = self._held_out(get, n, lambda item: (prompt(item, fmt), _key(item[1])), train_key, count)
        if self.choose_only:
            return
        self.examples = [encode_record(r, fmt, self.tokenizer, cfg, where, train_on_prompt=False)
                         for where, r in chosen]
        limit = cfg["data"]["max_seq_len"]
        if not any(t != IGNORE for x in self.examples for t in truncate(x, limit).targets):
            # else eval/loss would read 0 and eval/perplexity 1, a perfect score of no token
            source = f"eval.path {e['path']}" if e["path"] else "the training task drawn with eval.seed"
            raise FwError(f"eval: no example of {source} ({len(self.examples)} chosen) has a target token within "
                          f"data.max_seq_len ({limit}): their prompts fill it; raise data.max_seq_len or give "
                          "examples with shorter prompts")

    def _held_out(self, get: Any, count: int | None, key: Any, train_key: Any, draws: int) -> list[Any]:
        """The first `eval.max_prompts` distinct samples `get(i)` (i < `count`; None = endless) whose prompt is none
        of the training samples' prompts `train_key(j)`, j < `draws`; `key(sample)` is (its prompt, what tells it
        apart from other samples). An endless source is read up to 100 samples per wanted prompt (past the training
        ones when many of its samples are training samples).

        The first candidates are compared with the training samples in one pass that holds only them; only when
        too many of them are training samples are the training samples' keys held, and more candidates read."""
        memo = (_config_key(self.cfg), self.rl, draws, self._earlier)
        if memo not in _CHOSEN:   # `fw fit` chooses twice in one process: its validation, then its evaluation
            _remember(_CHOSEN, memo, self._choose(get, count, key, train_key, draws))
        chosen, self.changed = _CHOSEN[memo]
        return copy.deepcopy(chosen)   # the samples' metadata goes to user code (the reward)

    def _choose(self, get: Any, count: int | None, key: Any, train_key: Any, draws: int) -> tuple[list[Any], bool]:
        """`_held_out`'s samples, and whether the bound of an earlier start chose others."""
        wanted = self.cfg["eval"]["max_prompts"]
        candidates: dict[tuple[str, str], Any] = {}   # distinct, in the order read, by (prompt, identity)
        prompts: set[str] = set()   # the candidates' prompts
        first: dict[str, int] = {}   # prompt -> the index of the first training sample that has it
        read = 0

        def fill(limit: int, enough: int, held_out: bool) -> None:
            """Read candidates until `enough` distinct ones (`held_out`: ones no training sample has)."""
            nonlocal read
            limit = limit if count is None else min(count, limit)
            found = len(_pick(candidates, first, draws, enough) if held_out else candidates)
            while read < limit and found < enough:
                k = key(sample := get(read))
                read += 1
                if k not in candidates:
                    candidates[k] = sample
                    prompts.add(k[0])
                    found += not held_out or first.get(k[0], draws) >= draws

        fill(100 * wanted, POOL * wanted if draws else wanted, held_out=False)
        for j in range(draws):
            k = train_key(j)
            if k in prompts and k not in first:
                first[k] = j
        chosen = _pick(candidates, first, draws, wanted)
        if len(chosen) < wanted and (count is None or read < count):
            first = {}
            for j in range(draws):
                first.setdefault(train_key(j), j)
            fill(100 * wanted + len(first), wanted, held_out=True)
            chosen = _pick(candidates, first, draws, wanted)
        if not chosen:
            if self.cfg["eval"]["path"]:
                raise FwError("eval: every sample of eval.path is also a training sample of this run (it holds the "
                              "training data's prompts); set eval.path to held-out data, or set eval.held_out: false "
                              "to evaluate on training prompts")
            raise FwError("eval: every sample of the training task drawn with eval.seed is also a training sample of "
                          "this run (a task with few distinct prompts); set eval.path to held-out data, use a task "
                          "with more prompts, or set eval.held_out: false to evaluate on training prompts")
        if self.cfg["eval"]["path"] and draws:
            _say_left_out(list(candidates), chosen, wanted)
        changed = self._earlier is not None and _pick(candidates, first, self._earlier, wanted) != chosen
        return [candidates[k] for k in chosen], changed

    # ----------------------------------------------------------------- running
    def run(self, policy: Any, rank: int = 0, world_size: int = 1, engine: Any = None) -> dict[str, float]:
        """The eval metrics of `policy` (`eval/...` names); under several processes each rank evaluates
        every `world_size`-th sample and the sums are all-reduced (a collective: call it on every rank).
        `engine`: a RolloutEngine of `policy` to generate on (the training run's kept one, whose KV cache
        would otherwise sit beside a second one); else each chunk runs on a fresh engine. A reward that fails
        (FwError) on some ranks fails every rank, once each has scored its share: the ranks score different numbers
        of batches, so they meet only here."""
        error: FwError | None = None
        with preserved_rng(), torch.no_grad(), eval_mode(policy):
            if self.rl:
                sums, error = self._rl_sums(policy, rank, world_size, engine)
            else:
                sums = self._sft_sums(policy, rank, world_size)
        import torch.distributed as dist

        from framework.errors import raise_on_every_rank

        raise_on_every_rank(error, collective=world_size > 1)
        if world_size > 1 and dist.is_available() and dist.is_initialized():
            dist.all_reduce(sums)
        sums = sums.tolist()
        return self._rl_metrics(sums) if self.rl else self._sft_metrics(sums)

    def _rl_sums(self, policy: Any, rank: int, world_size: int,
                 engine: Any = None) -> tuple[torch.Tensor, FwError | None]:
        """This rank's sums, and the scoring failure that stopped it early (None when every batch was scored)."""
        from framework.rewards import score_rollout
        from framework.rollout import SamplingParams, generate, stop_token_ids
        from framework.rollout.kv_cache import CacheSettings
        from framework.rollout.scheduler import RowTooLong

        cfg, e = self.cfg, self.cfg["eval"]
        k = e["samples_per_prompt"]
        changes = {"temperature": e["temperature"]}
        if e["max_new_tokens"] is not None:
            changes["max_new_tokens"] = e["max_new_tokens"]
        params = SamplingParams.from_config(cfg["rollout"], **changes)
        eos = stop_token_ids(self.tokenizer, policy)
        mine = list(range(rank, len(self.ids), world_size))
        chunk = cfg["rollout"]["prompts_per_step"]
        sums = torch.zeros(_RL_SUMS, dtype=torch.float64)
        for start in range(0, len(mine), chunk):
            part = mine[start:start + chunk]
            prompts = [self.ids[i] for i in part for _ in range(k)]
            keys = [i * k + j for i in part for j in range(k)]   # sample j of eval prompt i, on any rank
            try:
                if engine is not None and engine.model is policy:
                    ro = engine.generate(prompts, params, eos_ids=eos, tokenizer=self.tokenizer, seed=self.seed,
                                         row_keys=keys)
                else:
                    ro = generate(policy, prompts, params, eos_ids=eos, tokenizer=self.tokenizer, seed=self.seed,
                                  cache=CacheSettings.from_config(cfg["rollout"]), row_keys=keys)
            except RowTooLong as exc:   # the engine names the rollout's limit; eval.max_new_tokens set this one
                if e["max_new_tokens"] is None:
                    raise
                raise exc.for_key("eval.max_new_tokens") from None
            try:
                rewards, _ = score_rollout(self.reward_fn, [self.texts[i] for i in part for _ in range(k)],
                                           ro.texts, [self.metadatas[i] for i in part for _ in range(k)],
                                           cfg["reward"])
            except FwError as exc:   # raised on every rank by `run`, which all of them reach
                return sums.to(policy.lm_head_weight.device), exc
            rewards = rewards.double().view(len(part), k)
            correct = (rewards >= 1.0).sum(dim=1).tolist()
            sums += torch.tensor([
                len(part), rewards.numel(), float(rewards.sum()), float(sum(correct)),
                sum(pass_at_k(k, c, k) for c in correct), sum(pass_at_k(k, c, 1) for c in correct),
                float(rewards.mean(dim=1).sum()), float(ro.completion_lens.sum())], dtype=torch.float64)
        return sums.to(policy.lm_head_weight.device), None

    @staticmethod
    def _rl_metrics(s: list[float]) -> dict[str, float]:
        prompts, samples = max(s[0], 1.0), max(s[1], 1.0)
        return {"eval/reward_mean": s[2] / samples, "eval/accuracy": s[3] / samples, "eval/pass@k": s[4] / prompts,
                "eval/pass@1": s[5] / prompts, "eval/mean@k": s[6] / prompts, "eval/response_len": s[7] / samples,
                "eval/prompts": s[0]}

    def _sft_sums(self, policy: Any, rank: int, world_size: int) -> torch.Tensor:
        import ops_cuda
        from framework.data import IGNORE, collate, truncate

        d = self.cfg["data"]
        device = policy.lm_head_weight.device
        mine = self.examples[rank::world_size]
        sums = torch.zeros(3, dtype=torch.float64, device=device)   # nll, correct, targets
        pad = self.tokenizer.pad_id if self.tokenizer.pad_id is not None else 0
        for start in range(0, len(mine), d["batch_size"]):
            rows = [[truncate(x, d["max_seq_len"])] for x in mine[start:start + d["batch_size"]]]
            batch = collate(rows, pad, None)
            hidden = policy(batch["input_ids"].to(device), position_ids=batch["position_ids"].to(device),
                            return_hidden=True)
            targets = batch["targets"].to(device)
            selected = targets != IGNORE
            h, t = hidden[selected], targets[selected]
            logprob, _ = ops_cuda.linear_logprob(h, policy.lm_head_weight, t)
            correct = count_correct(h, policy.lm_head_weight, t)
            sums += torch.stack([-logprob.double().sum(), correct.double(),
                                 torch.tensor(float(t.numel()), dtype=torch.float64, device=device)])
        return sums

    @staticmethod
    def _sft_metrics(s: list[float]) -> dict[str, float]:
        tokens = max(s[2], 1.0)
        loss = s[0] / tokens
        return {"eval/loss": loss, "eval/perplexity": math.exp(min(loss, 700.0)), "eval/token_accuracy": s[1] / tokens,
                "eval/tokens": s[2]}


def _length(source: Any) -> int | None:
    """The number of distinct samples of a finite source (a JSONL dataset), None for a procedural task."""
    return len(source) if hasattr(source, "__len__") else None


def _bounded(source: Any, limit: int) -> int:
    """`limit`, or the length of a finite source when it is shorter (later indices repeat its records)."""
    n = _length(source)
    return limit if n is None else min(n, limit)


def _say_left_out(read: list[tuple[str, str]], chosen: list[tuple[str, str]], wanted: int) -> None:
    """Say (on the first process) how many samples of eval.path, of those `_pick` passed over on its way to `chosen`,
    are training samples and left out: else a file that repeats training prompts is evaluated on fewer rows than
    it holds without a word."""
    from framework.console import first_process, say

    looked_at = len(read) if len(chosen) < wanted else read.index(chosen[-1]) + 1
    left_out = looked_at - len(chosen)
    if left_out and first_process():
        say(f"fw: eval.path: {left_out} of its samples {'has a prompt' if left_out == 1 else 'have prompts'} of the "
            f"training data and {'is' if left_out == 1 else 'are'} left out (eval.held_out: true); {len(chosen)} "
            f"{'is' if len(chosen) == 1 else 'are'} evaluated")


def _pick(candidates: dict[tuple[str, str], Any], first: dict[str, int], draws: int,
          wanted: int) -> list[tuple[str, str]]:
    """The keys of the first `wanted` candidates whose prompt none of the first `draws` training samples has."""
    out = []
    for k in candidates:
        if first.get(k[0], draws) >= draws:
            out.append(k)
            if len(out) == wanted:
                break
    return out


def data_position(state: Any) -> int | None:
    """The data position (training-stream samples consumed by all ranks) in a recipe's state: a recipe, or the
    dict its `state_dict` gave; None for a recipe that states none."""
    for name in POSITION_KEYS:
        value = state.get(name) if isinstance(state, dict) else getattr(state, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


@contextlib.contextmanager
def preserved_rng() -> Iterator[None]:
    """Every global generator (torch, CUDA, Python, NumPy) as it was before the block."""
    state = rng_state()
    try:
        yield
    finally:
        set_rng_state(state)


# The config keys `fw eval` of a checkpoint reads of every config (`read_keys` adds those of its kind and case), which
# alone name its report. It does not read where a run writes (`run_dir`, `name`), how it trains, logs and saves
# (optimizer, scheduler, the loss settings of the recipe's section, `model.value` / `model.reference`, the checkpoint
# and eval cadence, ...), nor `checkpoint.verify`, which refuses a damaged file rather than changes what an intact
# checkpoint evaluates to: a config that differs from the checkpoint's there alone evaluates as its own.
_READ_BY_EVERY_EVAL = ("recipe", "model.policy", "tokenizer", "trainer.accelerator", "trainer.precision", "data.task",
                       "data.path", "data.chat_template", "eval.path", "eval.held_out", "eval.max_prompts")
# RL: the generations (rollout's sampling and KV cache settings, eval.temperature in place of rollout.temperature)
# and their reward
_READ_BY_RL = ("reward", "eval.samples_per_prompt", "eval.temperature", "eval.max_new_tokens", "rollout.top_k",
               "rollout.top_p", "rollout.min_p", "rollout.stop", "rollout.prompts_per_step", "rollout.kv_cache_gib",
               "rollout.max_num_seqs", "rollout.admit_batch", "rollout.block_size", "rollout.kv_cache_dtype")
# SFT: the examples' format and tokens, and the batches their loss is computed in
_READ_BY_SFT = ("data.format", "data.max_seq_len", "data.batch_size")


def read_keys(cfg: dict, draws_known: bool) -> tuple[str, ...]:
    """The dotted keys of `cfg` (each with the keys under it) that `fw eval` of a checkpoint reads: those that can
    change its result. `draws_known`: whether the checkpoint records the training samples to hold out
    (`checkpoint_draws`); else they are counted from the config (`training_draws`)."""
    e, rl, draws = cfg["eval"], is_rl(cfg), needs_draws(cfg)
    keys = [*_READ_BY_EVERY_EVAL, *(_READ_BY_RL if rl else _READ_BY_SFT)]
    if rl and e["max_new_tokens"] is None:
        keys.append("rollout.max_new_tokens")
    if rl and (cfg["data"]["path"] or e["path"]):   # the fields of RL's JSONL prompts
        keys += ["data.prompt_key", "data.answer_key"]
    if rl and draws:   # the order of a JSONL file's training prompts, held out
        keys.append("data.shuffle")
    if rl or not e["path"]:   # RL generates with the eval seed; SFT draws its task's samples with it
        keys.append("eval.seed")
        if e["seed"] is None:   # the run's seed + 1
            keys.append("seed")
    if draws:   # the training stream the held-out samples are drawn from
        keys.append("seed")
    if draws and not draws_known:
        # what `training_draws` reads: the run's steps and batches, its data, and its recipe's split of a batch
        keys += ["trainer.max_steps", "trainer.accumulate_grad_batches", "data", "rollout.prompts_per_step",
                 cfg["recipe"]]
    return tuple(dict.fromkeys(keys))


def evaluate_checkpoint(checkpoint: str | Path, cfg: dict | None = None, out: str | Path | None = None,
                        skip_damaged: bool = False, overrides: list[str] | None = None) -> tuple[dict[str, Any], Path]:
    """Evaluate a checkpoint (or a run directory's newest) as training does, leaving out the training samples
    of the checkpoint's run (`checkpoint_draws`); write the JSON report to `out` and return (report, path).

    `cfg` replaces the checkpoint's own config.yaml, else `overrides` (`--a.b=v`) apply on top of it. The report
    holds the eval and reward settings and the keys the evaluation reads (`read_keys`) that differ from the
    checkpoint's config, a path moved with its files (`_verified_moves`) not among them. Its default path is
    `<run_dir>/eval/<checkpoint>.json` where none differs, else `<checkpoint>-<hash>.json` (the first 8 hex digits
    of the sha256 of `_as_read`'s config), and a report there of other read settings is never replaced."""
    from framework.checkpoint import read_resolved
    from framework.checkpoint.directory import CONFIG_FILE, config_sha256, read_complete_manifest
    from framework.checkpoint.resume import say_moved
    from framework.config import load_config
    from framework.durable import replace_file
    from framework.generate import _device, autocast_context, checkpoint_config, load_policy

    given, given_cfg, report_path = cfg is not None, cfg, out

    def prepare(path: Path) -> tuple:
        """Everything the evaluation reads of checkpoint `path`, before it runs."""
        own_file = str(path / CONFIG_FILE)
        # every problem of the checkpoint's config, the overrides' too
        run_cfg = given_cfg if given_cfg is not None else checkpoint_config(path, overrides, EVAL_IMPORTS)
        own: dict | None = run_cfg
        if given or overrides:
            try:
                own = load_config([own_file], imports=())
            except FwError:   # made valid by the given config or the overrides: what changed is not known
                own = None
        draws = checkpoint_draws(path, run_cfg) if needs_draws(run_cfg) else 0
        read = read_keys(run_cfg, draws is not None)
        manifest = read_complete_manifest(path)
        changes, moves = None, {}
        if own is not None:
            changes = {k: v for k, v in config_changes(own, run_cfg).items() if _is_read(k, read)}
            moves = _verified_moves(manifest, own, changes)
            for key, was in moves.items():
                say_moved(key, was, changes[key], "evaluating with it")
            changes = {k: v for k, v in changes.items() if k not in moves}
        settings = {"eval": run_cfg["eval"], "reward": run_cfg["reward"], "changes": changes}
        # named as absolute: `--checkpoint .` (or `..`) has no name of its own, nor a run directory above it
        at = Path(os.path.abspath(path))
        default = report_path is None
        if default:
            # a moved path is hashed as the checkpoint's own, so a move leaves the name other changes give
            named = _with_values(run_cfg, moves)
            name = at.name if changes == {} else f"{at.name}-{config_sha256(_as_read(named, own, read))[:8]}"
            where = (at.parent.parent / "eval" if at.parent.name == "checkpoints" else Path.cwd()) / f"{name}.json"
        else:
            where = Path(report_path)
        _check_report_path(where)   # before the evaluation, which may take long
        if default:
            _check_replace(where, settings, read)
        elif where.exists() and not _is_report(where):
            raise FwError(f"--out {where}: the file there is not an fw eval report, which is all --out replaces; "
                          "give another path, or move it away")
        step = manifest.get("step")
        tokenizer, policy = load_policy(run_cfg, path)
        return at, run_cfg, settings, where, step, tokenizer, policy, draws

    # a run directory's newest checkpoint, read again if the fit writing the run prunes it meanwhile
    path, cfg, settings, out, step, tokenizer, policy, draws = read_resolved(checkpoint, prepare, skip_damaged)
    device = _device(cfg)
    policy.to(device)
    evaluation = Evaluation(cfg, tokenizer, draws=draws)
    with autocast_context(cfg, device):
        metrics = evaluation.run(policy)
    report = {"checkpoint": str(path), "step": step, "recipe": cfg["recipe"], **settings,
              "held_out_draws": evaluation.draws, "metrics": metrics}
    out.parent.mkdir(parents=True, exist_ok=True)
    replace_file(out, json.dumps(report, indent=2) + "\n")   # whole or not at all
    return report, out


def _among(key: str, keys: tuple[str, ...]) -> bool:
    """Whether the dotted `key` is one of `keys` or lies under one of them."""
    return any(key == k or key.startswith(f"{k}.") for k in keys)


def _is_read(key: str, read: tuple[str, ...]) -> bool:
    """Whether a change of the dotted `key` changes a key of `read`: it is one, lies under one or holds one (a
    section that is null on one side)."""
    return _among(key, read) or any(k.startswith(f"{key}.") for k in read)


def _read_part(value: Any, prefix: str, read: tuple[str, ...]) -> Any:
    """What of `value`, the config's value at dotted `prefix` ("" for the whole config), is read (`read`)."""
    if prefix and _among(prefix, read):
        return value
    if not isinstance(value, dict):
        return None
    parts = {k: f"{prefix}.{k}" if prefix else str(k) for k in value}
    return {k: _read_part(value[k], p, read) for k, p in parts.items() if _is_read(p, read)}


def _as_read(cfg: dict, own: dict | None, read: tuple[str, ...]) -> dict:
    """The config the name of a report is hashed from: the checkpoint's own (`own`, without `run_dir` and `name`)
    with the keys the evaluation reads (`read`) at their values in `cfg`, so that a config that differs from the
    checkpoint's in read keys alone keeps the name it always had; only the read keys when `own` is not known."""
    if own is None:
        return _read_part(cfg, "", read)
    out = copy.deepcopy({k: v for k, v in own.items() if k not in ("run_dir", "name")})
    for dotted in read:
        *parents, last = dotted.split(".")
        into, source = out, cfg
        for part in parents:
            if not isinstance(into.get(part), dict):
                into[part] = {}
            into = into[part]
            source = source.get(part) if isinstance(source, dict) else None
        if isinstance(source, dict) and last in source:
            into[last] = copy.deepcopy(source[last])
        else:
            into.pop(last, None)
    return out


def _verified_moves(manifest: dict, own: dict, changes: dict[str, Any]) -> dict[str, Any]:
    """{dotted key: its value in `own`} of each path key among `changes` (`config_changes` of `own`, the config.yaml
    of the checkpoint whose manifest is `manifest`) whose new path holds what the checkpoint recorded for it, as a
    resume checks a move (`recorded_move_problem`): the same files at another place, read as they were."""
    from framework.checkpoint.resume import moved_path_keys, recorded_move_problem

    out: dict[str, Any] = {}
    for key in moved_path_keys():
        if key not in changes:
            continue
        old: Any = own
        for part in key.split("."):
            old = old.get(part) if isinstance(old, dict) else None
        new = changes[key]
        if old is not None and new is not None and recorded_move_problem(manifest, key, old, new) is None:
            out[key] = old
    return out


def _with_values(cfg: dict, values: dict[str, Any]) -> dict:
    """A copy of `cfg` with each dotted key of `values` set to its value there."""
    out = copy.deepcopy(cfg)
    for dotted, value in values.items():
        *parents, last = dotted.split(".")
        into = out
        for part in parents:
            into = into[part]
        into[last] = copy.deepcopy(value)
    return out


def config_changes(before: dict, after: dict, prefix: str = "") -> dict[str, Any]:
    """`{dotted key: value in after}` of every key whose value differs between two resolved configs."""
    out: dict[str, Any] = {}
    for k in sorted(set(before) | set(after), key=str):
        a, b = before.get(k), after.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            out.update(config_changes(a, b, f"{prefix}{k}."))
        elif a != b:
            out[f"{prefix}{k}"] = b
    return out


def checkpoint_draws(path: Path, cfg: dict) -> int | None:
    """The training samples left out of the eval data of checkpoint `path`: the bound its run evaluated
    against (the same eval set), else its data position (what its policy trained on); None when its trainer
    state holds neither (a recipe that states no data position)."""
    from framework.checkpoint.directory import TRAINER_STATE, verify_checkpoint
    from framework.checkpoint.tensors import SubclassRef, TensorRef
    from framework.optim import allow_optimizer_states

    if cfg["checkpoint"]["verify"]:
        verify_checkpoint(path, [TRAINER_STATE])
    allow_optimizer_states(cfg)
    try:
        with open(path / TRAINER_STATE, "rb") as f, torch.serialization.safe_globals([TensorRef, SubclassRef]):
            state = torch.load(f, map_location="cpu", weights_only=True)
    except (OSError, RuntimeError, EOFError, ValueError) as e:
        raise FwError(f"{path / TRAINER_STATE}: unreadable trainer state ({str(e).splitlines()[0]})") from None
    saved = state.get(HELD_OUT_ENTRY) or {}
    if isinstance(saved.get("draws"), int):
        return saved["draws"]
    return data_position(state.get("fw_recipe") or {})


def _check_replace(out: Path, settings: dict[str, Any], read: tuple[str, ...]) -> None:
    """FwError if `out` holds a report of settings other than `settings` (or one that records none): another value
    of a key the evaluation reads (`read`); the others its `eval` and `reward` record, and the changes of them an
    older fw recorded, are not compared."""
    if not out.exists():
        return
    try:
        earlier = json.loads(out.read_text(encoding="utf-8"))
        same = all(_read_settings(earlier.get(k), k, read) == _read_settings(v, k, read) for k, v in settings.items())
    except (OSError, ValueError, AttributeError):
        same = False
    if not same:
        raise FwError(f"{out} holds the report of an evaluation with other settings (or of an fw that did not "
                      "record them); move it away, or give --out FILE for this one")


def _read_settings(value: Any, key: str, read: tuple[str, ...]) -> Any:
    """What is read of a report's setting `key` (`eval`, `reward` or `changes`), for `_check_replace`."""
    if key == "changes":
        return None if value is None else {k: v for k, v in value.items() if _is_read(k, read)}
    return _read_part(value, key, read) if isinstance(value, dict) else value


def _is_report(path: Path) -> bool:
    """Whether the file at `path` is a JSON report `fw eval` wrote."""
    try:
        report = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(report, dict) and {"checkpoint", "metrics"} <= report.keys()


def _check_report_path(out: Path) -> None:
    """FwError if the report cannot be written at `out`: a directory there, a file where a folder of it must be,
    or a folder that is not writable."""
    if out.is_dir():
        raise FwError(f"--out {out}: a directory; give the JSON report's file path, e.g. {out / 'report.json'}")
    parent = out.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise FwError(f"--out {out}: cannot create its folder: {parent} is a file")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise FwError(f"--out {out}: {parent} is not writable")
    from framework.checkpoint.directory import enclosing_checkpoint

    checkpoint = enclosing_checkpoint(out.parent)
    if checkpoint is not None:   # not a file of its manifest: a prune deletes it with the checkpoint
        raise FwError(f"--out {out}: inside checkpoint {checkpoint}, whose files are those its manifest lists and "
                      "which a prune deletes whole; give a path outside it")


def format_table(report: dict[str, Any]) -> str:
    """The report's metrics as an aligned two-column table."""
    metrics = report["metrics"]
    width = max(len(k) for k in metrics)
    lines = [f"{report['checkpoint']} (step {report['step']}, recipe {report['recipe']})",
             f"{'metric'.ljust(width)}  value"]
    lines += [f"{k.ljust(width)}  {v:.6g}" for k, v in metrics.items()]
    return "\n".join(lines)
