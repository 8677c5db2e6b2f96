"""Exact resume on CPU: a run interrupted at step k (mid-epoch, mid-accumulation-free boundary, also mid
logging interval) and resumed from its last checkpoint logs the same metrics for every later step, and
ends with the same weights, as an uninterrupted run."""

import json
import math
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from framework.callbacks import Callback
from framework.config import resolve
from framework.errors import FwError
from framework.metrics import read_metrics
from framework.trainer import fit

TIMING = {"tokens_per_s"}   # wall-clock dependent


class CrashAt(Callback):
    """Simulates a crash right after optimizer step `step` (after the checkpoint of an earlier step)."""

    def __init__(self, step: int):
        self.step = step

    def after_optimizer_step(self, trainer, module, optimizer):
        if module.policy_version == self.step:
            raise RuntimeError(f"simulated crash after step {self.step}")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """10 chats at 4 per optimizer step (2 micro-batches of 2 rows, one chat per row): epochs end
    mid-step and the checkpoint at step 4 (position 16) falls in the middle of the second epoch."""
    lines = Path("recipes/data/arithmetic_chat.jsonl").read_text().splitlines()[:10]
    path = tmp_path_factory.mktemp("data") / "chats.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def config(run_dir, data, log_every, callbacks=()):
    return resolve({
        "recipe": "sft", "seed": 3, "run_dir": str(run_dir), "model": {"policy": {"preset": "tiny"}},
        "data": {"path": data, "max_seq_len": 96, "batch_size": 2},
        "optimizer": {"lr": 3e-3, "max_grad_norm": 0.5, "weight_decay": 0.01},
        "scheduler": {"name": "cosine", "warmup_steps": 3, "min_lr_ratio": 0.1},
        "trainer": {"accelerator": "cpu", "max_steps": 9, "accumulate_grad_batches": 2,
                    "log_every_n_steps": log_every, "enable_progress_bar": False},
        "checkpoint": {"every_n_steps": 4, "keep_last": None},
        "logging": {"csv": True, "tensorboard": False},
        "callbacks": list(callbacks)})


def test_a_crash_before_the_first_checkpoint_says_none_is_saved(tmp_path, data):
    crash = {"class_path": "test_resume.CrashAt", "init_args": {"step": 2}}
    with pytest.raises(RuntimeError, match="simulated crash") as raised:
        fit(config(tmp_path / "run", data, 1, [crash]))
    assert raised.value.__notes__ == ["fw: the run ended at step 2 on this error; no checkpoint is saved"]
    assert not (tmp_path / "run" / "checkpoints").exists() or not any((tmp_path / "run" / "checkpoints").iterdir())


def comparable(records):
    return [{k: v for k, v in r.items() if k not in TIMING} for r in records]


def final_weights(run_dir, step=9):
    return load_file(str(Path(run_dir) / "checkpoints" / f"step-{step:06d}" / "policy" / "model.safetensors"))


@pytest.mark.parametrize("log_every, crash_at", [(1, 6), (3, 5)])
def test_interrupted_and_resumed_run_equals_uninterrupted(tmp_path, data, log_every, crash_at):
    straight = tmp_path / "straight"
    fit(config(straight, data, log_every))

    broken = tmp_path / "broken"
    crash = {"class_path": "test_resume.CrashAt", "init_args": {"step": crash_at}}
    with pytest.raises(RuntimeError, match="simulated crash") as raised:
        fit(config(broken, data, log_every, [crash]))
    # the traceback ends with what the run kept and how it goes on
    note = (f"fw: the run ended at step {crash_at} on this error; the newest checkpoint is "
            f"{broken / 'checkpoints' / 'step-000004'}, and what came after it is not saved; continue with "
            f"fw fit --config {broken / 'config.yaml'} --resume last")
    assert raised.value.__notes__ == [note]
    logged = [r["step"] for r in read_metrics(broken / "metrics.jsonl")]
    # The crash left lines past the checkpoint (step 5 when logging every step): the resume drops them.
    assert logged == ([1, 2, 3, 4, 5] if log_every == 1 else [3])
    state = torch.load(broken / "checkpoints" / "step-000004" / "trainer_state.pt", weights_only=False)
    position = state["fw_recipe"]["position"]
    assert position == 16   # mid-epoch, in the second epoch

    trainer = fit(config(broken, data, log_every), resume="last")
    assert trainer.global_step == 9 and trainer.lightning_module.policy_version == 9

    expected = comparable(read_metrics(straight / "metrics.jsonl"))
    got = comparable(read_metrics(broken / "metrics.jsonl"))
    assert [r["step"] for r in expected] == ([*range(1, 10)] if log_every == 1 else [3, 6, 9])
    assert got == expected   # exact: same numbers for every step, before and after the resume
    a, b = final_weights(straight), final_weights(broken)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    if log_every == 1:
        # Resuming a finished run trains no more steps and leaves its metrics alone.
        trainer = fit(config(straight, data, log_every), resume="last")
        assert trainer.global_step == 9
        assert comparable(read_metrics(straight / "metrics.jsonl")) == expected


