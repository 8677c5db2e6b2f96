"""Checks of a config that need the filesystem, imports or this machine: what `fw validate` adds to the
schema's checks (framework/config.py), and what `fw fit` runs before it builds anything.

Everything that can be known without a training step is checked here, each problem at the position of
the key that causes it: the paths name what they should (a model directory with config.json and
weights, a tokenizer, JSONL files whose every row fits its format, a writable run_dir), the pluggable
parts import, are of the right kind and construct with their init_args, and the combinations the
schema cannot express hold. `machine=True` (fit) adds what depends on this machine: the accelerator,
devices, strategy and precision must be available here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import inspect
import json
import os
import re
import sys
import warnings
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

from framework.config import LocatedConfig, all_key_paths, is_override, load_located, world_size, written_by_fw
from framework.console import first_process
from framework.errors import FwError, Problem, what_raised
from framework.imports import InitArgsError, user_line
from framework.yaml12 import Mark

BUILTIN_RECIPES = ("sft", "grpo", "ppo")
RL_RECIPES = {"grpo": "group_size", "ppo": "samples_per_prompt"}  # section -> its samples-per-prompt key
MAX_ROW_PROBLEMS = 20  # per JSONL file
# Lightning strategies fw cannot train with (docs/MULTI_GPU.md), by name prefix
UNSUPPORTED_STRATEGIES = {"fsdp": "FSDP is not supported yet (docs/MULTI_GPU.md)",
                          "deepspeed": "DeepSpeed is not supported", "xla": "XLA/TPU is not supported",
                          "single_xla": "XLA/TPU is not supported", "single_tpu": "XLA/TPU is not supported"}
# The launching process of these trains nothing: a signal to it leaves the processes it started training, and it
# reports an end it did not see. `ddp` trains in every process it starts, the launching one included.
_LAUNCHER_ONLY = ("the process fw fit runs in would start the training processes and train in none of them, so a "
                  "SIGTERM or Ctrl+C to it would not stop them; use ddp (the same training, one process a device)")
UNSUPPORTED_STRATEGIES.update({"ddp_spawn": _LAUNCHER_ONLY, "ddp_fork": _LAUNCHER_ONLY,
                               "ddp_notebook": _LAUNCHER_ONLY})
MODEL_DIR = "a Hugging Face Qwen3 directory with config.json and model.safetensors"
# What user code that the checks call may raise: a failure, sys.exit() and Ctrl+C's KeyboardInterrupt, which
# `_Checks.add_error` turns into a problem of the config, or for Ctrl+C into fw's end on it (exit code 130).
USER_CODE_RAISES = (Exception, SystemExit, KeyboardInterrupt)


def _one_json_document(path: str) -> str | None:
    """What a file that is one JSON value over several lines holds (`an array`), else None: a `.json` file given
    where JSON Lines are read, whose every line would be reported on its own."""
    from framework.jsonl import json_type_name

    try:
        with open(path, encoding="utf-8-sig") as f:
            if f.readline().strip() not in ("[", "{"):   # how an indented document starts (json.dump(indent=2))
                return None
        return json_type_name(json.loads(Path(path).read_text(encoding="utf-8-sig")))
    except (OSError, ValueError):   # unreadable, not UTF-8, or not one JSON value: the rows say what is wrong
        return None


def _messages_without_template(prompt: object, what: str) -> str | None:
    """The problem of an RL prompt that is a list of messages under `data.chat_template: false`, which rollouts
    cannot render (they continue plain text), or None."""
    if isinstance(prompt, list):
        return (f"{what} is a list of messages but data.chat_template is false; set data.chat_template: true or give "
                "plain-string prompts")
    return None


def validate_config(paths: list[str], overrides: list[str] | None = None, *, machine: bool = False) -> dict:
    """Load and resolve the config, then run every check below; ConfigError lists all problems."""
    located = load_located(paths, overrides)
    problems = check(located, machine=machine)
    if problems:
        raise located.error(problems)
    return located.cfg


def check(located: LocatedConfig, *, machine: bool = False) -> list[Problem]:
    """Every problem of a resolved config that the schema cannot see."""
    checks = _Checks(located)
    checks.run_dir()
    checks.models()
    checks.data()
    checks.evaluation()
    checks.plugins()
    checks.combinations(machine)
    checks.trainer(machine)
    checks.held_out()
    checks.kv_rows(machine)
    if not machine:   # fw fit tokenizes its data as it builds its dataloader, before any step
        checks.sft_lengths()
    return checks.problems


def model_problems(located: LocatedConfig) -> list[Problem]:
    """The problems of the model directories and the tokenizer a config names, for the models its recipe builds, its
    data (JSONL rows, or the task and its first sample: the plan reads the prompts' lengths), and a rollout's longest
    row against a KV budget that the config fixes (`kv_rows`): what `fw plan` reads before it counts, so that it
    refuses what `fw validate` and `fw fit` refuse."""
    checks = _Checks(located)
    checks.models()
    checks.data()
    checks.task_sample()
    checks.batch_split()   # the plan cuts the rollout batch into its micro-batches
    checks.kv_rows(machine=False)
    return checks.problems


def read_problems(located: LocatedConfig, policy: bool, eval_files: bool) -> list[Problem]:
    """The problems of what `fw generate` / `fw eval` read of a config, at their keys, as fw validate says them:
    the policy's directory and the tokenizer (`policy`: generate without a checkpoint, whose policy/ serves
    otherwise) and eval.path's files (`eval_files`)."""
    checks = _Checks(located)
    if policy:
        checks.models(policy_only=True)
    if eval_files:
        checks.eval_files()
    return checks.problems


