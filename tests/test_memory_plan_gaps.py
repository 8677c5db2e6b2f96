"""What the memory plan counts beside the job's tensors: on CPU the process itself; in SFT the token accuracy's
logits."""

import gc
from pathlib import Path

import pytest
import torch
from test_memory_plan import _allocated_peak

from framework import memory_plan as mp
from framework.cli import main
from framework.config import load_config
from framework.models.qwen3_config import Qwen3Config

ROOT = Path(__file__).resolve().parents[1]
TRAIN = str(ROOT / "train.yaml")
CPU = ["--trainer.accelerator=cpu"]


def vm_rss() -> float:
    """This process's resident memory as the kernel reports it in /proc/self/status, in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return float(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def test_the_cpu_plan_counts_the_process_resident_memory_outside_the_allocator():
    # the earlier tests' garbage, freed while the plan is made, would shrink the resident memory in between
    gc.collect()
    before = vm_rss()
    plan = mp.estimate(load_config([TRAIN], CPU))
    after = vm_rss()
    (baseline,) = [r for r in plan.rows if r.name == "process baseline"]
    assert baseline.phases == ("held",) and baseline.outside_allocator
    low, high = min(before, after), max(before, after)
    assert low - 2**20 <= baseline.bytes <= high + 2**20, (before, baseline.bytes, after)
    assert plan.total_bytes - plan.allocated_bytes == baseline.bytes
    assert "  process baseline " in plan.table()
    # a GPU's plan is unchanged: the process's host memory is not on the GPU
    gpu = mp.estimate(load_config([TRAIN], []), gpu_gib=80.0)
    assert not [r for r in gpu.rows if r.name == "process baseline"]


def test_a_cpu_fit_that_fits_only_without_the_process_is_refused(tmp_path, capsys):
    """A limit above the job's tensors by half the process's resident memory: the check passed it, and the job
    could run out of memory once it built them."""
    tensors = mp.estimate(load_config([TRAIN], CPU)).allocated_bytes
    limit = (tensors + vm_rss() / 2) / mp.GIB
    run_dir = tmp_path / "run"
    code = main(["fit", "--config", TRAIN, *CPU, f"--run_dir={run_dir}", f"--trainer.memory_limit_gib={limit}"])
    err = capsys.readouterr().err
    assert code == 2, err[-3000:]
    (line,) = [ln for ln in err.splitlines() if ln.startswith("fw: error: ")]
    assert line.startswith("fw: error: memory plan: the job needs ") and "the biggest row is process baseline" in line
    assert "  process baseline " in err and "Traceback" not in err and not (run_dir / "config.yaml").exists()
    # with room for the process too, it fits
    room = mp.estimate(load_config([TRAIN], [*CPU, f"--trainer.memory_limit_gib={limit + vm_rss() / mp.GIB}"]))
    assert room.fits, room.table()


# ------------------------------------------------------------------------------------------ token accuracy

SFT = str(ROOT / "recipes" / "sft.yaml")
# Qwen3-0.6B's shape (its config.json): a vocabulary of 151,936 and 1,024-wide hidden states
QWEN_VOCAB, QWEN_HIDDEN = 151936, 1024
BIG_SFT = ["--model.policy.preset=qwen3-0.6b", "--data.max_seq_len=2048", "--data.batch_size=8"]


@pytest.mark.parametrize("tokens", [1000, 6000])   # one chunk of logits, and two
@pytest.mark.parametrize("autocast", [False, True])
def test_the_accuracy_peak_is_what_sfts_accuracy_holds(tokens, autocast):
    """recipes/sft.py's `_accuracy` on CPU, float32 or under bf16 autocast: the allocator's peak is the planned peak
    (one chunk's logits, autocast's casts, the argmax), not two chunks' logits at once. The CPU's
    bfloat16 matmul adds a scratch buffer, which the plan leaves out: well under a percent of the logits, but a few
    percent where oneDNN takes its AMX kernels (a CPU with AMX tiles; ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 brings it
    back under a percent); the accuracy's count adds a few scalars."""
    from recipes.sft import SFTRecipe

    vocab, hidden = 8192, 64
    model = Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=128, num_hidden_layers=1,
                        num_attention_heads=1, num_key_value_heads=1, head_dim=64)
    torch.manual_seed(0)
    h, w = torch.randn(tokens, hidden), torch.randn(vocab, hidden)
    t = torch.randint(0, vocab, (tokens,))
    recipe = SFTRecipe.__new__(SFTRecipe)   # `_accuracy` reads nothing of the instance but the class's chunk

    def accuracy():
        with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
            recipe._accuracy(h, w, t)

    accuracy()   # the first call's one-off allocations out of the measure
    measured = _allocated_peak(accuracy)
    planned = mp.accuracy_peak_bytes(model, tokens, SFTRecipe.ACCURACY_CHUNK, 4, 2 if autocast else 4)
    scratch = 1.04 if autocast else 1.01
    assert measured <= scratch * planned + 1024 and planned <= 1.05 * measured, (measured / 2**20, planned / 2**20)


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_an_sft_plan_counts_the_accuracy_logits_beyond_the_backwards_buffers(device):
    """16,384 loss tokens of Qwen3-0.6B: a logged step's accuracy holds one chunk of 4,096 tokens' logits while every
    activation is held. By hand from the config, less what the step's train phase counts that is not live then: one
    layer's activations' gradients in flight, the loss's backward's float32 grad_hidden and one tile of the LM
    head's gradient, and on CPU (float32) the loss reference's six float32 tiles of 441 rows (2**28 bytes a tile); on
    the GPU (bf16-mixed, float32 weights, kept logits) the accuracy also casts the LM head and a chunk's hidden
    states to bfloat16."""
    n, chunk, v, d, heads = 8 * 2048, 4096, QWEN_VOCAB, QWEN_HIDDEN, 16
    q, kv, inter = 16 * 128, 8 * 128, 3072
    # what one layer saves per token: its input and mid-point in the weights' dtype; qkv, attention's output,
    # gate_up, the rotated q and k with v's copy, the two normed inputs and swiglu's output in the matmuls'; the
    # float32 logsumexp of each head
    compute = (q + 2 * kv) + q + 2 * inter + (q + 2 * kv) + d + d + inter
    argmax = chunk * (8 + 1)   # the last chunk's int64 indices and their comparison's bools: a bound
    backward = n * d * 4 + 8192 * d * 4
    if device == "cuda":
        plan = mp.estimate(load_config([SFT], [*BIG_SFT, "--trainer.precision=bf16-mixed"]), gpu_gib=80.0)
        in_flight = n * (2 * d * 4 + compute * 2 + 4 * heads)
        expected = chunk * v * 2 + (v * d + chunk * d) * 2 + argmax - backward - in_flight
    else:
        plan = mp.estimate(load_config([SFT], [*BIG_SFT, *CPU, "--trainer.memory_limit_gib=1000"]))
        in_flight = n * (2 * d * 4 + compute * 4 + 4 * heads)
        expected = chunk * v * 4 + argmax - backward - in_flight - 6 * (2**28 // (4 * v)) * v * 4
    (row,) = [r for r in plan.rows if r.name == "accuracy logits"]
    # on CPU the loss's six tiles outweigh one chunk's logits: the accuracy raises no peak there
    assert row.phases == ("train",) and row.bytes == max(0, expected), plan.table()
    assert (expected > 0) == (device == "cuda"), expected
    # a recipe that computes no accuracy gets no row
    assert not [r for r in mp.estimate(load_config([TRAIN], CPU)).rows if r.name == "accuracy logits"]
