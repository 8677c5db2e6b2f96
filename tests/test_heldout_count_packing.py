"""The held-out bound's packed SFT count (`training_draws`, through `framework.data.packed_position`) against the
real packer: the data position that training's own batches (`SFTBatches`) reach, and a packer written here from
the examples `encode_record` builds, on several tasks, row lengths, process counts and resume positions. The
count tokenizes no example into ids and targets, reads past the run's last example without raising that
example's error, and counts right under a tokenizer.json that pads a batch."""

import json
from pathlib import Path

import pytest

from framework import evaluation
from framework.config import resolve
from framework.data import ExampleStream, SFTBatches, encode_record
from framework.errors import FwError
from framework.evaluation import training_draws
from framework.tasks import Arithmetic, Task
from framework.tokenizer import BUILTIN_FILE, Tokenizer, build_tokenizer

MODULE = Path(__file__).stem


class VariedTask(Task):
    """Plain prompts of 1 to 60 characters and completions of 1 to 10: with the built-in character tokenizer,
    examples of 3 to 71 tokens, some longer than a row and some that share one."""

    def sample(self, index: int) -> dict:
        import random

        rng = random.Random(f"varied:{self.seed}:{index}")
        prompt = "".join(rng.choice("abcdefgh ") for _ in range(rng.randint(1, 60)))
        answer = "".join(rng.choice("0123456789") for _ in range(rng.randint(1, 10)))
        return self._make(prompt, answer)


class FailingArithmetic(Arithmetic):
    """The arithmetic task, whose samples from index `fail_from` on raise."""

    def __init__(self, fail_from: int = 10**9, seed: int = 0):
        super().__init__(digits=2, seed=seed)
        self.fail_from = fail_from

    def sample(self, index: int) -> dict:
        if index >= self.fail_from:
            raise FwError(f"data.task: sample {index} fails")
        return super().sample(index)


class CountingTokenizer(Tokenizer):
    """The real tokenizer, counting the texts it tokenizes into ids with offsets (what an example is built from)."""

    built = 0

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        self.built += 1
        return super().encode_with_offsets(text)


@pytest.fixture(autouse=True)
def fresh_counts():
    """Counts computed here, not ones an earlier test left in this process."""
    evaluation._PACKED_DRAWS.clear()
    yield
    evaluation._PACKED_DRAWS.clear()


def sft_config(tmp_path: Path, data: dict, max_steps: int, batch_size: int = 2, accumulate: int = 1,
               **sections: dict) -> dict:
    cfg = {"recipe": "sft", "seed": 5, "run_dir": str(tmp_path / "run"), "model": {"policy": {"preset": "tiny"}},
           "data": {"pack": True, "batch_size": batch_size, **data},
           "trainer": {"accelerator": "cpu", "max_steps": max_steps, "accumulate_grad_batches": accumulate},
           "eval": {"every_n_steps": 1, "held_out": True, "max_prompts": 4}, **sections}
    return resolve(cfg)


def trained_position(cfg: dict, world_size: int, tokenizer: Tokenizer, step: int, position: int) -> int:
    """The data position training's own batches reach at trainer.max_steps, from policy step `step` at `position`:
    rank 0's `SFTBatches` (every rank builds the whole global batch) over the remaining steps' micro-batches."""
    d = cfg["data"]
    accumulate = cfg["trainer"]["accumulate_grad_batches"]
    batches = SFTBatches(ExampleStream(cfg, tokenizer, train_on_prompt=False), position, d["batch_size"],
                         d["max_seq_len"], True, tokenizer.pad_id, 0, world_size, accumulate)
    micro = (cfg["trainer"]["max_steps"] - step) * accumulate
    for n, batch in enumerate(batches, 1):
        if n == micro:
            return batch["next_position"]
    raise AssertionError("unreachable")


def packed_by_hand(cfg: dict, world_size: int, tokenizer: Tokenizer, step: int, position: int) -> int:
    """The same position from the examples `encode_record` builds, packed by the rule written out here: an example
    (cut to max_seq_len) joins the current row when the row's tokens stay within max_seq_len, else opens the next
    row; the run's rows are full when one does not fit in the last of them."""
    d, t = cfg["data"], cfg["trainer"]
    rows = (t["max_steps"] - step) * t["accumulate_grad_batches"] * d["batch_size"] * world_size
    stream = ExampleStream(cfg, tokenizer, train_on_prompt=False)
    row, used = 1, 0
    while True:
        if d["task"]:
            record = stream.task.sft_example(position)
            ids = encode_record(record, "prompt_completion", tokenizer, cfg, "ref", train_on_prompt=False).ids
        else:
            ids = stream[position].ids
        n = min(len(ids), d["max_seq_len"])
        if used + n > d["max_seq_len"]:
            if row == rows:
                return position
            row, used = row + 1, 0
        used += n
        position += 1


