"""SFT data: JSONL errors, loss masks on rendered chats, packing, the resumable / rank-split batch stream."""

import json

import pytest
import torch

import ops_cuda
from framework.config import resolve
from framework.data import (
    IGNORE,
    Example,
    ExampleStream,
    SFTBatches,
    collate,
    encode_record,
    global_batch,
    read_jsonl,
    truncate,
)
from framework.errors import FwError
from framework.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.builtin()


def cfg_for(path, **data):
    return resolve({"recipe": "sft", "model": {"policy": {"preset": "tiny"}},
                    "data": {"path": str(path), **data}})


def write_jsonl(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def trained_text(tok, example):
    """The text of every target token, i.e. what the loss covers."""
    return tok.decode([t for t in example.targets if t != IGNORE])


# ---------------------------------------------------------------- JSONL errors
@pytest.mark.parametrize("line, message", [
    ('{"messages": [', "not valid JSON"),
    ('{"prompt": "1+1=, "completion": "2"}', "not valid JSON (Expecting ',' delimiter at column 20)"),
    ('{"prompt": "1+1=', "not valid JSON (Unterminated string starting at column 12)"),
    ('[1, 2]', "expected a JSON object"),
    ('{"text": "hi"}', "expected a 'messages' list or 'prompt' and 'completion'"),
    ('{"messages": [{"role": "bot", "content": "x"}]}', "messages[0].role is 'bot'"),
    ('{"messages": [{"role": "user", "content": 3}]}', "messages[0] must be an object with string"),
    ('{"messages": [{"role": "user", "content": "hi"}]}', "no assistant turn"),
    ('{"prompt": "a", "completion": 5}', "string 'completion'"),
    ('{"prompt": [{"role": "tool", "content": "x"}], "completion": "b"}',
     "prompt: messages[0]: role 'tool' is not supported"),
    ('{"prompt": [], "completion": "b"}', "prompt: messages: expected a non-empty list"),
    ('{"prompt": ["hi"], "completion": "b"}', "prompt: messages[0]: expected a {role, content} object, got a string"),
    ('{"prompt": [{"content": "hi"}], "completion": "b"}', "prompt: messages[0]: missing 'role'"),
    (('{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", '
     '"tool_calls": [{"name": "f"}]}]}'), "messages[1]: tool_calls are not supported"),
    ('{"messages": [{"role": "assistant", "content": "a", "reasoning_content": 3}]}',
     "messages[0]: reasoning_content must be a string"),
])
def test_malformed_line_names_file_and_line(tmp_path, tok, line, message):
    good = {"prompt": "1+1=", "completion": "2"}
    path = write_jsonl(tmp_path / "d.jsonl", [good, "", line, good])
    with pytest.raises(FwError) as e:
        ExampleStream(cfg_for(path), tok, train_on_prompt=False)
    assert f"{path}:3: " in str(e.value)
    assert message in str(e.value)


def test_an_empty_prompt_and_completion_without_a_template_is_an_error(tmp_path, tok):
    """Rendered to nothing, the record would be eos alone with two targets (a crash at collation)."""
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "1+1=", "completion": "2"}, {"prompt": "", "completion": ""}])
    with pytest.raises(FwError, match=r"d.jsonl:2: the prompt and the completion are both empty"):
        ExampleStream(cfg_for(path, chat_template=False), tok, train_on_prompt=False)


def test_records_may_hold_unicode_line_separators(tmp_path, tok):
    """JSON strings may hold U+2028, U+2029 and U+0085 raw (json.dumps(ensure_ascii=False) writes them): one record
    a line, and the line numbers after it stay right."""
    lines = [json.dumps({"prompt": f"a{c}b", "completion": "c"}, ensure_ascii=False) for c in "\u2028\u2029\x85"]
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(lines + ["[1]"]) + "\n", encoding="utf-8")
    with pytest.raises(FwError, match=r"d.jsonl:4: expected a JSON object"):
        read_jsonl(str(path))
    path.write_text("\r\n".join(lines) + "\r\n", encoding="utf-8")
    records = read_jsonl(str(path))
    assert [where.rsplit(":", 1)[1] for where, _ in records] == ["1", "2", "3"]
    assert [r["prompt"] for _, r in records] == ["a\u2028b", "a\u2029b", "a\x85b"]


