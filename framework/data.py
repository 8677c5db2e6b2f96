"""SFT data: JSONL reading, chat rendering, loss masks, packing and the resumable batch stream.

An *example* is a token sequence with shifted targets: `targets[t]` is the token the model should
predict after reading `ids[:t+1]`, or -100 where no loss is taken (prompt, padding, the last token).
Shifting per example (not per packed row) keeps a packed row's sequences from predicting each other.

The *stream* is an infinite sequence of examples: position p is example `perm_e[p % n]` of epoch
`e = p // n` (a permutation seeded with `epoch_seed(seed, e)`), or `task.sft_example(p)` for a procedural task.
A global micro-batch takes the next examples of the stream: packed into `batch_size * world_size`
rows of `max_seq_len` tokens (or one example per row, right-padded); rank r keeps rows
`[r * batch_size, (r + 1) * batch_size)`. A batch is therefore a pure function of (seed, position),
and the position after the last consumed batch is all a checkpoint needs for an exact resume.

The position is global (the same on every rank), so a run may resume on a different number of
processes: with `batch_size * world_size` unchanged (e.g. 2 ranks x 4 rows -> 1 process x 8 rows) the
continued global batches are exactly those of the uninterrupted run; otherwise the stream continues at
the same position with the new global batch size (no example skipped or repeated).
"""

from __future__ import annotations

import json
from array import array
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset

from framework.console import first_process, say
from framework.errors import FwError
from framework.jsonl import read_jsonl
from framework.tasks import build_task, render_prompt
from framework.tokenizer import TURN_END, messages_problem

IGNORE = -100
ASSISTANT_HEADER = "<|im_start|>assistant\n"
# With thinking disabled the generation prompt already ends in this block, so it is prompt, not target; with
# thinking enabled the generation prompt stops at the header, and the block is what the model must write next.
EMPTY_THINK = "<think>\n\n</think>\n\n"
MARKERS = ("<|im_start|>", TURN_END)   # the chat template's turn markers, which `assistant_spans` searches for


@dataclass(frozen=True)
class Example:
    """One tokenized training sequence; `targets` are already shifted (see module docstring)."""

    ids: list[int]
    targets: list[int]


def record_problem(record: dict, fmt: str, chat_template: bool) -> tuple[str | None, str | None]:
    """(the record's format, None) or (None, what is wrong with it) under `data.format` `fmt` and
    `data.chat_template` `chat_template`: every problem `encode_record` would meet, so that `fw validate` names it."""
    if fmt == "auto":
        if "messages" in record:
            fmt = "messages"
        elif "prompt" in record and "completion" in record:
            fmt = "prompt_completion"
        else:
            return None, f"expected a 'messages' list or 'prompt' and 'completion' keys, got keys {sorted(record)}"
    if fmt == "messages":
        messages = record.get("messages")
        if not isinstance(messages, list) or not messages:
            return None, "'messages' must be a non-empty list of {role, content} objects"
        for i, m in enumerate(messages):
            if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                return None, f"messages[{i}] must be an object with string 'role' and 'content'"
            if m["role"] not in ("system", "user", "assistant"):
                return None, f"messages[{i}].role is {m['role']!r}; expected system, user or assistant"
        if not any(m["role"] == "assistant" for m in messages):
            return None, "'messages' has no assistant turn, so there is nothing to train on"
        problem = messages_problem(messages)
        if problem:
            return None, problem
    else:
        prompt, completion = record.get("prompt"), record.get("completion")
        if not (isinstance(prompt, (str, list)) and isinstance(completion, str)):
            return None, "expected string 'prompt' (or a messages list) and string 'completion'"
        problem = messages_problem(prompt) if isinstance(prompt, list) else None
        if problem:
            return None, f"prompt: {problem}"
        if not chat_template and isinstance(prompt, list):
            return None, ("'prompt' is a list of messages but data.chat_template is false; set data.chat_template: "
                          "true or give a plain-string prompt")
        if not chat_template and not prompt and not completion:   # eos alone: no token precedes it to predict it
            return None, "the prompt and the completion are both empty: nothing to train on"
    return fmt, None


def record_format(record: dict, fmt: str, chat_template: bool, where: str) -> str:
    """`messages` or `prompt_completion` for this record, checking it has what `data.format` asks for."""
    found, problem = record_problem(record, fmt, chat_template)
    if problem:
        raise FwError(f"{where}: {problem}")
    return found