@pytest.fixture(scope="module")
def four_steps(tmp_path_factory, data):
    """A finished run of 4 steps, each logged, its checkpoint at step 4; copied by each test that edits it."""
    run = tmp_path_factory.mktemp("four_steps") / "run"
    fit(config(run, data, 1) | {"trainer": config(run, data, 1)["trainer"] | {"max_steps": 4}})
    return run


@pytest.fixture
def resumable(four_steps, tmp_path, data):
    """(the `fw fit --resume last` arguments of a copy of `four_steps` that trains to step 6, its metrics.jsonl)."""
    from framework.config import dump_config

    run = tmp_path / "run"
    shutil.copytree(four_steps, run)
    train = tmp_path / "train.yaml"
    train.write_text(dump_config(config(run, data, 1)))
    return ["fit", "--config", str(train), "--resume", "last", "--trainer.max_steps=6"], run / "metrics.jsonl"


EXPECTED = 'a resume expects a JSON object with a number or null "step" on every line'


@pytest.mark.parametrize("line, problem", [
    (b"[1, 2]", "2: not a metrics record (an array, not an object)"),
    (b"3", "2: not a metrics record (a number, not an object)"),
    (b'"x"', "2: not a metrics record (a string, not an object)"),
    (b"null", "2: not a metrics record (null, not an object)"),
    (b'{"step": "2", "loss": 1.0}', "2: not a metrics record (its step is '2', not a finite number)"),
    (b'{"step": NaN, "loss": 1.0}', "2: not a metrics record (its step is nan, not a finite number)"),
    (b'{"step": true, "loss": 1.0}', "2: not a metrics record (its step is True, not a finite number)"),
    # cut short but not the last line: no crash leaves one, so it is not passed over as a torn write
    (b'{"step": 2, "lo', "2: not a metrics record (Unterminated string starting at column 13)"),
])
def test_a_resume_refuses_a_metrics_line_it_cannot_place_and_keeps_the_file(resumable, capsys, line, problem):
    """A hand-edited metrics.jsonl line that is no JSON object with an integer step: the resume cannot tell whether
    it comes before its checkpoint, so it neither keeps nor drops it. One line naming the file and line, exit 2,
    before a step is trained; the file is left as it was for the user to fix."""
    from test_crash_safety import fw_lines

    from framework.cli import main

    argv, metrics = resumable
    lines = metrics.read_bytes().splitlines(keepends=True)
    edited = b"".join([lines[0], line + b"\n", *lines[1:]])
    metrics.write_bytes(edited)
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert fw_lines(err)[-1] == f"fw: error: {metrics}:{problem}; {EXPECTED}, to keep those up to its checkpoint's " \
                                "step: fix or delete the line"
    assert metrics.read_bytes() == edited
    assert sorted(p.name for p in (metrics.parent / "checkpoints").iterdir()) == ["step-000004"]


def test_a_resume_names_a_metrics_byte_that_is_not_utf8_and_keeps_the_file(resumable, capsys):
    from test_crash_safety import fw_lines

    from framework.cli import main

    argv, metrics = resumable
    edited = metrics.read_bytes().replace(b'"step": 3', b'"step": 3, "note": "\xff"', 1)
    metrics.write_bytes(edited)
    capsys.readouterr()
    assert main(argv) == 2
    assert fw_lines(capsys.readouterr().err)[-1] == (f"fw: error: {metrics}:3:22: not UTF-8 (byte 0xff); save the "
                                                     "file as UTF-8")
    assert metrics.read_bytes() == edited