def test_examples_longer_than_max_seq_len_are_counted_when_loaded(tmp_path, tok, capsys):
    """truncate cuts them silently at batch time: the load says how many, and how many keep no target."""
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "1+1=", "completion": "2"},
                                              {"prompt": "x" * 200, "completion": "y"},
                                              {"prompt": "1+1=", "completion": "z" * 200}])
    ExampleStream(cfg_for(path, max_seq_len=64), tok, train_on_prompt=False)
    assert capsys.readouterr().err.splitlines() == [
        ("fw: data.path: 2 of 3 examples are longer than data.max_seq_len (64) and are cut to it; 1 of them keeps "
        "no token to train on")]
    ExampleStream(cfg_for(path, max_seq_len=512), tok, train_on_prompt=False)
    assert capsys.readouterr().err == ""


EMPTY_REPLY = "which trains on its end token alone and teaches the model to answer with nothing"


@pytest.mark.parametrize("data, thinking", [({}, False), ({}, True), ({"chat_template": False}, False)],
                         ids=["chat", "thinking", "plain"])
def test_examples_with_an_empty_reply_are_counted_when_loaded(tmp_path, tok, capsys, data, thinking):
    """An empty assistant reply trains on its end token alone: the load says how many examples have one and where the
    first is. A reply of reasoning only, or a context turn of a prompt (not trained), is not one."""
    chat = data.get("chat_template", True)
    q, a = {"role": "user", "content": "1+1="}, {"role": "assistant", "content": "2"}
    records = [{"prompt": "1+1=", "completion": "2"}, {"prompt": "2+2=", "completion": ""}]
    if chat:
        records += [{"prompt": [q, {"role": "assistant", "content": ""}, q], "completion": "2"},
                    {"messages": [q, a, q, {"role": "assistant", "content": ""}]},
                    {"messages": [q, {"role": "assistant", "content": "", "reasoning_content": "two"}]}]
    path = write_jsonl(tmp_path / "d.jsonl", records)
    cfg = resolve({"recipe": "sft", "model": {"policy": {"preset": "tiny"}}, "tokenizer": {"enable_thinking": thinking},
                   "data": {"path": str(path), **data}})
    ExampleStream(cfg, tok, train_on_prompt=False)
    n = 2 if chat else 1
    assert capsys.readouterr().err.splitlines() == [
        (f"fw: data.path: {n} of {len(records)} examples {'have' if n > 1 else 'has'} an empty or blank reply "
         f'(the first: {path}:2: completion is ""), {EMPTY_REPLY}')]
    # what the empty reply of line 2 trains on, by the template: its end token (after the empty think block that
    # enable_thinking leaves to the reply)
    example = encode_record(records[1], "auto", tok, cfg, "d.jsonl:2", train_on_prompt=False)
    end = "<|im_end|>" if chat else tok.decode([tok.eos_id])
    assert trained_text(tok, example) == ("<think>\n\n</think>\n\n" if thinking else "") + end
    if chat:
        path = write_jsonl(tmp_path / "d.jsonl", [records[0], records[3]])
        ExampleStream(cfg_for(path), tok, train_on_prompt=False)
        assert capsys.readouterr().err.splitlines() == [
            (f"fw: data.path: 1 of 2 examples has an empty or blank reply (the first: {path}:2: "
             f'messages[3].content is ""), {EMPTY_REPLY}')]


def test_a_messages_rows_empty_reply_is_counted_without_the_chat_template_too(tmp_path, tok, capsys):
    """data.chat_template: false renders prompt/completion rows as plain text, but a messages row through the
    template all the same: its empty reply trains on `<|im_end|>` alone, and is counted with the plain row's."""
    q = {"role": "user", "content": "1+1="}
    records = [{"prompt": "1+1=", "completion": "2"}, {"messages": [q, {"role": "assistant", "content": ""}]},
               {"prompt": "2+2=", "completion": ""}]
    path = write_jsonl(tmp_path / "d.jsonl", records)
    cfg = cfg_for(path, chat_template=False)
    ExampleStream(cfg, tok, train_on_prompt=False)
    assert capsys.readouterr().err.splitlines() == [
        (f'fw: data.path: 2 of 3 examples have an empty or blank reply (the first: {path}:2: messages[1].content is '
         f'""), {EMPTY_REPLY}')]
    example = encode_record(records[1], "auto", tok, cfg, "d.jsonl:2", train_on_prompt=False)
    assert trained_text(tok, example) == "<|im_end|>"


