"""The `fw` command line: commands, exit codes, error output, and the files that ship with it."""

import os
import re
import shutil
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import interrupt_once_started

from framework import yaml12
from framework.cli import main
from framework.config import load_config

ROOT = Path(__file__).resolve().parents[1]
TRAIN = str(ROOT / "train.yaml")
SCHEMA_FILE = ROOT / "schemas" / "train.schema.json"
BAD = ROOT / "tests" / "bad_configs"


def fw(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def fw_process(*argv: str, env: dict | None = None, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "framework", *argv], capture_output=True, text=True, cwd=cwd,
                          env={**os.environ, **(env or {})}, timeout=120, check=False)


# ------------------------------------------------------------------------------------------ help

def test_help_lists_the_commands_and_the_config_reference(capsys):
    code, out, _ = fw(capsys, "--help")
    assert code == 0
    for command in ["fit", "validate", "print-config", "schema", "export", "generate", "doctor", "ops"]:
        assert re.search(rf"^\s+{command}\s", out, re.MULTILINE), command
    flat = " ".join(out.split())
    assert str(SCHEMA_FILE) in flat and "fw schema" in flat


def test_fit_help_shows_options_overrides_and_the_config_reference(capsys):
    code, out, _ = fw(capsys, "fit", "--help")
    flat = " ".join(out.split())
    assert code == 0
    for text in ["--config FILE", "--resume last|PATH", "--debug", "--trainer.max_steps=10", str(SCHEMA_FILE),
                 "fw schema"]:
        assert text in flat, text


def test_no_command_prints_usage_and_exits_2(capsys):
    code, out, err = fw(capsys)
    assert (code, out) == (2, "") and err.startswith("usage: fw")


def test_unknown_arguments_of_commands_without_config_are_usage_errors(capsys):
    code, _, err = fw(capsys, "schema", "--trainer.max_steps=3")
    assert code == 2 and "unrecognized arguments: --trainer.max_steps=3" in err


def test_usage_errors_are_one_line_naming_the_command_and_its_help():
    """An option argparse refuses (a bad value, one missing, a command unknown) is one `fw: error:` line with exit
    code 2, as every other user error is, not the usage text followed by the error."""
    cases = {
        ("plan", "--config", TRAIN, "--gpu-gib", "abc"):
            "fw: error: plan: argument --gpu-gib: invalid float value: 'abc' (see fw plan --help)\n",
        ("export", "--checkpoint", "runs/x"):
            "fw: error: export: the following arguments are required: --out (see fw export --help)\n",
        ("schema", "--x"): "fw: error: schema: unrecognized arguments: --x (see fw schema --help)\n",
        ("--bogus",): "fw: error: unrecognized arguments: --bogus (see fw --help)\n",
        ("ops", "frob"): ("fw: error: ops: argument OPS_COMMAND: invalid choice: 'frob' (choose from 'build') "
                          "(see fw ops --help)\n"),
    }
    for argv, err in cases.items():
        done = fw_process(*argv)
        assert (done.returncode, done.stdout, done.stderr) == (2, "", err), argv


def test_an_empty_path_option_is_refused_naming_it(tmp_path, capsys):
    """An empty --config, --resume, --checkpoint, --out or --run is refused naming the option, instead of being
    read as the working directory (`--out ''` said that it exists, `--resume ''` named '.') or as a file named ''
    (a line starting ': config file not found')."""
    cases = {
        ("validate", "--config", ""): "--config is empty; give a YAML config file",
        ("validate", "--config", TRAIN, "--config", ""): "--config is empty; give a YAML config file",
        ("fit", "--config", TRAIN, "--resume", ""): "--resume is empty; give last or a checkpoint directory",
        ("export", "--checkpoint", "", "--out", str(tmp_path / "out")):
            "--checkpoint is empty; give a checkpoint or run directory",
        ("export", "--checkpoint", str(tmp_path), "--out", ""): "--out is empty; give a path to write",
        ("eval", "--checkpoint", str(tmp_path), "--out", ""): "--out is empty; give a path to write",
        ("generate", "--checkpoint", "", "--prompt", "3="): "--checkpoint is empty; give a checkpoint or run directory",
        ("plot", "--run", ""): "--run is empty; give a run directory",
    }
    for argv, message in cases.items():
        assert fw(capsys, *argv) == (2, "", f"fw: error: {message}\n"), argv
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------------ config commands

def test_validate(capsys):
    assert fw(capsys, "validate", "--config", TRAIN) == (0, f"{TRAIN}: valid (recipe grpo)\n", "")


