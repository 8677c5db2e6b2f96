"""`fw generate`: completions from a checkpoint directory and from a config, checked against a naive
greedy loop over full forwards of the same weights; the real CLI in a subprocess."""
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from scripts.ckpt_writer import policy_checkpoint

from framework import checkpoint as ck
from framework.config import resolve
from framework.errors import FwError
from framework.generate import generate_text
from framework.models import Qwen3ForCausalLM, save_pretrained
from framework.models.presets import preset_config
from framework.tokenizer import Tokenizer

REPO = Path(__file__).resolve().parents[1]


def make_cfg(chat_template: bool, **rollout):
    return resolve({"recipe": "grpo", "model": {"policy": {"preset": "tiny"}}, "seed": 3,
                    "data": {"task": {"name": "digits"}, "chat_template": chat_template},
                    "rollout": {"max_new_tokens": 9, **rollout}})


def write_checkpoint(run_dir, model, tok, step=10):
    """A checkpoint as FwModule hands it over: policy/ (HF weights + tokenizer files), config.yaml."""
    checkpoint = policy_checkpoint(model, tok, step, run_dir.parent / f"tok-{step}")
    path = ck.checkpoints_dir(run_dir) / ck.step_dir_name(step)
    cfg = make_cfg(chat_template=True)
    cfg["run_dir"] = str(run_dir)
    ck.write_checkpoint_dir(checkpoint, path, cfg)
    return path


def peaked_model(seed):
    tok = Tokenizer.builtin()
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(preset_config("tiny", tok.vocab_size, tok.eos_id, tok.pad_id))
    with torch.no_grad():  # peaked distributions, so greedy text is not a run of one character
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.3)
    return model.eval(), tok


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    model, tok = peaked_model(1)
    return write_checkpoint(tmp_path_factory.mktemp("gen") / "run", model, tok), model, tok


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


def test_cli_overrides_apply_on_top_of_the_checkpoints_config(checkpoint, capsys):
    """`fw generate --checkpoint DIR --a.b=v`: the checkpoint's config.yaml with the override; a bad override is
    named as fw fit names it."""
    from framework.cli import main

    ckpt, model, tok = checkpoint
    rendered = tok.apply_chat_template([{"role": "user", "content": "2+2="}], add_generation_prompt=True)
    expected = naive_greedy_text(model, tok, tok.encode(rendered), 3)
    assert main(["generate", "--checkpoint", str(ckpt), "--prompt", "2+2=", "--greedy",
                 "--rollout.max_new_tokens=3"]) == 0
    assert capsys.readouterr().out == expected + "\n"
    assert main(["generate", "--checkpoint", str(ckpt), "--prompt", "2+2=", "--rollout.max_new_tokens=0"]) == 2
    assert capsys.readouterr().err == ("override '--rollout.max_new_tokens=0': rollout.max_new_tokens: must be >= 1, "
                                       "got 0\n")


def test_sampling_is_seeded(checkpoint):
    ckpt, _, _ = checkpoint
    a = generate_text(None, "hi", checkpoint=str(ckpt), temperature=1.0, seed=5)
    assert a == generate_text(None, "hi", checkpoint=str(ckpt), temperature=1.0, seed=5)
    others = {generate_text(None, "hi", checkpoint=str(ckpt), temperature=1.0, seed=s) for s in (6, 7, 8)}
    assert others != {a}


def test_a_limit_the_cache_cannot_hold_names_the_option_that_set_it(checkpoint):
    """--max-new-tokens beyond what one row's KV blocks can hold is refused naming the option, not the config key
    it stands in for; set in the config, the key is named."""
    ckpt, _, _ = checkpoint
    with pytest.raises(FwError, match=r"raise rollout.kv_cache_gib or lower --max-new-tokens$"):
        generate_text(None, "2+2=", checkpoint=str(ckpt), max_new_tokens=10**11)
    with pytest.raises(FwError, match=r"raise rollout.kv_cache_gib or lower rollout.max_new_tokens$"):
        generate_text(None, "2+2=", checkpoint=str(ckpt), overrides=[f"--rollout.max_new_tokens={10**11}"])