def test_a_blank_reply_is_counted_and_quoted_as_the_record_holds_it(tmp_path, tok, capsys):
    """A reply of whitespace alone trains on little but its end token, as an empty one does: it is counted, and the
    line quotes the record's own value (the template may strip it)."""
    q = {"role": "user", "content": "1+1="}
    records = [{"prompt": "1+1=", "completion": "2"}, {"messages": [q, {"role": "assistant", "content": "\n"}]},
               {"prompt": "2+2=", "completion": " "}]
    path = write_jsonl(tmp_path / "d.jsonl", records)
    ExampleStream(cfg_for(path), tok, train_on_prompt=False)
    assert capsys.readouterr().err.splitlines() == [
        (f'fw: data.path: 2 of 3 examples have an empty or blank reply (the first: {path}:2: messages[1].content is '
         f'"\\n"), {EMPTY_REPLY}')]


def test_forced_format_mismatch_is_an_error(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "completion": "b"}])
    with pytest.raises(FwError, match=r"d.jsonl:1: 'messages' must be a non-empty list"):
        ExampleStream(cfg_for(path, format="messages"), tok, train_on_prompt=False)


def test_missing_file(tmp_path, tok):
    with pytest.raises(FwError, match="cannot read .*nope.jsonl"):
        ExampleStream(cfg_for(tmp_path / "nope.jsonl"), tok, train_on_prompt=False)


def test_read_jsonl_skips_blank_lines_and_keeps_line_numbers(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"a": 1}, "", "  ", {"b": 2}])
    assert read_jsonl(path) == [(f"{path}:1", {"a": 1}), (f"{path}:4", {"b": 2})]


# ---------------------------------------------------------------- loss masks
def test_chat_loss_covers_assistant_content_and_im_end(tmp_path, tok):
    cfg = cfg_for(tmp_path / "unused.jsonl")
    record = {"messages": [{"role": "system", "content": "Be brief."},
                           {"role": "user", "content": "What is 1 + 2?"},
                           {"role": "assistant", "content": "It is 3."},
                           {"role": "user", "content": "And 2 + 2?"},
                           {"role": "assistant", "content": "4"}]}
    ex = encode_record(record, "auto", tok, cfg, "x", train_on_prompt=False)
    full = ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 1 + 2?<|im_end|>\n"
            "<|im_start|>assistant\nIt is 3.<|im_end|>\n<|im_start|>user\nAnd 2 + 2?<|im_end|>\n"
            "<|im_start|>assistant\n<think>\n\n</think>\n\n4<|im_end|>\n")
    assert tok.decode(ex.ids) == full
    assert len(ex.targets) == len(ex.ids)
    # Targets are shifted: targets[t] is ids[t+1] where trained; the loss covers exactly these tokens.
    assert trained_text(tok, ex) == "It is 3.<|im_end|>4<|im_end|>"
    for t, target in enumerate(ex.targets):
        if target != IGNORE:
            assert target == ex.ids[t + 1]
    assert ex.targets[-1] == IGNORE


def test_with_thinking_enabled_the_last_turns_empty_think_block_is_trained(tmp_path, tok):
    """enable_thinking: the generation prompt stops at the assistant header, so the empty think block the template
    writes before the last turn's content is what the model must learn to write (it is prompt when thinking is
    off, whose generation prompt ends with it)."""
    cfg = resolve({"recipe": "sft", "model": {"policy": {"preset": "tiny"}}, "tokenizer": {"enable_thinking": True},
                   "data": {"path": str(tmp_path / "unused.jsonl")}})
    record = {"messages": [{"role": "user", "content": "What is 1 + 2?"}, {"role": "assistant", "content": "It is 3."},
                           {"role": "user", "content": "And 2 + 2?"}, {"role": "assistant", "content": "4"}]}
    ex = encode_record(record, "auto", tok, cfg, "x", train_on_prompt=False)
    assert tok.apply_chat_template(record["messages"][:3], add_generation_prompt=True,
                                   enable_thinking=True).endswith("<|im_start|>assistant\n")
    assert trained_text(tok, ex) == "It is 3.<|im_end|><think>\n\n</think>\n\n4<|im_end|>"
    off = encode_record(record, "auto", tok, cfg_for(tmp_path / "unused.jsonl"), "x", train_on_prompt=False)
    assert off.ids == ex.ids and trained_text(tok, off) == "It is 3.<|im_end|>4<|im_end|>"