def write_messages(path: Path) -> Path:
    """Chats of 1 to 3 turns of varied lengths, some longer than a 90-token row."""
    with path.open("w") as f:
        for i in range(23):
            turns = []
            for j in range(1 + i % 3):
                turns += [{"role": "user", "content": "q" * (3 + 7 * ((i + j) % 5))},
                          {"role": "assistant", "content": "a" * (1 + 11 * ((i * j) % 4))}]
            f.write(json.dumps({"messages": turns}) + "\n")
    return path


CASES = {
    # chat examples of 34 to 37 tokens: two share a 72-token row only when their lengths sum to at most 72
    "arithmetic-chat-72": ({"task": {"name": "arithmetic", "init_args": {"digits": 2}}, "max_seq_len": 72},
                           {"max_steps": 4, "accumulate": 2}, 1, 0, 0),
    # plain examples of 8 to 11 tokens, two or three a row; 2 processes, resumed at step 2, position 13
    "arithmetic-plain-30-resumed": ({"task": {"name": "arithmetic", "init_args": {"digits": 2}},
                                     "chat_template": False, "max_seq_len": 30},
                                    {"max_steps": 7, "batch_size": 3}, 2, 2, 13),
    # examples of 214 to 222 tokens, every one cut to the 200-token row; 3 processes
    "countdown-thinking-cut": ({"task": {"name": "countdown"}, "max_seq_len": 200},
                               {"max_steps": 3, "tokenizer": {"enable_thinking": True}}, 3, 0, 0),
    # examples of 3 to 71 tokens in 40-token rows: some cut, some sharing a row; 4 processes, resumed
    "varied-40-resumed": ({"task": {"class_path": f"{MODULE}.VariedTask"}, "chat_template": False,
                           "max_seq_len": 40}, {"max_steps": 3, "batch_size": 1, "accumulate": 3}, 4, 1, 5),
    # 30-token examples, 17 a 512-token row; 2 processes
    "digits-chat-512": ({"task": {"name": "digits"}, "max_seq_len": 512}, {"max_steps": 3}, 2, 0, 0),
}


@pytest.mark.parametrize(("data", "run", "world_size", "step", "position"), CASES.values(), ids=CASES.keys())
def test_the_count_is_where_training_packing_leaves_the_stream(tmp_path, data, run, world_size, step, position):
    run = dict(run)
    cfg = sft_config(tmp_path, data, run.pop("max_steps"), run.pop("batch_size", 2), run.pop("accumulate", 1),
                     **run)
    tokenizer = CountingTokenizer.builtin()
    counted = training_draws(cfg, world_size, tokenizer, step, position)
    assert tokenizer.built == 0   # counted from token counts, no example built
    expected = trained_position(cfg, world_size, tokenizer, step, position)
    assert tokenizer.built > 0
    assert counted == expected == packed_by_hand(cfg, world_size, tokenizer, step, position)


def test_a_jsonl_file_is_counted_over_its_shuffled_epochs(tmp_path):
    """data.path chats (23 records, some cut to the 90-token row) over three shuffled epochs, 2 processes, from
    position 31: the count reads the loaded examples' lengths."""
    data = {"path": str(write_messages(tmp_path / "chats.jsonl")), "max_seq_len": 90}
    cfg = sft_config(tmp_path, data, max_steps=6, batch_size=2, accumulate=2)
    tokenizer = build_tokenizer(cfg)
    counted = training_draws(cfg, 2, tokenizer, 1, 31)
    assert counted == trained_position(cfg, 2, tokenizer, 1, 31) == packed_by_hand(cfg, 2, tokenizer, 1, 31)
    assert counted // 23 - 31 // 23 == 2   # into the second epoch after the one it starts in


