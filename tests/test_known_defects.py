"""Known defects, each checked against what a user meets: integer tensors handed to the norm and RoPE ops, logits of
no columns handed to the sampler, a model directory (written by transformers) that lacks a tensor, fw eval's report of
the settings that differ from the checkpoint's."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_eval import EVAL, grpo_config
from test_hf_parity import hf_model

import ops_cuda
from framework.cli import main
from framework.errors import FwError
from framework.models import load_pretrained
from framework.trainer import fit


# ------------------------------------------------------------------ the norm and RoPE ops take floating tensors
def _qkv_args(dtype=torch.float32, weight_dtype=torch.float32):
    """qkv of 3 tokens, 2 query heads and 1 kv head of 8, its positions and norm weights."""
    qkv = torch.randn(3, (2 + 2) * 8).to(dtype)
    return qkv, torch.arange(3), torch.ones(8, dtype=weight_dtype), torch.ones(8, dtype=weight_dtype)


def _pools(dtype=torch.float32):
    return torch.zeros(2, 1, 4, 8, dtype=dtype), torch.zeros(2, 1, 4, 8, dtype=dtype)


INTEGER_CALLS = {
    "rms_norm-x": (lambda d: ops_cuda.rms_norm(torch.ones(2, 4, dtype=d), torch.ones(4), 1e-6), "rms_norm", "x"),
    "rms_norm-weight": (lambda d: ops_cuda.rms_norm(torch.ones(2, 4), torch.ones(4, dtype=d), 1e-6),
                        "rms_norm", "weight"),
    "add_rms_norm-x": (lambda d: ops_cuda.add_rms_norm(torch.ones(2, 4, dtype=d), torch.ones(2, 4, dtype=d),
                                                       torch.ones(4), 1e-6), "add_rms_norm", "x"),
    "add_rms_norm-weight": (lambda d: ops_cuda.add_rms_norm(torch.ones(2, 4), torch.ones(2, 4),
                                                            torch.ones(4, dtype=d), 1e-6), "add_rms_norm", "weight"),
    "qk_norm_rope-qkv": (lambda d: ops_cuda.qk_norm_rope(*_qkv_args(d), 1e-6, 1e4, 1), "qk_norm_rope", "qkv"),
    "qk_norm_rope-weight": (lambda d: ops_cuda.qk_norm_rope(*_qkv_args(weight_dtype=d), 1e-6, 1e4, 1),
                            "qk_norm_rope", "q_weight"),
    "qk_norm_rope_write-qkv": (lambda d: ops_cuda.qk_norm_rope_write(
        *_qkv_args(d), 1e-6, 1e4, *_pools(d), torch.zeros(3, dtype=torch.long), torch.arange(3)),
        "qk_norm_rope_write", "qkv"),
    "rope-q": (lambda d: ops_cuda.rope(torch.ones(1, 2, 2, 4, dtype=d), torch.ones(1, 2, 1, 4, dtype=d),
                                       torch.arange(2)[None], 1e4), "rope", "q"),
}


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool], ids=str)
@pytest.mark.parametrize("case", list(INTEGER_CALLS))
def test_norm_and_rope_ops_refuse_tensors_that_are_not_floating_point(case, dtype):
    """The CUDA kernels take float32, bfloat16 and float16 only; on the CPU the references computed in the integer
    dtype and returned truncated numbers of it (rms_norm of ones: ones; of [1, 2]: [0, 1]) without a word."""
    call, op, name = INTEGER_CALLS[case]
    with pytest.raises(ValueError, match=rf"^ops_cuda\.{op}: `{name}` must be a floating-point tensor, got "
                                         rf"{dtype}$"):
        call(dtype)


def test_the_float_check_leaves_floating_tensors_working():
    """float64 and bfloat16 still run, and give the hand-computed RMSNorm of [3, 4]: x / sqrt(12.5)."""
    for dtype in (torch.float64, torch.bfloat16):
        y = ops_cuda.rms_norm(torch.tensor([[3.0, 4.0]], dtype=dtype), torch.ones(2, dtype=dtype), 0.0)
        want = torch.tensor([[3.0, 4.0]], dtype=torch.float64) / 12.5 ** 0.5
        assert y.dtype == dtype
        torch.testing.assert_close(y.double(), want, rtol=1e-2 if dtype == torch.bfloat16 else 1e-12, atol=0)


# ------------------------------------------------------------------ sample: a vocabulary of no columns
@pytest.mark.parametrize("rows", [2, 0])
@pytest.mark.parametrize("settings", [(1.0, 0, 1.0, 0.0), (0.0, 0, 1.0, 0.0), (0.7, 5, 1.0, 0.0),
                                      (0.7, 0, 0.9, 0.0), (0.7, 0, 1.0, 0.1)],
                         ids=["plain", "greedy", "top_k", "top_p", "min_p"])
def test_sample_refuses_logits_of_no_columns(settings, rows):
    """Logits [B, 0] raised IndexError from deep inside the reference (an index of -1, or argmax/max over an empty
    dim); the wrapper and the op itself (the CPU kernel) now say what is wrong."""
    message = rf"^ops_cuda\.sample: `logits` has no columns \(shape \({rows}, 0\)\): a vocabulary of zero tokens"
    logits = torch.zeros(rows, 0)
    with pytest.raises(ValueError, match=message):
        ops_cuda.sample(logits, *settings, seed=3)
    with pytest.raises(ValueError, match=message):
        torch.ops.fw.sample(logits, *settings, 3, None)


# ------------------------------------------------------------------ a model directory that lacks a tensor
INDEX = "model.safetensors.index.json"


def _drop(file, name):
    """Rewrite safetensors `file` without tensor `name`, as a download of another revision of it would be."""
    tensors = load_file(str(file))
    del tensors[name]
    save_file(tensors, str(file), metadata={"format": "pt"})


def test_a_tensor_missing_from_the_single_file_names_that_file(tmp_path):
    hf_model(tied=False, kv_heads=2).save_pretrained(tmp_path)
    _drop(tmp_path / "model.safetensors", "model.norm.weight")
    with pytest.raises(FwError) as e:
        load_pretrained(tmp_path)
    assert str(e.value) == f"{tmp_path / 'model.safetensors'}: missing tensors ['model.norm.weight']"


def test_a_tensor_missing_from_its_shard_names_the_shard(tmp_path):
    """The index places the tensor in a shard that does not hold it: the shard and the index are named, not only
    the directory, whose many files the user would otherwise fetch again one by one."""
    hf_model(tied=False, kv_heads=2).save_pretrained(tmp_path, max_shard_size="8KB")
    weight_map = json.loads((tmp_path / INDEX).read_text())["weight_map"]
    shard = weight_map["model.layers.1.mlp.up_proj.weight"]
    assert len(set(weight_map.values())) > 2   # sharded: the message must pick the one shard out of several
    _drop(tmp_path / shard, "model.layers.1.mlp.up_proj.weight")
    with pytest.raises(FwError) as e:
        load_pretrained(tmp_path)
    assert str(e.value) == (f"{tmp_path / shard}: missing tensors ['model.layers.1.mlp.up_proj.weight'], which {INDEX} "
                            "places in that shard")


def test_a_tensor_the_index_places_nowhere_names_the_index_and_the_shards_searched(tmp_path):
    hf_model(tied=False, kv_heads=2).save_pretrained(tmp_path, max_shard_size="8KB")
    index = json.loads((tmp_path / INDEX).read_text())
    for name in ("model.norm.weight", "model.layers.0.input_layernorm.weight"):
        _drop(tmp_path / index["weight_map"].pop(name), name)
    (tmp_path / INDEX).write_text(json.dumps(index))
    shards = sorted(set(index["weight_map"].values()))
    more = f" and {len(shards) - 8} more" if len(shards) > 8 else ""
    with pytest.raises(FwError) as e:
        load_pretrained(tmp_path)
    assert str(e.value) == (f"{tmp_path / INDEX}: missing tensors ['model.layers.0.input_layernorm.weight', "
                            f"'model.norm.weight']: the index maps them to no shard, and none of its shards "
                            f"{shards[:8]}{more} holds them")


# ------------------------------------------------------------------ fw eval: where output goes is no setting
def test_fw_eval_does_not_count_where_a_run_writes_as_a_changed_setting(tmp_path, capsys):
    """A config of the same settings for another run directory and name (the training config kept beside a copied
    run, or one written for another run) evaluates as the checkpoint's own: its report lists no changes and takes
    the checkpoint's own report path. run_dir and name used to be listed as changes, and the report was written
    under a hashed name as one of other settings."""
    run = tmp_path / "run"
    fit(grpo_config(run, {**EVAL, "at_start": False}, trainer={"accelerator": "cpu", "max_steps": 2,
                                                               "enable_progress_bar": False}))
    text = (run / "config.yaml").read_text()
    assert f"\nrun_dir: {run}\n" in text and "\nname: fw\n" in text
    other = tmp_path / "other.yaml"
    other.write_text(text.replace(f"\nrun_dir: {run}\n", "\nrun_dir: elsewhere\n").replace("\nname: fw\n",
                                                                                           "\nname: another\n"))
    own = run / "eval" / "step-000002.json"
    assert main(["eval", "--checkpoint", str(run), "--config", str(other)]) == 0
    assert sorted(p.name for p in (run / "eval").iterdir()) == [own.name]
    assert json.loads(own.read_text())["changes"] == {}
    # a setting that the evaluation reads is still listed, and alone
    out = tmp_path / "r.json"
    assert main(["eval", "--checkpoint", str(run), "--config", str(other), "--eval.samples_per_prompt=1",
                 "--out", str(out)]) == 0
    assert json.loads(out.read_text())["changes"] == {"eval.samples_per_prompt": 1}
    # and such a change gets one default report whatever run_dir and name the config names
    for config in (other, run / "config.yaml"):
        assert main(["eval", "--checkpoint", str(run), "--config", str(config), "--eval.samples_per_prompt=1"]) == 0
    (hashed,) = [p.name for p in (run / "eval").iterdir() if p.name != own.name]
    assert hashed.startswith("step-000002-"), hashed
    # overrides on the checkpoint's own config.yaml, as `fw eval --help` offers them
    assert main(["eval", "--checkpoint", str(run), "--run_dir", str(tmp_path / "x"), "--name=x", "--out",
                 str(out)]) == 0
    assert json.loads(out.read_text())["changes"] == {}
    assert not (tmp_path / "elsewhere").exists() and not (tmp_path / "x").exists()