def test_prompt_completion_loss_covers_completion_and_eos(tmp_path, tok):
    cfg = cfg_for(tmp_path / "unused.jsonl")
    ex = encode_record({"prompt": "2 * 3 =", "completion": " 6"}, "auto", tok, cfg, "x", train_on_prompt=False)
    # the assistant turn ends as the template ends it: <|im_end|>, then a newline that is not a target
    assert tok.decode(ex.ids) == ("<|im_start|>user\n2 * 3 =<|im_end|>\n<|im_start|>assistant\n"
                                  "<think>\n\n</think>\n\n 6<|im_end|>\n")
    assert ex.ids[-2] == tok.token_to_id("<|im_end|>")
    assert trained_text(tok, ex) == " 6<|im_end|>"

    raw = cfg_for(tmp_path / "unused.jsonl", chat_template=False)
    ex = encode_record({"prompt": "2 * 3 =", "completion": " 6"}, "auto", tok, raw, "x", train_on_prompt=False)
    assert tok.decode(ex.ids) == "2 * 3 = 6<|im_end|>"
    assert trained_text(tok, ex) == " 6<|im_end|>"


def test_train_on_prompt_trains_every_next_token(tmp_path, tok):
    cfg = resolve({"recipe": "sft", "model": {"policy": {"preset": "tiny"}},
                   "data": {"path": "unused", "chat_template": False}})
    ex = encode_record({"prompt": "ab", "completion": "c"}, "auto", tok, cfg, "x", train_on_prompt=True)
    assert ex.targets == ex.ids[1:] + [IGNORE]


# ---------------------------------------------------------------- packing
def ex(n, start):
    """An example of n tokens whose every next token is a target (ids are distinct per example)."""
    ids = list(range(start, start + n))
    return Example(ids, ids[1:] + [IGNORE])


class ListStream:
    def __init__(self, examples):
        self.examples = examples

    def __getitem__(self, position):
        return self.examples[position % len(self.examples)]


def test_packing_fills_rows_in_order_with_restarting_positions():
    stream = ListStream([ex(3, 100), ex(4, 200), ex(2, 300), ex(5, 400), ex(1, 500)])
    rows, nxt = global_batch(stream, 0, rows=2, max_len=8, pack=True)
    # Row 0: 3 + 4 tokens (the 2-token one does not fit: 9 > 8); row 1: 2 + 5 + 1; then the batch is full.
    assert [[e.ids[0] for e in row] for row in rows] == [[100, 200], [300, 400, 500]]
    assert nxt == 5
    b = collate(rows, pad_id=0, length=8)
    assert b["input_ids"].tolist() == [[100, 101, 102, 200, 201, 202, 203, 0],
                                       [300, 301, 400, 401, 402, 403, 404, 500]]
    assert b["position_ids"].tolist() == [[0, 1, 2, 0, 1, 2, 3, 0], [0, 1, 0, 1, 2, 3, 4, 0]]
    # No target crosses a sequence boundary: a sequence's last token predicts nothing.
    assert b["targets"].tolist() == [[101, 102, IGNORE, 201, 202, 203, IGNORE, IGNORE],
                                     [301, IGNORE, 401, 402, 403, 404, IGNORE, IGNORE]]
    assert b["num_tokens"] == 15
    # the loss tokens' flat positions, row after row (row 1 starts at 8)
    assert b["loss_index"].tolist() == [0, 1, 3, 4, 5, 8, 10, 11, 12, 13]


def test_unpacked_rows_are_right_padded_to_the_longest():
    stream = ListStream([ex(3, 100), ex(5, 200), ex(2, 300)])
    rows, nxt = global_batch(stream, 1, rows=2, max_len=64, pack=False)
    assert nxt == 3
    b = collate(rows, pad_id=7, length=None)
    assert b["input_ids"].tolist() == [[200, 201, 202, 203, 204], [300, 301, 7, 7, 7]]
    assert b["position_ids"].tolist() == [[0, 1, 2, 3, 4], [0, 1, 0, 1, 2]]
    assert b["targets"][1].tolist() == [301, IGNORE, IGNORE, IGNORE, IGNORE]
    assert b["input_ids"].dtype == b["position_ids"].dtype == b["targets"].dtype == torch.long
    assert b["loss_index"].tolist() == [0, 1, 2, 3, 5]


