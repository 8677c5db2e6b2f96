"""`fw validate` / `fw fit` deep checks through real processes and real files: exit codes, one line per
problem at its position, the console script's imports, paths relative to the config file."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from framework.cli import main
from framework.config import MAX_PROBLEMS, ConfigError, load_config, resolve, save_resolved
from framework.errors import FwError
from framework.validate import MAX_ROW_PROBLEMS

ROOT = Path(__file__).resolve().parents[1]
GRPO = "recipe: grpo\nmodel:\n  policy:\n    preset: tiny\ndata:\n  task: {name: digits}\n"


def console_script(tmp_path: Path) -> Path:
    """What pip writes for `fw`: a script outside the working directory, so sys.path[0] is its own folder."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    script = bin_dir / "fw"
    script.write_text("import sys\nfrom framework.cli import main\nsys.exit(main())\n")
    return script


def run_script(tmp_path: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("FW_DEBUG", None)
    return subprocess.run([sys.executable, str(console_script(tmp_path)), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300, check=False)


def run_fw(argv: list[str], capsys) -> tuple[int, list[str]]:
    code = main(argv)
    return code, capsys.readouterr().err.splitlines()


def one_error_line(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    return lines[0]


# ------------------------------------------------------------------ the console script and imports

def test_console_script_imports_modules_next_to_the_config_and_in_the_working_directory(tmp_path):
    configs, work = tmp_path / "configs", tmp_path / "work"
    configs.mkdir()
    work.mkdir()
    for folder, name in ((configs, "cb_by_config"), (work, "cb_in_cwd")):
        (folder / f"{name}.py").write_text(
            "import lightning\n\nclass Noisy(lightning.Callback):\n    def __init__(self, every=1):\n"
            "        self.every = every\n")
    config = configs / "train.yaml"
    config.write_text(GRPO + "callbacks:\n  - class_path: cb_by_config.Noisy\n    init_args: {every: 2}\n"
                      "  - class_path: cb_in_cwd.Noisy\n")
    proc = run_script(tmp_path, work, "validate", "--config", str(config))
    assert (proc.returncode, proc.stderr) == (0, ""), proc.stderr
    assert "valid (recipe grpo)" in proc.stdout


def test_a_module_calling_sys_exit_at_import_is_an_error(tmp_path, monkeypatch, capsys):
    (tmp_path / "quitter.py").write_text("import sys\nsys.exit(0)\n")
    config = tmp_path / "train.yaml"
    config.write_text(GRPO + "reward:\n  class_path: quitter.Reward\n")
    line = one_error_line(run_script(tmp_path, tmp_path, "validate", "--config", str(config)))
    assert line.startswith(f"{config}:8:15: reward.class_path: ") and "called sys.exit(0)" in line
    monkeypatch.chdir(tmp_path)
    sys.modules.pop("quitter", None)
    assert run_fw(["fit", "--config", str(config)], capsys) == (2, [line])
    assert not (tmp_path / "runs").exists()


def test_a_reward_constructor_that_raises_stops_fit_before_anything_is_written(tmp_path):
    (tmp_path / "bad_reward.py").write_text(
        "class Reward:\n    def __init__(self, scale=1.0):\n        raise RuntimeError('no scale today')\n"
        "    def __call__(self, prompt, completion, metadata):\n        return 0.0\n")
    config = tmp_path / "train.yaml"
    config.write_text(GRPO + "run_dir: run\nreward:\n  class_path: bad_reward.Reward\n")
    line = one_error_line(run_script(tmp_path, tmp_path, "fit", "--config", str(config)))
    assert line == (f"{config}:9:15: reward.class_path: bad_reward.Reward(**init_args) raised RuntimeError: "
                    f"no scale today (at {tmp_path / 'bad_reward.py'}:3)")
    assert not (tmp_path / "run").exists()


# ------------------------------------------------------------------ this machine (fit only)

@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a CUDA GPU")
def test_accelerator_gpu_without_a_gpu_is_one_line_at_fit_and_valid_for_validate(tmp_path, capsys):
    config = tmp_path / "train.yaml"
    config.write_text(GRPO + "run_dir: run\ntrainer:\n  accelerator: gpu\n")
    # validate in this process (the console script's process is fit's below): a config for a GPU machine,
    # checked on a CPU one
    assert run_fw(["validate", "--config", str(config)], capsys) == (0, [])
    line = one_error_line(run_script(tmp_path, tmp_path, "fit", "--config", str(config)))
    assert line.startswith(f"{config}:9:16: trainer.accelerator: 'gpu' needs a CUDA GPU and this machine has none")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("strategy, message", [("nope", "unknown strategy 'nope'"),
                                               ("deepspeed", "'deepspeed' is not supported by fw")])
def test_strategy_problems_exit_2_at_fit(tmp_path, capsys, strategy, message):
    config = tmp_path / "train.yaml"
    config.write_text(GRPO + f"run_dir: {tmp_path / 'run'}\ntrainer:\n  strategy: {strategy}\n")
    code, lines = run_fw(["fit", "--config", str(config)], capsys)
    assert code == 2 and len(lines) == 1 and lines[0].startswith(f"{config}:9:13: trainer.strategy: {message}")
    assert not (tmp_path / "run").exists()


def test_single_device_strategy_is_refused_where_lightning_would_not_run_the_job(tmp_path, capsys):
    """Lightning's registry builds `single_device` on the CPU, which a GPU's accelerator refuses when the fit starts,
    and it runs one process whatever trainer.devices asks for (fw would plan, hold out and log for two). Both are
    refused at the key; one process on the CPU, which it runs, stays valid."""
    import lightning
    from lightning.pytorch.accelerators import CUDAAccelerator
    from lightning.pytorch.strategies import StrategyRegistry
    from lightning.pytorch.utilities.exceptions import MisconfigurationException

    assert StrategyRegistry.get("single_device").root_device == torch.device("cpu")
    with pytest.raises(MisconfigurationException, match="Device should be GPU, got cpu instead"):
        CUDAAccelerator().setup_device(torch.device("cpu"))
    trainer = lightning.Trainer(accelerator="cpu", devices=2, strategy="single_device", logger=False,
                                enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    assert trainer.world_size == 1
    capsys.readouterr()   # Lightning's info lines
    base = GRPO + f"run_dir: {tmp_path / 'run'}\ntrainer:\n  strategy: single_device\n"
    config = tmp_path / "train.yaml"
    on_a_gpu = ("'single_device' is Lightning's one-process strategy on the CPU (no setting gives it another device), "
                "and this job runs on a GPU, whose accelerator refuses the CPU when the fit starts; use auto, which "
                "runs a one-device job on its device")
    two = ("'single_device' runs one process, but trainer.devices x trainer.num_nodes asks for 2; use auto for one "
           "process, or ddp for 2")
    for extra, problem in (("  accelerator: gpu\n", on_a_gpu), ("  accelerator: cpu\n  devices: 2\n", two)):
        config.write_text(base + extra)
        assert run_fw(["validate", "--config", str(config)], capsys) == (
            2, [f"{config}:9:13: trainer.strategy: {problem}"]), extra
    config.write_text(base + "  accelerator: cpu\n")
    assert run_fw(["validate", "--config", str(config)], capsys) == (0, [])


def test_every_strategy_the_schema_offers_is_one_fw_trains_with(tmp_path, capsys):
    """The schema's `examples` are what editors offer to complete trainer.strategy: none of them may be one that
    `fw validate` then refuses (FSDP, say)."""
    schema = json.loads((ROOT / "schemas" / "train.schema.json").read_text())
    examples = schema["properties"]["trainer"]["properties"]["strategy"]["examples"]
    assert examples
    for strategy in examples:
        config = tmp_path / f"{strategy}.yaml"
        config.write_text(GRPO + f"run_dir: {tmp_path / 'run'}\ntrainer:\n  strategy: {strategy}\n")
        assert run_fw(["validate", "--config", str(config)], capsys) == (0, []), strategy


# ------------------------------------------------------------------ run_dir

def test_run_dir_below_a_file(tmp_path, capsys):
    (tmp_path / "taken").write_text("a file\n")
    config = tmp_path / "train.yaml"
    config.write_text(GRPO + "run_dir: taken/run\n")
    assert run_fw(["validate", "--config", str(config)], capsys) == (
        2, [f"{config}:7:10: run_dir: cannot create {tmp_path}/taken/run: {tmp_path}/taken is a file"])


@pytest.mark.parametrize("name, make", [("checkpoints", "file"), ("logs", "file"), (".lock", "dir"),
                                        ("metrics.jsonl", "dir"), ("config.yaml", "dir")])
def test_run_dir_entries_of_the_wrong_kind(tmp_path, capsys, name, make):
    """A file where fit writes a directory (or the reverse) would fail the run midway: refused up front."""
    run = tmp_path / "run"
    run.mkdir()
    (run / name).mkdir() if make == "dir" else (run / name).write_text("x\n")
    config = tmp_path / "train.yaml"
    config.write_text(GRPO + f"run_dir: {run}\n")
    want = "a directory" if make == "file" else "a file"
    assert run_fw(["fit", "--config", str(config)], capsys) == (
        2, [(f"{config}:7:10: run_dir: {run / name} is a {make.replace('dir', 'directory')}; fit writes {want} "
            "there: move it away")])


def test_a_hand_written_config_yaml_in_run_dir_is_not_replaced(tmp_path, capsys):
    """fit writes the resolved config to <run_dir>/config.yaml: a config of the user's there (the very file given,
    with `run_dir: .`) is refused before anything is written, not replaced; one that fw wrote is fit's to replace."""
    project = tmp_path / "project"
    project.mkdir()
    config = project / "config.yaml"
    text = "# my experiment\n" + GRPO + "run_dir: .\n"
    config.write_text(text)
    assert run_fw(["fit", "--config", str(config), "--trainer.max_steps=1"], capsys) == (
        2, [(f"{config}:8:10: run_dir: {config} is not a config.yaml that fw wrote; fit writes the run's resolved "
             "config there, which would replace it: move it away or choose another run_dir")])
    assert config.read_text() == text
    assert sorted(p.name for p in project.iterdir()) == ["config.yaml"]
    resolved = load_config([str(config)], imports=())
    save_resolved(resolved, config)
    assert run_fw(["validate", "--config", str(config)], capsys)[0] == 0


def test_a_run_dir_in_a_checkpoint_or_a_runs_checkpoints_folder_is_refused(tmp_path, capsys):
    """A fresh run whose run_dir is a checkpoint would write its config.yaml over the checkpoint's (which then fails
    its manifest's check: the checkpoint is lost); one inside a checkpoint is deleted with it by a prune, and one in a
    run's checkpoints/ folder is read as that run's checkpoint. Each is refused before anything is written."""
    run = tmp_path / "run"
    config = tmp_path / "train.yaml"
    config.write_text(GRPO + f"run_dir: {run}\nrollout: {{prompts_per_step: 2, max_new_tokens: 2}}\n"
                      "grpo: {group_size: 2}\ntrainer: {max_steps: 1, enable_progress_bar: false}\n"
                      "eval: {every_n_steps: null}\n")
    assert main(["fit", "--config", str(config)]) == 0
    step = run / "checkpoints" / "step-000001"
    before = {p: p.read_bytes() for p in step.rglob("*") if p.is_file()}
    capsys.readouterr()
    folder = run / "checkpoints"
    cases = {
        step: f"is checkpoint {step}: a run there would overwrite its config.yaml, which its manifest lists; "
              "choose a run_dir outside it",
        step / "policy" / "run": f"lies inside checkpoint {step}, which a prune deletes whole; choose a run_dir "
                                 "outside it",
        folder: f"is the checkpoints/ folder of run directory {run}, where fw reads what is there as that run's "
                f"checkpoints; choose a run_dir outside {folder}",
        folder / "new": f"lies inside the checkpoints/ folder of run directory {run}, where fw reads what is there "
                        f"as that run's checkpoints; choose a run_dir outside {folder}",
    }
    for run_dir, message in cases.items():
        assert run_fw(["fit", "--config", str(config), f"--run_dir={run_dir}"], capsys) == (
            2, [f"override '--run_dir={run_dir}': run_dir: {run_dir} {message}"]), run_dir
    assert {p: p.read_bytes() for p in step.rglob("*") if p.is_file()} == before
    assert sorted(p.name for p in folder.iterdir()) == ["step-000001"]


def test_eval_files_are_checked_where_training_evaluates(tmp_path, capsys):
    """fw validate (and fit, before anything is written) reads eval.path as it reads data.path, naming eval.path;
    a run whose training data is a JSONL file needs one."""
    bad = tmp_path / "eval.jsonl"
    bad.write_text('{"prompt": "1+1", "answer": "2"}\n[1, 2]\n')
    config = tmp_path / "train.yaml"
    config.write_text(GRPO + "eval:\n  every_n_steps: 5\n")
    assert run_fw(["validate", "--config", str(config), f"--eval.path={tmp_path}/none.jsonl"], capsys) == (
        2, [f"override '--eval.path={tmp_path}/none.jsonl': eval.path: no such file: {tmp_path}/none.jsonl"])
    assert run_fw(["validate", "--config", str(config), f"--eval.path={bad}"], capsys) == (
        2, [f"{bad}:2:1: eval.path: expected a JSON object, got an array"])
    assert run_fw(["fit", "--config", str(config), f"--eval.path={bad}", f"--run_dir={tmp_path}/run"], capsys) == (
        2, [f"{bad}:2:1: eval.path: expected a JSON object, got an array"])
    assert not (tmp_path / "run").exists()
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "1+1", "answer": "2"}\n')
    config.write_text(GRPO.replace("  task: {name: digits}\n", f"  path: {prompts}\n") + "eval:\n  every_n_steps: 5\n")
    code, lines = run_fw(["validate", "--config", str(config)], capsys)
    assert (code, lines) == (2, [(f"{config}:8:3: eval.path: the training data is a JSONL file (data.path), whose "
                                  "records the training stream visits again and again; set eval.path to a held-out "
                                  "JSONL file")])
    # without evaluation nothing reads eval.path
    assert run_fw(["validate", "--config", str(config), "--eval.every_n_steps=null",
                   f"--eval.path={tmp_path}/none.jsonl"], capsys)[0] == 0


def test_the_bad_rows_of_each_data_file_are_listed_together_and_their_count_after_them(tmp_path, capsys):
    """Rows of several files are reported file by file, each in line order, as they are in the file; the rows past
    the shown ones are counted after them, at their file."""
    good = '{"prompt": "1+1=", "completion": "2"}'
    a, b, c = tmp_path / "a.jsonl", tmp_path / "b.jsonl", tmp_path / "c.jsonl"
    a.write_text(f"{good}\n[1]\n{good}\n[2]\n")
    b.write_text(f"[3]\n{good}\n[4]\n")
    c.write_text("[5]\n" * (MAX_ROW_PROBLEMS + 2))
    config = tmp_path / "train.yaml"
    config.write_text(f"recipe: sft\nmodel:\n  policy: {{preset: tiny}}\ndata:\n  path: [{a}, {b}, {c}]\n")
    code, lines = run_fw(["validate", "--config", str(config)], capsys)
    array = "data.path: expected a JSON object, got an array"
    assert code == 2
    assert lines == ([f"{a}:2:1: {array}", f"{a}:4:1: {array}", f"{b}:1:1: {array}", f"{b}:3:1: {array}"]
                     + [f"{c}:{n}:1: {array}" for n in range(1, MAX_ROW_PROBLEMS + 1)]
                     + [f"{c}: data.path: 2 more bad rows not shown"])


def test_data_task_and_data_path_both_set_is_the_one_problem_reported_about_the_data(tmp_path, capsys):
    """Which of the two the run reads is for the user to choose: the rows of a file it may never read are not
    reported beside that choice."""
    rows = tmp_path / "p.jsonl"
    rows.write_text("[1]\n[2]\n")
    config = tmp_path / "train.yaml"
    config.write_text(GRPO + f"  path: {rows}\n")
    code, lines = run_fw(["validate", "--config", str(config)], capsys)
    assert code == 2
    assert lines == [f"{config}:6:3: data.task: set either data.task or data.path (JSONL), not both"]


def test_a_json_file_over_several_lines_is_one_problem_that_says_what_jsonl_is(tmp_path, capsys):
    """A `.json` file (an indented array of records, or one indented record) is named once, not line by line."""
    records = [{"prompt": "1+1=", "completion": "2"}, {"prompt": "2+2=", "completion": "4"}]
    for name, value, kind in (("a.json", records, "an array"), ("o.json", records[0], "an object")):
        data = tmp_path / name
        data.write_text(json.dumps(value, indent=2) + "\n")
        config = tmp_path / "train.yaml"
        config.write_text(f"recipe: sft\nmodel:\n  policy: {{preset: tiny}}\ndata:\n  path: {data}\n")
        assert run_fw(["validate", "--config", str(config)], capsys) == (2, [
            (f"{config}:5:9: data.path: {data} is one JSON document ({kind}) over several lines, not JSON Lines: "
             "write each record as one JSON object on a line of its own")])
    data.write_text("\n".join(json.dumps(r) for r in records) + "\n")   # the same records as JSON Lines
    assert run_fw(["validate", "--config", str(config)], capsys)[0] == 0


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_run_dir_not_writable(tmp_path, capsys):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    config = tmp_path / "train.yaml"
    config.write_text(GRPO + "run_dir: locked/run\n")
    try:
        code, lines = run_fw(["validate", "--config", str(config)], capsys)
    finally:
        locked.chmod(0o700)
    assert (code, lines) == (2, [f"{config}:7:10: run_dir: cannot create {locked}/run: {locked} is not writable"])



@pytest.mark.skipif(not os.path.isdir("/proc/self") or os.geteuid() != 0,
                    reason="needs Linux's /proc, and root, for whom the mode bits refuse nothing")
@pytest.mark.parametrize("run_dir, said", [
    ("/proc/fw-run", "cannot create /proc/fw-run: No such file or directory"),
    ("/proc", "/proc is not writable: No such file or directory")])
def test_run_dir_where_nothing_can_be_made(tmp_path, capsys, run_dir, said):
    """/proc takes no new entry, whatever the mode bits say (and for root `os.access` says yes): refused by validate,
    where fit would stop at the run lock, and nothing is left behind in a directory that takes entries."""
    config = tmp_path / "train.yaml"
    config.write_text(GRPO + f"run_dir: {run_dir}\n")
    assert run_fw(["validate", "--config", str(config)], capsys) == (2, [f"{config}:7:10: run_dir: {said}"])
    for writable in (tmp_path / "new" / "run", tmp_path):
        config.write_text(GRPO + f"run_dir: {writable}\n")
        before = sorted(p.name for p in tmp_path.iterdir())
        assert run_fw(["validate", "--config", str(config)], capsys)[0] == 0
        assert sorted(p.name for p in tmp_path.iterdir()) == before


# ------------------------------------------------------------------ model directories

@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from framework.models import build_policy, save_pretrained
    from framework.tokenizer import Tokenizer

    tok = Tokenizer.builtin()
    path = tmp_path_factory.mktemp("model")
    policy = build_policy({"path": None, "preset": "tiny", "dtype": None, "gradient_checkpointing": False,
                           "keep_logits": None, "compile": False, "lora": None}, tok)
    save_pretrained(policy, path)
    tok.save_pretrained(path)
    return path


def policy_config(tmp_path: Path, path: Path, extra: str = "") -> Path:
    config = tmp_path / "train.yaml"
    config.write_text(f"recipe: grpo\nmodel:\n  policy:\n    path: {path}\ndata:\n  task: {{name: digits}}\n" + extra)
    return config


def test_a_complete_model_directory_is_valid(tmp_path, model_dir, capsys):
    assert run_fw(["validate", "--config", str(policy_config(tmp_path, model_dir))], capsys) == (0, [])


def test_a_missing_model_directory_is_named_as_such(tmp_path, capsys):
    config = policy_config(tmp_path, tmp_path / "nowhere")
    code, lines = run_fw(["validate", "--config", str(config)], capsys)
    assert code == 2 and len(lines) == 1
    assert lines[0].startswith(f"{config}:4:11: model.policy.path: no such directory: {tmp_path}/nowhere")
    assert "tokenizer" not in lines[0]


@pytest.mark.parametrize("remove, message", [("model.safetensors", "no model.safetensors"),
                                             ("config.json", "no config.json"),
                                             ("tokenizer.json", "no tokenizer.json")])
def test_a_model_directory_missing_a_file(tmp_path, model_dir, capsys, remove, message):
    copy = tmp_path / "model"
    copy.mkdir()
    for f in model_dir.iterdir():
        if f.name != remove:
            (copy / f.name).write_bytes(f.read_bytes())
    config = policy_config(tmp_path, copy)
    code, lines = run_fw(["validate", "--config", str(config)], capsys)
    assert code == 2 and len(lines) == 1 and lines[0].startswith(f"{config}:4:11: model.policy.path: ")
    assert message in lines[0]


def test_an_fw_directory_given_as_the_model_says_what_to_set_instead(tmp_path, model_dir, capsys):
    """A checkpoint, its run directory or a LoRA checkpoint's adapters (no config.json of their own): the line
    names what to set instead, not only the missing config.json."""
    run = tmp_path / "run"
    checkpoint = run / "checkpoints" / "step-000004"
    (checkpoint / "policy").mkdir(parents=True)
    for f in model_dir.iterdir():
        (checkpoint / "policy" / f.name).write_bytes(f.read_bytes())
    lora = tmp_path / "lora"
    adapters = lora / "policy"
    adapters.mkdir(parents=True)
    (adapters / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 8}')
    expected = {
        checkpoint: f"{checkpoint} is an fw checkpoint: its policy's model directory is {checkpoint / 'policy'}",
        run: (f"{run} is an fw run directory: `fw export --checkpoint {run} --out DIR` writes its newest checkpoint "
              "as a model directory (with --merge where it trained LoRA adapters)"),
        lora: (f"{lora} is an fw LoRA checkpoint, whose policy/ holds adapters, not a whole model: set the directory "
               f"of the model they adapt, or write one with `fw export --merge --checkpoint {lora}`"),
        adapters: (f"{adapters} holds LoRA adapters, not a whole model: set the directory of the model they adapt, "
                   "or write one with `fw export --merge --checkpoint <their checkpoint>`")}
    for path, message in expected.items():
        config = policy_config(tmp_path, path)
        line = f"{config}:4:11: model.policy.path: {message}"
        assert run_fw(["validate", "--config", str(config)], capsys) == (2, [line])
    config = policy_config(tmp_path, checkpoint / "policy")   # what the line says to set
    assert run_fw(["validate", "--config", str(config)], capsys) == (0, [])


def test_a_ppo_checkpoint_given_as_the_critic_names_its_value_model(tmp_path, model_dir, capsys):
    """model.value.path at a PPO checkpoint: the line names the checkpoint's critic (value/), not its policy."""
    checkpoint = tmp_path / "run" / "checkpoints" / "step-000004"
    for part in ("policy", "value"):
        (checkpoint / part).mkdir(parents=True)
        for f in model_dir.iterdir():
            (checkpoint / part / f.name).write_bytes(f.read_bytes())
    config = tmp_path / "train.yaml"
    config.write_text(f"recipe: ppo\nmodel:\n  policy: {{preset: tiny}}\n  value:\n    path: {checkpoint}\n"
                      "data:\n  task: {name: digits}\n")
    line = (f"{config}:5:11: model.value.path: {checkpoint} is an fw checkpoint: its value model's directory is "
            f"{checkpoint / 'value'}")
    assert run_fw(["validate", "--config", str(config)], capsys) == (2, [line])


def test_truncated_weights_and_a_reference_that_is_a_file(tmp_path, model_dir, capsys):
    copy = tmp_path / "model"
    copy.mkdir()
    for f in model_dir.iterdir():
        (copy / f.name).write_bytes(f.read_bytes()[:40] if f.name == "model.safetensors" else f.read_bytes())
    config = tmp_path / "train.yaml"
    config.write_text(f"recipe: grpo\nmodel:\n  policy:\n    path: {copy}\n  reference:\n    path: x.txt\n"
                      "data:\n  task: {name: digits}\ngrpo:\n  kl_coef: 0.01\n")   # a KL term: the reference is built
    (tmp_path / "x.txt").write_text("not a model\n")
    code, lines = run_fw(["validate", "--config", str(config)], capsys)
    assert code == 2 and len(lines) == 2, lines
    assert lines[0].startswith(f"{config}:4:11: model.policy.path: {copy}/model.safetensors: not a readable")
    assert lines[1].startswith(f"{config}:6:11: model.reference.path: {tmp_path}/x.txt is a file")


@pytest.mark.parametrize("policy", ["preset: tiny", "path: MODEL"])
def test_a_reference_or_critic_smaller_than_the_tokenizer_is_named(tmp_path, model_dir, capsys, policy):
    """A reference or value model whose embedding holds fewer ids than the tokenizer (the policy directory's, or the
    preset's built-in one) has tokens is one line at its key, as a policy's is; fit would fail after a rollout."""
    from framework.models import Qwen3Config, Qwen3ForCausalLM, Qwen3ValueModel, save_pretrained, save_value_model
    from framework.tokenizer import Tokenizer

    small = Qwen3Config.from_hf({"vocab_size": 20, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 1,
                                 "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                                 "tie_word_embeddings": True})
    save_pretrained(Qwen3ForCausalLM(small), tmp_path / "lm")
    save_value_model(Qwen3ValueModel(small), tmp_path / "critic")
    config = tmp_path / "train.yaml"
    config.write_text(f"recipe: ppo\nmodel:\n  policy:\n    {policy.replace('MODEL', str(model_dir))}\n  reference:\n"
                      f"    path: {tmp_path / 'lm'}\n  value:\n    path: {tmp_path / 'critic'}\n"
                      "data:\n  task: {name: digits}\n")
    code, lines = run_fw(["validate", "--config", str(config)], capsys)
    says = f"the tokenizer has {Tokenizer.builtin().vocab_size} tokens but the model's vocab_size is 20"
    assert (code, lines) == (2, [f"{config}:6:11: model.reference.path: {says}",
                                 f"{config}:8:11: model.value.path: {says}"])


def test_bfloat16_weights_without_stochastic_rounding_are_named_at_their_key(tmp_path, capsys):
    config = tmp_path / "train.yaml"
    config.write_text(GRPO.replace("preset: tiny\n", "preset: tiny\n    dtype: bfloat16\n"))
    code, lines = run_fw(["validate", "--config", str(config)], capsys)
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"{config}:5:12: model.policy.dtype: bfloat16 makes the trained weights bfloat16")
    assert "set optimizer.stochastic_rounding: true" in lines[0]


def test_grpo_math_as_shipped_says_where_the_model_should_be(capsys):
    code, lines = run_fw(["validate", "--config", str(ROOT / "recipes" / "grpo_math.yaml")], capsys)
    if (ROOT / "models" / "Qwen3-0.6B").is_dir():
        pytest.skip("a model directory is installed")
    assert code == 2 and len(lines) == 1
    assert lines[0].startswith(f"{ROOT / 'recipes' / 'grpo_math.yaml'}:18:11: model.policy.path: no such directory: "
                               f"{ROOT / 'models' / 'Qwen3-0.6B'}")
    assert "NOT RUNNABLE AS SHIPPED" in (ROOT / "recipes" / "grpo_math.yaml").read_text()


# ------------------------------------------------------------------ paths relative to the config file

def test_paths_resolve_against_the_config_file_and_overrides_against_the_cwd(tmp_path, monkeypatch, capsys):
    project = tmp_path / "project"
    (project / "data").mkdir(parents=True)
    (project / "data" / "chat.jsonl").write_text('{"prompt": "a", "completion": "b"}\n')
    config = project / "sft.yaml"
    config.write_text("recipe: sft\nmodel:\n  policy:\n    preset: tiny\ndata:\n  path: data/chat.jsonl\n"
                      "run_dir: ../runs/sft\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    cfg = load_config([str(config)], [])
    assert cfg["data"]["path"] == str(project / "data" / "chat.jsonl")
    assert cfg["run_dir"] == str(tmp_path / "runs" / "sft")
    assert load_config([str(config)], ["--run_dir=out"])["run_dir"] == str(elsewhere / "out")
    assert run_fw(["validate", "--config", str(config)], capsys) == (0, [])
    # a list of files, one written in a second config in another directory
    other = tmp_path / "other"
    (other / "more").mkdir(parents=True)
    (other / "more" / "x.jsonl").write_text('{"prompt": "c", "completion": "d"}\n')
    (other / "top.yaml").write_text("data:\n  path: [more/x.jsonl, ~/y.jsonl]\n")
    cfg = load_config([str(config), str(other / "top.yaml")], [])
    assert cfg["data"]["path"] == [str(other / "more" / "x.jsonl"), os.path.expanduser("~/y.jsonl")]


def test_the_shipped_sft_recipe_validates_from_any_directory(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert run_fw(["validate", "--config", str(ROOT / "recipes" / "sft.yaml")], capsys) == (0, [])
    assert load_config([str(ROOT / "recipes" / "sft.yaml")], [])["run_dir"] == str(ROOT / "runs" / "arith-sft")


# ------------------------------------------------------------------ many problems

def test_thousands_of_unknown_keys_are_reported_briefly_in_linear_time(tmp_path, capsys):
    config = tmp_path / "train.yaml"
    config.write_text(GRPO + "".join(f"k{i}: 1\n" for i in range(8000)))
    start = time.perf_counter()
    code, lines = run_fw(["validate", "--config", str(config)], capsys)
    assert time.perf_counter() - start < 20   # quadratic merging took minutes here
    assert code == 2 and len(lines) == MAX_PROBLEMS + 1
    assert lines[0] == f"{config}:7:1: k0: unknown key 'k0' (allowed here: " + lines[0].split("(allowed here: ")[1]
    assert lines[-1] == f"{config}: {8000 - MAX_PROBLEMS} more problems not shown; fix these first"


# ------------------------------------------------------------------ fw doctor / fw ops build

def fake_toolkit(tmp_path: Path, script: str) -> dict:
    """A CUDA_HOME-shaped folder whose bin/nvcc is `script`; the environment that finds it first on PATH."""
    nvcc = tmp_path / "cuda" / "bin" / "nvcc"
    nvcc.parent.mkdir(parents=True)
    nvcc.write_text("#!/bin/sh\n" + script)
    nvcc.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_HOME", "CUDA_PATH")}
    return {**env, "PATH": f"{nvcc.parent}{os.pathsep}{env['PATH']}", "PYTHONPATH": str(ROOT)}


def doctor_line(env: dict) -> str:
    proc = subprocess.run([sys.executable, "-m", "framework", "doctor"], env=env, capture_output=True, text=True,
                          timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr
    return next(line for line in proc.stdout.splitlines() if line.startswith("CUDA toolkit (nvcc): "))


@pytest.mark.parametrize("script, says", [
    ("echo 'cannot find libcudart' >&2\nexit 3\n", "--version exits with 3: cannot find libcudart"),
    ("echo 'hello'\n", "--version names no CUDA release: it is not a working nvcc"),
])
def test_doctor_does_not_trust_a_broken_nvcc(tmp_path, script, says):
    line = doctor_line(fake_toolkit(tmp_path, script))
    assert line == f"CUDA toolkit (nvcc): {tmp_path / 'cuda'} (unusable: {tmp_path / 'cuda' / 'bin' / 'nvcc'} {says})"


@pytest.mark.skipif(torch.version.cuda is not None, reason="the CPU-only torch case")
def test_doctor_says_a_working_nvcc_cannot_serve_a_cpu_torch(tmp_path):
    line = doctor_line(fake_toolkit(tmp_path, "echo 'Cuda compilation tools, release 12.4, V12.4.131'\n"))
    assert line.endswith(f"(unusable: nvcc is CUDA 12.4, but torch {torch.__version__} is a CPU-only build)")


def test_ops_build_without_cuda_is_one_line(tmp_path):
    env = fake_toolkit(tmp_path, "echo 'Cuda compilation tools, release 12.4, V12.4.131'\n")
    proc = subprocess.run([sys.executable, "-m", "framework", "ops", "build"], env=env, capture_output=True,
                          text=True, timeout=300, check=False)
    if torch.cuda.is_available():
        pytest.skip("a machine with CUDA builds the ops")
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert proc.stderr.startswith("fw: error: cannot build the CUDA ops: ")


@pytest.mark.parametrize("settings, problem", [
    ([], "computes in float32"),                                              # 32-true, float32 weights
    (["--trainer.precision=bf16-mixed"], None),
    (["--trainer.precision=16-mixed"], None),
    (["--model.policy.dtype=bfloat16"], None),
    (["--rollout.kv_cache_dtype=auto"], None),
])
def test_fp8_kv_cache_needs_a_16_bit_rollout_on_cuda(tmp_path, settings, problem):
    """The check fw fit runs where CUDA is visible (here called directly): a float8 KV cache with a float32 rollout
    is one problem at rollout.kv_cache_dtype, before anything runs; 16-bit compute by autocast or weights is not."""
    from framework.config import load_located
    from framework.validate import _Checks

    located = load_located(["train.yaml"], [f"--run_dir={tmp_path}/run", "--trainer.precision=32-true",
                                            "--rollout.kv_cache_dtype=float8_e4m3", *settings])
    checks = _Checks(located)
    checks.fp8_rollout()
    lines = [str(p) for p in checks.problems]
    if problem is None:
        assert lines == []
    else:
        assert len(lines) == 1 and "rollout.kv_cache_dtype" in lines[0] and problem in lines[0], lines
        assert "needs a bfloat16 or float16 rollout on CUDA" in lines[0]


def test_answers_that_numeric_match_cannot_read_are_named_at_their_line(tmp_path, capsys):
    """JSONL prompts are scored by numeric_match (their own reward) unless another reward is named: fw validate
    names each answer that is not one number at its line, as fit would refuse it later; another reward reads
    them as text."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "1+1", "answer": "2"}\n{"prompt": "x", "answer": "about 5 or 6"}\n'
                       '{"prompt": "y", "answer": 5e-05}\n')
    config = tmp_path / "train.yaml"
    config.write_text(GRPO.replace("  task: {name: digits}\n", f"  path: {prompts}\n"))
    code, lines = run_fw(["validate", "--config", str(config)], capsys)
    assert code == 2 and len(lines) == 1
    assert lines[0].startswith(f"{prompts}:2:1: data.path: answer: the reference answer 'about 5 or 6' is not one "
                               "number")
    assert run_fw(["validate", "--config", str(config), "--reward.name=exact_match"], capsys)[0] == 0


def test_message_prompts_without_the_chat_template_are_named_where_they_are(tmp_path, capsys):
    """A rollout continues plain text: a prompt that is a list of messages needs data.chat_template, which fw validate
    (and so fw fit, before anything is built) says at the JSONL line or at data.task, not fit midway without a place."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "1+1", "answer": "2"}\n{"prompt": [{"role": "user", "content": "2+2"}], '
                       '"answer": "4"}\n')
    config = tmp_path / "train.yaml"
    config.write_text(GRPO.replace("  task: {name: digits}\n", f"  path: {prompts}\n  chat_template: false\n"))
    assert run_fw(["validate", "--config", str(config)], capsys) == (2, [
        (f"{prompts}:2:1: data.path: 'prompt' is a list of messages but data.chat_template is false; set "
         "data.chat_template: true or give plain-string prompts")])
    assert run_fw(["validate", "--config", str(config), "--data.chat_template=true"], capsys)[0] == 0
    (tmp_path / "chat_task.py").write_text(
        "from framework.tasks import Task\n\nclass Chat(Task):\n    def sample(self, index):\n"
        "        return {'prompt': [{'role': 'user', 'content': '1='}], 'answer': '2', 'metadata': {'answer': '2'}}\n")
    config.write_text(GRPO.replace("  task: {name: digits}\n", "  task: {class_path: chat_task.Chat}\n"
                                   "  chat_template: false\n"))
    assert run_fw(["validate", "--config", str(config)], capsys) == (2, [
        (f"{config}:6:9: data.task: Chat.sample(0)'s prompt is a list of messages but data.chat_template is "
         "false; set data.chat_template: true or give plain-string prompts")])
    assert run_fw(["validate", "--config", str(config), "--data.chat_template=true"], capsys)[0] == 0


def test_only_the_models_the_recipe_builds_are_read(tmp_path, capsys):
    """GRPO builds no critic, so a stale model.value.path is no problem of its run; PPO's is."""
    config = tmp_path / "train.yaml"
    config.write_text(GRPO)
    missing = tmp_path / "gone"
    assert run_fw(["validate", "--config", str(config), f"--model.value.path={missing}"], capsys)[0] == 0
    code, lines = run_fw(["validate", "--config", str(config), "--recipe=ppo", f"--model.value.path={missing}"],
                         capsys)
    assert code == 2 and len(lines) == 1 and "model.value.path" in lines[0] and str(missing) in lines[0]


# ------------------------------------------------------------------ the held-out eval set (fit's first evaluation)

def test_validate_refuses_the_held_out_eval_set_that_fit_refuses(tmp_path, capsys):
    """train.yaml with eval.held_out: true: the digits task has 10 prompts and training draws all of them, so
    fit's first evaluation finds no eval prompt; validate says so, in the same words, and fit says so before
    anything is built or written."""
    from framework.errors import FwError
    from framework.evaluation import Evaluation
    from framework.tasks import Digits
    from framework.tokenizer import build_tokenizer

    train = str(ROOT / "train.yaml")
    override = "--eval.held_out=true"
    cfg = load_config([train], [override])
    draws = cfg["trainer"]["max_steps"] * cfg["rollout"]["prompts_per_step"]   # a rollout batch per step
    assert {Digits(rule="next", seed=cfg["seed"]).sample(i)["prompt"] for i in range(draws)} == {
        f"{d}=" for d in range(10)}
    with pytest.raises(FwError) as e:   # what fit's first evaluation (EvalCallback) runs
        Evaluation(cfg, build_tokenizer(cfg))
    fit_message = str(e.value)
    assert fit_message.startswith("eval: every sample of the training task drawn with eval.seed is also a training")

    code, lines = run_fw(["validate", "--config", train, override], capsys)
    assert (code, lines) == (2, [f"override '{override}': eval.held_out: {fit_message.removeprefix('eval: ')}"])
    run_dir = tmp_path / "run"
    assert run_fw(["fit", "--config", train, override, f"--run_dir={run_dir}"], capsys) == (2, lines)
    assert not run_dir.exists()
    # the shipped configs as they are still validate (grpo_math.yaml names a model directory to download)
    for name in ["train.yaml", "recipes/grpo.yaml", "recipes/ppo.yaml", "recipes/sft.yaml"]:
        assert run_fw(["validate", "--config", str(ROOT / name)], capsys) == (0, []), name


def test_an_eval_file_of_training_prompts_is_refused_at_eval_path(tmp_path, capsys):
    """GRPO on JSONL prompts evaluated on the training file itself (given as an override): the problem is shown at
    eval.path, where the eval samples come from, and says that the file holds the training data's prompts."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(f'{{"prompt": "{a} + {a} =", "answer": "{2 * a}"}}\n' for a in range(4)))
    config = tmp_path / "c.yaml"
    config.write_text(f"recipe: grpo\nmodel: {{policy: {{preset: tiny}}}}\ndata: {{path: {prompts}}}\n"
                      "rollout: {prompts_per_step: 2, max_new_tokens: 4}\ngrpo: {group_size: 2}\n"
                      "eval: {every_n_steps: 2}\ntrainer: {max_steps: 4}\n")
    override = f"--eval.path={prompts}"
    line = (f"override '{override}': eval.path: every sample of eval.path is also a training sample of this run (it "
            "holds the training data's prompts); set eval.path to held-out data, or set eval.held_out: false to "
            "evaluate on training prompts")
    assert run_fw(["validate", "--config", str(config), override], capsys) == (2, [line])


def test_an_eval_file_that_repeats_training_prompts_says_how_many_it_leaves_out(tmp_path, capsys):
    """GRPO on 4 JSONL prompts, evaluated on a file that repeats 2 of them among 3 new ones: the repeats are left out
    (eval.held_out), and a line says how many, so that the file's rows and eval's count are not silently apart."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(f'{{"prompt": "{a} + {a} =", "answer": "{2 * a}"}}\n' for a in range(4)))
    held = tmp_path / "held.jsonl"
    held.write_text("".join(f'{{"prompt": "{a} + {a} =", "answer": "{2 * a}"}}\n' for a in (1, 7, 3, 8, 9)))
    config = tmp_path / "c.yaml"
    config.write_text(f"recipe: grpo\nmodel: {{policy: {{preset: tiny}}}}\ndata: {{path: {prompts}}}\n"
                      "rollout: {prompts_per_step: 2, max_new_tokens: 4}\ngrpo: {group_size: 2}\n"
                      f"eval: {{every_n_steps: 2, path: {held}}}\ntrainer: {{max_steps: 4}}\n")
    assert run_fw(["validate", "--config", str(config)], capsys) == (0, [
        ("fw: eval.path: 2 of its samples have prompts of the training data and are left out (eval.held_out: true); "
         "3 are evaluated")])
    held.write_text("".join(f'{{"prompt": "{a} + {a} =", "answer": "{2 * a}"}}\n' for a in (7, 8, 9)))
    assert run_fw(["validate", "--config", str(config)], capsys) == (0, [])


def test_validate_counts_the_training_draws_as_fit_does(tmp_path, capsys):
    """Two-digit prompts (100 of them): the eval set is empty exactly when the rollout batches of
    trainer.max_steps steps on trainer.devices processes draw every prompt; found by hand from the task's
    samples, the boundary is one rollout batch wide."""
    from framework.tasks import Digits

    per_batch = 8
    seen, n = set(), 0
    while len(seen) < 100:   # the index of the training sample that draws the last unseen prompt
        seen.add(Digits(num_digits=2, seed=0).sample(n)["prompt"])
        n += 1
    last = n - 1
    # the eval source's first 1000 samples (the least fit reads for 10 prompts) hold every prompt
    assert len({Digits(num_digits=2, seed=1).sample(i)["prompt"] for i in range(1000)}) == 100
    config = tmp_path / "train.yaml"
    config.write_text(
        "recipe: grpo\nseed: 0\nmodel: {policy: {preset: tiny}}\n"
        "data: {task: {name: digits, init_args: {num_digits: 2}}, chat_template: false}\n"
        f"rollout: {{prompts_per_step: {per_batch}, max_new_tokens: 2}}\n"
        "grpo: {group_size: 2, epochs: 1, minibatches: 1}\n"
        "trainer: {accelerator: cpu}\n"
        "eval: {every_n_steps: 10, held_out: true, max_prompts: 10, seed: 1}\n"
        f"run_dir: {tmp_path / 'run'}\n")

    def validate(steps: int, devices: int) -> int:
        return run_fw(["validate", "--config", str(config), f"--trainer.max_steps={steps}",
                       f"--trainer.devices={devices}"], capsys)[0]

    batches = last // per_batch + 1   # the first number of rollout batches that draws every prompt
    assert (validate(batches - 1, 1), validate(batches, 1)) == (0, 2)
    assert (validate(last // (2 * per_batch), 2), validate(-(-batches // 2), 2)) == (0, 2)


def test_validate_names_the_process_count_its_held_out_check_assumed(capsys):
    """trainer.devices: auto leaves the number of processes to the machine that runs the job, and the more
    processes draw training prompts, the fewer eval samples are held out: fw validate says for how many it checked
    (this machine's: its GPUs under CUDA, else one), and how to check another count; nothing with an explicit one."""
    config = str(ROOT / "recipes" / "grpo.yaml")
    args = ["validate", "--config", config, "--eval.every_n_steps=10", "--eval.held_out=true",
            "--data.task={name: arithmetic}"]
    assert main(args) == 0
    n = max(torch.cuda.device_count(), 1) if torch.cuda.is_available() else 1
    assert capsys.readouterr().out.strip() == (
        f"{config}: valid (recipe grpo; held-out eval set checked for {n} process{'es' if n > 1 else ''}, "
        "trainer.devices: auto counting this machine's GPUs: --trainer.devices=N checks N a node)")
    for explicit in ("--trainer.devices=1", "--trainer.accelerator=cpu"):   # on the CPU, auto is one process
        assert main([*args, explicit]) == 0
        assert capsys.readouterr().out.strip() == f"{config}: valid (recipe grpo)"


@pytest.mark.parametrize("returned, problem", [
    ("('say 1', '1')", "Odd.sample(0) returned a tuple, expected a dict with prompt, answer and metadata"),
    ("{'prompt': 12, 'answer': '1', 'metadata': {}}",
     "Odd.sample(0): prompt must be a string or a list of {role, content} messages, got int 12"),
    ("{'prompt': 'say 1', 'answer': '1'}",
     ("Odd.sample(0) returned a dict without 'metadata', expected a dict with prompt, answer and metadata "
      "(its keys: 'prompt', 'answer')")),
    ("{'prompt': 'say 1', 'answer': '1', 'metadata': None}",
     "Odd.sample(0): metadata must be a dict (what the reward gets as its third argument), got NoneType"),
    ("{'prompt': 'say 1', 'metadata': {'answer': '1'}}",
     ("Odd.sample(0) returned a dict without 'answer', expected a dict with prompt, answer and metadata "
      "(its keys: 'prompt', 'metadata')")),
    ("{'prompt': 'say 1', 'answer': 1, 'metadata': {'answer': '1'}}",
     ("Odd.sample(0): answer must be a string (the completion SFT trains on, the reference of the built-in "
      "rewards), got int")),
])
def test_a_task_class_whose_samples_training_cannot_read_is_a_config_problem(tmp_path, capsys, returned, problem):
    """A user's task class returns anything from sample(): what the recipes read of it is checked, at data.task,
    by fw validate (and so by fw fit before anything is built) and on every draw, instead of a traceback."""
    module = f"odd_task_{abs(hash(returned))}"
    (tmp_path / f"{module}.py").write_text("from framework.tasks import Task\n\nclass Odd(Task):\n"
                                           f"    def sample(self, index):\n        return {returned}\n")
    config = tmp_path / "c.yaml"
    config.write_text(f"recipe: grpo\nmodel: {{policy: {{preset: tiny}}}}\ndata:\n"
                      f"  task: {{class_path: {module}.Odd}}\nreward: {{name: exact_match}}\n")
    assert run_fw(["validate", "--config", str(config)], capsys) == (2, [f"{config}:4:9: data.task: {problem}"])
    # and for SFT, which trains on each sample's answer
    assert run_fw(["validate", "--config", str(config), "--recipe=sft", "--reward.name=null"], capsys) == (
        2, [f"{config}:4:9: data.task: {problem}"])


def test_a_task_whose_first_sample_raises_names_the_users_line(tmp_path, capsys):
    (tmp_path / "raising_task.py").write_text("class Task:\n    def sample(self, index):\n"
                                              "        return {'prompt': [][index]}\n")
    config = tmp_path / "c.yaml"
    config.write_text("recipe: grpo\nmodel: {policy: {preset: tiny}}\ndata:\n"
                      "  task: {class_path: raising_task.Task}\nreward: {name: exact_match}\n")
    line = (f"{config}:4:9: data.task: Task.sample(0) raised IndexError: list index out of range "
            f"(at {tmp_path / 'raising_task.py'}:3)")
    assert run_fw(["validate", "--config", str(config)], capsys) == (2, [line])


@pytest.mark.parametrize("prompt, problem", [
    ("''", "prompt is an empty string"),
    ("[{'role': 'user'}]", "prompt messages[0] (user): content must be a string, got null"),
    ("[{'role': 'user', 'content': 12}]", "prompt messages[0] (user): content must be a string, got a number"),
])
def test_a_task_class_whose_prompt_cannot_be_generated_from_is_a_config_problem(tmp_path, capsys, prompt, problem):
    """An empty prompt (no token to continue) or a chat that data.chat_template cannot render: fw validate says it at
    data.task with the sample, not fit at generation ("generate: prompt 0 is empty") or chat rendering, which name
    neither."""
    module = f"blank_task_{abs(hash(prompt))}"
    (tmp_path / f"{module}.py").write_text(
        "from framework.tasks import Task\n\nclass Blank(Task):\n    def sample(self, index):\n"
        f"        return {{'prompt': {prompt}, 'answer': '1', 'metadata': {{'answer': '1'}}}}\n")
    config = tmp_path / "c.yaml"
    config.write_text(f"recipe: grpo\nmodel: {{policy: {{preset: tiny}}}}\ndata:\n"
                      f"  task: {{class_path: {module}.Blank}}\n  chat_template: true\n")
    assert run_fw(["validate", "--config", str(config)], capsys) == (
        2, [f"{config}:4:9: data.task: Blank.sample(0): {problem}"])


def test_a_task_without_the_metadata_its_reward_reads_is_a_config_problem(tmp_path, capsys):
    """exact_match (a Task's own reward) and numeric_match read metadata["answer"] on every call: a sample without
    it is a problem at data.task that fw validate says, not the first reward call of fit. A reward that does not
    read it (format, or a user's) takes the same task."""
    (tmp_path / "unanswered.py").write_text(
        "from framework.tasks import Task\n\nclass Unanswered(Task):\n    def sample(self, index):\n"
        "        return {'prompt': '1=', 'answer': '1', 'metadata': {'level': 1}}\n\n\n"
        "class Length:\n    def __call__(self, prompt, completion, metadata):\n        return len(completion)\n")
    config = tmp_path / "c.yaml"
    config.write_text("recipe: grpo\nmodel: {policy: {preset: tiny}}\ndata:\n"
                      "  task: {class_path: unanswered.Unanswered}\n")
    for args, name in (([], "exact_match"), (["--reward.name=numeric_match"], "numeric_match")):
        assert run_fw(["validate", "--config", str(config), *args], capsys) == (2, [
            (f"{config}:4:9: data.task: Unanswered.sample(0): metadata has no 'answer', which the reward "
             f"{name!r} reads (its keys: 'level')")])
    for args in (["--reward.name=format"], ["--reward.class_path=unanswered.Length"], ["--recipe=sft"]):
        assert run_fw(["validate", "--config", str(config), *args], capsys)[0] == 0, args


def test_validate_tokenizes_sft_data_as_fit_does(tmp_path, capsys):
    """SFT rows longer than data.max_seq_len: fw validate says how many fit cuts, as fit says it, and refuses data
    that keeps no token to train on, which fit refuses as it builds its data."""
    config = tmp_path / "sft.yaml"
    config.write_text(f"recipe: sft\nmodel: {{policy: {{preset: tiny}}}}\n"
                      f"data: {{path: {ROOT / 'recipes' / 'data' / 'arithmetic_chat.jsonl'}, max_seq_len: 8}}\n")
    code, lines = run_fw(["validate", "--config", str(config)], capsys)
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"{config}:3:") and (": data.max_seq_len: all 400 examples of data.path are longer "
                                                     "than data.max_seq_len (8), and cut to it none keeps") in lines[0]
    assert run_fw(["validate", "--config", str(config), "--data.max_seq_len=48"], capsys) == (0, [
        "fw: data.path: 400 of 400 examples are longer than data.max_seq_len (48) and are cut to it"])


def test_validate_says_how_many_sft_examples_have_an_empty_reply_as_fit_does(tmp_path, capsys):
    """An empty assistant reply trains on its end token alone: fw validate says it in the line fit's data loading
    says (tests/test_sft_data.py), and the config stays valid."""
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "1+1=", "completion": "2"}\n'
                    '{"messages": [{"role": "user", "content": "2+2="}, {"role": "assistant", "content": ""}]}\n')
    config = tmp_path / "sft.yaml"
    config.write_text(f"recipe: sft\nmodel: {{policy: {{preset: tiny}}}}\ndata: {{path: {data}}}\n")
    assert run_fw(["validate", "--config", str(config)], capsys) == (0, [
        (f"fw: data.path: 1 of 2 examples has an empty or blank reply (the first: {data}:2: "
         'messages[1].content is ""), which trains on its end token alone and teaches the model to answer with '
         "nothing")])


def test_a_check_of_several_keys_shows_at_the_one_an_override_changed(tmp_path, capsys):
    """minibatches x accumulate_grad_batches against the rollout batch relates four keys: the problem shows at the
    override that broke it (a file's key it was reported at before, under a key the user had not touched), and at
    grpo.minibatches when none of them is overridden."""
    config = tmp_path / "c.yaml"
    config.write_text("recipe: grpo\nmodel: {policy: {preset: tiny}}\ndata: {task: {name: digits}}\n"
                      "grpo: {minibatches: 4}\n")
    tail = ("4 minibatches x trainer.accumulate_grad_batches (64) exceeds the 64 samples of one rollout batch "
            "(rollout.prompts_per_step x grpo.group_size)")
    assert main(["validate", "--config", str(config), "--trainer.accumulate_grad_batches=64"]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"override '--trainer.accumulate_grad_batches=64': trainer.accumulate_grad_batches: {tail}")
    config.write_text(config.read_text() + "trainer: {accumulate_grad_batches: 64}\n")
    assert main(["validate", "--config", str(config)]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == f"{config}:4:21: grpo.minibatches: {tail}"


def test_name_and_class_path_together_show_at_the_one_an_override_added(tmp_path, capsys):
    """A task of the file chosen by class_path, then --data.task.name from the command line: the problem is the
    override's, naming the file's class_path and the override that clears it; both written in the file, it is at
    data.task."""
    (tmp_path / "mytask.py").write_text("class T:\n    def sample(self, i):\n        return {'prompt': 'x'}\n")
    config = tmp_path / "c.yaml"
    config.write_text("recipe: grpo\nmodel: {policy: {preset: tiny}}\ndata:\n  task:\n    class_path: mytask.T\n")
    argv = ["validate", "--config", str(config), "--data.task.name=digits"]
    assert run_fw(argv, capsys) == (2, [
        ("override '--data.task.name=digits': data.task.name: set only one of 'name' or 'class_path': name is set "
         f"here and class_path: mytask.T at {config}:5; give --data.task.class_path=null (or remove one)")])
    assert run_fw(argv + ["--data.task.class_path=null"], capsys) == (0, [])
    message = "set only one of 'name' or 'class_path', not 'name' and 'class_path'"
    config.write_text(config.read_text() + "    name: digits\n")
    assert run_fw(["validate", "--config", str(config)], capsys) == (2, [f"{config}:4:3: data.task: {message}"])


def test_a_reward_takes_name_or_class_path_not_both_as_a_task_does(tmp_path, capsys):
    """A reward class given by override over a file's built-in reward name: refused as a task's pair is (the name
    would be ignored), naming the file's name and the override that clears it; with it, the config validates."""
    (tmp_path / "myreward.py").write_text(
        "class Length:\n    def __call__(self, prompt, completion, metadata):\n        return len(completion)\n")
    config = tmp_path / "c.yaml"
    config.write_text("recipe: grpo\nmodel: {policy: {preset: tiny}}\ndata: {task: {name: digits}}\n"
                      "reward:\n  name: exact_match\n")
    argv = ["validate", "--config", str(config), "--reward.class_path=myreward.Length"]
    assert run_fw(argv, capsys) == (2, [
        ("override '--reward.class_path=myreward.Length': reward.class_path: set only one of 'name' or 'class_path': "
         f"class_path is set here and name: exact_match at {config}:5; give --reward.name=null (or remove one)")])
    assert run_fw(argv + ["--reward.name=null"], capsys) == (0, [])


def test_path_and_preset_from_two_files_name_both_and_the_fix(tmp_path, model_dir, capsys):
    """preset from one file, path from a later one: merged, both are set. The line, at the later file's
    model.policy, names where preset was set too and the override that clears it; that override validates."""
    base = tmp_path / "base.yaml"
    base.write_text("recipe: grpo\nmodel:\n  policy: {preset: tiny}\ndata: {task: {name: digits}}\n")
    real = tmp_path / "real.yaml"
    real.write_text(f"model:\n  policy: {{path: {model_dir}}}\n")
    files = ["validate", "--config", str(base), "--config", str(real)]
    assert run_fw(files, capsys) == (2, [
        (f"{real}:2:3: model.policy: set only one of 'path' or 'preset': path is set here and preset: tiny at "
         f"{base}:3; give --model.policy.preset=null (or remove one)")])
    assert run_fw(files + ["--model.policy.preset=null"], capsys) == (0, [])


def test_path_by_override_over_a_files_preset_names_both_and_the_fix(tmp_path, model_dir, capsys):
    """--model.policy.path over a file that sets preset: the override's line names the file's preset and the
    override that clears it; given too, the config validates."""
    config = tmp_path / "train.yaml"
    config.write_text("recipe: grpo\nmodel:\n  policy:\n    preset: tiny\ndata: {task: {name: digits}}\n")
    argv = ["validate", "--config", str(config), f"--model.policy.path={model_dir}"]
    assert run_fw(argv, capsys) == (2, [
        (f"override '--model.policy.path={model_dir}': model.policy.path: set only one of 'path' or 'preset': path "
         f"is set here and preset: tiny at {config}:4; give --model.policy.preset=null (or remove one)")])
    assert run_fw(argv + ["--model.policy.preset=null"], capsys) == (0, [])


def test_path_and_preset_in_a_config_built_in_python_say_both_without_a_file_or_override():
    """A dict config has no file, line or override to name: the line says both keys are set, not that each was set
    "at the default", and gives no command-line flag."""
    with pytest.raises(ConfigError) as e:
        resolve({"recipe": "sft", "model": {"policy": {"path": "/models/q", "preset": "tiny"}}})
    assert str(e.value) == "<config>: model.policy: set only one of 'path' or 'preset', not 'path' and 'preset'"


DIGITS_CONFIG = ("recipe: grpo\nmodel: {policy: {preset: tiny}}\ndata:\n  task:\n    name: digits\n"
                 "    init_args: {num_digits: 1, rule: next}\n  chat_template: false\n")


def test_a_bad_init_args_value_an_override_set_shows_at_the_override(tmp_path, capsys):
    """A value the task's own check refuses, set by --data.task.init_args.KEY: the override's line, not the line of
    the file's init_args, whose values are right."""
    config = tmp_path / "c.yaml"
    config.write_text(DIGITS_CONFIG)
    assert run_fw(["validate", "--config", str(config), "--data.task.init_args.rule=prev"], capsys) == (2, [
        ("override '--data.task.init_args.rule=prev': data.task.init_args: digits task: rule must be one of copy, "
         "last, next, sum, max, got 'prev'")])
    assert run_fw(["validate", "--config", str(config), "--data.task.init_args.num_digits=two"], capsys) == (2, [
        ("override '--data.task.init_args.num_digits=two': data.task.init_args: digits task: num_digits must be an "
         "int >= 1, got 'two'")])


def test_an_unknown_init_args_key_an_override_set_shows_at_the_override(tmp_path, capsys):
    """A key the class does not take, added by an override to the file's init_args: of a built-in task (its build
    refuses it) and of a class_path task (the config's own check of the signature)."""
    config = tmp_path / "c.yaml"
    config.write_text(DIGITS_CONFIG)
    assert run_fw(["validate", "--config", str(config), "--data.task.init_args.foo=1"], capsys) == (2, [
        ("override '--data.task.init_args.foo=1': data.task.init_args: 'digits' has no parameter(s) foo; it takes "
         "num_digits, rule, template, seed")])
    (tmp_path / "argtask.py").write_text(
        "class T:\n    def __init__(self, a=1, seed=0):\n        pass\n\n"
        "    def sample(self, i):\n        return {'prompt': 'x', 'answer': '1', 'metadata': {}}\n")
    config.write_text("recipe: grpo\nmodel: {policy: {preset: tiny}}\ndata:\n  task:\n    class_path: argtask.T\n"
                      "    init_args: {a: 2}\n  chat_template: false\n")
    assert run_fw(["validate", "--config", str(config), "--data.task.init_args.b=3"], capsys) == (2, [
        ("override '--data.task.init_args.b=3': data.task.init_args: init_args do not fit argtask.T(a=1, seed=0): "
         "got an unexpected keyword argument 'b' (accepted: a, seed)")])


def test_a_reward_init_args_key_an_override_set_shows_at_the_override(tmp_path, capsys):
    """reward.init_args written in the file, one key set from the command line: a built-in reward refusing it, and a
    class_path reward whose constructor refuses its value (a problem shown at reward.class_path, the override's)."""
    config = tmp_path / "c.yaml"
    config.write_text("recipe: grpo\nmodel: {policy: {preset: tiny}}\ndata: {task: {name: digits}}\n"
                      "reward:\n  name: numeric_match\n  init_args: {rel_tol: 0.1}\n")
    assert run_fw(["validate", "--config", str(config), "--reward.init_args.x=1"], capsys) == (2, [
        ("override '--reward.init_args.x=1': reward.init_args: for 'numeric_match': NumericMatch.__init__() got an "
         "unexpected keyword argument 'x'")])
    (tmp_path / "kreward.py").write_text(
        "class R:\n    def __init__(self, k=1):\n        if k == 0:\n"
        "            raise ValueError('k must not be 0')\n\n"
        "    def __call__(self, prompt, completion, metadata):\n        return 0.0\n")
    config.write_text("recipe: grpo\nmodel: {policy: {preset: tiny}}\ndata: {task: {name: digits}}\n"
                      "reward:\n  class_path: kreward.R\n  init_args: {k: 1}\n")
    assert run_fw(["validate", "--config", str(config), "--reward.init_args.k=0"], capsys) == (2, [
        ("override '--reward.init_args.k=0': reward.class_path: kreward.R(**init_args) raised ValueError: k must not "
         f"be 0 (at {tmp_path / 'kreward.py'}:4)")])


def test_a_bad_init_args_value_from_the_file_shows_at_the_file_under_an_override(tmp_path, capsys):
    """The file's init_args hold the bad value and an override sets another key of them rightly: the file's line.
    The override's value refused first (the task checks num_digits before rule): the override's."""
    config = tmp_path / "c.yaml"
    config.write_text(DIGITS_CONFIG.replace("rule: next", "rule: prev"))
    assert run_fw(["validate", "--config", str(config), "--data.task.init_args.num_digits=2"], capsys) == (2, [
        (f"{config}:6:16: data.task.init_args: digits task: rule must be one of copy, last, next, sum, max, "
         "got 'prev'")])
    assert run_fw(["validate", "--config", str(config), "--data.task.init_args.num_digits=0"], capsys) == (2, [
        ("override '--data.task.init_args.num_digits=0': data.task.init_args: digits task: num_digits must be an "
         "int >= 1, got 0")])


def test_model_paths_the_recipe_will_not_read_are_said_once_each(tmp_path, capsys):
    """A critic's path under GRPO and a reference's under kl_coef 0 look in use and are not: one warning line each
    (exit 0, nothing read); a PPO config reads both and says nothing of them."""
    config = tmp_path / "c.yaml"
    config.write_text(f"recipe: grpo\nmodel:\n  policy: {{preset: tiny}}\n  value: {{path: {tmp_path / 'gone'}}}\n"
                      f"  reference: {{path: {tmp_path / 'gone2'}}}\ndata: {{task: {{name: digits}}}}\n")
    assert main(["validate", "--config", str(config)]) == 0
    assert capsys.readouterr().err.splitlines() == [
        "fw: warning: model.value.path is set, but recipe grpo trains no critic: it is not read",
        ("fw: warning: model.reference.path is set, but grpo.kl_coef is 0.0, so no reference model is built: it is "
         "not read")]
    assert main(["validate", "--config", str(config), "--recipe=ppo"]) == 2
    err = capsys.readouterr().err
    assert "warning" not in err and "model.value.path: no such directory" in err


INTERRUPTING = """class Task:
    def __init__(self, seed=0, stop_in=""):
        self.stop_in = stop_in
        if stop_in == "init":
            raise KeyboardInterrupt

    def sample(self, index):
        if self.stop_in == "sample":
            raise KeyboardInterrupt
        return {"prompt": "1+1=", "answer": "2", "metadata": {"answer": "2"}}


class Reward:
    def __init__(self):
        raise KeyboardInterrupt

    def __call__(self, completion, answer, metadata):
        return 0.0
"""


@pytest.mark.parametrize("stop_in, said", [
    ("init", "building the task (at {module}:5)"),
    ("sample", "Task.sample(0) (at {module}:9)"),
    ("reward", "building the reward (at {module}:15)"),
])
def test_ctrl_c_in_user_code_ends_validate_with_130_naming_the_call_and_its_line(tmp_path, capsys, stop_in, said):
    """A KeyboardInterrupt while fw validate runs the user's code (Ctrl+C in a slow task, or the code's own) is no
    problem of the config: validate ends as Ctrl+C ends fw, with exit code 130 and one line, which names the call
    and the user's line it stopped at, as it names the line of code that raised; the traceback only with --debug.
    sys.exit() in the same code stays a problem of the config at its key (exit code 2)."""
    name = f"interrupting_{stop_in}"
    module = tmp_path / f"{name}.py"
    module.write_text(INTERRUPTING)
    config = tmp_path / "c.yaml"
    reward = f"{{class_path: {name}.Reward}}" if stop_in == "reward" else "{name: exact_match}"
    config.write_text(f"recipe: grpo\nmodel: {{policy: {{preset: tiny}}}}\n"
                      f"data: {{task: {{class_path: {name}.Task, init_args: {{stop_in: {stop_in}}}}}, "
                      f"chat_template: false}}\nreward: {reward}\n")
    line = "fw: interrupted: KeyboardInterrupt in " + said.format(module=module)
    try:
        assert run_fw(["validate", "--config", str(config)], capsys) == (130, [line])
        code, err = run_fw(["--debug", "validate", "--config", str(config)], capsys)
        assert code == 130 and err[0] == "Traceback (most recent call last):" and err[-1] == line
        module.write_text(INTERRUPTING.replace("raise KeyboardInterrupt", "raise SystemExit(4)"))
        sys.modules.pop(name, None)
        code, err = run_fw(["validate", "--config", str(config)], capsys)
        assert code == 2 and len(err) == 1 and "called sys.exit(4) (at " in err[0] and err[0].startswith(f"{config}:")
    finally:
        sys.modules.pop(name, None)


@pytest.mark.skipif(torch.cuda.is_available(), reason="what a machine without a GPU checks")
def test_cpu_offload_under_accelerator_auto_is_checked_for_the_gpu_it_is_for(tmp_path, capsys):
    """optimizer.cpu_offload moves a GPU's optimizer states to the CPU. Under trainer.accelerator: auto the machine
    that runs the job picks the device, so fw validate checks it as for a GPU, as it checks accelerator: gpu on any
    machine, and says so; fw plan --gpu-gib plans it on the GPU. fw fit, here, refuses it: this machine has no GPU;
    and an explicit CPU job is refused everywhere, as is one of several processes."""
    from framework.validate import validate_config

    bench = str(ROOT / "benchmarks" / "grpo_bench.yaml")
    offload = [f"--run_dir={tmp_path / 'run'}", "--optimizer.cpu_offload=true"]
    assert main(["validate", "--config", bench, *offload]) == 0
    assert capsys.readouterr().out.strip() == (
        f"{bench}: valid (recipe grpo; optimizer.cpu_offload checked for one GPU, which trainer.accelerator: auto runs "
        "on where there is one (none here); trainer.devices: auto would take every GPU of a machine of several, and "
        "cpu_offload runs in one process: --trainer.devices=1 keeps it to one)")
    assert main(["validate", "--config", bench, *offload, "--trainer.devices=1"]) == 0
    assert capsys.readouterr().out.strip() == (
        f"{bench}: valid (recipe grpo; optimizer.cpu_offload checked for a GPU, which trainer.accelerator: auto runs "
        "on where there is one (none here))")
    code, out, err = main(["plan", "--config", bench, *offload, "--gpu-gib", "80"]), *capsys.readouterr()
    assert (code, err) == (0, "") and "pinned CPU memory (optimizer.cpu_offload)" in out
    for other, problem in (("--trainer.accelerator=cpu", "this run has no CUDA GPU (trainer.accelerator: cpu)"),
                           ("--trainer.devices=2", "runs in a single process only")):
        code, err = run_fw(["validate", "--config", bench, *offload, other], capsys)
        assert code == 2 and len(err) == 1 and problem in err[0], err
    with pytest.raises(FwError) as e:   # fw fit's checks: this machine's
        validate_config([bench], offload, machine=True)
    assert "optimizer.cpu_offload: true moves the optimizer states from a CUDA GPU to the CPU, but this run has no " \
           "CUDA GPU (trainer.accelerator: auto, none visible)" in str(e.value)


def test_validate_runs_without_lightning_and_speaks_on_the_first_process_only(tmp_path):
    """Lightning takes seconds to import: `fw validate` of a config with no user callback, logger or named strategy
    checks it without importing Lightning. Its warnings are the first process's: under a launcher's RANK=1, or on a
    later node of a job started by hand on each node, they are not given; under RANK=0 (or none) they are."""
    config = tmp_path / "c.yaml"
    config.write_text(f"recipe: grpo\nrun_dir: {tmp_path / 'run'}\ndata: {{task: {{name: digits}}}}\n"
                      f"model:\n  policy: {{preset: tiny}}\n  value: {{path: {tmp_path / 'gone'}}}\n")
    probe = ("import sys\nfrom framework.cli import main\ncode = main(['validate', '--config', sys.argv[1]])\n"
             "print(code, 'lightning' in sys.modules)\n")
    warning = "fw: warning: model.value.path is set, but recipe grpo trains no critic: it is not read\n"
    # a job started by hand on each node: the first process of node 1 has LOCAL_RANK 0 and is not the job's first
    for launch, said in (({}, warning), ({"RANK": "0"}, warning), ({"RANK": "1"}, ""),
                         ({"NODE_RANK": "1", "LOCAL_RANK": "0"}, ""), ({"NODE_RANK": "0", "LOCAL_RANK": "0"}, warning)):
        env = {k: v for k, v in os.environ.items()
               if k not in ("RANK", "LOCAL_RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK", "NODE_RANK", "GROUP_RANK")}
        env.update(launch, PYTHONPATH=str(ROOT))
        done = subprocess.run([sys.executable, "-c", probe, str(config)], env=env, capture_output=True, text=True,
                              check=False, timeout=120)
        assert (done.stdout, done.stderr) == (f"{config}: valid (recipe grpo)\n0 False\n", said), launch


def test_a_kv_budget_below_two_blocks_is_refused_at_its_key_and_two_blocks_run(tmp_path, capsys):
    """rollout.kv_cache_gib that pays for fewer than 2 blocks (a row's and the scratch block) was rounded up to 2,
    so a budget smaller than a block ran past itself; it is refused at its key before anything runs, by `fw plan` as
    by `fw validate`, and `fw generate` counts one block. Exactly 2 blocks run and give the tokens of an unbounded
    budget."""
    config = tmp_path / "c.yaml"
    config.write_text(GRPO + "  chat_template: false\nrollout:\n  max_new_tokens: 2\n  kv_cache_gib: 1.0e-6\n")
    code, lines = run_fw(["validate", "--config", str(config)], capsys)
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"{config}:10:17: rollout.kv_cache_gib: one row of the longest prompt"), lines
    assert "the pool holds 0 (rollout.kv_cache_gib 1e-06)" in lines[0] and "not even the prompt fits" in lines[0]
    assert run_fw(["plan", "--config", str(config)], capsys) == (2, lines)   # fw plan refuses it as validate does
    gen = ["generate", "--config", str(config), "--prompt", "12+3=", "--seed", "3"]
    code, lines = run_fw(gen, capsys)
    assert code == 2 and lines == [("fw: error: rollout: one row of 5 prompt + 2 new tokens needs 1 KV blocks of 16 "
                                    "positions, the cache holds 0, and not even its prompt fits, whatever "
                                    "rollout.max_new_tokens: raise rollout.kv_cache_gib")], lines
    two_blocks = 2 * 32768 / 2**30   # tiny: 2 x 2 layers x 2 kv heads x 16 positions x 64 x 4 B a block
    assert main([*gen, f"--rollout.kv_cache_gib={two_blocks!r}"]) == 0
    bounded = capsys.readouterr().out
    assert main([*gen, "--rollout.kv_cache_gib=null"]) == 0
    assert capsys.readouterr().out == bounded


def test_min_lr_ratio_under_a_constant_schedule_is_refused(tmp_path, capsys):
    """`scheduler.name: constant` (the default) never decays, so a min_lr_ratio written for it would change nothing
    (the lr stays at optimizer.lr: test_optim_review's constant case): refused at its line, as the recipe sections'
    unread keys are; under a decaying schedule it validates."""
    path = tmp_path / "train.yaml"
    path.write_text("recipe: sft\nmodel:\n  policy: {preset: tiny}\ndata:\n  task: {name: digits}\n"
                    f"run_dir: {tmp_path / 'run'}\nscheduler:\n  warmup_steps: 10\n  min_lr_ratio: 0.1\n")
    assert run_fw(["validate", "--config", str(path)], capsys) == (2, [
        (f"{path}:9:17: scheduler.min_lr_ratio: 0.1 changes nothing while scheduler.name is constant; set name: "
         "linear or cosine to decay the lr to it, or leave min_lr_ratio at 0.0")])
    for name in ("linear", "cosine"):
        assert run_fw(["validate", "--config", str(path), f"--scheduler.name={name}"], capsys) == (0, [])
    assert run_fw(["validate", "--config", str(path), "--scheduler.min_lr_ratio=0"], capsys) == (0, [])


def test_max_error_fraction_under_on_error_raise_is_refused(tmp_path, capsys):
    """Under `reward.on_error: raise` (the default) the first failed sample stops the run, so a max_error_fraction
    would change nothing (test_rewards: under raise, one failure of three stops scoring at a fraction of 1): refused at
    its line; under zero it validates."""
    path = tmp_path / "train.yaml"
    path.write_text("recipe: grpo\nmodel:\n  policy: {preset: tiny}\ndata:\n  task: {name: digits}\n"
                    f"run_dir: {tmp_path / 'run'}\nreward:\n  max_error_fraction: 0.9\n")
    assert run_fw(["validate", "--config", str(path)], capsys) == (2, [
        (f"{path}:8:23: reward.max_error_fraction: 0.9 changes nothing while reward.on_error is raise, which stops "
         "the run at the first failed sample; set on_error: zero to score failed samples 0 up to that fraction, or "
         "leave max_error_fraction at 0.5")])
    assert run_fw(["validate", "--config", str(path), "--reward.on_error=zero"], capsys) == (0, [])
    assert run_fw(["validate", "--config", str(path), "--reward.max_error_fraction=0.5"], capsys) == (0, [])
