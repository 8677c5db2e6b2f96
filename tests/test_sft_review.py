"""SFT under attack: a procedural task's examples cut by data.max_seq_len are said; a completion whose first character
the tokenizer's normalizer folds into the prompt's last token is trained; packed and unpacked batches, split over
processes and accumulated, give the float64 gradient of the token mean over the examples each run alone; and every
example of an epoch is trained once."""

import json
from collections import Counter
from itertools import pairwise
from types import SimpleNamespace

import pytest
import torch
from scripts.qwen_tokenizer import qwen_tokenizer_dir

from framework.config import resolve
from framework.data import IGNORE, ExampleStream, SFTBatches, encode_record
from framework.models import build_policy
from framework.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.builtin()


def sft_cfg(data: dict, **sections: dict) -> dict:
    return resolve({"recipe": "sft", "model": {"policy": {"preset": "tiny"}}, "data": data, **sections})


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


# ---------------------------------------------------------------- a task's cut examples are said

def test_a_task_example_cut_by_max_seq_len_is_said_once(tok, capsys):
    """data.path examples are counted at load; a procedural task's, which are endless, are said when training first
    reads one longer than data.max_seq_len (a countdown example is over 200 built-in tokens, its answer at the end:
    cut to 100 it keeps no target, and the run would train on nothing without a word)."""
    cfg = sft_cfg({"task": {"name": "countdown"}, "max_seq_len": 100})
    stream = ExampleStream(cfg, tok, train_on_prompt=False)
    assert capsys.readouterr().err == ""
    n = len(stream[0].ids)
    assert n > 200
    batches = iter(SFTBatches(stream, 0, 2, 100, True, tok.pad_id))
    assert int((next(batches)["targets"] != IGNORE).sum()) == 0
    next(batches)
    assert capsys.readouterr().err.splitlines() == [
        (f"fw: data.task: example 0 has {n} tokens, more than data.max_seq_len (100), and is cut to it, keeping no "
         "token to train on; later examples that are longer are cut too, unsaid")]
    # long enough: nothing is said
    stream = ExampleStream(sft_cfg({"task": {"name": "countdown"}, "max_seq_len": 512}), tok, train_on_prompt=False)
    next(iter(SFTBatches(stream, 0, 2, 512, True, tok.pad_id)))
    assert capsys.readouterr().err == ""


def test_a_cut_task_example_that_keeps_targets_is_said_without_the_warning(tok, capsys):
    """With sft.train_on_prompt an example cut by one token keeps every target but its last."""
    n = len(ExampleStream(sft_cfg({"task": {"name": "countdown"}}), tok, train_on_prompt=True)[0].ids)
    stream = ExampleStream(sft_cfg({"task": {"name": "countdown"}, "max_seq_len": n - 1}), tok, train_on_prompt=True)
    batches = iter(SFTBatches(stream, 0, 1, n - 1, False, tok.pad_id))
    next(batches)
    assert capsys.readouterr().err.splitlines() == [
        (f"fw: data.task: example 0 has {n} tokens, more than data.max_seq_len ({n - 1}), and is cut to it; later "
         "examples that are longer are cut too, unsaid")]


# ---------------------------------------------------------------- normalizer folding at the completion's start

def test_a_completion_starting_with_a_combining_mark_is_trained_from_its_first_character():
    """Qwen3's tokenizer normalizes to NFC: a plain prompt ending in "e" and a completion starting with U+0301 become
    one "é", and the token holding it reports the span of the "e" alone. It carries the completion's first character,
    so it is trained, as a token straddling the boundary is."""
    tok = Tokenizer.from_pretrained(qwen_tokenizer_dir())
    cfg = sft_cfg({"path": "unused.jsonl", "chat_template": False})
    ex = encode_record({"prompt": "Say cafe", "completion": "\u0301 au lait"}, "auto", tok, cfg, "x",
                       train_on_prompt=False)
    assert tok.decode(ex.ids) == "Say caf\u00e9 au lait<|im_end|>"
    trained = tok.decode([t for t in ex.targets if t != IGNORE])
    assert trained.endswith("\u00e9 au lait<|im_end|>") and "Say" not in trained, trained
    assert all(t == IGNORE or t == ex.ids[i + 1] for i, t in enumerate(ex.targets))


# ---------------------------------------------------------------- loss and gradients: float64 reference

RECORDS = [{"prompt": "q" * (1 + 5 * i % 7), "completion": "a" * (1 + 3 * i % 9)} for i in range(10)]