def test_a_limit_the_cache_cannot_hold_is_refused_before_any_weights_load(tmp_path, checkpoint, capsys):
    """--max-new-tokens past what the rollout's KV cache holds is refused from the config, the policy's config.json
    and the prompt alone: a checkpoint whose weights are damaged (files of the manifest's sizes, which the
    checkpoint's resolution checks) gets the same one line, and so does a config whose model directory has no
    weights. The largest limit the cache holds runs."""
    from framework.cli import main

    ckpt, model, tok = checkpoint
    rendered = tok.apply_chat_template([{"role": "user", "content": "2+2="}], add_generation_prompt=True)
    prompt_len = len(tok.encode(rendered))
    bs = 16   # rollout.block_size's default
    block = 2 * 2 * 2 * bs * 64 * 4   # keys and values x 2 layers x 2 kv heads x 16 positions x head_dim 64 x float32
    blocks = -(-prompt_len // bs) + 3   # the pool: a scratch block and blocks - 1 that one row may use
    gib = blocks * block / 2**30
    largest = (blocks - 1) * bs - prompt_len + 1   # a row writes its prompt and every new token but the last

    def fw(path, n):
        code = main(["generate", "--checkpoint", str(path), "--prompt", "2+2=", "--greedy", "--max-new-tokens",
                     str(n), f"--rollout.kv_cache_gib={gib!r}"])
        return code, capsys.readouterr().err

    refusal = (f"rollout: one row of {prompt_len} prompt + {largest + 1} new tokens needs {blocks} KV blocks of {bs} "
               f"positions, the cache holds {blocks - 1}: raise rollout.kv_cache_gib or lower --max-new-tokens")
    assert fw(ckpt, largest) == (0, "")
    assert fw(ckpt, largest + 1) == (2, f"fw: error: {refusal}\n")
    for damage, at, value in (("weight", -5, 0x7F), ("header", 7, 0x01)):   # only the hash sees a flipped weight
        weights = tmp_path / damage / "policy" / "model.safetensors"
        shutil.copytree(ckpt, weights.parent.parent)
        _corrupt(weights, at, value)
        assert fw(weights.parent.parent, largest + 1) == (2, f"fw: error: {refusal}\n"), damage
        code, err = fw(weights.parent.parent, largest)   # a limit the cache holds reads the weights, which fail
        assert code == 2 and str(weights) in err, (damage, err)

    save_pretrained(model, tmp_path / "model")
    tok.save_pretrained(tmp_path / "model")
    (tmp_path / "model" / "model.safetensors").unlink()
    cfg = resolve({"recipe": "grpo", "model": {"policy": {"path": str(tmp_path / "model")}},
                   "data": {"task": {"name": "digits"}, "chat_template": True}, "rollout": {"kv_cache_gib": gib}})
    with pytest.raises(FwError, match=f"^{re.escape(refusal)}$"):
        generate_text(cfg, "2+2=", max_new_tokens=largest + 1)


def test_from_config_preset_is_deterministic():
    cfg = make_cfg(chat_template=False)
    text = generate_text(cfg, "1=", temperature=0.0)
    assert text == generate_text(cfg, "1=", temperature=0.0) and len(text) <= 9


def test_bad_checkpoint(tmp_path):
    with pytest.raises(FwError, match="not a checkpoint .* nor a run directory"):
        generate_text(None, "x", checkpoint=str(tmp_path))
    (tmp_path / "policy").mkdir()   # a bare HF directory is a model path, not a checkpoint
    save_pretrained(Qwen3ForCausalLM(preset_config("tiny", 103)), tmp_path / "policy")
    with pytest.raises(FwError, match="not a checkpoint"):
        generate_text(None, "x", checkpoint=str(tmp_path))
    with pytest.raises(FwError, match="no such directory"):
        generate_text(None, "x", checkpoint=str(tmp_path / "nope"))


def test_run_dir_means_its_newest_checkpoint(tmp_path, checkpoint):
    _, model, tok = checkpoint
    run = tmp_path / "run"
    other, _ = peaked_model(2)
    write_checkpoint(run, other, tok, step=3)
    newest = write_checkpoint(run, model, tok, step=10)
    expected = naive_greedy_text(model, tok, tok.encode(tok.apply_chat_template(
        [{"role": "user", "content": "2+2="}], add_generation_prompt=True)), 9)
    assert generate_text(None, "2+2=", checkpoint=str(run), temperature=0.0) == expected
    assert expected != naive_greedy_text(other, tok, tok.encode(tok.apply_chat_template(
        [{"role": "user", "content": "2+2="}], add_generation_prompt=True)), 9)

    (newest / "policy" / "tokenizer.json").unlink()   # the newest is damaged: named, skipped only on request
    with pytest.raises(FwError, match=f"newest checkpoint {newest} is damaged: .*tokenizer.json: missing"):
        generate_text(None, "2+2=", checkpoint=str(run), temperature=0.0)
    fallback = generate_text(None, "2+2=", checkpoint=str(run), temperature=0.0, skip_damaged=True)
    assert fallback == naive_greedy_text(other, tok, tok.encode(tok.apply_chat_template(
        [{"role": "user", "content": "2+2="}], add_generation_prompt=True)), 9)


def test_an_override_of_the_recipe_is_named(checkpoint):
    """The checkpoint's config.yaml (recipe grpo) holds grpo:, which recipe sft refuses: said of the override that
    changes the recipe, not of the file's line."""
    path, _, _ = checkpoint
    with pytest.raises(FwError) as e:
        generate_text(None, "x", checkpoint=str(path), overrides=["--recipe=sft"])
    assert str(e.value) == (
        "override '--recipe=sft': recipe: the checkpoint's config.yaml is of recipe grpo and holds grpo:, which "
        "recipe sft does not allow; to read the checkpoint under recipe sft, give a config of that recipe with "
        "--config FILE")
    same = generate_text(None, "2+2=", checkpoint=str(path), overrides=["--recipe=grpo"], temperature=0.0)
    assert same == generate_text(None, "2+2=", checkpoint=str(path), temperature=0.0)


def _corrupt(file, at, value):
    data = bytearray(file.read_bytes())
    data[at] = value
    file.write_bytes(bytes(data))


def test_corrupt_weights_are_found(tmp_path):
    model, tok = peaked_model(1)
    path = write_checkpoint(tmp_path / "run", model, tok)
    weights = path / "policy" / "model.safetensors"
    _corrupt(weights, weights.stat().st_size - 5, 0x7F)   # flipped bytes in a weight: only the hash sees them
    with pytest.raises(FwError, match=f"{weights}: sha256 .* does not match"):
        generate_text(None, "x", checkpoint=str(path), temperature=0.0)

    _corrupt(weights, 7, 0x01)   # a header length of 2**56 bytes: checked before safetensors parses it
    cfg = make_cfg(chat_template=True)
    cfg["checkpoint"]["verify"] = False
    # unhashed, the header check refuses it; the file it names is hashed then, and named as corrupt
    with pytest.raises(FwError, match=f"{weights}: sha256 .* does not match"):
        generate_text(cfg, "x", checkpoint=str(path), temperature=0.0)


def test_cli_generate_prints_the_completion(checkpoint, capsys):
    from framework.cli import main

    ckpt, model, tok = checkpoint
    rendered = tok.apply_chat_template([{"role": "user", "content": "abc"}], add_generation_prompt=True)
    expected = naive_greedy_text(model, tok, tok.encode(rendered), 5)
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-m", "framework", "generate", "--checkpoint", str(ckpt),
                          "--prompt", "abc", "--greedy", "--max-new-tokens", "5"],
                         check=False, capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout == expected + "\n"

    # the run directory works the same; a corrupt newest one is one line (in this process: the real process above
    # shows the command's output)
    run_dir = ckpt.parent.parent
    weights = ckpt / "policy" / "model.safetensors"
    original = weights.read_bytes()
    try:
        _corrupt(weights, 3, 0xFF)
        code = main(["generate", "--checkpoint", str(run_dir), "--prompt", "abc", "--greedy"])
    finally:
        weights.write_bytes(original)
    out = capsys.readouterr()
    assert code == 2 and out.out == ""
    assert out.err.startswith(f"fw: error: the newest checkpoint {ckpt} is damaged: {weights}: sha256 ")
    assert out.err.endswith("; --skip-damaged uses the newest intact older one instead\n")
    assert out.err.count("\n") == 1


