"""`fw export`: a checkpoint's policy/ as an HF directory that transformers loads with the same logits."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from scripts.ckpt_writer import make_cfg, policy_checkpoint

from framework import checkpoint as ck
from framework.errors import FwError
from framework.export import export_checkpoint
from framework.models import Qwen3Config, Qwen3ForCausalLM
from framework.models.presets import PRESETS
from framework.tokenizer import Tokenizer


def _policy(tied: bool) -> Qwen3ForCausalLM:
    tok = Tokenizer.builtin()
    config = Qwen3Config(**{**PRESETS["tiny"], "vocab_size": tok.vocab_size, "tie_word_embeddings": tied,
                            "eos_token_id": tok.eos_id, "pad_token_id": tok.pad_id})
    model = Qwen3ForCausalLM(config)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():  # weights large enough that logits spread over several units
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.2 * noise if name.endswith("norm.weight") else 0.25 * noise)
    return model.eval()


def _write(run_dir, model: Qwen3ForCausalLM, step: int = 3) -> str:
    """A checkpoint as FwModule hands it over (DESIGN.md "Checkpoints"), tokenizer files included."""
    checkpoint = policy_checkpoint(model, Tokenizer.builtin(), step, run_dir.parent / "tok")
    path = ck.checkpoints_dir(run_dir) / ck.step_dir_name(step)
    ck.AtomicCheckpointIO(make_cfg(str(run_dir))).save_checkpoint(checkpoint, path)
    return str(path)


@pytest.mark.parametrize("tied", [True, False])
def test_export_loads_in_transformers_with_same_logits(tmp_path, tied):
    model = _policy(tied)
    ckpt = _write(tmp_path / "run", model)
    out = tmp_path / "export"
    assert export_checkpoint(ckpt, out) == str(out)
    assert sorted(os.listdir(out)) == ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                                       "tokenizer_config.json"]
    assert [n for n in os.listdir(tmp_path) if n.startswith(".")] == []  # staging published, nothing left

    hf, info = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32,
                                                                 output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    assert type(hf).__name__ == "Qwen3ForCausalLM" and hf.config.tie_word_embeddings is tied
    ids = torch.randint(0, model.config.vocab_size, (2, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf.eval()(input_ids=ids).logits
        got = model(ids)
    assert ref.std() > 1.0
    assert (got - ref).abs().max().item() <= 1e-4

    hf_tok = transformers.AutoTokenizer.from_pretrained(str(out))
    text = "<|im_start|>user\n12+30=?<|im_end|>\n"
    assert hf_tok.encode(text, add_special_tokens=False) == Tokenizer.builtin().encode(text)


def test_export_of_a_run_dir_takes_its_newest_checkpoint(tmp_path, capsys):
    run_dir = tmp_path / "run"
    _write(run_dir, _policy(True), step=3)
    newest = _policy(False)
    _write(run_dir, newest, step=8)
    out = export_checkpoint(run_dir, tmp_path / "export")
    assert capsys.readouterr().err == (f"fw: exported {ck.checkpoints_dir(run_dir) / ck.step_dir_name(8)}, the newest "
                                       f"checkpoint of {run_dir}\n")   # which one, where the run dir does not say
    export_checkpoint(ck.checkpoints_dir(run_dir) / ck.step_dir_name(3), tmp_path / "named")
    assert capsys.readouterr().err == ""   # named itself
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert hf.config.tie_word_embeddings is False  # step 8's model, not step 3's


def test_export_refuses_bad_input(tmp_path):
    ckpt = _write(tmp_path / "run", _policy(True))
    weights = Path(ckpt) / "policy" / "model.safetensors"

    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("user data")
    with pytest.raises(FwError, match="already exists and is not an empty directory"):
        export_checkpoint(ckpt, busy)
    assert os.listdir(busy) == ["keep.txt"]

    with pytest.raises(FwError, match="no such directory"):
        export_checkpoint(tmp_path / "nope", tmp_path / "out")
    with pytest.raises(FwError, match="not a checkpoint"):
        export_checkpoint(busy, tmp_path / "out")

    # a file, a folder inside the checkpoint, the run's checkpoints/ folder: each said as what it is
    run = tmp_path / "run"
    in_run = (f"the checkpoints/ folder of run directory {run}; give the run directory (for its newest checkpoint) "
              "or one of the checkpoints in it")
    for given, said in [(weights, "a file; expected a checkpoint directory or a run directory"),
                        (weights.parent, f"a folder inside checkpoint {ckpt}; give the checkpoint itself"),
                        (run / "checkpoints", in_run)]:
        with pytest.raises(FwError) as e:
            export_checkpoint(given, tmp_path / "out")
        assert str(e.value) == f"--checkpoint {given}: {said}"

    # the run directory of a fit that stopped before its first checkpoint
    failed = tmp_path / "failed"
    failed.mkdir()
    (failed / ".lock").touch()
    with pytest.raises(FwError) as e:
        export_checkpoint(failed, tmp_path / "out")
    assert str(e.value) == f"--checkpoint {failed}: a run directory whose run has saved no checkpoint (no checkpoints/)"

    data = bytearray(weights.read_bytes())
    data[-3] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(FwError, match=str(weights)):
        export_checkpoint(ckpt, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_export_into_a_link_to_an_empty_directory_fills_the_target(tmp_path):
    ckpt = _write(tmp_path / "run", _policy(True))
    target = tmp_path / "models" / "target"
    target.mkdir(parents=True)
    link = tmp_path / "link"
    link.symlink_to(target)
    out = export_checkpoint(ckpt, link)
    assert Path(out) == target and link.is_symlink() and link.resolve() == target
    assert "config.json" in os.listdir(target)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "models", "run", "tok"]   # no staging left


def test_export_refuses_the_working_directory(tmp_path, monkeypatch):
    ckpt = _write(tmp_path / "run", _policy(True))
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    with pytest.raises(FwError, match=r"^--out \.: the working directory \(or one above it\)"):
        export_checkpoint(ckpt, ".")
    assert os.listdir(here) == [] and here.is_dir()


def test_export_leaves_what_another_process_wrote_during_it(tmp_path, monkeypatch):
    """The emptiness check runs before the copy; a file that lands in --out meanwhile (a second export, say) is
    kept, and the export says so instead of deleting it."""
    from framework import export

    ckpt = _write(tmp_path / "run", _policy(True))
    out = tmp_path / "out"
    out.mkdir()
    copy = export._copy_checked

    def copy_then_another_writer(*args):
        copy(*args)
        (out / "precious.txt").write_text("another writer's file")

    monkeypatch.setattr(export, "_copy_checked", copy_then_another_writer)
    with pytest.raises(FwError, match="another process wrote into it during the export; it is left as it was"):
        export_checkpoint(ckpt, out)
    assert os.listdir(out) == ["precious.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "run", "tok"]   # the staging copy is gone


def test_fw_export_command(tmp_path, capsys):
    from framework.cli import main

    ckpt = _write(tmp_path / "run", _policy(True))
    assert main(["export", "--checkpoint", ckpt, "--out", str(tmp_path / "hf")]) == 0
    assert "hf" in capsys.readouterr().out
    exported, saved = tmp_path / "hf" / "model.safetensors", Path(ckpt) / "policy" / "model.safetensors"
    assert exported.read_bytes() == saved.read_bytes()
    assert main(["export", "--checkpoint", ckpt, "--out", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert "already exists and is not an empty directory" in err and "Traceback" not in err


def test_export_under_a_file_is_one_line(tmp_path, capsys):
    """--out below a file (a typo'd parent): one line naming the file, exit 2, nothing left beside it."""
    from framework.cli import main

    ckpt = _write(tmp_path / "run", _policy(True))
    (tmp_path / "f").write_text("x")
    for out in (tmp_path / "f" / "hf", tmp_path / "f" / "sub" / "hf"):
        assert main(["export", "--checkpoint", ckpt, "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert err == f"fw: error: --out {out}: cannot create its folder: {tmp_path / 'f'} is a file\n"
    assert (tmp_path / "f").read_text() == "x" and not [p for p in os.listdir(tmp_path) if p.startswith(".")]


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc")
def test_export_where_no_folder_can_be_made_is_one_line_naming_out(tmp_path, capsys):
    """--out under /proc, where no directory can be created (ENOENT), or below a missing one there."""
    from framework.cli import main

    ckpt = _write(tmp_path / "run", _policy(True))
    for out in ("/proc/fw-export", "/proc/fw-export/hf"):
        assert main(["export", "--checkpoint", ckpt, "--out", out]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"fw: error: --out {out}: No such file or directory (/proc/") and err.count("\n") == 1
        assert err.endswith("; nothing was exported there: choose a directory this user can write\n")


def test_export_of_a_run_dir_with_a_damaged_newest_checkpoint(tmp_path, capsys):
    from framework.cli import main

    run_dir = tmp_path / "run"
    _write(run_dir, _policy(True), step=3)
    newest = Path(_write(run_dir, _policy(False), step=8))
    weights = newest / "policy" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0x10   # same size: only the sha256 finds it
    weights.write_bytes(bytes(data))

    assert main(["export", "--checkpoint", str(run_dir), "--out", str(tmp_path / "a")]) == 2
    err = capsys.readouterr().err   # found while copying, and refused as a missing file is, with the way past it
    assert err.startswith(f"fw: error: the newest checkpoint {newest} is damaged: {weights}: sha256 ")
    assert err.endswith("the file is corrupt; --skip-damaged uses the newest intact older one instead\n")
    assert err.count("\n") == 1
    assert not (tmp_path / "a").exists() and [n for n in os.listdir(tmp_path) if n.startswith(".")] == []

    assert main(["export", "--checkpoint", str(run_dir), "--out", str(tmp_path / "b"), "--skip-damaged"]) == 0
    err = capsys.readouterr().err
    assert err.startswith(f"fw: warning: skipping damaged checkpoint {newest}: {weights}: sha256 ")
    assert err.endswith(f"fw: exported {newest.parent / 'step-000003'}, the newest intact checkpoint of {run_dir}\n")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "b"), dtype=torch.float32)
    assert hf.config.tie_word_embeddings is True   # step 3's model


def test_export_refuses_an_out_inside_checkpoints(tmp_path, capsys):
    """An export inside a checkpoint is deleted with it by a prune and lies beside the files its manifest lists; a
    step-* folder in checkpoints/ passes for the run's damaged newest checkpoint: both are refused, nothing written."""
    import shutil

    from framework.cli import main

    run_dir = tmp_path / "run"
    step3 = Path(_write(run_dir, _policy(True), step=3))
    ckpts = ck.checkpoints_dir(run_dir)
    copy = tmp_path / "copy"
    shutil.copytree(step3, copy)   # a checkpoint outside any run
    beside = f"give a directory outside {ckpts}, such as {run_dir / 'export'}"
    cases = {
        step3 / "exported": f"inside checkpoint {step3}, which a prune deletes whole; {beside}",
        ckpts / "step-000009": (f"inside the checkpoints/ folder of run directory {run_dir}, where fw reads step-* "
                                f"folders as checkpoints; {beside}"),
        ckpts: (f"the checkpoints/ folder of run directory {run_dir}, where fw reads step-* folders as checkpoints; "
                f"{beside}"),
        copy / "policy" / "out": (f"inside checkpoint {copy}, whose files are those its manifest lists; give a "
                                  "directory outside it"),
    }
    for out, why in cases.items():
        assert main(["export", "--checkpoint", str(run_dir), "--out", str(out)]) == 2
        assert capsys.readouterr().err == f"fw: error: --out {out}: {why}\n"
    assert os.listdir(ckpts) == ["step-000003"] and sorted(os.listdir(step3)) == sorted(os.listdir(copy))
    assert sorted(os.listdir(copy / "policy")) == sorted(os.listdir(step3 / "policy"))
    ck.verify_checkpoint(step3)
    assert main(["export", "--checkpoint", str(run_dir), "--out", str(run_dir / "export")]) == 0


def _write_cfg(run_dir, model: Qwen3ForCausalLM, cfg: dict, step: int = 3) -> str:
    checkpoint = policy_checkpoint(model, Tokenizer.builtin(), step, run_dir.parent / "tok")
    path = ck.checkpoints_dir(run_dir) / ck.step_dir_name(step)
    ck.AtomicCheckpointIO(cfg).save_checkpoint(checkpoint, path)
    return str(path)


def test_export_writes_a_generation_config_with_which_generate_stops_at_im_end(tmp_path):
    """config.json's eos is <|endoftext|>; transformers' generate must still stop at the chat turn's end."""
    from test_save_pretrained import bigram_model, generated

    tok = Tokenizer.builtin()
    im_end, endoftext = tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")
    model, a = bigram_model(tok)
    out = export_checkpoint(_write(tmp_path / "run", model), tmp_path / "export")
    gen = transformers.GenerationConfig.from_pretrained(out)
    assert sorted(gen.eos_token_id) == sorted([im_end, endoftext]) and gen.pad_token_id == tok.pad_id
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "hi"}]))
    assert generated(Path(out), prompt, eos_token_id=endoftext) == [a, im_end] * 4
    assert generated(Path(out), prompt) == [a, im_end]