def _spans_to_example(text: str, spans: list[tuple[int, int]], tokenizer: Any, train_all: bool,
                      end: list[int] | None = None) -> Example:
    """Tokenize `text` whole and build shifted targets: a token is trainable where its characters overlap one of
    the sorted, disjoint character `spans` (every token with `train_all`); the `end` ids follow, trainable.

    The text is tokenized once, not piece by piece, because a byte-level BPE merges across the pieces: the newline
    closing an assistant header and a reply that starts with a newline become one two-newline token, and a plain
    prompt "...Par" followed by the completion "is" becomes "Paris". Such a token, straddling a span's start, is
    trainable: it carries completion text, which the loss would otherwise never cover. A span's end never
    straddles: a chat span ends with the special token <|im_end|>, a plain completion is followed by eos.
    """
    ids, offsets = tokenizer.encode_with_offsets(text)
    # A normalizer may fold a character into the token before it while that token's offsets leave it out (NFC
    # makes "e" and a combining accent one "é" spanning the "e" alone): a token's characters run to the next one's.
    nexts = [a for a, _ in offsets[1:]] + [len(text)]
    trainable: list[bool] = []
    j = 0
    for (a, b), following in zip(offsets, nexts):
        while j < len(spans) and spans[j][1] <= a:
            j += 1
        trainable.append(train_all or (j < len(spans) and spans[j][0] < max(b, following, a + 1)))
    for i in end or []:
        ids.append(i)
        trainable.append(True)
    # Position t predicts token t+1; the first token is never a target (nothing precedes it).
    targets = [ids[t + 1] if trainable[t + 1] else IGNORE for t in range(len(ids) - 1)] + [IGNORE]
    return Example(ids, targets)


def assistant_spans(rendered: str, where: str, thinking: bool) -> list[tuple[int, int]]:
    """The character spans of a rendered Qwen3 chat that the loss covers: each assistant turn's content and its
    `<|im_end|>` (not the newline after it, which the model never writes: generation stops at `<|im_end|>`), and
    its empty think block too where `thinking` (tokenizer.enable_thinking) leaves it out of the generation prompt.
    The chat's contents must not hold the template's markers (`render_chat` masks them)."""
    spans: list[tuple[int, int]] = []
    pos = 0
    while (start := rendered.find(ASSISTANT_HEADER, pos)) != -1:
        body = start + len(ASSISTANT_HEADER)
        if not thinking and rendered.startswith(EMPTY_THINK, body):
            body += len(EMPTY_THINK)
        end = rendered.find(TURN_END, body)
        if end == -1:
            raise FwError(f"{where}: the chat template left an assistant turn without {TURN_END}")
        pos = end + len(TURN_END)
        spans.append((body, pos))
    return spans


def _mask(text: str) -> str:
    """`text` with each template marker replaced by as many NUL characters: same length, no marker left."""
    for marker in MARKERS:
        text = text.replace(marker, "\0" * len(marker))
    return text


def render_chat(messages: list[dict], tokenizer: Any, thinking: bool, where: str) -> tuple[str, list[tuple[int, int]]]:
    """A chat rendered by the template with no generation prompt, and its `assistant_spans`.

    A message may quote the markers (a user asking about chat templates): found by searching the rendered text,
    such a quote would open or close an assistant span inside another turn. So the spans are found in the chat
    rendered again with every marker in the messages masked: the template puts contents in verbatim (only
    newlines at their edges and around a think block are trimmed, which masking leaves as they are), so the masked
    text has the turns' markers at the same offsets and none inside a content."""
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=False, enable_thinking=thinking)
    fields = ("content", "reasoning_content")
    if not any(isinstance(m.get(f), str) and marker in m[f] for m in messages for f in fields for marker in MARKERS):
        return rendered, assistant_spans(rendered, where, thinking)
    masked = tokenizer.apply_chat_template(
        [{**m, **{f: _mask(m[f]) for f in fields if isinstance(m.get(f), str)}} for m in messages],
        add_generation_prompt=False, enable_thinking=thinking)
    if len(masked) != len(rendered):   # a template that changes a content's length by what it holds
        raise FwError(f"{where}: a message quotes {' or '.join(MARKERS)}, and the chat template does not keep "
                      "contents verbatim, so its assistant turns cannot be told apart from the quote; remove it")
    return rendered, assistant_spans(masked, where, thinking)


