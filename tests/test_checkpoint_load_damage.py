"""A corrupt checkpoint read without hashing (`checkpoint.verify: false`): the sizes are right, so nothing finds it
before it loads, and its load fails however the corruption shows (an unparsable header, a pickle that does not
load, a tensor name that no longer matches, a config.yaml key misspelt). Every such failure is one line naming the
corrupt file by its sha256, with `--skip-damaged` where that passes over it, and `--skip-damaged` hashes to find it.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
from test_crash_safety import fw_lines

from framework.cli import main

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "recipes" / "data"
HINT = "; --skip-damaged uses the newest intact older one instead"


def _write_config(path: Path, run_dir: Path) -> str:
    """A tiny CPU SFT run of 4 steps, a checkpoint every 2 (all kept), checkpoints read without hashing."""
    cfg = {"recipe": "sft", "seed": 0, "run_dir": str(run_dir), "model": {"policy": {"preset": "tiny"}},
           "data": {"path": str(DATA / "arithmetic_chat.jsonl"), "max_seq_len": 64, "batch_size": 4},
           "trainer": {"accelerator": "cpu", "max_steps": 4, "enable_progress_bar": False},
           "checkpoint": {"every_n_steps": 2, "keep_last": None, "verify": False},
           "logging": {"csv": False, "tensorboard": False}}
    path.write_text(json.dumps(cfg))   # JSON is YAML
    return str(path)


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A finished run with checkpoints at steps 2 and 4, copied by each test that damages one."""
    base = tmp_path_factory.mktemp("trained")
    assert main(["fit", "--config", _write_config(base / "train.yaml", base / "run")]) == 0
    return base / "run"


@pytest.fixture
def run(trained, tmp_path) -> tuple[Path, str]:
    """(run directory, its config file): a copy of the trained run."""
    run_dir = tmp_path / "run"
    shutil.copytree(trained, run_dir)
    return run_dir, _write_config(tmp_path / "train.yaml", run_dir)


def _flip(file: Path, at: int) -> None:
    """Flip the case bit of byte `at` (a letter's case in a header, a name or a key): the size stays."""
    data = bytearray(file.read_bytes())
    data[at] ^= 0x20
    file.write_bytes(bytes(data))


def _at(text: bytes, offset: int = 0):
    """The damage at `offset` from the first occurrence of `text` in the file."""
    return lambda data: data.index(text) + offset


# (file, where its byte is flipped): each fails its load in another way when read unhashed
DAMAGE = {
    "safetensors header": ("policy/model.safetensors", lambda data: 12),   # the header's JSON: unparsable
    "pickled trainer state": ("trainer_state.pt", lambda data: 2),         # the zip's signature: no pickle loads
    "trainer tensor name": ("trainer_state.safetensors", _at(b"exp_avg", 2)),   # a tensor the state refers to
    "weight name": ("policy/model.safetensors", _at(b"layers.1.", 2)),     # loads; the model's restore fails
    "config key": ("config.yaml", _at(b"max_steps", 6)),                   # an unknown key in the config
}


def _damage(checkpoint: Path, kind: str) -> str:
    """Flip a byte of `checkpoint`'s file for `kind`; the problem as a sha256 check states it, from the manifest
    and the file's bytes."""
    rel, where = DAMAGE[kind]
    file = checkpoint / rel
    _flip(file, where(file.read_bytes()))
    listed = json.loads((checkpoint / "manifest.json").read_text())["files"][rel]
    assert file.stat().st_size == listed["size"]   # nothing but a hash finds it
    digest = hashlib.sha256(file.read_bytes()).hexdigest()
    return f"{file}: sha256 {digest} does not match the manifest's {listed['sha256']}: the file is corrupt"


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_fit_resume_names_a_corrupt_file_that_fails_to_load_unhashed(run, kind, capsys):
    run_dir, train = run
    step4 = run_dir / "checkpoints" / "step-000004"
    problem = _damage(step4, kind)
    capsys.readouterr()
    assert main(["fit", "--config", train, "--resume", "last", "--trainer.max_steps=6"]) == 2
    errors = [line for line in fw_lines(capsys.readouterr().err) if "error" in line]
    assert errors == [f"fw: error: the newest checkpoint {step4} is damaged: {problem}{HINT}"]
    assert sorted(p.name for p in step4.parent.iterdir()) == ["step-000002", "step-000004"]   # no step taken

    # named itself, it has no older one to turn to
    assert main(["fit", "--config", train, "--resume", str(step4), "--trainer.max_steps=6"]) == 2
    errors = [line for line in fw_lines(capsys.readouterr().err) if "error" in line]
    assert errors == [f"fw: error: --resume {step4}: the checkpoint is damaged: {problem}"]