def test_export_carries_the_generation_config_of_the_model_the_run_started_from(tmp_path):
    from framework.config import resolve
    from framework.models import save_pretrained

    base = tmp_path / "Qwen3-tiny"
    model = _policy(False)
    save_pretrained(model, base)
    Tokenizer.builtin().save_pretrained(base)
    qwen3 = transformers.GenerationConfig(bos_token_id=151643, eos_token_id=[151645, 151643], pad_token_id=151643,
                                          do_sample=True, temperature=0.6, top_k=20, top_p=0.95)
    qwen3.save_pretrained(str(base))
    run_dir = tmp_path / "run"
    cfg = resolve({"recipe": "sft", "run_dir": str(run_dir), "model": {"policy": {"path": str(base)}}})
    out = export_checkpoint(_write_cfg(run_dir, model, cfg), tmp_path / "export")
    assert (Path(out) / "generation_config.json").read_bytes() == (base / "generation_config.json").read_bytes()
    gen = transformers.GenerationConfig.from_pretrained(out)
    assert (gen.do_sample, gen.temperature, gen.top_k, gen.top_p) == (True, 0.6, 20, 0.95)

    (base / "generation_config.json").unlink()   # a source without one: made from config.json and the tokenizer
    out = export_checkpoint(_write_cfg(tmp_path / "run2", model, cfg), tmp_path / "export2")
    tok = Tokenizer.builtin()
    assert json.loads((Path(out) / "generation_config.json").read_text()) == {
        "eos_token_id": tok.eos_id, "pad_token_id": tok.pad_id}