def _keys() -> list[str]:
    """Every dotted key, longest first (so `data.task.init_args` wins over `data.task`)."""
    return sorted((".".join(p) for p in all_key_paths()), key=len, reverse=True)


def _fw_directory(path: str, value: bool = False) -> str | None:
    """What to set instead when `path` is an fw directory with no config.json: LoRA adapters, a checkpoint, a run
    directory; None otherwise (read_config then says what is missing). `value`: the path of a value model, which a
    PPO checkpoint holds in its value/."""
    from framework.checkpoint import checkpoints_dir
    from framework.export import POLICY
    from framework.models.hf_io import MODEL_CONFIG
    from framework.models.lora import ADAPTER_CONFIG

    p = Path(path)
    if (p / MODEL_CONFIG).is_file():
        return None
    if (p / ADAPTER_CONFIG).is_file():
        return (f"{path} holds LoRA adapters, not a whole model: set the directory of the model they adapt, or write "
                "one with `fw export --merge --checkpoint <their checkpoint>`")
    if value and (p / "value" / MODEL_CONFIG).is_file():   # the critic, saved under its component's name
        return f"{path} is an fw checkpoint: its value model's directory is {p / 'value'}"
    if (p / POLICY / MODEL_CONFIG).is_file():
        return f"{path} is an fw checkpoint: its policy's model directory is {p / POLICY}"
    if (p / POLICY / ADAPTER_CONFIG).is_file():   # its policy/ is adapters: that directory is refused too
        return (f"{path} is an fw LoRA checkpoint, whose {POLICY}/ holds adapters, not a whole model: set the "
                f"directory of the model they adapt, or write one with `fw export --merge --checkpoint {path}`")
    if checkpoints_dir(p).is_dir():
        return (f"{path} is an fw run directory: `fw export --checkpoint {path} --out DIR` writes its newest "
                "checkpoint as a model directory (with --merge where it trained LoRA adapters)")
    return None


def _inside_checkpoints(path: str) -> str | None:
    """Why run_dir `path` is no place for a run, or None: it is a checkpoint directory, whose config.yaml the run
    would overwrite (the checkpoint then fails its manifest's check), or lies in one, which a prune deletes whole,
    or in a run's checkpoints/ folder, where fw reads the folders it writes as that run's checkpoints."""
    from framework.checkpoint import checkpoints_dir, run_of_checkpoints_folder
    from framework.checkpoint.directory import enclosing_checkpoint

    folder = Path(os.path.abspath(path))
    checkpoint = enclosing_checkpoint(folder)
    if checkpoint == folder:
        return (f"is checkpoint {checkpoint}: a run there would overwrite its config.yaml, which its manifest lists; "
                "choose a run_dir outside it")
    if checkpoint is not None:
        return f"lies inside checkpoint {checkpoint}, which a prune deletes whole; choose a run_dir outside it"
    run = run_of_checkpoints_folder(folder)
    if run is not None:
        where = "is" if folder == checkpoints_dir(run) else "lies inside"
        return (f"{where} the checkpoints/ folder of run directory {run}, where fw reads what is there as that "
                f"run's checkpoints; choose a run_dir outside {checkpoints_dir(run)}")
    return None


def _write_probe(directory: str, make: Callable[[str], object], remove: Callable[[str], object]) -> str | None:
    """Whether an entry can be made in `directory`, by making one and removing it: `os.access` says yes for root
    wherever the mode bits would refuse, also in /proc and /sys, which refuse every new entry. None, or why not."""
    probe = os.path.join(directory, f".fw-validate-{os.getpid()}")
    try:
        make(probe)
    except OSError as e:
        return e.strerror or str(e)
    with contextlib.suppress(OSError):
        remove(probe)
    return None


