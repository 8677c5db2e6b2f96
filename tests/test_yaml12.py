"""The YAML 1.2 core loader: scalars, duplicate keys, positions, syntax errors, dumping, isolation."""

import math
import random

import pytest
import yaml

from framework import yaml12
from framework.errors import ConfigError

# (plain scalar as written, value under the YAML 1.2 core schema) -- from the 1.2.2 spec, section 10.3
CORE_SCALARS = [
    ("2e-5", 2e-5), ("1e3", 1000.0), ("-1.5E+3", -1500.0), (".5", 0.5), ("1.", 1.0), ("+12.5", 12.5),
    ("0", 0), ("-7", -7), ("+5", 5), ("0755", 755), ("0o17", 15), ("0x1F", 31), ("0xff", 255),
    ("true", True), ("True", True), ("TRUE", True), ("false", False), ("False", False), ("FALSE", False),
    ("null", None), ("Null", None), ("NULL", None), ("~", None), ("", None),
    ("on", "on"), ("off", "off"), ("yes", "yes"), ("no", "no"), ("y", "y"), ("n", "n"), ("Yes", "Yes"),
    ("12:30", "12:30"), ("2024-01-01", "2024-01-01"), ("1_000", "1_000"), ("0b101", "0b101"),
    ("tRUE", "tRUE"), ("nULL", "nULL"), ("1e", "1e"), ("0x", "0x"), ("0o8", "0o8"), ("=", "="),
    ("<<", "<<"), ("hello world", "hello world"), ("'1e3'", "1e3"), ('"true"', "true"),
]


@pytest.mark.parametrize("text,expected", CORE_SCALARS)
def test_core_schema_scalars(text, expected):
    value = yaml12.load(f"v: {text}\n")["v"]
    assert value == expected and type(value) is type(expected)


@pytest.mark.parametrize("text,sign", [(".inf", 1), ("+.inf", 1), ("-.inf", -1), (".Inf", 1), ("-.INF", -1)])
def test_infinities(text, sign):
    assert yaml12.load(f"v: {text}")["v"] == sign * math.inf


@pytest.mark.parametrize("text", [".nan", ".NaN", ".NAN"])
def test_nan(text):
    assert math.isnan(yaml12.load(f"v: {text}")["v"])


def test_yaml11_words_are_strings_also_as_keys():
    assert yaml12.load("on: 1\nyes: 2\n") == {"on": 1, "yes": 2}


def test_pyyaml_global_loaders_are_untouched():
    # importing framework.yaml12 must not change what plain PyYAML does (YAML 1.1)
    assert yaml.safe_load("a: on\nb: 2e-5\nc: 0755\nd: 12:30\n") == {"a": True, "b": "2e-5", "c": 493, "d": 750}
    assert yaml12.Yaml12Loader.yaml_implicit_resolvers is not yaml.SafeLoader.yaml_implicit_resolvers
    assert yaml12.Yaml12Loader.yaml_constructors is not yaml.SafeLoader.yaml_constructors


def test_nested_structures_and_anchors():
    text = "base: &b {lr: 1e-4, betas: [0.9, 0.95]}\ncopy: *b\nlist:\n  - 1\n  - [a, {x: .5}]\n"
    assert yaml12.load(text) == {"base": {"lr": 1e-4, "betas": [0.9, 0.95]},
                                 "copy": {"lr": 1e-4, "betas": [0.9, 0.95]}, "list": [1, ["a", {"x": 0.5}]]}


def test_positions_of_keys_and_values():
    text = "a: 1\nsection:\n  key:   value\n  items:\n    - x\n    - {y: 2}\n"
    data, marks = yaml12.load_with_marks(text, "f.yaml")
    assert data["section"]["items"][1] == {"y": 2}
    assert marks[("a",)].key == yaml12.Mark("f.yaml", 1, 1)
    assert marks[("a",)].value == yaml12.Mark("f.yaml", 1, 4)
    assert marks[("section", "key")].key == yaml12.Mark("f.yaml", 3, 3)
    assert marks[("section", "key")].value == yaml12.Mark("f.yaml", 3, 10)
    assert marks[("section", "items", 0)].value == yaml12.Mark("f.yaml", 5, 7)
    assert marks[("section", "items", 1, "y")].value == yaml12.Mark("f.yaml", 6, 11)
    assert marks[("section", "items", 1)].key is None