def save_lora_checkpoint(cfg: dict, policy, tok, base: Path) -> Path:
    """The step-3 checkpoint of a LoRA run of `cfg` on `base`, with `policy`'s adapters, as FwModule hands it over."""
    from framework.models.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, adapter_config, peft_targets

    files = {**tok.files(), ADAPTER_CONFIG: json.dumps(adapter_config(policy, str(base))).encode()}
    adapters = {name: t.detach().clone() for name, (t, _, _) in peft_targets(policy).items()}
    checkpoint = {"global_step": 3, "policy_version": 3, "state_dict": {},
                  "fw_components": {"policy": {"config": None, "weights_file": ADAPTER_WEIGHTS,
                                               "state_dict": adapters, "files": files}}}
    path = ck.checkpoints_dir(cfg["run_dir"]) / ck.step_dir_name(3)
    ck.AtomicCheckpointIO(cfg).save_checkpoint(checkpoint, path)
    return path


def test_a_merged_export_carries_the_generation_config_of_its_base(tmp_path):
    from framework.config import resolve
    from framework.models import build_policy, save_pretrained

    tok = Tokenizer.builtin()
    base = tmp_path / "base"
    save_pretrained(_policy(False), base)
    tok.save_pretrained(base)
    transformers.GenerationConfig(eos_token_id=[151645, 151643], do_sample=True, temperature=0.7,
                                  top_k=20, top_p=0.8).save_pretrained(str(base))
    cfg = resolve({"recipe": "sft", "run_dir": str(tmp_path / "run"),
                   "model": {"policy": {"path": str(base), "lora": {"rank": 4}}}})
    policy = build_policy(cfg["model"]["policy"], tok, seed=cfg["seed"])
    path = save_lora_checkpoint(cfg, policy, tok, base)
    original = (base / "generation_config.json").read_bytes()
    # the base's changes after the run started: the merged model has the one the run started from
    transformers.GenerationConfig(eos_token_id=151643, temperature=1.5, do_sample=True).save_pretrained(str(base))

    out = Path(export_checkpoint(path, tmp_path / "merged", merge=True))
    assert sorted(os.listdir(out)) == ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                                       "tokenizer_config.json"]
    assert (out / "generation_config.json").read_bytes() == original
    assert transformers.GenerationConfig.from_pretrained(str(out)).temperature == 0.7