class _Checks:
    def __init__(self, located: LocatedConfig):
        self.located = located
        self.cfg = located.cfg
        self.recipe = self.cfg["recipe"]
        self.problems: list[Problem] = []
        self.task: Any = None
        self.task_failed = False

    # ------------------------------------------------------------------ helpers
    def add(self, path: tuple, message: str, key: bool = False, keys: Collection | None = None,
            init_args: tuple | None = None) -> None:
        """A problem at `path`; one with a class's init_args (about their `keys`, where known) at the override that
        set the key it is about, if one did (config.py's LocatedConfig.problem), and so one raised by a constructor
        called with the `init_args` at that path, though shown at its class_path."""
        problem = self.located.problem(path, message, key, keys)
        if init_args is not None and path != init_args:
            set_at = self.located.problem(init_args, message, keys=keys)
            if is_override(Mark(set_at.file, set_at.line, set_at.col)):
                problem = dataclasses.replace(problem, file=set_at.file, line=set_at.line, col=set_at.col)
        self.problems.append(problem)

    def _overridden(self, paths: list[tuple]) -> tuple:
        """Of the keys one check relates, the first that a command-line override set (the value the user changed
        last, so where the problem shows), else the first written in a config file (a key left to its default has no
        line of its own: it would show at its section's first key), else the first."""
        for path in paths:
            located = self.located.marks.get(path)
            if located is not None and is_override(located.value):
                return path
        return next((path for path in paths if path in self.located.marks), paths[0])

    def add_error(self, e: BaseException, default: tuple, what: str = "", init_args: tuple | None = None) -> None:
        """An error from a builder: at the key its message starts with (`data.task.init_args: ...`), else
        at `default` (`init_args`: the key of the init_args the builder was called with, see `add`); an exception
        that is not an FwError is shown as what raised it. A KeyboardInterrupt (Ctrl+C
        while user code ran, or its own) is no problem of the config: it ends the checks as Ctrl+C ends fw, with exit
        code 130 and one line that names the call and the user's line it stopped at."""
        if isinstance(e, KeyboardInterrupt):
            from framework.signals import Interrupted

            raise Interrupted(f"{what or '.'.join(map(str, default))}{user_line(e)}") from e
        if not isinstance(e, FwError):
            self.add(default, f"{what} {what_raised(e)}{user_line(e)}".strip(), init_args=init_args)
            return
        text = str(e)
        keys = e.keys if isinstance(e, InitArgsError) else None   # the init_args keys it is about, where known
        for dotted in _keys():
            if text.startswith((dotted + ":", dotted + " ")):
                rest = text[len(dotted):].lstrip(":").strip()
                self.add(tuple(dotted.split(".")), rest, keys=keys)
                return
        self.add(default, text, keys=keys, init_args=init_args)

    # ------------------------------------------------------------------ paths
    def run_dir(self) -> None:
        from framework.run_lock import LOCK_FILE

        path = self.cfg["run_dir"]
        inside = _inside_checkpoints(path)
        if inside:
            self.add(("run_dir",), f"{path} {inside}")
            return
        if os.path.exists(path):
            if not os.path.isdir(path):
                self.add(("run_dir",), f"{path} is a file; run_dir must be a directory")
            elif not os.access(path, os.W_OK | os.X_OK):
                self.add(("run_dir",), f"{path} is not writable")
            else:
                problem = _write_probe(path, lambda at: os.close(os.open(at, os.O_CREAT | os.O_EXCL | os.O_WRONLY)),
                                       os.remove)
                if problem:
                    self.add(("run_dir",), f"{path} is not writable: {problem}")
            # what fit writes there, by kind: one of the other kind in its place fails the run midway
            for name, directory in (("checkpoints", True), ("logs", True), (LOCK_FILE, False),
                                    ("metrics.jsonl", False), ("config.yaml", False)):
                child = os.path.join(path, name)
                if os.path.exists(child) and os.path.isdir(child) != directory:
                    self.add(("run_dir",), f"{child} is a {'file' if directory else 'directory'}; fit writes "
                                           f"{'a directory' if directory else 'a file'} there: move it away")
            config = os.path.join(path, "config.yaml")
            if os.path.isfile(config) and not written_by_fw(config):
                # fit replaces it with the run's resolved config: a hand-written one (a config next to its own
                # run, `run_dir: .`) would lose its comments and take in every override of the command
                self.add(("run_dir",), f"{config} is not a config.yaml that fw wrote; fit writes the run's resolved "
                                       "config there, which would replace it: move it away or choose another run_dir")
            return
        parent = path
        while not os.path.exists(parent):
            parent = os.path.dirname(parent)
        if not os.path.isdir(parent):
            self.add(("run_dir",), f"cannot create {path}: {parent} is a file")
        elif not os.access(parent, os.W_OK | os.X_OK):
            self.add(("run_dir",), f"cannot create {path}: {parent} is not writable")
        else:
            problem = _write_probe(parent, os.mkdir, os.rmdir)
            if problem:
                self.add(("run_dir",), f"cannot create {path}: {problem}")

    def model_dir(self, where: tuple, value: bool = False) -> Any:
        """The Qwen3Config of the model directory at `where`, or None after adding its problem."""
        from framework.models.hf_io import VALUE_ARCHITECTURE, checkpoint_files, read_config

        path = self.cfg
        for k in where:
            path = path[k]
        if not os.path.exists(path):
            self.add(where, f"no such directory: {path} (expected {MODEL_DIR})")
            return None
        if not os.path.isdir(path):
            self.add(where, f"{path} is a file; expected {MODEL_DIR}")
            return None
        other = _fw_directory(path, value)
        if other is not None:
            self.add(where, other)
            return None
        try:
            config, raw = read_config(path)
            files = checkpoint_files(path)
        except FwError as e:
            self.add(where, str(e))
            return None
        if not value and VALUE_ARCHITECTURE in (raw.get("architectures") or []):
            self.add(where, f"{path} holds a value model ({VALUE_ARCHITECTURE}), not a language model")
            return None
        from safetensors import safe_open

        for file in files:
            try:
                with safe_open(str(file), framework="pt", device="cpu") as f:
                    f.keys()
            except Exception as e:  # noqa: BLE001 (safetensors raises its own error types)
                self.add(where, f"{file}: not a readable safetensors file ({e})")
                return None
        return config

    def models(self, policy_only: bool = False) -> None:
        """The model directories (the policy's alone with `policy_only`: what generate and eval build) and the
        tokenizer."""
        model = self.cfg["model"]
        roles = ["policy"]
        needs = None if policy_only else self._requirements()
        if needs is not None:   # the models the recipe builds, as fit does
            roles += [role for role, built in (("value", needs.value_model), ("reference", needs.reference_model))
                      if built]
        configs = {("model", role, "path"): self.model_dir(("model", role, "path"), value=role == "value")
                   for role in roles if model[role]["path"]}
        if needs is not None:
            self._say_unread(needs)
        policy_at = ("model", "policy", "path")
        tokenizer_at = ("tokenizer", "path") if self.cfg["tokenizer"]["path"] else policy_at
        if tokenizer_at == policy_at and policy_at in configs and configs[policy_at] is None:
            return   # the policy directory's problem is reported; its tokenizer cannot be read
        from framework.models.build import vocabulary_problem
        from framework.tokenizer import Tokenizer

        tokenizer_path = self.cfg["tokenizer"]["path"] or model["policy"]["path"]
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")   # a differing chat template is fit's warning to give
                tokenizer = Tokenizer.from_pretrained(tokenizer_path) if tokenizer_path else Tokenizer.builtin()
        except FwError as e:
            self.add(tokenizer_at, str(e))
            return
        for where, config in configs.items():
            problem = None if config is None else vocabulary_problem(tokenizer.vocab_size, config)
            if problem is not None:
                self.add(tokenizer_at if where == policy_at else where, problem)

    def _say_unread(self, needs: Any) -> None:
        """Say (on the first process) which model paths the recipe will not read: a critic's under a recipe without
        one, a reference's where its KL coefficient is 0 (a path that still looks in use)."""
        if not first_process():
            return
        model, kl = self.cfg["model"], (self.cfg.get(self.recipe) or {}).get("kl_coef")
        why = {"value": f"recipe {self.recipe} trains no critic",
               "reference": f"{self.recipe}.kl_coef is {kl}, so no reference model is built" if kl == 0
               else f"recipe {self.recipe} builds no reference model"}
        for role, built in (("value", needs.value_model), ("reference", needs.reference_model)):
            if model[role]["path"] and not built:
                print(f"fw: warning: model.{role}.path is set, but {why[role]}: it is not read", file=sys.stderr)

    # ------------------------------------------------------------------ data
    def data(self) -> None:
        data = self.cfg["data"]
        if self.recipe in BUILTIN_RECIPES:
            if data["path"] and data["task"]:
                self.add(self._overridden([("data", "task"), ("data", "path")]),
                         "set either data.task or data.path (JSONL), not both", key=True)
                return   # which one the run is to read is the user's choice: no report on the rows of either
            if not data["path"] and not data["task"]:
                need = "examples" if self.recipe == "sft" else "prompts"
                self.add(("data",), f"recipe {self.recipe} needs {need}: set data.path (JSONL) or data.task "
                                    "(e.g. {name: digits})", key=True)
        paths = data["path"]
        for i, path in enumerate([paths] if isinstance(paths, str) else paths or []):
            self.jsonl(("data", "path") if isinstance(paths, str) else ("data", "path", i), path)

    def evaluation(self) -> None:
        """eval.path's files, read as the training data's are, where training evaluates (`fw eval` checks its own
        source when it runs)."""
        from framework.evaluation import SOURCE_PROBLEM, eval_enabled

        if not eval_enabled(self.cfg):
            return
        if self.cfg["eval"]["path"] is None and not self.cfg["data"]["task"]:
            self.add(("eval", "path"), SOURCE_PROBLEM)
        self.eval_files()

    def eval_files(self) -> None:
        """eval.path's JSONL files, row by row."""
        paths = self.cfg["eval"]["path"]
        for i, path in enumerate([paths] if isinstance(paths, str) else paths or []):
            self.jsonl(("eval", "path") if isinstance(paths, str) else ("eval", "path", i), path, "eval.path")

    def jsonl(self, where: tuple, path: str, key: str = "data.path") -> None:
        from framework.data import record_problem
        from framework.jsonl import NotUtf8, rows
        from framework.rewards import parse_reference
        from framework.tasks import JsonlPrompts, prompt_record_problem

        if not os.path.isfile(path):
            self.add(where, f"no such file: {path}" if not os.path.exists(path) else f"{path} is not a file")
            return
        data = self.cfg["data"]
        reward = self.cfg["reward"]
        # numeric_match (named, or JSONL prompts' own reward) needs each answer to be one number
        numeric = not reward["class_path"] and (reward["name"] or JsonlPrompts.reward_name) == "numeric_match"
        bad = n = 0
        try:
            for row in rows(path):
                n += 1
                problem = row.problem
                if problem is None and self.recipe == "sft":
                    problem = record_problem(row.record, data["format"], data["chat_template"])[1]
                elif problem is None and self.recipe in RL_RECIPES:
                    problem = prompt_record_problem(row.record, data["prompt_key"], data["answer_key"])
                    if problem is None and not data["chat_template"]:
                        problem = _messages_without_template(row.record[data["prompt_key"]], repr(data["prompt_key"]))
                    if problem is None and numeric:
                        try:
                            parse_reference(row.record[data["answer_key"]])
                        except ValueError as e:
                            problem = f"{data['answer_key']}: {e}"
                if problem:
                    bad += 1
                    whole = _one_json_document(path) if n == 1 and row.record is None else None
                    if whole:
                        self.add(where, f"{path} is one JSON document ({whole}) over several lines, not JSON Lines: "
                                        "write each record as one JSON object on a line of its own")
                        return
                    if bad <= MAX_ROW_PROBLEMS:
                        self.problems.append(Problem(path, row.line, row.col, key, problem))
        except NotUtf8 as e:   # after the rows before its line
            if bad > MAX_ROW_PROBLEMS:
                self.problems.append(Problem(path, None, None, key,
                                             f"{bad - MAX_ROW_PROBLEMS} more bad rows not shown"))
            self.problems.append(Problem(e.path, e.line, e.col, key, e.reason))
            return
        except FwError as e:   # unreadable
            self.add(where, str(e).removeprefix("data.path: "))
            return
        if bad > MAX_ROW_PROBLEMS:
            self.problems.append(Problem(path, None, None, key, f"{bad - MAX_ROW_PROBLEMS} more bad rows not shown"))
        if n == 0:
            self.add(where, f"{path} holds no records (every line is empty)")

    def held_out(self) -> None:
        """The eval set that is left once the samples the run can train on are held out must not be empty: fit
        refuses it at its first evaluation, so the same check (`check_held_out`, no model built) runs here, for
        the run's number of processes (`trainer.devices` x `trainer.num_nodes`). It reads the task and data the
        checks above looked at, so it runs only when they found nothing: their problem is the one to fix first."""
        from framework.evaluation import check_held_out, eval_enabled

        if not (eval_enabled(self.cfg) and self.cfg["eval"]["held_out"]) or self.problems:
            return
        if not first_process():
            return   # a process that global rank 0 of a multi-process fit started, after rank 0 checked it
        try:
            check_held_out(self.cfg, world_size(self.cfg))
        except USER_CODE_RAISES as e:   # user code, the task's: add_error says it
            if isinstance(e, FwError) and str(e).startswith("eval: "):
                # shown where the eval samples come from when a file does: the key a user changes
                self.add(("eval", "path") if self.cfg["eval"]["path"] else ("eval", "held_out"),
                         str(e).removeprefix("eval: "))
            else:
                self.add_error(e, ("eval",), "choosing the held-out eval set")

    def kv_rows(self, machine: bool) -> None:
        """The longest row of a rollout and of an evaluation must fit the rollout engine's KV pool where the config
        fixes its budget (rollout.kv_cache_gib, or the fixed one off CUDA), which the engine refuses it from at the
        first rollout or evaluation. `fw validate` (not `machine`) checks the fixed budget off CUDA only for a job
        that leaves no GPU to the machine that runs it. Runs only when the checks above found nothing: it reads the
        data they read."""
        if self.recipe not in RL_RECIPES or self.problems:
            return
        from framework.config import uses_cuda
        from framework.evaluation import Evaluation, eval_enabled
        from framework.memory_plan import kv_row_problem, user_code
        from framework.models.build import policy_config
        from framework.recipe import recipe_class
        from framework.tokenizer import build_tokenizer

        t = self.cfg["trainer"]
        cuda = uses_cuda(t) if machine else t["accelerator"] not in ("cpu", "mps")
        if self.cfg["rollout"]["kv_cache_gib"] is None and cuda:
            return
        recipe = recipe_class(self.recipe)
        tokenizer = build_tokenizer(self.cfg)
        model = policy_config(self.cfg["model"]["policy"], tokenizer)
        try:
            with user_code(recipe):   # Ctrl+C in the task's code ends fw as the memory plan's reading does
                shapes = recipe.batch_shapes(self.cfg, tokenizer)
        except FwError:   # the task's prompts past its first: the memory plan, which reads them next, says it
            return
        backend = "cuda" if cuda else "cpu"
        problem = kv_row_problem(self.cfg, model, backend, shapes.prompt_len, shapes.new_tokens,
                                 "rollout.max_new_tokens")
        if problem:
            # where not even the prompt fits (a row of one new token does not), no limit helps: the budget is the key
            fits = kv_row_problem(self.cfg, model, backend, shapes.prompt_len, 1, "rollout.max_new_tokens") is None
            self.add(("rollout", "max_new_tokens" if fits else "kv_cache_gib"), problem)
            return
        e = self.cfg["eval"]
        if not eval_enabled(self.cfg):
            return
        try:
            ids = Evaluation(self.cfg, tokenizer, world_size(self.cfg)).ids
        except USER_CODE_RAISES as exc:   # user code, the task's or the reward's: add_error says it
            self.add_error(exc, ("eval",), "choosing the eval set")
            return
        new = e["max_new_tokens"] or shapes.new_tokens
        problem = kv_row_problem(self.cfg, model, backend, max(map(len, ids), default=0), new, "eval.max_new_tokens")
        if problem:
            # at eval.path where its prompts, not a limit of its own, pass the rollout's pool
            self.add(("eval", "path" if e["max_new_tokens"] is None and e["path"] else "max_new_tokens"), problem)

    def sft_lengths(self) -> None:
        """SFT data tokenized as training tokenizes it: the examples that data.max_seq_len cuts, and those with an empty
        reply, are said on stderr, as fit says them, and data that keeps no token to train on is a problem. Runs only
        when the checks above found nothing."""
        if self.recipe != "sft" or not self.cfg["data"]["path"] or self.problems:
            return
        from framework.data import load_examples
        from framework.tokenizer import build_tokenizer

        try:
            load_examples(self.cfg, build_tokenizer(self.cfg), train_on_prompt=self.cfg["sft"]["train_on_prompt"])
        except FwError as e:
            self.add_error(e, ("data", "path"))

    # ------------------------------------------------------------------ class_path parts
    def plugins(self) -> None:
        sample = self.task_sample()
        reward = self.cfg["reward"]
        # without a task a null reward.name has nothing to follow: the task's problem is the one to fix
        task_missing = (self.task_failed or self.task is None) and not reward["class_path"] and not reward["name"]
        if self.recipe in RL_RECIPES and not task_missing:
            from framework.rewards import build_reward

            try:
                reward = build_reward(self.cfg["reward"], self.task)
            except USER_CODE_RAISES as e:   # user code: add_error says it
                r = self.cfg["reward"]
                self.add_error(e, ("reward", "class_path") if r["class_path"] else
                               ("reward", "init_args") if r["init_args"] else ("reward",), "building the reward",
                               init_args=("reward", "init_args"))
            else:
                problem = reward_call_problem(reward, self.cfg["reward"]["class_path"])
                if problem:
                    self.add(("reward", "class_path"), problem)
                if sample is not None:   # the task's first sample holds what the reward reads of it
                    from framework.rewards import check_metadata

                    try:
                        check_metadata(self.task, 0, sample, reward)
                    except FwError as e:
                        self.add_error(e, ("data", "task"))
                    except USER_CODE_RAISES as e:   # the reward's own metadata_problem: add_error says it
                        self.add_error(e, ("reward", "class_path"), f"{type(reward).__name__}.metadata_problem("
                                       f"{type(self.task).__name__}.sample(0)'s metadata)")
        if self.cfg["callbacks"]:   # Lightning (seconds to import) only where a user's callback is to be checked
            self.callbacks()
        if self.cfg["logging"]["loggers"]:
            self.loggers()

    def task_sample(self) -> dict | None:
        """Build a class_path or built-in task and check its first sample, as training reads it: that sample, or None
        (no such task, or one that failed)."""
        data = self.cfg["data"]
        sample = None
        if data["task"] and not data["path"]:
            from framework.tasks import build_task, checked_sample

            try:
                self.task = build_task(data, seed=self.cfg["seed"])
            except USER_CODE_RAISES as e:   # user code: add_error says it
                self.task_failed = True
                at = ("data", "task", "init_args") if ("data", "task", "init_args") in self.located.marks else \
                    ("data", "task")
                self.add_error(e, at, "building the task")
            else:
                try:   # its first sample, as training reads it
                    sample = checked_sample(self.task, 0)
                    prompt = sample["prompt"]
                except USER_CODE_RAISES as e:   # user code: add_error says it
                    self.task_failed = True
                    self.add_error(e, ("data", "task"), f"{type(self.task).__name__}.sample(0)")
                else:
                    problem = None if data["chat_template"] or self.recipe not in RL_RECIPES else \
                        _messages_without_template(prompt, f"{type(self.task).__name__}.sample(0)'s prompt")
                    if problem:
                        self.add(("data", "task"), problem)
        elif data["path"] and self.recipe in RL_RECIPES:
            from framework.tasks import JsonlPrompts

            self.task = JsonlPrompts   # its reward_name is what a null reward.name means
        return sample

    def callbacks(self) -> None:
        from framework.callbacks import callback_problems
        from framework.imports import instantiate_once

        built = []
        for i, spec in enumerate(self.cfg["callbacks"]):
            try:
                built.append((i, spec["class_path"], instantiate_once(spec, f"callbacks[{i}]")))   # fit's run uses it
            except USER_CODE_RAISES as e:   # user code: add_error says it
                self.add_error(e, ("callbacks", i, "class_path"), "building the callback",
                               init_args=("callbacks", i, "init_args"))
        for i, problem in callback_problems(built, self.cfg["trainer"]["enable_progress_bar"]):
            self.add(("callbacks", i, "class_path"), problem)

    def loggers(self) -> None:
        from framework.loggers import logger_args_problem, logger_class_problem

        for i, spec in enumerate(self.cfg["logging"]["loggers"]):
            problem = logger_class_problem(spec["class_path"])
            if problem is not None:
                self.add(("logging", "loggers", i, "class_path"), problem)
            elif problem := logger_args_problem(spec, self.cfg["run_dir"]):
                self.add(("logging", "loggers", i, "init_args"), problem)

    # ------------------------------------------------------------------ combinations
    def combinations(self, machine: bool = False) -> None:
        from framework.optim import optimizer_problems
        from framework.recipe import recipe_class
        from framework.rewards import settings_problems
        from framework.schedule import schedule_problems

        cfg = self.cfg
        try:
            own = getattr(recipe_class(cfg["recipe"]), "config_problems", None)
        except FwError:   # a recipe that cannot be loaded: the config stage has said why
            own = None
        recipe_problems: list[str] = []
        if callable(own):
            try:
                recipe_problems = list(own(cfg))
            except USER_CODE_RAISES as e:   # a plugin recipe's code: add_error says it
                self.add_error(e, ("recipe",), f"{self.recipe}'s config_problems(cfg)")
        for problem in [*optimizer_problems(_on_a_gpu(cfg) if _offloads_for_a_gpu(cfg, machine) else cfg),
                        *schedule_problems(cfg), *(settings_problems(cfg) if self.recipe in RL_RECIPES else []),
                        *recipe_problems]:
            key, _, message = problem.partition(": ")   # each line starts with the key it names
            self.add(tuple(key.split(".")), message)
        if self.recipe not in RL_RECIPES:
            return
        temperature = cfg["rollout"]["temperature"]
        if temperature <= 0:
            self.add(("rollout", "temperature"), f"{self.recipe} samples from the policy and needs a temperature "
                     f"> 0 (got {temperature}); the trainer's logprobs use the same one")
        self.batch_split()

    def batch_split(self) -> None:
        """An RL rollout batch too small for its minibatches x micro-batches: no policy step could be cut from it."""
        if self.recipe not in RL_RECIPES:
            return
        cfg = self.cfg
        section = cfg[self.recipe]
        samples = cfg["rollout"]["prompts_per_step"] * section[RL_RECIPES[self.recipe]]
        micro = cfg["trainer"]["accumulate_grad_batches"]
        if section["minibatches"] * micro > samples:
            related = [(self.recipe, "minibatches"), ("trainer", "accumulate_grad_batches"),
                       ("rollout", "prompts_per_step"), (self.recipe, RL_RECIPES[self.recipe])]
            self.add(self._overridden(related),
                     f"{section['minibatches']} minibatches x trainer.accumulate_grad_batches ({micro}) exceeds the "
                     f"{samples} samples of one rollout batch (rollout.prompts_per_step x "
                     f"{self.recipe}.{RL_RECIPES[self.recipe]})")

    # ------------------------------------------------------------------ trainer
    def trainer(self, machine: bool) -> None:
        t = self.cfg["trainer"]
        strategy = t["strategy"]
        known = ["auto"]
        if strategy != "auto":   # Lightning (seconds to import) only where another strategy is named
            from lightning.pytorch.strategies import StrategyRegistry

            known += StrategyRegistry.available_strategies()
        unsupported = next((why for prefix, why in UNSUPPORTED_STRATEGIES.items() if strategy.startswith(prefix)),
                           None)
        strategy_ok = False
        if unsupported and strategy in known:
            self.add(("trainer", "strategy"), f"'{strategy}' is not supported by fw: {unsupported}")
        elif strategy not in known:
            usable = [s for s in known if not any(s.startswith(p) for p in UNSUPPORTED_STRATEGIES)
                      and "find_unused" not in s]   # variants fw picks itself when a recipe needs them
            close = difflib.get_close_matches(strategy, usable, n=1)
            self.add(("trainer", "strategy"), f"unknown strategy '{strategy}'; expected one of "
                     f"{', '.join(usable)}" + (f"; did you mean '{close[0]}'?" if close else ""))
        elif strategy == "single_device" and (problem := _single_device_problem(self.cfg)):
            self.add(("trainer", "strategy"), problem)
        else:
            strategy_ok = True
        needs = self._requirements()
        if needs is not None:
            from framework.precision import check_precision

            try:
                check_precision(self.cfg, needs, machine)
            except FwError as e:
                self.add_error(e, ("trainer", "precision"))
        if machine and strategy_ok:
            self.machine()

    def _requirements(self) -> Any:
        """The recipe's `requirements(cfg)`; None where the recipe cannot be loaded (the schema checks have said
        why) or its own code raises (said here, once)."""
        from framework.recipe import recipe_class

        if not hasattr(self, "_needs"):
            self._needs = None
            try:
                recipe = recipe_class(self.recipe)
            except FwError:
                return None
            try:
                self._needs = recipe.requirements(self.cfg)
            except USER_CODE_RAISES as e:   # user code: add_error says it
                self.add_error(e, ("recipe",), f"{self.recipe}'s requirements(cfg)")
        return self._needs

    def machine(self) -> None:
        """The accelerator, devices, strategy and precision must be available on this machine."""
        import torch

        t = self.cfg["trainer"]
        accelerator = t["accelerator"]
        if accelerator in ("gpu", "cuda") and not torch.cuda.is_available():
            build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
            self.add(("trainer", "accelerator"), f"'{accelerator}' needs a CUDA GPU and this machine has none "
                     f"visible (torch {torch.__version__}, {build}); use trainer.accelerator: cpu or auto")
            return
        mps = getattr(torch.backends, "mps", None)
        if accelerator == "mps" and not (mps and mps.is_available()):
            self.add(("trainer", "accelerator"), "'mps' needs Apple-silicon MPS, which this machine does not have")
            return
        devices = t["devices"]
        if accelerator in ("gpu", "cuda") and isinstance(devices, int) and devices > torch.cuda.device_count():
            self.add(("trainer", "devices"), f"{devices} GPUs asked for, {torch.cuda.device_count()} visible")
            return
        from lightning.pytorch.trainer.connectors.accelerator_connector import _AcceleratorConnector

        from framework.trainer import quiet_lightning

        try:
            # quiet as fw's own Trainer is: its info lines ("Using bfloat16 Automatic Mixed Precision") would
            # otherwise come before the config's problems, or once more before a run
            with warnings.catch_warnings(), quiet_lightning():
                warnings.simplefilter("ignore")
                _AcceleratorConnector(devices=devices, num_nodes=t["num_nodes"], accelerator=accelerator,
                                      strategy=t["strategy"], precision=t["precision"])
        except Exception as e:  # noqa: BLE001 (Lightning's refusals come as several exception types)
            first = re.sub(r"\s+", " ", str(e)).strip()
            self.add(("trainer",), f"Lightning cannot run these trainer settings on this machine: {first}", key=True)
            return
        if self.recipe in RL_RECIPES and accelerator in ("auto", "gpu", "cuda") and torch.cuda.is_available():
            self.fp8_rollout()

    def fp8_rollout(self) -> None:
        """A float8 KV cache on CUDA needs a 16-bit rollout (the decode kernel's queries): refused before the run."""
        import torch

        from framework.memory_plan import compute_dtype
        from framework.rollout.kv_cache import fp8_cuda_problem

        if self.cfg["rollout"]["kv_cache_dtype"] != "float8_e4m3":
            return
        problem = fp8_cuda_problem(getattr(torch, compute_dtype(self.cfg)))
        if problem:
            self.add(("rollout", "kv_cache_dtype"), problem)