def test_base_checkpoint_stops_at_the_chat_turn_end():
    """A base checkpoint names <|endoftext|> as eos in tokenizer_config.json and config.json, but the chat
    template closes each assistant turn with <|im_end|>: generation must stop there too, or a chat-trained base
    model writes on into the next turn."""
    from tokenizers import Tokenizer as HfTokenizer

    from framework.rollout.engine import stop_token_ids
    from framework.tokenizer import BUILTIN_FILE

    hf = HfTokenizer.from_file(str(BUILTIN_FILE))
    base = Tokenizer(hf, eos_token="<|endoftext|>")
    endoftext, im_end = hf.token_to_id("<|endoftext|>"), hf.token_to_id("<|im_end|>")
    config = preset_config("tiny", base.vocab_size, endoftext, base.pad_id)
    assert config.eos_token_id == endoftext
    with torch.device("meta"):
        model = Qwen3ForCausalLM(config)
    assert stop_token_ids(base, model) == sorted({endoftext, im_end})


def test_generation_config_eos_ids_stop_as_in_transformers(tmp_path):
    """Qwen3's released directories name <|im_end|> as eos in config.json and add <|endoftext|> in
    generation_config.json, which transformers' generate stops on. A model made to emit <|endoftext|> greedily
    stops at once in transformers' generate and in fw's."""
    transformers = pytest.importorskip("transformers")
    tok = Tokenizer.builtin()
    eot, im_end = tok.token_to_id("<|endoftext|>"), tok.token_to_id("<|im_end|>")
    torch.manual_seed(0)
    config = transformers.Qwen3Config(vocab_size=tok.vocab_size, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                      tie_word_embeddings=False, bos_token_id=eot, eos_token_id=im_end,
                                      pad_token_id=eot)
    hf = transformers.Qwen3ForCausalLM(config)
    with torch.no_grad():   # the residual stream is the embedding, whose column 0 makes <|endoftext|> win
        for layer in hf.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        hf.model.embed_tokens.weight[:, 0] = 10.0
        hf.lm_head.weight.zero_()
        hf.lm_head.weight[eot, 0] = 5.0
    hf.generation_config.eos_token_id = [im_end, eot]
    hf.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    prompt = tok.encode("1+1=")
    new = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0, len(prompt):].tolist()
    assert new == [eot]   # transformers stops on the generation config's second eos id
    cfg = resolve({"recipe": "grpo", "model": {"policy": {"path": str(tmp_path)}},
                   "data": {"task": {"name": "digits"}, "chat_template": False}, "rollout": {"max_new_tokens": 8}})
    assert generate_text(cfg, "1+1=", temperature=0.0) == ""


