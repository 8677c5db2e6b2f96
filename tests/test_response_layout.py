"""recipes/rl.py `response_layout` field by field against layouts built token by token in plain Python, on random
micro-batches (empty completions, groups interleaved under any ids, one row), padded, packed and with shared
prompts; on CUDA the same, with the device never waited for."""
import itertools
import random

import pytest
import torch

from recipes.rl import response_layout


def batch(seed: int, rows: int, shared: bool):
    """Random right-padded rows: host prompt and completion lengths (some completions empty), group ids (a group's
    rows share their prompt's length and tokens), the width."""
    rng = random.Random(seed)
    ids = [rng.choice([3, 7, 10, 42]) for _ in range(rows)]
    group_prompt = {k: rng.randint(1, 9) for k in set(ids)}
    p = [group_prompt[k] if shared else rng.randint(1, 9) for k in ids]
    width = rng.randint(1, 12)
    c = [rng.choice([0, width, rng.randint(0, width)]) for _ in range(rows)]
    tokens = torch.randint(0, 1000, (rows, 9 + width + 3), generator=torch.Generator().manual_seed(seed))
    if shared:
        for b, k in enumerate(ids):
            first = ids.index(k)
            tokens[b, :p[b]] = tokens[first, :p[b]]
    return tokens, p, c, ids, width


def padded_by_hand(tokens, p, c):
    longest = max(a + b for a, b in zip(p, c))
    answers = [(b, j, b * longest + p[b] + j - 1, int(tokens[b, p[b] + j])) for b in range(len(p)) for j in range(c[b])]
    return tokens[:, :longest], None, answers, None


def packed_by_hand(tokens, p, c):
    ids, pos, answers, cu = [], [], [], [0]
    for b in range(len(p)):
        start = len(ids)
        for i in range(p[b] + c[b]):
            ids.append(int(tokens[b, i]))
            pos.append(i)
        cu.append(len(ids))
        answers += [(b, j, start + p[b] + j - 1, int(tokens[b, p[b] + j])) for j in range(c[b])]
    return ids, pos, answers, {"cu_seqlens": cu, "max_seqlen": max(a + b for a, b in zip(p, c))}


def shared_by_hand(tokens, p, c, groups):
    keys = sorted(set(groups))
    first = {k: groups.index(k) for k in keys}
    ids, pos, last, cu_p, cu_g, cu_s = [], [], {}, [0], [0], [0]
    for k in keys:
        b = first[k]
        ids += tokens[b, :p[b]].tolist()
        pos += list(range(p[b]))
        last[k] = len(ids) - 1
        cu_p.append(len(ids))
        cu_s.append(len(ids))
    answers, live = [], []
    for k in keys:
        for b in [r for r in range(len(p)) if groups[r] == k]:
            for j in range(c[b]):
                answers.append((b, j, last[k] if j == 0 else len(ids) - 1, int(tokens[b, p[b] + j])))
                ids.append(int(tokens[b, p[b] + j]))
                pos.append(p[b] + j)
            if c[b]:
                live.append(c[b])
                cu_s.append(len(ids))
        cu_g.append(len(ids) - cu_p[-1])
    prompts = [p[first[k]] for k in keys]
    per_group = [b - a for a, b in itertools.pairwise(cu_g)]
    return ids, pos, answers, {"prompt_tokens": cu_p[-1], "cu_prompts": cu_p, "max_prompt": max(prompts),
                               "cu_groups": cu_g, "max_group": max(per_group), "cu_seqs": cu_s,
                               "max_seq": max(prompts + live)}


def assert_layout(x, want) -> None:
    ids, pos, answers, packing = want
    if pos is None:   # padded
        assert torch.equal(x.input_ids.cpu(), ids) and x.position_ids is None and x.packing is None
    else:
        assert x.input_ids.cpu().tolist() == [ids] and x.position_ids.cpu().tolist() == [pos]
        got = {k: v.cpu().tolist() if isinstance(v, torch.Tensor) else v for k, v in x.packing._asdict().items()}
        assert got == packing
        assert all(v.dtype == torch.int32 for v in x.packing if isinstance(v, torch.Tensor))
    got = list(zip(*(t.cpu().tolist() for t in (x.rows, x.cols, x.source, x.targets))))
    assert got == answers
    assert all(t.dtype == torch.long for t in (x.rows, x.cols, x.source))


CASES = [(seed, rows) for seed in range(6) for rows in (1, 5, 12)]


@pytest.mark.parametrize("seed, rows", CASES)
@pytest.mark.parametrize("layout", ["padded", "packed", "shared"])
def test_the_layout_is_the_one_built_token_by_token(seed, rows, layout):
    tokens, p, c, groups, width = batch(seed, rows, shared=layout == "shared")
    pl, cl = torch.tensor(p), torch.tensor(c)
    if layout == "shared":
        x = response_layout(tokens, pl, cl, width, groups=torch.tensor(groups))
        assert_layout(x, shared_by_hand(tokens, p, c, groups))
    else:
        x = response_layout(tokens, pl, cl, width, packed=layout == "packed")
        assert_layout(x, (packed_by_hand if layout == "packed" else padded_by_hand)(tokens, p, c))


def test_packed_none_pads_unless_packing_removes_enough_tokens():
    tokens = torch.arange(40).reshape(2, 20)
    # 19 and 20 tokens: packing would save 1 of 40, under PACK_MIN_SAVING
    assert response_layout(tokens, torch.tensor([9, 10]), torch.tensor([10, 10]), 10).packing is None
    # 5 and 20 tokens: it saves 15 of 40
    x = response_layout(tokens, torch.tensor([3, 10]), torch.tensor([2, 10]), 10)
    assert x.packing.cu_seqlens.tolist() == [0, 5, 25]


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["padded", "packed", "shared"])
def test_on_cuda_the_layout_is_the_same_and_never_waits_for_the_device(layout):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    for seed, rows in CASES:
        tokens, p, c, groups, width = batch(seed, rows, shared=layout == "shared")
        pl, cl = torch.tensor(p), torch.tensor(c)
        tokens_d = tokens.cuda()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            if layout == "shared":
                x = response_layout(tokens_d, pl, cl, width, groups=torch.tensor(groups))
            else:
                x = response_layout(tokens_d, pl, cl, width, packed=layout == "packed")
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert x.rows.is_cuda and x.input_ids.is_cuda
        if layout == "shared":
            assert_layout(x, shared_by_hand(tokens, p, c, groups))
        else:
            assert_layout(x, (packed_by_hand if layout == "packed" else padded_by_hand)(tokens, p, c))