def encode_record(record: dict, fmt: str, tokenizer: Any, cfg: dict, where: str, *,
                  train_on_prompt: bool) -> Example:
    """Tokenize one SFT record; the loss covers assistant content (or the completion) and its end token,
    or every next token with `train_on_prompt`.

    With `data.chat_template` the ids are those of the whole rendered conversation, as transformers'
    `apply_chat_template(..., tokenize=True)` gives them: a prompt/completion pair is the prompt's messages and
    the completion as the assistant turn after them, which ends as the template ends it (`<|im_end|>` and a
    newline), whatever eos the tokenizer names (a base checkpoint's is <|endoftext|>). A plain pair ends with eos.
    """
    text, spans, end = render_record(record, fmt, tokenizer, cfg, where)
    return _spans_to_example(text, spans, tokenizer, train_on_prompt, end=end)


def render_record(record: dict, fmt: str, tokenizer: Any, cfg: dict,
                  where: str) -> tuple[str, list[tuple[int, int]], list[int]]:
    """What `encode_record` tokenizes of one SFT record: (the text, the character spans its loss covers, the ids
    that follow the text), with every check and error of `encode_record`; an example has `len(encode(text)) +
    len(ids)` tokens."""
    fmt = record_format(record, fmt, cfg["data"]["chat_template"], where)
    thinking = cfg["tokenizer"]["enable_thinking"]
    if fmt == "messages":
        rendered, spans = render_chat(record["messages"], tokenizer, thinking, where)
        return rendered, spans, []
    prompt, completion = record["prompt"], record["completion"]
    if cfg["data"]["chat_template"]:
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        rendered, spans = render_chat(messages + [{"role": "assistant", "content": completion}], tokenizer, thinking,
                                      where)
        # Only the last assistant turn is the completion; those of a messages prompt are context.
        return rendered, spans[-1:], []
    text = render_prompt(prompt, tokenizer, False, thinking) + completion
    # The completion ends with eos so the model learns to stop; eos is a target of the last real token.
    return text, [(len(text) - len(completion), len(text))], [tokenizer.eos_id]


def record_prompt(record: dict, fmt: str, tokenizer: Any, cfg: dict, where: str) -> str:
    """The prompt of one SFT record, as the model reads it: its rendered text (`render_record`) up to where the
    last span its loss covers starts, so a pair and a `messages` chat that render to the same text have the same
    prompt, whatever their keys' order or their answers."""
    text, spans, _ = render_record(record, fmt, tokenizer, cfg, where)
    return text[:spans[-1][0]]


def load_examples(cfg: dict, tokenizer: Any, *, train_on_prompt: bool) -> list[Example]:
    """Every example of `data.path` (one file or a list), tokenized up front so bad lines fail early."""
    paths = cfg["data"]["path"]
    paths = [paths] if isinstance(paths, str) else list(paths)
    examples = []
    empty: list[str] = []   # where each example with an empty reply is, and its key
    for path in paths:
        for where, record in read_jsonl(path):
            text, spans, end = render_record(record, cfg["data"]["format"], tokenizer, cfg, where)
            examples.append(_spans_to_example(text, spans, tokenizer, train_on_prompt, end=end))
            key = empty_reply(record, cfg, text, spans, where)
            if key is not None:
                empty.append(f"{where}: {key}")
    if not examples:
        raise FwError(f"data.path: no examples in {', '.join(map(str, paths))}")
    _say_truncated(examples, cfg["data"]["max_seq_len"])
    _say_empty(empty, len(examples))
    return examples


def empty_reply(record: dict, cfg: dict, text: str, spans: list[tuple[int, int]], where: str) -> str | None:
    """The first empty or blank reply among what the loss of one record covers (`render_record`'s `text` and
    `spans`), as its key and the record's own value, e.g. `completion is " "`; None when every reply holds text. Such
    a reply trains on its end token (`<|im_end|>`, or eos without a chat template) and whitespace alone, an empty
    think block aside."""
    fmt = record_format(record, cfg["data"]["format"], cfg["data"]["chat_template"], where)
    if fmt == "prompt_completion":
        replies = [("completion", record["completion"])]   # its one span
    else:   # a span per assistant turn
        replies = [(f"messages[{i}].content", m["content"]) for i, m in enumerate(record["messages"])
                   if m["role"] == "assistant"]
    # a messages row renders through the chat template whatever data.chat_template says (render_record)
    templated = cfg["data"]["chat_template"] or fmt == "messages"
    for (key, value), (a, b) in zip(replies, spans, strict=False):
        reply = text[a:b].removesuffix(TURN_END).removeprefix(EMPTY_THINK) if templated else text[a:b]
        if not reply.strip():
            return f"{key} is {json.dumps(value, ensure_ascii=False)}"
    return None


