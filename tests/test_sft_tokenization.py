"""SFT tokenization against transformers on Qwen3's real vocabulary: the ids of a chat example are those of the
whole rendered conversation, an assistant turn ends as the template ends it under a base tokenizer too, and the
loss covers the assistant text."""

import json
import shutil

import pytest
from scripts.qwen_tokenizer import qwen_tokenizer_dir
from transformers import PreTrainedTokenizerFast

from framework.config import resolve
from framework.data import IGNORE, encode_record
from framework.tokenizer import Tokenizer, qwen3_chat_template

IM_END, ENDOFTEXT = 151645, 151643   # Qwen3's ids of <|im_end|> and <|endoftext|>


@pytest.fixture(scope="module")
def instruct():
    """fw's tokenizer and transformers' fast tokenizer of the same Qwen3 (instruct: eos <|im_end|>) files."""
    d = qwen_tokenizer_dir()
    return Tokenizer.from_pretrained(d), PreTrainedTokenizerFast(tokenizer_file=str(d / "tokenizer.json"))


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """The same vocabulary with the tokenizer_config.json of a Qwen3 base checkpoint, which names <|endoftext|> eos."""
    d = tmp_path_factory.mktemp("qwen3-base")
    shutil.copy(qwen_tokenizer_dir() / "tokenizer.json", d / "tokenizer.json")
    config = json.loads((qwen_tokenizer_dir() / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps({**config, "eos_token": "<|endoftext|>"}))
    hf = PreTrainedTokenizerFast(tokenizer_file=str(d / "tokenizer.json"), eos_token="<|endoftext|>")
    return Tokenizer.from_pretrained(d), hf


def cfg(thinking=False, chat_template=True):
    return resolve({"recipe": "sft", "model": {"policy": {"preset": "tiny"}},
                    "tokenizer": {"enable_thinking": thinking},
                    "data": {"path": "unused.jsonl", "chat_template": chat_template}})


def hf_chat_ids(hf, messages, thinking):
    """transformers' whole-string ids of the conversation rendered with the repository's Qwen3 template."""
    return list(hf.apply_chat_template(messages, chat_template=qwen3_chat_template(), tokenize=True, return_dict=True,
                                       add_generation_prompt=False, enable_thinking=thinking)["input_ids"])


def trained_text(tok, example):
    return tok.decode([t for t in example.targets if t != IGNORE])


def check_shift(example):
    assert len(example.targets) == len(example.ids) and example.targets[-1] == IGNORE
    assert all(t == IGNORE or t == example.ids[i + 1] for i, t in enumerate(example.targets))


THINK = "<think>\n\n</think>\n\n"

# (messages, trained text with thinking off, with thinking on). An assistant turn before the last user message is
# rendered without a think block, so its content follows the header's newline, and the pre-tokenizer joins that
# newline with content starting with whitespace and a newline (or a newline and a space): the joined token is
# trained (it carries the content's first characters), so the trained text starts with the header's newline.
CHATS = [
    ([{"role": "user", "content": "Q1"}, {"role": "assistant", "content": "\nA1"},
      {"role": "user", "content": "Q2"}, {"role": "assistant", "content": "A2"}],
     "\n\nA1<|im_end|>A2<|im_end|>", "\n\nA1<|im_end|>" + THINK + "A2<|im_end|>"),
    ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Q1"},
      {"role": "assistant", "content": " \nA1"}, {"role": "user", "content": "Q2"},
      {"role": "assistant", "content": "\t\nA2"}, {"role": "user", "content": "\n\nQ3"},
      {"role": "assistant", "content": " \nA3"}],
     "\n \nA1<|im_end|>\n\t\nA2<|im_end|> \nA3<|im_end|>",
     "\n \nA1<|im_end|>\n\t\nA2<|im_end|>" + THINK + " \nA3<|im_end|>"),
    ([{"role": "user", "content": "Q"}, {"role": "assistant", "content": "\n\n"},
      {"role": "user", "content": "again"}, {"role": "assistant", "content": "\n A"}],
     "\n\n\n<|im_end|> A<|im_end|>", "\n\n\n<|im_end|>" + THINK + " A<|im_end|>"),
    # the last turn's reasoning is a think block of its own, trained whether thinking is on or off
    ([{"role": "user", "content": "Q"}, {"role": "assistant", "content": "<think>\nwhy\n</think>\n\n  \nA"}],
     "<think>\nwhy\n</think>\n\n  \nA<|im_end|>", "<think>\nwhy\n</think>\n\n  \nA<|im_end|>"),
    ([{"role": "user", "content": "Q1"}, {"role": "assistant", "content": "\n  \nA1"},
      {"role": "user", "content": "Q2"}, {"role": "assistant", "content": "A2", "reasoning_content": " r"}],
     "\n\n  \nA1<|im_end|><think>\n r\n</think>\n\nA2<|im_end|>",
     "\n\n  \nA1<|im_end|><think>\n r\n</think>\n\nA2<|im_end|>"),
]


