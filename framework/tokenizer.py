"""`Tokenizer`: a `tokenizers` tokenizer with Qwen3's special tokens and chat template.

`apply_chat_template` renders Qwen3's template (framework/assets/qwen3_chat_template.jinja, the
`chat_template` of Qwen3's tokenizer_config.json) in plain Python for system, user and assistant turns.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import unicodedata
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tokenizers import AddedToken
from tokenizers import Tokenizer as _HfTokenizer

from framework.errors import FwError
from framework.jsonl import json_type_name

ASSETS = Path(__file__).parent / "assets"
BUILTIN_FILE = ASSETS / "char_tokenizer.json"
CHAT_TEMPLATE_FILE = ASSETS / "qwen3_chat_template.jinja"
# Closes every turn of Qwen3's chat template. A chat-templated conversation ends its assistant turns with it, also
# under a base checkpoint, whose tokenizer_config.json names <|endoftext|> as eos.
TURN_END = "<|im_end|>"
EOS_TOKEN = TURN_END          # Qwen3's eos and pad tokens, used when tokenizer_config.json names none
PAD_TOKEN = "<|endoftext|>"
_ROLES = ("system", "user", "assistant")
# Pre-tokenizers that only split or drop characters, and ByteLevel (one character per byte), under which a model in
# _BOUNDED_MODELS makes at most one token per character (a byte under byte-level BPE or BPE's byte fallback).
_SPLITTING = {"Split", "Digits", "Punctuation", "Whitespace", "WhitespaceSplit", "ByteLevel"}
_BOUNDED_MODELS = {"BPE", "WordLevel"}


def qwen3_chat_template() -> str:
    """The Jinja source of Qwen3's chat template (what transformers would render)."""
    return CHAT_TEMPLATE_FILE.read_text()