# ---------------------------------------------------------------- the source model's generation_config.json

ROOT = Path(__file__).resolve().parent.parent
QWEN3_GENERATION = {"bos_token_id": 151643, "eos_token_id": [151645, 151643], "pad_token_id": 151643,
                    "do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.95}


def _hf_base(path: Path, **generation) -> bytes:
    """An HF model directory (the tiny preset, the built-in tokenizer) with the generation_config.json that
    transformers writes for `generation`; returns that file's bytes."""
    from framework.models import save_pretrained

    save_pretrained(_policy(False), path)
    Tokenizer.builtin().save_pretrained(path)
    transformers.GenerationConfig(**generation).save_pretrained(str(path))
    return (path / "generation_config.json").read_bytes()


def _sft_from(base: Path, run_dir: Path, max_steps: int) -> dict:
    from framework.config import resolve

    return resolve({
        "recipe": "sft", "seed": 1, "run_dir": str(run_dir), "model": {"policy": {"path": str(base)}},
        "data": {"path": str(ROOT / "recipes" / "data" / "arithmetic_chat.jsonl"), "max_seq_len": 64,
                 "batch_size": 2},
        "trainer": {"accelerator": "cpu", "max_steps": max_steps, "enable_progress_bar": False},
        "checkpoint": {"every_n_steps": 2, "keep_last": None},
        "logging": {"csv": False, "tensorboard": False}})


def test_a_run_from_a_checkpoints_policy_keeps_the_source_generation_config(tmp_path):
    """A checkpoint's policy/ is a whole HF directory: a next run started from it (and an export of that run,
    and transformers) reads the generation_config.json of the model the first run started from."""
    from framework.trainer import fit

    base = tmp_path / "Qwen3-tiny"
    original = _hf_base(base, **QWEN3_GENERATION)
    fit(_sft_from(base, tmp_path / "first", 2))
    policy = ck.checkpoints_dir(tmp_path / "first") / "step-000002" / "policy"
    assert (policy / "generation_config.json").read_bytes() == original
    ck.verify_checkpoint(policy.parent, ["policy/generation_config.json"])
    fit(_sft_from(policy, tmp_path / "second", 2))
    export_checkpoint(ck.checkpoints_dir(tmp_path / "second") / "step-000002", tmp_path / "out")
    assert (tmp_path / "out" / "generation_config.json").read_bytes() == original
    gen = transformers.GenerationConfig.from_pretrained(str(policy))
    assert gen.eos_token_id == [151645, 151643]


def test_a_run_keeps_the_generation_config_it_started_from(tmp_path):
    """fw fit from an HF directory; its generation_config.json then changes (a resumed run keeps the original
    all the same) and the directory goes: every checkpoint of the run exports the original, byte for byte. A
    checkpoint written without the copy (as before checkpoints kept one) exports what the directory holds."""
    import shutil

    from framework.trainer import fit

    base = tmp_path / "Qwen3-tiny"
    original = _hf_base(base, **QWEN3_GENERATION)
    run_dir = tmp_path / "run"
    cfg = _sft_from(base, run_dir, 2)
    fit(cfg)
    first = ck.checkpoints_dir(run_dir) / "step-000002"
    assert (first / "generation_config.json").read_bytes() == original
    assert "generation_config.json" in ck.read_manifest(first)["files"]
    ck.verify_checkpoint(first, ["generation_config.json"])   # its sha256 is the manifest's

    changed = _hf_base(base, eos_token_id=151643, do_sample=True, temperature=1.5)
    fit(_sft_from(base, run_dir, 4), resume="last")
    second = ck.checkpoints_dir(run_dir) / "step-000004"
    assert (second / "generation_config.json").read_bytes() == original

    # as the writer wrote it before: the same checkpoint without the copy
    from framework.checkpoint.directory import SOURCE_GENERATION_CONFIG

    old = ck.read_checkpoint_dir(first)
    old.pop(SOURCE_GENERATION_CONFIG)
    assert old["fw_components"]["policy"]["files"].pop("generation_config.json") == original   # policy/'s copy
    ck.write_checkpoint_dir(old, tmp_path / "old" / "step-000002", cfg)
    assert not (tmp_path / "old" / "step-000002" / "generation_config.json").exists()
    export_checkpoint(tmp_path / "old" / "step-000002", tmp_path / "from-old")
    assert (tmp_path / "from-old" / "generation_config.json").read_bytes() == changed

    shutil.rmtree(base)
    for ckpt, out in ((first, tmp_path / "a"), (second, tmp_path / "b")):
        export_checkpoint(ckpt, out)
        assert (out / "generation_config.json").read_bytes() == original
    gen = transformers.GenerationConfig.from_pretrained(str(tmp_path / "b"))
    assert (gen.do_sample, gen.temperature, gen.top_k, gen.top_p, gen.eos_token_id) == (
        True, 0.6, 20, 0.95, [151645, 151643])


def test_export_reads_config_yaml_as_fw_does(tmp_path, monkeypatch):
    """A checkpoint without the source's copy, whose config.yaml gives model.policy.path relative to the
    checkpoint (as `load_config`, and so fw generate, fw eval and --merge, read it): export finds the model
    directory there, not under the working directory."""
    from framework.config import load_config

    base = tmp_path / "models" / "Qwen3-tiny"
    original = _hf_base(base, **QWEN3_GENERATION)
    ckpt = ck.checkpoints_dir(tmp_path / "run") / ck.step_dir_name(3)
    cfg = _sft_from(base, tmp_path / "run", 3)
    cfg["model"]["policy"]["path"] = os.path.relpath(base, ckpt)
    ck.write_checkpoint_dir(policy_checkpoint(_policy(False), Tokenizer.builtin(), 3, tmp_path / "tok"), ckpt, cfg)
    assert "path: ../../../models/Qwen3-tiny\n" in (ckpt / "config.yaml").read_text()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert load_config([str(ckpt / "config.yaml")])["model"]["policy"]["path"] == str(base)

    out = Path(export_checkpoint(ckpt, tmp_path / "export"))
    assert (out / "generation_config.json").read_bytes() == original


def _lora_run(tmp_path: Path) -> tuple[Path, Path]:
    """(base model directory, step-2 checkpoint) of a 2-step LoRA SFT run on an HF base directory."""
    from framework.trainer import fit

    base = tmp_path / "base"
    _hf_base(base, eos_token_id=[151645, 151643])
    cfg = _sft_from(base, tmp_path / "run", 2)
    cfg["model"]["policy"]["lora"] = {"rank": 4, "alpha": 8, "dropout": 0.0, "targets": ["q_proj", "v_proj"]}
    fit(cfg)
    return base, ck.checkpoints_dir(tmp_path / "run") / ck.step_dir_name(2)


def test_a_lora_checkpoint_whose_base_is_gone_says_which_key_and_where(tmp_path, capsys):
    """fw export --merge, fw generate and fw eval of a LoRA checkpoint whose base directory moved away: one line
    naming the checkpoint, model.policy.path and the missing directory; fw generate then reads the base from
    --model.policy.path at its new place, the same completion as before the move, and it and fw eval say the move
    in one line each."""
    from framework.cli import main

    base, ckpt = _lora_run(tmp_path)
    held = ROOT / "recipes" / "data" / "arithmetic_chat_heldout.jsonl"
    generate = ["generate", "--checkpoint", str(ckpt), "--prompt", "1+1=", "--greedy", "--max-new-tokens", "6"]
    assert main(generate) == 0
    before = capsys.readouterr().out
    moved = tmp_path / "moved"
    base.rename(moved)
    assert main(["export", "--checkpoint", str(ckpt), "--out", str(tmp_path / "merged"), "--merge"]) == 2
    assert main(generate) == 2
    assert main(["eval", "--checkpoint", str(ckpt), f"--eval.path={held}"]) == 2
    line = (f"fw: error: {ckpt}: the base model of its LoRA adapters, model.policy.path of its config.yaml, is "
            f"{base}: no such directory; put that model back there (fw generate, fw eval and fw export --merge also "
            "take --model.policy.path=DIR of a copy, checked against the checkpoint's record of its files)")
    assert capsys.readouterr().err.splitlines() == [line] * 3
    assert not (tmp_path / "merged").exists()
    assert main([*generate, f"--model.policy.path={moved}"]) == 0
    said = (f"fw: model.policy.path moved from {base} to {moved}, which holds the same content (size and sha256 of "
            "every file); {}")
    assert capsys.readouterr() == (before, said.format("generating with it") + "\n")
    assert main(["eval", "--checkpoint", str(ckpt), f"--eval.path={held}", f"--model.policy.path={moved}",
                 "--out", str(tmp_path / "report.json")]) == 0
    err = capsys.readouterr().err.splitlines()
    assert [line for line in err if "moved" in line] == [said.format("evaluating with it")]


def _tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v for f in sorted(model_dir.glob("*.safetensors")) for k, v in load_file(str(f)).items()}