def test_a_missing_tokenizer_names_the_key_it_came_from(tmp_path):
    """fw generate and fw eval run without fw validate: a model directory without tokenizer.json, or a
    tokenizer.path without one, is named by its key."""
    tok = Tokenizer.builtin()
    model = Qwen3ForCausalLM(preset_config("tiny", tok.vocab_size, tok.eos_id, tok.pad_id))
    save_pretrained(model, tmp_path / "model")   # no tokenizer given: config.json and weights only
    assert not (tmp_path / "model" / "tokenizer.json").exists()
    base = {"recipe": "grpo", "data": {"task": {"name": "digits"}}, "rollout": {"max_new_tokens": 2}}
    cases = [({"model": {"policy": {"path": str(tmp_path / "model")}}}, "model.policy.path", tmp_path / "model"),
             ({"model": {"policy": {"preset": "tiny"}}, "tokenizer": {"path": str(tmp_path / "none")}},
              "tokenizer.path", tmp_path / "none")]
    for (settings, key, where), what in zip(cases, ("no tokenizer.json", "no such file or directory")):
        with pytest.raises(FwError) as e:
            generate_text(resolve({**base, **settings}), "hi", temperature=0.0)
        assert str(e.value).startswith(f"{key}: {where}: {what}"), str(e.value)