def _say_empty(empty: list[str], total: int) -> None:
    """Say (on the first process) how many examples have an empty reply, and where the first is."""
    if not empty or not first_process():
        return
    say(f"fw: data.path: {len(empty)} of {total} examples {'has' if len(empty) == 1 else 'have'} an empty or "
        f"blank reply (the first: {empty[0]}), which trains on its end token alone and teaches the model to answer "
        "with nothing")


def _say_truncated(examples: list[Example], max_len: int) -> None:
    """Say (on the first process) how many examples `truncate` will cut, and how many of those keep no target."""
    long = [e for e in examples if len(e.ids) > max_len]
    if not long:
        return
    empty = sum(all(t == IGNORE for t in truncate(e, max_len).targets) for e in long)
    if empty == len(examples):   # every step would train on nothing
        # a target at position i is kept when i < max_len - 1 (truncate): the least length that keeps one
        least = min(next((i for i, t in enumerate(e.targets) if t != IGNORE), len(e.ids)) for e in examples) + 2
        raise FwError(f"data.max_seq_len: all {len(examples)} examples of data.path are longer than "
                      f"data.max_seq_len ({max_len}), and cut to it none keeps a token to train on; raise it to at "
                      f"least {least}")
    if not first_process():
        return
    cut = f"; {empty} of them {'keeps' if empty == 1 else 'keep'} no token to train on" if empty else ""
    say(f"fw: data.path: {len(long)} of {len(examples)} examples are longer than data.max_seq_len ({max_len}) "
        f"and are cut to it{cut}")


def _say_task_cut(position: int, example: Example, max_len: int) -> None:
    """Say (on the first process) that the task's example at `position` is cut to `max_len`, and whether it keeps a
    target: a task's examples are drawn as training reads them, so none is counted at load as data.path's are."""
    if not first_process():
        return
    empty = all(t == IGNORE for t in truncate(example, max_len).targets)
    say(f"fw: data.task: example {position} has {len(example.ids)} tokens, more than data.max_seq_len ({max_len}), "
        f"and is cut to it{', keeping no token to train on' if empty else ''}; later examples that are longer are "
        "cut too, unsaid")


EPOCH_STRIDE = 0x9E3779B9   # 2^32 divided by the golden ratio: odd, and far from every small fraction of 2^32


def epoch_seed(seed: int, epoch: int) -> int:
    """The seed of epoch `epoch`'s order in a run seeded `seed`. `seed + epoch` would give the run seeded 1 the orders
    of the run seeded 0 an epoch later, so a sweep over seeds would train every run on one sequence of examples,
    shifted. torch's CPU generator keeps only the low 32 bits of a seed, so the epoch is spread over them by an odd
    stride: every epoch of a run has a seed of its own, and runs whose seeds differ by at most 100000 share one only
    between epochs at least 28657 apart."""
    return (seed + epoch * EPOCH_STRIDE) % 2**32