def test_export_reads_a_moved_lora_base_from_model_policy_path(tmp_path, capsys):
    """fw export of a LoRA checkpoint whose base directory moved: --merge is refused in one line, and with
    --model.policy.path at the new place merges the same weights as before the move (saying the move in one line);
    the adapter export names the
    new place in adapter_config.json, from which PEFT loads the base. A checkpoint without the source model's
    generation_config.json takes the one the moved base holds."""
    from framework.checkpoint.directory import SOURCE_GENERATION_CONFIG
    from framework.cli import main
    from framework.config import load_config

    base, ckpt = _lora_run(tmp_path)
    # as the writer wrote it before: the same checkpoint without the copy of the base's generation_config.json
    old = tmp_path / "old" / ck.step_dir_name(2)
    was = ck.read_checkpoint_dir(ckpt)
    assert was.pop(SOURCE_GENERATION_CONFIG) is not None
    was["fw_components"]["policy"]["weights_file"] = "adapter_model.safetensors"   # no config.json to say so
    ck.write_checkpoint_dir(was, old, load_config([str(ckpt / "config.yaml")], imports=()),
                            sources=ck.read_manifest(ckpt)["sources"])
    assert not (old / "generation_config.json").exists()
    assert main(["export", "--checkpoint", str(ckpt), "--out", str(tmp_path / "before"), "--merge"]) == 0
    assert main(["export", "--checkpoint", str(ckpt), "--out", str(tmp_path / "adapters-before")]) == 0
    before = _tensors(tmp_path / "before")
    adapters = json.loads((tmp_path / "adapters-before" / "adapter_config.json").read_text())
    assert adapters["base_model_name_or_path"] == str(base)

    moved = tmp_path / "moved"
    base.rename(moved)
    capsys.readouterr()
    assert main(["export", "--checkpoint", str(ckpt), "--out", str(tmp_path / "merged"), "--merge"]) == 2
    assert capsys.readouterr().err == (
        f"fw: error: {ckpt}: the base model of its LoRA adapters, model.policy.path of its config.yaml, is {base}: no "
        "such directory; put that model back there (fw generate, fw eval and fw export --merge also take "
        "--model.policy.path=DIR of a copy, checked against the checkpoint's record of its files)\n")
    assert not (tmp_path / "merged").exists()

    merged = tmp_path / "merged"
    assert main(["export", "--checkpoint", str(ckpt), "--out", str(merged), "--merge",
                 "--model.policy.path", str(moved)]) == 0
    assert capsys.readouterr().err == (f"fw: model.policy.path moved from {base} to {moved}, which holds the same "
                                       "content (size and sha256 of every file); exporting with it\n")
    after = _tensors(merged)
    assert sorted(after) == sorted(before)
    assert all(torch.equal(after[k], before[k]) for k in before)
    assert sorted(os.listdir(merged)) == sorted(os.listdir(tmp_path / "before"))
    for name in os.listdir(merged):
        assert (merged / name).read_bytes() == (tmp_path / "before" / name).read_bytes(), name

    assert main(["export", "--checkpoint", str(ckpt), "--out", str(tmp_path / "adapters"),
                 f"--model.policy.path={moved}"]) == 0
    assert json.loads((tmp_path / "adapters" / "adapter_config.json").read_text()) == {
        **adapters, "base_model_name_or_path": str(moved)}
    assert sorted(os.listdir(tmp_path / "adapters")) == sorted(os.listdir(tmp_path / "adapters-before"))
    for name in set(os.listdir(tmp_path / "adapters")) - {"adapter_config.json"}:
        assert (tmp_path / "adapters" / name).read_bytes() == (tmp_path / "adapters-before" / name).read_bytes()

    # without the checkpoint's copy: the generation_config.json of the base where it is now
    (moved / "generation_config.json").write_text(json.dumps({"eos_token_id": 151643}))
    assert main(["export", "--checkpoint", str(old), "--out", str(tmp_path / "from-old"), "--merge",
                 "--model.policy.path", str(moved)]) == 2   # an edited base is another model
    (moved / "generation_config.json").write_bytes((ckpt / "generation_config.json").read_bytes())
    assert main(["export", "--checkpoint", str(old), "--out", str(tmp_path / "from-old"), "--merge",
                 "--model.policy.path", str(moved)]) == 0
    assert (tmp_path / "from-old" / "generation_config.json").read_bytes() == (
        moved / "generation_config.json").read_bytes()
    assert all(torch.equal(t, before[k]) for k, t in _tensors(tmp_path / "from-old").items())


