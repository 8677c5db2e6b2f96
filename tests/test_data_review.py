"""Data loading under review: the epoch orders of runs with neighbouring seeds, a JSONL object with a key written
twice, a data file that is compressed or Parquet rather than JSON Lines text, and a YAML key written twice in a
mapping that aliases reuse."""

import bz2
import gzip
import json
import lzma

import pytest

from framework.config import resolve
from framework.data import ExampleStream
from framework.errors import ConfigError, FwError
from framework.jsonl import read_jsonl
from framework.tasks import JsonlPrompts
from framework.tokenizer import Tokenizer
from framework.validate import validate_config


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.builtin()


def write_jsonl(path, lines):
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


# ---------------------------------------------------------------- epoch orders and the seed

def test_runs_with_neighbouring_seeds_share_no_epoch_order(tmp_path, tok):
    """Every (seed, epoch) shuffles the examples its own way: with orders seeded by `seed + epoch`, the run with seed
    1 reads in its first epoch exactly what the run with seed 0 reads in its second, so a seed sweep over multi-epoch
    SFT trains on the same sequence of examples shifted by an epoch."""
    n = 20
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": f"q{i}", "completion": f"a{i}"} for i in range(n)])
    orders = {}
    seeds = (0, 1, 2, 2**32 - 1)   # the schema's least and greatest seeds too
    for seed in seeds:
        cfg = resolve({"recipe": "sft", "seed": seed, "model": {"policy": {"preset": "tiny"}},
                       "data": {"path": str(path)}})
        stream = ExampleStream(cfg, tok, train_on_prompt=False)
        index = {tuple(e.ids): i for i, e in enumerate(stream.examples)}
        for epoch in range(3):
            order = tuple(index[tuple(stream[p].ids)] for p in range(epoch * n, (epoch + 1) * n))
            assert sorted(order) == list(range(n))   # each epoch visits every example once
            orders[seed, epoch] = order
    assert orders[1, 0] != orders[0, 1] and orders[2, 0] != orders[1, 1] and orders[0, 0] != orders[2**32 - 1, 1]
    assert len(set(orders.values())) == len(orders)


def test_runs_whose_seeds_are_close_share_an_order_only_epochs_apart():
    """What `epoch_seed`'s docstring promises: epoch seeds (s, e) and (s + d, e') meet only where s + e * stride and
    s + d + e' * stride agree in their low 32 bits (all torch's generator keeps), i.e. e - e' = d / stride mod 2^32."""
    from framework.data import EPOCH_STRIDE, epoch_seed

    inverse = pow(EPOCH_STRIDE, -1, 2**32)
    gaps = ((d * inverse) % 2**32 for d in range(1, 100_001))
    assert min(min(g, 2**32 - g) for g in gaps) == 28657
    assert [epoch_seed(s, e) for s, e in ((0, 0), (3, 0), (0, 1), (2**32 - 1, 1))] == \
        [0, 3, EPOCH_STRIDE, EPOCH_STRIDE - 1]   # seed 0 keeps its first epoch's order; below 2^32, torch's range


# ---------------------------------------------------------------- a key written twice

@pytest.mark.parametrize("line, key", [
    ('{"prompt": "2+2=", "completion": "4", "completion": "5"}', "completion"),
    ('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "a", "content": "b"}]}',
     "content"),
])
def test_a_key_written_twice_in_a_jsonl_object_is_an_error(tmp_path, line, key):
    """json keeps the last of two values of one key and drops the first without a word, so the run would train on
    one of the two answers the line holds; a YAML config with a key written twice is refused, and so is this line."""
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "1+1=", "completion": "2"}, line])
    with pytest.raises(FwError) as e:
        read_jsonl(path)
    message = str(e.value)
    assert message.startswith(f"{path}:2: ") and f"duplicate key {key!r}" in message
    assert "\n" not in message


