"""The memory plan (framework/memory_plan.py): its arithmetic against hand counts of the tiny preset, the
activation formula against the bytes a real forward saves, `fw plan`, `fw fit`'s refusal, and on a GPU the
estimate against torch.cuda.max_memory_allocated."""

import gc
import json
import os
import subprocess
import sys
import weakref
from itertools import pairwise
from pathlib import Path

import pytest
import torch
from conftest import interrupt_once_started
from scripts.qwen_tokenizer import qwen_tokenizer_dir
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import ops_cuda
from framework import memory_plan as mp
from framework.cli import main
from framework.config import load_config, resolve
from framework.errors import FwError
from framework.models.presets import preset_config
from framework.models.qwen3 import Qwen3ForCausalLM
from framework.models.qwen3_config import Qwen3Config
from framework.recipe import BatchShapes, Requirements
from framework.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[1]
TRAIN = str(ROOT / "train.yaml")
V = Tokenizer.builtin().vocab_size   # the tiny preset's vocabulary: the built-in tokenizer's
# The tiny preset by hand: hidden 64, intermediate 192, 2 layers, 4 query heads and 2 kv heads of 64, tied.
D, INTER, LAYERS, Q, KV, HEADS = 64, 192, 2, 4 * 64, 2 * 64, 4
LAYER_PARAMS = D * (Q + 2 * KV) + Q * D + D * 2 * INTER + INTER * D + 2 * D + 2 * 64
PARAMS = V * D + LAYERS * LAYER_PARAMS + D


def tiny(recipe: str = "sft", run_dir: str | None = None, **sections) -> dict:
    cfg = {"recipe": recipe, "model": {"policy": {"preset": "tiny"}}, **({"run_dir": run_dir} if run_dir else {})}
    for key, value in sections.items():
        cfg.setdefault(key, {}).update(value)
    return resolve(cfg)


def plan_of(cfg: dict, shapes: BatchShapes | None = None, backend: str = "cpu", **kw) -> mp.Plan:
    req = Requirements(automatic_optimization=cfg["recipe"] == "sft",
                       reference_model=cfg["recipe"] == "grpo" and cfg["grpo"]["kl_coef"] > 0)
    return mp.build_plan(cfg, preset_config("tiny", V), req, shapes, backend=backend, **kw)


def row(plan: mp.Plan, name: str) -> mp.Row:
    return next(r for r in plan.rows if r.name == name)


SFT_SHAPES = BatchShapes(rows=2, seq_len=16, loss_tokens=32, packed=True)


# ------------------------------------------------------------------------------------------ hand counts

def test_tiny_sft_plan_matches_a_hand_count():
    cfg = tiny("sft", data={"batch_size": 2, "max_seq_len": 16})
    plan = plan_of(cfg, SFT_SHAPES)
    assert PARAMS == 179_200
    assert row(plan, "policy weights").bytes == PARAMS * 4
    assert row(plan, "gradients").bytes == PARAMS * 4
    assert row(plan, "optimizer states").bytes == 2 * 4 * PARAMS
    # one layer per token, float32: the layer input and mid-point; normed input, qkv, rotated q and k with v's copy
    # (packed rows through varlen attention: no mask, no repeated K/V), attention output, normed mid-point,
    # gate_up, swiglu; logsumexp
    per_layer = 2 * D * 4 + (D + (Q + 2 * KV) + (Q + 2 * KV) + Q + D + 2 * INTER + INTER) * 4 + HEADS * 4
    assert per_layer == 8464
    outside = 8 + 8 + D * 4   # input ids, positions, the final norm's input
    tokens = 2 * 16
    expected = tokens * (LAYERS * per_layer + mp.BACKWARD_IN_FLIGHT_LAYERS * per_layer + outside)
    assert row(plan, "activations").bytes == expected
    # float32: the loss recomputes its logits (no kept float16 copy); the reference's float32 tiles of all 32 rows
    logits = (32 * (D * 4 + 8 + 4 + 4 + 16) + 32 * mp.LOSS_BYTES_PER_TOKEN
              + mp.REFERENCE_LOGITS_TILES * 32 * V * 4 + V * D * 4)
    assert row(plan, "logits buffers").bytes == logits
    # CPU: AdamW's loop over parameters holds sqrt(v) and its quotient of one tensor beside the previous tensor's
    # quotient; in the matrices' order (the tied embedding, then each layer's qkv, o, gate_up and down) the most is
    # the first layer's down_proj quotient beside the second's qkv_proj's two
    matrices = [V * D] + [D * (Q + 2 * KV), Q * D, D * 2 * INTER, INTER * D] * LAYERS
    loop = max([2 * matrices[0]] + [a + 2 * b for a, b in pairwise(matrices)])
    assert loop == INTER * D + 2 * D * (Q + 2 * KV)
    assert row(plan, "optimizer step buffers").bytes == loop * 4
    held = PARAMS * 4 + 2 * 4 * PARAMS
    assert plan.total_bytes == held + PARAMS * 4 + expected + logits
    assert not any(r.name == "CUDA context" for r in plan.rows)


def test_keep_engine_holds_the_kv_cache_through_every_phase_when_it_fits():
    """rollout.keep_engine: kept, the KV cache (8 rows of one 16-position block + scratch, by hand) is held, so it
    adds its bytes to the train-phase peak; handed back, it counts in the rollout phase only. "auto" keeps it
    when the GPU holds the kept plan, hands it back when only the other fits, and keeps it with no limit."""
    shapes = BatchShapes(rows=4, seq_len=10 + 6, loss_tokens=4 * 6, rollout_rows=8, prompt_len=10, new_tokens=6)
    kv = 2 * LAYERS * (8 + 1) * 2 * 16 * 64 * 4   # float32: k and v, 2 layers, 9 blocks, 2 kv heads of 64
    kept = plan_of(tiny("grpo", rollout={"keep_engine": True}), shapes)
    back = plan_of(tiny("grpo", rollout={"keep_engine": False}), shapes)
    assert row(kept, "KV cache").phases == ("held",) and row(back, "KV cache").phases == ("rollout",)
    assert row(kept, "KV cache").bytes == row(back, "KV cache").bytes == kv
    assert kept.keeps_engine is True and back.keeps_engine is False
    assert back.peak_phase == "train" and kept.total_bytes == back.total_bytes + kv
    auto = tiny("grpo")
    assert plan_of(auto, shapes).keeps_engine is True   # no limit known
    roomy = plan_of(auto, shapes, limit_bytes=kept.total_bytes)
    tight = plan_of(auto, shapes, limit_bytes=kept.total_bytes - 1)
    assert roomy.keeps_engine is True and roomy.total_bytes == kept.total_bytes
    assert tight.keeps_engine is False and tight.total_bytes == back.total_bytes and tight.fits
    assert "handed back after each rollout" in row(tight, "KV cache").how
    assert plan_of(tiny("sft"), SFT_SHAPES).keeps_engine is None   # nothing generates



def test_a_kept_engine_under_autocast_holds_its_weight_casts_through_the_update():
    """float32 weights under bf16-mixed: the rollout engine multiplies by its own bf16 copies of the matmul weights
    (the projections and the tied embedding, 2 bytes each, by hand). Kept, they add their bytes to the update's
    phases; handed back, or without autocast, or with LoRA (whose layers autocast casts), there is no such row."""
    shapes = BatchShapes(rows=4, seq_len=10 + 6, loss_tokens=4 * 6, rollout_rows=8, prompt_len=10, new_tokens=6)
    matmul = V * D + LAYERS * (D * (Q + 2 * KV) + Q * D + D * 2 * INTER + INTER * D)
    mixed = {"precision": "bf16-mixed"}
    kept = plan_of(tiny("grpo", trainer=mixed, rollout={"keep_engine": True}), shapes)
    # held through the update: its forward, the end of its backward (one micro-batch a step) and its step
    assert row(kept, mp.ENGINE_CASTS).bytes == matmul * 2
    assert row(kept, mp.ENGINE_CASTS).phases == ("train", "backward", "step")
    back = plan_of(tiny("grpo", trainer=mixed, rollout={"keep_engine": False}), shapes)
    assert kept.phase_bytes("train") == back.phase_bytes("train") + matmul * 2
    assert kept.phase_bytes("rollout") == back.phase_bytes("rollout") - row(back, "KV cache").bytes   # now held
    for cfg in (tiny("grpo", trainer=mixed, rollout={"keep_engine": False}),
                tiny("grpo", rollout={"keep_engine": True}),
                tiny("grpo", trainer=mixed, rollout={"keep_engine": True},
                     model={"policy": {"preset": "tiny", "lora": {"rank": 4, "targets": ["q_proj"]}}})):
        assert not any(r.name == mp.ENGINE_CASTS for r in plan_of(cfg, shapes).rows)
    # "auto" that cannot keep the engine drops both the held KV cache and the casts
    tight = plan_of(tiny("grpo", trainer=mixed), shapes, limit_bytes=kept.total_bytes - 1)
    assert tight.keeps_engine is False and not any(r.name == mp.ENGINE_CASTS for r in tight.rows)
    assert tight.total_bytes == back.total_bytes

def test_a_float8_kv_cache_counts_one_byte_an_element():
    """rollout.kv_cache_dtype float8_e4m3 under bf16-mixed: the KV cache row is half the bfloat16 one (8 rows of one
    16-position block and the scratch block, 1 byte an element), and a kv_cache_gib budget holds twice the blocks."""
    shapes = BatchShapes(rows=4, seq_len=10 + 6, loss_tokens=4 * 6, rollout_rows=8, prompt_len=10, new_tokens=6)

    def kv(dtype, **rollout):
        cfg = tiny("grpo", trainer={"precision": "bf16-mixed"}, rollout={"kv_cache_dtype": dtype, **rollout})
        return row(plan_of(cfg, shapes, backend="cuda"), "KV cache")

    assert kv("float8_e4m3").bytes == 2 * LAYERS * (8 + 1) * 2 * 16 * 64 * 1 == kv("auto").bytes // 2
    budget = {"kv_cache_gib": 4 * 2 * LAYERS * 2 * 16 * 64 * 2 / (1 << 30)}   # 4 bfloat16 blocks
    fp8, bf16 = kv("float8_e4m3", **budget), kv("auto", **budget)
    assert fp8.bytes == bf16.bytes == 4 * 2 * LAYERS * 2 * 16 * 64 * 2
    assert ": 8 blocks of 16 positions" in fp8.how and ": 4 blocks of 16 positions" in bf16.how


