"""`save_pretrained`: an atomic publish (a crash, SIGKILL included, leaves the old directory or the new one) and a
generation_config.json that transformers' `generate` stops with at the end of a chat turn."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from framework.errors import FwError
from framework.models import Qwen3Config, Qwen3ForCausalLM, load_pretrained, save_pretrained
from framework.models.presets import PRESETS
from framework.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[1]
TINY = {"vocab_size": 110, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "tie_word_embeddings": False}
SHARD = "20KB"   # several shards for TINY (about 70 KB of float32 weights)

# A child process that saves tiny_model(seed) to PATH, each safetensors file followed by a pause, so that the
# parent can SIGKILL it at a chosen point of the save. Patched before fw imports save_file.
CHILD = """
import sys, time
import safetensors.torch as st
write = st.save_file
def slow(*args, **kwargs):
    write(*args, **kwargs)
    time.sleep(float(sys.argv[4]))
st.save_file = slow
sys.path.insert(0, sys.argv[5])
from test_save_pretrained import tiny_model
from framework.models import save_pretrained
save_pretrained(tiny_model(int(sys.argv[2])), sys.argv[1], max_shard_size=sys.argv[3])
"""


def tiny_model(seed: int) -> Qwen3ForCausalLM:
    g = torch.Generator().manual_seed(seed)
    model = Qwen3ForCausalLM(Qwen3Config.from_hf(TINY))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    return model.eval()


def assert_holds(path: Path, seed: int) -> None:
    """`path` loads, with exactly the weights of tiny_model(seed)."""
    loaded, want = load_pretrained(path).hf_state_dict(), tiny_model(seed).hf_state_dict()
    assert sorted(loaded) == sorted(want)
    for name in want:
        assert torch.equal(loaded[name], want[name]), name


def hidden(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith("."))


def start_child(target: Path, seed: int, pause_s: float) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-c", CHILD, str(target), str(seed), SHARD, str(pause_s),
                             str(ROOT / "tests")], cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)


def kill_when(child: subprocess.Popen, root: Path, pattern: str, kill: bool = True, timeout_s: float = 120) -> Path:
    """SIGKILL `child` (unless not `kill`) as soon as a file matching `pattern` exists anywhere under `root`,
    hidden folders included; return that file."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = list(root.rglob(pattern))
        if found:
            if kill:
                child.send_signal(signal.SIGKILL)
                child.wait()
            return found[0]
        if child.poll() is not None:
            pytest.fail(f"the save finished before {pattern} appeared: {child.stderr.read()[-2000:]}")
        time.sleep(0.005)
    child.kill()
    pytest.fail(f"no {pattern} after {timeout_s} s")


# ---------------------------------------------------------------- atomicity


@pytest.mark.parametrize("kill_after", ["first", "last"])
def test_sigkill_mid_save_leaves_the_old_model(tmp_path, kill_after):
    target = tmp_path / "model"
    save_pretrained(tiny_model(1), target)
    Tokenizer.builtin().save_pretrained(target)
    before = {p.name: p.read_bytes() for p in target.iterdir()}

    child = start_child(target, seed=2, pause_s=1.0)
    first = kill_when(child, tmp_path, "model-00001-of-*.safetensors", kill=kill_after == "first")
    if kill_after == "last":   # every shard written, the index and config.json not yet
        count = first.name.split("-of-")[1].split(".")[0]
        assert int(count) > 2
        kill_when(child, tmp_path, f"model-{count}-of-{count}.safetensors")
    assert child.returncode == -signal.SIGKILL

    assert {p.name: p.read_bytes() for p in target.iterdir()} == before   # every file as it was
    assert_holds(target, seed=1)
    save_pretrained(tiny_model(3), target)   # the next save removes what the killed one left
    assert_holds(target, seed=3)
    assert hidden(tmp_path) == []
    assert (target / "tokenizer.json").read_bytes() == before["tokenizer.json"]


def test_sigkill_of_a_first_save_leaves_no_model(tmp_path):
    target = tmp_path / "model"
    child = start_child(target, seed=2, pause_s=1.0)
    kill_when(child, tmp_path, "model-00002-of-*.safetensors")
    assert not target.exists()
    with pytest.raises(FwError, match="no config.json"):
        load_pretrained(target)
    save_pretrained(tiny_model(4), target)
    assert_holds(target, seed=4)
    assert hidden(tmp_path) == []