def test_a_key_written_twice_in_an_rl_prompt_is_an_error(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", ['{"prompt": "1+1=", "answer": "2", "answer": "3"}'])
    with pytest.raises(FwError, match=rf"^{path}:1: .*duplicate key 'answer'"):
        JsonlPrompts(str(path), "prompt", "answer", shuffle=True)


def test_fw_validate_names_the_line_with_a_key_written_twice(tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "completion": "b"},
                                              '{"prompt": "c", "prompt": "d", "completion": "e"}'])
    config = tmp_path / "c.yaml"
    config.write_text(f"recipe: sft\nmodel: {{policy: {{preset: tiny}}}}\ndata: {{path: {data}}}\n")
    with pytest.raises(ConfigError) as e:
        validate_config([str(config)])
    problems = [str(p) for p in e.value.problems]
    assert len(problems) == 1 and problems[0].startswith(f"{data}:2:") and "duplicate key 'prompt'" in problems[0]


def test_equal_keys_in_different_objects_are_not_duplicates(tmp_path):
    line = {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}], "content": 1}
    path = write_jsonl(tmp_path / "d.jsonl", [line])
    assert read_jsonl(path) == [(f"{path}:1", line)]


# ---------------------------------------------------------------- a compressed or Parquet file

RECORDS = b'{"prompt": "1+1=", "completion": "2"}\n' * 50


CONTAINERS = {   # name: (content, what the message calls it)
    "d.jsonl.gz": (gzip.compress(RECORDS), "a gzip-compressed file"),
    "d.jsonl.bz2": (bz2.compress(RECORDS), "a bzip2-compressed file"),
    "d.jsonl.xz": (lzma.compress(RECORDS), "an xz-compressed file"),
    "d.jsonl.zst": (b"\x28\xb5\x2f\xfd\x24\x00\x81\x00\xff", "a zstd-compressed file"),
    "d.zip": (b"PK\x03\x04\x14\x00\x00\x00\x08\x00\x91\xc3", "a zip archive"),
    "d.parquet": (b"PAR1\x15\x04\x15\x80\xe1\x01", "a Parquet file"),
}


@pytest.mark.parametrize("name", CONTAINERS)
def test_a_compressed_or_parquet_data_file_is_named_as_such(tmp_path, name):
    """Such a file is not UTF-8, and being told to save it as UTF-8 sends the user to an editor that cannot open it:
    the message says what the file is and that fw reads JSON Lines text."""
    content, said = CONTAINERS[name]
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(FwError) as e:
        read_jsonl(path)
    message = str(e.value)
    assert message.startswith(f"{path}:1:1: {said}, not JSON Lines text"), message
    assert "save the file as UTF-8" not in message


def test_a_text_file_that_begins_like_a_container_is_read_as_text(tmp_path):
    """The magic bytes name a container only where the file is not UTF-8 text: a record may begin with them."""
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'PAR1\n')
    with pytest.raises(FwError, match=rf"^{path}:1: not valid JSON"):
        read_jsonl(path)


def test_a_file_that_is_not_utf8_is_still_said_to_be_so(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'{"prompt": "a", "completion": "\xe9"}\n')
    with pytest.raises(FwError, match=rf"^{path}:1:32: not UTF-8 \(byte 0xe9\); save the file as UTF-8$"):
        read_jsonl(path)


# ---------------------------------------------------------------- YAML: a duplicate key reached through an alias

def test_a_duplicate_key_in_an_aliased_mapping_is_one_problem_where_it_is_written():
    """A mapping with a key written twice, anchored and used again by an alias, is one mistake at one place: one
    problem at the path where it is written, not a second at the alias's path, which points at the same line."""
    from framework import yaml12

    text = "optimizer: &o\n  lr: 1.0e-5\n  lr: 2.0e-5\neval: {x: *o}\nsft: [*o, *o]\n"
    with pytest.raises(ConfigError) as e:
        yaml12.load_with_marks(text, "c.yaml")
    problems = [str(p) for p in e.value.problems]
    assert problems == ["c.yaml:3:3: optimizer.lr: duplicate key 'lr' (first defined at line 2)"]