def test_grpo_kv_cache_reference_and_cuda_rows_by_hand():
    cfg = tiny("grpo", grpo={"kl_coef": 0.1}, trainer={"precision": "bf16-mixed"})
    shapes = BatchShapes(rows=4, seq_len=10 + 6, loss_tokens=4 * 6, rollout_rows=8, prompt_len=10, new_tokens=6,
                         scoring_rows=8)
    plan = plan_of(cfg, shapes, backend="cuda")
    # the paged cache in autocast's bfloat16: k and v, 2 layers, 8 rows of one 16-position block (10 prompt + 5
    # written new tokens) and the scratch block, 2 kv heads, head_dim 64
    assert row(plan, "KV cache").bytes == 2 * LAYERS * (8 + 1) * 2 * 16 * 64 * 2
    capped = plan_of(tiny("grpo", grpo={"kl_coef": 0.1}, trainer={"precision": "bf16-mixed"},
                          rollout={"kv_cache_gib": 4 * 2 * LAYERS * 2 * 16 * 64 * 2 / (1 << 30)}), shapes,
                     backend="cuda")
    assert row(capped, "KV cache").bytes == 4 * 2 * LAYERS * 2 * 16 * 64 * 2   # the budget: 4 blocks
    assert row(plan, "reference model").bytes == PARAMS * 4     # a float32 copy of the policy
    # autocast's cached casts: every projection and the (tied) LM head in bfloat16, not the norms
    assert row(plan, "autocast weight casts").bytes == (LAYERS * (LAYER_PARAMS - 2 * D - 2 * 64) + V * D) * 2
    assert row(plan, "CUDA context").outside_allocator
    assert plan.allocated_bytes == plan.total_bytes - mp.CUDA_CONTEXT_BYTES
    # mixed precision: residual stream float32, matmul operands bfloat16; not packed: no mask. Kept: the normed
    # input, qkv, q and k after RoPE with v's copy, attention's output, the normed mid-point, gate_up's and swiglu's
    # outputs
    per_layer = 2 * D * 4 + (D + (Q + 2 * KV) + (Q + 2 * KV) + Q + D + 2 * INTER + INTER) * 2 + HEADS * 4
    assert mp.layer_saved_bytes(preset_config("tiny", V), 16, False, 4, 2, "cuda") == per_layer
    # bf16 operands keep the loss's logits in float16 (keep_logits null, no checkpointing), with chunk offsets
    assert "kept float16 logits" in row(plan, "logits buffers").how
    assert plan.peak_phase in mp.PHASES and plan.total_bytes == plan.phase_bytes("held") + max(
        plan.phase_bytes(p) for p in mp.PHASES)


# ------------------------------------------------------------------------------------------ options move rows

def test_each_optimizer_option_moves_the_states_row_by_its_bytes():
    base = row(plan_of(tiny()), "optimizer states").bytes
    eight = plan_of(tiny(optimizer={"name": "adamw8bit"}))
    assert base == 8 * PARAMS
    # AdamW8bit quantizes tensors of at least 4096 elements that its 256-element block divides: the layers'
    # projections; the norms and the tiny embedding (103 x 64 = 6,592) keep plain float32 moments
    plain = V * D + LAYERS * (2 * D + 2 * 64) + D
    assert row(eight, "optimizer states").bytes == (PARAMS - plain) * 2 * (1 + 4 / 256) + plain * 2 * 4
    offload = plan_of(tiny(optimizer={"cpu_offload": True}), backend="cuda")
    states = row(offload, "optimizer states")
    assert states.bytes == 0 and states.host_bytes == 8 * PARAMS + 2 * 4 * PARAMS
    assert offload.host_bytes == states.host_bytes
    # float16 weights: float32 moments and master copy (framework/optim.py Float32StateAdamW), fused, with one
    # parameter's gradient in float32 in the step
    half = plan_of(tiny(trainer={"precision": "16-true"}))
    assert row(half, "optimizer states").bytes == 12 * PARAMS and row(half, "gradients").bytes == 2 * PARAMS
    assert row(half, "optimizer step buffers").bytes == 4 * D * (Q + 2 * KV)
    half_offload = plan_of(tiny(trainer={"precision": "16-true"}, optimizer={"cpu_offload": True}), backend="cuda")
    assert row(half_offload, "optimizer states").host_bytes == 12 * PARAMS + 2 * 2 * PARAMS
    # bfloat16 weights with stochastic rounding: weights, gradients and 8-bit moments at 2 + 2 + 2.03 B/param (the
    # small tensors' plain moments in bfloat16)
    lean = plan_of(tiny(model={"policy": {"preset": "tiny", "dtype": "bfloat16"}}, trainer={"precision": "bf16-true"},
                        optimizer={"name": "adamw8bit", "stochastic_rounding": True}))
    assert [row(lean, n).bytes for n in ("policy weights", "gradients", "optimizer states")] == [
        2 * PARAMS, 2 * PARAMS, (PARAMS - plain) * 2 * (1 + 4 / 256) + plain * 2 * 2]


def test_lora_trains_only_the_adapters_and_drops_the_reference_copy():
    lora = {"rank": 8, "targets": ["q_proj", "v_proj"]}
    full = plan_of(tiny("grpo", grpo={"kl_coef": 0.1}))
    cfg = tiny("grpo", grpo={"kl_coef": 0.1}, model={"policy": {"preset": "tiny", "lora": lora}})
    adapted = plan_of(cfg)
    adapters = LAYERS * 8 * ((D + Q) + (D + KV))    # A [8, in] and B [out, 8] for q_proj and v_proj
    assert row(adapted, "LoRA adapters").bytes == adapters * 4
    assert row(adapted, "gradients").bytes == adapters * 4
    assert row(adapted, "optimizer states").bytes == adapters * 8
    assert row(adapted, "policy weights").bytes == row(full, "policy weights").bytes == PARAMS * 4
    assert row(full, "reference model").bytes == PARAMS * 4
    assert not any(r.name == "reference model" for r in adapted.rows)   # the base with the adapters off


@pytest.mark.parametrize("lora", [None, {"rank": 4, "targets": ["q_proj"]}])
def test_the_critic_is_counted_in_the_dtype_fit_builds_it(tmp_path, lora):
    """PPO on a bfloat16 policy: the critic that FwModule builds is bfloat16 with full fine-tuning, float32 under
    LoRA (it trains every weight, as the adapters do): the plan's value model row is its parameters' bytes, as built,
    and AdamW's two moments in the same dtype."""
    from framework.module import FwModule

    optimizer = {"stochastic_rounding": True} if lora is None else {}   # bf16 weights need it to train
    cfg = tiny("ppo", run_dir=str(tmp_path), model={"policy": {"preset": "tiny", "dtype": "bfloat16", "lora": lora}},
               trainer={"accelerator": "cpu"}, optimizer=optimizer, data={"task": {"name": "digits"}})
    value = FwModule(cfg).value
    built = sum(p.numel() * p.element_size() for p in value.parameters())
    assert {p.dtype for p in value.parameters()} == {torch.float32 if lora else torch.bfloat16}
    plan = mp.build_plan(cfg, preset_config("tiny", V), Requirements(automatic_optimization=False, value_model=True),
                         None, backend="cpu")
    assert row(plan, "value model").bytes == built + 2 * built