def test_a_resume_drops_a_torn_last_metrics_line(resumable, capsys):
    """A run killed mid-write leaves its last line cut short, with no newline after it: the resume drops it with the
    other lines past its checkpoint, as before."""
    from test_crash_safety import fw_lines

    from framework.cli import main

    argv, metrics = resumable
    metrics.write_bytes(metrics.read_bytes() + b'{"step": 5, "loss": 0.5}\n{"step": 6, "lo')
    assert main(argv) == 0
    fw_lines(capsys.readouterr().err)   # no traceback
    assert [r["step"] for r in read_metrics(metrics)] == [1, 2, 3, 4, 5, 6]


def test_a_resume_keeps_the_metrics_lines_logged_without_a_step_before_its_checkpoint(resumable, capsys):
    """A callback's `logger.log_metrics(...)` without a step writes `"step": null` (or a hand edit leaves a line
    with no step key): the resume keeps such lines up to the first line past its checkpoint, after which the run
    logged them past the checkpoint and logs them again; a whole step such as 3.0 compares as 3."""
    argv, metrics = resumable
    lines = metrics.read_bytes().splitlines(keepends=True)
    metrics.write_bytes(b"".join([*lines[:2], b'{"step": null, "mine": 1}\n', b'{"step": 3.0, "mine": 3}\n',
                                  *lines[2:], b'{"mine": 2}\n', b'{"step": 5, "loss": 0.5}\n',
                                  b'{"step": null, "mine": 5}\n']))
    from framework.cli import main

    assert main(argv) == 0
    records = read_metrics(metrics)
    assert [r.get("step") for r in records] == [1, 2, None, 3.0, 3, 4, None, 5, 6]
    assert [r["mine"] for r in records if "mine" in r] == [1, 3, 2]
    assert records[7]["loss"] != 0.5   # step 5 is the resumed run's own


def test_resume_from_an_older_checkpoint_into_its_run_dir_is_refused(tmp_path, data):
    """A run holding step-4 and step-8: resuming step-4 there would train steps 5.. beside the other timeline's
    step-8, which `--resume last` would then pick and pruning by step would keep. Refused; nothing changes."""
    run = tmp_path / "run"
    fit(config(run, data, 1) | {"trainer": config(run, data, 1)["trainer"] | {"max_steps": 8}})
    before = sorted(p.name for p in (run / "checkpoints").iterdir())
    metrics = (run / "metrics.jsonl").read_bytes()
    assert before == ["step-000004", "step-000008"]
    with pytest.raises(FwError, match=r"--resume .*step-000004: .*checkpoints holds checkpoints past step 4 "
                                      r"\(step-000008\); a run resumed there would mix its steps"):
        fit(config(run, data, 1), resume=str(run / "checkpoints" / "step-000004"))
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == before
    assert (run / "metrics.jsonl").read_bytes() == metrics
    # into another run_dir it resumes
    trainer = fit(config(tmp_path / "branch", data, 1), resume=str(run / "checkpoints" / "step-000004"))
    assert trainer.global_step == 9


def test_resume_of_another_runs_checkpoint_into_a_used_run_dir_is_refused(tmp_path, data):
    """Run A's step-8 resumed into run B, which holds a checkpoint of its own: B's metrics would go on with A's steps
    and pruning by step would delete B's checkpoint. Into run C, which crashed before its first checkpoint, A's
    steps would follow C's metrics. Both refused; nothing of B or C changes."""
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    fit(config(a, data, 1) | {"trainer": config(a, data, 1)["trainer"] | {"max_steps": 8}})
    fit(config(b, data, 1) | {"trainer": config(b, data, 1)["trainer"] | {"max_steps": 4}})
    with pytest.raises(RuntimeError, match="simulated crash"):
        fit(config(c, data, 1, [{"class_path": "test_resume.CrashAt", "init_args": {"step": 2}}]))
    kept = {run: (sorted(p.name for p in (run / "checkpoints").glob("*")), (run / "metrics.jsonl").read_bytes())
            for run in (b, c)}
    assert kept[b][0] == ["step-000004"] and kept[c][0] == []
    theirs = a / "checkpoints" / "step-000008"
    with pytest.raises(FwError) as e:
        fit(config(b, data, 1), resume=str(theirs))
    assert str(e.value) == (f"--resume {theirs}: {theirs} is not one of {b / 'checkpoints'}, which holds checkpoints "
                            "of its own (step-000004 is the newest): a run resumed there would mix its steps with "
                            "theirs and prune them; resume into an empty run_dir, or give --resume last to continue "
                            "the run there")
    with pytest.raises(FwError, match=rf"^{c / 'metrics.jsonl'} holds the metrics of an earlier run"):
        fit(config(c, data, 1), resume=str(a))   # a run directory stands for its newest checkpoint
    for run in (b, c):
        assert (sorted(p.name for p in (run / "checkpoints").glob("*")), (run / "metrics.jsonl").read_bytes()) \
            == kept[run]


