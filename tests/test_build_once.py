"""`fw fit` builds each user object of the config (`class_path` + `init_args`) once in its process: the checks of
the config build it, and the run uses that object, so a constructor's side effects (a tracking run opened, a
directory made, a thread started) happen once."""

import inspect
import os
from pathlib import Path
from typing import ClassVar

import pytest
import yaml
from lightning.pytorch.loggers import CSVLogger
from test_ddp import run_fit

from framework import tasks as tasks_module
from framework.callbacks import Callback
from framework.cli import main
from framework.tasks import Task

DATA = "recipes/data/arithmetic_chat.jsonl"


def fit_args(run_dir, *extra):
    return ["fit", "--config", "recipes/sft.yaml", f"--run_dir={run_dir}", f"--data.path={DATA}",
            "--data.max_seq_len=64", "--data.batch_size=2", "--trainer.enable_progress_bar=false",
            "--logging.tensorboard=false", "--logging.csv=false", *extra]


class Opens(Callback):
    """Opens its `run` file at construction, as a tracking client opens a run; keeps what it saw of the fit."""

    built: ClassVar[list] = []   # every instance, in the order built

    def __init__(self, run: str):
        with open(run, "a") as f:
            f.write("opened\n")
        self.steps: list[int] = []
        self.restored: list[int] = []
        Opens.built.append(self)

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.steps.append(module.policy_version)

    def state_dict(self):
        return {"steps": list(self.steps)}

    def load_state_dict(self, state):
        self.restored = list(state["steps"])


class CountedLogger(CSVLogger):
    built: ClassVar[list] = []

    def __init__(self, save_dir: str):
        super().__init__(save_dir=save_dir)
        CountedLogger.built.append(self)


def test_a_callback_and_a_logger_are_built_once_and_the_run_uses_them(tmp_path, monkeypatch):
    """The checks of `fw fit` built each callback, and the trainer built it again: a constructor that opens a
    tracking run opened two, one of which saw no step."""
    monkeypatch.setattr(Opens, "built", [])
    monkeypatch.setattr(CountedLogger, "built", [])
    run = tmp_path / "tracking.txt"
    assert main(fit_args(tmp_path / "run", "--trainer.max_steps=2",
                         f"--callbacks=[{{class_path: test_build_once.Opens, init_args: {{run: {run}}}}}]",
                         "--logging.loggers=[{class_path: test_build_once.CountedLogger}]")) == 0
    assert run.read_text() == "opened\n"
    assert len(Opens.built) == 1 and Opens.built[0].steps == [1, 2]
    assert len(CountedLogger.built) == 1


def test_two_alike_callbacks_are_two_objects(tmp_path, monkeypatch):
    """The same class_path and init_args twice in `callbacks` are two callbacks, each built once."""
    monkeypatch.setattr(Opens, "built", [])
    run = tmp_path / "tracking.txt"
    spec = f"{{class_path: test_build_once.Opens, init_args: {{run: {run}}}}}"
    # a state_key of their own: a checkpoint holds one state per key
    monkeypatch.setattr(Opens, "state_key", property(lambda self: f"Opens{Opens.built.index(self)}"))
    assert main(fit_args(tmp_path / "run", "--trainer.max_steps=1", f"--callbacks=[{spec}, {spec}]")) == 0
    assert run.read_text() == "opened\n" * 2
    assert len(Opens.built) == 2 and Opens.built[0] is not Opens.built[1]
    assert [cb.steps for cb in Opens.built] == [[1], [1]]


def test_a_resumed_run_builds_its_callback_once_and_restores_its_state_into_it(tmp_path, monkeypatch):
    run = tmp_path / "tracking.txt"
    callbacks = f"--callbacks=[{{class_path: test_build_once.Opens, init_args: {{run: {run}}}}}]"
    monkeypatch.setattr(Opens, "built", [])
    assert main(fit_args(tmp_path / "run", "--trainer.max_steps=1", callbacks)) == 0
    monkeypatch.setattr(Opens, "built", [])
    assert main(fit_args(tmp_path / "run", "--trainer.max_steps=2", "--resume=last", callbacks)) == 0
    assert run.read_text() == "opened\n" * 2   # once a process
    assert len(Opens.built) == 1
    assert Opens.built[0].restored == [1] and Opens.built[0].steps == [2]


def test_a_callback_that_fails_to_build_is_still_refused_at_its_line_before_the_run(tmp_path, capsys):
    config = tmp_path / "c.yaml"
    config.write_text(f"recipe: sft\nrun_dir: {tmp_path / 'run'}\nmodel: {{policy: {{preset: tiny}}}}\n"
                      "data: {task: {name: digits}}\ntrainer: {max_steps: 1}\ncallbacks:\n"
                      "  - {class_path: test_build_once.Opens, init_args: {run: /nonexistent/dir/run.txt}}\n")
    assert main(["fit", "--config", str(config)]) == 2
    opens_at = inspect.getsourcelines(Opens.__init__)[1] + 1   # the constructor's open()
    line = (f"{config}:7:18: callbacks[0].class_path: test_build_once.Opens(**init_args) raised FileNotFoundError: "
            f"[Errno 2] No such file or directory: '/nonexistent/dir/run.txt' (at {__file__}:{opens_at})")
    assert capsys.readouterr().err.splitlines() == [line]
    assert not (tmp_path / "run").exists()


class SeededTask(Task):
    """The digits 0-9 in an order of its seed; each construction noted with its seed."""

    reward_name = "numeric_match"
    built: ClassVar[list] = []

    def __init__(self, seed: int = 0):
        super().__init__(seed)
        SeededTask.built.append(seed)

    def __len__(self):
        return 10

    def sample(self, index):
        d = (index * 3 + self.seed) % 10
        return self._make(f"{d}=", str((d + 1) % 10))