def test_truncation_keeps_the_head_and_drops_the_cut_target():
    e = truncate(ex(6, 10), 4)
    assert e.ids == [10, 11, 12, 13]
    assert e.targets == [11, 12, 13, IGNORE]


def test_packed_logprobs_equal_each_sequence_alone(tmp_path, tok):
    """A packed row's per-token log-probs equal those of each of its sequences run alone (fp32)."""
    from framework.models import build_policy

    torch.manual_seed(0)
    cfg = cfg_for(tmp_path / "unused.jsonl")
    policy = build_policy(cfg["model"]["policy"], tok).eval()
    examples = [encode_record({"prompt": p, "completion": c}, "auto", tok, cfg, "x", train_on_prompt=False)
                for p, c in [("1 + 1 =", " 2"), ("What is 12 * 3?", " 36"), ("hi", " there!")]]
    total = sum(len(e.ids) for e in examples)
    rows, _ = global_batch(ListStream(examples), 0, rows=1, max_len=total + 5, pack=True)
    assert rows == [examples]
    b = collate(rows, tok.pad_id, total + 5)
    with torch.no_grad():
        packed = torch.log_softmax(policy(b["input_ids"], position_ids=b["position_ids"]).double(), -1)[0]
        at = 0
        for e in examples:
            alone = torch.log_softmax(policy(torch.tensor([e.ids])).double(), -1)[0]
            n = len(e.ids)
            assert torch.allclose(packed[at:at + n], alone, atol=1e-5, rtol=0)
            at += n


# ---------------------------------------------------------------- the stream
def test_stream_epochs_are_seeded_permutations(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": f"q{i}", "completion": f"a{i}"} for i in range(7)])
    s = ExampleStream(cfg_for(path), tok, train_on_prompt=False)
    epoch0 = [tuple(s[p].ids) for p in range(7)]
    epoch1 = [tuple(s[p].ids) for p in range(7, 14)]
    everything = {tuple(e.ids) for e in s.examples}
    assert set(epoch0) == set(epoch1) == everything
    assert epoch0 != epoch1   # reshuffled every epoch
    order = torch.randperm(7, generator=torch.Generator().manual_seed(0)).tolist()
    assert epoch0 == [tuple(s.examples[i].ids) for i in order]
    assert [tuple(s[p].ids) for p in range(7)] == epoch0   # a pure function of the position
    unshuffled = ExampleStream(cfg_for(path, shuffle=False), tok, train_on_prompt=False)
    assert [unshuffled[p].ids for p in range(8)] == [e.ids for e in s.examples] + [s.examples[0].ids]


def batches(stream, start, n, **kw):
    it = iter(SFTBatches(stream, start, **kw))
    return [next(it) for _ in range(n)]


def same(a, b):
    return all(torch.equal(a[k], b[k]) for k in ("input_ids", "position_ids", "targets")) and \
        a["next_position"] == b["next_position"]


@pytest.mark.parametrize("pack", [True, False])
def test_batches_resume_exactly_from_a_saved_position(tmp_path, tok, pack):
    path = write_jsonl(tmp_path / "d.jsonl",
                       [{"prompt": f"{i} + {i} =", "completion": f" {2 * i}"} for i in range(23)])
    s = ExampleStream(cfg_for(path), tok, train_on_prompt=False)
    kw = {"batch_size": 3, "max_seq_len": 64, "pack": pack, "pad_id": tok.pad_id}
    run = batches(s, 0, 12, **kw)
    assert run[-1]["next_position"] > 23   # crossed into a later epoch
    k = 5
    stream = ExampleStream(cfg_for(path), tok, train_on_prompt=False)
    resumed = batches(stream, run[k - 1]["next_position"], 12 - k, **kw)
    assert all(same(a, b) for a, b in zip(run[k:], resumed))


@pytest.mark.parametrize("pack", [True, False])
def test_ranks_split_the_global_batch(tmp_path, tok, pack):
    """2 ranks with batch B see, together, exactly what 1 rank with batch 2B sees."""
    path = write_jsonl(tmp_path / "d.jsonl",
                       [{"prompt": "x" * (i % 9), "completion": f" {i}"} for i in range(30)])
    s = ExampleStream(cfg_for(path), tok, train_on_prompt=False)
    one = batches(s, 0, 4, batch_size=4, max_seq_len=48, pack=pack, pad_id=tok.pad_id)
    r0 = batches(s, 0, 4, batch_size=2, max_seq_len=48, pack=pack, pad_id=tok.pad_id, rank=0, world_size=2)
    r1 = batches(s, 0, 4, batch_size=2, max_seq_len=48, pack=pack, pad_id=tok.pad_id, rank=1, world_size=2)
    for a, b0, b1 in zip(one, r0, r1):
        assert a["next_position"] == b0["next_position"] == b1["next_position"]
        for row, ranks_row in zip(range(4), [(b0, 0), (b0, 1), (b1, 0), (b1, 1)]):
            b, i = ranks_row
            n = int((a["targets"][row] != IGNORE).sum())
            assert n == int((b["targets"][i] != IGNORE).sum())
            width = min(a["input_ids"].shape[1], b["input_ids"].shape[1])
            real = a["input_ids"][row] != tok.pad_id
            assert torch.equal(a["input_ids"][row][real], b["input_ids"][i][: int(real.sum())])
            assert torch.equal(a["targets"][row][:width], b["targets"][i][:width])


def test_task_examples(tok):
    cfg = resolve({"recipe": "sft", "model": {"policy": {"preset": "tiny"}},
                   "data": {"task": {"name": "arithmetic"}}})
    s = ExampleStream(cfg, tok, train_on_prompt=False)
    from framework.tasks import build_task

    sample = build_task(cfg["data"], seed=cfg["seed"]).sample(3)
    assert trained_text(tok, s[3]) == sample["answer"] + "<|im_end|>"
    assert [s[p].ids for p in range(4)] == [ExampleStream(cfg, tok, train_on_prompt=False)[p].ids for p in range(4)]


def test_path_and_task_together_is_an_error(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "completion": "b"}])
    cfg = resolve({"recipe": "sft", "model": {"policy": {"preset": "tiny"}},
                   "data": {"path": str(path), "task": {"name": "arithmetic"}}})
    with pytest.raises(FwError, match="not both"):
        ExampleStream(cfg, tok, train_on_prompt=False)