def test_export_refuses_a_model_policy_path_that_is_not_the_checkpoints_base(tmp_path, capsys):
    """--model.policy.path names the checkpoint's base at another place: a directory of other files, a missing
    one, a full-model checkpoint (no base) or a LoRA checkpoint on a preset is refused in one line, nothing
    written."""
    import shutil

    from framework.cli import main
    from framework.config import resolve
    from framework.models import build_policy

    base, ckpt = _lora_run(tmp_path)
    other = tmp_path / "other"
    shutil.copytree(base, other)
    (other / "generation_config.json").write_text(json.dumps({"eos_token_id": 151643}))
    extra = tmp_path / "extra"
    shutil.copytree(base, extra)
    (extra / "README.md").write_text("a copy\n")
    full = tmp_path / "full" / "step-000003"
    ck.write_checkpoint_dir(policy_checkpoint(_policy(False), Tokenizer.builtin(), 3, tmp_path / "tok"), full,
                            _sft_from(base, tmp_path / "full", 3))
    tok = Tokenizer.builtin()
    cfg = resolve({"recipe": "sft", "run_dir": str(tmp_path / "preset"),
                   "model": {"policy": {"preset": "tiny", "lora": {"rank": 4}}}})
    preset = save_lora_checkpoint(cfg, build_policy(cfg["model"]["policy"], tok, seed=cfg["seed"]), tok, None)
    afile = tmp_path / "afile"
    afile.write_text("not a model\n")
    out = tmp_path / "out"
    capsys.readouterr()
    for checkpoint, dir_, merge in ((ckpt, other, ["--merge"]), (ckpt, extra, []), (ckpt, tmp_path / "gone", []),
                                    (ckpt, afile, []), (full, base, []), (preset, base, ["--merge"])):
        assert main(["export", "--checkpoint", str(checkpoint), "--out", str(out), *merge,
                     "--model.policy.path", str(dir_)]) == 2
    assert not out.exists()
    lines = capsys.readouterr().err.splitlines()
    assert lines == [
        (f"fw: error: --model.policy.path {other}: not the base model of the LoRA adapters of {ckpt}, {base} "
         f"({other / 'generation_config.json'} differs in content from what the checkpoint recorded); give the "
         "directory that model was moved or copied to"),
        (f"fw: error: --model.policy.path {extra}: not the base model of the LoRA adapters of {ckpt}, {base} "
         f"({extra} holds other files (README.md) from what the checkpoint recorded); give the directory that model "
         "was moved or copied to"),
        (f"fw: error: --model.policy.path {tmp_path / 'gone'}: no such directory; give the directory that the base "
         f"model of {ckpt} ({base}) was moved or copied to"),
        (f"fw: error: --model.policy.path {afile}: not a directory; give the directory that the base model of {ckpt} "
         f"({base}) was moved or copied to"),
        (f"fw: error: --model.policy.path {base}: {full} holds a full model, not LoRA adapters (no "
         "policy/adapter_config.json), so it has no base model to name; leave --model.policy.path out"),
        (f"fw: error: --model.policy.path {base}: the LoRA adapters of {preset} are on the preset tiny "
         "(model.policy.preset of its config.yaml), built from its seed, not on a model directory; leave "
         "--model.policy.path out")]


