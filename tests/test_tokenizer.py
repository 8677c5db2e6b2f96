"""Tokenizer: built-in character tokenizer, Qwen3's real vocabulary, chat template vs transformers' Jinja."""

import json
import string
import warnings

import pytest
from scripts.qwen_tokenizer import qwen_tokenizer_dir
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from framework.errors import FwError
from framework.tokenizer import BUILTIN_FILE, Tokenizer, qwen3_chat_template

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]

CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+3?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"}],
    # multi-turn: an earlier assistant turn loses its reasoning, content is kept
    [{"role": "system", "content": "S"}, {"role": "user", "content": "Q1"},
     {"role": "assistant", "content": "<think>\nr1\n</think>\n\nA1"}, {"role": "user", "content": "Q2"}],
    # SFT-style: the conversation ends with the assistant answer
    [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A\nB"}],
    [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "<think>\nwhy\n</think>\n\nA"}],
    [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A", "reasoning_content": "\nR\n"}],
    # two assistant turns after the last query: only the one with reasoning and the last keep a think block
    [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A1"},
     {"role": "assistant", "content": "<think>x</think>A2"}, {"role": "assistant", "content": "A3"}],
    # a system message that is not first is an ordinary turn
    [{"role": "user", "content": "Q"}, {"role": "system", "content": "late"}, {"role": "user", "content": "  "}],
    [{"role": "user", "content": "<tool_response>x</tool_response>"}, {"role": "assistant", "content": "A"}],
]




def test_builtin_vocabulary_and_special_tokens():
    tok = Tokenizer.builtin()
    printable = "\t\n" + "".join(chr(i) for i in range(32, 127))
    assert tok.vocab_size == len(printable) + 1 + len(SPECIALS)   # + <unk>
    ids = tok.encode(printable)
    assert len(ids) == len(printable) and len(set(ids)) == len(printable)
    assert tok.decode(ids) == printable
    special_ids = [tok.encode(s) for s in SPECIALS]
    assert all(len(i) == 1 for i in special_ids) and len({i[0] for i in special_ids}) == len(SPECIALS)
    assert tok.eos_id == tok.token_to_id("<|im_end|>") and tok.pad_id == tok.token_to_id("<|endoftext|>")
    assert tok.eos_id != tok.pad_id


def test_builtin_never_splits_special_tokens_and_round_trips():
    tok = Tokenizer.builtin()
    text = "<|im_start|>user\n12+7=?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n19<|im_end|>"
    ids = tok.encode(text)
    assert ids[0] == tok.token_to_id("<|im_start|>") and ids[-1] == tok.eos_id
    assert ids.count(tok.token_to_id("<think>")) == 1 and ids.count(tok.eos_id) == 2
    assert tok.decode(ids) == text
    assert "<|im_end|>" not in tok.decode(ids, skip_special_tokens=True)
    # a near-miss of a special token is plain characters
    assert tok.encode("<|im_end") == [tok.token_to_id(c) for c in "<|im_end"]
    # characters outside printable ASCII become <unk> (one token each), never an error
    assert tok.encode("é€") == [tok.token_to_id("<unk>")] * 2


def test_builtin_matches_transformers_fast_tokenizer():
    hf = PreTrainedTokenizerFast(tokenizer_file=str(BUILTIN_FILE))
    tok = Tokenizer.builtin()
    text = "Solve: 17*3 =\t51<|im_end|><|endoftext|> ok </think>"
    assert tok.encode(text) == hf.encode(text, add_special_tokens=False)
    assert tok.decode(tok.encode(text)) == hf.decode(hf.encode(text, add_special_tokens=False))