def test_a_resume_past_max_steps_is_refused_and_one_at_it_says_so(tmp_path, data, capsys):
    """A resume only trains further: a checkpoint past trainer.max_steps is refused before anything changes (its
    config.yaml would record a max_steps the run never kept); one at it trains nothing and says so."""
    run = tmp_path / "run"
    cfg = config(run, data, 1)
    fit(cfg | {"trainer": cfg["trainer"] | {"max_steps": 4}})
    written = (run / "config.yaml").read_bytes()
    capsys.readouterr()
    with pytest.raises(FwError, match=r"^--resume last: step-000004 is past trainer.max_steps \(4 > 3\); a resume "
                                      r"only trains further: set --trainer.max_steps above 4$"):
        fit(cfg | {"trainer": cfg["trainer"] | {"max_steps": 3}}, resume="last")
    assert (run / "config.yaml").read_bytes() == written
    best = tmp_path / "best"   # a copy under another name: its manifest's step counts, not its name
    shutil.copytree(run / "checkpoints" / "step-000004", best)
    with pytest.raises(FwError, match=r"^--resume .*best: best is past trainer.max_steps \(4 > 3\)"):
        fit(cfg | {"run_dir": str(tmp_path / "other"), "trainer": cfg["trainer"] | {"max_steps": 3}}, resume=str(best))
    trainer = fit(cfg | {"trainer": cfg["trainer"] | {"max_steps": 4}}, resume="last")
    assert trainer.global_step == 4
    assert ("fw: step-000004 is at trainer.max_steps (4) already: nothing to train; raise --trainer.max_steps to "
            "continue") in capsys.readouterr().err.splitlines()


def test_a_resume_whose_smaller_keep_last_deletes_kept_checkpoints_says_which_first(tmp_path, data, capsys):
    """A run kept every checkpoint (keep_last null, one a step); a resume that leaves that override out (keep_last 2)
    deletes the oldest three at its first save: a warning names them, and the command that keeps them, as the resume
    starts. A smaller keep_last that deletes nothing the run's own value keeps is not warned about."""
    run = tmp_path / "run"
    cfg = config(run, data, 1)
    every = cfg["checkpoint"] | {"every_n_steps": 1}
    fit(cfg | {"trainer": cfg["trainer"] | {"max_steps": 4}, "checkpoint": every})
    capsys.readouterr()
    fit(cfg | {"trainer": cfg["trainer"] | {"max_steps": 5}, "checkpoint": every | {"keep_last": 2}}, resume="last")
    warned = [line for line in capsys.readouterr().err.splitlines() if line.startswith("fw: warning")]
    assert warned == [(f"fw: warning: checkpoint.keep_last null -> 2: the first save of this resume deletes "
                      f"step-000001, step-000002, step-000003, which the run's setting keeps (Ctrl+C twice ends the "
                      f"resume before that save); fw fit --config {run / 'config.yaml'} --resume last resumes with the "
                      f"settings the run ran with")]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-000004", "step-000005"]

    other = tmp_path / "other"

    def at(max_steps: int, keep_last: int) -> dict:
        return cfg | {"run_dir": str(other), "trainer": cfg["trainer"] | {"max_steps": max_steps},
                      "checkpoint": every | {"keep_last": keep_last}}

    fit(at(2, 4))
    capsys.readouterr()
    fit(at(3, 3), resume="last")   # 4 -> 3 over 2 checkpoints: the first save leaves 3, deleting none
    assert "warning" not in capsys.readouterr().err
    # 3 -> 2 over 3: the run's own value deletes step 1 at the next save, the new one step 2 as well
    fit(at(4, 2), resume="last")
    assert [line for line in capsys.readouterr().err.splitlines() if line.startswith("fw: warning")] == [
        (f"fw: warning: checkpoint.keep_last 3 -> 2: the first save of this resume deletes step-000002, which the "
        f"run's setting keeps (Ctrl+C twice ends the resume before that save); fw fit --config "
        f"{other / 'config.yaml'} --resume last resumes with the settings the run ran with")]