def test_validate_needs_a_config(capsys):
    assert fw(capsys, "validate") == (2, "", "fw: error: fw validate needs --config FILE\n")


def test_print_config_is_the_resolved_config(capsys):
    code, out, err = fw(capsys, "print-config", "--config", TRAIN, "--trainer.max_steps=3", "--optimizer.lr=2e-5")
    assert (code, err) == (0, "")
    printed = yaml12.load(out)
    assert printed == load_config([TRAIN], ["--trainer.max_steps=3", "--optimizer.lr=2e-5"])
    assert printed["trainer"]["max_steps"] == 3 and printed["optimizer"]["lr"] == 2e-5
    assert printed["scheduler"] == {"name": "constant", "warmup_steps": 0, "min_lr_ratio": 0.0}  # defaults shown


def test_an_override_may_give_its_value_as_the_next_argument(capsys):
    """`--trainer.max_steps 3`, as options take their values, is `--trainer.max_steps=3`; a value may start with a
    single dash. An override without any value is still refused."""
    code, out, err = fw(capsys, "print-config", "--config", TRAIN, "--trainer.max_steps", "3", "--name", "-run1",
                        "--optimizer.lr=2e-5")
    assert (code, err) == (0, "")
    assert yaml12.load(out) == load_config([TRAIN], ["--trainer.max_steps=3", "--name=-run1", "--optimizer.lr=2e-5"])
    code, _, err = fw(capsys, "validate", "--config", TRAIN, "--trainer.max_steps")
    assert code == 2 and "malformed override: expected --key.path=value" in err


def test_print_config_output_is_itself_a_valid_config(capsys, tmp_path):
    _, out, _ = fw(capsys, "print-config", "--config", TRAIN)
    saved = tmp_path / "resolved.yaml"
    saved.write_text(out)
    assert fw(capsys, "validate", "--config", str(saved))[0] == 0


def test_schema_prints_the_schema_file(capsys):
    code, out, err = fw(capsys, "schema")
    assert (code, err) == (0, "") and out == SCHEMA_FILE.read_text()


# ------------------------------------------------------------------------------------------ errors

def test_config_errors_are_one_line_each_without_traceback(capsys):
    path = BAD / "many_problems.yaml"
    code, out, err = fw(capsys, "validate", "--config", str(path))
    assert (code, out) == (2, "")
    assert [line.split(": ")[0] for line in err.splitlines()] == [f"{path}:{p}" for p in
                                                                   ["5:14", "6:3", "8:7", "10:8", "11:1"]]


def test_debug_adds_the_traceback(capsys):
    path = str(BAD / "missing_recipe.yaml")
    code, _, err = fw(capsys, "validate", "--config", path, "--debug")
    assert code == 2 and "Traceback (most recent call last)" in err and "ConfigError" in err
    assert err.splitlines()[-1] == f"{path}:1:1: recipe: missing required key 'recipe'"
    code, _, err = fw(capsys, "--debug", "validate", "--config", path)
    assert code == 2 and "Traceback" in err


def test_fw_debug_environment_variable(capsys, monkeypatch):
    path = str(BAD / "missing_recipe.yaml")
    monkeypatch.setenv("FW_DEBUG", "1")
    assert "Traceback" in fw(capsys, "validate", "--config", path)[2]
    monkeypatch.setenv("FW_DEBUG", "0")
    assert "Traceback" not in fw(capsys, "validate", "--config", path)[2]


def test_generate_argument_errors(capsys):
    assert fw(capsys, "generate", "--prompt", "hi") == (
        2, "", "fw: error: fw generate needs --config FILE or --checkpoint DIR\n")
    code, _, err = fw(capsys, "generate", "--config", TRAIN, "--prompt", "hi", "--greedy", "--temperature", "1")
    assert code == 2 and "not allowed with argument" in err
    code, _, err = fw(capsys, "generate", "--config", TRAIN, "--prompt", "hi", "--max-new-tokens", "0")
    assert (code, err) == (2, "fw: error: --max-new-tokens must be an int >= 1, got 0\n")
    code, _, err = fw(capsys, "generate", "--config", TRAIN, "--prompt", "hi", "--temperature", "-1")
    assert (code, err) == (2, "fw: error: --temperature must be 0 (greedy) or a finite number >= 1e-05, got -1.0\n")
    for seed in ("-1", str(2**32), str(2**70)):   # the config's seed's bounds
        code, _, err = fw(capsys, "generate", "--config", TRAIN, "--prompt", "hi", "--seed", seed)
        said = f"fw: error: --seed must be an integer from 0 to 4294967295, as the config's seed is; got {seed}\n"
        assert (code, err) == (2, said)
    code, _, err = fw(capsys, "generate", "--config", TRAIN, "--prompt", "hi", "--temperature", "warm")
    assert code == 2 and "argument --temperature: invalid float value: 'warm'" in err


