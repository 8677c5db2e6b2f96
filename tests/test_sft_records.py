"""SFT records: the held-out eval set compares prompts (not whole records) with the training data, fw validate
refuses what fit's tokenization refuses at the record's file, line and key, and a message quoting the chat
template's markers trains nothing but the assistant turns. References are hand-written rendered texts."""

import json

import pytest

from framework.cli import main
from framework.config import resolve
from framework.data import IGNORE, encode_record
from framework.errors import FwError
from framework.evaluation import _CHOSEN, Evaluation
from framework.tokenizer import Tokenizer, build_tokenizer

THINK = "<think>\n\n</think>\n\n"


def write_jsonl(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def chat_text(*turns):
    """A Qwen3 chat rendered by hand: (role, content) turns, the last one an assistant turn with its empty think
    block (the template writes one before an assistant turn that follows the last user turn)."""
    out = "".join(f"<|im_start|>{role}\n{content}<|im_end|>\n" for role, content in turns[:-1])
    return out + f"<|im_start|>assistant\n{THINK}{turns[-1][1]}<|im_end|>\n"


def sft_config(tmp_path, train, held, chat_template=True, max_prompts=10):
    return resolve({"recipe": "sft", "seed": 1, "run_dir": str(tmp_path / "run"),
                    "model": {"policy": {"preset": "tiny"}},
                    "data": {"path": str(train), "chat_template": chat_template},
                    "trainer": {"accelerator": "cpu", "max_steps": 2},
                    "eval": {"path": str(held), "every_n_steps": 1, "max_prompts": max_prompts}})


def trained_text(tok, example):
    return tok.decode([t for t in example.targets if t != IGNORE])


# ---------------------------------------------------------------- held out by prompt

def test_sft_eval_leaves_out_every_example_whose_prompt_is_a_training_prompt(tmp_path):
    """A training prompt with another answer, the same pair with its keys swapped, and a pair that renders to the
    tokens of a training chat are all training prompts; examples of a new prompt are kept, each of its answers."""
    train = write_jsonl(tmp_path / "train.jsonl", [
        {"prompt": "What is 2 + 2?", "completion": "4"},
        {"messages": [{"role": "user", "content": "Capital of France?"}, {"role": "assistant", "content": "Paris"}]},
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                      {"role": "assistant", "content": "Hello"}]}])
    held = write_jsonl(tmp_path / "held.jsonl", [
        {"prompt": "What is 2 + 2?", "completion": "Four."},
        {"completion": "4", "prompt": "What is 2 + 2?"},
        {"prompt": "Capital of France?", "completion": "Lyon"},
        {"messages": [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "four"}]},
        {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
         "completion": "Hey"},
        {"prompt": "New question?", "completion": "yes"},
        {"prompt": "New question?", "completion": "no"},
        {"prompt": "Hi", "completion": "Hello"},   # no system turn: another prompt
        {"prompt": "New question?", "completion": "yes"}])   # the same example again
    cfg = sft_config(tmp_path, train, held)
    _CHOSEN.clear()
    tok = Tokenizer.builtin()
    texts = [tok.decode(e.ids) for e in Evaluation(cfg, tok).examples]
    assert texts == [chat_text(("user", "New question?"), ("assistant", "yes")),
                     chat_text(("user", "New question?"), ("assistant", "no")),
                     chat_text(("user", "Hi"), ("assistant", "Hello"))]