def test_every_duplicate_key_is_reported():
    text = "a: 1\nb:\n  c: 1\n  c: 2\na: 3\nl:\n  - x: 1\n    x: 2\n  - {k: 1, k: 2}\n"
    with pytest.raises(ConfigError) as e:
        yaml12.load(text, "d.yaml")
    assert [str(p) for p in e.value.problems] == [
        "d.yaml:4:3: b.c: duplicate key 'c' (first defined at line 3)",
        "d.yaml:5:1: a: duplicate key 'a' (first defined at line 1)",
        "d.yaml:8:5: l[0].x: duplicate key 'x' (first defined at line 7)",
        "d.yaml:9:12: l[1].k: duplicate key 'k' (first defined at column 6)",
    ]


def test_parse_scalar_of_a_flow_mapping_with_a_key_written_twice_is_an_error():
    with pytest.raises(ConfigError) as e:
        yaml12.parse_scalar("[{a: 1, b: 2, a: 3}]")
    assert [(p.key_path, p.col, p.message) for p in e.value.problems] == [
        ("[0].a", 15, "duplicate key 'a' (first defined at column 3)")]


def test_duplicate_keys_differing_only_in_spelling_of_the_same_value():
    # `1` and `0x1` are the same int key once resolved
    with pytest.raises(ConfigError, match="duplicate key '1'"):
        yaml12.load("1: a\n0x1: b\n")


def test_syntax_error_position():
    with pytest.raises(ConfigError) as e:
        yaml12.load("a: [1, 2\nb: 3\n", "s.yaml")
    (problem,) = e.value.problems
    assert (problem.file, problem.line, problem.col) == ("s.yaml", 2, 2)
    assert "YAML syntax error" in problem.message and "expected ',' or ']'" in problem.message


def test_tab_indentation_hint():
    with pytest.raises(ConfigError) as e:
        yaml12.load("a:\n\tb: 1\n", "t.yaml")
    (problem,) = e.value.problems
    assert (problem.line, problem.col) == (2, 1)
    assert "spaces, not tabs" in problem.message


TAB_FOUND = "YAML syntax error: while scanning for the next token, found character '\\t' that cannot start any token"


@pytest.mark.parametrize("text,where,hint", [
    ("a:\n\tb: 1\n", "2:1", "indent YAML with spaces, not tabs"),
    ("a:\n  b: 1\n \tc: 2\n", "3:2", "indent YAML with spaces, not tabs"),
    ("seed:\t0\n", "1:6", "a tab cannot separate a key from its value in this reader; use a space"),
    ("a: {b:\t1}\n", "1:7", "a tab cannot separate a key from its value in this reader; use a space"),
    ("a: [1,\t2]\n", "1:7",
     "this reader takes no tab between YAML tokens; use a space, or quote a value that holds a tab"),
])
def test_a_tab_is_called_indentation_only_where_it_indents(text, where, hint):
    assert _one_problem(text) == f"f.yaml:{where}: {TAB_FOUND} ({hint})"


@pytest.mark.parametrize("text,where,message", [
    ("a: 1\nb: 'x\n\nc: 2\n", "5:1",
     "while scanning a quoted scalar (started at line 2, column 4), found unexpected end of stream"),
    ('a: "x\n', "2:1", "while scanning a quoted scalar (started at line 1, column 4), found unexpected end of stream"),
    ("a: [1, 2\nb: 3\n", "2:2",
     "while parsing a flow sequence (started at line 1, column 4), expected ',' or ']', but got ':'"),
    ("a: &x 1\nb: &x 2\n", "2:4", "found duplicate anchor 'x' (first defined at line 1, column 4)"),
    ("a: {[1]: 2}\n", "1:5", "while constructing a mapping (started at line 1, column 4), found unhashable key"),
    ("a: 1\n---\nb: 2\n", "2:1", "expected a single document in the stream, but found another document"),
])
def test_a_syntax_error_names_where_the_unclosed_node_opened(text, where, message):
    assert _one_problem(text) == f"f.yaml:{where}: YAML syntax error: {message}"


def test_two_documents_are_an_error():
    with pytest.raises(ConfigError, match="expected a single document"):
        yaml12.load("a: 1\n---\nb: 2\n")


def test_empty_document_is_none():
    assert yaml12.load_with_marks("# only a comment\n", "e.yaml") == (None, {})