@pytest.mark.parametrize("thinking", [False, True])
@pytest.mark.parametrize("messages,off,on", CHATS)
def test_chat_ids_are_transformers_whole_conversation_ids(instruct, messages, off, on, thinking):
    tok, hf = instruct
    ex = encode_record({"messages": messages}, "auto", tok, cfg(thinking), "x", train_on_prompt=False)
    assert ex.ids == hf_chat_ids(hf, messages, thinking)
    check_shift(ex)
    assert trained_text(tok, ex) == (on if thinking else off)


# (prompt, completion, trained text with thinking off, with thinking on): a chat-templated pair is the conversation
# prompt + [the completion as an assistant turn], which the template renders with a think block and the content's
# leading newlines stripped.
PAIRS = [
    ("2 * 3 =", " 6", " 6<|im_end|>", THINK + " 6<|im_end|>"),
    ("Q", "\nA", "A<|im_end|>", THINK + "A<|im_end|>"),
    ("Q", " \nA", " \nA<|im_end|>", THINK + " \nA<|im_end|>"),
    ([{"role": "system", "content": "S"}, {"role": "user", "content": "Q1"}, {"role": "assistant", "content": "\nA1"},
      {"role": "user", "content": "Q2"}], "A2", "A2<|im_end|>", THINK + "A2<|im_end|>"),
]


@pytest.mark.parametrize("thinking", [False, True])
@pytest.mark.parametrize("prompt,completion,off,on", PAIRS)
def test_chat_pair_ids_are_transformers_ids_of_prompt_and_completion(instruct, prompt, completion, off, on, thinking):
    tok, hf = instruct
    messages = ([{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt) + [
        {"role": "assistant", "content": completion}]
    ex = encode_record({"prompt": prompt, "completion": completion}, "auto", tok, cfg(thinking), "x",
                       train_on_prompt=False)
    assert ex.ids == hf_chat_ids(hf, messages, thinking)
    check_shift(ex)
    assert trained_text(tok, ex) == (on if thinking else off)   # the prompt's own assistant turn is not trained


@pytest.mark.parametrize("prompt,completion,trained", [
    # "...is Par" + "is." is " Paris." whole: the token " Paris" straddles the boundary and is trained
    ("The capital of France is Par", "is.", " Paris."),
    ("x =\n", "\ny", " =\n\ny"),   # punctuation takes the newlines after it
    ("a\n", "\nb", "\n\nb"),
])
def test_plain_pair_ids_are_the_whole_strings_ids_then_eos(instruct, prompt, completion, trained):
    tok, hf = instruct
    ex = encode_record({"prompt": prompt, "completion": completion}, "auto", tok, cfg(chat_template=False), "x",
                       train_on_prompt=False)
    assert ex.ids == hf.encode(prompt + completion, add_special_tokens=False) + [IM_END]
    check_shift(ex)
    assert trained_text(tok, ex) == trained + "<|im_end|>"


def test_base_tokenizer_ends_chat_turns_with_im_end_and_plain_pairs_with_its_eos(base):
    """A base checkpoint's eos is <|endoftext|>; a chat-templated example still ends its assistant turn with
    <|im_end|> and the newline the template writes after it, where generation stops, as transformers renders it."""
    tok, hf = base
    assert (tok.eos_id, hf.eos_token_id) == (ENDOFTEXT, ENDOFTEXT)
    messages = [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "5"}]
    for record in ({"prompt": "What is 2 + 3?", "completion": "5"}, {"messages": messages}):
        for thinking in (False, True):
            ex = encode_record(record, "auto", tok, cfg(thinking), "x", train_on_prompt=False)
            assert ex.ids == hf_chat_ids(hf, messages, thinking)
            assert ex.ids[-2:] == [IM_END, tok.encode("\n")[0]] and ENDOFTEXT not in ex.ids
            assert trained_text(tok, ex) == ("" if not thinking else THINK) + "5<|im_end|>"
    plain = encode_record({"prompt": "2 + 3 =", "completion": " 5"}, "auto", tok, cfg(chat_template=False), "x",
                          train_on_prompt=False)
    assert plain.ids == hf.encode("2 + 3 = 5", add_special_tokens=False) + [ENDOFTEXT]
    assert trained_text(tok, plain) == " 5<|endoftext|>"


def test_train_on_prompt_trains_every_next_token_of_the_whole_conversation(instruct):
    tok, hf = instruct
    messages = CHATS[0][0]
    ex = encode_record({"messages": messages}, "auto", tok, cfg(), "x", train_on_prompt=True)
    ids = hf_chat_ids(hf, messages, False)
    assert ex.ids == ids and ex.targets == ids[1:] + [IGNORE]