def test_generate_refuses_an_empty_prompt_before_loading_the_model(capsys, monkeypatch):
    """train.yaml renders no chat template: an empty --prompt leaves the model nothing to read, which is said
    before any weights load (minutes for a big model)."""
    import framework.generate

    def no_load(*args):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(framework.generate, "load_policy", no_load)
    assert fw(capsys, "generate", "--config", TRAIN, "--prompt", "") == (
        2, "", ("fw: error: --prompt is empty, and data.chat_template is false, so the model would read no token; "
                "give the text to continue\n"))


def test_skip_damaged_without_the_checkpoints_it_chooses_among_is_refused(capsys, tmp_path):
    """`--skip-damaged` chooses among a run directory's checkpoints: without `--resume` (fit) or `--checkpoint`
    (generate) there are none, and the option is refused rather than ignored, before anything runs."""
    run_dir = tmp_path / "run"
    assert fw(capsys, *_fit_argv(run_dir, "--skip-damaged")) == (
        2, "", ("fw: error: --skip-damaged applies only with --resume: it passes over a run directory's damaged "
                "newest checkpoint for its newest intact one; add --resume last, or leave --skip-damaged out\n"))
    assert not run_dir.exists()
    sft = str(ROOT / "recipes" / "sft.yaml")
    assert fw(capsys, "generate", "--config", sft, "--prompt", "1+1=", "--greedy", "--skip-damaged") == (
        2, "", ("fw: error: --skip-damaged applies only with --checkpoint: it passes over a run directory's damaged "
                "newest checkpoint for its newest intact one; add --checkpoint RUN_DIR, or leave --skip-damaged out\n"))


def test_export_of_a_missing_checkpoint_is_a_user_error(capsys, tmp_path):
    code, out, err = fw(capsys, "export", "--checkpoint", str(tmp_path / "nope"), "--out", str(tmp_path / "out"))
    assert (code, out) == (2, "")
    assert err.startswith("fw: error: ") and len(err.splitlines()) == 1 and "Traceback" not in err