def test_export_of_a_checkpoint_without_a_record_of_its_gone_base_says_the_move_cannot_be_checked(tmp_path, capsys):
    """A LoRA checkpoint written before checkpoints recorded their base model's files, whose base has moved away:
    --model.policy.path is refused in one line saying that the move cannot be checked (not that the directory holds
    another model) and how to export it; with the base back at its place (a symlink) the export needs no option."""
    from framework.cli import main
    from framework.config import load_config

    base, ckpt = _lora_run(tmp_path)
    old = tmp_path / "old" / ck.step_dir_name(2)
    was = ck.read_checkpoint_dir(ckpt)
    was["fw_components"]["policy"]["weights_file"] = "adapter_model.safetensors"   # no config.json to say so
    ck.write_checkpoint_dir(was, old, load_config([str(ckpt / "config.yaml")], imports=()), sources={})
    assert not ck.read_manifest(old)["sources"]
    moved = tmp_path / "moved"
    base.rename(moved)
    capsys.readouterr()
    for merge in (["--merge"], []):
        assert main(["export", "--checkpoint", str(old), "--out", str(tmp_path / "out"), *merge,
                     "--model.policy.path", str(moved)]) == 2
    line = (f"fw: error: --model.policy.path {moved}: {old} was written without a record of its base model's files, "
            f"and {base} is gone, so the move cannot be checked; put the base model back at {base} (a symlink to "
            f"{moved} will do) and leave --model.policy.path out")
    assert capsys.readouterr().err.splitlines() == [line, line]
    assert not (tmp_path / "out").exists()
    base.symlink_to(moved)
    assert main(["export", "--checkpoint", str(old), "--out", str(tmp_path / "out"), "--merge"]) == 0


