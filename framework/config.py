"""Load, merge, override, validate and resolve the job config against schemas/train.schema.json.

Paths (the schema's keys with `"format": "path"`) written in a config file resolve against that
file's directory; paths from command-line overrides, Python-built configs and defaults resolve against
the working directory. The resolved config holds them absolute.

The resolved config is a plain nested dict in which every key of the schema is present with its
default filled in, except the recipe sections: only the section of the selected recipe exists
(`cfg["grpo"]` under `recipe: grpo`; `cfg.get("ppo")` is None there). That keeps the resolved
config valid against the schema, which allows a recipe section only under its own recipe, so a
run's saved `config.yaml` can be loaded again as it is.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import importlib
import json
import math
import os
import re
from collections.abc import Collection
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from jsonschema import Draft202012Validator, ValidationError
from jsonschema.exceptions import best_match

from framework import yaml12
from framework.durable import replace_file
from framework.errors import ConfigError, FwError, Problem
from framework.imports import SEARCH_PATHS, add_search_paths, check_init_args, import_object
from framework.jsonl import NotUtf8, decode_utf8
from framework.yaml12 import Located, Mark

SCHEMA_FILE = "train.schema.json"
MODELINE = "# yaml-language-server: $schema="
MAX_PROBLEMS = 50  # reported; the rest are counted in one more line
MAX_SHOWN = 100   # characters of a wrong string value that a message quotes
# Built-in names that are checked against a registry at validation time, unless a class_path is set too (which
# the schema refuses: one line for it is enough).
_REGISTRIES = {("reward", "name"): ("framework.rewards", "REWARDS"),
               ("data", "task", "name"): ("framework.tasks", "TASKS")}


# ------------------------------------------------------------------------------------------ the schema

def schema_path() -> Path:
    """The schema file shipped in the package (in a source checkout, a link to schemas/train.schema.json)."""
    return Path(str(resources.files("framework") / SCHEMA_FILE))


def schema_text() -> str:
    return schema_path().read_text(encoding="utf-8")


@functools.cache
def _schema() -> dict:
    return json.loads(schema_text())  # read-only inside this module


@functools.cache
def _validator() -> Draft202012Validator:
    return Draft202012Validator(_schema())


def recipe_sections() -> tuple[str, ...]:
    """The built-in recipe names, which are also the names of their config sections."""
    return tuple(_schema()["properties"]["recipe"]["anyOf"][0]["enum"])


@functools.cache
def path_keys() -> tuple[tuple[str, ...], ...]:
    """The key paths whose values are filesystem paths (`"format": "path"` in the schema)."""
    def walk(node: dict, prefix: tuple) -> list[tuple]:
        out = []
        for key, sub in node.get("properties", {}).items():
            out += [prefix + (key,)] if sub.get("format") == "path" else walk(sub, prefix + (key,))
        return out
    return tuple(walk(_schema(), ()))


def _class_path_pattern() -> str:
    return _schema()["properties"]["callbacks"]["items"]["properties"]["class_path"]["pattern"]


# ------------------------------------------------------------------------------------------ helpers

_dotted = yaml12.dotted_path


def _locate(marks: dict, path: tuple, key: bool, fallback: Mark) -> Mark:
    """The mark of `path` (its key's when `key` and there is one), else of its nearest written parent."""
    for n in range(len(path), -1, -1):
        located = marks.get(path[:n])
        if located is not None:
            if key and n == len(path) and located.key is not None:
                return located.key
            return located.value
    return fallback


def _names(message: str, key: Any) -> bool:
    """Whether `message` names `key` as a word of its own, not as part of another name, a dotted path or a file's."""
    return re.search(rf"(?<![\w./-]){re.escape(str(key))}(?![\w/-]|\.\w)", message) is not None


def _init_args_mark(marks: dict, path: tuple, init_args: Any, message: str, keys: Collection | None,
                    fallback: Mark) -> Mark:
    """Where a problem with the init_args at `path` shows. Those a command-line override set whole: at it. Else at
    the override that set one of the keys the problem is about (`keys`, else the keys its message names), or, when
    it names none of them, at the override that set any (the value the user changed last); a problem with keys of the
    file's shows at the file's init_args, as one with no override does."""
    mapping = _locate(marks, path, False, fallback)
    if is_override(mapping) or not isinstance(init_args, dict):
        return mapping
    overridden = [k for k in init_args if path + (k,) in marks and is_override(marks[path + (k,)].value)]
    if not overridden:
        return mapping
    about = [k for k in init_args if k in keys] if keys is not None else [k for k in init_args if _names(message, k)]
    blamed = [k for k in overridden if k in about] if about else overridden
    return marks[path + (blamed[0],)].value if blamed else mapping


def _suggest(word: Any, choices: list) -> str:
    same_but_case = [c for c in choices if str(c).lower() == str(word).lower()]
    close = same_but_case or difflib.get_close_matches(str(word), [str(c) for c in choices], n=1, cutoff=0.6)
    return f"; did you mean '{close[0]}'?" if close else ""


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _enum_hint(value: Any, choices: list) -> str:
    """What to write instead of `value`, not one of `choices`: a number's nearest allowed numbers (a spelling
    suggestion would offer 128 for 12, quoted as if it were a string), a quoted number unquoted, else the closest
    spelling."""
    numbers = [c for c in choices if _is_number(c)]
    if isinstance(value, str) and any(str(c) == value.strip() for c in numbers):
        return f" (write it without quotes: {value.strip()})"
    if _is_number(value):
        below, above = [c for c in numbers if c < value], [c for c in numbers if c > value]
        near = ([max(below)] if below else []) + ([min(above)] if above else [])
        if near:
            return f"; the nearest allowed {'are' if len(near) > 1 else 'is'} {' and '.join(map(str, near))}"
    return _suggest(value, choices)


@functools.cache
def all_key_paths() -> tuple[tuple, ...]:
    return tuple(_key_paths(_schema()))


def _key_paths(node: dict, prefix: tuple = ()) -> list[tuple]:
    """Dotted paths of every key the schema knows (list items excluded)."""
    out = []
    for key, sub in node.get("properties", {}).items():
        out.append(prefix + (key,))
        out += _key_paths(sub, prefix + (key,))
    return out


def _unknown_key_message(key: Any, allowed: list, where: tuple, recipe: Any) -> str:
    """Unknown key: a close spelling here, else the place the key belongs, else what is allowed here."""
    message = f"unknown key '{key}'" + _suggest(key, allowed)
    if key == "<<":   # YAML 1.1's merge key
        return message + (" (YAML 1.2 has no merge key: write the keys out, or put the shared ones in a file of "
                          "their own and pass it first with another --config)")
    if message.endswith("?"):
        return message
    other_recipes = [r for r in recipe_sections() if r != recipe]
    homes = [p for p in all_key_paths() if p[-1] == key and p[:-1] != where and p[0] not in other_recipes]
    if homes:
        return message + "; it belongs in " + " or ".join(f"'{'.'.join(p[:-1]) or 'the top level'}'" for p in homes)
    return message + f" (allowed here: {', '.join(allowed)})"


def _describe(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return f"the number {value!r}"
    if isinstance(value, str):   # cut short: a text pasted under the wrong key still gives a line that can be read
        return f"the string {value if len(value) <= MAX_SHOWN else value[:MAX_SHOWN] + '…'!r}"
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    return type(value).__name__


_TYPE_WORDS = {"object": "a mapping", "array": "a list", "null": "null", "integer": "an integer",
               "number": "a number", "boolean": "true or false", "string": "a string"}


def _type_message(error: ValidationError) -> str:
    types = error.validator_value if isinstance(error.validator_value, list) else [error.validator_value]
    expected = " or ".join(_TYPE_WORDS.get(t, t) for t in types)
    msg = f"expected {expected}, got {_describe(error.instance)}"
    if error.instance is None and error.schema.get("default") == []:   # `callbacks:` with its items commented out
        return msg + " (a key with nothing after it is null: write [] for none, or remove the key)"
    return msg + _bool_hint(error.instance, "boolean" in types)


# Lightning's short precision names, and what it reads them as: the closest spelling of `bf16` (bf16-true) would
# change what trains
_PRECISION_ALIASES = {"64": "64-true", "32": "32-true", "16": "16-mixed", "bf16": "bf16-mixed"}


def _bool_hint(value: Any, wants_bool: bool) -> str:
    return yaml12.bool_hint(value) if wants_bool else ""


def _null_hint(schema: dict) -> str:
    """' (or null: what null means)' for a nullable key whose description says it (`eval.every_n_steps: 0` meant
    as 'off'), else ''."""
    types = schema.get("type")
    if not (isinstance(types, list) and "null" in types):
        return ""
    # up to the sentence's end: a '.' followed by a space or the end, or a ';' (not the '.' of 3.0 or a.b)
    m = re.search(r"`?null`? = (.+?)(?:\.(?=\s|$)|;|$)", schema.get("description") or "")
    return f" (or null: {m.group(1).strip()})" if m else ""


def _choice_text(values: list) -> str:
    return ", ".join("null" if v is None else str(v).lower() if isinstance(v, bool) else str(v) for v in values)


def _alternatives_message(error: ValidationError) -> str | None:
    """oneOf/anyOf: 'exactly one of' for branches that each require one key, else the schema's description."""
    branches = error.validator_value
    if all(isinstance(b, dict) and len(b.get("required", [])) == 1 for b in branches) \
            and isinstance(error.instance, dict):
        keys = [b["required"][0] for b in branches]
        present = [k for k in keys if error.instance.get(k) is not None]
        names = " or ".join(f"'{k}'" for k in keys)
        if not present:
            return f"set one of {names} (none is set)"
        if len(present) > 1:
            return f"set only one of {names}, not {' and '.join(repr(k) for k in present)}"
        return None  # the set key has a bad value: its own error says so
    description = error.schema.get("description")
    if description:
        return f"{_describe(error.instance)} is not allowed here: {description}"
    return best_match(error.context).message if error.context else error.message


def _where_set(marks: dict, path: tuple) -> str:
    """Where the key at `path` was set: `FILE:LINE`, the override's label, or 'the default'."""
    located = marks.get(path)
    if located is None:
        return "the default"
    m = located.key or located.value
    return m.file if m.line is None else f"{m.file}:{m.line}"


def _sources_message(path: tuple, keys: list, instance: dict, marks: dict, shown: str) -> str | None:
    """'set only one of' two keys that different files or overrides set (merged, the later ones win): which key is
    set where the problem shows (`shown`, a file or an override), where the other was set and the override that
    clears it. None when all of them are set where it shows, whose lines say it, or when none has a place (a config
    built in Python), where no file, line or override is there to name."""
    present = [k for k in keys if instance.get(k) is not None]
    if not any(path + (k,) in marks for k in present):
        return None
    here = [k for k in present if path + (k,) in marks and marks[path + (k,)].value.file == shown]
    if len(here) == len(present):
        return None
    others = [k for k in present if k not in here]
    parts = [f"{k} is set here" for k in here]
    parts += [f"{k}: {yaml12.inline(instance[k])} at {_where_set(marks, path + (k,))}" for k in others]
    cleared = others if here else others[:-1]   # none set here: keep the one listed last
    fix = " ".join(f"--{_dotted(path + (k,))}=null" for k in cleared)
    names = " or ".join(f"'{k}'" for k in keys)
    return f"set only one of {names}: {' and '.join(parts)}; give {fix} (or remove one)"


def _problems_for(error: ValidationError, marks: dict, fallback: Mark, recipe: Any) -> list[Problem]:
    path = tuple(error.absolute_path)
    v = error.validator

    def at(p: tuple, message: str, key: bool = False, shown: str | None = None) -> Problem:
        # a problem with a whole mapping or list is shown at its key, where the block starts
        key = key or (p == path and isinstance(error.instance, (dict, list)))
        m = _locate(marks, p, key, fallback)
        return Problem(m.file, m.line, m.col, shown or _dotted(p), message)

    if v == "additionalProperties":
        allowed = list(error.schema.get("properties", {}))
        extra = [k for k in error.instance if k not in allowed]
        written = [yaml12.key_text(k) for k in extra]
        # suggestions cost a search over the schema each: only for the keys that will be shown
        return [at(path + (k,), _unknown_key_message(w, allowed, path, recipe) if i < MAX_PROBLEMS
                   else f"unknown key '{w}'", key=True, shown=_dotted(path + (w,)))
                for i, (k, w) in enumerate(zip(extra, written, strict=True))]
    if v == "required":
        return [at(path + (k,), f"missing required key '{k}'") for k in error.validator_value
                if isinstance(error.instance, dict) and k not in error.instance]
    if v == "type":
        return [at(path, _type_message(error))]
    if v == "enum":
        choices = error.validator_value
        alias = _PRECISION_ALIASES.get(str(error.instance)) if path == ("trainer", "precision") else None
        hint = f"; did you mean '{alias}', which Lightning's {error.instance!r} stands for?" if alias else ""
        hint = hint or _bool_hint(error.instance, True in choices) or _enum_hint(error.instance, choices)
        return [at(path, f"expected one of {_choice_text(choices)}; got {_describe(error.instance)}" + hint)]
    if v == "not" and error.schema.get("description"):
        return [at(path, f"{error.schema['description'].rstrip('.')} (this config has recipe: {recipe})", key=True)]
    if v in ("oneOf", "anyOf"):
        message = _alternatives_message(error)
        if not message:
            return []
        # two keys of which one may be set: shown at the one an override set, the value changed last
        keys = [k for b in error.validator_value if isinstance(b, dict) for k in b.get("required", [])[:1]]
        chosen = [path + (k,) for k in keys if isinstance(error.instance, dict) and k in error.instance
                  and path + (k,) in marks and is_override(marks[path + (k,)].value)]
        if not message.startswith("set only one"):
            return [at(path, message)]
        problem = at(chosen[0], message) if chosen else at(path, message)
        sources = _sources_message(path, keys, error.instance, marks, problem.file)
        return [dataclasses.replace(problem, message=sources) if sources else problem]
    if v == "pattern" and path and path[-1] == "class_path":
        return [at(path, f"{_describe(error.instance)} is not a dotted import path like 'package.module.Class'")]
    if v in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
        op = {"minimum": ">=", "maximum": "<=", "exclusiveMinimum": ">", "exclusiveMaximum": "<"}[v]
        return [at(path, f"must be {op} {error.validator_value}, got {error.instance!r}" + _null_hint(error.schema))]
    if v == "minLength" and error.validator_value == 1:
        return [at(path, "must not be empty")]
    if v in ("minItems", "maxItems"):
        word = "at least" if v == "minItems" else "at most"
        return [at(path, f"needs {word} {error.validator_value} item(s), got {len(error.instance)}")]
    return [at(path, error.message)]


def _check_class_paths(data: Any, marks: dict, fallback: Mark, path: tuple = (),
                       sections: Collection[str] | None = None) -> list[Problem]:
    """Import every `class_path` written in the config (under the top-level `sections`, None: all); check its
    `init_args` names against the signature."""
    problems: list[Problem] = []
    if isinstance(data, list):
        for i, item in enumerate(data):
            problems += _check_class_paths(item, marks, fallback, path + (i,))
        return problems
    if not isinstance(data, dict):
        return problems
    class_path = data.get("class_path")
    if isinstance(class_path, str) and re.match(_class_path_pattern(), class_path):
        where = path + ("class_path",)
        try:
            target = import_object(class_path)
            init_args = data.get("init_args")
            if isinstance(init_args, dict) and callable(target):
                where = path + ("init_args",)
                check_init_args(target, init_args, class_path)
        except FwError as e:
            m = _init_args_mark(marks, where, data.get("init_args"), str(e), getattr(e, "keys", None), fallback) \
                if where[-1] == "init_args" else _locate(marks, where, False, fallback)
            problems.append(Problem(m.file, m.line, m.col, _dotted(where), str(e)))
    for key, value in data.items():
        if path == () and sections is not None and key not in sections:
            continue
        if key != "init_args":  # what init_args holds belongs to the user's class
            problems += _check_class_paths(value, marks, fallback, path + (key,))
    return problems


def _get(data: Any, path: tuple) -> Any:
    for p in path:
        if isinstance(data, list) and isinstance(p, int) and 0 <= p < len(data):
            data = data[p]
        elif not isinstance(data, dict):
            return None
        else:
            data = data.get(p)
    return data


def _check_registry_names(data: dict, marks: dict, fallback: Mark) -> list[Problem]:
    """Built-in reward / task names must exist."""
    problems = []
    for path, (module_name, attr) in _REGISTRIES.items():
        name = _get(data, path)
        if not isinstance(name, str) or not name or _get(data, path[:-1] + ("class_path",)):
            continue   # an empty name is the schema's to report
        registry = getattr(importlib.import_module(module_name), attr)
        if name not in registry:
            m = _locate(marks, path, False, fallback)
            problems.append(Problem(m.file, m.line, m.col, _dotted(path),
                                    f"unknown built-in '{name}' (built-ins: {', '.join(sorted(registry))})"
                                    + _suggest(name, list(registry))))
    return problems


def _check_recipe(data: dict, marks: dict, fallback: Mark) -> list[Problem]:
    """`recipe` must name an installed recipe that imports (the schema checks only its form)."""
    from framework.recipe import installed_recipes, recipe_class

    name = data.get("recipe")
    if not isinstance(name, str):
        return []   # the schema has reported it
    m = _locate(marks, ("recipe",), False, fallback)
    try:
        installed = installed_recipes()
        if name in installed:
            recipe_class(name)
            return []
    except FwError as e:
        return [Problem(m.file, m.line, m.col, "recipe", str(e).removeprefix("recipe: "))]
    # built-ins first, in the schema's order, then the others installed
    names = [r for r in recipe_sections() if r in installed] + sorted(set(installed) - set(recipe_sections()))
    if not names:
        return [Problem(m.file, m.line, m.col, "recipe", "no recipes are installed: install fw (pip install -e .)")]
    return [Problem(m.file, m.line, m.col, "recipe", f"expected one of {', '.join(names)}; got the string "
                    f"'{name}'" + _suggest(name, names))]


def _check_finite(data: Any, marks: dict, fallback: Mark, path: tuple = ()) -> list[Problem]:
    """NaN and infinities pass every `minimum` / `maximum` of the schema; no fw key takes them."""
    if isinstance(data, float) and not math.isfinite(data):
        m = _locate(marks, path, False, fallback)
        return [Problem(m.file, m.line, m.col, _dotted(path), f"must be a finite number, got {data!r}")]
    problems: list[Problem] = []
    items = data.items() if isinstance(data, dict) else enumerate(data) if isinstance(data, list) else ()
    for key, value in items:
        if key != "init_args":  # what init_args holds belongs to the user's class
            problems += _check_finite(value, marks, fallback, path + (key,))
    return problems


def _recipe_unknown(recipe: Any) -> bool:
    """Whether `recipe` is reported as no recipe at all: not a string, or a name no package installs."""
    from framework.recipe import installed_recipes

    if not isinstance(recipe, str):
        return True
    try:
        return recipe not in installed_recipes()
    except FwError:
        return False   # _check_recipe reports the broken installation; the recipe may well be right


_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")


def _superseded(error: ValidationError, failed: set) -> bool:
    """Whether `error` repeats another problem of the same value, `failed` being what that value failed: one line
    a key. A value of the wrong type fails a key's choices (`block_size: 12.5`), which say what it takes better
    than its type, and its bounds (`group_size: 1.5`), which an integer's type says first."""
    if error.validator == "type":
        return "enum" in failed
    return error.validator in _BOUNDS and "type" in failed


def _validate(data: Any, marks: dict, fallback: Mark, imports: Collection[str] | None = None) -> list[Problem]:
    recipe = data.get("recipe") if isinstance(data, dict) else None
    # under a misspelt recipe (`GRPO`) the right section would be reported as not allowed with it
    sections_unjudged = isinstance(data, dict) and "recipe" in data and _recipe_unknown(recipe)
    problems: list[Problem] = _check_finite(data, marks, fallback)
    errors = list(_validator().iter_errors(data))
    failed: dict[tuple, set] = {}   # what each key's value failed, by the key's schema
    for error in errors:
        failed.setdefault((tuple(error.absolute_path), id(error.schema)), set()).add(error.validator)
    for error in errors:
        if _superseded(error, failed[(tuple(error.absolute_path), id(error.schema))]):
            continue
        if tuple(error.absolute_path) == ("recipe",) and error.validator == "anyOf":
            continue   # a string that names no recipe: _check_recipe says which ones are installed
        if sections_unjudged and error.validator == "not" and len(error.absolute_path) == 1 \
                and error.absolute_path[0] in recipe_sections():
            continue   # the recipe's own problem is reported; which sections it allows is moot
        if isinstance(error.instance, float) and not math.isfinite(error.instance):
            continue   # _check_finite has said it
        problems += _problems_for(error, marks, fallback, recipe)
    if isinstance(data, dict):
        problems += _check_class_paths(data, marks, fallback, sections=imports)
        problems += _check_registry_names(data, marks, fallback)
        problems += _check_recipe(data, marks, fallback)
    return problems


# ------------------------------------------------------------------------------------------ defaults

def _types(sub: dict) -> list:
    t = sub.get("type", [])
    return t if isinstance(t, list) else [t]


def _fill(sub: dict, value: Any, recipe: Any, top: bool = False) -> Any:
    """`value` with the defaults filled in below it; integral floats become ints for integer keys, also in the
    anyOf / oneOf branch the value matches."""
    if isinstance(value, float) and value.is_integer() and "integer" in _types(sub) and "number" not in _types(sub):
        return int(value)  # `max_steps: 1e3` is valid as an integer in JSON Schema; code wants an int
    if isinstance(value, list) and isinstance(sub.get("items"), dict):
        return [_fill(sub["items"], item, recipe) for item in value]
    if not isinstance(value, dict):
        # `devices: 1.0` matches the integer branch of `devices` and `devices: [0.0]` its list of integers
        for branch in sub.get("anyOf", []) + sub.get("oneOf", []):
            if Draft202012Validator(branch).is_valid(value):
                return _fill(branch, value, recipe)
    if not isinstance(value, dict) or "properties" not in sub:
        return value
    out = {}  # keys in schema order, so printed configs read like the reference
    for key, prop in sub["properties"].items():
        if top and key in recipe_sections() and key != recipe:
            continue
        if key in value:
            out[key] = _fill(prop, value[key], recipe)
        elif "default" in prop:
            out[key] = _fill(prop, copy.deepcopy(prop["default"]), recipe)
        elif "properties" in prop:
            out[key] = _fill(prop, {}, recipe)
    out.update({k: v for k, v in value.items() if k not in out})  # free-form keys (validated already)
    return out


def defaults(recipe: str) -> dict:
    """Every default of the schema for `recipe` (required keys without a default stay absent)."""
    return _fill(_schema(), {"recipe": recipe}, recipe, top=True)


# ------------------------------------------------------------------------------------------ merging

def _merge(base: Any, new: Any, marks: dict, new_marks: dict) -> Any:
    """Mappings merge key by key; anything else (lists too) replaces, taking its marks along."""
    replaced: set[tuple] = set()
    merged = _merge_into(base, new, (), replaced, marks, new_marks)
    _replace_marks(marks, new_marks, replaced)
    return merged


def _merge_into(base: Any, new: Any, path: tuple, replaced: set, marks: dict, new_marks: dict) -> Any:
    if isinstance(base, dict) and isinstance(new, dict):
        for key, value in new.items():
            if key in base:
                base[key] = _merge_into(base[key], value, path + (key,), replaced, marks, new_marks)
            else:
                base[key] = value
                replaced.add(path + (key,))
        if path in new_marks:
            marks[path] = new_marks[path]
        return base
    replaced.add(path)
    return new


def _replace_marks(marks: dict, new_marks: dict, prefixes: set[tuple]) -> None:
    """Marks under each prefix come from `new_marks`; one pass over each dict (depth is bounded)."""
    def under(p: tuple) -> bool:
        return any(p[:n] in prefixes for n in range(len(p) + 1))
    for p in [p for p in marks if under(p)]:
        del marks[p]
    marks.update({p: m for p, m in new_marks.items() if under(p)})


def _read_file(path: str, later: bool = False) -> tuple[Any, dict, list[Problem]]:
    """A config file's data and marks, or its problems. `later`: a file merged over earlier ones, which need not
    hold recipe and model."""
    if not os.path.exists(path):
        return None, {}, [Problem(path, None, None, "", "config file not found")]
    if os.path.isdir(path):
        return None, {}, [Problem(path, None, None, "", "is a directory, expected a YAML config file")]
    try:
        text = decode_utf8(Path(path).read_bytes(), path)
    except OSError as e:
        return None, {}, [Problem(path, None, None, "", f"cannot read the config file: {e}")]
    except NotUtf8 as e:
        return None, {}, [Problem(path, e.line, e.col, "", e.reason)]
    try:
        data, marks = yaml12.load_with_marks(text, path)
    except ConfigError as e:
        return None, {}, e.problems
    if data is None:
        fix = ("a later --config is merged over the earlier ones: give it a key to change, or leave it out" if later
               else "expected a mapping with at least 'recipe' and 'model'")
        return None, {}, [Problem(path, 1, 1, "", f"the config file is empty; {fix}")]
    if not isinstance(data, dict):
        m = marks[()].value
        return None, {}, [Problem(path, m.line, m.col, "", f"the top level must be a mapping of sections "
                                                           f"(key: value lines), got {_describe(data)}")]
    return data, marks, []


# ------------------------------------------------------------------------------------------ overrides

def _holds_mapping(sub: dict) -> bool:
    """Whether a key with schema `sub` can take a mapping (a section, or a free-form one like init_args)."""
    if "properties" in sub or "object" in _types(sub):
        return True
    if "type" in sub:
        return False
    if "enum" in sub or "const" in sub:
        return any(isinstance(v, dict) for v in sub.get("enum", [sub.get("const")]))
    branches = sub.get("anyOf", []) + sub.get("oneOf", [])
    return not branches or any(_holds_mapping(b) for b in branches)


def _expected_words(sub: dict) -> str:
    """What a key with schema `sub` takes, in words: 'an integer', 'a string or null', 'a choice (one of a, b)'."""
    if "type" in sub:
        return " or ".join(_TYPE_WORDS.get(t, t) for t in _types(sub))
    if "enum" in sub:  # the parentheses keep the choices apart from the rest of a sentence
        return f"a choice (one of {_choice_text(sub['enum'])})"
    if "const" in sub:
        return _choice_text([sub["const"]])
    branches = sub.get("anyOf", []) + sub.get("oneOf", [])
    return " or ".join(_expected_words(b) for b in branches) if branches else "a value"


def _schema_at(keys: list[str], recipe: Any = None) -> tuple[dict | None, str | None]:
    """(subschema at `keys` or None when inside a free-form mapping, error text for a key that cannot be there)."""
    sub: dict | None = _schema()
    for i, key in enumerate(keys):
        props = sub.get("properties")
        if props is None:
            if not _holds_mapping(sub) and "array" not in _types(sub):
                # a key below a scalar: the override is at fault, not the file that sets the scalar
                return None, f"{'.'.join(keys[:i])} is {_expected_words(sub)}, not a section"
            return None, None  # free-form, or a list: _apply_override says it cannot reach inside a list
        if key not in props:
            if sub.get("additionalProperties") is False:
                return None, _unknown_key_message(key, list(props), tuple(keys[:i]), recipe)
            return None, None
        sub = props[key]
    return sub, None


_OVERRIDE = "override "   # the marks of the keys an override sets name it as their file: override '--a.b=v'


def key_schema(dotted: str) -> dict:
    """The schema of one key (`seed`, `rollout.temperature`): its type, bounds and description."""
    sub, wrong = _schema_at(dotted.split("."))
    if sub is None:
        raise KeyError(f"{dotted}: {wrong or 'not a key of the schema'}")
    return sub


def override_label(arg: str) -> str:
    """The name under which the problems of command-line override `arg` (`--a.b=v`) are shown, as a file's."""
    return f"{_OVERRIDE}'{arg}'"


def is_override(mark: Mark) -> bool:
    """Whether `mark` is where a command-line override (not a config file) set a key."""
    return mark.line is None and mark.file.startswith(_OVERRIDE)


def _apply_override(data: dict, marks: dict, arg: str) -> list[Problem]:
    label = override_label(arg)
    text = arg.removeprefix("--")
    key, sep, raw = text.partition("=")
    keys = key.split(".")
    if not sep or not all(k.strip() == k and k for k in keys):
        return [Problem(label, None, None, "", "malformed override: expected --key.path=value, "
                                               "e.g. --trainer.max_steps=10")]
    sub, wrong = _schema_at(keys, data.get("recipe"))
    if wrong:
        return [Problem(label, None, None, key, wrong)]
    try:
        value, ok = yaml12.parse_scalar(raw)  # not one flow value: the text itself
    except ConfigError as e:   # a key written twice in the value
        return [Problem(label, None, None, key + ("" if p.key_path.startswith("[") else ".") + p.key_path, p.message)
                for p in e.problems]
    opener = raw.lstrip()[:1]
    if not ok and opener in ("{", "["):   # as in a file, a flow collection that does not close is an error
        kind = "mapping, e.g. {preset: tiny}" if opener == "{" else "list, e.g. [a, b]"
        return [Problem(label, None, None, key, f"a value starting with '{opener}' must be one whole YAML flow {kind}; "
                                                f"got {raw!r} (quote it, '...', for a string)")]
    # a scalar only: `[a.jsonl, 5]` is a list, as in a file, and never the string that spells it, like `[3` above
    if sub is not None and not isinstance(value, (str, list, dict)) and not Draft202012Validator(sub).is_valid(value) \
            and Draft202012Validator(sub).is_valid(raw):
        value = raw  # e.g. --name=123 for a string key: typed by the schema; a quoted string ('') is what it reads as
    node = data
    for i, k in enumerate(keys[:-1]):
        child = node.get(k)
        if isinstance(child, list) or "array" in _types(_schema_at(keys[:i + 1])[0] or {}):
            return [Problem(label, None, None, key, f"cannot override inside the list '{'.'.join(keys[:i + 1])}'; "
                                                    f"set the whole list, e.g. --{'.'.join(keys[:i + 1])}=[...]")]
        if not isinstance(child, dict):
            node[k] = child = {}
        node = child
    node[keys[-1]] = value
    path = tuple(keys)
    mark = Located(Mark(label), Mark(label))
    _replace_marks(marks, {path + p: mark for p in [()] + _paths(value)}, {path})
    for n in range(1, len(path)):  # parents created by the override; written ones keep their marks
        marks.setdefault(path[:n], mark)
    return []


def _paths(value: Any, prefix: tuple = ()) -> list[tuple]:
    out = [prefix] if prefix else []
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else []
    for k, v in items:
        out += _paths(v, prefix + (k,))
    return out


# ------------------------------------------------------------------------------------------ paths

def _absolute(value: Any, base: str) -> Any:
    """`value` (a path string or a list of them) made absolute against `base`; other values as they are."""
    if isinstance(value, str) and value:
        return os.path.abspath(os.path.join(base, os.path.expanduser(value)))
    if isinstance(value, list):
        return [_absolute(v, base) for v in value]
    return value


def _resolve_paths(data: Any, base: str) -> None:
    """Make the path keys of `data` absolute against `base`, in place."""
    for keys in path_keys():
        node = _get(data, keys[:-1])
        if isinstance(node, dict) and keys[-1] in node:
            node[keys[-1]] = _absolute(node[keys[-1]], base)


# ------------------------------------------------------------------------------------------ public API

def _sorted_problems(problems: list[Problem], order: dict) -> list[Problem]:
    unique = list(dict.fromkeys(problems))
    files = dict(order)   # the config files, then the files they name (data files) in the order they were checked
    for p in unique:
        files.setdefault(p.file, len(files))
    # a problem without a line (a file's summary) after the file's rows
    unique.sort(key=lambda p: (files[p.file], p.line is None, p.line or 0, p.col or 0))
    if len(unique) > MAX_PROBLEMS:
        last = unique[MAX_PROBLEMS - 1]
        unique = unique[:MAX_PROBLEMS] + [Problem(last.file, None, None, "", f"{len(unique) - MAX_PROBLEMS} "
                                                  "more problems not shown; fix these first")]
    return unique


def _finish(data: Any, marks: dict, fallback: Mark, problems: list[Problem], order: dict,
            imports: Collection[str] | None = None) -> dict:
    problems = problems + _validate(data, marks, fallback, imports)
    if problems:
        raise ConfigError(_sorted_problems(problems, order))
    cfg = _fill(_schema(), data, data["recipe"], top=True)
    _resolve_paths(cfg, os.getcwd())   # overrides and defaults; paths from files are absolute already
    return cfg


@dataclass
class LocatedConfig:
    """A resolved config with the position of every key written in its files or overrides."""

    cfg: dict
    marks: dict
    fallback: Mark
    order: dict

    def problem(self, path: tuple, message: str, key: bool = False, keys: Collection | None = None) -> Problem:
        """A problem with `path`, shown where it (or its nearest written parent) was written; one with a class's
        init_args (about their `keys`, when known) at the override that set the key it is about, if one did."""
        if path and path[-1] == "init_args" and not key:
            m = _init_args_mark(self.marks, path, _get(self.cfg, path), message, keys, self.fallback)
        else:
            m = _locate(self.marks, path, key, self.fallback)
        return Problem(m.file, m.line, m.col, _dotted(path), message)

    def error(self, problems: list[Problem]) -> ConfigError:
        return ConfigError(_sorted_problems(problems, self.order))


def load_located(paths: list[str], overrides: list[str] | None = None, *,
                 imports: Collection[str] | None = None) -> LocatedConfig:
    """`load_config`, keeping the positions for checks that come after the schema's (framework/validate.py)."""
    if not paths:
        raise FwError("no config file given: pass --config FILE")
    if imports is None or imports:
        # class_path modules next to a config or in the working directory import also under the console script;
        # a read that imports none (a checkpoint's config.yaml, compared at a resume) leaves the directories, which
        # a run records, as they are
        add_search_paths([os.getcwd(), *(os.path.dirname(os.path.abspath(p)) for p in paths)])
        add_search_paths([d for p in paths for d in _recorded_search_paths(p)])
    data: dict = {}
    marks: dict = {}
    problems: list[Problem] = []
    for i, path in enumerate(paths):
        new, new_marks, file_problems = _read_file(path, later=i > 0)
        problems += file_problems
        if new is not None and not problems:  # after a broken file, merging further files explains nothing
            _resolve_paths(new, os.path.dirname(os.path.abspath(path)))
            new_marks = dict(new_marks)
            new_marks.pop((), None)
            data = _merge(data, new, marks, new_marks)
            marks[()] = Located(Mark(path, 1, 1))
    if problems:
        raise ConfigError(problems)
    order = {p: i for i, p in enumerate(paths)}
    for i, arg in enumerate(overrides or []):
        order[override_label(arg)] = len(paths) + i
        problems += _apply_override(data, marks, arg)
    fallback = marks[()].value if () in marks else Mark(paths[-1])
    return LocatedConfig(_finish(data, marks, fallback, problems, order, imports), marks, fallback, order)


def load_config(paths: list[str], overrides: list[str] | None = None, *,
                imports: Collection[str] | None = None) -> dict:
    """Read YAML files (merged left to right), apply `--key.path=value` overrides, validate, fill defaults.
    `imports`: the top-level sections whose `class_path` modules are imported and checked (None: every one); a
    command that never builds a section's objects leaves it out, so a module it does not use cannot stop it.

    Raises ConfigError listing every problem as `FILE:LINE:COL: key.path: message`.
    """
    return load_located(paths, overrides, imports=imports).cfg


def resolve(d: dict) -> dict:
    """Validate a config built in Python and return a deep copy with every default filled in."""
    if not isinstance(d, dict):
        raise ConfigError([Problem("<config>", None, None, "", f"expected a mapping, got {_describe(d)}")])
    return _finish(copy.deepcopy(d), {}, Mark("<config>"), [], {})


def uses_cuda(trainer: dict) -> bool:
    """Whether the `trainer:` section runs the job on CUDA GPUs: accelerator gpu or cuda, or auto where torch sees
    one."""
    import torch

    accelerator = trainer["accelerator"]
    return accelerator in ("gpu", "cuda") or (accelerator == "auto" and torch.cuda.is_available())


def world_size(cfg: dict, backend: str | None = None) -> int:
    """Processes the job runs on: trainer.devices (auto = every GPU of this machine, one process on CPU) x
    trainer.num_nodes. `backend`: "cuda" or "cpu", default the one `uses_cuda` says the trainer runs on."""
    import torch

    if backend is None:
        backend = "cuda" if uses_cuda(cfg["trainer"]) else "cpu"
    devices = cfg["trainer"]["devices"]
    if isinstance(devices, list):
        n = len(devices)
    elif devices in ("auto", -1):
        n = max(torch.cuda.device_count(), 1) if backend == "cuda" else 1
    else:
        n = int(devices)
    return n * cfg["trainer"]["num_nodes"]


def dump_config(cfg: dict) -> str:
    """The config as YAML 1.2 text (what `fw print-config` shows)."""
    return yaml12.dump(cfg)


SEARCH_PATHS_LINE = "# fw: class_path modules also import from: "
RESOLVED_LINE = "# Resolved by fw: every default filled in.\n"   # the mark of a config.yaml that fw wrote


def _recorded_search_paths(path: str) -> list[str]:
    """The directories a resolved config.yaml records on its `SEARCH_PATHS_LINE` (none for another file)."""
    try:
        with open(path, encoding="utf-8") as f:
            head = [f.readline() for _ in range(3)]
    except (OSError, UnicodeDecodeError):
        return []   # _read_file reports it
    for line in head:
        if line.startswith(SEARCH_PATHS_LINE):
            try:
                dirs = json.loads(line[len(SEARCH_PATHS_LINE):])
            except ValueError:
                return []
            return [d for d in dirs if isinstance(d, str)] if isinstance(dirs, list) else []
    return []


def written_by_fw(path: str | os.PathLike) -> bool:
    """Whether the config file `path` is one that `save_resolved` wrote (`RESOLVED_LINE` heads it, below the
    modeline)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return RESOLVED_LINE in [f.readline() for _ in range(3)]
    except OSError:
        return False


def save_resolved(cfg: dict, path: str | os.PathLike) -> None:
    """Write `cfg` as YAML with the schema modeline, atomically (a temp file renamed into place); the directories
    class_path modules were imported from in this process are recorded for the commands that read it back."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    schema_ref = os.path.relpath(os.path.realpath(schema_path()), os.path.realpath(path.parent))
    searched = f"{SEARCH_PATHS_LINE}{json.dumps(SEARCH_PATHS)}\n" if SEARCH_PATHS else ""
    text = f"{MODELINE}{Path(schema_ref).as_posix()}\n" + RESOLVED_LINE + searched + dump_config(cfg)
    replace_file(path, text)