def test_batches_carry_the_target_count_of_their_accumulation_window(tmp_path, tok):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "x" * i, "completion": "y" * (i + 1)} for i in range(9)])
    s = ExampleStream(cfg_for(path), tok, train_on_prompt=False)
    it = iter(SFTBatches(s, 0, batch_size=2, max_seq_len=64, pack=False, pad_id=tok.pad_id, accumulate=3))
    for _ in range(2):
        window = [next(it) for _ in range(3)]
        total = sum(int((b["targets"] != IGNORE).sum()) for b in window)
        assert [b["step_targets"] for b in window] == [total] * 3


def test_the_sft_recipe_passes_sft_train_on_prompt_to_its_stream(tmp_path, tok):
    from recipes.sft import SFTRecipe

    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "ab", "completion": "c"}])
    cfg = resolve({"recipe": "sft", "model": {"policy": {"preset": "tiny"}},
                   "data": {"path": str(path), "chat_template": False}, "sft": {"train_on_prompt": True}})
    example = SFTRecipe(cfg, tok).stream[0]
    assert example.targets == example.ids[1:] + [IGNORE]
    cfg["sft"]["train_on_prompt"] = False
    assert trained_text(tok, SFTRecipe(cfg, tok).stream[0]) == "c<|im_end|>"


@pytest.mark.parametrize("pack", [True, False])
def test_collate_gives_the_sequence_bounds_the_positions_imply(pack):
    """The batch's cu_seqlens / max_seqlen, built on the host, are what ops_cuda.packed_sequences finds in its
    position_ids (every example and every row's padding a sequence)."""
    rows = [[ex(3, 10), ex(2, 20)], [ex(6, 30)], [ex(1, 40)]]
    b = collate(rows, pad_id=0, length=8 if pack else None)
    cu, longest = ops_cuda.packed_sequences(b["position_ids"])
    assert b["cu_seqlens"].dtype == torch.int32 and b["cu_seqlens"].tolist() == cu.tolist()
    assert b["max_seqlen"] == longest