def test_sigkill_between_the_renames_keeps_the_old_model_beside(tmp_path):
    """On a file system that cannot swap two directories in one step, the one moment the target is missing:
    the old directory is set aside, the new one not yet in. The old directory is whole, and the next save puts
    it back first (its tokenizer stays with the new weights)."""
    target = tmp_path / "model"
    save_pretrained(tiny_model(1), target, tokenizer=Tokenizer.builtin())
    (target / "README.md").write_text("my model\n")
    kill_in_window = CHILD.replace("import sys, time", "import os, signal, sys, time\nrename = os.rename\n"
                                   "import framework.durable\n"
                                   "framework.durable.exchange = lambda a, b: False   # no RENAME_EXCHANGE\n"
                                   "def rename_or_die(a, b):\n"
                                   "    if os.path.basename(a).startswith('.staging-') and not os.path.lexists(b):\n"
                                   "        os.kill(os.getpid(), signal.SIGKILL)\n"
                                   "    return rename(a, b)\n"
                                   "os.rename = rename_or_die")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    child = subprocess.run([sys.executable, "-c", kill_in_window, str(target), "2", SHARD, "0", str(ROOT / "tests")],
                           check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert child.returncode == -signal.SIGKILL, child.stderr[-2000:]

    assert not target.exists()
    old = [p for p in tmp_path.iterdir() if p.name.startswith(".") and (p / "README.md").is_file()
           and (p / "model.safetensors").is_file()]   # the new one, beside it, is sharded
    assert len(old) == 1
    assert_holds(old[0], seed=1)
    save_pretrained(tiny_model(3), target)
    assert_holds(target, seed=3)
    assert (target / "README.md").read_text() == "my model\n"
    assert Tokenizer.from_pretrained(target).encode("12+3") == Tokenizer.builtin().encode("12+3")
    assert hidden(tmp_path) == []


def test_a_failing_save_leaves_the_old_model_and_no_staging(tmp_path, monkeypatch):
    from framework.models import hf_io

    target = tmp_path / "model"
    save_pretrained(tiny_model(1), target, max_shard_size=SHARD)
    before = {p.name: p.read_bytes() for p in target.iterdir()}
    write, calls = hf_io.save_file, []

    def disk_full_on_the_third(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise OSError(28, "No space left on device")
        write(*args, **kwargs)

    monkeypatch.setattr(hf_io, "save_file", disk_full_on_the_third)
    with pytest.raises(OSError, match="No space left"):
        save_pretrained(tiny_model(2), target, max_shard_size=SHARD)
    assert {p.name: p.read_bytes() for p in target.iterdir()} == before
    assert_holds(target, seed=1)
    assert hidden(tmp_path) == []


def test_saving_over_a_model_keeps_the_other_files_and_never_writes_through_them(tmp_path):
    target = tmp_path / "model"
    save_pretrained(tiny_model(1), target, max_shard_size=SHARD)
    Tokenizer.builtin().save_pretrained(target)
    (target / "notes").mkdir()
    (target / "notes" / "README.md").write_text("trained on arithmetic\n")
    old_config = (target / "tokenizer_config.json").read_bytes()
    os.link(target / "tokenizer_config.json", tmp_path / "old_tokenizer_config.json")   # the old file's inode

    edited = tmp_path / "tok"
    Tokenizer.builtin().save_pretrained(edited)
    config = json.loads((edited / "tokenizer_config.json").read_text())
    (edited / "tokenizer_config.json").write_text(json.dumps({**config, "model_max_length": 4096}))
    retrained = Tokenizer.from_pretrained(edited)
    save_pretrained(tiny_model(2), target, tokenizer=retrained)
    assert sorted(os.listdir(target)) == ["config.json", "generation_config.json", "model.safetensors", "notes",
                                          "tokenizer.json", "tokenizer_config.json"]   # the old shards are gone
    assert (target / "notes" / "README.md").read_text() == "trained on arithmetic\n"
    assert json.loads((target / "tokenizer_config.json").read_text())["model_max_length"] == 4096
    assert (tmp_path / "old_tokenizer_config.json").read_bytes() == old_config   # written as a new file
    assert_holds(target, seed=2)
    assert hidden(tmp_path) == []


def test_save_refuses_a_file_and_the_working_directory(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("x")
    with pytest.raises(FwError, match="file: exists and is not a directory"):
        save_pretrained(tiny_model(1), tmp_path / "file")
    here = tmp_path / "here"
    save_pretrained(tiny_model(1), here)
    monkeypatch.chdir(here)
    with pytest.raises(FwError, match=r"^\.: the working directory \(or one above it\)"):
        save_pretrained(tiny_model(2), ".")
    assert_holds(here, seed=1)


def test_save_into_a_link_replaces_the_target_and_keeps_the_link(tmp_path):
    target = tmp_path / "models" / "target"
    save_pretrained(tiny_model(1), target)
    link = tmp_path / "link"
    link.symlink_to(target)
    save_pretrained(tiny_model(2), link)
    assert link.is_symlink() and link.resolve() == target
    assert_holds(target, seed=2)
    assert hidden(tmp_path / "models") == []


# ---------------------------------------------------------------- generation_config.json


def bigram_model(tok: Tokenizer) -> tuple[Qwen3ForCausalLM, int]:
    """A model whose layers add nothing, so the next token depends on the current one only: "a" after every
    token but "a", <|im_end|> after "a". config.json's eos is <|endoftext|>, as in Qwen3's base models.
    Returns (model, id of "a")."""
    (a,) = tok.encode("a")
    im_end = tok.token_to_id("<|im_end|>")
    config = Qwen3Config(**{**PRESETS["tiny"], "vocab_size": tok.vocab_size, "tie_word_embeddings": False,
                            "bos_token_id": None, "eos_token_id": tok.pad_id, "pad_token_id": tok.pad_id})
    model = Qwen3ForCausalLM(config)
    u = torch.ones(config.hidden_size)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0 if name.endswith("norm.weight") else 0.0)
        model.model.embed_tokens.weight.copy_(u)
        model.model.embed_tokens.weight[a] = -u
        model.lm_head_weight[a] = u
        model.lm_head_weight[im_end] = -u
    return model.eval(), a


def generated(path: Path, prompt: list[int], **kwargs) -> list[int]:
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=8, **kwargs)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("how", ["tokenizer argument", "tokenizer already there"])
def test_generate_stops_at_the_end_of_the_chat_turn(tmp_path, how):
    import transformers

    tok = Tokenizer.builtin()
    im_end, endoftext = tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")
    model, a = bigram_model(tok)
    if how == "tokenizer argument":
        save_pretrained(model, tmp_path, tokenizer=tok)
    else:
        tok.save_pretrained(tmp_path)
        save_pretrained(model, tmp_path)

    gen = transformers.GenerationConfig.from_pretrained(str(tmp_path))
    assert sorted(gen.eos_token_id) == sorted([im_end, endoftext])
    assert gen.pad_token_id == tok.pad_id and gen.bos_token_id is None
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "hi"}]))
    assert generated(tmp_path, prompt, eos_token_id=endoftext) == [a, im_end] * 4   # config.json's eos alone
    assert generated(tmp_path, prompt) == [a, im_end]