def test_chat_template_hand_written_strings():
    tok = Tokenizer.builtin()
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    head = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n"
    assert tok.apply_chat_template(msgs) == head + "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert tok.apply_chat_template(msgs, enable_thinking=True) == head + "<|im_start|>assistant\n"
    assert tok.apply_chat_template(msgs, add_generation_prompt=False) == head
    sft = msgs + [{"role": "assistant", "content": "4"}]
    assert tok.apply_chat_template(sft, add_generation_prompt=False) == (
        head + "<|im_start|>assistant\n<think>\n\n</think>\n\n4<|im_end|>\n")
    turns = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "<think>t</think>b"},
             {"role": "user", "content": "c"}]
    assert tok.apply_chat_template(turns, enable_thinking=True) == (
        "<|im_start|>user\na<|im_end|>\n<|im_start|>assistant\nb<|im_end|>\n"
        "<|im_start|>user\nc<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("gen,thinking", [(True, False), (True, True), (False, False)])
def test_chat_template_matches_transformers_jinja(messages, gen, thinking):
    hf = PreTrainedTokenizerFast(tokenizer_file=str(BUILTIN_FILE))
    expected = hf.apply_chat_template(messages, chat_template=qwen3_chat_template(), tokenize=False,
                                      add_generation_prompt=gen, enable_thinking=thinking)
    ours = Tokenizer.builtin().apply_chat_template(messages, add_generation_prompt=gen, enable_thinking=thinking)
    assert ours == expected


@pytest.mark.parametrize("messages,match", [
    ([], "non-empty list"),
    ([{"role": "tool", "content": "x"}], r"messages\[0\]: role 'tool'"),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "content": None}], r"messages\[1\].*string"),
    ([{"role": "user"}], r"messages\[0\].*content must be a string"),
    ([{"role": "assistant", "content": "", "tool_calls": [{"name": "f"}]}], "tool_calls"),
])
def test_chat_template_rejects_bad_messages(messages, match):
    with pytest.raises(FwError, match=match):
        Tokenizer.builtin().apply_chat_template(messages)


def test_real_qwen3_vocabulary():
    d = qwen_tokenizer_dir()
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # its chat_template is exactly the one we render: no warning
        tok = Tokenizer.from_pretrained(d)
    assert tok.encode("The capital of France is Paris.") == [785, 6722, 315, 9625, 374, 12095, 13]
    assert [tok.token_to_id(s) for s in SPECIALS] == [151643, 151644, 151645, 151667, 151668]
    assert (tok.eos_id, tok.pad_id, tok.vocab_size) == (151645, 151643, 151669)
    assert json.loads((d / "tokenizer_config.json").read_text())["chat_template"] == qwen3_chat_template()
    text = "<|im_start|>user\nQuelle est la capitale? 東京<|im_end|>\n<think>\n\n</think>"
    ids = tok.encode(text)
    assert ids[:3] == [151644, 872, 198] and 151645 in ids and 151667 in ids and 151668 in ids
    assert tok.decode(ids) == text
    hf = AutoTokenizer.from_pretrained(str(d))
    assert ids == hf.encode(text, add_special_tokens=False)
    for messages in CONVERSATIONS:
        assert tok.apply_chat_template(messages) == hf.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert Tokenizer.from_pretrained(d / "tokenizer.json").encode(text) == ids


@pytest.mark.parametrize("which", ["builtin", "qwen3"])
def test_encode_with_offsets_matches_transformers_offsets(which):
    """Each token's character span, as transformers' offset mapping gives it (a multi-byte character's tokens
    share its span; a special token spans its whole text)."""
    file = BUILTIN_FILE if which == "builtin" else qwen_tokenizer_dir() / "tokenizer.json"
    text = "<|im_start|>user\n東京 😀 naïve 𓀀<|im_end|>\n<|im_start|>assistant\n\n  \nAB<|im_end|>\n"
    tok = Tokenizer.from_pretrained(file)
    hf = PreTrainedTokenizerFast(tokenizer_file=str(file))
    enc = hf(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = tok.encode_with_offsets(text)
    assert ids == enc["input_ids"] == tok.encode(text)
    assert offsets == [tuple(o) for o in enc["offset_mapping"]]
    assert text[offsets[0][0]:offsets[0][1]] == "<|im_start|>" and offsets[-1] == (len(text) - 1, len(text))
    if which == "qwen3":   # Qwen3 has no token for 𓀀: its 4 bytes take 3 tokens, each spanning the character
        at = text.index("𓀀")
        assert offsets.count((at, at + 1)) == 3


def test_save_pretrained_loads_in_transformers(tmp_path):
    tok = Tokenizer.builtin()
    tok.save_pretrained(tmp_path)
    hf = AutoTokenizer.from_pretrained(str(tmp_path))
    text = "x=1<|im_end|>"
    assert hf.encode(text, add_special_tokens=False) == tok.encode(text)
    assert hf.eos_token_id == tok.eos_id and hf.pad_token_id == tok.pad_id
    msgs = CONVERSATIONS[2]
    assert hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True,
                                  enable_thinking=False) == tok.apply_chat_template(msgs)
    again = Tokenizer.from_pretrained(tmp_path)
    assert again.encode(text) == tok.encode(text) and again.eos_id == tok.eos_id