def _single_device_problem(cfg: dict) -> str | None:
    """Why Lightning's `single_device` strategy cannot run the job, or None: the registry builds it with the CPU as
    its device, which no setting changes (a GPU's accelerator refuses it at the start of the fit), and it runs one
    process whatever trainer.devices and trainer.num_nodes ask for."""
    from framework.config import uses_cuda

    t = cfg["trainer"]
    if t["accelerator"] in ("gpu", "cuda", "mps") or uses_cuda(t):
        return ("'single_device' is Lightning's one-process strategy on the CPU (no setting gives it another device), "
                "and this job runs on a GPU, whose accelerator refuses the CPU when the fit starts; use auto, which "
                "runs a one-device job on its device")
    processes = world_size(cfg, "cpu")
    if processes != 1:
        return (f"'single_device' runs one process, but trainer.devices x trainer.num_nodes asks for {processes}; "
                f"use auto for one process, or ddp for {processes}")
    return None


def _offloads_for_a_gpu(cfg: dict, machine: bool = False) -> bool:
    """Whether the optimizer.cpu_offload of `cfg` is checked for a GPU that this machine lacks: `fw validate` (not
    `machine`) checks a job that leaves the device to the machine that runs it (trainer.accelerator: auto) as it runs
    on one with a GPU, whose states cpu_offload moves, as it checks `accelerator: gpu` on any machine; `fw fit`
    checks it on this machine."""
    from framework.config import uses_cuda

    t = cfg["trainer"]
    return not machine and cfg["optimizer"]["cpu_offload"] and t["accelerator"] == "auto" and not uses_cuda(t)