def test_plain_sft_eval_pairs_are_held_out_by_their_prompt_string(tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", [{"prompt": "2+2=", "completion": "4"}])
    held = write_jsonl(tmp_path / "held.jsonl", [{"prompt": "2+2=", "completion": "5"},
                                                 {"prompt": "2+2= ", "completion": "4"}])
    cfg = sft_config(tmp_path, train, held, chat_template=False)
    _CHOSEN.clear()
    tok = Tokenizer.builtin()
    examples = Evaluation(cfg, tok).examples
    assert [tok.decode(e.ids) for e in examples] == ["2+2= 4<|im_end|>"]   # the builtin tokenizer's eos


def test_rl_eval_prompts_are_held_out_by_the_text_the_policy_reads(tmp_path):
    """With the chat template a string prompt and its one-user-turn chat are the same prompt."""
    train = write_jsonl(tmp_path / "train.jsonl", [{"prompt": "3+1=", "answer": "4"}])
    held = write_jsonl(tmp_path / "held.jsonl", [{"prompt": [{"role": "user", "content": "3+1="}], "answer": "4"},
                                                 {"prompt": "5+1=", "answer": "6"}])
    cfg = resolve({"recipe": "grpo", "seed": 1, "run_dir": str(tmp_path / "run"),
                   "model": {"policy": {"preset": "tiny"}}, "data": {"path": str(train), "chat_template": True},
                   "rollout": {"prompts_per_step": 2, "max_new_tokens": 1}, "grpo": {"group_size": 2},
                   "trainer": {"accelerator": "cpu", "max_steps": 2},
                   "eval": {"path": str(held), "every_n_steps": 1, "max_prompts": 4, "samples_per_prompt": 1}})
    _CHOSEN.clear()
    expected = f"<|im_start|>user\n5+1=<|im_end|>\n<|im_start|>assistant\n{THINK}"
    assert Evaluation(cfg, build_tokenizer(cfg)).texts == [expected]


# ---------------------------------------------------------------- validate names what fit refuses

def test_validate_names_the_file_line_and_key_of_records_fit_cannot_tokenize(tmp_path, capsys):
    train = write_jsonl(tmp_path / "train.jsonl", [{"prompt": "a", "completion": "b"},
                                                   {"prompt": [{"role": "user", "content": "a"}], "completion": "b"}])
    held = write_jsonl(tmp_path / "held.jsonl", [{"prompt": "c", "completion": "d"}, "",
                                                 {"prompt": "", "completion": ""}])
    config = tmp_path / "sft.yaml"
    config.write_text(f"recipe: sft\nmodel: {{policy: {{preset: tiny}}}}\nrun_dir: {tmp_path / 'run'}\n"
                      f"data: {{path: {train}, chat_template: false}}\n"
                      f"eval: {{path: {held}, every_n_steps: 1}}\ntrainer: {{accelerator: cpu, max_steps: 1}}\n")
    expected = [(f"{train}:2:1: data.path: 'prompt' is a list of messages but data.chat_template is false; set "
                 "data.chat_template: true or give a plain-string prompt"),
                f"{held}:3:1: eval.path: the prompt and the completion are both empty: nothing to train on"]
    for command in ("validate", "fit"):
        assert main([command, "--config", str(config)]) == 2
        assert capsys.readouterr().err.splitlines() == expected
    assert not (tmp_path / "run").exists()
    # with the chat template both are conversations fit can train on
    assert main(["validate", "--config", str(config), "--data.chat_template=true"]) == 0


def test_an_eval_record_fit_refuses_is_named_by_its_file_and_line(tmp_path):
    """Evaluation (which `fw eval` builds without fw validate's checks) names the eval file and line."""
    train = write_jsonl(tmp_path / "train.jsonl", [{"prompt": "a", "completion": "b"}])
    held = write_jsonl(tmp_path / "held.jsonl", [{"prompt": "c", "completion": "d"}, "",
                                                 {"prompt": "", "completion": ""}])
    _CHOSEN.clear()
    with pytest.raises(FwError, match=f"^{held}:3: the prompt and the completion are both empty"):
        Evaluation(sft_config(tmp_path, train, held, chat_template=False), Tokenizer.builtin())


# ---------------------------------------------------------------- quoted markers

QUOTE = "What does this print? <|im_start|>assistant\nSECRET<|im_end|>\n<|im_start|>assistant\n"
QUOTED = [
    # a user turn quoting an assistant turn: only the real assistant turn is trained
    ([{"role": "user", "content": QUOTE}, {"role": "assistant", "content": "It opens a turn."}],
     "It opens a turn.<|im_end|>"),
    # a system turn quoting one, then two real assistant turns
    ([{"role": "system", "content": f"Never write {QUOTE}"}, {"role": "user", "content": "Q1"},
      {"role": "assistant", "content": "A1"}, {"role": "user", "content": "Q2"},
      {"role": "assistant", "content": "A2"}],
     "A1<|im_end|>A2<|im_end|>"),
    # an assistant turn quoting <|im_end|>: its whole content is trained, then the turn's own end
    ([{"role": "user", "content": "Q1"}, {"role": "assistant", "content": "a<|im_end|>b"},
      {"role": "user", "content": "Q2"}, {"role": "assistant", "content": "c <|im_start|>assistant\nd"}],
     "a<|im_end|>b<|im_end|>c <|im_start|>assistant\nd<|im_end|>"),
]


@pytest.mark.parametrize("messages,trained", QUOTED)
def test_a_message_quoting_the_chat_markers_trains_only_the_assistant_turns(tmp_path, messages, trained):
    tok = Tokenizer.builtin()
    cfg = resolve({"recipe": "sft", "model": {"policy": {"preset": "tiny"}}, "data": {"path": "unused.jsonl"}})
    ex = encode_record({"messages": messages}, "auto", tok, cfg, "x", train_on_prompt=False)
    assert tok.decode(ex.ids) == tok.apply_chat_template(messages, add_generation_prompt=False)
    assert trained_text(tok, ex) == trained
    assert all(t == IGNORE or t == ex.ids[i + 1] for i, t in enumerate(ex.targets))


def test_a_pair_quoting_the_markers_trains_its_whole_completion_and_nothing_else():
    tok = Tokenizer.builtin()
    cfg = resolve({"recipe": "sft", "model": {"policy": {"preset": "tiny"}}, "data": {"path": "unused.jsonl"}})
    completion = "It writes <|im_start|>assistant\nhi<|im_end|> and stops"
    for prompt in (QUOTE, [{"role": "user", "content": QUOTE}, {"role": "assistant", "content": "x"},
                           {"role": "user", "content": "again"}]):
        ex = encode_record({"prompt": prompt, "completion": completion}, "auto", tok, cfg, "x", train_on_prompt=False)
        assert trained_text(tok, ex) == completion + "<|im_end|>"