@pytest.mark.parametrize("which", ["builtin", "qwen3"])
def test_the_files_a_checkpoint_holds_are_the_tokenizers_librarys_own_save(tmp_path, which):
    """A checkpoint takes the tokenizer's files from memory, not through a temporary directory (a full /tmp would
    stop the run's start): tokenizer.json is the bytes the tokenizers library's `save` writes, and save_pretrained
    writes the same files."""
    from tokenizers import Tokenizer as HfTokenizer

    tok = Tokenizer.builtin() if which == "builtin" else Tokenizer.from_pretrained(qwen_tokenizer_dir())
    files = tok.files()
    source = BUILTIN_FILE if which == "builtin" else qwen_tokenizer_dir() / "tokenizer.json"
    HfTokenizer.from_file(str(source)).save(str(tmp_path / "library.json"))
    assert files["tokenizer.json"] == (tmp_path / "library.json").read_bytes()
    tok.save_pretrained(tmp_path / "saved")
    assert {p.name: p.read_bytes() for p in (tmp_path / "saved").iterdir()} == files


def test_warns_when_a_checkpoint_brings_another_chat_template(tmp_path):
    Tokenizer.builtin().save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "{{ messages[0].content }}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.warns(UserWarning, match="differs from Qwen3's"):
        Tokenizer.from_pretrained(tmp_path)