@pytest.mark.parametrize("damage", ["corrupt", "truncated"])
def test_fw_fit_skip_damaged_resumes_past_a_damaged_newest_checkpoint(tmp_path, data, damage, capsys):
    """`fw fit --resume last` on a run whose newest checkpoint (step 8) has a flipped bit (sizes intact) or a cut
    file: named before anything loads, with the advice to skip it; `--skip-damaged` resumes step 4 and moves
    step 8 aside, so pruning (`keep_last: 1` at step 6) keeps the resumed run's own checkpoint and a later plain
    `--resume last` continues it to step 8 with the weights of the uninterrupted run."""
    from framework.cli import main
    from framework.config import dump_config

    run = tmp_path / "run"
    cfg = config(run, data, 1)
    cfg["scheduler"].update(name="constant", min_lr_ratio=0.0)   # the lr of a step does not depend on max_steps
    cfg["trainer"]["max_steps"] = 8
    train = tmp_path / "train.yaml"
    train.write_text(dump_config(cfg))
    assert main(["fit", "--config", str(train)]) == 0
    ckpts = run / "checkpoints"
    step8 = ckpts / "step-000008"
    straight = {k: v.clone() for k, v in final_weights(run, 8).items()}   # copies: the file is mapped
    weights = step8 / "policy" / "model.safetensors"
    original = weights.read_bytes()
    if damage == "corrupt":
        flipped = bytearray(original)
        flipped[len(flipped) // 2] ^= 0x01
        weights.write_bytes(bytes(flipped))
        why = f"{weights}: sha256 "
    else:
        weights.write_bytes(original[:-1])
        why = f"{weights}: size {len(original) - 1} bytes"
    damaged = weights.read_bytes()
    capsys.readouterr()

    resume = ["fit", "--config", str(train), "--resume", "last"]
    assert main(resume) == 2
    [error] = [line for line in capsys.readouterr().err.splitlines() if line.startswith("fw:")]
    assert error.startswith(f"fw: error: the newest checkpoint {step8} is damaged: {why}")
    assert error.endswith("the file is corrupt; --skip-damaged uses the newest intact older one instead")
    assert sorted(p.name for p in ckpts.iterdir()) == ["step-000004", "step-000008"]

    assert main([*resume, "--skip-damaged", "--trainer.max_steps=6", "--checkpoint.keep_last=1"]) == 0
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("fw:")]
    aside = ckpts / "step-000008.damaged"
    assert err[0].startswith(f"fw: warning: skipping damaged checkpoint {step8}: {why}")
    assert err[1] == f"fw: moved the damaged checkpoint {step8} aside to {aside}, where no --resume or pruning reads it"
    assert err[2].startswith(f"fw: resuming {ckpts / 'step-000004'} with changed settings: trainer.max_steps 8 -> 6")
    assert sorted(p.name for p in ckpts.iterdir()) == ["step-000006", "step-000008.damaged"]
    assert (aside / "policy" / "model.safetensors").read_bytes() == damaged   # kept as it was, for inspection

    assert main(resume) == 0
    assert f"fw: resuming {ckpts / 'step-000006'}" in capsys.readouterr().err
    assert sorted(p.name for p in ckpts.iterdir()) == ["step-000006", "step-000008", "step-000008.damaged"]
    resumed = final_weights(run, 8)
    assert resumed.keys() == straight.keys() and all(torch.equal(resumed[k], straight[k]) for k in straight)


def test_tokens_per_s_after_a_resume_counts_the_restored_steps_time(tmp_path, data):
    """A logging interval open at the checkpoint (steps 1-6 of 8) continues after the resume with its tokens; its
    time must continue too, or the first record after the resume divides 8 steps' tokens by 2 steps' time."""
    def run(run_dir, callbacks=()):
        cfg = config(run_dir, data, 8, callbacks)
        cfg["trainer"]["max_steps"] = 8
        cfg["checkpoint"]["every_n_steps"] = 6
        return cfg

    fit(run(tmp_path / "straight"))
    with pytest.raises(RuntimeError, match="simulated crash"):
        fit(run(tmp_path / "broken", [{"class_path": "test_resume.CrashAt", "init_args": {"step": 7}}]))
    fit(run(tmp_path / "broken"), resume="last")
    [a] = read_metrics(tmp_path / "straight" / "metrics.jsonl")
    [b] = read_metrics(tmp_path / "broken" / "metrics.jsonl")
    assert a["step"] == b["step"] == 8 and a["tokens"] == b["tokens"]
    assert b["tokens_per_s"] < 2 * a["tokens_per_s"], (a["tokens_per_s"], b["tokens_per_s"])


