"""YAML 1.2 core-schema loading and dumping on top of PyYAML, keeping source positions.

PyYAML implements YAML 1.1: `2e-5` is a string, `on`/`yes` are booleans, `0755` is octal and `12:30`
is the sexagesimal int 750, while editors validate the same file as YAML 1.2. `Yaml12Loader` has its
own implicit-resolver table with only the 1.2 core schema:

- null: `~`, `null`/`Null`/`NULL`, or nothing
- bool: `true`/`True`/`TRUE`, `false`/`False`/`FALSE` (so `on`, `off`, `yes`, `no`, `y`, `n` are strings)
- int: `[-+]?[0-9]+` (decimal, so `0755` is the int 755, as in the 1.2 core schema), `0o17`, `0x1F`
- float: `1.5`, `.5`, `2e-5`, `1e3`, `-1.5E+3`, `.inf`, `-.inf`, `.nan`
- everything else is a string (`12:30`, `2024-01-01`, `1_000`)

An explicit `!!bool`, `!!int`, `!!float` or `!!null` takes only the spellings above (`!!bool yes` is an
error, not false). No timestamps, no `<<` merge keys (both are 1.1 only). Duplicate keys are errors, and so
is an alias inside the node it refers to (`&a [*a]`). Loading returns the data plus the position of every
value (and key) by path, so later errors can say FILE:LINE:COL. PyYAML's global loaders and dumpers are
left untouched.

A config is small, so loading refuses documents that are not: more than MAX_DEPTH levels of nesting,
MAX_ALIASES aliases, or MAX_NODES values counting every alias expansion (an alias bomb). Each limit is
checked as the document is read, so a hostile file costs time linear in its size.
"""

from __future__ import annotations

import json
import math
import re
import sys
from dataclasses import dataclass
from typing import Any

import yaml

from framework.errors import ConfigError, Problem

Path = tuple  # a path into the data: mapping keys and list indices
MAX_DEPTH = 50          # nested mappings / lists
MAX_ALIASES = 100       # `*name` references
MAX_NODES = 20_000      # values, with every alias expanded where it is used


@dataclass(frozen=True)
class Mark:
    """Where something was written: a file (or a label such as an override) and a 1-based position."""

    file: str
    line: int | None = None
    col: int | None = None


@dataclass(frozen=True)
class Located:
    """Position of a value and, for mapping entries, of its key."""

    value: Mark
    key: Mark | None = None