def grads_of_training(path, pack: bool, world: int, accumulate: int, batch_size: int) -> tuple[list, int]:
    """The float64 gradient one optimizer step of the recipe leaves: each rank's micro-batches through
    SFTRecipe.training_step, each loss divided by `accumulate` and `world` as Lightning and DDP's averaging do."""
    from recipes.sft import SFTRecipe

    cfg = sft_cfg({"path": str(path), "chat_template": False, "pack": pack, "batch_size": batch_size,
                   "max_seq_len": 40}, trainer={"accumulate_grad_batches": accumulate})
    tok = Tokenizer.builtin()
    policy = build_policy(cfg["model"]["policy"], tok, seed=3).double()
    recipe = SFTRecipe(cfg, tok)
    ranks = [SimpleNamespace(policy=policy, rank=r, world_size=world, device=torch.device("cpu"),
                             log=lambda *a, **k: None, logging_this_step=lambda: True) for r in range(world)]
    loaders = [iter(SFTBatches(recipe.stream, 0, batch_size, 40, pack, tok.pad_id, r, world, accumulate))
               for r in range(world)]
    for _ in range(accumulate):
        for ctx, loader in zip(ranks, loaders):
            (recipe.training_step(ctx, next(loader), 0) / accumulate / world).backward()
    return [p.grad for p in policy.parameters()], recipe.position


def grads_of_each_example_alone(path, position: int) -> list:
    """The gradient of the token mean of -log p(target) over stream examples 0 .. position-1, each run alone."""
    cfg = sft_cfg({"path": str(path), "chat_template": False, "max_seq_len": 40})
    tok = Tokenizer.builtin()
    policy = build_policy(cfg["model"]["policy"], tok, seed=3).double()
    stream = ExampleStream(cfg, tok, train_on_prompt=False)
    nll, count = torch.zeros((), dtype=torch.float64), 0
    for p in range(position):
        e = stream[p]
        assert len(e.ids) <= 40
        logp = torch.log_softmax(policy(torch.tensor([e.ids]))[0], -1)
        t = torch.tensor(e.targets)
        keep = t != IGNORE
        nll = nll - logp[keep].gather(1, t[keep][:, None]).sum()
        count += int(keep.sum())
    (nll / count).backward()
    return [p.grad for p in policy.parameters()]


@pytest.mark.parametrize(("pack", "world", "accumulate", "batch_size"),
                         [(False, 1, 2, 2), (False, 2, 2, 1), (True, 1, 3, 1), (True, 2, 2, 1)])
def test_a_step_gives_the_token_mean_gradient_of_its_examples_alone(tmp_path, pack, world, accumulate, batch_size):
    """Micro-batches of uneven target counts (completions of 1 to 9 tokens), packed (several examples a row) or not,
    over 1 or 2 processes: the step's gradient is that of the mean over every target token of the step, each example
    run alone, in float64 (a per-micro-batch or per-example mean, or attention across a packed row, differs)."""
    path = write_jsonl(tmp_path / "d.jsonl", RECORDS)
    got, position = grads_of_training(path, pack, world, accumulate, batch_size)
    assert position >= (4 if not pack else 8)   # packed rows hold several examples
    want = grads_of_each_example_alone(path, position)
    for g, w in zip(got, want):
        assert torch.allclose(g, w, atol=1e-12, rtol=1e-9)


# ---------------------------------------------------------------- every example once an epoch

@pytest.mark.parametrize(("pack", "world", "accumulate", "batch_size"),
                         [(False, 3, 2, 2), (True, 2, 3, 2), (True, 1, 1, 1)])
def test_every_example_of_an_epoch_is_trained_once(tmp_path, tok, pack, world, accumulate, batch_size):
    """11 records (fewer than some global batches), shuffled, over several epochs: the examples in the rows of every
    process's micro-batches, in order, are the stream's epochs, each a permutation of the records."""
    records = [{"prompt": f"{i}" * (1 + i % 4), "completion": chr(ord("a") + i) * (1 + i % 3)} for i in range(11)]
    path = write_jsonl(tmp_path / "d.jsonl", records)
    cfg = sft_cfg({"path": str(path), "chat_template": False, "max_seq_len": 24})
    stream = ExampleStream(cfg, tok, train_on_prompt=False)
    loaders = [iter(SFTBatches(stream, 0, batch_size, 24, pack, tok.pad_id, r, world, accumulate))
               for r in range(world)]
    seen: list[str] = []
    position = 0
    for _ in range(7 * accumulate):
        batches = [next(loader) for loader in loaders]
        for b in batches:
            assert b["next_position"] == batches[0]["next_position"]
            for ids, pos in zip(b["input_ids"].tolist(), b["position_ids"].tolist()):
                starts = [i for i, p in enumerate(pos) if p == 0] + [len(ids)]
                # a row's padding is a sequence of its own, of pad tokens
                seen += [tok.decode(ids[a:z]) for a, z in pairwise(starts) if ids[a] != tok.pad_id]
        position = batches[0]["next_position"]
    assert position > 2 * len(records)
    texts = [r["prompt"] + r["completion"] + "<|im_end|>" for r in records]
    expected = []
    for epoch in range(-(-position // len(records))):
        seed = (cfg["seed"] + epoch * 0x9E3779B9) % 2**32   # an odd stride per epoch: data.epoch_seed
        perm = torch.randperm(len(records), generator=torch.Generator().manual_seed(seed)).tolist()
        expected += [texts[i] for i in perm]
    assert seen == expected[:position]
    for epoch in range(position // len(records)):
        assert Counter(seen[epoch * len(records):(epoch + 1) * len(records)]) == Counter(texts)