def test_a_loaded_generation_config_is_written_back_unchanged(tmp_path):
    import transformers

    src, dst = tmp_path / "src", tmp_path / "dst"
    save_pretrained(tiny_model(1), src)
    qwen3 = transformers.GenerationConfig(bos_token_id=151643, eos_token_id=[151645, 151643], pad_token_id=151643,
                                          do_sample=True, temperature=0.6, top_k=20, top_p=0.95)
    qwen3.save_pretrained(str(src))
    model = load_pretrained(src)
    save_pretrained(model, dst, tokenizer=Tokenizer.builtin())   # its own tokenizer does not override the file
    assert (dst / "generation_config.json").read_bytes() == (src / "generation_config.json").read_bytes()
    again = transformers.GenerationConfig.from_pretrained(str(dst))
    assert (again.temperature, again.top_k, again.top_p, again.do_sample) == (0.6, 20, 0.95, True)
    assert again.eos_token_id == [151645, 151643]


def test_an_unreadable_generation_config_is_named(tmp_path):
    save_pretrained(tiny_model(1), tmp_path)
    (tmp_path / "generation_config.json").write_text("{temperature: 0.6")
    with pytest.raises(FwError, match=f"^{tmp_path / 'generation_config.json'}: invalid JSON"):
        load_pretrained(tmp_path)


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_every_file_gets_the_mode_the_umask_gives(tmp_path, umask):
    """A saved model is read by other users' processes (a server, an evaluation job): its weight shards get the
    mode a new file gets under the umask, as its JSON files do, not the owner-only mode safetensors creates."""
    before = os.umask(umask)
    try:
        save_pretrained(tiny_model(0), tmp_path / "m", max_shard_size=SHARD)
    finally:
        os.umask(before)
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in (tmp_path / "m").iterdir()}
    assert sum(name.endswith(".safetensors") for name in modes) > 1
    assert set(modes.values()) == {oct(0o666 & ~umask)}, modes
