"""The schema itself, the files that point editors at it, and the copy shipped inside the package."""

import ast
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from jsonschema import Draft202012Validator

from framework.config import defaults, load_config, schema_path

ROOT = Path(__file__).resolve().parents[1]
SCHEMA_FILE = ROOT / "schemas" / "train.schema.json"
SCHEMA = json.loads(SCHEMA_FILE.read_text())
VALIDATOR = Draft202012Validator(SCHEMA)
RECIPES = ["sft", "grpo", "ppo"]
NO_DEFAULT = {("recipe",), ("callbacks", "[]", "class_path"),   # must be written by the user
              ("logging", "loggers", "[]", "class_path")}


def properties(node: dict, path: tuple = ()):
    """Every (path, subschema) of the property tree; list items appear as '[]'."""
    for key, sub in node.get("properties", {}).items():
        yield path + (key,), sub
        yield from properties(sub, path + (key,))
        if isinstance(sub.get("items"), dict):
            yield from properties(sub["items"], path + (key, "[]"))


PROPS = list(properties(SCHEMA))


def test_schema_is_valid_draft_2020_12():
    assert SCHEMA["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    Draft202012Validator.check_schema(SCHEMA)


def test_top_level_sections():
    assert list(SCHEMA["properties"]) == ["recipe", "seed", "name", "run_dir", "model", "tokenizer", "data",
                                          "rollout", "reward", "sft", "grpo", "ppo", "optimizer", "scheduler",
                                          "trainer", "checkpoint", "eval", "logging",
                                          "callbacks"]
    assert SCHEMA["required"] == ["recipe", "model"]


@pytest.mark.parametrize("path,sub", PROPS, ids=[".".join(p) for p, _ in PROPS])
def test_every_key_is_documented_and_has_a_valid_default(path, sub):
    assert sub.get("description") and sub.get("markdownDescription")
    if "properties" in sub:
        assert sub.get("additionalProperties") is False, "mappings with known keys reject unknown ones"
    elif path not in NO_DEFAULT:
        assert "default" in sub
        assert Draft202012Validator(sub).is_valid(sub["default"]), f"default {sub['default']!r} fails its own schema"
    if "enum" in sub:
        assert len(sub.get("enumDescriptions", [])) == len(sub["enum"])
        if "default" in sub:
            assert sub["default"] in sub["enum"]


# Code defaults that share a schema key's name and default but not its meaning: the values that turn a sampling
# filter off, the seed of a task or a generate call built without a config (fw always passes one), the flag of a
# tokenizer method that stands in for Hugging Face's (fw always passes it), and whitening's epsilon.
_TASK_CLASSES = ("Task", "Digits", "Arithmetic", "Countdown", "JsonlPrompts")
OTHER_CONCEPTS = {
    *(("framework/rollout/sampling.py", "SamplingParams", key) for key in ("top_k", "top_p", "min_p", "stop")),
    *(("framework/tasks.py", f"{task}.__init__", "seed") for task in _TASK_CLASSES),
    ("framework/rollout/engine.py", "RolloutEngine.generate", "seed"),
    ("framework/rollout/engine.py", "generate", "seed"),
    ("framework/tokenizer.py", "Tokenizer.apply_chat_template", "enable_thinking"),
    ("recipes/advantages.py", "whiten", "eps"),
}


def _literal(node: ast.AST):
    """The value of a literal default (tuples as lists, as the schema writes them), else None."""
    try:
        value = ast.literal_eval(node)
    except ValueError:
        return None
    return list(value) if isinstance(value, tuple) else value


def _same(a, b) -> bool:
    return a == b and isinstance(a, bool) == isinstance(b, bool) and isinstance(a, str) == isinstance(b, str)


def repeated_defaults(path: Path) -> list[tuple[str, str, object]]:
    """(owner, key, value) of each parameter, class field or `.get(key, value)` of `path` named as a schema key and
    defaulting to a non-null default of that key (owner: the enclosing function or class, dotted)."""
    by_name: dict[str, list] = {}
    for p, sub in PROPS:
        if sub.get("default") is not None:
            by_name.setdefault(p[-1], []).append(sub["default"])
    found = []

    def check(owner: str, key: object, node: ast.AST) -> None:
        value = _literal(node)
        if isinstance(key, str) and value is not None and any(_same(value, d) for d in by_name.get(key, [])):
            found.append((owner, key, value))

    def visit(node: ast.AST, owner: str) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            owner = f"{owner}.{node.name}" if owner else node.name
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = node.args
            positional = a.posonlyargs + a.args
            for arg, default in zip(positional[len(positional) - len(a.defaults):], a.defaults):
                check(owner, arg.arg, default)
            for arg, default in zip(a.kwonlyargs, a.kw_defaults):
                if default is not None:
                    check(owner, arg.arg, default)
        if isinstance(node, ast.ClassDef):
            for field in node.body:
                if isinstance(field, ast.AnnAssign) and isinstance(field.target, ast.Name) and field.value:
                    check(owner, field.target.id, field.value)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" \
                and len(node.args) == 2 and isinstance(node.args[0], ast.Constant):
            check(owner, node.args[0].value, node.args[1])
        for child in ast.iter_child_nodes(node):
            visit(child, owner)

    visit(ast.parse(path.read_text()), "")
    return found


def test_code_takes_defaults_from_the_schema_and_never_repeats_them():
    """DESIGN.md: a key's default lives in the schema only. A parameter, field or `.get` named as a key and defaulting
    to its value is a second copy, which drifts when the schema changes: read the resolved config instead (or
    `framework.config.defaults` where there is no config)."""
    repeats = [(path.relative_to(ROOT).as_posix(), owner, key, value)
               for package in ("framework", "recipes", "examples") for path in sorted((ROOT / package).rglob("*.py"))
               for owner, key, value in repeated_defaults(path)]
    assert [r for r in repeats if r[:3] not in OTHER_CONCEPTS] == []
    assert {r[:3] for r in repeats} == OTHER_CONCEPTS   # an exception that is gone leaves this list


def test_the_check_for_repeated_defaults_sees_each_form(tmp_path):
    """A field, a positional and a keyword-only parameter and a `.get`; not another value, a bool for 1, or null."""
    code = tmp_path / "code.py"
    code.write_text("class Loss:\n    loss_agg: str = 'token-mean'\n    clip: float = 0.3\n\n"
                    "def build(cfg, seed=0, *, top_p=1, shuffle=1, name=None):\n"
                    "    return cfg['data'].get('max_seq_len', 512), cfg.get('batch_size', 9)\n")
    assert repeated_defaults(code) == [("Loss", "loss_agg", "token-mean"), ("build", "seed", 0),
                                       ("build", "top_p", 1), ("build", "max_seq_len", 512)]


@pytest.mark.parametrize("recipe", RECIPES)
def test_the_defaults_validate_against_the_schema(recipe):
    cfg = defaults(recipe)
    assert not VALIDATOR.is_valid(cfg)  # a policy is still missing: nothing else is
    cfg["model"]["policy"]["preset"] = "tiny"
    assert list(VALIDATOR.iter_errors(cfg)) == []
    assert [s for s in RECIPES if s in cfg] == [recipe]


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("section", RECIPES)
def test_recipe_sections_only_under_their_recipe(recipe, section):
    cfg = {"recipe": recipe, "model": {"policy": {"preset": "tiny"}}, section: {}}
    assert VALIDATOR.is_valid(cfg) == (recipe == section)


@pytest.mark.parametrize("policy,ok", [
    ({"preset": "tiny"}, True), ({"path": "/m"}, True), ({"path": "/m", "preset": None}, True),
    ({"path": None, "preset": "small"}, True), ({}, False), ({"path": None, "preset": None}, False),
    ({"path": "/m", "preset": "tiny"}, False), ({"preset": "qwen3-0.5b"}, False), ({"preset": "qwen3-8b"}, True),
])
def test_policy_needs_exactly_one_of_path_and_preset(policy, ok):
    assert VALIDATOR.is_valid({"recipe": "sft", "model": {"policy": policy}}) == ok


@pytest.mark.parametrize("spec,ok", [
    ({"name": "arithmetic"}, True), ({"class_path": "pkg.mod.Task", "init_args": {"n": 1}}, True), (None, True),
    ({"name": "arithmetic", "class_path": "pkg.mod.Task"}, False), ({"init_args": {}}, False),
    ({"class_path": "NoDots"}, False), ({"name": "x", "other": 1}, False),
])
def test_task_is_a_name_or_a_class_path(spec, ok):
    cfg = {"recipe": "grpo", "model": {"policy": {"preset": "tiny"}}, "data": {"task": spec}}
    assert VALIDATOR.is_valid(cfg) == ok


@pytest.mark.parametrize("item,ok", [
    ({"class_path": "a.B"}, True), ({"class_path": "a.b.C", "init_args": {"x": [1]}}, True),
    ({"init_args": {}}, False), ({"class_path": "a.B", "args": {}}, False), ("a.B", False),
])
def test_callbacks_items(item, ok):
    assert VALIDATOR.is_valid({"recipe": "sft", "model": {"policy": {"preset": "tiny"}}, "callbacks": [item]}) == ok


def test_packaged_schema_is_the_same_file():
    packaged = schema_path()
    assert packaged.parent.name == "framework"
    assert packaged.read_bytes() == SCHEMA_FILE.read_bytes()


def _shipped_yamls() -> list[Path]:
    return sorted(ROOT.glob("train*.yaml")) + sorted((ROOT / "recipes").glob("**/*.yaml"))


@pytest.mark.parametrize("path", _shipped_yamls(), ids=lambda p: str(p.relative_to(ROOT)))
def test_shipped_yaml_has_the_modeline_and_validates(path, monkeypatch):
    first = path.read_text().splitlines()[0]
    prefix = "# yaml-language-server: $schema="
    assert first.startswith(prefix)
    assert (path.parent / first[len(prefix):]).resolve() == SCHEMA_FILE
    monkeypatch.chdir(ROOT)  # relative data paths in shipped configs are relative to the repository root
    assert load_config([str(path.relative_to(ROOT))], [])["recipe"] in RECIPES


def editor_glob(pattern: str, name: str) -> bool:
    """VS Code glob semantics: `**/` is zero or more directories, `*` stays within one."""
    regex = re.escape(pattern).replace(r"\*\*/", "(?:.*/)?").replace(r"\*", "[^/]*")
    return re.fullmatch(regex, name) is not None


def test_vscode_maps_the_configs_to_the_schema():
    settings = json.loads((ROOT / ".vscode" / "settings.json").read_text())
    ((schema_ref, globs),) = settings["yaml.schemas"].items()
    assert (ROOT / schema_ref).resolve() == SCHEMA_FILE
    for name in ["train.yaml", "train_sft.yaml", "recipes/grpo.yaml", "recipes/examples/ppo.yaml"]:
        assert any(editor_glob(g, name) for g in globs), name
    assert not any(editor_glob(g, "tests/bad_configs/empty_file.yaml") for g in globs)


def test_a_built_wheel_carries_the_schema_and_fw_schema_works_outside_the_repo(tmp_path):
    pytest.importorskip("setuptools")  # the build runs without isolation: no network needed
    src = tmp_path / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "build")
    src.mkdir()
    for name in ["pyproject.toml", "README.md"]:
        shutil.copy(ROOT / name, src / name)
    for name in ["framework", "ops_cuda", "recipes", "schemas"]:
        shutil.copytree(ROOT / name, src / name, symlinks=True, ignore=ignore)
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(wheels), str(src)], check=True, cwd=tmp_path, capture_output=True, timeout=300)
    (wheel,) = wheels.glob("fw-*.whl")
    with zipfile.ZipFile(wheel) as z:
        assert z.read("framework/train.schema.json") == SCHEMA_FILE.read_bytes()
        entry_points = next(n for n in z.namelist() if n.endswith(".dist-info/entry_points.txt"))
        assert "fw = framework.cli:main" in z.read(entry_points).decode()
        z.extractall(tmp_path / "site")
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site")}
    out = subprocess.run([sys.executable, "-m", "framework", "schema"], cwd=tmp_path, env=env,
                         capture_output=True, timeout=120, check=True)
    assert out.stdout == SCHEMA_FILE.read_bytes()