def test_resume_last_without_checkpoint_is_an_error(tmp_path, data):
    (tmp_path / "empty").mkdir()
    with pytest.raises(FwError, match="no complete checkpoint"):
        fit(config(tmp_path / "empty", data, 1), resume="last")


def test_resume_last_of_a_run_dir_that_does_not_exist_says_so_and_leaves_nothing(tmp_path, data, capsys):
    from test_crash_safety import fw_lines

    from framework.cli import main

    typo = tmp_path / "typo"
    (tmp_path / "train.yaml").write_text(json.dumps(config(tmp_path / "run", data, 1)))
    assert main(["fit", "--config", str(tmp_path / "train.yaml"), f"--run_dir={typo}", "--resume", "last"]) == 2
    assert fw_lines(capsys.readouterr().err) == [
        (f"fw: error: --resume last: run_dir {typo} does not exist, so it holds no checkpoint to resume; give the "
         "run_dir of the run to continue, or leave out --resume to start a new run there")]
    assert os.listdir(tmp_path) == ["train.yaml"]


def test_config_written_to_run_dir(tmp_path, data):
    cfg = config(tmp_path / "run", data, 1)
    cfg["trainer"]["max_steps"] = 1
    fit(cfg)
    from framework.config import load_config

    assert load_config([str(tmp_path / "run" / "config.yaml")], []) == cfg
    assert json.loads((tmp_path / "run" / "checkpoints" / "step-000001" / "manifest.json").read_text())


def test_fresh_run_over_existing_checkpoints_is_refused_before_writing(tmp_path, data):
    cfg = config(tmp_path / "run", data, 1)
    cfg["trainer"]["max_steps"] = 1
    fit(cfg)
    run = tmp_path / "run"
    before = {p: p.read_bytes() for p in (run / "config.yaml", run / "metrics.jsonl")}
    other = config(run, data, 1)
    other["optimizer"]["lr"] = 1e-4
    with pytest.raises(FwError, match="already holds checkpoints"):
        fit(other)
    assert {p: p.read_bytes() for p in before} == before   # the earlier run's files are untouched


# ---------------------------------------------------------------- what a resume may change


def schema_leaf_keys(nullable_sections=False):
    """Every leaf key of the schema, walked here independently of framework code; with `nullable_sections` also
    the sections that may be null (`model.policy.lora`), which a resume compares whole when one side is null."""
    schema = json.loads((Path(__file__).parents[1] / "schemas" / "train.schema.json").read_text())
    keys = []

    def walk(node, prefix):
        for key, sub in node.get("properties", {}).items():
            if "properties" in sub:
                if nullable_sections and "null" in sub.get("type", []):
                    keys.append(f"{prefix}{key}")
                walk(sub, f"{prefix}{key}.")
            else:
                keys.append(f"{prefix}{key}")

    walk(schema, "")
    return keys


def test_every_schema_key_has_a_resume_rule():
    from framework.checkpoint.resume import APPLIES, REFUSED, RESET, RESUME_RULES

    keys = schema_leaf_keys(nullable_sections=True)
    assert {"model.policy.lora", "data.task"} <= set(keys)
    unclassified = [k for k in keys if k not in RESUME_RULES]
    assert unclassified == [], f"add these keys to RESUME_RULES in framework/checkpoint/resume.py: {unclassified}"
    assert sorted(set(RESUME_RULES) - set(keys)) == []   # no rule for a key the schema does not have
    for key, (rule, why) in RESUME_RULES.items():
        assert rule in (APPLIES, RESET, REFUSED) and why, key


class RecordSettings(Callback):
    """Appends each optimizer step's (role, step, lr and weight_decay of every param group) to a JSON file."""

    def __init__(self, path: str):
        self.path = path

    def before_optimizer_step(self, trainer, module, optimizer):
        role = module.optimizer_role(optimizer)
        groups = [[g["lr"], g["weight_decay"], list(g["betas"])] for g in optimizer.param_groups]
        with open(self.path, "a") as f:
            f.write(json.dumps([role, module.policy_version + 1, groups]) + "\n")


