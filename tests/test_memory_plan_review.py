"""The KV budget against the rows a rollout or an evaluation generates: `fw validate` (and so `fw fit` before it
builds anything) refuses a row that the engine's pool cannot hold, where the config fixes the pool's budget, as the
engine refuses it at its first rollout; and the plan counts the CPU pool the engine makes."""

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