def test_save_pretrained_writes_the_template_fw_renders_with(tmp_path):
    Tokenizer.builtin().save_pretrained(tmp_path / "src")
    cfg = json.loads((tmp_path / "src" / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
    cfg["eos_token"], cfg["pad_token"] = {"content": "<|im_end|>", "special": True}, None   # an AddedToken, unset
    (tmp_path / "src" / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.warns(UserWarning, match="differs from Qwen3's"):
        tok = Tokenizer.from_pretrained(tmp_path / "src")
    assert (tok.eos_token, tok.pad_token) == ("<|im_end|>", "<|endoftext|>")
    tok.save_pretrained(tmp_path / "out")
    saved = json.loads((tmp_path / "out" / "tokenizer_config.json").read_text())
    assert saved["chat_template"] == qwen3_chat_template()
    hf = AutoTokenizer.from_pretrained(str(tmp_path / "out"))
    for msgs in CONVERSATIONS:
        assert hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True,
                                      enable_thinking=False) == tok.apply_chat_template(msgs)
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # the saved directory carries Qwen3's template: no warning
        Tokenizer.from_pretrained(tmp_path / "out")


@pytest.mark.parametrize("text,message", [
    ("[]", "expected a JSON object, got an array"),
    ("null", "expected a JSON object, got null"),
    ('"eos"', "expected a JSON object, got a string"),
    ('{"eos_token": 5}', 'eos_token: expected a string or {"content": string}, got a number'),
    ('{"pad_token": ["<|endoftext|>"]}', 'pad_token: expected a string or {"content": string}, got an array'),
    ('{"eos_token": {"content": 5}}',
     'eos_token: expected a string or {"content": string}, got an object without a string "content"'),
])
def test_a_tokenizer_config_of_the_wrong_shape_is_a_one_line_error_in_fw_validate(tmp_path, capsys, text, message):
    from framework.cli import main

    Tokenizer.builtin().save_pretrained(tmp_path / "tk")
    (tmp_path / "tk" / "tokenizer_config.json").write_text(text)
    config = tmp_path / "c.yaml"
    config.write_text("recipe: grpo\nmodel:\n  policy:\n    preset: tiny\ndata:\n  task: {name: digits}\n"
                      "tokenizer:\n  path: tk\n")
    assert main(["validate", "--config", str(config)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "Traceback" not in err
    assert err == f"{config}:8:9: tokenizer.path: {tmp_path / 'tk' / 'tokenizer_config.json'}: {message}\n"


def test_from_pretrained_errors(tmp_path):
    with pytest.raises(FwError, match="no tokenizer.json"):
        Tokenizer.from_pretrained(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(FwError, match="cannot read tokenizer"):
        Tokenizer.from_pretrained(tmp_path)
    Tokenizer.builtin().save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    cfg["eos_token"] = "</s>"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(FwError, match=r"eos token '</s>' is not in the vocabulary"):
        Tokenizer.from_pretrained(tmp_path)


def test_printable_covers_python_printable_ascii():
    # the built-in vocabulary is every printable ASCII character except \r \x0b \x0c
    tok = Tokenizer.builtin()
    unk = tok.token_to_id("<unk>")
    assert [c for c in string.printable if tok.encode(c) == [unk]] == ["\r", "\x0b", "\x0c"]


QWEN3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
               r"\s*[\r\n]+|\s+(?!\S)|\s+")


def test_byte_level_bpe_with_qwen3_pre_tokenizer(tmp_path):
    """A small BPE trained here with Qwen3's normalizer, pre-tokenizer and special tokens (its real
    vocabulary is checked in test_real_qwen3_vocabulary when the dev dependency is present)."""
    from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers, trainers
    from tokenizers import Tokenizer as HfTokenizer

    tk = HfTokenizer(models.BPE())
    tk.normalizer = normalizers.NFC()
    tk.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN3_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tk.decoder = decoders.ByteLevel()
    corpus = ["The capital of France is Paris.", "Les élèves d'aujourd'hui comptent 12345 étoiles!",
              "def f(x):\n    return x * 2\n", "東京は日本の首都です。"] * 20
    tk.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tk.save(str(tmp_path / "tokenizer.json"))
    tok = Tokenizer.from_pretrained(tmp_path)
    hf = PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"))
    assert (tok.eos_id, tok.pad_id) == (SPECIALS.index("<|im_end|>"), SPECIALS.index("<|endoftext|>"))
    texts = ["The capital of France is Paris.", "naïve café — 2024 ✓ 😀", "  spaced\n\n\tout  ",
             "<|im_start|>user\nCombien font 12+30?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n42"]
    for text in texts:
        ids = tok.encode(text)
        assert ids == hf.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text   # byte-level: every string round-trips
    ids = tok.encode(texts[3])
    assert [i for i in ids if i < len(SPECIALS)] == [1, 2, 1, 3, 4]   # specials whole, in order
    digits = tok.encode("12345")   # Qwen's \p{N} rule: one pre-token per digit
    assert len(digits) == 5 and tok.decode(digits[:1]) == "1"


def test_a_tokenizer_json_saved_with_padding_and_truncation_encodes_whole_texts(tmp_path):
    """A tokenizer.json may hold padding and truncation settings (the tokenizers library saves them). transformers'
    fast tokenizer applies neither unless a call asks for it; fw's encode, its batched token counts (the memory
    plan's longest prompt, the held-out count) and its offsets must not either: each is the text's whole length."""
    spec = json.loads(BUILTIN_FILE.read_text())
    spec["truncation"] = {"direction": "Right", "max_length": 4, "strategy": "LongestFirst", "stride": 0}
    spec["padding"] = {"strategy": {"Fixed": 16}, "direction": "Right", "pad_to_multiple_of": None, "pad_id": 0,
                       "pad_type_id": 0, "pad_token": "<|endoftext|>"}
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    texts = ["hello world", "7=", "a much longer text than sixteen characters"]
    hf = PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"))
    expected = [len(hf(t, add_special_tokens=False)["input_ids"]) for t in texts]
    assert expected == [len(t) for t in texts]   # the character vocabulary: one token a character
    tok = Tokenizer.from_pretrained(tmp_path)
    assert [len(tok.encode(t)) for t in texts] == expected
    assert tok.token_counts(texts) == expected
    assert tok.most_tokens(texts) == max(expected)
    assert [len(tok.encode_with_offsets(t)[0]) for t in texts] == expected


def test_generate_of_a_config_whose_model_directory_is_missing_says_so(tmp_path, capsys):
    """`fw generate --config F` checks a model.policy.path that does not exist (recipes/grpo_math.yaml before its
    model is downloaded) as fw validate does: the line says there is no such directory, at the override or the
    file's line, not that a tokenizer.json is missing from it; a directory without a model says that."""
    from framework.cli import main

    config = tmp_path / "c.yaml"
    config.write_text("recipe: grpo\nmodel:\n  policy:\n    path: models/Qwen3-0.6B\ndata:\n  task: {name: digits}\n")
    (tmp_path / "empty").mkdir()
    missing = tmp_path / "models" / "Qwen3-0.6B"
    absent = f"no such directory: {missing} (expected a Hugging Face Qwen3 directory with config.json and " \
             "model.safetensors)"
    empty = f"{tmp_path / 'empty'}: no config.json (expected a Hugging Face checkpoint directory)"
    for path, message in ((missing, absent), (tmp_path / "empty", empty)):
        assert main(["generate", "--config", str(config), "--prompt", "hi", f"--model.policy.path={path}"]) == 2
        assert capsys.readouterr().err == f"override '--model.policy.path={path}': model.policy.path: {message}\n"
    assert main(["generate", "--config", str(config), "--prompt", "hi"]) == 2
    assert capsys.readouterr().err == f"{config}:4:11: model.policy.path: {absent}\n"