@pytest.mark.parametrize("value", ["1e3", "0755", "0o17", "0x1F", "true", "TRUE", "null", "~", "", ".5", ".inf",
                                   "-.5e-3", "yes", "on", "12:30", "2024-01-01", "1_000", "#x", "a: b", "- x",
                                   "'q'", "multi\nline", " lead", "[1]"])
def test_dump_round_trip_of_strings(value):
    assert yaml12.load(yaml12.dump({"v": value})) == {"v": value}


@pytest.mark.parametrize("value", ["END\x85", "\x85", "a\u2028b", "\u2029", "x\x85\n\u2028 \u2029y"])
def test_dump_round_trip_of_unicode_line_breaks(value):
    text = yaml12.dump({"v": value, value: 1})
    assert yaml12.load(text) == {"v": value, value: 1}
    assert yaml.safe_load(text) == {"v": value, value: 1}   # PyYAML's own reader reads the escapes alike


def test_dump_round_trip_fuzz():
    """What fw writes reads back the same in fw's YAML 1.2 reader and in PyYAML's YAML 1.1 one."""
    rng = random.Random(0)
    alphabet = list("ab 0:#-?,[]{}!&*|>'\"%@`~\t\n\r\\e.") + ["\x85", "\u2028", "\u2029", "\ufeff", "é", "\x7f",
                                                               "null", "true", "on", ".inf", "0x1", "1e5", "<<",
                                                               "Yes", "n", "=", "12", ":30", "2026-12-07", "0b1", "_"]
    for _ in range(1500):
        value = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 6)))
        data = {"k": value, value: [value]}
        text = yaml12.dump(data)
        assert yaml12.load(text) == data, repr(value)
        assert yaml.safe_load(text) == data, repr(value)


# strings that YAML 1.1 (PyYAML's `yaml.safe_load`, or the 1.1 spec: y/n) or YAML 1.2 reads as something else
AMBIGUOUS = ["y", "Y", "n", "N", "yes", "Yes", "YES", "no", "No", "NO", "on", "On", "ON", "off", "Off", "OFF",
             "12:30", "-1:30", "1:20:30", "190:20:30.15", "0o17", "0x1F", "0b101", "+0b1", "0755", "1_000", "1.5_0",
             ".inf", "-.Inf", ".NaN", "~", "null", "Null", "", "true", "False", "1e3", "2026-12-07",
             "2001-12-14t21:59:43.10-05:00", "=", "<<"]


@pytest.mark.parametrize("value", AMBIGUOUS)
def test_dump_quotes_a_string_either_yaml_version_would_misread(value):
    data = {"v": value, value: [value], "m": {value: value}}
    text = yaml12.dump(data)
    assert text.splitlines()[0] == f"v: '{value}'"
    assert yaml12.load(text) == data
    assert yaml.safe_load(text) == data


def test_dump_quotes_only_what_a_yaml_reader_would_misread():
    data = {"a": "1e3", "b": "yes", "c": "12:30", "d": "digits-grpo", "e": "yEs", "f": "x:y", "g": "1.2.3",
            "h": "2026-12", "i": "hello world", "j": "0o8", "k": "runs/exp-1"}
    assert yaml12.dump(data) == ("a: '1e3'\nb: 'yes'\nc: '12:30'\nd: digits-grpo\ne: yEs\nf: x:y\ng: 1.2.3\n"
                                 "h: 2026-12\ni: hello world\nj: 0o8\nk: runs/exp-1\n")
    assert yaml12.load(yaml12.dump(data)) == yaml.safe_load(yaml12.dump(data)) == data


def test_dump_round_trip_of_numbers_and_order():
    data = {"z": 2e-5, "a": 1000.0, "m": [1, -3, 0.1], "n": None, "t": True, "i": math.inf}
    text = yaml12.dump(data)
    assert list(yaml12.load(text)) == ["z", "a", "m", "n", "t", "i"]
    assert yaml12.load(text) == data