def records(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def cosine(step, base, warmup, total, floor):
    """The lr of the optimizer step after `step` steps, written out by hand."""
    if step < warmup:
        return base * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / (total - warmup))
    return base * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


def test_resume_applies_new_lr_schedule_and_weight_decay(tmp_path, data):
    run, log = tmp_path / "run", tmp_path / "lr.jsonl"
    record = [{"class_path": "test_resume.RecordSettings", "init_args": {"path": str(log)}}]
    first = config(run, data, 1, record)
    first["trainer"]["max_steps"] = 4
    fit(first)
    old = [r for r in records(log)]
    assert [r[1] for r in old] == [1, 2, 3, 4]
    assert [r[2][0][0] for r in old] == pytest.approx([cosine(s, 3e-3, 3, 4, 0.1) for s in range(4)], rel=1e-12)

    log.unlink()
    second = config(run, data, 1, record)
    second["optimizer"].update(lr=1e-2, weight_decay=0.2, betas=[0.8, 0.99])
    second["scheduler"].update(min_lr_ratio=0.5)
    second["trainer"]["max_steps"] = 7
    trainer = fit(second, resume="last")
    assert trainer.global_step == 7
    new = records(log)
    assert [r[1] for r in new] == [5, 6, 7]
    for _, step, groups in new:
        lr = cosine(step - 1, 1e-2, 3, 7, 0.5)
        assert [g[0] for g in groups] == pytest.approx([lr, lr], rel=1e-12)
        assert [g[1] for g in groups] == [0.2, 0.0]   # matrices decay, norms' gains do not
        assert all(g[2] == [0.8, 0.99] for g in groups)
    # the run's recorded config is what ran, and the next checkpoint records it too
    from framework.config import load_config

    assert load_config([str(run / "config.yaml")])["optimizer"]["lr"] == 1e-2
    assert load_config([str(run / "checkpoints" / "step-000007" / "config.yaml")])["optimizer"]["lr"] == 1e-2


def test_a_resume_into_another_recipe_names_the_recipe_alone(tmp_path, data):
    """Every section and default of the other recipe differs too; the refusal names the one change that matters."""
    run = tmp_path / "run"
    cfg = config(run, data, 1)
    cfg["trainer"]["max_steps"] = 1
    fit(cfg)
    grpo = resolve({"recipe": "grpo", "seed": 3, "run_dir": str(tmp_path / "other"),
                    "model": {"policy": {"preset": "tiny"}}, "data": {"task": {"name": "digits"}}})
    with pytest.raises(FwError) as e:
        fit(grpo, resume=str(run))
    message = str(e.value)
    assert message.startswith(f"--resume {run / 'checkpoints' / 'step-000001'}: a resume cannot apply: recipe "
                              "changed from sft to grpo (")
    assert message.count("changed from") == 1, message


def test_values_in_resume_messages_are_written_as_in_a_config_file():
    from framework.checkpoint.resume import shown

    values = [None, True, False, 3, 1e-5, "32-true", "", "null", "a\nb", [1, "x"], {"rank": 8, "targets": None}]
    assert [shown(v) for v in values] == ["null", "true", "false", "3", "1.0e-05", "32-true", "''", "'null'",
                                          '"a\\nb"', "[1, x]", "{rank: 8, targets: null}"]


@pytest.mark.parametrize("key, value, message", [
    ("data.max_seq_len", 64, "data.max_seq_len changed from 96 to 64"),
    ("seed", 4, "seed changed from 3 to 4"),
    ("trainer.precision", "64-true", "trainer.precision changed from 32-true to 64-true"),
    ("data.shuffle", False, "data.shuffle changed from true to false"),   # as YAML writes them, not Python
])
def test_resume_refuses_a_change_it_cannot_apply(tmp_path, data, key, value, message, capsys):
    from test_crash_safety import fw_lines

    from framework.cli import main

    run = tmp_path / "run"
    cfg = config(run, data, 1)
    cfg["trainer"]["max_steps"] = 1
    fit(cfg)
    before = {p: p.read_bytes() for p in (run / "config.yaml", run / "metrics.jsonl")}
    section, _, name = key.rpartition(".")
    changed = config(run, data, 1)
    (changed[section] if section else changed)[name] = value
    with pytest.raises(FwError, match=message):
        fit(changed, resume="last")
    assert {p: p.read_bytes() for p in before} == before   # nothing written: config.yaml still what ran

    (tmp_path / "train.yaml").write_text(json.dumps({**cfg, "trainer": {**cfg["trainer"], "max_steps": 2}}))
    capsys.readouterr()
    assert main(["fit", "--config", str(tmp_path / "train.yaml"), f"--{key}={value}", "--resume", "last"]) == 2
    (error,) = [line for line in fw_lines(capsys.readouterr().err) if not line.startswith("INFO:")]
    assert message in error and error.startswith("fw: error: --resume ")