def test_a_checkpoints_config_imports_the_runs_modules_from_any_working_directory(tmp_path):
    """The README: class_path modules import from the working directory and the config file's directory. A
    checkpoint's config.yaml lies elsewhere, so it records those directories, and `fw eval --checkpoint` (which
    scores with the reward) run from a third directory finds the run's own reward module."""
    from framework.config import load_config
    from framework.trainer import fit

    project, elsewhere, run = tmp_path / "project", tmp_path / "elsewhere", tmp_path / "run"
    project.mkdir()
    elsewhere.mkdir()
    (project / "gen_walk_reward.py").write_text(
        "class Zero:\n    def __call__(self, prompt, completion, metadata):\n        return 0.0\n")
    (project / "c.yaml").write_text(
        f"recipe: grpo\nrun_dir: {run}\nmodel: {{policy: {{preset: tiny}}}}\n"
        "data: {task: {name: digits}, chat_template: false}\n"
        "rollout: {prompts_per_step: 2, max_new_tokens: 2}\ngrpo: {group_size: 2}\n"
        "reward: {class_path: gen_walk_reward.Zero}\n"
        "eval: {every_n_steps: null, max_prompts: 2, samples_per_prompt: 1, held_out: false}\n"
        "trainer: {accelerator: cpu, max_steps: 1, enable_progress_bar: false}\n"
        "logging: {csv: false, tensorboard: false}\n")
    fit(load_config([str(project / "c.yaml")]))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-m", "framework", "eval", "--checkpoint", str(run)], check=False,
                          cwd=elsewhere, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "gen_walk_reward.Zero" in done.stdout + (run / "eval" / "step-000001.json").read_text()


def test_a_module_only_training_uses_cannot_stop_generate_or_export(tmp_path, checkpoint):
    """A checkpoint taken to another machine without the run's reward and callback modules: `fw generate` and
    `fw export` build neither, so they work; `fw eval` scores with the reward and names the key it cannot import."""
    _, model, tok = checkpoint
    run = tmp_path / "run"
    ckpt = policy_checkpoint(model, tok, 4, tmp_path / "tok")
    cfg = make_cfg(chat_template=True)
    cfg["run_dir"] = str(run)
    cfg["reward"]["class_path"] = "fw_gone_reward_module.Reward"
    cfg["callbacks"] = [{"class_path": "fw_gone_callback_module.Callback", "init_args": {}}]
    path = ck.checkpoints_dir(run) / ck.step_dir_name(4)
    ck.write_checkpoint_dir(ckpt, path, cfg)
    env = {**os.environ, "PYTHONPATH": str(REPO)}

    def fw(*args):
        return subprocess.run([sys.executable, "-m", "framework", *args], check=False, cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=300)

    rendered = tok.apply_chat_template([{"role": "user", "content": "2+2="}], add_generation_prompt=True)
    done = fw("generate", "--checkpoint", str(path), "--prompt", "2+2=", "--greedy")
    assert (done.returncode, done.stdout) == (0, naive_greedy_text(model, tok, tok.encode(rendered), 9) + "\n"), \
        done.stderr[-2000:]
    done = fw("export", "--checkpoint", str(path), "--out", str(tmp_path / "hf"))
    assert done.returncode == 0, done.stderr[-2000:]
    assert (tmp_path / "hf" / "config.json").is_file()
    done = fw("eval", "--checkpoint", str(path))
    assert done.returncode == 2
    assert "reward.class_path" in done.stderr and "fw_gone_reward_module" in done.stderr, done.stderr
    assert "callbacks" not in done.stderr and "Traceback" not in done.stderr, done.stderr