def test_a_checkpoints_policy_takes_no_other_model_from_the_config(tmp_path, capsys):
    """fw generate / fw eval read the checkpoint's policy: a config or override that names another base model,
    other LoRA settings or no LoRA is refused in one line naming the key (before, the base came from the
    checkpoint's config.yaml whatever the override said, and fw eval's report listed the override as applied)."""
    from framework.cli import main

    base, ckpt = _lora_run(tmp_path)
    other = tmp_path / "other"
    _hf_base(other, eos_token_id=151643)   # another generation_config.json: other content
    generate = ["generate", "--checkpoint", str(ckpt), "--prompt", "1+1=", "--greedy", "--max-new-tokens", "2"]
    held = ROOT / "recipes" / "data" / "arithmetic_chat_heldout.jsonl"
    capsys.readouterr()
    assert main([*generate, f"--model.policy.path={other}"]) == 2
    assert main([*generate, "--model.policy.lora.rank=8"]) == 2
    assert main(["eval", "--checkpoint", str(ckpt), f"--eval.path={held}", "--model.policy.lora=null"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        (f"fw: error: model.policy.path is {other} here, but the policy of {ckpt} has {base} (the "
        f"weights and their shapes come from the checkpoint; {other / 'generation_config.json'} differs in content "
        "from what the checkpoint recorded); leave model.policy.path as the checkpoint's config.yaml has it"),
        (f"fw: error: model.policy.lora.rank is 8 here, but the policy of {ckpt} has 4 (the adapters' shapes are in "
        "the checkpoint); leave model.policy.lora.rank as the checkpoint's config.yaml has it"),
        (f"fw: error: model.policy.lora is null here, but the policy of {ckpt} has {{rank: 4, alpha: 8, dropout: 0.0, "
         "targets: [q_proj, v_proj]} (the checkpoint holds "
        "LoRA adapters); leave model.policy.lora as the checkpoint's config.yaml has it")]


def test_a_checkpoints_policy_loads_in_the_configs_dtype(tmp_path):
    """model.policy.dtype applies to a checkpoint's policy, full or LoRA (the LoRA base was rebuilt in the
    checkpoint's dtype whatever the config said); a copy of the base at another path reads as the base."""
    import shutil

    from framework.generate import load_policy, run_config

    base, ckpt = _lora_run(tmp_path)
    copy = tmp_path / "copy"
    shutil.copytree(base, copy)
    bf16 = "--model.policy.dtype=bfloat16"
    for overrides in ([bf16], [bf16, f"--model.policy.path={copy}"]):
        _, policy = load_policy(run_config(None, ckpt, overrides), ckpt)
        assert {p.dtype for p in policy.parameters()} == {torch.bfloat16}
    _, policy = load_policy(run_config(None, ckpt, []), ckpt)
    assert {p.dtype for p in policy.parameters()} == {torch.float32}
    full = tmp_path / "full" / "step-000003"
    cfg = _sft_from(base, tmp_path / "full", 3)
    ck.write_checkpoint_dir(policy_checkpoint(_policy(False), Tokenizer.builtin(), 3, tmp_path / "tok"), full, cfg)
    _, policy = load_policy(run_config(None, full, ["--model.policy.dtype=bfloat16"]), full)
    assert {p.dtype for p in policy.parameters()} == {torch.bfloat16}
    with pytest.raises(FwError, match=r"^model.policy.lora is \{rank: 4, .* has null \(the checkpoint holds a full"):
        load_policy(run_config(None, full, ["--model.policy.lora.rank=4"]), full)
    # a full checkpoint whose config.yaml this fw cannot read (another version's keys) still loads under a given
    # config: its weights and shapes are its own
    other = tmp_path / "other" / "step-000003"
    ck.write_checkpoint_dir(policy_checkpoint(_policy(False), Tokenizer.builtin(), 3, tmp_path / "tok"), other,
                            {**cfg, "a_later_key": 1})
    given = {**cfg, "model": {**cfg["model"], "policy": {**cfg["model"]["policy"], "dtype": "bfloat16"}}}
    _, policy = load_policy(given, other)
    assert {p.dtype for p in policy.parameters()} == {torch.bfloat16}



def test_fw_eval_of_a_moved_lora_base_or_data_file_reports_no_change(tmp_path, capsys):
    """fw eval of a LoRA checkpoint with --model.policy.path at a copy of its base, and --data.path at a copy of its
    data, each holding what the checkpoint recorded: a move, as a resume accepts it, is no change of settings. The
    report is the checkpoint's own (before, each was listed in "changes" and the report named with a hash), and with
    another change too it keeps the name and "changes" of that change alone; a data file of other content stays a
    change."""
    import shutil

    from framework.cli import main
    from framework.trainer import fit

    base, data = tmp_path / "base", tmp_path / "train.jsonl"
    _hf_base(base, eos_token_id=[151645, 151643])
    shutil.copy(ROOT / "recipes" / "data" / "arithmetic_chat.jsonl", data)
    cfg = _sft_from(base, tmp_path / "run", 2)
    cfg["data"]["path"] = str(data)
    cfg["eval"].update(path=str(ROOT / "recipes" / "data" / "arithmetic_chat_heldout.jsonl"), max_prompts=4)
    cfg["model"]["policy"]["lora"] = {"rank": 4, "alpha": 8, "dropout": 0.0, "targets": ["q_proj", "v_proj"]}
    fit(cfg)
    ckpt = ck.checkpoints_dir(tmp_path / "run") / ck.step_dir_name(2)
    reports = tmp_path / "run" / "eval"
    copy, data_copy, other = tmp_path / "copy", tmp_path / "copy.jsonl", tmp_path / "other.jsonl"
    shutil.copytree(base, copy)
    shutil.copy(data, data_copy)
    other.write_text("".join(data.read_text().splitlines(keepends=True)[::-1]))   # other content: reversed

    said: list[str] = []

    def evaluate(*overrides: str) -> tuple[str, dict]:
        capsys.readouterr()
        assert main(["eval", "--checkpoint", str(ckpt), *overrides]) == 0
        printed = capsys.readouterr()
        said[:] = [line for line in printed.err.splitlines() if " moved from " in line]
        out = Path(printed.out.splitlines()[-1].removeprefix("wrote "))
        assert out.parent == reports
        return out.name, json.loads(out.read_text())

    name, own = evaluate()
    assert (name, own["changes"]) == ("step-000002.json", {})
    base.rename(tmp_path / "gone")   # the base is now at its copy alone
    for overrides in ([f"--model.policy.path={copy}"], [f"--model.policy.path={copy}", f"--data.path={data_copy}"]):
        name, report = evaluate(*overrides)
        assert (name, report["changes"], report["metrics"]) == ("step-000002.json", {}, own["metrics"]), overrides
    # each move said in one line, as a resume says it
    assert said == [f"fw: {key} moved from {was} to {now}, which holds the same content (size and sha256 of every "
                    "file); evaluating with it" for key, was, now in [("model.policy.path", base, copy),
                                                                       ("data.path", data, data_copy)]]
    (tmp_path / "gone").rename(base)
    hashed, report = evaluate(f"--data.path={other}")
    assert hashed.startswith("step-000002-") and report["changes"] == {"data.path": str(other)}
    name, report = evaluate(f"--model.policy.path={copy}", f"--data.path={other}")
    assert (name, report["changes"]) == (hashed, {"data.path": str(other)})
    assert sorted(p.name for p in reports.iterdir()) == sorted({"step-000002.json", hashed})

# `fw export ARGV...` with an audit hook that sends this process the signal named by argv[1] as it opens the
# staging copy's weight file: the copy half made
SIGNALLED_EXPORT = """
import os, signal, sys
signum = getattr(signal, sys.argv[1])

def hook(event, args):
    if event == "open" and isinstance(args[0], str) and "/.staging-" in args[0] and args[0].endswith(".safetensors"):
        os.kill(os.getpid(), signum)

sys.addaudithook(hook)
from framework.cli import main
sys.exit(main(sys.argv[2:]))
"""


def _signalled_export(signame: str, ckpt: str, out: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    env.pop("FW_DEBUG", None)
    return subprocess.run([sys.executable, "-c", SIGNALLED_EXPORT, signame, "export", "--checkpoint", ckpt, "--out",
                           str(out)], check=False, env=env, capture_output=True, text=True, timeout=120)


def test_a_sigterm_during_export_removes_its_staging_copy(tmp_path):
    """SIGTERM (`timeout`, a scheduler, `kill`) in the middle of the copy: its default action ended the process
    there and left the hidden staging copy (an 8B model's 16 GB) beside --out, removed only by a later export to
    that same path. Now the copy is removed, and the export ends with exit code 143 and one line."""
    ckpt = _write(tmp_path / "run", _policy(tied=True))
    models = tmp_path / "models"
    models.mkdir()
    proc = _signalled_export("SIGTERM", ckpt, models / "model")
    assert proc.returncode == 143, proc.stderr[-3000:]
    line = f"fw: stopped by SIGTERM while exporting {ckpt}; nothing was written to --out {models / 'model'}"
    assert proc.stderr.splitlines() == [line]
    assert os.listdir(models) == []