def test_turning_lora_on_or_off_at_a_resume_is_refused_at_its_key(tmp_path, data, capsys):
    """A run without LoRA holds a full model, one with LoRA adapters: a resume that sets or clears
    model.policy.lora is refused at that key before anything runs, not taken as the adapters' defaults."""
    for before, after in ((None, {}), ({"rank": 4}, None)):
        run = tmp_path / f"run-{before is None}"
        cfg = config(run, data, 1)
        cfg["trainer"]["max_steps"] = 1
        cfg["model"]["policy"]["lora"] = before
        cfg = resolve(cfg)
        fit(cfg)
        changed = resolve({**cfg, "model": {**cfg["model"], "policy": {**cfg["model"]["policy"], "lora": after}}})
        was, now = cfg["model"]["policy"]["lora"], changed["model"]["policy"]["lora"]
        assert (was is None) != (now is None)
        with pytest.raises(FwError) as e:   # at max_steps already: refused before "nothing to train" too
            fit(changed, resume="last")
        lora = ("{rank: 4, alpha: 32, dropout: 0.0, targets: [q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, "
                "down_proj]}")
        shown = ("null", lora.replace("rank: 4", "rank: 16")) if before is None else (lora, "null")
        assert str(e.value) == (
            f"--resume {run / 'checkpoints' / 'step-000001'}: a resume cannot apply: model.policy.lora changed from "
            f"{shown[0]} to {shown[1]} (the checkpoint holds a full model where it is null, LoRA adapters where set); "
            f"keep the value of {run / 'checkpoints' / 'step-000001' / 'config.yaml'} or start a new run_dir")
        assert sorted(os.listdir(run / "checkpoints")) == ["step-000001"]
        assert "nothing to train" not in capsys.readouterr().err


def test_ppo_resume_resets_the_critic_lr(tmp_path):
    from test_ppo import config as ppo_config

    run, log = tmp_path / "run", tmp_path / "lr.jsonl"
    record = [{"class_path": "test_resume.RecordSettings", "init_args": {"path": str(log)}}]
    fit(ppo_config(run, record, checkpoint={"every_n_steps": 1, "keep_last": None}))
    assert {r[0] for r in records(log)} == {"policy", "critic"}
    log.unlink()
    fit(ppo_config(run, record, ppo={"critic": {"lr": 3e-4, "weight_decay": 0.1, "max_grad_norm": None}},
                   optimizer={"lr": 2e-3}, trainer={"max_steps": 3}), resume="last")
    new = records(log)
    assert sorted(r[0] for r in new) == ["critic", "policy"]   # one rollout: one step of each
    for role, _, groups in new:
        lr, decay = (2e-3, 0.0) if role == "policy" else (3e-4, 0.1)
        assert [g[0] for g in groups] == pytest.approx([lr] * len(groups), rel=1e-12)
        assert groups[0][1] == decay


def test_resumes_add_no_checkpoint_directory_to_the_recorded_import_directories(tmp_path, data):
    """A resume reads the checkpoint's config.yaml to compare it with the new config; that adds nothing to the
    directories class_path modules import from, which the run's config.yaml records for fw eval and fw generate:
    resumes do not pile up (later pruned) checkpoint directories there."""
    from framework.config import SEARCH_PATHS_LINE

    cfg = config(tmp_path / "run", data, 1)
    cfg["trainer"]["max_steps"] = 1
    cfg["checkpoint"].update(every_n_steps=1, keep_last=1)

    def recorded() -> list[str]:
        text = (tmp_path / "run" / "config.yaml").read_text()
        return [line for line in text.splitlines() if line.startswith(SEARCH_PATHS_LINE)]

    fit(cfg)
    first = recorded()
    for steps in (2, 3):
        cfg["trainer"]["max_steps"] = steps
        fit(cfg, resume="last")
    assert recorded() == first
    assert str(tmp_path / "run" / "checkpoints") not in "".join(recorded())
