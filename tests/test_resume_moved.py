"""A resume decides a moved path by what it holds: a project (config, data, model, run_dir) copied elsewhere
resumes there, with one stderr line per moved path; other content at the new path is refused naming the file;
a checkpoint without the record (written before it existed) accepts a move only where the old path still holds
the same content, and otherwise says how to proceed."""

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from framework.checkpoint.store import resolve_resume
from framework.cli import main
from framework.config import load_config
from framework.errors import FwError

SFT = """recipe: sft
seed: 0
run_dir: runs/sft
model: {policy: %s}
data: {path: data/chats.jsonl, max_seq_len: 64, batch_size: 2}
optimizer: {lr: 3.0e-3}
scheduler: {name: constant}
trainer: {max_steps: 2, accelerator: cpu, enable_progress_bar: false}
checkpoint: {every_n_steps: 2}
logging: {csv: false, tensorboard: false}
"""


def _project(root: Path, policy: str) -> Path:
    (root / "data").mkdir(parents=True)
    lines = Path("recipes/data/arithmetic_chat.jsonl").read_text().splitlines()[:10]
    (root / "data" / "chats.jsonl").write_text("\n".join(lines) + "\n")
    (root / "sft.yaml").write_text(SFT % policy)
    return root


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A project with relative paths, trained to its step-2 checkpoint by `fw fit`."""
    root = _project(tmp_path_factory.mktemp("moved") / "projA", "{preset: tiny}")
    assert main(["fit", "--config", str(root / "sft.yaml")]) == 0
    return root


@pytest.fixture(scope="module")
def trained_from_model(trained, tmp_path_factory):
    """A project whose policy starts from a Hugging Face model directory inside it (`model.policy.path`)."""
    from framework.export import export_checkpoint

    root = _project(tmp_path_factory.mktemp("moved_model") / "projA", "{path: model}")
    export_checkpoint(trained / "runs" / "sft", root / "model")
    assert main(["fit", "--config", str(root / "sft.yaml")]) == 0
    return root


def _copy(root: Path, to: Path) -> Path:
    shutil.copytree(root, to, symlinks=True)
    return to


def _resume(root: Path, *overrides: str) -> str | None:
    """What `fw fit --config <root>/sft.yaml --resume last` decides, before anything trains."""
    return resolve_resume("last", load_config([str(root / "sft.yaml")], list(overrides)))


def _drop_record(root: Path) -> None:
    """Make the checkpoint one written before the manifest recorded its sources."""
    manifest = root / "runs" / "sft" / "checkpoints" / "step-000002" / "manifest.json"
    data = json.loads(manifest.read_text())
    del data["sources"]
    manifest.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def test_a_moved_project_resumes_and_continues_as_in_place(trained, tmp_path, capsys):
    """The manifest records the data file's size and sha256 (as hashlib computes them); the project copied
    elsewhere resumes with one line saying data.path moved, and trains on exactly as the project resumed in
    place does (same weights at step 3)."""
    data = trained / "data" / "chats.jsonl"
    manifest = json.loads((trained / "runs" / "sft" / "checkpoints" / "step-000002" / "manifest.json").read_text())
    assert manifest["sources"] == {"data.path": {"size": data.stat().st_size,
                                                 "sha256": hashlib.sha256(data.read_bytes()).hexdigest()}}
    here = _copy(trained, tmp_path / "here")   # the original stays, for the other tests
    moved = _copy(trained, tmp_path / "projB")
    capsys.readouterr()
    assert main(["fit", "--config", str(moved / "sft.yaml"), "--trainer.max_steps=3", "--resume", "last"]) == 0
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("fw:")]
    assert err[0] == (f"fw: data.path moved from {data} to {moved / 'data' / 'chats.jsonl'}, which holds the "
                      "same content (size and sha256 of every file); resuming with it")
    assert err[1].startswith(f"fw: resuming {moved / 'runs' / 'sft' / 'checkpoints' / 'step-000002'} with changed "
                             "settings: run_dir ")
    assert err[1].endswith("trainer.max_steps 2 -> 3") and "data.path" not in err[1]
    step3 = moved / "runs" / "sft" / "checkpoints" / "step-000003"
    assert load_config([str(step3 / "config.yaml")])["data"]["path"] == str(moved / "data" / "chats.jsonl")
    # `here` resumes the checkpoint whose config names `trained`'s data: the same file, an unchanged path
    assert main(["fit", "--config", str(trained / "sft.yaml"), f"--run_dir={here / 'runs' / 'sft'}",
                 "--trainer.max_steps=3", "--resume", "last"]) == 0
    a = load_file(str(step3 / "policy" / "model.safetensors"))
    b = load_file(str(here / "runs" / "sft" / "checkpoints" / "step-000003" / "policy" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_other_content_at_the_new_path_is_refused(trained, tmp_path):
    """One byte changed (same size) in the moved data file: refused, saying the content differs."""
    moved = _copy(trained, tmp_path / "projB")
    data = moved / "data" / "chats.jsonl"
    text = data.read_text()
    data.write_text(text.replace("1", "2", 1))
    assert data.stat().st_size == len(text)
    with pytest.raises(FwError) as e:
        _resume(moved)
    message = str(e.value)
    assert "\n" not in message
    assert (f"data.path changed from {trained / 'data' / 'chats.jsonl'} to {data} (the saved data position "
            f"indexes this data; {data} differs in content from what the checkpoint recorded)") in message


def test_a_moved_model_directory_is_compared_file_by_file(trained_from_model, tmp_path, capsys):
    """model.policy.path: the directory's files (config.json, weights, tokenizer) as recorded -> accepted; one
    bit flipped in its weights -> refused naming the weights file."""
    root = trained_from_model
    manifest = json.loads((root / "runs" / "sft" / "checkpoints" / "step-000002" / "manifest.json").read_text())
    files = manifest["sources"]["model.policy.path"]["files"]
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(files)
    weights = root / "model" / "model.safetensors"
    assert files["model.safetensors"] == {"size": weights.stat().st_size,
                                          "sha256": hashlib.sha256(weights.read_bytes()).hexdigest()}
    moved = _copy(root, tmp_path / "projB")
    capsys.readouterr()
    assert _resume(moved) == str(moved / "runs" / "sft" / "checkpoints" / "step-000002")
    err = capsys.readouterr().err
    assert f"fw: model.policy.path moved from {root / 'model'} to {moved / 'model'}," in err
    assert "fw: data.path moved from" in err

    other = _copy(root, tmp_path / "projC")
    raw = bytearray((other / "model" / "model.safetensors").read_bytes())
    raw[-3] ^= 0x01
    (other / "model" / "model.safetensors").write_bytes(bytes(raw))
    with pytest.raises(FwError, match=f"{other / 'model' / 'model.safetensors'} differs in content from what "
                                      "the checkpoint recorded"):
        _resume(other)


def test_a_checkpoint_without_a_record_compares_with_the_old_path_or_says_how_to_proceed(trained, tmp_path, capsys):
    """A checkpoint written before the record: the old path still there with the same content -> accepted; the
    old path gone -> refused, saying to restore it (a symlink will do) and set the key back, which then works."""
    moved = _copy(trained, tmp_path / "projB")
    _drop_record(moved)
    capsys.readouterr()
    assert _resume(moved) == str(moved / "runs" / "sft" / "checkpoints" / "step-000002")
    assert "fw: data.path moved from" in capsys.readouterr().err

    gone, new = trained / "data" / "chats.jsonl", moved / "data" / "chats.jsonl"
    aside = tmp_path / "aside.jsonl"
    gone.rename(aside)   # the old project's data gone (put back below: the module's other tests use it)
    try:
        with pytest.raises(FwError) as e:
            _resume(moved)
        assert (f"the checkpoint records no fingerprint of what {gone} held and it is gone, so the move cannot be "
                f"checked: restore {gone} (a symlink to {new} will do) and set data.path to {gone} again"
                ) in str(e.value)
        gone.symlink_to(new)
        assert _resume(moved, f"--data.path={gone}") == str(moved / "runs" / "sft" / "checkpoints" / "step-000002")
    finally:
        gone.unlink(missing_ok=True)
        aside.rename(gone)


def test_generate_and_eval_of_a_full_checkpoint_need_no_base_model(trained, tmp_path, capsys):
    """A full fine-tune's checkpoint holds its whole policy: with its base model directory deleted, `fw generate
    --config F --checkpoint RUN` and `fw eval` still run from the checkpoint's policy/, where `fw generate --config F`
    alone, which builds from that directory, is refused at its line."""
    from framework.export import export_checkpoint

    root = _project(tmp_path / "projB", "{path: model}")
    export_checkpoint(trained / "runs" / "sft", root / "model")
    assert main(["fit", "--config", str(root / "sft.yaml")]) == 0
    shutil.rmtree(root / "model")
    config, run = str(root / "sft.yaml"), str(root / "runs" / "sft")
    capsys.readouterr()
    assert main(["generate", "--config", config, "--checkpoint", run, "--prompt", "1+1=", "--max-new-tokens", "2",
                 "--greedy"]) == 0
    assert main(["eval", "--config", config, "--checkpoint", run, f"--eval.path={root / 'data' / 'chats.jsonl'}",
                 "--eval.held_out=false", "--out", str(tmp_path / "report.json")]) == 0
    capsys.readouterr()
    assert main(["generate", "--config", config, "--prompt", "1+1=", "--max-new-tokens", "2", "--greedy"]) == 2
    assert capsys.readouterr().err == (f"{config}:4:24: model.policy.path: no such directory: {root / 'model'} "
                                       "(expected a Hugging Face Qwen3 directory with config.json and "
                                       "model.safetensors)\n")


def test_a_lora_base_rewritten_in_place_is_refused_where_a_full_models_is_not(trained, trained_from_model, tmp_path,
                                                                             capsys):
    """LoRA adapters are trained on their frozen base, which the checkpoint does not hold: that base rewritten at
    its unchanged path (one bit of its weights) is refused by a resume and by fw export --merge and fw generate,
    naming the file, and a copy of the original named with --model.policy.path still exports; its generation config
    may change (the checkpoint keeps its own). A full fine-tune's checkpoint holds its weights, so its initial model
    may change in place."""
    from framework.export import export_checkpoint

    root = _project(tmp_path / "projL", "{path: model, lora: {rank: 4}}")
    export_checkpoint(trained / "runs" / "sft", root / "model")
    original = tmp_path / "original"
    shutil.copytree(root / "model", original)
    assert main(["fit", "--config", str(root / "sft.yaml")]) == 0
    weights = root / "model" / "model.safetensors"

    def flip(path: Path) -> None:
        raw = bytearray(path.read_bytes())
        raw[-3] ^= 0x01
        path.write_bytes(bytes(raw))

    flip(weights)
    with pytest.raises(FwError) as e:
        _resume(root)
    assert (f"model.policy.path {root / 'model'} holds other content than when the checkpoint was written (the "
            f"checkpoint's LoRA adapters were trained on this frozen base model; {weights} differs in content from "
            "what the checkpoint recorded)") in str(e.value)
    run = root / "runs" / "sft"
    refusal = (f"fw: error: {run / 'checkpoints' / 'step-000002'}: the base model of its LoRA adapters, "
               f"{root / 'model'} (model.policy.path), is not the one they were trained on ({weights} differs in "
               "content from what the checkpoint recorded); put that model back there, or name a copy of it with "
               "--model.policy.path=DIR\n")
    capsys.readouterr()
    assert main(["export", "--checkpoint", str(run), "--merge", "--out", str(tmp_path / "merged")]) == 2
    assert capsys.readouterr().err.endswith(refusal)
    assert not (tmp_path / "merged").exists()
    assert main(["generate", "--checkpoint", str(run), "--prompt", "1+1=", "--max-new-tokens", "2", "--greedy"]) == 2
    assert capsys.readouterr().err.endswith(refusal)
    assert main(["export", "--checkpoint", str(run), "--merge", "--out", str(tmp_path / "merged"),
                 "--model.policy.path", str(original)]) == 0
    flip(weights)   # back to what it was
    (root / "model" / "generation_config.json").write_text('{"temperature": 0.5}\n')   # not the weights: no matter
    assert _resume(root) == str(run / "checkpoints" / "step-000002")

    full = trained_from_model / "model" / "model.safetensors"
    flip(full)
    try:
        assert _resume(trained_from_model, "--trainer.max_steps=3") == str(
            trained_from_model / "runs" / "sft" / "checkpoints" / "step-000002")
    finally:
        flip(full)   # the module's other tests use it