class Tokenizer:
    """Text <-> token ids; special tokens are matched whole and never split."""

    def __init__(self, tokenizer: _HfTokenizer, eos_token: str = EOS_TOKEN, pad_token: str = PAD_TOKEN,
                 source: str = "tokenizer", config: dict | None = None):
        # a tokenizer.json may carry padding or truncation settings (saved with them); transformers applies
        # neither unless a call asks for it, and fw encodes whole texts: a truncated prompt or a padded batch count
        # would be silently wrong
        tokenizer.no_padding()
        tokenizer.no_truncation()
        self._tk = tokenizer
        self.source = source
        self.config = dict(config or {})   # tokenizer_config.json contents, written back by save_pretrained
        self.eos_token, self.pad_token = eos_token, pad_token
        self.eos_id = self._special_id(eos_token, "eos")
        self.pad_id = self._special_id(pad_token, "pad")
        self.vocab_size: int = tokenizer.get_vocab_size(with_added_tokens=True)

    def _special_id(self, token: str, what: str) -> int:
        tid = self._tk.token_to_id(token)
        if tid is None:
            raise FwError(f"{self.source}: the {what} token {token!r} is not in the vocabulary")
        return tid

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> Tokenizer:
        """From a directory (tokenizer.json + optional tokenizer_config.json) or a tokenizer.json file."""
        path = Path(path)
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            # a path that is not there at all (a model not yet downloaded) is not a directory missing one file
            what = "no tokenizer.json" if path.exists() else "no such file or directory"
            raise FwError(f"{path}: {what} (expected a directory holding tokenizer.json, or the file)")
        try:
            tk = _HfTokenizer.from_file(str(file))
        except Exception as e:  # noqa: BLE001 (tokenizers raises a bare Exception on malformed files)
            raise FwError(f"{file}: cannot read tokenizer: {e}") from None
        config: dict = {}
        config_file = file.parent / "tokenizer_config.json"
        if config_file.is_file():
            try:
                config = json.loads(config_file.read_text())
            except json.JSONDecodeError as e:
                raise FwError(f"{config_file}: invalid JSON: {e}") from None
            if not isinstance(config, dict):
                raise FwError(f"{config_file}: expected a JSON object, got {_json_type(config)}")
            _add_config_tokens(tk, config, config_file)
            # transformers encodes special tokens' text as plain text under split_special_tokens
            tk.encode_special_tokens = config.get("split_special_tokens") is True
        # transformers writes the template to chat_template.jinja and reads that file before the config's key
        template_file = file.parent / "chat_template.jinja"
        where, template = (template_file, template_file.read_text()) if template_file.is_file() else \
            (config_file, _default_template(config.get("chat_template")))
        if isinstance(template, str) and template.strip() != qwen3_chat_template().strip():
            warnings.warn(f"{where}: its chat_template differs from Qwen3's; fw renders chat "
                          "prompts with Qwen3's template", stacklevel=2)
        eos, pad = (_token(config, key, config_file) for key in ("eos_token", "pad_token"))
        return cls(tk, eos or EOS_TOKEN, pad or PAD_TOKEN, source=str(file), config=config)

    @classmethod
    def builtin(cls) -> Tokenizer:
        """The character-level tokenizer shipped with fw: printable ASCII, tab, newline, <unk> and Qwen3's
        special tokens (<|endoftext|> pad, <|im_start|>, <|im_end|> eos, <think>, </think>)."""
        return cls(_HfTokenizer.from_file(str(BUILTIN_FILE)), source="builtin character tokenizer")

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` (no BOS/EOS added; special tokens in the text become their ids)."""
        return self._tk.encode(text, add_special_tokens=False).ids

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """`encode(text)` and each token's (start, end) character span in `text`; the tokens of one multi-byte
        character share its span."""
        enc = self._tk.encode(text, add_special_tokens=False)
        return enc.ids, enc.offsets

    def token_counts(self, texts: list[str]) -> list[int]:
        """`len(encode(t))` of each of `texts`, encoded in one batch (on the tokenizers library's threads)."""
        return [len(e.ids) for e in self._tk.encode_batch(texts, add_special_tokens=False)]

    @functools.cached_property
    def fingerprint(self) -> str:
        """sha256 of the tokenizer's whole pipeline: equal fingerprints tokenize alike."""
        # to_str leaves out encode_special_tokens, which changes the ids of a special token's text
        split = "\0split_special_tokens" if self._tk.encode_special_tokens else ""
        return hashlib.sha256((self._tk.to_str() + split).encode()).hexdigest()

    @functools.cached_property
    def token_bound(self) -> Callable[[str], int] | None:
        """A function giving an upper bound on the tokens of a text from the text alone, or None where the
        pipeline gives none.

        Added and special tokens are matched whole: one token for one or more characters. The rest is split into
        pieces, which a word-level model makes one token each, and BPE one token or fewer per character of the
        piece: per byte under ByteLevel (a character per byte) or byte fallback. So the bound is the characters
        of the normalized text, or its UTF-8 bytes. NFC normalizes each piece between added tokens, and an NFC
        form has at most the characters and bytes of the NFD form, which decomposes each character on its own.
        Other normalizers (NFKC makes up to 18 characters of one) and pipelines that add characters (a prefix
        space, Metaspace) or pad get no bound.
        """
        tk = self._tk
        if type(tk.model).__name__ not in _BOUNDED_MODELS:
            return None
        steps = [json.loads(tk.pre_tokenizer.__getstate__())] if tk.pre_tokenizer is not None else []
        per_byte = type(tk.model).__name__ == "BPE" and bool(tk.model.byte_fallback)
        while steps:
            step = steps.pop()
            if step["type"] == "Sequence":
                steps.extend(step["pretokenizers"])
            elif step["type"] not in _SPLITTING or step.get("add_prefix_space"):
                return None
            per_byte |= step["type"] == "ByteLevel"
        normalizer = None if tk.normalizer is None else json.loads(tk.normalizer.__getstate__())["type"]
        if normalizer not in (None, "NFC"):
            return None

        def bound(text: str) -> int:
            if text.isascii():   # a byte a character, which every normal form leaves as it is
                return len(text)
            text = unicodedata.normalize("NFD", text) if normalizer else text
            return len(text.encode("utf-8")) if per_byte else len(text)

        return bound

    def most_tokens(self, texts: set[str] | list[str]) -> int:
        """The most tokens of any of `texts`: by decreasing `token_bound`, in batches of 1, 2, 4, ... texts (the
        first often decides), until no bound is above the most found; every text where there is no bound."""
        bound = self.token_bound
        ranked = sorted(((bound(t), t) for t in texts), key=lambda pair: pair[0], reverse=True) if bound else \
            [(None, t) for t in texts]
        best, start, size = 0, 0, 1
        while start < len(ranked):
            batch = [t for most, t in ranked[start:start + size] if most is None or most > best]
            if not batch:   # neither these texts nor any after them can have more tokens
                break
            best = max(best, *self.token_counts(batch))
            start, size = start + size, min(2 * size, 8192)
        return best

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self._tk.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tk.token_to_id(token)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            enable_thinking: bool = False) -> str:
        """Qwen3's chat rendering of system / user / assistant messages.

        Assistant turns after the last user message carry a <think> block (reasoning from
        `reasoning_content` or from a <think>...</think> prefix of the content; empty otherwise); the
        generation prompt opens an assistant turn, pre-closing the think block unless enable_thinking.
        """
        _check_messages(messages)
        last_query = len(messages) - 1
        for i in range(len(messages) - 1, -1, -1):
            c = messages[i]["content"]
            if messages[i]["role"] == "user" and not (c.startswith("<tool_response>")
                                                      and c.endswith("</tool_response>")):
                last_query = i
                break
        out = []
        for i, m in enumerate(messages):
            role, content = m["role"], m["content"]
            if role == "user" or role == "system":
                out.append(f"<|im_start|>{role}\n{content}<|im_end|>\n")
                continue
            reasoning = m.get("reasoning_content")
            if reasoning is None:
                reasoning = ""
                if "</think>" in content:
                    reasoning = content.split("</think>")[0].rstrip("\n").split("<think>")[-1].lstrip("\n")
                    content = content.split("</think>")[-1].lstrip("\n")
            if i > last_query and (i == len(messages) - 1 or reasoning):
                out.append(f"<|im_start|>assistant\n<think>\n{reasoning.strip(chr(10))}\n</think>\n\n"
                           f"{content.lstrip(chr(10))}<|im_end|>\n")
            else:
                out.append(f"<|im_start|>assistant\n{content}<|im_end|>\n")
        if add_generation_prompt:
            out.append("<|im_start|>assistant\n" + ("" if enable_thinking else "<think>\n\n</think>\n\n"))
        return "".join(out)

    def files(self) -> dict[str, bytes]:
        """tokenizer.json and tokenizer_config.json for transformers, by name, with Qwen3's chat template: the one
        fw renders prompts with, whichever template the directory it was read from had."""
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "unk_token": None,
                  "clean_up_tokenization_spaces": False, "model_max_length": 131072, **self.config,
                  "eos_token": self.eos_token, "pad_token": self.pad_token,
                  "chat_template": qwen3_chat_template()}
        # to_str(pretty=True) is the text `save` writes
        return {"tokenizer.json": self._tk.to_str(pretty=True).encode("utf-8"),
                "tokenizer_config.json": (json.dumps(config, indent=2, ensure_ascii=False) + "\n").encode("utf-8")}

    def save_pretrained(self, path: str | os.PathLike) -> None:
        """Write `files()` into directory `path`."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        for name, data in self.files().items():
            (path / name).write_bytes(data)


def _json_type(value: Any) -> str:
    """How JSON spells the type of a parsed value."""
    if value is None or isinstance(value, bool):
        return json.dumps(value)
    names = {dict: "an object", list: "an array", str: "a string", int: "a number", float: "a number"}
    return names.get(type(value), type(value).__name__)


def _default_template(template: Any) -> Any:
    """The template transformers renders of tokenizer_config.json's chat_template: the string, or the one named
    "default" of a list of {name, template}."""
    if isinstance(template, list):
        return next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"),
                    None)
    return template


def _add_config_tokens(tk: _HfTokenizer, config: dict, file: Path) -> None:
    """Add the tokens of tokenizer_config.json's added_tokens_decoder that tokenizer.json lacks, in the order of
    their ids, as transformers does on loading (each takes the next free id)."""
    decoder = config.get("added_tokens_decoder")
    if not isinstance(decoder, dict):
        return
    for key in sorted(decoder, key=lambda k: int(k) if str(k).isdigit() else -1):
        spec = decoder[key]
        content = spec.get("content") if isinstance(spec, dict) else None
        if not isinstance(content, str):
            raise FwError(f'{file}: added_tokens_decoder[{key!r}]: expected {{"content": string, ...}}')
        if tk.token_to_id(content) is not None:
            continue
        token = AddedToken(content, single_word=bool(spec.get("single_word", False)),
                           lstrip=bool(spec.get("lstrip", False)), rstrip=bool(spec.get("rstrip", False)),
                           normalized=bool(spec.get("normalized", not spec.get("special", False))),
                           special=bool(spec.get("special", False)))
        (tk.add_special_tokens if token.special else tk.add_tokens)([token])


def _token(config: dict, key: str, file: Path) -> str | None:
    """The token `config[key]` names in tokenizer_config.json: a string or an AddedToken {"content": string};
    None where the key is absent or null."""
    value = config.get(key)
    content = value.get("content") if isinstance(value, dict) else value
    if value is not None and not isinstance(content, str):
        got = 'an object without a string "content"' if isinstance(value, dict) else _json_type(value)
        raise FwError(f'{file}: {key}: expected a string or {{"content": string}}, got {got}')
    return content


def messages_problem(messages: Any) -> str | None:
    """Why `messages` is not a chat the Qwen3 template renders (a non-empty list of {role, content} with roles
    system, user or assistant, no tool calls), or None."""
    if not isinstance(messages, list) or not messages:
        return "messages: expected a non-empty list of {role, content} dicts"
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            return f"messages[{i}]: expected a {{role, content}} object, got {json_type_name(m)}"
        if "role" not in m:
            return f"messages[{i}]: missing 'role' (one of system, user, assistant)"
        if m["role"] not in _ROLES:
            return f"messages[{i}]: role {m['role']!r} is not supported; expected system, user or assistant"
        if not isinstance(m.get("content"), str):
            return f"messages[{i}] ({m['role']}): content must be a string, got {json_type_name(m.get('content'))}"
        if m.get("tool_calls"):
            return f"messages[{i}]: tool_calls are not supported"
        reasoning = m.get("reasoning_content")
        if reasoning is not None and not isinstance(reasoning, str):
            return f"messages[{i}]: reasoning_content must be a string"
    return None


def _check_messages(messages: list[dict]) -> None:
    problem = messages_problem(messages)
    if problem:
        raise FwError(f"chat {problem}")


def build_tokenizer(cfg: dict) -> Tokenizer:
    """`tokenizer.path`, else the policy directory's tokenizer, else the built-in character tokenizer."""
    key = "tokenizer.path" if cfg["tokenizer"]["path"] else "model.policy.path"
    path = cfg["tokenizer"]["path"] or cfg["model"]["policy"]["path"]
    if not path:
        return Tokenizer.builtin()
    try:
        return Tokenizer.from_pretrained(path)
    except FwError as e:   # the commands that run without `fw validate` (generate, eval) name the key too
        raise FwError(f"{key}: {e}") from None