def reward_call_problem(reward: Any, class_path: str | None) -> str | None:
    """Why fw cannot call the reward that `class_path` built as it scores samples, or None (also for a built-in): its
    batch(prompts, completions, metadatas) where it has one, and its own call (prompt, completion, metadata) where it
    is callable, which fw falls back to when batch() raises. A signature that inspect cannot read passes."""
    if not class_path:
        return None
    batch = getattr(reward, "batch", None)
    calls = [(batch, "a rollout batch, reward.batch(prompts, completions, metadatas)", ([], [], []))] \
        if callable(batch) else []
    if callable(reward):
        calls.append((reward, "a sample, reward(prompt, completion, metadata)", ("", "", {})))
    for target, how, args in calls:
        try:
            signature = inspect.signature(target)
        except (TypeError, ValueError):   # a builtin or C extension's: nothing to read
            continue
        try:
            signature.bind(*args)
        except TypeError as e:
            name = getattr(target, "__name__", "__call__")   # an instance's own call has no name of its own
            return f"{class_path} builds a reward that fw cannot call as it scores {how}: its {name}{signature}: {e}"
    return None


def _on_a_gpu(cfg: dict) -> dict:
    """`cfg` with its trainer on a GPU (trainer.accelerator: gpu)."""
    return {**cfg, "trainer": {**cfg["trainer"], "accelerator": "gpu"}}


