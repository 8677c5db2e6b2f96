"""`fw generate` and `fw eval` used as a demanding user would: a --prompt of bytes that are not UTF-8, a report path
inside a checkpoint, `--checkpoint .` from inside one, an eval.max_new_tokens the KV cache cannot hold, SFT eval
examples that keep no target token."""

import json

import pytest
import torch
from scripts.ckpt_writer import policy_checkpoint

from framework import checkpoint as ck
from framework.cli import main
from framework.config import resolve
from framework.models import Qwen3ForCausalLM
from framework.models.presets import preset_config
from framework.tokenizer import Tokenizer


def _cfg(run_dir) -> dict:
    return resolve({"recipe": "grpo", "seed": 3, "run_dir": str(run_dir), "model": {"policy": {"preset": "tiny"}},
                    "data": {"task": {"name": "digits"}, "chat_template": False},
                    "rollout": {"prompts_per_step": 2, "max_new_tokens": 2},
                    "eval": {"max_prompts": 2, "samples_per_prompt": 1, "held_out": False}})


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny GRPO checkpoint (policy/ and config.yaml) at <run>/checkpoints/step-000004."""
    root = tmp_path_factory.mktemp("review")
    tok = Tokenizer.builtin()
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(preset_config("tiny", tok.vocab_size, tok.eos_id, tok.pad_id))
    path = ck.checkpoints_dir(root / "run") / ck.step_dir_name(4)
    ck.write_checkpoint_dir(policy_checkpoint(model, tok, 4, root / "tok"), path, _cfg(root / "run"))
    return path


def _files(folder):
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


@pytest.mark.parametrize(("prompt", "what"), [("ab\udcff", "byte 0xff at character 3"),
                                              ("\ud800x", "the lone surrogate U+D800 at character 1")])
def test_a_prompt_that_is_not_utf8_is_one_line(checkpoint, capsys, prompt, what):
    """Bytes of another encoding on the command line reach Python as lone surrogates, which the tokenizer refuses
    with a TypeError: one line naming --prompt, exit 2."""
    assert main(["generate", "--checkpoint", str(checkpoint), "--prompt", prompt, "--greedy"]) == 2
    shown = capsys.readouterr()
    assert shown.out == ""
    assert shown.err.splitlines() == [f"fw: error: --prompt is not UTF-8 text ({what}); give the prompt in UTF-8"]


@pytest.mark.parametrize("where", ["r.json", "policy/r.json", "new/r.json"])
def test_fw_eval_writes_no_report_inside_a_checkpoint(checkpoint, capsys, where):
    """A report in a checkpoint directory is no file of its manifest, and the run's prune deletes it with the
    checkpoint: refused before anything loads, as fw export refuses an --out there."""
    before = _files(checkpoint)
    out = checkpoint / where
    assert main(["eval", "--checkpoint", str(checkpoint), "--out", str(out)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        (f"fw: error: --out {out}: inside checkpoint {checkpoint}, whose files are those its manifest lists and "
         "which a prune deletes whole; give a path outside it")]
    assert _files(checkpoint) == before


@pytest.mark.parametrize("inside", ["", "policy"])
def test_fw_eval_of_a_relative_checkpoint_writes_the_runs_report(checkpoint, capsys, monkeypatch, inside):
    """`fw eval --checkpoint .` in the checkpoint (`..` in its policy/): the report goes where the absolute path's
    goes, <run>/eval/step-000004.json, naming the checkpoint absolutely; before, it was `.json` (`...json`) in the
    working directory, inside the checkpoint, and named the checkpoint `.`."""
    before = _files(checkpoint)
    report = checkpoint.parent.parent / "eval" / "step-000004.json"
    report.unlink(missing_ok=True)
    monkeypatch.chdir(checkpoint / inside)
    assert main(["eval", "--checkpoint", ".." if inside else "."]) == 0
    assert capsys.readouterr().out.endswith(f"wrote {report}\n")
    assert json.loads(report.read_text())["checkpoint"] == str(checkpoint)
    assert _files(checkpoint) == before


def test_an_eval_limit_the_cache_cannot_hold_names_eval_max_new_tokens(checkpoint, tmp_path, capsys):
    """eval.max_new_tokens, not rollout.max_new_tokens, sets the evaluation's limit: the refusal names the key
    the user set."""
    out = tmp_path / "r.json"
    assert main(["eval", "--checkpoint", str(checkpoint), "--out", str(out), f"--eval.max_new_tokens={10**11}"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].endswith("raise rollout.kv_cache_gib or lower eval.max_new_tokens"), err
    assert not out.exists()
    assert main(["eval", "--checkpoint", str(checkpoint), "--out", str(out), f"--rollout.max_new_tokens={10**11}"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].endswith("raise rollout.kv_cache_gib or lower rollout.max_new_tokens"), err


def test_sft_eval_of_examples_whose_targets_all_fall_past_max_seq_len_is_refused(tmp_path):
    """An SFT eval whose every example keeps no target token within data.max_seq_len reported eval/loss 0 and
    eval/perplexity 1, a perfect score of no token: refused, naming the file and the key. One target token more
    (the prompt's last position, which predicts the completion's first token) evaluates that one token."""
    from framework.data import IGNORE, encode_record
    from framework.errors import FwError
    from framework.evaluation import Evaluation
    from framework.models import build_policy

    held = tmp_path / "held.jsonl"
    record = {"prompt": "12 + 30 = ", "completion": "42"}
    held.write_text(json.dumps(record) + "\n")

    def cfg(max_seq_len):
        return resolve({"recipe": "sft", "seed": 1, "model": {"policy": {"preset": "tiny"}},
                        "data": {"task": {"name": "digits"}, "chat_template": False, "max_seq_len": max_seq_len},
                        "eval": {"path": str(held), "held_out": False}})

    tok = Tokenizer.builtin()
    targets = encode_record(record, "prompt_completion", tok, cfg(512), "x", train_on_prompt=False).targets
    prompt = next(i for i, t in enumerate(targets) if t != IGNORE) + 1   # the prompt's tokens
    policy = build_policy(cfg(prompt)["model"]["policy"], tok, seed=1)
    with pytest.raises(FwError) as e:
        Evaluation(cfg(prompt), tok).run(policy)
    assert str(e.value) == (f"eval: no example of eval.path {held} (1 chosen) has a target token within "
                            f"data.max_seq_len ({prompt}): their prompts fill it; raise data.max_seq_len or give "
                            "examples with shorter prompts")
    assert Evaluation(cfg(prompt + 1), tok).run(policy)["eval/tokens"] == 1