class CountedReward:
    built: ClassVar[list] = []

    def __init__(self, scale: float):
        self.scale = scale
        self.calls = 0
        CountedReward.built.append(self)

    def __call__(self, prompt, completion, metadata):
        self.calls += 1
        return self.scale * float(completion.strip() == metadata["answer"])


def fit_grpo(tmp_path, data: dict, **sections) -> int:
    """`fw fit` of one GRPO step with evaluation on the tiny preset, prompts from `data`; `sections` add keys."""
    cfg = {"recipe": "grpo", "seed": 5, "run_dir": str(tmp_path / "run"), "model": {"policy": {"preset": "tiny"}},
           "data": {**data, "chat_template": False},
           "rollout": {"prompts_per_step": 2, "max_new_tokens": 2},
           "grpo": {"group_size": 2, "epochs": 1, "minibatches": 1},
           "eval": {"every_n_steps": 1, "max_prompts": 2, "samples_per_prompt": 1},
           "trainer": {"max_steps": 1, "enable_progress_bar": False},
           "logging": {"csv": False, "tensorboard": False}}
    for name, values in sections.items():
        cfg[name] = {**cfg.get(name, {}), **values}
    (tmp_path / "fit.yaml").write_text(yaml.safe_dump(cfg))
    return main(["fit", "--config", str(tmp_path / "fit.yaml")])


def test_an_rl_task_and_reward_are_built_once_each(tmp_path, monkeypatch):
    """A GRPO run with evaluation: its checks, the memory plan, the recipe and the evaluation each built the task
    (seven times with the run's seed, twice with the eval's) and the reward (four times). One task is built for the
    run's seed and one for `eval.seed` (README: the eval copy), and one reward, which training and evaluation
    call."""
    monkeypatch.setattr(SeededTask, "built", [])
    monkeypatch.setattr(CountedReward, "built", [])
    assert fit_grpo(tmp_path, {"task": {"class_path": "test_build_once.SeededTask"}},
                    reward={"class_path": "test_build_once.CountedReward", "init_args": {"scale": 2.0}}) == 0
    assert sorted(SeededTask.built) == [5, 6]   # eval.seed null: the run's seed + 1
    assert len(CountedReward.built) == 1
    assert CountedReward.built[0].calls == 2 * 2 + 2   # a rollout batch's samples, then the eval's


def test_rl_prompt_files_are_read_once(tmp_path, monkeypatch):
    """data.path and eval.path: the checks, the memory plans, the recipe and the evaluation each read the JSONL files
    again; now each is read once a process."""
    reads = []
    real = tasks_module.read_jsonl

    def counted(path, key):
        reads.append(str(path))
        return real(path, key)

    monkeypatch.setattr(tasks_module, "read_jsonl", counted)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(f'{{"prompt": "{i}+1=", "answer": "{i + 1}"}}\n' for i in range(8)))
    held_out = tmp_path / "held_out.jsonl"
    held_out.write_text("".join(f'{{"prompt": "{i}+2=", "answer": "{i + 2}"}}\n' for i in range(4)))
    assert fit_grpo(tmp_path, {"path": str(prompts)}, eval={"path": str(held_out)}) == 0
    assert sorted(reads) == [str(held_out), str(prompts)]


def _note(path: str, what: str) -> None:
    with open(path, "a") as f:
        f.write(f"{what} {os.getpid()}\n")


class NotesCallback(Callback):
    def __init__(self, notes: str):
        _note(notes, "callback")


class NotesTask(Task):
    reward_name = "numeric_match"

    def __init__(self, notes: str, seed: int = 0):
        super().__init__(seed)
        _note(notes, "task")

    def __len__(self):
        return 10

    def sample(self, index):
        d = (index * 3 + self.seed) % 10
        return self._make(f"{d}=", str((d + 1) % 10))


class NotesReward:
    def __init__(self, notes: str):
        _note(notes, "reward")

    def __call__(self, prompt, completion, metadata):
        return float(completion.strip() == metadata["answer"])


@pytest.mark.slow   # a 2-process Lightning start-up
def test_each_process_of_a_two_process_run_builds_each_object_once(tmp_path):
    """`trainer.strategy: ddp` starts the second process as a new `fw fit`, which checks the config and builds
    everything on its own: each process builds each user object once, the launching one too."""
    notes = str(tmp_path / "notes.txt")
    cfg = {"recipe": "grpo", "seed": 0, "run_dir": str(tmp_path / "run"), "model": {"policy": {"preset": "tiny"}},
           "data": {"task": {"class_path": "test_build_once.NotesTask", "init_args": {"notes": notes}},
                    "chat_template": False},
           "rollout": {"prompts_per_step": 2, "max_new_tokens": 2},
           "reward": {"class_path": "test_build_once.NotesReward", "init_args": {"notes": notes}},
           "grpo": {"group_size": 2},
           "callbacks": [{"class_path": "test_build_once.NotesCallback", "init_args": {"notes": notes}}],
           "trainer": {"accelerator": "cpu", "devices": 2, "strategy": "ddp", "max_steps": 1,
                       "enable_progress_bar": False},
           "logging": {"csv": False, "tensorboard": False}}
    proc = run_fit(tmp_path, cfg, timeout=600)
    assert proc.returncode == 0, proc.stderr
    lines = Path(notes).read_text().splitlines()
    pids = {line.split()[1] for line in lines}
    assert len(pids) == 2
    assert sorted(lines) == sorted(f"{what} {pid}" for pid in pids for what in ("callback", "task", "reward"))