def process_assumption(cfg: dict) -> str | None:
    """What `fw validate` assumed of the machine that runs the job where a check depends on it and the config leaves
    it to that machine, or None where nothing did: the number of processes (`trainer.devices: auto` or -1) for the
    held-out eval set, whose training draws grow with the processes, so that it may pass here and fail on a machine
    of more GPUs (a refusal here holds for more processes too); a GPU for optimizer.cpu_offload under
    `trainer.accelerator: auto` on a machine without one (`_offloads_for_a_gpu`)."""
    from framework.evaluation import eval_enabled, needs_draws

    said = []
    t = cfg["trainer"]
    auto_devices = t["devices"] in ("auto", -1)
    if auto_devices and t["accelerator"] != "cpu" and eval_enabled(cfg) and needs_draws(cfg):
        # on the CPU, auto is one process a node on any machine
        n = world_size(cfg)
        said.append(f"held-out eval set checked for {n} process{'es' if n > 1 else ''}, trainer.devices: "
                    f"{t['devices']} counting this machine's GPUs: --trainer.devices=N checks N a node")
    if _offloads_for_a_gpu(cfg):
        said.append(f"optimizer.cpu_offload checked for {'one GPU' if auto_devices else 'a GPU'}, which "
                    "trainer.accelerator: auto runs on where there is one (none here)"
                    + (f"; trainer.devices: {t['devices']} would take every GPU of a machine of several, and "
                       "cpu_offload runs in one process: --trainer.devices=1 keeps it to one" if auto_devices else ""))
    return "; ".join(said) or None