class ExampleStream:
    """Position -> example: shuffled epochs of a fixed list, or a procedural task's `sft_example`.
    `train_on_prompt`: the loss covers every next token, not only the assistant / completion ones."""

    def __init__(self, cfg: dict, tokenizer: Any, *, train_on_prompt: bool):
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.train_on_prompt = train_on_prompt
        self.seed = cfg["seed"]
        self.shuffle = cfg["data"]["shuffle"]
        data = cfg["data"]
        if data["path"] and data["task"]:
            raise FwError("data: set either data.path (JSONL) or data.task (procedural task), not both")
        if data["path"]:
            self.examples: list[Example] | None = load_examples(cfg, tokenizer, train_on_prompt=train_on_prompt)
            self.task = None
        elif data["task"]:
            self.examples = None
            self.task = build_task(data, seed=self.seed)
        else:
            raise FwError("data: SFT needs data.path (JSONL with messages or prompt/completion) or data.task")
        self._perm_epoch = -1
        self._perm: list[int] = []
        self._said_cut = False   # a task's examples are endless: the first one `truncate` cuts is said

    def __getitem__(self, position: int) -> Example:
        if self.examples is None:
            record = self.task.sft_example(position)
            example = encode_record(record, "prompt_completion", self.tokenizer, self.cfg,
                                    f"data.task example {position}", train_on_prompt=self.train_on_prompt)
            if not self._said_cut and len(example.ids) > self.cfg["data"]["max_seq_len"]:
                self._said_cut = True
                _say_task_cut(position, example, self.cfg["data"]["max_seq_len"])
            return example
        n = len(self.examples)
        epoch, i = divmod(position, n)
        if not self.shuffle:
            return self.examples[i]
        if epoch != self._perm_epoch:
            g = torch.Generator().manual_seed(epoch_seed(self.seed, epoch))
            self._perm = torch.randperm(n, generator=g).tolist()
            self._perm_epoch = epoch
        return self.examples[self._perm[i]]

    def lengths(self, position: int, count: int) -> tuple[list[int], Exception | None]:
        """The token counts of the `count` examples from `position`, as `self[p]` has them, with no ids or targets
        built (a task's texts are tokenized in one batch); and the error of the first example that fails, which
        ends the counts there: the caller raises it once it reaches that example, as reading it would."""
        if self.examples is not None:
            return [len(self[p].ids) for p in range(position, position + count)], None
        texts: list[str] = []
        ends: list[int] = []
        error: Exception | None = None
        for p in range(position, position + count):
            try:
                text, _, end = render_record(self.task.sft_example(p), "prompt_completion", self.tokenizer, self.cfg,
                                             f"data.task example {p}")
            except Exception as e:  # noqa: BLE001 (the task's code: whatever `self[p]` would raise)
                error = e
                break
            texts.append(text)
            ends.append(len(end))
        return [n + k for n, k in zip(self.tokenizer.token_counts(texts), ends)], error


def truncate(example: Example, max_len: int) -> Example:
    """The first `max_len` tokens; the last kept token predicts nothing (its next token is cut)."""
    if len(example.ids) <= max_len:
        return example
    return Example(example.ids[:max_len], example.targets[: max_len - 1] + [IGNORE])


class RowFiller:
    """The packing rule, the one place that decides where a packed row ends: examples fill `rows` rows of
    `max_len` tokens in stream order; one that does not fit in the current row starts the next, and the rows are
    full when one does not fit in the last. `global_batch` packs examples by it, `packed_position` counts by it
    from the examples' lengths alone, so the count is where packing leaves the stream."""

    def __init__(self, rows: int, max_len: int):
        self.rows = rows
        self.max_len = max_len
        self.row = 0
        self.used = 0

    def place(self, length: int) -> int | None:
        """The row an example of `length` tokens (truncated: at most `max_len`) goes into, or None, placing
        nothing, when it does not fit in the last row."""
        if self.used + length > self.max_len:
            if self.row + 1 >= self.rows:
                return None
            self.row += 1
            self.used = 0
        self.used += length
        return self.row


def global_batch(stream: ExampleStream, position: int, rows: int, max_len: int,
                 pack: bool) -> tuple[list[list[Example]], int]:
    """The rows of the global micro-batch starting at `position`, and the position after it.

    Packed: examples fill rows by `RowFiller`'s rule; the batch ends when an example does not fit in the last row.
    Unpacked: one example per row.
    """
    if not pack:
        return [[truncate(stream[p], max_len)] for p in range(position, position + rows)], position + rows
    out: list[list[Example]] = []
    filler = RowFiller(rows, max_len)
    while True:
        example = truncate(stream[position], max_len)
        row = filler.place(len(example.ids))
        if row is None:
            return out, position
        if row == len(out):
            out.append([])
        out[row].append(example)
        position += 1


LENGTH_CHUNK = 1024   # the most examples `packed_position` counts in one batch (it reads at most this many past)


def packed_position(stream: ExampleStream, position: int, rows: int, max_len: int) -> int:
    """The stream position after `rows` packed rows filled from `position`: where `global_batch` leaves it, however
    those rows are split into batches (the example that ends a batch starts the next one's first row); from the
    examples' token counts (`ExampleStream.lengths`), building none of them."""
    if rows <= 0:
        return position
    filler = RowFiller(rows, max_len)
    size = 64   # a short run reads few examples past its last one; a long one counts in large batches
    while True:
        lengths, error = stream.lengths(position, size)
        for length in lengths:
            if filler.place(min(length, max_len)) is None:   # min: the length `truncate` leaves
                return position
            position += 1
        if error is not None:
            raise error
        size = min(2 * size, LENGTH_CHUNK)