def test_gradient_checkpointing_keeps_layer_inputs_and_one_recompute():
    cfg = tiny(data={"batch_size": 2, "max_seq_len": 16})
    ckpt = tiny(data={"batch_size": 2, "max_seq_len": 16},
                model={"policy": {"preset": "tiny", "gradient_checkpointing": True}})
    per_layer = mp.layer_saved_bytes(preset_config("tiny", V), 16, True, 4, 4, "cpu")
    full = row(plan_of(cfg, SFT_SHAPES), "activations").bytes
    kept = row(plan_of(ckpt, SFT_SHAPES), "activations").bytes
    assert full - kept == 32 * (LAYERS * per_layer - LAYERS * D * 4 - per_layer)
    # under bf16 checkpointing also turns the kept logits off (keep_logits null), explicit keep_logits wins
    bf16 = {"trainer": {"precision": "bf16-mixed"}}
    keeps = row(plan_of(tiny(**bf16), SFT_SHAPES), "logits buffers")
    recomputes = row(plan_of(tiny(model={"policy": {"preset": "tiny", "gradient_checkpointing": True}}, **bf16),
                             SFT_SHAPES), "logits buffers")
    forced = row(plan_of(tiny(model={"policy": {"preset": "tiny", "gradient_checkpointing": True,
                                                 "keep_logits": True}}, **bf16), SFT_SHAPES), "logits buffers")
    kept_bytes = 32 * V * 2 + 32 * -(-V // 256) * 4
    assert "kept" in keeps.how and "kept" not in recomputes.how and forced.bytes == keeps.bytes
    assert keeps.bytes - kept_bytes == recomputes.bytes - mp.REFERENCE_LOGITS_TILES * 32 * V * 4


def test_recipes_declare_their_micro_batch_shapes(tmp_path):
    from recipes.grpo import GRPORecipe
    from recipes.sft import SFTRecipe

    tok = Tokenizer.builtin()
    sft = SFTRecipe.batch_shapes(tiny(data={"batch_size": 3, "max_seq_len": 40}), tok)
    assert (sft.rows, sft.seq_len, sft.loss_tokens, sft.packed, sft.rollout_rows) == (3, 40, 120, True, 0)
    prompts = tmp_path / "p.jsonl"
    texts = ["ab", "a much longer prompt than the rest", "xyz"]
    prompts.write_text("".join(json.dumps({"prompt": t, "answer": "1"}) + "\n" for t in texts))
    cfg = tiny("grpo", data={"path": str(prompts), "chat_template": False},
               rollout={"prompts_per_step": 3, "max_new_tokens": 5},
               grpo={"group_size": 2, "minibatches": 2}, trainer={"accumulate_grad_batches": 2})
    shapes = GRPORecipe.batch_shapes(cfg, tok)
    # the largest micro-batch the update loop forms: 6 rows -> minibatches of 3 -> micro-batches of 2 and 1
    recipe = GRPORecipe(cfg, tok)
    largest = max(len(m) for mb in recipe.minibatches(6, 0) for m in mb)
    assert (shapes.rows, largest) == (2, 2)
    # the built-in tokenizer has one token per character: the longest prompt is 34 tokens
    assert (shapes.prompt_len, shapes.new_tokens, shapes.seq_len) == (len(texts[1]), 5, len(texts[1]) + 5)
    assert (shapes.rollout_rows, shapes.loss_tokens, shapes.scoring_rows) == (6, 10, 0)


def test_the_longest_prompt_of_a_dataset_counts_wherever_it_lies(tmp_path):
    """RL prompts are never truncated, so the plan's prompt length is the dataset's longest prompt, here the last
    of 5,000 rows (not shuffled: the last drawn), 3,000 characters: 3,000 tokens of the built-in tokenizer."""
    from recipes.grpo import GRPORecipe

    prompts = tmp_path / "p.jsonl"
    rows = ["ab"] * 4999 + ["x" * 3000]
    prompts.write_text("".join(json.dumps({"prompt": t, "answer": "1"}) + "\n" for t in rows))
    cfg = tiny("grpo", data={"path": str(prompts), "chat_template": False, "shuffle": False},
               rollout={"max_new_tokens": 5})
    shapes = GRPORecipe.batch_shapes(cfg, Tokenizer.builtin())
    assert (shapes.prompt_len, shapes.seq_len) == (3000, 3005)
    # a file rewritten in place is read again
    prompts.write_text("".join(json.dumps({"prompt": t, "answer": "1"}) + "\n" for t in rows[:-1] + ["y" * 3001]))
    assert GRPORecipe.batch_shapes(cfg, Tokenizer.builtin()).prompt_len == 3001


def _byte_bpe(merges: list[tuple[str, str]], normalizer: str = "NFC") -> Tokenizer:
    """A byte-level BPE under NFC (Qwen3's tokenizer's normalizer) or another normalizer, with Qwen3's chat tokens
    and the given merges."""
    from tokenizers import AddedToken, models, normalizers, pre_tokenizers
    from tokenizers import Tokenizer as HfTokenizer

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {c: i for i, c in enumerate(sorted(alphabet))}
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tk = HfTokenizer(models.BPE(vocab=vocab, merges=merges))
    tk.normalizer = getattr(normalizers, normalizer)()
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False)
                           for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")])
    return Tokenizer(tk, source="test byte-level BPE")


@pytest.mark.parametrize("tokenizer", ["builtin", "qwen3", "byte-bpe", "byte-bpe-merges", "byte-bpe-nfkc"])
@pytest.mark.parametrize("chat_template", [False, True])
def test_the_longest_prompt_equals_the_most_tokens_of_any_prompt(tmp_path, tokenizer, chat_template):
    """longest_prompt tokenizes only the prompts whose bound on their tokens can still beat the longest found: its
    answer is the most tokens the tokenizer gives any prompt of the file. Among them: U+0958, which NFC turns from 3
    bytes into 6 (a bound on the raw bytes would stop at the 700 z's before it), special tokens (many bytes, one
    token), letters that the merges pack up to four to a token, and characters the built-in tokenizer does not know
    (one <unk> each). Under NFKC, which gives no bound, U+FDFA is 18 characters, 33 bytes: every prompt is
    tokenized."""
    from recipes.rl import longest_prompt

    tok = {"builtin": Tokenizer.builtin, "qwen3": lambda: Tokenizer.from_pretrained(qwen_tokenizer_dir()),
           "byte-bpe": lambda: _byte_bpe([]),
           "byte-bpe-merges": lambda: _byte_bpe([("a", "a"), ("aa", "aa")]),
           "byte-bpe-nfkc": lambda: _byte_bpe([], "NFKC")}[tokenizer]()
    texts = ["z" * 700, "\u0958" * 200 + "b", "a" * 650, "<|im_end|>" * 70, "e\u0301" * 60, "\u00e9" * 130, "ab " * 90,
             "\ufdfa" * 40]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": t, "answer": "1"}) + "\n" for t in texts))
    cfg = tiny("grpo", data={"path": str(prompts), "chat_template": chat_template})
    render = (lambda t: tok.apply_chat_template([{"role": "user", "content": t}])) if chat_template else str
    assert longest_prompt(cfg, tok) == max(len(tok.encode(render(t))) for t in texts)
    if tokenizer == "byte-bpe":   # NFC's 6 bytes a character, one token each
        assert longest_prompt(cfg, tok) == 1201 + (len(tok.encode(render(""))) if chat_template else 0)
    if tokenizer == "byte-bpe-nfkc":
        assert longest_prompt(cfg, tok) == 40 * 33 + (len(tok.encode(render(""))) if chat_template else 0)