_CORE_RESOLVERS = [  # order matters within a first character: int is tried before float
    ("tag:yaml.org,2002:bool", r"^(?:true|True|TRUE|false|False|FALSE)$", "tTfF"),
    ("tag:yaml.org,2002:null", r"^(?:~|null|Null|NULL|)$", ["~", "n", "N", ""]),
    ("tag:yaml.org,2002:int", r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$", "-+0123456789"),
    ("tag:yaml.org,2002:float",
     r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$",
     "-+0123456789."),
]


def _core_resolver_table() -> dict:
    table: dict = {}
    for tag, pattern, first in _CORE_RESOLVERS:
        regexp = re.compile(pattern)
        for ch in first:
            table.setdefault(ch, []).append((tag, regexp))
    return table


_CORE_PATTERNS = {tag: re.compile(pattern) for tag, pattern, _ in _CORE_RESOLVERS}
_CORE_EXPECTED = {  # tag: (what it takes, examples or a hint)
    "tag:yaml.org,2002:bool": ("true or false", " (YAML 1.2 reads on/off/yes/no as strings)"),
    "tag:yaml.org,2002:null": ("null, ~ or nothing", ""),
    "tag:yaml.org,2002:int": ("an integer", " (e.g. 42, -7, 0o17, 0x1F)"),
    "tag:yaml.org,2002:float": ("a number", " (e.g. 1.5, 2e-5, 1e3, .inf, .nan)"),
}


def _shown(text: str) -> str:
    """`text` quoted and cut short, so that a long scalar still gives a one-line message."""
    return repr(text if len(text) <= 40 else text[:40] + "…")


def _core_text(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> str:
    """The scalar's text, refused unless the core schema reads it as the node's tag.

    Untagged scalars only get these tags when they match, so this refuses explicit tags such as `!!int abc`.
    """
    text = loader.construct_scalar(node)
    if not _CORE_PATTERNS[node.tag].fullmatch(text):
        what, hint = _CORE_EXPECTED[node.tag]
        raise yaml.constructor.ConstructorError(
            None, None, f"expected {what} after !!{node.tag.rsplit(':', 1)[1]}, got {_shown(text)}{hint}",
            node.start_mark)
    return text


def _construct_null(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> None:
    _core_text(loader, node)


def _construct_int(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> int:
    text = _core_text(loader, node)
    if text.startswith(("0x", "0o")):
        return int(text, 0)
    try:
        return int(text, 10)  # leading zeros are decimal in the 1.2 core schema
    except ValueError:  # Python refuses to convert decimal strings over sys.get_int_max_str_digits() digits
        raise yaml.constructor.ConstructorError(
            None, None, f"expected an integer of at most {sys.get_int_max_str_digits()} digits, "
                        f"got one of {len(text.lstrip('+-'))}", node.start_mark) from None


def _construct_float(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> float:
    text = _core_text(loader, node).lower()
    if text.endswith(".inf"):
        return -math.inf if text.startswith("-") else math.inf
    if text == ".nan":
        return math.nan
    return float(text)


def _construct_timestamp(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> None:
    # PyYAML's own constructor fails with an AttributeError on text that is not a date
    raise yaml.constructor.ConstructorError(
        None, None, f"!!timestamp is YAML 1.1 only, got {_shown(loader.construct_scalar(node))}; a config takes "
                    "dates as strings", node.start_mark)


def _construct_bool(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> bool:
    return _core_text(loader, node).lower() == "true"


class Yaml12Loader(yaml.SafeLoader):
    """SafeLoader with the YAML 1.2 core schema (its own resolver table; nothing global is changed)
    that refuses documents deeper than MAX_DEPTH, with more than MAX_ALIASES aliases or MAX_NODES nodes."""

    yaml_implicit_resolvers = _core_resolver_table()

    def __init__(self, stream: str):
        super().__init__(stream)
        self._depth = self._aliases = self._nodes = 0
        self._open: dict[str, yaml.Mark] = {}  # anchors of the collections being composed

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node:
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent):
            self._aliases += 1
            if self._aliases > MAX_ALIASES:
                raise _limit(f"has more than {MAX_ALIASES} aliases", event.start_mark)
            if event.anchor in self._open:  # the node would contain itself: walking it never ends
                m = self._open[event.anchor]
                raise _Cycle(None, None, f"the alias *{event.anchor} refers to a node that contains it "
                                         f"(&{event.anchor} at line {m.line + 1}, column {m.column + 1}); "
                                         "expected an alias to a node outside it", event.start_mark)
        else:
            self._nodes += 1
            if self._nodes > MAX_NODES:
                raise _limit(f"has more than {MAX_NODES} values", event.start_mark)
        self._depth += 1
        if self._depth > MAX_DEPTH:
            raise _limit(f"is nested more than {MAX_DEPTH} levels deep", event.start_mark)
        anchor = event.anchor if isinstance(event, (yaml.SequenceStartEvent, yaml.MappingStartEvent)) else None
        if anchor is not None:
            self._open[anchor] = event.start_mark
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1
            if anchor is not None:
                self._open.pop(anchor, None)


class _TooBig(yaml.composer.ComposerError):
    """A document over one of the size limits."""


def _limit(what: str, mark: yaml.Mark) -> _TooBig:
    return _TooBig(None, None, f"the document {what}; a config is much smaller", mark)


class _Cycle(yaml.composer.ComposerError):
    """An alias inside the node it refers to (`&a [*a]`): valid YAML, but no config is infinite."""


Yaml12Loader.add_constructor("tag:yaml.org,2002:int", _construct_int)  # copies the table for this class only
Yaml12Loader.add_constructor("tag:yaml.org,2002:float", _construct_float)
Yaml12Loader.add_constructor("tag:yaml.org,2002:bool", _construct_bool)
Yaml12Loader.add_constructor("tag:yaml.org,2002:null", _construct_null)
Yaml12Loader.add_constructor("tag:yaml.org,2002:timestamp", _construct_timestamp)


class _Yaml11Resolver(yaml.resolver.Resolver):
    """The implicit tags a YAML 1.1 reader gives a plain scalar: PyYAML's own resolver, which `yaml.safe_load`
    uses, plus the 1.1 spec's `y`/`Y`/`n`/`N` booleans that PyYAML leaves out but other 1.1 readers take."""


_Yaml11Resolver.add_implicit_resolver("tag:yaml.org,2002:bool", re.compile(r"^(?:y|Y|n|N)$"), list("yYnN"))
_YAML11 = _Yaml11Resolver()


class Yaml12Dumper(yaml.SafeDumper):
    """SafeDumper that quotes exactly the strings that the 1.2 core schema or a YAML 1.1 reader would read as
    something else, and writes strings holding U+0085, U+2028 or U+2029 double-quoted.

    A resolved config.yaml is read by fw (YAML 1.2) and by users' scripts, often with PyYAML (YAML 1.1, where
    `12:30` is 750 and `on` is true); a string either would misread is quoted, so both read the same string.
    """

    yaml_implicit_resolvers = _core_resolver_table()

    def resolve(self, kind: type, value: Any, implicit: tuple[bool, bool]) -> str:
        tag = super().resolve(kind, value, implicit)
        if kind is yaml.ScalarNode and implicit[0] and tag == self.DEFAULT_SCALAR_TAG:
            # the serializer writes a string plain only where this gives the string tag; any other tag quotes it
            return _YAML11.resolve(kind, value, implicit)
        return tag


# PyYAML reads these as line breaks, which a plain or single-quoted scalar folds (NEL becomes a space); escaped
# in double quotes (\N, \L, \P) they read back as themselves, also in YAML 1.2 readers.
_FOLDED_BREAKS = ("\x85", "\u2028", "\u2029")


def _represent_str(dumper: Yaml12Dumper, data: str) -> yaml.ScalarNode:
    style = '"' if any(ch in data for ch in _FOLDED_BREAKS) else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", data, style=style)


Yaml12Dumper.add_representer(str, _represent_str)  # copies the table for this class only


def _mark(file: str, m: yaml.Mark) -> Mark:
    return Mark(file, m.line + 1, m.column + 1)


def _at(m: yaml.Mark) -> str:
    return f"line {m.line + 1}, column {m.column + 1}"


def _tab_hint(m: yaml.Mark | None) -> str:
    """Why a tab at `m` cannot be there: indentation, a key's separator or another place between tokens."""
    if m is None or m.buffer is None:
        return " (use spaces, not tabs, outside quoted values)"
    start = max(m.buffer.rfind(br, 0, m.pointer) for br in ("\n", "\r", *_FOLDED_BREAKS)) + 1  # PyYAML's breaks
    before = m.buffer[start:m.pointer]
    if not before.strip(" \t\ufeff"):
        return " (indent YAML with spaces, not tabs)"
    if before.rstrip(" \t").endswith(":"):
        return " (a tab cannot separate a key from its value in this reader; use a space)"
    return " (this reader takes no tab between YAML tokens; use a space, or quote a value that holds a tab)"


def _syntax_problem(file: str, e: yaml.MarkedYAMLError) -> Problem:
    mark = e.problem_mark or e.context_mark
    text = e.problem or "invalid YAML"
    elsewhere = e.context_mark is not None and e.problem_mark is not None and \
        (e.context_mark.line, e.context_mark.column) != (e.problem_mark.line, e.problem_mark.column)
    context = e.context or ""
    if elsewhere and context.startswith("found duplicate anchor"):
        text = f"{context.removesuffix('; first occurrence')} (first defined at {_at(e.context_mark)})"
    elif elsewhere and context.startswith("while "):
        # an unclosed quote or bracket is found at the end of the file: say where it opened
        text = f"{context} (started at {_at(e.context_mark)}), {text}"
    elif context:
        text = f"{context}, {text}"
    if "'\\t'" in text:
        text += _tab_hint(e.problem_mark)
    what = "YAML" if isinstance(e, (_TooBig, _Cycle)) else "YAML syntax error"
    return Problem(file, mark.line + 1 if mark else None, mark.column + 1 if mark else None, "",
                   f"{what}: {text}")


def _key_text(loader: Yaml12Loader, node: yaml.Node) -> Any:
    if isinstance(node, yaml.ScalarNode):
        return loader.construct_object(node, deep=True)
    return None  # complex keys cannot be config keys; schema validation reports them


def dotted_path(path: Path) -> str:
    """`path` as the config's messages write it: `callbacks[0].class_path`."""
    out = ""
    for p in path:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out


class _Budget:
    """Values left to visit: aliases make a small node graph expand to an exponentially large tree. `checked`: the
    mappings whose keys were checked, which an alias reaches again under another path."""

    def __init__(self, n: int):
        self.left = n
        self.checked: set[int] = set()


def _walk(loader: Yaml12Loader, node: yaml.Node, file: str, path: Path, marks: dict, problems: list,
          key_mark: Mark | None, budget: _Budget) -> None:
    """Record positions under `path` and find duplicate keys, all of them."""
    budget.left -= 1
    if budget.left < 0:
        raise _limit(f"has more than {MAX_NODES} values once its aliases are expanded", node.start_mark)
    marks[path] = Located(_mark(file, node.start_mark), key_mark)
    if isinstance(node, yaml.MappingNode):
        seen: dict = {}
        # a key written twice is one problem, at the path where it is written, whatever the aliases that reuse it
        first_visit = id(node) not in budget.checked
        budget.checked.add(id(node))
        for k_node, v_node in node.value:
            key = _key_text(loader, k_node)
            kmark = _mark(file, k_node.start_mark)
            try:
                first = seen.get(key)
            except TypeError:  # unhashable keys are reported by PyYAML when constructing
                first = None
            if first is not None:
                if first_visit:
                    at = f"column {first.col}" if first.line == kmark.line else f"line {first.line}"
                    shown = key_text(key)
                    problems.append(Problem(file, kmark.line, kmark.col, dotted_path(path + (shown,)),
                                            f"duplicate key '{shown}' (first defined at {at})"))
                continue
            if key is not None:
                seen[key] = kmark
            _walk(loader, v_node, file, path + (key,), marks, problems, kmark, budget)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _walk(loader, item, file, path + (i,), marks, problems, None, budget)


# The words YAML 1.1 read as booleans and YAML 1.2 reads as strings
YAML11_BOOLEANS = {"on", "off", "yes", "no", "y", "n"}


def bool_hint(value: Any) -> str:
    """What to write instead, where `value` is meant as a boolean but is a YAML 1.1 boolean word, else ""."""
    if isinstance(value, str) and value.lower() in YAML11_BOOLEANS:
        return " (YAML 1.2 reads on/off/yes/no as strings: write true or false)"
    return ""


_BREAK = re.compile("\r\n|[\n\r\x85\u2028\u2029]")   # the line breaks PyYAML counts lines by


def _unreadable_character(file: str, text: str, e: yaml.reader.ReaderError) -> Problem:
    """PyYAML's reader refuses a character (a control character, U+FFFE) before it parses, at an offset into `text`
    rather than a line: the problem at that character's line and column."""
    before = text[:e.position]
    breaks = list(_BREAK.finditer(before))
    col = e.position - (breaks[-1].end() if breaks else 0) + 1
    return Problem(file, len(breaks) + 1, col, "",
                   f"YAML syntax error: the character U+{e.character:04X} is not allowed in YAML text; remove it, or "
                   f'write it as the escape "\\u{e.character:04x}" inside double quotes')


def _compose(text: str, file: str) -> tuple[yaml.Node | None, Yaml12Loader]:
    try:
        loader = Yaml12Loader(text)   # reads the whole text, refusing what YAML does not allow in it
    except yaml.reader.ReaderError as e:
        raise ConfigError([_unreadable_character(file, text, e)]) from None
    try:
        return loader.get_single_node(), loader
    except yaml.MarkedYAMLError as e:
        loader.dispose()
        raise ConfigError([_syntax_problem(file, e)]) from None


def load_with_marks(text: str, file: str = "<string>") -> tuple[Any, dict[Path, Located]]:
    """Parse one YAML 1.2 document; returns (data, positions by path). Raises ConfigError on bad YAML."""
    node, loader = _compose(text, file)
    try:
        if node is None:
            return None, {}
        marks: dict[Path, Located] = {}
        problems: list[Problem] = []
        try:
            _walk(loader, node, file, (), marks, problems, None, _Budget(MAX_NODES))
        except yaml.MarkedYAMLError as e:
            raise ConfigError([_syntax_problem(file, e)]) from None
        if problems:
            raise ConfigError(problems)
        try:
            data = loader.construct_document(node)
        except yaml.MarkedYAMLError as e:
            raise ConfigError([_syntax_problem(file, e)]) from None
        return data, marks
    finally:
        loader.dispose()


def load(text: str, file: str = "<string>") -> Any:
    """Parse one YAML 1.2 document into plain Python data."""
    return load_with_marks(text, file)[0]


def parse_scalar(text: str) -> tuple[Any, bool]:
    """Parse a command-line value as a YAML 1.2 scalar or flow collection.

    Returns (value, ok); ok is False when the text is not one flow value (e.g. `a: b`, `- x`, or `exp #3`,
    where a comment would drop text), in which case value is the text itself. A key written twice in a flow
    mapping (`{a: 1, a: 2}`) raises ConfigError, as it does in a file; its problems are at their path in the value.
    """
    try:
        node, loader = _compose(text, "<value>")
    except ConfigError:
        return text, False
    try:
        if node is None:   # nothing, or only a comment (`#3`)
            return (None, True) if not text.strip() else (text, False)
        if isinstance(node, (yaml.MappingNode, yaml.SequenceNode)) and not node.flow_style:
            return text, False
        if text[node.end_mark.index:].strip():   # a comment after the value
            return text, False
        problems: list[Problem] = []
        _walk(loader, node, "<value>", (), {}, problems, None, _Budget(MAX_NODES))
        if problems:
            raise ConfigError(problems)
        return loader.construct_document(node), True
    except yaml.YAMLError:
        return text, False
    finally:
        loader.dispose()


def key_text(key: Any) -> str:
    """A mapping key as the file writes it: `1:`, `true:` and `null:` are the keys 1, true and null, not a list
    index [1] or Python's True and None."""
    return key if isinstance(key, str) else inline(key)


def inline(value: Any) -> str:
    """`value` as a config file writes it, on one line: null, true, 32-true, [a, b], {rank: 8}."""
    text = yaml.dump(value, Dumper=Yaml12Dumper, default_flow_style=True, sort_keys=False, width=sys.maxsize,
                     allow_unicode=True)
    text = text.removesuffix("\n...\n").removesuffix("\n")
    # a multi-line string: JSON, which YAML reads too, escapes its line breaks
    return text if "\n" not in text else json.dumps(value, ensure_ascii=False)


def dump(data: Any) -> str:
    """Block-style YAML that `load` reads back to the same data (keys keep their order)."""
    return yaml.dump(data, Dumper=Yaml12Dumper, sort_keys=False, default_flow_style=False, allow_unicode=True,
                     width=100)