def collate(rows: list[list[Example]], pad_id: int, length: int | None) -> dict[str, Any]:
    """input_ids, position_ids (restarting at 0 for every sequence), targets, num_tokens (an int) and
    loss_index: the flat positions (row after row) of the targets that are not -100, in order, so that a
    recipe gathers the loss tokens with an index tensor instead of a boolean mask (whose size the host
    would have to read back from the device).

    Padding uses positions 0.. of its own, so it never continues a real sequence; its targets are -100.
    Each field is built as one flat list and becomes a tensor once: a packed batch holds
    hundreds of short examples, and a tensor per example costs more than the rest of the batch.
    """
    length = length or max(sum(len(e.ids) for e in row) for row in rows)
    ids: list[int] = []
    pos: list[int] = []
    tgt: list[int] = []
    seqlens: list[int] = []   # every example, and every row's padding, is a sequence of its own
    real = 0
    for row in rows:
        for e in row:
            ids += e.ids
            pos += range(len(e.ids))
            tgt += e.targets
            seqlens += [len(e.ids)] if e.ids else []
        pad = length - sum(len(e.ids) for e in row)
        ids += [pad_id] * pad
        pos += range(pad)
        tgt += [IGNORE] * pad
        seqlens += [pad] if pad else []
        real += length - pad
    shape = (len(rows), length)
    targets = _long_tensor(tgt, shape)
    cu_seqlens = torch.tensor([0] + seqlens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    return {"input_ids": _long_tensor(ids, shape), "position_ids": _long_tensor(pos, shape), "targets": targets,
            "loss_index": (targets.view(-1) != IGNORE).nonzero().view(-1), "num_tokens": real,
            "cu_seqlens": cu_seqlens, "max_seqlen": max(seqlens, default=0)}


def _long_tensor(values: list[int], shape: tuple[int, int]) -> torch.Tensor:
    """An int64 tensor of `shape` holding `values`, through an int64 array: converting a long list
    element by element in torch.tensor costs several times more."""
    if not values:
        return torch.zeros(shape, dtype=torch.long)
    return torch.frombuffer(array("q", values), dtype=torch.long).view(shape)


class SFTBatches(IterableDataset):
    """Infinite micro-batches for one rank, starting at stream `position`.

    They come in windows of `accumulate` micro-batches (one optimizer step). Each batch carries
    `next_position` (the stream position after it) and `step_targets`, the number of target tokens in
    the whole window over all ranks, so a loss divided by it is the exact token mean of the step.
    """

    def __init__(self, stream: ExampleStream, position: int, batch_size: int, max_seq_len: int, pack: bool,
                 pad_id: int, rank: int = 0, world_size: int = 1, accumulate: int = 1):
        self.stream = stream
        self.position = position
        self.batch_size = batch_size
        self.max_seq_len = max_seq_len
        self.pack = pack
        self.pad_id = pad_id
        self.rank = rank
        self.world_size = world_size
        self.accumulate = accumulate

    def __iter__(self) -> Iterator[dict[str, Any]]:
        position = self.position
        while True:
            window = []
            for _ in range(self.accumulate):
                rows, position = global_batch(self.stream, position, self.batch_size * self.world_size,
                                              self.max_seq_len, self.pack)
                window.append((rows, position))
            # Every rank builds the global batches, so the step's target count needs no communication.
            step_targets = sum(len(e.targets) - e.targets.count(IGNORE) for rows, _ in window for row in rows
                               for e in row)
            for rows, next_position in window:
                mine = rows[self.rank * self.batch_size:(self.rank + 1) * self.batch_size]
                batch = collate(mine, self.pad_id, self.max_seq_len if self.pack else None)
                batch["next_position"] = next_position   # ints: Lightning leaves them on the host
                batch["step_targets"] = step_targets
                yield batch


def sft_dataloader(stream: ExampleStream, position: int, cfg: dict, pad_id: int, rank: int,
                   world_size: int, accumulate: int = 1, pin_memory: bool = False) -> DataLoader:
    """A DataLoader over `SFTBatches` (batches are built in the main process; they are cheap).

    `pin_memory` (for a CUDA device) puts the batches in page-locked memory, so that their copy to the
    device runs asynchronously instead of waiting for the work already queued on the GPU.
    """
    data = cfg["data"]
    batches = SFTBatches(stream, position, data["batch_size"], data["max_seq_len"], data["pack"], pad_id,
                         rank, world_size, accumulate)
    return DataLoader(batches, batch_size=None, num_workers=0, pin_memory=pin_memory)