@pytest.mark.parametrize("text,expected", [
    ("10", (10, True)), ("1e-4", (1e-4, True)), ("[1, 2]", ([1, 2], True)), ("{a: 1}", ({"a": 1}, True)),
    ("", (None, True)), ("hello world", ("hello world", True)), ("a: b", ("a: b", False)),
    ("- x", ("- x", False)), ("[1, 2", ("[1, 2", False)), ("yes", ("yes", True)),
    # a comment would drop text from one command-line value: the value is the text
    ("exp #3", ("exp #3", False)), ("#3", ("#3", False)), ("x\t#3", ("x\t#3", False)),
    ("'a' # c", ("'a' # c", False)), ("[1, 2] # x", ("[1, 2] # x", False)), ("a#b", ("a#b", True)),
    (" 'a b'  ", ("a b", True)), ("  ", (None, True)),
])
def test_parse_scalar(text, expected):
    assert yaml12.parse_scalar(text) == expected


def test_windows_line_endings_and_byte_order_mark():
    data, marks = yaml12.load_with_marks("\ufeffa: 1\r\nb:\r\n  c: 2e-5\r\n", "w.yaml")
    assert data == {"a": 1, "b": {"c": 2e-5}}
    assert marks[("b", "c")].value == yaml12.Mark("w.yaml", 3, 6)


# ---------------------------------------------------------------- size limits (hostile documents)

def _one_problem(text: str) -> str:
    with pytest.raises(ConfigError) as info:
        yaml12.load_with_marks(text, "f.yaml")
    assert len(info.value.problems) == 1
    return str(info.value.problems[0])


def test_an_alias_bomb_is_refused_before_it_expands():
    # 9 levels of 9 aliases: 9**9 values once expanded, from a file of about 300 bytes
    text = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{c}: &{c} [{', '.join(['*' + p] * 9)}]\n" for p, c in zip("abcdefgh", "bcdefghi", strict=True))
    assert len(text) < 400
    assert "values once its aliases are expanded" in _one_problem(text)


def test_too_many_aliases():
    text = "a: &a 1\nb: [" + ", ".join(["*a"] * (yaml12.MAX_ALIASES + 1)) + "]\n"
    assert f"more than {yaml12.MAX_ALIASES} aliases" in _one_problem(text)


def test_aliases_within_the_limits_still_load():
    assert yaml12.load("a: &a [1, 2]\nb: *a\n") == {"a": [1, 2], "b": [1, 2]}


@pytest.mark.parametrize("open_, close", [("{k: ", "}"), ("[", "]")])
def test_deep_nesting_is_a_problem_not_a_recursion_error(open_, close):
    message = _one_problem("x: " + open_ * 500 + "1" + close * 500 + "\n")
    assert message.startswith("f.yaml:1:") and f"nested more than {yaml12.MAX_DEPTH} levels" in message


def test_deep_block_nesting():
    text = "".join(" " * (2 * i) + f"k{i}:\n" for i in range(500)) + " " * 1000 + "v\n"
    assert f"nested more than {yaml12.MAX_DEPTH} levels" in _one_problem(text)


def test_too_many_values_stop_the_reading_where_the_limit_is_crossed():
    text = "".join(f"k{i}: 1\n" for i in range(200_000))
    # each entry is a key and a value: the limit is crossed at entry MAX_NODES / 2
    assert _one_problem(text).startswith(f"f.yaml:{yaml12.MAX_NODES // 2}:")


# ---------------------------------------------------------------- explicit tags

@pytest.mark.parametrize("text,expected", [
    ("!!int 42", 42), ("!!int -7", -7), ("!!int 0755", 755), ("!!int 0o17", 15), ("!!int 0x1F", 31),
    ("!!float 1", 1.0), ("!!float 2e-5", 2e-5), ("!!float -.inf", -math.inf), ("!!float '1.5'", 1.5),
    ("!!bool true", True), ("!!bool FALSE", False), ("!!bool 'True'", True),
    ("!!null ~", None), ("!!null NULL", None), ("!!null", None),
])
def test_explicit_tags_take_the_core_schema_spellings(text, expected):
    value = yaml12.load(f"v: {text}\n")["v"]
    assert value == expected and type(value) is type(expected)


INT_EXAMPLES = "(e.g. 42, -7, 0o17, 0x1F)"
FLOAT_EXAMPLES = "(e.g. 1.5, 2e-5, 1e3, .inf, .nan)"
BOOL_HINT = "(YAML 1.2 reads on/off/yes/no as strings)"


