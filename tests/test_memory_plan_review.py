"""The KV budget against the rows a rollout or an evaluation generates: `fw validate` (and so `fw fit` before it
builds anything) refuses a row that the engine's pool cannot hold, where the config fixes the pool's budget, as the
engine refuses it at its first rollout; and the plan counts the CPU pool the engine makes."""

from itertools import pairwise

import pytest

from framework import memory_plan as mp
from framework.cli import main
from framework.config import resolve
from framework.models.presets import preset_config
from framework.recipe import BatchShapes, Requirements
from framework.rollout.engine import check_fresh_pool, row_states
from framework.rollout.kv_cache import CacheSettings
from framework.rollout.sampling import SamplingParams
from framework.rollout.scheduler import RowTooLong
from framework.tokenizer import Tokenizer

V = Tokenizer.builtin().vocab_size
# One block of the tiny preset's pool in float32 (train.yaml's 32-true): keys and values, 2 layers, 2 kv heads of 64,
# 16 positions, 4 bytes.
BLOCK = 2 * 2 * 2 * 64 * 16 * 4
TEN_BLOCKS_GIB = 10 * BLOCK / (1 << 30)   # a pool of 10 blocks: the scratch block and 9 for rows, 144 positions
PROMPT = 2   # the digits task's prompts ("3=") under the built-in character tokenizer, no chat template
MOST = 9 * 16 - PROMPT + 1   # every prompt token and every new token but the last is written: 143 new tokens fit


def validate(capsys, *overrides: str, tmp_path) -> tuple[int, str]:
    code = main(["validate", "--config", "train.yaml", f"--run_dir={tmp_path / 'run'}", *overrides])
    return code, capsys.readouterr().err


def engine_refuses(prompt_len: int, new_tokens: int, kv_cache_gib: float | None) -> bool:
    """Whether a fresh engine over the tiny float32 policy on the CPU refuses one row (the engine's own arithmetic)."""
    import torch

    settings = CacheSettings(kv_cache_gib, 256, 16, 8, "auto")
    try:
        check_fresh_pool(row_states([[1] * prompt_len], SamplingParams(max_new_tokens=new_tokens, temperature=1.0)),
                         settings, preset_config("tiny", V), torch.float32, torch.device("cpu"))
    except RowTooLong:
        return True
    return False


@pytest.fixture(autouse=True)
def _root(monkeypatch):
    from pathlib import Path

    monkeypatch.chdir(Path(__file__).resolve().parents[1])


@pytest.mark.parametrize("new_tokens", [MOST - 1, MOST, MOST + 1, 4000])
def test_validate_refuses_a_rollout_row_that_the_kv_budget_cannot_hold(tmp_path, capsys, new_tokens):
    refused = engine_refuses(PROMPT, new_tokens, TEN_BLOCKS_GIB)
    assert refused == (new_tokens > MOST)   # the engine's boundary, counted by hand
    code, err = validate(capsys, f"--rollout.kv_cache_gib={TEN_BLOCKS_GIB}", f"--rollout.max_new_tokens={new_tokens}",
                         tmp_path=tmp_path)
    assert code == (2 if refused else 0), err
    if refused:
        lines = [line for line in err.splitlines() if "rollout.max_new_tokens" in line]
        assert len(lines) == 1 and f"{MOST} at most" in lines[0] and "holds 9" in lines[0], err