def test_the_packing_rule_on_lengths_found_by_hand(tmp_path):
    """Plain records of 3, 3, 2, 5, 3, 6, 12 and 2 tokens (characters and eos, one a token) in 8-token rows, in
    file order: 3+3+2 fill row 1 exactly; 5+3 row 2; 6 row 3, where the 12-token record, cut to 8, does not fit;
    8 row 4; 2 and the second epoch's 3 and 3 row 5."""
    from framework.data import global_batch, packed_position

    lengths = [3, 3, 2, 5, 3, 6, 12, 2]
    path = tmp_path / "plain.jsonl"
    path.write_text("".join(json.dumps({"prompt": "p" * (n - 2), "completion": "c"}) + "\n" for n in lengths))
    cfg = sft_config(tmp_path, {"path": str(path), "chat_template": False, "shuffle": False, "max_seq_len": 8},
                     max_steps=1, batch_size=1)
    tokenizer = build_tokenizer(cfg)
    stream = ExampleStream(cfg, tokenizer, train_on_prompt=False)
    assert [len(stream[p].ids) for p in range(8)] == lengths
    after = {1: 3, 2: 5, 3: 6, 4: 7, 5: 10}   # rows filled from position 0 -> the position after them
    for rows, position in after.items():
        assert packed_position(stream, 0, rows, 8) == position
        assert global_batch(stream, 0, rows, 8, True)[1] == position
        assert training_draws(sft_config(tmp_path, cfg["data"], max_steps=rows, batch_size=1), 1, tokenizer) \
            == position
    assert [[len(e.ids) for e in row] for row in global_batch(stream, 0, 5, 8, True)[0]] == \
        [[3, 3, 2], [5, 3], [6], [8], [2, 3, 3]]
    assert packed_position(stream, 3, 2, 8) == 6   # from position 3: 5+3, then 6
    # from position 6: the 12-token record, cut to 8, fills the first row (uncut it would not fit even there)
    assert packed_position(stream, 6, 1, 8) == global_batch(stream, 6, 1, 8, True)[1] == 7
    assert packed_position(stream, 4, 0, 8) == 4   # no rows: nothing drawn


def test_an_example_past_the_last_one_trained_on_is_never_raised(tmp_path):
    """The count reads examples ahead in batches; the error of one that training never reads is not raised, and
    that of the one training reads last (it does not fit, so it ends the rows) is raised as training raises it."""
    data = {"task": {"class_path": f"{MODULE}.FailingArithmetic"}, "chat_template": False, "max_seq_len": 30}
    cfg = sft_config(tmp_path, data, max_steps=3)
    tokenizer = build_tokenizer(cfg)
    position = training_draws(cfg, 1, tokenizer)
    assert position == trained_position(cfg, 1, tokenizer, 0, 0)
    failing = {**data, "task": {**data["task"], "init_args": {"fail_from": position + 1}}}
    cfg = sft_config(tmp_path, failing, max_steps=3)
    assert training_draws(cfg, 1, tokenizer) == position == trained_position(cfg, 1, tokenizer, 0, 0)
    failing["task"]["init_args"]["fail_from"] = position
    cfg = sft_config(tmp_path, failing, max_steps=3)
    message = f"data.task: sample {position} fails"
    with pytest.raises(FwError, match=message):
        trained_position(cfg, 1, tokenizer, 0, 0)
    with pytest.raises(FwError, match=message):
        training_draws(cfg, 1, tokenizer)


def test_a_tokenizer_json_that_pads_a_batch_is_counted_as_training_reads_it(tmp_path):
    """A tokenizer.json that pads a batch to its longest text (one text is not padded): fw's tokenizer drops the
    padding, so the batched count is the one training reaches, not one of padded lengths."""
    config = json.loads(BUILTIN_FILE.read_text())
    config["padding"] = {"strategy": "BatchLongest", "direction": "Right", "pad_to_multiple_of": None, "pad_id": 0,
                         "pad_type_id": 0, "pad_token": "<|endoftext|>"}
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer.json").write_text(json.dumps(config))
    data = {"task": {"class_path": f"{MODULE}.VariedTask"}, "chat_template": False, "max_seq_len": 64}
    cfg = sft_config(tmp_path, data, max_steps=4, tokenizer={"path": str(tmp_path / "tok")})
    tokenizer = build_tokenizer(cfg)
    assert tokenizer.token_counts(["ab", "abcdef"]) == [2, 6]
    assert len(tokenizer.encode("ab")) == 2
    counted = training_draws(cfg, 1, tokenizer)
    assert counted == trained_position(cfg, 1, tokenizer, 0, 0) == packed_by_hand(cfg, 1, tokenizer, 0, 0)