@pytest.mark.parametrize("text,message", [
    ("!!int abc", f"expected an integer after !!int, got 'abc' {INT_EXAMPLES}"),
    ("!!int 0x", f"expected an integer after !!int, got '0x' {INT_EXAMPLES}"),
    ("!!int 1.5", f"expected an integer after !!int, got '1.5' {INT_EXAMPLES}"),
    ("!!int 1_000", f"expected an integer after !!int, got '1_000' {INT_EXAMPLES}"),
    ("!!float abc", f"expected a number after !!float, got 'abc' {FLOAT_EXAMPLES}"),
    ("!!float 0x1F", f"expected a number after !!float, got '0x1F' {FLOAT_EXAMPLES}"),
    ("!!bool yes", f"expected true or false after !!bool, got 'yes' {BOOL_HINT}"),
    ("!!bool on", f"expected true or false after !!bool, got 'on' {BOOL_HINT}"),
    ("!!bool tRUE", f"expected true or false after !!bool, got 'tRUE' {BOOL_HINT}"),
    ("!!bool |\n  true\n", f"expected true or false after !!bool, got 'true\\n' {BOOL_HINT}"),
    ("!!null abc", "expected null, ~ or nothing after !!null, got 'abc'"),
    ("!!timestamp abc", "!!timestamp is YAML 1.1 only, got 'abc'; a config takes dates as strings"),
    ("!!timestamp 2024-01-01", "!!timestamp is YAML 1.1 only, got '2024-01-01'; a config takes dates as strings"),
    ("!!int " + "7" * 60 + "x", f"expected an integer after !!int, got '{'7' * 40}…' {INT_EXAMPLES}"),
])
def test_an_explicit_tag_on_a_value_it_cannot_take_is_a_positioned_error(text, message):
    # the position is the tag's, where the value starts
    assert _one_problem(f"a: 1\nv: {text}\n") == f"f.yaml:2:4: YAML syntax error: {message}"


def test_an_explicit_tag_on_a_key_it_cannot_take():
    assert _one_problem("a: 1\n!!int abc: 2\n") == (
        f"f.yaml:2:1: YAML syntax error: expected an integer after !!int, got 'abc' {INT_EXAMPLES}")


def test_an_integer_too_long_for_python_is_a_positioned_error():
    assert _one_problem("v: " + "9" * 5000 + "\n") == (
        "f.yaml:1:4: YAML syntax error: expected an integer of at most 4300 digits, got one of 5000")


@pytest.mark.parametrize("text", ["!!int abc", "!!int 0x", "!!float abc", "!!bool yes", "!!bool on", "!!null x"])
def test_parse_scalar_of_a_tag_it_cannot_take_is_the_text_itself(text):
    assert yaml12.parse_scalar(text) == (text, False)


# ---------------------------------------------------------------- recursive aliases

@pytest.mark.parametrize("text,col,anchor_col", [
    ("x: &a [*a]\n", 8, 4),
    ("x: &a {k: *a}\n", 11, 4),
    ("x: &a [1, {k: [2, *a]}]\n", 19, 4),
    ("x: [0, &a [1, &b [*a]]]\n", 19, 8),
])
def test_an_alias_inside_the_node_it_refers_to_is_a_problem_not_a_recursion_error(text, col, anchor_col):
    assert _one_problem(text) == (f"f.yaml:1:{col}: YAML: the alias *a refers to a node that contains it "
                                  f"(&a at line 1, column {anchor_col}); expected an alias to a node outside it")


def test_a_block_alias_inside_its_node():
    text = "base: &b\n  lr: 1\n  again: *b\n"
    assert _one_problem(text) == ("f.yaml:3:10: YAML: the alias *b refers to a node that contains it "
                                  "(&b at line 1, column 7); expected an alias to a node outside it")


def test_parse_scalar_of_a_recursive_alias_is_the_text_itself():
    assert yaml12.parse_scalar("&a [*a]") == ("&a [*a]", False)


def test_aliases_to_complete_nodes_still_load():
    # the same anchor used twice, nested anchors, and an alias beside (not inside) its node
    text = "a: &a [1, &b [2]]\nb: *a\nc: *b\nd: [*b, *a]\ne: [&c {k: 1}, *c]\nf: &f {x: &x 3, y: *x}\n"
    assert yaml12.load(text) == {"a": [1, [2]], "b": [1, [2]], "c": [2], "d": [[2], [1, [2]]],
                                 "e": [{"k": 1}, {"k": 1}], "f": {"x": 3, "y": 3}}
    assert yaml12.parse_scalar("[&a [1], *a]") == ([[1], [1]], True)
