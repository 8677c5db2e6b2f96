"""`fw generate`: completions from a checkpoint directory and from a config, checked against a naive
greedy loop over full forwards of the same weights; the real CLI in a subprocess."""
import os
import subprocess
import sys

import pytest
import torch

from framework.config import resolve, save_resolved
from framework.errors import FwError
from framework.generate import generate_text
from framework.models import Qwen3ForCausalLM, save_pretrained
from framework.models.presets import preset_config
from framework.tokenizer import Tokenizer


def make_cfg(chat_template: bool, **rollout):
    return resolve({"recipe": "grpo", "model": {"policy": {"preset": "tiny"}}, "seed": 3,
                    "data": {"task": {"name": "digits"}, "chat_template": chat_template},
                    "rollout": {"max_new_tokens": 9, **rollout}})


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A checkpoint-shaped directory: policy/ (HF weights + tokenizer) and config.yaml."""
    tok = Tokenizer.builtin()
    torch.manual_seed(1)
    model = Qwen3ForCausalLM(preset_config("tiny", tok.vocab_size, tok.eos_id, tok.pad_id))
    with torch.no_grad():  # peaked distributions, so greedy text is not a run of one character
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.3)
    ckpt = tmp_path_factory.mktemp("run") / "step-000010"
    save_pretrained(model, ckpt / "policy")
    tok.save_pretrained(ckpt / "policy")
    save_resolved(make_cfg(chat_template=True), ckpt / "config.yaml")
    return ckpt, model.eval(), tok


def naive_greedy_text(model, tok, ids, max_new_tokens):
    seq, out = list(ids), []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            token = int(model(torch.tensor([seq]))[0, -1].argmax())
            if token == tok.eos_id:
                break
            out.append(token)
            seq.append(token)
    return tok.decode(out)


def test_checkpoint_greedy_with_chat_template(checkpoint):
    ckpt, model, tok = checkpoint
    rendered = tok.apply_chat_template([{"role": "user", "content": "2+2="}], add_generation_prompt=True)
    assert rendered.startswith("<|im_start|>user\n2+2=<|im_end|>")
    expected = naive_greedy_text(model, tok, tok.encode(rendered), 9)
    assert generate_text(None, "2+2=", checkpoint=str(ckpt), temperature=0.0) == expected
    assert len(expected) >= 2


def test_checkpoint_with_overriding_config(checkpoint):
    ckpt, model, tok = checkpoint
    cfg = make_cfg(chat_template=False, max_new_tokens=4)
    expected = naive_greedy_text(model, tok, tok.encode("2+2="), 4)
    assert generate_text(cfg, "2+2=", checkpoint=str(ckpt), temperature=0.0) == expected
    longer = naive_greedy_text(model, tok, tok.encode("2+2="), 7)
    assert generate_text(cfg, "2+2=", checkpoint=str(ckpt), max_new_tokens=7, temperature=0.0) == longer


def test_sampling_is_seeded(checkpoint):
    ckpt, _, _ = checkpoint
    a = generate_text(None, "hi", checkpoint=str(ckpt), temperature=1.0, seed=5)
    assert a == generate_text(None, "hi", checkpoint=str(ckpt), temperature=1.0, seed=5)
    others = {generate_text(None, "hi", checkpoint=str(ckpt), temperature=1.0, seed=s) for s in (6, 7, 8)}
    assert others != {a}


def test_from_config_preset_is_deterministic():
    cfg = make_cfg(chat_template=False)
    text = generate_text(cfg, "1=", temperature=0.0)
    assert text == generate_text(cfg, "1=", temperature=0.0) and len(text) <= 9


def test_bad_checkpoint(tmp_path):
    with pytest.raises(FwError, match="no policy/config.json"):
        generate_text(None, "x", checkpoint=str(tmp_path))
    (tmp_path / "policy").mkdir()
    save_pretrained(Qwen3ForCausalLM(preset_config("tiny", 103)), tmp_path / "policy")
    with pytest.raises(FwError, match="no config.yaml there; pass --config"):
        generate_text(None, "x", checkpoint=str(tmp_path))


def test_cli_generate_prints_the_completion(checkpoint):
    ckpt, model, tok = checkpoint
    rendered = tok.apply_chat_template([{"role": "user", "content": "abc"}], add_generation_prompt=True)
    expected = naive_greedy_text(model, tok, tok.encode(rendered), 5)
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-m", "framework", "generate", "--checkpoint", str(ckpt),
                          "--prompt", "abc", "--greedy", "--max-new-tokens", "5"],
                         check=False, capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout == expected + "\n"