@pytest.mark.parametrize("group, micro, minibatches", [(8, 2, 1), (8, 3, 1), (4, 3, 2)])
def test_shared_prompts_count_each_reached_groups_prompt_once(tmp_path, group, micro, minibatches):
    """The activations cover the micro-batch of most tokens that minibatches() forms: its completions, and each
    group's prompt once (twice where a cut divides the group)."""
    from recipes.grpo import GRPORecipe

    tok = Tokenizer.builtin()
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": "x" * n, "answer": "1"}) + "\n" for n in (7, 30, 12)))
    base = {"data": {"path": str(prompts), "chat_template": False},
            "rollout": {"prompts_per_step": 3, "max_new_tokens": 5}, "trainer": {"accumulate_grad_batches": micro}}
    cfg = tiny("grpo", grpo={"group_size": group, "minibatches": minibatches, "shared_prompt": True}, **base)
    shapes = GRPORecipe.batch_shapes(cfg, tok)
    recipe = GRPORecipe(cfg, tok)
    micro_batches = [m for mb in recipe.minibatches(3 * group, 0) for m in mb]
    most = max(len(m) * 5 + len(torch.unique(m // group)) * 30 for m in micro_batches)
    assert shapes.tokens == most < shapes.rows * shapes.seq_len
    plain = tiny("grpo", grpo={"group_size": group, "minibatches": minibatches}, **base)
    plain_shapes = GRPORecipe.batch_shapes(plain, tok)
    assert plain_shapes.tokens == 0
    shared, whole = row(plan_of(cfg, shapes), "activations"), row(plan_of(plain, plain_shapes), "activations")
    assert shared.bytes / whole.bytes == pytest.approx(most / (shapes.rows * shapes.seq_len))
    assert f"{most:,} tokens ({shapes.rows} rows of at most {shapes.seq_len}, each group's prompt once)" in shared.how


# ------------------------------------------------------------------------------------------ real saved bytes

def _is_param_cast(t: torch.Tensor, frozen: list[torch.Tensor]) -> bool:
    """Whether `t` (or its transpose, as nn.Linear saves it) is autocast's cast of a parameter: a trained one's,
    recorded by autograd, or a frozen one's (LoRA's base), equal to it in the lower precision."""
    grad_fn = t.grad_fn
    if type(grad_fn).__name__ == "TBackward0":   # nn.Linear saves the transposed weight
        grad_fn = grad_fn.next_functions[0][0]
    if grad_fn is not None:
        return type(grad_fn).__name__ == "ToCopyBackward0" and any(
            type(f).__name__ == "AccumulateGrad" for f, _ in grad_fn.next_functions if f is not None)
    views = (t, t.t()) if t.dim() == 2 else (t,)
    return any(x.shape == p.shape and x.dtype != p.dtype and torch.equal(x, p.to(x.dtype))
               for x in views for p in frozen)


def _saved_bytes(model, ids, positions, autocast: bool) -> tuple[int, int]:
    """(bytes of the distinct storages a forward saves for backward, excluding parameters and their autocast
    casts; bytes of those casts)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    frozen = [p for p in model.parameters() if not p.requires_grad]
    seen: dict[int, int] = {}
    casts: dict[int, int] = {}

    def pack(t):
        key = t.untyped_storage().data_ptr()
        if key not in params:
            (casts if _is_param_cast(t, frozen) else seen)[key] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
            torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        model(ids, position_ids=positions, return_hidden=True)
    return sum(seen.values()), sum(casts.values())


ALL = list(mp.LORA_TARGETS)


@pytest.mark.parametrize("dtype,autocast,packed,targets,dropout", [
    (torch.float32, False, False, None, 0), (torch.float32, False, True, None, 0),
    (torch.bfloat16, False, False, None, 0), (torch.float32, True, False, None, 0),
    (torch.float32, True, True, None, 0),
    # LoRA: frozen projections keep nothing of their inputs, and the first layer, with no gradient into it, keeps
    # nothing before its first adapter
    (torch.float32, False, False, ALL, 0), (torch.float32, False, True, ["q_proj", "v_proj"], 0),
    (torch.float32, False, False, ["down_proj"], 0), (torch.float32, True, False, ["gate_proj"], 0),
    (torch.float32, True, True, ["o_proj", "down_proj"], 0.1),
    (torch.float32, False, False, ["k_proj", "up_proj"], 0.1),
    # LoRA on a bfloat16 base without autocast: the adapters multiply float32 copies of their inputs, and o_proj's
    # input is kept twice (the attention's bfloat16 output and A's float32 copy)
    (torch.bfloat16, False, False, ALL, 0), (torch.bfloat16, False, True, ["q_proj", "o_proj", "down_proj"], 0),
    (torch.bfloat16, False, False, ["gate_proj", "up_proj"], 0.1)])
def test_activation_formula_equals_the_bytes_a_forward_saves(dtype, autocast, packed, targets, dropout):
    from framework.models.lora import add_adapters

    config = preset_config("small", V)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).to(dtype)
    lora = None if targets is None else {"rank": 8, "alpha": 16, "dropout": dropout, "targets": targets}
    if lora is not None:
        add_adapters(model, lora)
    B, T = 2, 24
    ids = torch.randint(0, V, (B, T))
    positions = torch.cat([torch.arange(10), torch.arange(T - 10)]).expand(B, T).contiguous() if packed else None
    saved, casts = _saved_bytes(model, ids, positions, autocast)
    res = torch.finfo(dtype).bits // 8
    comp = 2 if autocast else res
    adapter = comp if autocast else 4   # the adapters are float32 (add_adapters), as under the default precision
    per_layer = mp.layer_saved_bytes(config, T, packed, res, comp, backend="cpu", lora=lora, adapter_bytes=adapter)
    outside = mp.model_saved_bytes(config, res, trains_embedding=lora is None)
    bounds = 4 * (2 * B + 1) if packed else 0   # cu_seqlens of the 2 B sequences, shared by every layer
    first = copies = 0.0
    if lora is not None:
        first = mp.first_layer_unsaved_bytes(config, res, comp, lora, backend="cpu", adapter_bytes=adapter)
        copies = mp.lora_weight_copies_bytes(config, lora, adapter)
    expected = B * T * (config.num_hidden_layers * per_layer - first + outside) + copies + bounds
    assert saved == pytest.approx(expected, rel=0, abs=0.5)
    if lora is None:
        counts = mp.param_counts(config)
        assert casts == (counts.matmul - counts.embed) * 2 * autocast   # the LM head is cast by the loss, below


class _Made(TorchDispatchMode):
    """Every tensor an op makes inside the mode, by weak reference, and whether it is a cast of a parameter."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        super().__init__()
        self.params = {id(p) for p in params}
        self.made: list[tuple[weakref.ref, int, int, bool]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        cast = func is torch.ops.aten._to_copy.default and id(args[0]) in self.params
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                s = t.untyped_storage()
                self.made.append((weakref.ref(t), s.data_ptr(), s.nbytes(), cast))
        return out


@pytest.mark.parametrize("dtype,autocast,targets,dropout", [
    (torch.float32, True, ALL, 0), (torch.float32, False, ["down_proj"], 0),
    (torch.float32, True, ["q_proj", "v_proj"], 0), (torch.float32, False, ["o_proj"], 0.1),
    (torch.float32, True, ["gate_proj", "up_proj", "down_proj"], 0),
    # a bfloat16 base without autocast: A's float32 copy of SwiGLU's output is kept, not recomputed
    (torch.bfloat16, False, ALL, 0), (torch.bfloat16, False, ["down_proj"], 0)])
def test_selective_recomputation_under_lora_keeps_the_bytes_the_formula_counts(dtype, autocast, targets, dropout):
    """gradient_checkpointing selective with adapters (whose saved tensors the recomputation's hooks take over, so
    they are measured as the storages the forward leaves alive, less the parameters, their casts and the output):
    a norm's output feeding an adapter is kept, SwiGLU's output is recomputed, and the first layer keeps nothing
    before its first adapter but what a recomputation needs."""
    from framework.models.lora import add_adapters

    config = preset_config("small", V)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).to(dtype)
    lora = {"rank": 8, "alpha": 16, "dropout": dropout, "targets": targets}
    add_adapters(model, lora)
    model.gradient_checkpointing = "selective"
    B, T = 2, 24
    ids = torch.randint(0, V, (B, T))
    params = list(model.parameters())
    with torch.autocast("cpu", torch.bfloat16, enabled=autocast), _Made(params) as made:
        h = model(ids, return_hidden=True)
    gc.collect()
    skip = {p.untyped_storage().data_ptr() for p in params} | {h.untyped_storage().data_ptr()}
    skip |= {ptr for ref, ptr, n, cast in made.made if ref() is not None and cast}   # a cast, or a view of one
    alive = {ptr: n for ref, ptr, n, cast in made.made if ref() is not None and ptr not in skip}
    res = torch.finfo(dtype).bits // 8
    comp, adapter = (2, 2) if autocast else (res, 4)
    expected = B * T * (config.num_hidden_layers * mp.layer_saved_bytes(config, T, False, res, comp, "cpu", lora, True,
                                                                         adapter)
                        - mp.first_layer_unsaved_bytes(config, res, comp, lora, True, "cpu", adapter)
                        + mp.model_saved_bytes(config, res, trains_embedding=False))
    assert sum(alive.values()) == pytest.approx(expected + mp.lora_weight_copies_bytes(config, lora, adapter), abs=0.5)


def _allocated_peak(fn) -> int:
    """The most bytes the CPU allocator holds during `fn()` above what it held before (the profiler's timeline of
    every allocation and free)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as prof:
        fn()
    live = peak = 0
    for _, action, _, size in prof._memory_profile().timeline:
        live += size if action.name == "CREATE" else -size if action.name == "DESTROY" else 0
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize("micro", [1, 2])
def test_a_manual_update_peaks_where_the_plan_says(micro):
    """GRPO's update on CPU (the small preset, float32): each micro-batch's forward through completion_logprobs, its
    loss and backward, then fw's AdamW step, and the gradients set to None as step_optimizer does. Its allocator
    peak above the step's start is at most the plan's largest phase, and at least that less the one layer of
    gradients in flight that the plan allows the backward. With one micro-batch a step no gradient is live in the
    forward, and the backward frees each layer's activations as it makes that layer's gradients: counting both at
    once, the plan would exceed the peak by about the gradients."""
    from framework.optim import build_optimizer
    from recipes.rl import completion_logprobs

    rows, prompt, new = 8, 24, 16
    cfg = tiny("grpo", model={"policy": {"preset": "small"}}, trainer={"accumulate_grad_batches": micro})
    config = preset_config("small", V)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).train()
    optimizer = build_optimizer(model, cfg["optimizer"], cfg)
    batches = [torch.randint(0, V, (rows, prompt + new)) for _ in range(micro)]
    prompt_lens, completion_lens = torch.full((rows,), prompt), torch.full((rows,), new)

    def update():
        for tokens in batches:
            logp, _ = completion_logprobs(model, tokens, prompt_lens, completion_lens, new, 1.0)
            (-(logp * torch.ones(rows, new)).sum() / (rows * new * micro)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    update()   # the optimizer's states, held from then on
    measured = _allocated_peak(update)
    shapes = BatchShapes(rows=rows, seq_len=prompt + new, loss_tokens=rows * new, packed=True)
    plan = mp.build_plan(cfg, config, Requirements(automatic_optimization=False), shapes, backend="cpu")
    planned = max(plan.phase_bytes(phase) for phase in mp.PHASES)
    in_flight = rows * (prompt + new) * mp.layer_saved_bytes(config, prompt + new, True, 4, 4, "cpu")
    assert planned - in_flight <= measured <= planned, (measured, plan.table())


STEP_SHAPES = {"tiny": preset_config("tiny", V),   # the tied embedding and qkv_proj of one size, side by side
               "wide-mlp": Qwen3Config(vocab_size=256, hidden_size=128, intermediate_size=2048, num_hidden_layers=2,
                                       num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                                       tie_word_embeddings=True),   # gate_up and down dominate
               "big-vocab": Qwen3Config(vocab_size=8192, hidden_size=128, intermediate_size=256, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1, head_dim=64)}   # untied
STEP_SETTINGS = {
    "float32": ({}, {}, {}),
    "float32 fused": ({}, {}, {"fused": True}),
    "float32 lora": ({"lora": {"rank": 8}}, {}, {}),
    "16-true": ({}, {"precision": "16-true"}, {}),
    "16-true lora": ({"lora": {"rank": 8}}, {"precision": "16-true"}, {}),
    "adamw8bit": ({}, {}, {"name": "adamw8bit"}),
    "bf16 rounded": ({"dtype": "bfloat16"}, {"precision": "bf16-true"}, {"stochastic_rounding": True}),
}


@pytest.mark.parametrize("shape", list(STEP_SHAPES))
@pytest.mark.parametrize("setting", list(STEP_SETTINGS))
def test_the_cpu_step_phase_is_the_measured_peak_of_an_optimizer_step(shape, setting):
    """fw's optimizer (build_optimizer) over a model's trainable tensors on CPU: the allocator's peak while the
    gradients are made and the step runs, its states made by an earlier step, against the plan's step phase (the
    gradients and the step's buffers). The plan counts tensors; the step's scalars (its counters, 12 bytes) are
    below that resolution."""
    pytest.importorskip("torchao")
    from framework.models.lora import add_adapters
    from framework.optim import build_optimizer

    policy, trainer, optimizer = STEP_SETTINGS[setting]
    cfg = tiny(model={"policy": {"preset": "tiny", **policy}}, trainer={"accelerator": "cpu", **trainer},
               optimizer={"weight_decay": 0.01, **optimizer})
    config = STEP_SHAPES[shape]
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config)
    if policy.get("lora"):
        add_adapters(model, cfg["model"]["policy"]["lora"])
    if "precision" in trainer:   # what Lightning's -true precisions do to the whole module
        model = model.to(getattr(torch, mp.CONVERTS_TO[trainer["precision"]]))
    opt = build_optimizer(model, cfg["optimizer"], cfg)
    trained = [p for p in model.parameters() if p.requires_grad]

    def step():
        for p in trained:
            p.grad = torch.empty_like(p).normal_(0.0, 1e-3)   # in place: no temporary beside the gradient
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    measured = _allocated_peak(step)
    plan = mp.build_plan(cfg, config, Requirements(automatic_optimization=True), None, backend="cpu")
    planned = plan.phase_bytes("step")
    assert measured - 1024 <= planned <= 1.15 * measured, (measured, plan.table())


def test_kept_logits_formula_equals_what_linear_logprob_saves():
    torch.manual_seed(0)
    n, d, vocab = 40, 32, 1000
    hidden = torch.randn(n, d, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(vocab, d, dtype=torch.bfloat16, requires_grad=True)
    sizes = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: sizes.append((t.dtype, t.untyped_storage().nbytes()))
                                                  or t, lambda t: t):
        ops_cuda.linear_logprob(hidden, weight, torch.randint(0, vocab, (n,)), save_logits=True)
    kept = sum(b for dt, b in sizes if dt == torch.float16)
    floats = sorted(b for dt, b in sizes if dt == torch.float32)   # logsumexp, entropy, the chunks' offsets
    assert kept == n * vocab * 2 and floats == [n * 4, n * 4, n * -(-vocab // mp.SAVED_LOGITS_CHUNK) * 4]


# ------------------------------------------------------------------------------------------ fw plan

def fw(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_fw_plan_prints_an_aligned_table_and_exits_0(capsys):
    code, out, err = fw(capsys, "plan", "--config", TRAIN, "--trainer.max_steps=3")
    assert (code, err) == (0, "")
    lines = out.splitlines()
    assert lines[0].startswith("fw plan: recipe grpo, tiny (179,200 params, 2 layers), 32-true")
    table = [ln for ln in lines[2:] if ln.startswith("  ")]
    names = [ln.split("  ")[1] for ln in table]
    for name in ("policy weights", "gradients", "optimizer states", "KV cache", "activations", "logits buffers",
                 "total", "limit"):
        assert name in names, name
    end = lines[1].index("GiB") + len("GiB")   # the GiB column is right-aligned under its header
    values = [ln[:end].split()[-1] for ln in table if not ln.startswith("  limit")]
    assert all(v.replace(".", "").isdigit() and len(v.split(".")[1]) == 1 for v in values), values
    assert "this machine's memory" in table[-1] or "container's memory limit" in table[-1], table[-1]


def test_fw_plan_that_does_not_fit_lists_overrides_that_do(capsys):
    # the engine handed back after each rollout: with no limit, "auto" would keep it, and the totals would differ
    args = ["plan", "--config", TRAIN, "--data.task.init_args={num_digits: 40}", "--rollout.max_new_tokens=64",
            "--rollout.keep_engine=false", "--trainer.accelerator=gpu"]
    code, out, _ = fw(capsys, *args)
    assert code == 0
    total = float(next(ln for ln in out.splitlines() if ln.startswith("  total")).split()[1])
    limit = total * 0.6
    code, out, err = fw(capsys, *args, "--gpu-gib", f"{limit:.3f}")
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("fw: error: memory plan: the job needs ")
    assert "the biggest row is " in err and "; try --" in err
    assert f"does not fit: {total:.1f} GiB > {limit:.1f} GiB; try one of:" in out
    tried = [ln.split("  -> ")[0].split() for ln in out.splitlines() if "  -> " in ln and ln.startswith("  --")]
    assert ["--model.policy.gradient_checkpointing=true"] in tried
    assert ["--model.policy.gradient_checkpointing=selective"] in tried
    fitting = [t for t, ln in zip(tried, [ln for ln in out.splitlines() if "  -> " in ln and ln.startswith("  --")])
               if ln.endswith("(fits)")]
    assert fitting, out
    for overrides in fitting:   # each override said to fit does fit when applied
        assert fw(capsys, *args, *overrides, "--gpu-gib", f"{limit:.3f}")[0] == 0, overrides


def test_fw_plan_imports_a_task_module_next_to_the_config(tmp_path):
    """The RL plan reads the task's widest prompt, so `fw plan` (the console script, whose sys.path holds no working
    directory) imports a `data.task` class_path module next to the config, as `fw fit` does."""
    script = Path(sys.executable).parent / "fw"
    if not script.exists():
        pytest.skip("the fw console script is not installed next to this Python")
    (tmp_path / "plan_walk_task.py").write_text(
        "from framework.tasks import Task\n\n"
        "class Echo(Task):\n"
        "    def sample(self, index):\n"
        "        answer = str(index % 7)\n"
        "        return {'prompt': f'say {answer}', 'answer': answer, 'metadata': {'answer': answer}}\n")
    config = tmp_path / "c.yaml"
    config.write_text("recipe: grpo\nmodel: {policy: {preset: tiny}}\n"
                      "data: {task: {class_path: plan_walk_task.Echo}, chat_template: false}\n"
                      "reward: {name: exact_match}\nrollout: {prompts_per_step: 2, max_new_tokens: 4}\n")
    done = subprocess.run([str(script), "plan", "--config", str(config)], cwd=tmp_path / "..", capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("fw plan: recipe grpo, tiny")


def test_gpu_gib_plans_for_a_gpu_under_accelerator_auto(capsys):
    """`fw plan --gpu-gib N` asks whether the job fits a GPU of N GiB: under `trainer.accelerator: auto` that is a
    GPU plan (its CUDA context counted) on any machine, one without a GPU too; an explicit `cpu` keeps the CPU's."""
    code, out, _ = fw(capsys, "plan", "--config", TRAIN, "--gpu-gib", "80")
    assert code == 0 and out.splitlines()[0].endswith("; memory per GPU") and "\n  CUDA context " in out
    code, out, _ = fw(capsys, "plan", "--config", TRAIN, "--gpu-gib", "80", "--trainer.accelerator=cpu")
    assert code == 0 and out.splitlines()[0].endswith("; memory per process (CPU)")


def test_a_job_that_fits_only_with_lora_alone_is_also_shown_the_full_fine_tuning_settings_that_fit_together():
    """Qwen3-8B GRPO against 75 GiB: LoRA fits alone and no full fine-tuning change does, so the plan also gives the
    fewest full fine-tuning changes that fit together: applied, the job fits, and without any one of them it does
    not. The refusal line names both."""
    cfg = load_config([str(ROOT / "recipes" / "grpo.yaml")], ["--model.policy.preset=qwen3-8b",
                                                              "--trainer.accelerator=gpu"])
    plan = mp.estimate(cfg, gpu_gib=75)
    assert plan.fits is False
    assert any(s.fits and "--model.policy.lora" in s.text for s in plan.suggestions)
    assert not any(s.fits for s in plan.suggestions if "--model.policy.lora" not in s.text)
    together = plan.together
    assert together is not None and together.fits and "--model.policy.lora" not in together.text
    overrides = together.text.split()

    def fits(extra):
        return mp.estimate(load_config([str(ROOT / "recipes" / "grpo.yaml")],
                                       ["--model.policy.preset=qwen3-8b", "--trainer.accelerator=gpu", *extra]),
                           gpu_gib=75).fits

    assert fits(overrides)
    groups = [[o] for o in overrides if not o.startswith(("--model.policy.dtype", "--trainer.precision",
                                                         "--optimizer.stochastic_rounding"))]
    lean = [o for o in overrides if o.startswith(("--model.policy.dtype", "--trainer.precision",
                                                  "--optimizer.stochastic_rounding"))]
    groups += [lean] if lean else []
    for group in groups:   # each change (bf16 weights, bf16-true and stochastic rounding go as one) is needed
        assert not fits([o for o in overrides if o not in group]), group
    assert "together, full fine-tuning: " + together.text in plan.table()
    assert "; or, keeping full fine-tuning, all of " + together.text in plan.refusal()


@pytest.mark.parametrize("job, gib", [
    (["--trainer.devices=2", "--trainer.strategy=ddp"], 80),   # the offloaded step runs in one process only
    (["--trainer.precision=16-mixed"], 80),                     # the loss scaler would unscale offloaded gradients
    (["--optimizer.fused=true"], 70),                           # torch's fused AdamW does not step torchao's states
    (["--model.policy.dtype=bfloat16", "--optimizer.stochastic_rounding=true", "--trainer.precision=bf16-mixed"], 30)])
def test_every_change_the_plan_suggests_passes_fws_checks(tmp_path, job, gib):
    """Qwen3-4B GRPO under settings that rule some changes out (the comments; the last: LoRA's float32 adapters,
    which stochastic rounding cannot step): every suggestion and the combined one, applied, pass `fw validate`'s
    checks, which `fw fit` runs, and the first is in the refusal."""
    from framework.optim import optimizer_problems
    from framework.validate import validate_config

    base = [f"--run_dir={tmp_path}", "--model.policy.preset=qwen3-4b", "--trainer.accelerator=gpu", *job]
    grpo = str(ROOT / "recipes" / "grpo.yaml")
    validate_config([grpo], base)   # the job itself is valid
    plan = mp.estimate(load_config([grpo], base), gpu_gib=gib)
    assert plan.fits is False and plan.suggestions
    for suggestion in plan.suggestions + ([plan.together] if plan.together else []):
        cfg = validate_config([grpo], base + list(suggestion.overrides))
        assert optimizer_problems(cfg) == [], suggestion.text
    assert "; try " + plan.suggestions[0].text + " (" in plan.refusal()


def test_fw_plan_reads_only_the_models_the_recipe_builds(tmp_path, capsys):
    """GRPO builds no critic, and no reference without a KL term: a stale model.value.path or model.reference.path
    leaves its plan alone (a warning says each is not read), while PPO, which builds its critic, reads the path and
    names it."""
    stale = str(tmp_path / "gone")
    code, out, err = fw(capsys, "plan", "--config", TRAIN, f"--model.value.path={stale}",
                        f"--model.reference.path={stale}", "--grpo.kl_coef=0")
    assert code == 0 and out.startswith("fw plan: recipe grpo")
    said = [line.split(": ")[2] for line in err.splitlines()]
    assert said == ["model.value.path is set, but recipe grpo trains no critic",
                    "model.reference.path is set, but grpo.kl_coef is 0, so no reference model is built"]
    code, _, err = fw(capsys, "plan", "--config", str(ROOT / "recipes" / "ppo.yaml"), f"--model.value.path={stale}")
    assert code == 2 and stale in err


def test_fw_plan_reports_a_model_directory_at_its_key_as_validate_does(tmp_path, capsys):
    """A model directory that is not there is one line at the key that names it, saying so, not a tokenizer's
    missing file."""
    config = tmp_path / "c.yaml"
    config.write_text("recipe: sft\nmodel:\n  policy: {path: gone}\ndata: {task: {name: digits}}\n")
    code, out, err = fw(capsys, "plan", "--config", str(config))
    assert (code, out) == (2, "")
    gone = tmp_path / "gone"
    assert err.splitlines() == [(f"{config}:3:18: model.policy.path: no such directory: {gone} (expected a Hugging "
                                 "Face Qwen3 directory with config.json and model.safetensors)")]


def test_fw_plan_reports_its_data_at_their_keys_as_validate_does(tmp_path, capsys, monkeypatch):
    """The plan reads the prompts' lengths: a user task whose init_args miss a required argument, and a JSONL row
    whose prompt is no string, are each the line fw validate gives, at the key or the row, not a line that names
    neither."""
    (tmp_path / "qa_task.py").write_text(
        "from framework.tasks import Digits\n\n\nclass WithLevel(Digits):\n"
        "    def __init__(self, level, **kw):\n        super().__init__(**kw)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    config = tmp_path / "task.yaml"
    config.write_text("data:\n  task: {name: null, class_path: qa_task.WithLevel, init_args: {num_digits: 1}}\n")
    code, out, err = fw(capsys, "plan", "--config", TRAIN, "--config", str(config))
    assert (code, out) == (2, "")
    assert err.splitlines() == [(f"{config}:2:64: data.task.init_args: init_args do not fit qa_task.WithLevel(level, "
                                 "**kw): missing a required argument: 'level' (accepted: level)")]
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": "1=", "answer": "2"}\n{"prompt": 5, "answer": "3"}\n')
    config = tmp_path / "rows.yaml"
    config.write_text(f"data:\n  task: null\n  path: {rows}\neval: {{every_n_steps: null}}\n")
    code, out, err = fw(capsys, "plan", "--config", TRAIN, "--config", str(config))
    assert (code, out) == (2, "")
    assert err.splitlines() == [(f"{rows}:2:1: data.path: 'prompt' must be a non-empty string or a non-empty list "
                                 "of {role, content} messages")]


def test_fw_plan_reports_a_batch_split_at_its_key_as_validate_does(tmp_path, capsys):
    """A rollout batch that cannot be cut into minibatches x micro-batches is the line fw validate gives, at the key
    in the file that set it, not a line that names no file."""
    config = tmp_path / "c.yaml"
    config.write_text("trainer:\n  accumulate_grad_batches: 1000\n")
    code, out, err = fw(capsys, "plan", "--config", TRAIN, "--config", str(config))
    assert (code, out) == (2, "")
    expected = (f"{config}:2:28: trainer.accumulate_grad_batches: 1 minibatches x trainer.accumulate_grad_batches "
                "(1000) exceeds the 512 samples of one rollout batch (rollout.prompts_per_step x grpo.group_size)\n")
    assert err == expected
    assert fw(capsys, "validate", "--config", TRAIN, "--config", str(config)) == (2, "", expected)


def test_fw_plan_usage_errors(capsys):
    for value in ("0", "inf", "nan", "1e300"):   # "fits: inf GiB to spare" says nothing
        code, _, err = fw(capsys, "plan", "--config", TRAIN, "--gpu-gib", value)
        assert code == 2 and err == (f"fw: error: --gpu-gib is one GPU's memory in GiB: a number > 0 and at most "
                                     f"1048576, got {float(value):g}\n")
    assert fw(capsys, "plan", "--config", TRAIN, "--gpu-gib", "1048576")[0] == 0
    code, _, err = fw(capsys, "plan")
    assert code == 2 and err == "fw: error: fw plan needs --config FILE\n"


def test_a_recipe_without_batch_shapes_gets_a_plan_without_activations(install_recipe, capsys):
    sys.path.insert(0, str(ROOT / "tests" / "plugins"))
    try:
        install_recipe({"copy": "fw_copy_recipe:CopyRecipe"})
        cfg = resolve({"recipe": "copy", "model": {"policy": {"preset": "tiny"}}})
        plan = mp.estimate(cfg, gpu_gib=4.0)
    finally:
        sys.path.remove(str(ROOT / "tests" / "plugins"))
    assert "declares no batch_shapes" in row(plan, "activations").how and plan.fits


# ------------------------------------------------------------------------------------------ fw fit

def test_fw_fit_refuses_a_job_over_the_memory_limit_before_writing_anything(tmp_path, capsys):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "notes.txt").write_text("mine")
    code, out, err = fw(capsys, "fit", "--config", TRAIN, f"--run_dir={run_dir}", "--trainer.memory_limit_gib=0.001")
    assert (code, out) == (2, "")
    errors = [ln for ln in err.splitlines() if ln.startswith("fw: error:")]
    assert len(errors) == 1 and err.endswith(errors[0] + "\n") and "Traceback" not in err
    assert "more than the 0.001 GiB limit (trainer.memory_limit_gib); the biggest row is " in errors[0]
    # nothing fits in 1 MiB: no "try", but how close the most fw can change gets, and what is left to change
    assert "; try" not in errors[0] and "; no change fw knows fits, all of --" in errors[0]
    assert ("; shorten the sequences or shrink the batch (rollout.max_new_tokens, rollout.prompts_per_step, "
            "grpo.group_size), or give each process more memory; ") in errors[0]
    assert "  policy weights " in err    # the plan's table came first, on stderr
    assert sorted(p.name for p in run_dir.iterdir()) == ["notes.txt"]


def test_every_scaling_row_is_a_valid_config_that_the_plan_fits_on_one_h200(monkeypatch):
    """benchmarks/scale.py's rows, as `fw fit` reads their overrides: schema-valid, and planned for CUDA within an
    H200's memory and within the row's own peak goal (the plan is within 2% of the measured peaks there)."""
    monkeypatch.syspath_prepend(str(ROOT))
    from benchmarks.scale import ROWS

    assert {"grpo-4b", "grpo-4b-117", "grpo-8b-lora16", "sft-8b"} <= {row.name for row in ROWS}
    for row in ROWS:
        cfg = load_config([str(ROOT / row.config)], [*row.overrides, "--trainer.accelerator=gpu"])
        plan = mp.estimate(cfg, gpu_gib=139)
        assert plan.fits, (row.name, plan.table())
        if row.goal_peak_gib is not None:
            assert plan.allocated_bytes <= row.goal_peak_gib * mp.GIB, (row.name, plan.table())


# ------------------------------------------------------------------------------------------ GPU

@pytest.mark.gpu
@pytest.mark.parametrize("job", ["sft", "grpo"])
def test_plan_is_within_15_percent_of_the_measured_peak(tmp_path, job):
    from framework.trainer import fit

    common = [f"--run_dir={tmp_path / 'run'}", "--model.policy.preset=qwen3-0.6b", "--trainer.precision=bf16-mixed",
              "--trainer.max_steps=2", "--trainer.enable_progress_bar=false", "--logging.csv=false",
              "--logging.tensorboard=false", "--checkpoint.every_n_steps=1000"]
    if job == "sft":   # every token a target: the plan's bound on the loss's tokens is met
        cfg = load_config([str(ROOT / "recipes" / "sft.yaml")],
                          common + ["--data.max_seq_len=1024", "--data.batch_size=4", "--sft.train_on_prompt=true"])
    else:              # a random-init model never stops early: every completion is max_new_tokens long
        cfg = load_config([str(ROOT / "benchmarks" / "grpo_bench.yaml")],
                          common + ["--rollout.prompts_per_step=8", "--rollout.max_new_tokens=128",
                                    "--trainer.accumulate_grad_batches=1"])
    plan = mp.estimate(cfg)
    fit(cfg)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    peak = max(r["memory/peak_gib"] for r in records if "memory/peak_gib" in r) * mp.GIB
    assert all("memory/reserved_gib" in r for r in records if "memory/peak_gib" in r)
    assert abs(plan.allocated_bytes - peak) <= 0.15 * peak, (plan.table(), peak / mp.GIB)


def test_fw_plan_suggests_auto_when_a_kept_engine_does_not_fit(capsys):
    """keep_engine true on a GPU that holds the job only with the KV cache handed back: refused, and the
    suggestion to let "auto" hand it back is listed and fits."""
    # a KV cache worth a GiB digit; planned for a GPU, as --gpu-gib plans
    big = ["--data.task.init_args={num_digits: 40}", "--rollout.max_new_tokens=64", "--trainer.accelerator=gpu"]
    totals = {keep: mp.estimate(load_config([TRAIN], [*big, f"--rollout.keep_engine={keep}"])).total_bytes / 2**30
              for keep in ("true", "false")}
    assert totals["true"] > totals["false"] + 0.01
    limit = (totals["true"] + totals["false"]) / 2
    code, out, _ = fw(capsys, "plan", "--config", TRAIN, *big, "--rollout.keep_engine=true", "--gpu-gib",
                      f"{limit:.4f}")
    assert code == 2
    line = next(ln for ln in out.splitlines() if ln.startswith("  --rollout.keep_engine=auto"))
    assert float(line.split("->")[1].split()[0]) <= limit


# ------------------------------------------------------------------------------------------ positions

def test_rows_longer_than_the_models_positions_are_warned_of_in_the_plan():
    # the tiny preset: max_position_embeddings 4096 (framework/models/presets.py)
    assert mp.estimate(tiny("sft", data={"max_seq_len": 4096})).warnings == []
    plan = mp.estimate(tiny("sft", data={"max_seq_len": 4097}))
    line = ("data.max_seq_len allows rows of 4,097 tokens, more than the policy's max_position_embeddings (4,096), "
            "the positions it is made for; fw applies no RoPE scaling")
    assert plan.warnings == [line]
    assert plan.table().splitlines()[-1] == "warning: " + line


def test_fw_plan_warns_of_a_completion_that_passes_the_models_positions(capsys):
    # a limit past the plan: the CPU limit is this machine's memory, which 512 rows of 4,097 tokens may pass
    code, out, err = fw(capsys, "plan", "--config", TRAIN, "--rollout.max_new_tokens=4095",
                        "--trainer.memory_limit_gib=100000")
    assert (code, err) == (0, "")
    warning = out.splitlines()[-1]
    prompt = int(warning.split("the longest prompt (")[1].split(" tokens)")[0])
    assert prompt == 2   # "3=": so that prompt + 4,095 passes 4,096
    assert warning == (f"warning: the longest prompt ({prompt} tokens) plus rollout.max_new_tokens (4,095) allows rows "
                       f"of {prompt + 4095:,} tokens, more than the policy's max_position_embeddings (4,096), the "
                       "positions it is made for; fw applies no RoPE scaling")
    code, out, _ = fw(capsys, "plan", "--config", TRAIN, f"--rollout.max_new_tokens={4096 - prompt}",
                      "--trainer.memory_limit_gib=100000")
    assert code == 0 and "warning:" not in out


def test_gpu_gib_under_accelerator_auto_gives_the_plan_of_a_gpu_machine(capsys):
    """`fw plan --gpu-gib N` under `trainer.accelerator: auto` counts what `fw fit` does on a GPU, on a machine without
    one too: bf16 GRPO lays each group's prompt out once there (shared_prompt auto) and may offload the optimizer, so
    the table and the suggestions are those of `--trainer.accelerator=gpu`."""
    args = ["plan", "--config", str(ROOT / "benchmarks" / "grpo_bench.yaml"), "--model.policy.preset=qwen3-4b",
            "--gpu-gib", "40"]
    code, on_gpu, _ = fw(capsys, *args, "--trainer.accelerator=gpu")
    assert code == 2 and "each group's prompt once" in on_gpu and "--optimizer.cpu_offload=true" in on_gpu
    code, auto, _ = fw(capsys, *args)
    assert (code, auto) == (2, on_gpu)


@pytest.mark.parametrize("total, limit, said", [(80.04, 80.0, ("80.04", "80.00")), (80.2, 80.0, ("80.2", "80.0")),
                                                (0.001236, 0.001234, ("0.00124", "0.00123"))])
def test_a_job_just_over_its_limit_reads_over_it(total, limit, said):
    """A total that passes the limit by less than the table's rounding is said with the decimals that tell them apart,
    in the table's verdict and in the refusal, rather than as "80.0 GiB > 80.0 GiB"."""
    plan = mp.Plan("t", [mp.Row("weights", total * mp.GIB, ("held",), "")], limit_bytes=limit * mp.GIB,
                   limit_source="--gpu-gib")
    assert plan.fits is False
    assert f"does not fit: {said[0]} GiB > {said[1]} GiB" in plan.table()
    assert plan.refusal().startswith(f"memory plan: the job needs {said[0]} GiB per process, more than the {said[1]} "
                                     "GiB limit (--gpu-gib); ")


def test_lora_jobs_are_offered_bfloat16_for_their_frozen_base_and_their_critic(tmp_path):
    """Under LoRA the float32 weights are the frozen base and, under PPO, the critic: the plan offers bfloat16 for the
    base alone (the adapters stay float32 under bf16-mixed, so no rounding is needed) and every weight in bfloat16
    with stochastic rounding. Qwen3-8B PPO with LoRA in 80 GiB fits only with the critic in bfloat16 too."""
    from framework.validate import validate_config

    bench = ROOT / "benchmarks"
    base = [f"--run_dir={tmp_path}", "--model.policy.preset=qwen3-8b", "--model.policy.lora.rank=16",
            "--trainer.accelerator=gpu", "--rollout.max_new_tokens=1024"]
    grpo = [str(bench / "grpo_bench.yaml")]
    plan = mp.estimate(load_config(grpo, base), gpu_gib=40)
    alone = next(s for s in plan.suggestions if s.overrides == ("--model.policy.dtype=bfloat16",))
    cfg = validate_config(grpo, base + list(alone.overrides))   # fw fit's checks pass: no rounding needed
    halved = mp.estimate(cfg, gpu_gib=40)
    assert halved.total_bytes == alone.total_bytes
    assert 2 * row(halved, "policy weights").bytes == row(plan, "policy weights").bytes

    ppo = [str(bench / "ppo_bench.yaml")]
    plan = mp.estimate(load_config(ppo, base), gpu_gib=80)
    assert plan.together is not None and plan.together.fits, plan.table()
    assert "--trainer.precision=bf16-true" in plan.together.overrides
    cfg = validate_config(ppo, base + list(plan.together.overrides))
    assert mp.estimate(cfg, gpu_gib=80).fits


def test_no_suggestion_saves_a_negligible_share_of_what_the_job_lacks():
    """Qwen3-1.7B LoRA SFT of 8 x 4096 tokens against 24 GiB is tens of GiB over: 8-bit states for its adapters save a
    tenth of a GiB, no advice, so the plan leaves them out; every change it lists fits or closes 1% of the gap."""
    base = ["--model.policy.preset=qwen3-1.7b", "--model.policy.lora.rank=16", "--trainer.precision=bf16-mixed",
            "--data.max_seq_len=4096", "--data.batch_size=8", "--trainer.accelerator=gpu"]
    sft = [str(ROOT / "recipes" / "sft.yaml")]
    plan = mp.estimate(load_config(sft, base), gpu_gib=24)
    gap = plan.total_bytes - 24 * mp.GIB
    eight_bit = mp.estimate(load_config(sft, [*base, "--optimizer.name=adamw8bit"]), gpu_gib=24)
    assert 0 < plan.total_bytes - eight_bit.total_bytes < 0.01 * gap
    assert plan.suggestions and all("adamw8bit" not in s.text for s in plan.suggestions)
    assert plan.together is None or "adamw8bit" not in plan.together.text
    assert all(s.fits or plan.total_bytes - s.total_bytes >= 0.01 * gap for s in plan.suggestions)


def test_a_kv_pool_that_does_not_fit_is_offered_a_smaller_budget(tmp_path):
    """A rollout-bound job (Qwen3-0.6B, 256 completions of up to 2048 tokens, 40 GiB) is offered the
    rollout.kv_cache_gib that brings it to the limit (the same tokens in more decode steps): the KV row less the
    excess, in hundredths of a GiB rounded down. For Qwen3-4B, whose activations also pass the limit, the changes
    together end with the pool sized to what the others leave. Applied, each passes fw's checks and fits."""
    from framework.validate import validate_config

    grpo = [str(ROOT / "benchmarks" / "grpo_bench.yaml")]
    base = [f"--run_dir={tmp_path}", "--trainer.accelerator=gpu", "--rollout.max_new_tokens=2048",
            "--model.policy.gradient_checkpointing=true", "--trainer.accumulate_grad_batches=16"]
    plan = mp.estimate(load_config(grpo, base), gpu_gib=40)
    kv = row(plan, "KV cache").bytes
    gib = int((kv - (plan.total_bytes - 40 * mp.GIB)) / mp.GIB * 100) / 100
    assert plan.suggestions[0].overrides == (f"--rollout.kv_cache_gib={gib}",) and plan.suggestions[0].fits
    assert mp.estimate(validate_config(grpo, base + [f"--rollout.kv_cache_gib={gib}"]), gpu_gib=40).fits

    base = [f"--run_dir={tmp_path}", "--trainer.accelerator=gpu", "--rollout.max_new_tokens=1024",
            "--model.policy.preset=qwen3-4b"]
    plan = mp.estimate(load_config(grpo, base), gpu_gib=40)
    assert plan.together is not None and plan.together.fits, plan.table()
    assert plan.together.overrides[-1].startswith("--rollout.kv_cache_gib=")
    assert mp.estimate(validate_config(grpo, base + list(plan.together.overrides)), gpu_gib=40).fits


def test_each_suggestion_is_counted_with_the_batch_it_makes(tmp_path):
    """A suggestion that changes the batch is recounted with the batch it makes: halving rollout.prompts_per_step
    halves the rollout's rows of a job whose KV pool passes the limit, and its total is what `fw plan` says of the job
    with it (the original batch's shapes counted it as saving nothing, so it was never offered)."""
    grpo = [str(ROOT / "benchmarks" / "grpo_bench.yaml")]
    base = [f"--run_dir={tmp_path}", "--trainer.accelerator=gpu", "--rollout.max_new_tokens=2048",
            "--model.policy.gradient_checkpointing=true", "--trainer.accumulate_grad_batches=16"]
    plan = mp.estimate(load_config(grpo, base), gpu_gib=40)
    fewer = next(s for s in plan.suggestions if s.overrides == ("--rollout.prompts_per_step=16",))
    recount = mp.estimate(load_config(grpo, [*base, "--rollout.prompts_per_step=16"]), gpu_gib=40)
    assert fewer.total_bytes == recount.total_bytes and fewer.fits == recount.fits
    assert "128 rows" in row(recount, "KV cache").how


def test_the_shape_keys_a_refusal_names_are_the_schemas():
    from framework.config import all_key_paths
    from framework.memory_plan import SHAPE_KEYS

    known = {".".join(p) for p in all_key_paths()}
    assert set(SHAPE_KEYS) == {"sft", "grpo", "ppo"}
    for keys in SHAPE_KEYS.values():
        assert set(keys.split(", ")) <= known, keys


def test_an_rl_job_is_offered_smaller_rollouts_with_as_many_samples_in_each_optimizer_step(tmp_path, capsys):
    """In RL, trainer.accumulate_grad_batches splits each minibatch into micro-batches, so fewer prompts with more
    accumulation would shrink each optimizer step's batch; fewer prompts in as many fewer minibatches keep it.
    Qwen3-1.7B PPO whose critic's values over 256 rollouts of 4212 tokens pass 75 GiB: the plan offers 8 prompts in 1
    minibatch for 32 in 4 (8 x 8 / 1 = 32 x 8 / 4 = 64 samples an optimizer step, micro-batches of 4 rows either
    way), the first that fits; applied, the job passes fw's checks and its own plan fits with the total the
    suggestion said. With one minibatch no such change exists, and none is offered."""
    from framework.validate import validate_config

    ppo = str(ROOT / "benchmarks" / "ppo_bench.yaml")   # 32 prompts x 8 samples, accumulate_grad_batches 4
    job = [f"--run_dir={tmp_path}", "--model.policy.preset=qwen3-1.7b", "--ppo.minibatches=4",
           "--rollout.max_new_tokens=4096", "--rollout.kv_cache_gib=8", "--model.policy.gradient_checkpointing=true",
           "--trainer.accumulate_grad_batches=16", "--trainer.accelerator=gpu"]
    code, out, err = fw(capsys, "plan", "--config", ppo, *job, "--gpu-gib", "75")
    assert code == 2 and "4 rows of at most 4212" in out and "no-grad forward of 256 rows" in out
    said = [ln for ln in out.splitlines() if ln.startswith("  --rollout.prompts_per_step=")]
    assert len(said) == 1 and said[0].split("  -> ")[0].split() == ["--rollout.prompts_per_step=8",
                                                                      "--ppo.minibatches=1"]
    assert said[0].endswith(" GiB (fits)")
    assert "; try --rollout.prompts_per_step=8 --ppo.minibatches=1 (" in err   # the only change that fits alone
    total = said[0].split("  -> ")[1].split()[0]
    changed = [*job, "--rollout.prompts_per_step=8", "--ppo.minibatches=1"]
    validate_config([ppo], changed)
    code, out, _ = fw(capsys, "plan", "--config", ppo, *changed, "--gpu-gib", "75")
    assert code == 0 and "fits: " in out
    assert next(ln for ln in out.splitlines() if ln.startswith("  total")).split()[1] == total
    assert "4 rows of at most 4212" in out and "no-grad forward of 64 rows" in out

    one = ["--ppo.minibatches=1", "--trainer.accumulate_grad_batches=64"]   # micro-batches of 4 rows still
    code, out, _ = fw(capsys, "plan", "--config", ppo, *job, *one, "--gpu-gib", "75")
    assert code == 2 and "4 rows of at most 4212" in out and "minibatches" not in out


def test_smaller_rollouts_divide_the_prompts_and_the_minibatches_by_each_common_factor():
    cfg = {"rollout": {"prompts_per_step": 12}, "grpo": {"minibatches": 18}}
    assert mp._fewer_prompts(cfg, "grpo") == [{"rollout.prompts_per_step": 6, "grpo.minibatches": 9},
                                              {"rollout.prompts_per_step": 4, "grpo.minibatches": 6},
                                              {"rollout.prompts_per_step": 2, "grpo.minibatches": 3}]
    assert mp._fewer_prompts({"rollout": {"prompts_per_step": 12}, "grpo": {"minibatches": 1}}, "grpo") == []
    assert mp._fewer_prompts({"rollout": {"prompts_per_step": 9}, "grpo": {"minibatches": 4}}, "grpo") == []
    assert mp._fewer_prompts({"rollout": {"prompts_per_step": 8}, "sft": {}}, "") == []


def test_changes_applied_together_keep_the_smaller_rollouts_that_keep_the_optimizer_steps_batch():
    """Qwen3-0.6B GRPO of 32 prompts x 16 in 8 minibatches with completions of 8192 tokens, against 24 GiB: no change
    fits, and the changes applied together keep 4 prompts in 1 minibatch (64 samples an optimizer step, as the job's);
    halving rollout.prompts_per_step, a later change, would set 16 prompts in that 1 minibatch, 256 samples a step and
    four times the rollout, and is left out. Their total is the plan of the job with them."""
    grpo = [str(ROOT / "recipes" / "grpo.yaml")]
    base = ["--model.policy.preset=qwen3-0.6b", "--grpo.minibatches=8", "--rollout.max_new_tokens=8192",
            "--model.policy.gradient_checkpointing=true", "--trainer.accelerator=gpu"]
    cfg = load_config(grpo, base)
    assert (cfg["rollout"]["prompts_per_step"], cfg["grpo"]["group_size"]) == (32, 16)
    plan = mp.estimate(cfg, gpu_gib=24)
    assert not any(s.fits for s in plan.suggestions)
    texts = [s.text for s in plan.suggestions]
    assert "--rollout.prompts_per_step=4 --grpo.minibatches=1" in texts and "--rollout.prompts_per_step=16" in texts
    together = plan.together
    assert together is not None and not together.fits
    assert "--rollout.prompts_per_step=4" in together.overrides and "--grpo.minibatches=1" in together.overrides
    assert "--rollout.prompts_per_step=16" not in together.overrides
    assert mp.estimate(load_config(grpo, [*base, *together.overrides]), gpu_gib=24).total_bytes == together.total_bytes


LATE_RAISER = """import sys


class Task:
    def sample(self, index):
        if index == 5:
            self.fail()
        return {"prompt": "1+1=", "answer": "2", "metadata": {"answer": "2"}}

    def fail(self):
        {raise_it}
"""


@pytest.mark.parametrize("raise_it, code, said", [
    ("raise ValueError('no sample 5')", 2, "fw: error: data.task: Task.sample raised ValueError: no sample 5"),
    ("sys.exit(3)", 2, "fw: error: data.task: Task.sample called sys.exit(3)"),
    ("raise KeyboardInterrupt", 130, "fw: interrupted: KeyboardInterrupt in Task.sample"),
])
def test_user_code_that_raises_in_the_plan_is_one_line_naming_its_line(tmp_path, capsys, raise_it, code, said):
    """The RL plan reads the task's first prompts (a task that states no widest ones): what the task's code raises
    there, past the first sample that fw validate reads, is one line naming the call fw made and the user's line
    that raised, as validate says it, from fw plan and from fw fit before anything is written; a KeyboardInterrupt
    (Ctrl+C while the task's code runs, or its own) ends them as Ctrl+C ends fw, with exit code 130. No traceback
    but with --debug."""
    module = f"late_raiser_{abs(hash(raise_it))}"
    (tmp_path / f"{module}.py").write_text(LATE_RAISER.replace("{raise_it}", raise_it))
    config = tmp_path / "c.yaml"
    config.write_text(f"recipe: grpo\nmodel: {{policy: {{preset: tiny}}}}\n"
                      f"data: {{task: {{class_path: {module}.Task}}, chat_template: false}}\n"
                      f"reward: {{name: exact_match}}\nrollout: {{prompts_per_step: 2, max_new_tokens: 4}}\n"
                      f"trainer: {{max_steps: 1}}\nrun_dir: {tmp_path / 'run'}\n")
    line = f"{said} (at {tmp_path / f'{module}.py'}:11)\n"   # fail()'s line, under the sample fw called
    assert fw(capsys, "validate", "--config", str(config)) == (0, f"{config}: valid (recipe grpo)\n", "")
    assert fw(capsys, "plan", "--config", str(config)) == (code, "", line)
    assert fw(capsys, "fit", "--config", str(config)) == (code, "", line)
    assert not (tmp_path / "run").exists()
    back, _, err = fw(capsys, "--debug", "plan", "--config", str(config))
    assert back == code and "Traceback (most recent call last)" in err and err.endswith(line)
    sys.modules.pop(module, None)


def test_a_plugin_recipes_batch_shapes_that_raise_are_said_at_recipe(tmp_path, install_recipe):
    (tmp_path / "shapeless_recipe.py").write_text(
        "from fw_copy_recipe import CopyRecipe\n\n\nclass Shapeless(CopyRecipe):\n    @classmethod\n"
        "    def batch_shapes(cls, cfg, tokenizer):\n        return {}['rows']\n")
    sys.path[:0] = [str(ROOT / "tests" / "plugins"), str(tmp_path)]
    try:
        install_recipe({"shapeless": "shapeless_recipe:Shapeless"})
        cfg = resolve({"recipe": "shapeless", "model": {"policy": {"preset": "tiny"}}})
        with pytest.raises(FwError) as e:
            mp.estimate(cfg, gpu_gib=4.0)
    finally:
        sys.path.remove(str(ROOT / "tests" / "plugins"))
        sys.path.remove(str(tmp_path))
        sys.modules.pop("shapeless_recipe", None)
    assert str(e.value) == (f"recipe: Shapeless.batch_shapes raised KeyError: 'rows' "
                            f"(at {tmp_path / 'shapeless_recipe.py'}:7)")


def test_ctrl_c_while_the_plan_reads_a_slow_task_exits_130_naming_where_it_was(tmp_path):
    """A real SIGINT to `fw plan` while the task's sample() sleeps: exit code 130, one line naming the call and the
    user's line the plan was waiting on, no traceback."""
    marker = tmp_path / "started"
    (tmp_path / "slow_plan_task.py").write_text(
        "import pathlib\nimport time\n\n\nclass Task:\n    def sample(self, index):\n        if index == 3:\n"
        f"            pathlib.Path({str(marker)!r}).touch()\n            time.sleep(60)\n"
        "        return {'prompt': '1+1=', 'answer': '2', 'metadata': {}}\n")
    config = tmp_path / "c.yaml"
    config.write_text("recipe: grpo\nmodel: {policy: {preset: tiny}}\n"
                      "data: {task: {class_path: slow_plan_task.Task}, chat_template: false}\n"
                      "reward: {name: exact_match}\nrollout: {prompts_per_step: 2, max_new_tokens: 4}\n")
    env = {k: v for k, v in os.environ.items() if k != "FW_DEBUG"}
    proc = subprocess.Popen([sys.executable, "-m", "framework", "plan", "--config", str(config)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    interrupt_once_started(proc, marker)
    out, err = proc.communicate(timeout=60)
    assert (proc.returncode, out, err) == (
        130, "", f"fw: interrupted: KeyboardInterrupt in Task.sample (at {tmp_path / 'slow_plan_task.py'}:9)\n")