def test_skip_damaged_hashes_checkpoints_that_are_read_unhashed(run, capsys):
    """A flipped bit in a weight loads without an error: only its hash shows it. `--skip-damaged` hashes, so it
    passes over that checkpoint, as with `checkpoint.verify: true`, rather than resume from it."""
    run_dir, train = run
    ckpts = run_dir / "checkpoints"
    weights = ckpts / "step-000004" / "policy" / "model.safetensors"
    _flip(weights, weights.stat().st_size - 3)
    capsys.readouterr()
    assert main(["fit", "--config", train, "--resume", "last", "--skip-damaged"]) == 0
    lines = fw_lines(capsys.readouterr().err)
    assert lines[0].startswith(f"fw: warning: skipping damaged checkpoint {ckpts / 'step-000004'}: {weights}: sha256 ")
    assert lines[2].startswith(f"fw: resuming {ckpts / 'step-000002'}")
    assert sorted(p.name for p in ckpts.iterdir()) == ["step-000002", "step-000004", "step-000004.damaged"]


@pytest.mark.parametrize("kind", ["safetensors header", "config key"])
def test_generate_and_eval_name_a_corrupt_file_that_fails_to_load_unhashed(run, kind, capsys):
    run_dir, _ = run
    step4 = run_dir / "checkpoints" / "step-000004"
    problem = _damage(step4, kind)
    generate = ["generate", "--prompt", "1+1=", "--greedy", "--max-new-tokens", "2"]
    assert main([*generate, "--checkpoint", str(run_dir)]) == 2
    assert capsys.readouterr() == ("", f"fw: error: the newest checkpoint {step4} is damaged: {problem}{HINT}\n")
    assert main([*generate, "--checkpoint", str(step4)]) == 2
    assert capsys.readouterr() == ("", f"fw: error: {problem}\n")
    evaluate = ["eval", "--out", str(run_dir / "eval.json"), "--eval.max_prompts=2",
                f"--eval.path={DATA / 'arithmetic_chat_heldout.jsonl'}"]
    assert main([*evaluate, "--checkpoint", str(run_dir)]) == 2
    assert capsys.readouterr() == ("", f"fw: error: the newest checkpoint {step4} is damaged: {problem}{HINT}\n")
    assert main([*evaluate, "--checkpoint", str(run_dir), "--skip-damaged"]) == 0
    assert f"fw: warning: skipping damaged checkpoint {step4}: {problem}\n" in capsys.readouterr().err


def test_skip_damaged_with_one_checkpoint_is_refused_before_anything_reads_it(run, capsys):
    """`--skip-damaged` passes over a run directory's damaged newest checkpoint; a checkpoint directory named itself
    has no other to turn to, and it was read unhashed as if the option were not there (a flipped bit in a weight:
    generate and eval ran on it, fit resumed from it). Every command refuses the option there, in one line naming
    the run directory to give instead, before anything is read or written, and `--help` says so."""
    run_dir, train = run
    step4 = run_dir / "checkpoints" / "step-000004"
    _damage(step4, "weight name")   # loads without an error; only its hash finds it
    out = run_dir.parent / "out"
    commands = {
        "--resume": ["fit", "--config", train, "--resume", str(step4), "--trainer.max_steps=6"],
        "--checkpoint": [["export", "--out", str(out), "--checkpoint", str(step4)],
                         ["generate", "--prompt", "1+1=", "--greedy", "--max-new-tokens", "2", "--checkpoint",
                          str(step4)],
                         ["eval", "--out", str(out / "eval.json"), "--eval.max_prompts=2",
                          f"--eval.path={DATA / 'arithmetic_chat_heldout.jsonl'}", "--checkpoint", str(step4)]]}
    argvs = [("--resume", commands["--resume"])] + [("--checkpoint", argv) for argv in commands["--checkpoint"]]
    capsys.readouterr()
    for option, argv in argvs:
        assert main([*argv, "--skip-damaged"]) == 2, argv[0]
        assert capsys.readouterr() == ("", (
            f"fw: error: --skip-damaged applies only to a run directory: it passes over a run directory's damaged "
            f"newest checkpoint for its newest intact one, and {option} {step4} is one checkpoint; give its run "
            f"directory {run_dir}, or leave --skip-damaged out\n")), argv[0]
    assert not out.exists()
    assert sorted(p.name for p in step4.parent.iterdir()) == ["step-000002", "step-000004"]   # nothing moved aside
    for command in ("fit", "export", "generate", "eval"):
        assert main([command, "--help"]) == 0
        assert "refused with a checkpoint directory" in " ".join(capsys.readouterr().out.split()), command