def test_the_advice_of_a_kv_refusal_makes_the_job_valid(tmp_path, capsys):
    code, err = validate(capsys, f"--rollout.kv_cache_gib={TEN_BLOCKS_GIB}", "--rollout.max_new_tokens=4000",
                         tmp_path=tmp_path)
    assert code == 2
    gib = err.split("rollout.kv_cache_gib ")[-1].split(" or more")[0]
    need = -(-(PROMPT + 4000 - 1) // 16)   # 251 blocks for the row, and the scratch block
    assert int(float(gib) * (1 << 30)) // BLOCK >= need + 1
    assert int((float(gib) - 0.01) * (1 << 30)) // BLOCK < need + 1   # the least such budget in hundredths
    assert not engine_refuses(PROMPT, 4000, float(gib))
    assert validate(capsys, f"--rollout.kv_cache_gib={gib}", "--rollout.max_new_tokens=4000",
                    tmp_path=tmp_path)[0] == 0
    assert validate(capsys, f"--rollout.kv_cache_gib={TEN_BLOCKS_GIB}", f"--rollout.max_new_tokens={MOST}",
                    tmp_path=tmp_path)[0] == 0


def test_validate_refuses_an_eval_row_that_the_kv_budget_cannot_hold(tmp_path, capsys):
    """Evaluation generates on the rollout's pool settings with its own limit (train.yaml evaluates every 20 steps)."""
    budget = f"--rollout.kv_cache_gib={TEN_BLOCKS_GIB}"
    code, err = validate(capsys, budget, f"--eval.max_new_tokens={MOST + 1}", tmp_path=tmp_path)
    assert code == 2 and "eval.max_new_tokens" in err and f"{MOST} at most" in err, err
    assert "rollout.max_new_tokens" not in err
    assert validate(capsys, budget, f"--eval.max_new_tokens={MOST}", tmp_path=tmp_path)[0] == 0
    # no evaluation during training: nothing to refuse
    assert validate(capsys, budget, f"--eval.max_new_tokens={MOST + 1}", "--eval.every_n_steps=null",
                    tmp_path=tmp_path)[0] == 0


def test_a_cpu_jobs_fixed_pool_refuses_a_row_longer_than_it_and_a_gpu_jobs_is_left_to_the_plan(tmp_path, capsys):
    """kv_cache_gib null: on the CPU the engine's pool is a fixed 4 GiB; on a GPU it is what the GPU has free when the
    pool is made, which validate cannot know (the memory plan counts it)."""
    most = (4 * (1 << 30) // BLOCK - 1) * 16 - PROMPT + 1
    assert engine_refuses(PROMPT, most + 1, None) and not engine_refuses(PROMPT, most, None)
    code, err = validate(capsys, "--trainer.accelerator=cpu", f"--rollout.max_new_tokens={most + 1}",
                         tmp_path=tmp_path)
    assert code == 2 and f"{most} at most" in err, err
    assert validate(capsys, "--trainer.accelerator=cpu", f"--rollout.max_new_tokens={most}", tmp_path=tmp_path)[0] == 0
    assert validate(capsys, "--trainer.accelerator=gpu", f"--rollout.max_new_tokens={most + 1}",
                    tmp_path=tmp_path)[0] == 0


def test_the_cpu_plan_counts_the_pool_the_engine_makes_without_a_budget():
    """On the CPU, kv_cache_gib null gives the engine a 4 GiB pool however long the rollout: the plan counts that, not
    what every row could use at once."""
    cfg = resolve({"recipe": "grpo", "model": {"policy": {"preset": "tiny"}}})
    shapes = BatchShapes(rows=4, seq_len=PROMPT + 8000, loss_tokens=4 * 8000, rollout_rows=512, prompt_len=PROMPT,
                         new_tokens=8000)
    req = Requirements(automatic_optimization=False, reference_model=False)
    cpu = mp.build_plan(cfg, preset_config("tiny", V), req, shapes, backend="cpu")
    kv = next(r for r in cpu.rows if r.name == "KV cache")
    assert kv.bytes == (4 << 30) // BLOCK * BLOCK
    gpu = mp.build_plan(cfg, preset_config("tiny", V), req, shapes, backend="cuda")
    assert next(r for r in gpu.rows if r.name == "KV cache").bytes == (512 * -(-8001 // 16) + 1) * BLOCK


# ------------------------------------------------------------------------------ optimizer states, tensor by tensor

def _state_bytes(opt) -> int:
    """Bytes of an optimizer's per-parameter states as built: plain tensors, and an 8-bit moment's codes and block
    scales (its 256-entry code map and the step counters are constants a tensor, below the plan's resolution)."""
    import torch

    total = 0
    for state in opt.state.values():
        for key, t in state.items():
            if key == "step" or not isinstance(t, torch.Tensor):
                continue
            total += t.codes.nbytes + t.scale.nbytes if hasattr(t, "codes") else t.nbytes
    return total


def _tiny_tensors() -> list[int]:
    """The tiny preset's trainable tensors by hand: the tied embedding (103 x 64), then per layer qkv, o, gate_up,
    down and four norm gains (two of 64, q_norm and k_norm of head_dim 64), and the final norm."""
    layer = [64 * (256 + 2 * 128), 256 * 64, 64 * 2 * 192, 192 * 64, 64, 64, 64, 64]
    return [V * 64] + 2 * layer + [64]


def _8bit_bytes(sizes: list[int], plain_bytes: int) -> float:
    """torchao's AdamW8bit by hand: 8-bit codes and a float32 scale per 256 for a tensor of at least 4096 elements
    that 256 divides, else both moments in the parameter's dtype."""
    return sum(2 * (n + 4 * n / 256) if n >= 4096 and n % 256 == 0 else 2 * n * plain_bytes for n in sizes)


@pytest.mark.parametrize("setting", ["adamw8bit", "adamw8bit bf16 rounded", "adamw8bit lora", "adamw", "16-true"])
def test_the_states_row_is_the_bytes_the_optimizer_makes(setting):
    """fw's optimizer over the tiny preset on CPU, stepped once: the states it holds against the plan's row and a
    count by hand. AdamW8bit quantizes only tensors of at least 4096 elements that its 256-element block divides:
    the norms, the tiny preset's embedding (6,592 elements) and small LoRA factors keep plain moments."""
    pytest.importorskip("torchao")
    import torch

    from framework.models.lora import add_adapters
    from framework.models.qwen3 import Qwen3ForCausalLM
    from framework.optim import build_optimizer

    policy, trainer, optimizer = {
        "adamw8bit": ({}, {}, {"name": "adamw8bit"}),
        "adamw8bit bf16 rounded": ({"dtype": "bfloat16"}, {"precision": "bf16-true"},
                                   {"name": "adamw8bit", "stochastic_rounding": True}),
        "adamw8bit lora": ({"lora": {"rank": 8, "targets": ["q_proj", "down_proj"]}}, {}, {"name": "adamw8bit"}),
        "adamw": ({}, {}, {}),
        "16-true": ({}, {"precision": "16-true"}, {}),
    }[setting]
    cfg = resolve({"recipe": "sft", "model": {"policy": {"preset": "tiny", **policy}},
                   "trainer": {"accelerator": "cpu", **trainer}, "optimizer": optimizer})
    config = preset_config("tiny", V)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config)
    if "lora" in policy:
        add_adapters(model, cfg["model"]["policy"]["lora"])
    if "precision" in trainer:   # what Lightning's -true precisions do to the whole module
        model = model.to(getattr(torch, mp.CONVERTS_TO[trainer["precision"]]))
    opt = build_optimizer(model, cfg["optimizer"], cfg)
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    opt.step()
    plan = mp.build_plan(cfg, config, Requirements(automatic_optimization=True), None, backend="cpu")
    planned = next(r.bytes for r in plan.rows if r.name == "optimizer states")
    sizes = _tiny_tensors()
    assert sum(sizes) == 179_200
    if "lora" in policy:   # A [8, in] and B [out, 8] of q_proj (64 -> 256) and down_proj (192 -> 64), per layer
        sizes = 2 * [8 * 64, 256 * 8, 8 * 192, 64 * 8]
    by_hand = {"adamw8bit": _8bit_bytes(sizes, 4), "adamw8bit bf16 rounded": _8bit_bytes(sizes, 2),
               "adamw8bit lora": _8bit_bytes(sizes, 4), "adamw": 8 * sum(sizes), "16-true": 12 * sum(sizes)}[setting]
    assert _state_bytes(opt) == by_hand
    assert planned == by_hand, plan.table()


def test_the_critics_8bit_states_keep_its_small_tensors_plain():
    """PPO's critic: its trunk (no LM head) and v_head, a [1, 64] weight and a bias, all below AdamW8bit's 4096
    elements, with the norms and the tiny embedding, in plain float32 moments."""
    cfg = resolve({"recipe": "ppo", "model": {"policy": {"preset": "tiny"}}, "optimizer": {"name": "adamw8bit"}})
    plan = mp.build_plan(cfg, preset_config("tiny", V), Requirements(automatic_optimization=False, value_model=True),
                         None, backend="cpu")
    critic = _tiny_tensors() + [64, 1]
    value = next(r for r in plan.rows if r.name == "value model")
    assert value.bytes == sum(critic) * 4 + _8bit_bytes(critic, 4)   # weights and states; no autocast casts


# ------------------------------------------------------------------------------ properties over a grid of jobs

RL_REQ = {"grpo": Requirements(automatic_optimization=False, reference_model=True),
          "ppo": Requirements(automatic_optimization=False, reference_model=True, value_model=True)}


def _shapes(recipe: str, rows: int, prompt: int, new: int) -> BatchShapes:
    """A micro-batch of `rows` rows: SFT's of `prompt + new` tokens, RL's of a prompt and its completion, from a
    rollout of 4 x rows samples that the reference scores whole."""
    if recipe == "sft":
        return BatchShapes(rows=rows, seq_len=prompt + new, loss_tokens=rows * (prompt + new), packed=True)
    return BatchShapes(rows=rows, seq_len=prompt + new, loss_tokens=rows * new, packed=True, rollout_rows=4 * rows,
                       prompt_len=prompt, new_tokens=new, scoring_rows=4 * rows)


GRID_SETTINGS = {
    "float32": {},
    "bf16-mixed checkpointed": {"trainer": {"precision": "bf16-mixed"},
                                "model": {"policy": {"gradient_checkpointing": True}}},
    "selective lora": {"model": {"policy": {"gradient_checkpointing": "selective", "lora": {"rank": 8}}}},
    "bf16-true 8-bit": {"model": {"policy": {"dtype": "bfloat16"}}, "trainer": {"precision": "bf16-true"},
                        "optimizer": {"name": "adamw8bit", "stochastic_rounding": True}},
}


def _grid_cfg(recipe: str, setting: str, preset: str) -> dict:
    cfg: dict = {"recipe": recipe, "model": {"policy": {"preset": preset}}, "rollout": {"keep_engine": False}}
    for key, section in GRID_SETTINGS[setting].items():
        if key == "model":
            cfg["model"]["policy"].update(section["policy"])
        else:
            cfg[key] = section
    return resolve(cfg)


@pytest.mark.parametrize("recipe", ["sft", "grpo", "ppo"])
@pytest.mark.parametrize("setting", list(GRID_SETTINGS))
def test_more_rows_longer_sequences_and_a_larger_model_never_plan_less(recipe, setting):
    """The plan's total, and every phase, over micro-batches of 1 to 16 rows, prompts of 8 to 512 tokens and
    completions of 8 to 1024, on the tiny, small and 0.6B shapes: none grows and plans less."""
    req = RL_REQ.get(recipe, Requirements(automatic_optimization=True))
    models = {p: preset_config(p, V) for p in ("tiny", "small", "qwen3-0.6b")}

    def plan(preset: str, rows: int, prompt: int, new: int) -> mp.Plan:
        shapes = _shapes(recipe, rows, prompt, new)
        return mp.build_plan(_grid_cfg(recipe, setting, preset), models[preset], req, shapes, backend="cuda")

    def no_less(a: mp.Plan, b: mp.Plan, what: str) -> None:
        assert b.total_bytes >= a.total_bytes, what
        for phase in ("held", *mp.PHASES):
            assert b.phase_bytes(phase) >= a.phase_bytes(phase), (what, phase)

    for preset in models:
        for rows, more in pairwise([1, 2, 3, 8, 16]):
            no_less(plan(preset, rows, 64, 64), plan(preset, more, 64, 64), f"{preset}: rows {rows} -> {more}")
        for prompt, longer in pairwise([8, 9, 64, 512]):
            no_less(plan(preset, 4, prompt, 64), plan(preset, 4, longer, 64), f"{preset}: prompt {prompt} -> {longer}")
        for new, longer in pairwise([8, 16, 17, 256, 1024]):
            no_less(plan(preset, 4, 64, new), plan(preset, 4, 64, longer), f"{preset}: new {new} -> {longer}")
    for small, large in pairwise(models):
        no_less(plan(small, 4, 64, 64), plan(large, 4, 64, 64), f"{small} -> {large}")


def test_the_reference_model_is_counted_exactly_when_the_recipe_builds_one():
    """A frozen reference in the policy's dtype with a KL term (GRPO, PPO), none at kl_coef 0, and none under LoRA,
    whose base with the adapters off is the reference, unless model.reference.path names another model."""
    from framework.recipe import recipe_class

    policy = preset_config("tiny", V)
    other = preset_config("small", V)
    params = 179_200
    small = V * 256 + 4 * (256 * (512 + 2 * 256) + 512 * 256 + 256 * 2 * 768 + 768 * 256 + 2 * 256 + 2 * 64) + 256
    for recipe in ("grpo", "ppo"):
        for kl in (0.0, 0.05):
            for lora in (None, {"rank": 4}):
                for path, ref_cfg in ((None, None), ("somewhere", other)):
                    for precision, dtype, b in (("32-true", None, 4), ("bf16-mixed", None, 4),
                                                ("bf16-true", None, 2), ("32-true", "bfloat16", 2)):
                        cfg = resolve({"recipe": recipe, recipe: {"kl_coef": kl}, "trainer": {"precision": precision},
                                       "model": {"policy": {"preset": "tiny", "lora": lora, "dtype": dtype},
                                                 "reference": {"path": path}}})
                        req = recipe_class(recipe).requirements(cfg)
                        plan = mp.build_plan(cfg, policy, req, None, backend="cpu", reference=ref_cfg)
                        ref = [r for r in plan.rows if r.name == "reference model"]
                        built = kl > 0 and (lora is None or path is not None)
                        what = (recipe, kl, lora, path, precision, dtype)
                        assert len(ref) == built, what
                        if built:
                            assert ref[0].bytes == (small if path else params) * b, what


@pytest.mark.parametrize("job, gib", [
    (["recipes/sft.yaml", "--model.policy.preset=qwen3-0.6b", "--data.max_seq_len=4096", "--data.batch_size=16"], 40),
    (["recipes/sft.yaml", "--model.policy.preset=qwen3-1.7b", "--trainer.precision=bf16-mixed"], 24),
    (["recipes/grpo.yaml", "--model.policy.preset=qwen3-1.7b", "--rollout.max_new_tokens=2048"], 40),
    (["recipes/ppo.yaml", "--model.policy.preset=qwen3-0.6b", "--rollout.max_new_tokens=1024"], 16),
])
def test_each_suggestion_names_schema_keys_and_applied_plans_what_it_said(tmp_path, job, gib):
    """Over jobs that do not fit: every override a suggestion (or the combined one) gives is a key of the schema, and
    the config with it applied plans the total the suggestion says, fitting where it says it fits."""
    from framework.config import all_key_paths, load_config

    known = {".".join(p) for p in all_key_paths()}
    base = [f"--run_dir={tmp_path}", "--trainer.accelerator=gpu", *job[1:]]
    plan = mp.estimate(load_config([job[0]], base), gpu_gib=gib)
    assert plan.fits is False and plan.suggestions, plan.table()
    for s in plan.suggestions + ([plan.together] if plan.together else []):
        for override in s.overrides:
            assert override.startswith("--") and override[2:].split("=")[0] in known, override
        applied = mp.estimate(load_config([job[0]], base + list(s.overrides)), gpu_gib=gib)
        assert applied.total_bytes == pytest.approx(s.total_bytes), s.text
        assert applied.fits == bool(s.fits), s.text


@pytest.mark.parametrize("recipe, sections, rows, seq_len, loss_tokens", [
    # SFT: data.batch_size rows of data.max_seq_len, every token a target; accumulation adds micro-batches
    ("sft", {"data": {"batch_size": 6, "max_seq_len": 40}}, 6, 40, 240),
    # GRPO: 6 prompts x 4 samples in 2 minibatches of 2 micro-batches: 6 rows of the 2-token prompt + 30 new tokens
    ("grpo", {"rollout": {"prompts_per_step": 6}, "grpo": {"group_size": 4, "minibatches": 2}}, 6, 2 + 30, 6 * 30),
    # PPO: 5 prompts x 3 samples in one minibatch of 2 micro-batches: ceil(15 / 2) = 8 rows
    ("ppo", {"rollout": {"prompts_per_step": 5}, "ppo": {"samples_per_prompt": 3}}, 8, 2 + 30, 8 * 30),
])
def test_the_activations_are_counted_on_the_micro_batch_the_config_makes(tmp_path, recipe, sections, rows, seq_len,
                                                                         loss_tokens):
    """The plan of each recipe on the digits task (2-token prompts, no chat template), 2 micro-batches a step: its
    activation and logits rows are those of the micro-batch counted by hand (rows x (prompt + max_new_tokens) for RL,
    data.batch_size x data.max_seq_len for SFT), each prompt laid out in its row (shared_prompt false)."""
    from framework.recipe import recipe_class

    cfg: dict = {"recipe": recipe, "run_dir": str(tmp_path), "model": {"policy": {"preset": "tiny"}},
                 "trainer": {"accelerator": "cpu", "accumulate_grad_batches": 2},
                 "data": {"task": {"name": "digits", "init_args": {"num_digits": 1, "rule": "next"}},
                          "chat_template": False}}
    if recipe != "sft":
        cfg["rollout"] = {"max_new_tokens": 30}
        cfg[recipe] = {"shared_prompt": False}
    for key, section in sections.items():
        cfg.setdefault(key, {}).update(section)
    cfg = resolve(cfg)
    plan = mp.estimate(cfg)
    batch = 6 * 4 if recipe == "grpo" else 5 * 3
    shapes = (BatchShapes(rows=rows, seq_len=seq_len, loss_tokens=loss_tokens, packed=True) if recipe == "sft" else
              BatchShapes(rows=rows, seq_len=seq_len, loss_tokens=loss_tokens, packed=True, rollout_rows=batch,
                          prompt_len=PROMPT, new_tokens=30, scoring_rows=batch if recipe == "ppo" else 0))
    by_hand = mp.build_plan(cfg, preset_config("tiny", V), recipe_class(recipe).requirements(cfg), shapes,
                            backend="cpu")
    for name in ("activations", "logits buffers", "scoring forward", "critic update"):
        got, want = ([r for r in p.rows if r.name == name] for p in (plan, by_hand))
        assert [r.bytes for r in got] == [r.bytes for r in want], name
    assert f"{rows} rows x {seq_len}" in next(r for r in plan.rows if r.name == "activations").how