def test_keyboard_interrupt_exits_130(capsys, tmp_path, monkeypatch):
    (tmp_path / "interrupting_fw_mod.py").write_text("raise KeyboardInterrupt\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    config = tmp_path / "c.yaml"
    config.write_text("recipe: sft\nmodel: {policy: {preset: tiny}}\n"
                      "callbacks: [{class_path: interrupting_fw_mod.Callback}]\n")
    module = tmp_path / "interrupting_fw_mod.py"
    assert fw(capsys, "validate", "--config", str(config)) == (
        130, "", f"fw: interrupted: KeyboardInterrupt (at {module}:1)\n")
    sys.modules.pop("interrupting_fw_mod", None)


def test_ops_build_without_cuda_is_one_line(capsys):
    torch = pytest.importorskip("torch")
    if torch.version.cuda is not None:
        pytest.skip("this torch has CUDA: building is the GPU tests' business")
    code, _, err = fw(capsys, "ops", "build")
    assert code == 2 and err.startswith("fw: error: cannot build the CUDA ops: ") and len(err.splitlines()) == 1


def test_doctor(capsys):
    code, out, err = fw(capsys, "doctor")
    assert (code, err) == (0, "") and out.startswith("torch: ")


# ------------------------------------------------------------------------------------------ real processes

def test_process_reports_every_problem_and_exits_2():
    proc = fw_process("validate", "--config", str(BAD / "many_problems.yaml"))
    assert proc.returncode == 2 and proc.stdout == ""
    assert len(proc.stderr.splitlines()) == 5 and "Traceback" not in proc.stderr


def test_process_debug_shows_the_traceback():
    proc = fw_process("--debug", "validate", "--config", str(BAD / "duplicate_key.yaml"))
    assert proc.returncode == 2 and "Traceback (most recent call last)" in proc.stderr


def test_console_script_outside_the_repo(tmp_path):
    script = Path(sys.executable).parent / "fw"
    if not script.exists():
        pytest.skip("the fw console script is not installed next to this Python")
    proc = subprocess.run([str(script), "validate", "--config", TRAIN, "--trainer.max_steps=x"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 2
    assert proc.stderr == ("override '--trainer.max_steps=x': trainer.max_steps: expected an integer, "
                           "got the string 'x'\n")


def test_a_reader_that_stops_reading_ends_fw_quietly():
    """`fw plan ... | head -1`: the reader has closed the pipe when fw writes; fw ends as a command killed by
    SIGPIPE does (128 + 13), saying nothing, instead of two tracebacks."""
    proc = subprocess.Popen([sys.executable, "-m", "framework", "plan", "--config", TRAIN], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()   # before fw writes: its first write meets a pipe without a reader
    err = proc.stderr.read().decode()
    assert (proc.wait(timeout=60), err) == (128 + signal.SIGPIPE, "")


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full, a device whose writes fail")
@pytest.mark.parametrize("command", [["schema"], ["print-config", "--config", TRAIN], ["plan", "--config", TRAIN]])
def test_a_result_that_cannot_be_written_is_one_line(command):
    """A full disk under standard output: one line and exit 2, not a traceback from print() or from the
    interpreter's flush at exit."""
    with open("/dev/full", "w") as full:
        proc = subprocess.run([sys.executable, "-m", "framework", *command], cwd=ROOT, stdout=full,
                              stderr=subprocess.PIPE, text=True, timeout=120, check=False)
    want = "fw: error: cannot write to standard output: No space left on device\n"
    assert (proc.returncode, proc.stderr) == (2, want)


def test_a_closed_standard_output_is_refused_rather_than_the_result_dropped():
    """fd 1 closed: Python's print() writes nowhere without a word, so the result would be lost with exit 0."""
    proc = subprocess.run(["sh", "-c", 'exec "$0" -m framework schema >&-', sys.executable], cwd=ROOT,
                          stderr=subprocess.PIPE, text=True, timeout=120, check=False)
    want = "fw: error: standard output is closed; fw schema writes its result there\n"
    assert (proc.returncode, proc.stderr) == (2, want)


def test_sigint_exits_130(tmp_path):
    marker = tmp_path / "started"
    (tmp_path / "slow_fw_mod.py").write_text(
        f"import pathlib, time\npathlib.Path({str(marker)!r}).touch()\ntime.sleep(60)\n")
    config = tmp_path / "c.yaml"
    config.write_text("recipe: sft\nmodel: {policy: {preset: tiny}}\ncallbacks: [{class_path: slow_fw_mod.Cb}]\n")
    proc = subprocess.Popen([sys.executable, "-m", "framework", "validate", "--config", str(config)],
                            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(tmp_path)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    interrupt_once_started(proc, marker)
    _, err = proc.communicate(timeout=60)
    assert (proc.returncode, err) == (130, f"fw: interrupted: KeyboardInterrupt (at {tmp_path / 'slow_fw_mod.py'}:3)\n")


# ------------------------------------------------------------------------------------------ fit, end to end

def test_fit_generate_export_end_to_end(capsys, tmp_path):
    pytest.importorskip("framework.trainer")
    run_dir = tmp_path / "run"
    code, _, err = fw(capsys, "fit", "--config", TRAIN, f"--run_dir={run_dir}", "--trainer.max_steps=1",
                      "--checkpoint.every_n_steps=1", "--trainer.enable_progress_bar=false",
                      "--logging.tensorboard=false")
    assert code == 0, err
    saved = run_dir / "config.yaml"
    assert saved.read_text().startswith("# yaml-language-server: $schema=")
    assert load_config([str(saved)], []) == load_config(
        [TRAIN], [f"--run_dir={run_dir}", "--trainer.max_steps=1", "--checkpoint.every_n_steps=1",
                  "--trainer.enable_progress_bar=false", "--logging.tensorboard=false"])
    (checkpoint,) = (run_dir / "checkpoints").glob("step-*")
    code, out, err = fw(capsys, "generate", "--checkpoint", str(checkpoint), "--prompt", "1+1=", "--greedy",
                        "--max-new-tokens", "4")
    assert code == 0, err
    assert out.endswith("\n")
    code, _, err = fw(capsys, "export", "--checkpoint", str(checkpoint), "--out", str(tmp_path / "hf"))
    assert code == 0, err
    assert (tmp_path / "hf" / "config.json").is_file()


def _fit_argv(run_dir: Path, *extra: str) -> list[str]:
    return ["fit", "--config", str(ROOT / "recipes" / "sft.yaml"), f"--run_dir={run_dir}",
            f"--data.path={ROOT / 'recipes' / 'data' / 'arithmetic_chat.jsonl'}", "--data.max_seq_len=64",
            "--data.batch_size=4", "--trainer.max_steps=3", "--logging.tensorboard=false", *extra]


def test_an_error_during_fit_is_one_line_of_its_own_after_the_progress_bar(capsys, tmp_path, monkeypatch):
    (tmp_path / "failing_fw_cb.py").write_text(
        "import lightning\nfrom framework.errors import FwError\n\n"
        "class FailAtStep2(lightning.Callback):\n"
        "    def on_train_batch_start(self, trainer, module, batch, batch_idx):\n"
        "        if module.policy_version == 1:\n"
        "            raise FwError('the source is gone:\\n  it was moved')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    code, out, err = fw(capsys, *_fit_argv(tmp_path / "run", "--trainer.enable_progress_bar=true",
                                           "--callbacks=[{class_path: failing_fw_cb.FailAtStep2}]"))
    sys.modules.pop("failing_fw_cb", None)
    # the bar (on stdout, which a terminal shows with stderr) had its line ended before the error
    assert code == 2 and "step:" in out and out.endswith("\n")
    # stderr holds the memory plan's table, then the one error line
    assert err.endswith("\nfw: error: the source is gone:; it was moved\n") and err.count("fw: error:") == 1


def test_a_fresh_fit_does_not_overwrite_the_metrics_of_an_earlier_run(capsys, tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    earlier = '{"step": 1, "loss": 2.5}\n{"step": 2, "loss": 2.25}\n'
    (run_dir / "metrics.jsonl").write_text(earlier)
    code, _, err = fw(capsys, *_fit_argv(run_dir, "--trainer.enable_progress_bar=false"))
    assert (code, err) == (2, (f"fw: error: {run_dir / 'metrics.jsonl'} holds the metrics of an earlier run, which "
                               "left no checkpoint to resume from; choose another run_dir, or delete the file to "
                               "start over\n"))
    assert (run_dir / "metrics.jsonl").read_text() == earlier and not (run_dir / "config.yaml").exists()
    # an empty metrics.jsonl (a run that stopped before its first step) is no earlier run
    (run_dir / "metrics.jsonl").write_text("")
    assert fw(capsys, *_fit_argv(run_dir, "--trainer.enable_progress_bar=false"))[0] == 0


def test_a_fresh_fit_does_not_continue_the_csv_log_of_an_earlier_run(capsys, tmp_path):
    """logs/version_0 is the one folder a resume continues; a fresh run would append to an earlier run's rows."""
    run_dir = tmp_path / "run"
    logs = run_dir / "logs" / "version_0"
    logs.mkdir(parents=True)
    (logs / "metrics.csv").write_text("step,loss\n")   # a header alone: no point logged yet
    earlier = "step,loss\n1,2.5\n"
    assert fw(capsys, *_fit_argv(tmp_path / "other", "--trainer.enable_progress_bar=false"))[0] == 0
    (logs / "metrics.csv").write_text(earlier)
    code, _, err = fw(capsys, *_fit_argv(run_dir, "--trainer.enable_progress_bar=false"))
    assert (code, err) == (2, (f"fw: error: {logs / 'metrics.csv'} holds the logs of an earlier run, which left no "
                               f"checkpoint to resume from; choose another run_dir, or delete {logs} to start over\n"))
    assert (logs / "metrics.csv").read_text() == earlier and not (run_dir / "config.yaml").exists()
    (logs / "metrics.csv").write_text("step,loss\n")
    assert fw(capsys, *_fit_argv(run_dir, "--trainer.enable_progress_bar=false"))[0] == 0


def test_the_refusal_of_an_earlier_runs_metrics_names_its_logs_too(capsys, tmp_path):
    """What a failed run leaves, metrics.jsonl and logs/version_0, is named in one line: deleting the file alone
    would only meet the next refusal."""
    run_dir = tmp_path / "run"
    logs = run_dir / "logs" / "version_0"
    logs.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "loss": 2.5}\n')
    (logs / "metrics.csv").write_text("step,loss\n1,2.5\n")
    code, _, err = fw(capsys, *_fit_argv(run_dir, "--trainer.enable_progress_bar=false"))
    assert (code, err) == (2, (f"fw: error: {run_dir / 'metrics.jsonl'} holds the metrics of an earlier run, which "
                               "left no checkpoint to resume from; choose another run_dir, or delete the file and "
                               f"{logs} to start over\n"))
    (run_dir / "metrics.jsonl").unlink()
    shutil.rmtree(logs)
    assert fw(capsys, *_fit_argv(run_dir, "--trainer.enable_progress_bar=false"))[0] == 0


# ------------------------------------------------------------------------------------------ shipping

def _ci_test_command() -> str:
    lines = [ln for ln in (ROOT / ".ci" / "run").read_text().splitlines() if "-m pytest" in ln]
    (line,) = lines
    return line.split("||")[0].strip()


def test_readme_quickstart_and_ci_run_the_same_test_command():
    readme = (ROOT / "README.md").read_text()
    command = _ci_test_command()
    assert command == 'python -m pytest -q -m "not slow" -n 2'
    assert command in readme
    for text in ['pip install -e ".[dev]"', "fw fit --config train.yaml", "## Callbacks",
                 "schemas/train.schema.json", "yaml-language-server"]:
        assert text in readme, text


def test_the_readme_config_example_is_valid(tmp_path):
    blocks = re.findall(r"```yaml\n(.*?)```", (ROOT / "README.md").read_text(), re.DOTALL)
    assert blocks
    for i, block in enumerate(blocks):
        path = tmp_path / f"readme_{i}.yaml"
        path.write_text(block)
        assert load_config([str(path)], [])["recipe"] in ("sft", "grpo", "ppo")


def test_ci_script_is_strict_and_executable():
    path = ROOT / ".ci" / "run"
    text = path.read_text()
    assert text.startswith("#!/usr/bin/env bash\n") and "set -euo pipefail" in text
    assert path.stat().st_mode & stat.S_IXUSR
    for step in ['pip install "torch==2.13.0"', 'pip install -e ".[dev]"', "ruff check ."]:
        assert step in text, step
    subprocess.run(["bash", "-n", str(path)], check=True)


def test_pyproject_dependencies_and_entry_point():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    specifiers = pytest.importorskip("packaging.requirements")
    deps = {specifiers.Requirement(d).name: specifiers.Requirement(d).specifier for d in project["dependencies"]}
    assert set(deps) == {"torch", "lightning", "torchmetrics", "safetensors", "tokenizers", "pyyaml", "jsonschema",
                         "ninja", "tensorboardX", "tqdm"}
    for name, version in [("torch", "2.11.0"), ("lightning", "2.6.6"), ("pyyaml", "6.0.3"), ("tokenizers", "0.23.2"),
                          ("safetensors", "0.8.0"), ("torchmetrics", "1.9.0"), ("ninja", "1.13.2")]:
        assert deps[name].contains(version), f"{name} {version} (the GPU machine's) must be admitted"
    dev = {specifiers.Requirement(d).name for d in project["optional-dependencies"]["dev"]}
    assert {"pytest", "ruff"} <= dev
    assert project["scripts"] == {"fw": "framework.cli:main"}
    assert project["requires-python"] == ">=3.10"


def test_generate_and_eval_with_a_config_report_its_problems_at_their_keys(capsys, tmp_path):
    """`fw generate --config` and `fw eval --config` check the policy directory, the tokenizer and (eval) eval.path's
    rows as fw validate does: each problem at its override or file line and key, every bad row, before anything
    loads."""
    missing = tmp_path / "nonexist"
    code, out, err = fw(capsys, "generate", "--config", TRAIN, "--prompt", "3=", "--model.policy.preset=null",
                        f"--model.policy.path={missing}")
    assert (code, out) == (2, "")
    assert err == (f"override '--model.policy.path={missing}': model.policy.path: no such directory: {missing} "
                   "(expected a Hugging Face Qwen3 directory with config.json and model.safetensors)\n")
    rows = tmp_path / "eval.jsonl"
    rows.write_text('{"messages": [{"role": "user", "content": "1+1"}, {"role": "assistant", "content": "2"}]}\n'
                    'not json\n{"x": 1}\n')
    code, out, err = fw(capsys, "eval", "--config", str(ROOT / "recipes" / "sft.yaml"), "--checkpoint",
                        str(tmp_path / "none"), f"--eval.path={rows}")
    assert (code, out) == (2, "")
    assert err.splitlines() == [
        f"{rows}:2:1: eval.path: not valid JSON (Expecting value at column 1)",
        f"{rows}:3:1: eval.path: expected a 'messages' list or 'prompt' and 'completion' keys, got keys ['x']"]
