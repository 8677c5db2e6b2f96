"""Config loading: merging, overrides, defaults, resolve, saving, class_path imports."""

import inspect
import json
import os
import re
import sys
from collections import OrderedDict
from fractions import Fraction
from pathlib import Path

import pytest
import yaml

from framework import yaml12
from framework.config import load_config, resolve, save_resolved, schema_path
from framework.errors import ConfigError, FwError, Problem
from framework.imports import import_class, import_object, instantiate

ROOT = Path(__file__).resolve().parents[1]
MINIMAL = "recipe: grpo\nmodel:\n  policy:\n    preset: tiny\n"


def write(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def problems(exc: pytest.ExceptionInfo) -> list[str]:
    return [str(p) for p in exc.value.problems]


def design_defaults() -> dict:
    """The config block of docs/DESIGN.md, the contract the schema's defaults must match."""
    text = (ROOT / "docs" / "DESIGN.md").read_text()
    return yaml12.load(re.search(r"## The config.*?```yaml\n(.*?)```", text, re.DOTALL).group(1))


# ------------------------------------------------------------------------------------------ defaults

def assert_same(actual: dict, expected: dict, where: str = "") -> None:
    """`actual` has the keys of `expected`, no others, with the same values: the reference lists every default."""
    extra = sorted(set(actual) - set(expected))
    assert not extra, f"{where}{extra[0]} is not in the reference"
    for key, value in expected.items():
        assert key in actual, f"{where}{key} is missing"
        if isinstance(value, dict) and value:
            assert_same(actual[key], value, f"{where}{key}.")
        else:
            assert actual[key] == value and type(actual[key]) is type(value), f"{where}{key}: {actual[key]!r}"


@pytest.mark.parametrize("recipe", ["sft", "grpo", "ppo"])
def test_resolved_defaults_match_the_design_contract(recipe):
    expected = design_defaults()
    expected["recipe"] = recipe
    expected["model"]["policy"]["preset"] = "tiny"
    expected["run_dir"] = os.path.abspath(expected["run_dir"])  # a default path resolves against the cwd
    for other in ("sft", "grpo", "ppo"):
        if other != recipe:
            del expected[other]  # only the selected recipe's section exists in a resolved config
    cfg = resolve({"recipe": recipe, "model": {"policy": {"preset": "tiny"}}})
    assert_same(cfg, expected)
    assert list(cfg) == list(expected)  # the same sections, in the order of the reference


def test_resolve_does_not_touch_its_input_and_is_idempotent():
    raw = {"recipe": "ppo", "model": {"policy": {"path": "/m"}}, "callbacks": [{"class_path": "fractions.Fraction"}]}
    before = repr(raw)
    cfg = resolve(raw)
    assert repr(raw) == before
    assert cfg["callbacks"] == [{"class_path": "fractions.Fraction", "init_args": {}}]
    assert cfg["ppo"]["critic"] == {"lr": 1e-5, "weight_decay": 0.0, "max_grad_norm": 1.0}
    assert resolve(cfg) == cfg


def test_defaults_fill_inside_given_task_and_keep_user_values():
    cfg = resolve({"recipe": "grpo", "model": {"policy": {"preset": "tiny"}},
                   "data": {"task": {"name": "arithmetic", "init_args": {"digits": 2}}, "max_seq_len": 64}})
    assert cfg["data"]["task"] == {"name": "arithmetic", "class_path": None, "init_args": {"digits": 2}}
    assert cfg["data"]["max_seq_len"] == 64 and cfg["data"]["batch_size"] == 8


def test_integral_floats_become_ints_for_integer_keys():
    cfg = resolve({"recipe": "sft", "model": {"policy": {"preset": "tiny"}}, "trainer": {"max_steps": 1e3},
                   "optimizer": {"lr": 1e-3}})
    assert cfg["trainer"]["max_steps"] == 1000 and type(cfg["trainer"]["max_steps"]) is int
    assert type(cfg["optimizer"]["lr"]) is float


def test_integral_floats_become_ints_in_the_any_of_branch_they_match(tmp_path, capsys):
    from framework.cli import main
    from framework.validate import validate_config

    path = write(tmp_path, "c.yaml", MINIMAL + "data: {task: {name: digits}}\n"
                 "trainer: {accelerator: cpu, devices: 1.0}\nrollout: {temperature: 1.0}\n")
    cfg = load_config([path])
    assert cfg["trainer"]["devices"] == 1 and type(cfg["trainer"]["devices"]) is int
    assert type(cfg["rollout"]["temperature"]) is float   # a number key keeps its float
    devices = load_config([path], ["--trainer.devices=[0.0, 2.0]"])["trainer"]["devices"]
    assert devices == [0, 2] and all(type(d) is int for d in devices)
    # what `fw fit` checks: Lightning's own accelerator connector takes the resolved devices
    assert validate_config([path], machine=True)["trainer"]["devices"] == 1
    assert main(["validate", "--config", path]) == 0
    assert main(["print-config", "--config", path]) == 0
    assert yaml12.load(capsys.readouterr().out)["trainer"]["devices"] == 1


def test_resolve_reports_every_problem_without_positions():
    with pytest.raises(ConfigError) as e:
        resolve({"recipe": "grpo", "model": {"policy": {"preset": "tiny"}}, "trainer": {"max_steps": 0},
                 "seed": "x"})
    assert problems(e) == ["<config>: seed: expected an integer, got the string 'x'",
                           "<config>: trainer.max_steps: must be >= 1, got 0"]


def test_resolve_rejects_a_non_mapping():
    with pytest.raises(ConfigError, match="expected a mapping, got a list"):
        resolve([1])


def test_reward_class_path_keeps_the_builtin_name_default():
    # documented: reward.class_path is set instead of reward.name, which stays null
    cfg = resolve({"recipe": "grpo", "model": {"policy": {"preset": "tiny"}},
                   "reward": {"class_path": "fractions.Fraction"}})
    assert cfg["reward"] == {"name": None, "class_path": "fractions.Fraction", "init_args": {},
                             "on_error": "raise", "max_error_fraction": 0.5, "timeout_s": 120}


def test_problem_text():
    assert str(Problem("a.yaml", 3, 5, "x.y", "bad")) == "a.yaml:3:5: x.y: bad"
    assert str(Problem("a.yaml", None, None, "", "config file not found")) == "a.yaml: config file not found"
    err = ConfigError([Problem("a", 1, 1, "k", "m1"), Problem("b", 2, 2, "", "m2")])
    assert str(err) == "a:1:1: k: m1\nb:2:2: m2" and isinstance(err, FwError)


# ------------------------------------------------------------------------------------------ merging

def test_files_merge_left_to_right(tmp_path):
    base = write(tmp_path, "base.yaml", MINIMAL + "optimizer:\n  lr: 1e-4\n  betas: [0.8, 0.9]\n"
                                                  "rollout:\n  stop: ['a', 'b']\n  max_new_tokens: 16\n")
    top = write(tmp_path, "top.yaml", "optimizer:\n  betas: [0.5, 0.6]\n  eps: 1e-6\nrollout:\n  stop: ['c']\n")
    cfg = load_config([base, top], [])
    assert cfg["optimizer"]["lr"] == 1e-4  # kept from base
    assert cfg["optimizer"]["betas"] == [0.5, 0.6] and cfg["optimizer"]["eps"] == 1e-6  # from top
    assert cfg["rollout"]["stop"] == ["c"]  # lists replace
    assert cfg["rollout"]["max_new_tokens"] == 16


def test_errors_point_at_the_file_that_set_the_value(tmp_path):
    base = write(tmp_path, "base.yaml", MINIMAL + "trainer:\n  max_steps: 0\n  log_every_n_steps: 0\n")
    top = write(tmp_path, "top.yaml", "# later file\ntrainer:\n  max_steps: 5\n  log_every_n_steps: -3\n")
    with pytest.raises(ConfigError) as e:
        load_config([base, top], [])
    assert problems(e) == [f"{top}:4:22: trainer.log_every_n_steps: must be >= 1, got -3"]


def test_a_temperature_between_greedy_and_its_floor_is_refused_at_its_line(tmp_path):
    path = write(tmp_path, "t.yaml", MINIMAL + "rollout:\n  temperature: 1.0e-6\n")
    with pytest.raises(ConfigError) as e:
        load_config([path], [])
    assert problems(e) == [(f"{path}:{len(MINIMAL.splitlines()) + 2}:16: rollout.temperature: the number 1e-06 is "
                            "not allowed here: Sampling temperature: 0 = greedy (fw generate only: GRPO/PPO need > 0), "
                            "else at least 1e-5.")]
    load_config([write(tmp_path, "z.yaml", MINIMAL + "rollout:\n  temperature: 0\n")], [])   # greedy is fine


def test_a_mapping_replaced_by_a_scalar_takes_the_new_position(tmp_path):
    base = write(tmp_path, "base.yaml", MINIMAL + "data:\n  task: {name: arithmetic}\n")
    top = write(tmp_path, "top.yaml", "data:\n  task: 5\n")
    with pytest.raises(ConfigError) as e:
        load_config([base, top], [])
    assert problems(e) == [f"{top}:2:9: data.task: expected a mapping or null, got the number 5"]


def test_no_config_file_given():
    with pytest.raises(FwError, match="no config file given"):
        load_config([], [])


def test_every_missing_file_is_reported(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_config([str(tmp_path / "a.yaml"), str(tmp_path / "b.yaml")], [])
    assert problems(e) == [f"{tmp_path / 'a.yaml'}: config file not found",
                           f"{tmp_path / 'b.yaml'}: config file not found"]


# ------------------------------------------------------------------------------------------ overrides

def test_overrides_are_typed_by_the_schema(tmp_path):
    path = write(tmp_path, "c.yaml", MINIMAL + "name: base\n")
    cfg = load_config([path], ["--trainer.max_steps=10", "--optimizer.lr=1e-4", "--optimizer.betas=[0.9, 0.95]",
                               "--name=123", "--run_dir=2024", "--logging.tensorboard=false",
                               "--optimizer.max_grad_norm=null", "--trainer.devices=2", "--rollout.stop=[]",
                               "--tokenizer.path=true"])
    assert cfg["trainer"]["max_steps"] == 10
    assert cfg["optimizer"]["lr"] == 1e-4 and cfg["optimizer"]["betas"] == [0.9, 0.95]
    assert cfg["name"] == "123" and cfg["run_dir"] == os.path.abspath("2024")  # string keys keep the text
    assert cfg["logging"]["tensorboard"] is False and cfg["optimizer"]["max_grad_norm"] is None
    assert cfg["trainer"]["devices"] == 2 and cfg["rollout"]["stop"] == []
    assert cfg["tokenizer"]["path"] == os.path.abspath("true")


def test_an_override_value_keeps_the_text_after_a_hash_through_the_cli(tmp_path, monkeypatch, capsys):
    from framework.cli import main

    monkeypatch.chdir(tmp_path)
    path = write(tmp_path, "c.yaml", MINIMAL + "data: {task: {name: digits}}\n")
    assert main(["print-config", "--config", path, "--name=exp #3", "--run_dir=runs/exp #3", "--seed=4 # c"]) == 2
    assert capsys.readouterr().err == "override '--seed=4 # c': seed: expected an integer, got the string '4 # c'\n"
    assert main(["print-config", "--config", path, "--name=exp #3", "--run_dir=runs/exp #3",
                 "--optimizer.betas=[0.8, 0.9]"]) == 0
    cfg = yaml12.load(capsys.readouterr().out)
    assert cfg["name"] == "exp #3" and cfg["run_dir"] == str(Path.cwd() / "runs" / "exp #3")
    assert cfg["optimizer"]["betas"] == [0.8, 0.9]


def test_overrides_apply_after_all_files_in_order(tmp_path):
    a = write(tmp_path, "a.yaml", MINIMAL + "seed: 1\n")
    b = write(tmp_path, "b.yaml", "seed: 2\n")
    assert load_config([a, b], ["seed=3", "--seed=4"])["seed"] == 4


def test_override_creates_parents_and_reaches_free_form_init_args(tmp_path):
    path = write(tmp_path, "c.yaml", MINIMAL)
    cfg = load_config([path], ["--data.task.name=arithmetic", "--data.task.init_args.digits=3",
                               "--reward.init_args.tolerance=1e-6"])
    assert cfg["data"]["task"] == {"name": "arithmetic", "class_path": None, "init_args": {"digits": 3}}
    assert cfg["reward"]["init_args"] == {"tolerance": 1e-6}


def test_override_errors_name_the_override(tmp_path):
    path = write(tmp_path, "c.yaml", MINIMAL + "trainer:\n  max_steps: 0\n")
    with pytest.raises(ConfigError) as e:
        load_config([path], ["--trainer.max_stepz=10", "--optimizer.lr=fast", "--logging.csv=on",
                             "--callbacks.0.class_path=x.Y", "trainer.max_steps", "--=1", "--a..b=1"])
    assert problems(e) == [
        f"{path}:6:14: trainer.max_steps: must be >= 1, got 0",
        ("override '--trainer.max_stepz=10': trainer.max_stepz: unknown key 'max_stepz'; "
        "did you mean 'max_steps'?"),
        "override '--optimizer.lr=fast': optimizer.lr: expected a number, got the string 'fast'",
        ("override '--logging.csv=on': logging.csv: expected true or false, got the string 'on' "
        "(YAML 1.2 reads on/off/yes/no as strings: write true or false)"),
        ("override '--callbacks.0.class_path=x.Y': callbacks.0.class_path: cannot override inside the list "
        "'callbacks'; set the whole list, e.g. --callbacks=[...]"),
        "override 'trainer.max_steps': malformed override: expected --key.path=value, e.g. --trainer.max_steps=10",
        "override '--=1': malformed override: expected --key.path=value, e.g. --trainer.max_steps=10",
        "override '--a..b=1': malformed override: expected --key.path=value, e.g. --trainer.max_steps=10",
    ]


def test_a_key_written_twice_in_an_override_value_is_an_error_as_in_a_file(tmp_path):
    path = write(tmp_path, "c.yaml", MINIMAL)
    with pytest.raises(ConfigError) as e:
        load_config([path], ["--model.policy={preset: tiny, preset: small}",
                             "--callbacks=[{class_path: a.B, class_path: c.D}]"])
    assert problems(e) == [
        ("override '--model.policy={preset: tiny, preset: small}': model.policy.preset: duplicate key 'preset' "
         "(first defined at column 2)"),
        ("override '--callbacks=[{class_path: a.B, class_path: c.D}]': callbacks[0].class_path: duplicate key "
         "'class_path' (first defined at column 3)"),
    ]


def test_an_unclosed_flow_value_in_an_override_is_an_error_as_in_a_file(tmp_path):
    """`{preset: tiny` is no YAML value (a file saying it fails to parse): never the string it spells. Quoted, a
    string may start with a bracket."""
    path = write(tmp_path, "c.yaml", MINIMAL)
    with pytest.raises(ConfigError) as e:
        load_config([path], ["--model.policy={preset: tiny", "--trainer.max_steps=[3"])
    assert problems(e) == [
        ("override '--model.policy={preset: tiny': model.policy: a value starting with '{' must be one whole YAML "
         "flow mapping, e.g. {preset: tiny}; got '{preset: tiny' (quote it, '...', for a string)"),
        ("override '--trainer.max_steps=[3': trainer.max_steps: a value starting with '[' must be one whole YAML "
         "flow list, e.g. [a, b]; got '[3' (quote it, '...', for a string)"),
    ]
    assert load_config([path], ["--name='[exp'"])["name"] == "[exp"


def test_override_below_a_scalar_key_names_the_override_not_the_file(tmp_path):
    # the file sets these keys correctly: the override that reaches below them is at fault
    path = write(tmp_path, "c.yaml", MINIMAL + "seed: 0\noptimizer:\n  lr: 3.0e-3\ntrainer:\n  devices: 1\n")
    with pytest.raises(ConfigError) as e:
        load_config([path], ["--seed.x=1", "--optimizer.lr.value=1", "--name.first.second=a",
                             "--data.task.class_path.x=1", "--model.policy.preset.size=1", "--trainer.devices.n=2"])
    assert problems(e) == [
        "override '--seed.x=1': seed.x: seed is an integer, not a section",
        "override '--optimizer.lr.value=1': optimizer.lr.value: optimizer.lr is a number, not a section",
        "override '--name.first.second=a': name.first.second: name is a string, not a section",
        ("override '--data.task.class_path.x=1': data.task.class_path.x: data.task.class_path is a string or null, "
         "not a section"),
        ("override '--model.policy.preset.size=1': model.policy.preset.size: model.policy.preset is a choice "
         "(one of tiny, small, qwen3-0.6b, qwen3-1.7b, qwen3-4b, qwen3-8b, null), not a section"),
        ("override '--trainer.devices.n=2': trainer.devices.n: trainer.devices is auto or an integer or a list, "
         "not a section"),
    ]


def test_override_below_a_free_form_key_written_in_the_file_adds_to_it(tmp_path):
    path = write(tmp_path, "c.yaml", MINIMAL + "data:\n  task:\n    name: arithmetic\n    init_args: {digits: 2}\n")
    cfg = load_config([path], ["--data.task.init_args.allow_negative=false"])
    assert cfg["data"]["task"]["init_args"] == {"digits": 2, "allow_negative": False}


def test_override_fixes_an_error_in_a_file(tmp_path):
    path = write(tmp_path, "c.yaml", MINIMAL + "trainer:\n  max_steps: 0\n")
    assert load_config([path], ["--trainer.max_steps=7"])["trainer"]["max_steps"] == 7


def test_override_of_another_recipes_section(tmp_path):
    path = write(tmp_path, "c.yaml", MINIMAL)
    with pytest.raises(ConfigError) as e:
        load_config([path], ["--ppo.gamma=0.9"])
    assert problems(e) == [("override '--ppo.gamma=0.9': ppo: The ppo: section is only allowed with recipe: ppo "
                           "(this config has recipe: grpo)")]


# ------------------------------------------------------------------------------------------ saving

def test_save_resolved_round_trips_with_a_working_modeline(tmp_path):
    path = write(tmp_path, "c.yaml", MINIMAL + "optimizer: {lr: 2e-5}\nrollout: {stop: ['yes', '1e3']}\n")
    cfg = load_config([path], [])
    out = tmp_path / "run" / "deep" / "config.yaml"
    save_resolved(cfg, out)
    first = out.read_text().splitlines()[0]
    assert first.startswith("# yaml-language-server: $schema=")
    schema_ref = first.split("$schema=", 1)[1]
    assert os.path.samefile(out.parent / schema_ref, os.path.realpath(schema_path()))
    assert load_config([str(out)], []) == cfg
    assert [p.name for p in out.parent.iterdir()] == ["config.yaml"]  # no temp file left behind


@pytest.mark.parametrize("value", ["y", "N", "yes", "No", "on", "OFF", "12:30", "1:20:30", "0o17", "0x1F", "0b101",
                                   "0755", ".inf", "~", "null", "2026-12-07", "=", "<<", "1_000", "true"])
def test_a_written_config_reads_back_its_strings_in_yaml_1_1_too(tmp_path, capsys, value):
    """config.yaml and `fw print-config` quote a string that PyYAML (YAML 1.1, what many scripts read config.yaml
    with) or fw (YAML 1.2) would read as something else: `12:30` is 750 and `on` is true in YAML 1.1."""
    from framework.cli import main
    path = write(tmp_path, "c.yaml", MINIMAL + f"name: {json.dumps(value)}\nrollout: {{stop: [{json.dumps(value)}]}}\n")
    cfg = load_config([path], [])
    out = tmp_path / "run" / "config.yaml"
    save_resolved(cfg, out)
    assert main(["print-config", "--config", path]) == 0
    for text in (out.read_text(), capsys.readouterr().out):
        assert f"\nname: '{value}'\n" in text
        pyyaml = yaml.safe_load(text)
        assert (pyyaml["name"], pyyaml["rollout"]["stop"]) == (value, [value])
        assert yaml12.load(text) == cfg
    assert load_config([str(out)], []) == cfg


def test_a_written_config_of_unambiguous_strings_quotes_none(tmp_path, capsys):
    from framework.cli import main
    path = write(tmp_path, "c.yaml", MINIMAL + "name: yEs-12:30\nrollout: {stop: [x:y, '1.2.3', 2026-12]}\n")
    cfg = load_config([path], [])
    assert main(["print-config", "--config", path]) == 0
    text = capsys.readouterr().out
    assert "\nname: yEs-12:30\n" in text and "\n  stop:\n  - x:y\n  - 1.2.3\n  - 2026-12\n" in text
    assert "'" not in text and '"' not in text
    assert yaml12.load(text) == cfg and yaml.safe_load(text) == cfg


# ------------------------------------------------------------------------------------------ class_path

@pytest.fixture
def user_modules(tmp_path, monkeypatch):
    """A directory of importable user modules (real files on sys.path)."""
    pkg = tmp_path / "userpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "good.py").write_text("class Scale:\n    def __init__(self, factor, offset=0.0):\n"
                                 "        self.factor, self.offset = factor, offset\n\n"
                                 "    class Inner:\n        pass\n\n\ndef helper():\n    return 1\n")
    (pkg / "needs_dep.py").write_text("import nosuchdep_for_fw_tests\n")
    (pkg / "broken.py").write_text("def f(:\n")
    (pkg / "raises.py").write_text("raise RuntimeError('boom at import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "userpkg"
    for name in [m for m in sys.modules if m == "userpkg" or m.startswith("userpkg.")]:
        del sys.modules[name]


def test_import_object_and_class(user_modules):
    assert import_class("collections.OrderedDict") is OrderedDict
    assert import_class("userpkg.good.Scale.Inner").__qualname__ == "Scale.Inner"
    assert import_object("userpkg.good.helper")() == 1
    with pytest.raises(FwError, match="'userpkg.good.helper' is a function, not a class"):
        import_class("userpkg.good.helper")


def test_a_user_file_named_like_a_standard_module_is_told_to_be_renamed(user_modules, tmp_path):
    """A user's code.py beside the config: `code` is Python's own module, imported before it (here, or by anything
    earlier in the process), so `code.Good` names a missing attribute of the standard module; the error says which
    file was imported and to rename the user's. A near miss of a real attribute keeps its suggestion."""
    import code

    (tmp_path / "code.py").write_text("class Good:\n    pass\n")
    with pytest.raises(FwError) as e:
        import_object("code.Good")
    assert str(e.value) == (f"cannot import 'code.Good': module 'code' has no attribute 'Good'; 'code' is Python's own "
                            f"module ({code.__file__}), which a file of yours of that name does not replace: rename "
                            "your file")
    with pytest.raises(FwError, match=r"did you mean 'code.InteractiveConsole'\?$"):
        import_object("code.InteractiveConsol")
    with pytest.raises(FwError, match=r"'sys' is Python's own module \(built into the interpreter\)"):
        import_object("sys.Good")   # a module without a file


@pytest.mark.parametrize("class_path,message", [
    ("nosuchpkg_fw.mod.Cls", "cannot import 'nosuchpkg_fw.mod.Cls': no module named 'nosuchpkg_fw'"),
    ("userpkg.nosuchmod.Cls", "cannot import 'userpkg.nosuchmod.Cls': no module named 'userpkg.nosuchmod'"),
    ("userpkg.good.Nope", "cannot import 'userpkg.good.Nope': module 'userpkg.good' has no attribute 'Nope'"),
    ("userpkg.good.Scale.Nope",
     "cannot import 'userpkg.good.Scale.Nope': 'userpkg.good.Scale' has no attribute 'Nope'"),
    ("userpkg.good.Scal", "module 'userpkg.good' has no attribute 'Scal'; did you mean 'userpkg.good.Scale'?"),
    ("userpkg.god.Scale", "no module named 'userpkg.god'; did you mean 'userpkg.good.Scale'?"),
    ("userpkg.good.Scale.Iner",
     "'userpkg.good.Scale' has no attribute 'Iner'; did you mean 'userpkg.good.Scale.Inner'?"),
    ("userpkg.needs_dep.X", ("cannot import 'userpkg.needs_dep.X': importing module 'userpkg.needs_dep' failed: "
                            "No module named 'nosuchdep_for_fw_tests'")),
    ("userpkg.broken.X", "cannot import 'userpkg.broken.X': importing module 'userpkg.broken' failed: SyntaxError"),
    ("userpkg.raises.X", "importing module 'userpkg.raises' failed: RuntimeError: boom at import"),
    # a module, not imported before or imported already: no attribute missing, but no class named either
    ("userpkg.good", "'userpkg.good' is a module; class_path names a class in it, such as 'userpkg.good.ClassName'"),
    ("os.path", "'os.path' is a module; class_path names a class in it, such as 'os.path.ClassName'"),
    ("Scale", "'Scale' is not a dotted path like 'package.module.ClassName'"),
    ("a..b", "'a..b' is not a dotted path"),
])
def test_import_errors_say_what_is_missing(user_modules, class_path, message):
    with pytest.raises(FwError) as e:
        import_object(class_path)
    assert message in str(e.value)


def test_an_import_error_names_the_line_that_raised(user_modules, tmp_path):
    """A module that fails while it is imported is named with the line that raised, the innermost module's when one
    user module imports another."""
    pkg = tmp_path / "userpkg"
    (pkg / "imports_raises.py").write_text("import os\n\nfrom userpkg import raises\n")
    (pkg / "late_dep.py").write_text("import os\nimport nosuchdep_for_fw_tests\n")
    expected = {"userpkg.raises.X": f"RuntimeError: boom at import (at {pkg / 'raises.py'}:1)",
                "userpkg.imports_raises.X": f"RuntimeError: boom at import (at {pkg / 'raises.py'}:1)",
                "userpkg.late_dep.X": f"No module named 'nosuchdep_for_fw_tests' (at {pkg / 'late_dep.py'}:2)",
                "userpkg.broken.X": f"(at {pkg / 'broken.py'}:1)"}
    for class_path, message in expected.items():
        with pytest.raises(FwError) as e:
            import_object(class_path)
        assert str(e.value).endswith(message), str(e.value)
        assert str(e.value).count("broken.py") <= 1   # a SyntaxError's own text names the file too


def test_instantiate(user_modules):
    obj = instantiate({"class_path": "userpkg.good.Scale", "init_args": {"factor": 2}}, offset=1.5)
    assert (obj.factor, obj.offset) == (2, 1.5)
    assert instantiate({"class_path": "fractions.Fraction", "init_args": {"numerator": 3, "denominator": 4}}) \
        == Fraction(3, 4)
    assert instantiate({"class_path": "fractions.Fraction"}) == 0
    with pytest.raises(FwError, match="init_args do not fit userpkg.good.Scale.*unexpected keyword argument "
                                      "'factr'.*accepted: factor, offset"):
        instantiate({"class_path": "userpkg.good.Scale", "init_args": {"factr": 2}})
    # a required argument left out is read off the signature, as a misspelt one is, not from the constructor's error
    with pytest.raises(FwError) as e:
        instantiate({"class_path": "userpkg.good.Scale", "init_args": {}}, offset=1.5)
    assert str(e.value) == ("init_args do not fit userpkg.good.Scale(factor, offset=0.0): missing a required argument: "
                            "'factor' (accepted: factor, offset)")
    with pytest.raises(FwError, match="set offset, which fw passes itself"):
        instantiate({"class_path": "userpkg.good.Scale", "init_args": {"factor": 1, "offset": 2}}, offset=1)
    with pytest.raises(FwError, match="expected a mapping with a 'class_path' string"):
        instantiate({"init_args": {}})
    with pytest.raises(FwError, match="init_args of fractions.Fraction must be a mapping"):
        instantiate({"class_path": "fractions.Fraction", "init_args": [1]})
    with pytest.raises(FwError, match="'math.pi' is a float, which cannot be called"):
        instantiate({"class_path": "math.pi"})


def test_a_constructor_that_raises_names_the_users_line(user_modules, tmp_path):
    # the innermost line of the user's code: not json's, nor fw's or Python's under the user's call
    (tmp_path / "userpkg" / "ctor.py").write_text(
        "import json\nimport sys\n\nfrom framework.imports import in_library\n\n\n"
        "def check(n):\n    raise ValueError(f'bad n {n}')\n\n\n"
        "class Helper:\n    def __init__(self, n=-1):\n        check(n)\n\n\n"
        "class Json:\n    def __init__(self):\n        json.loads('')\n\n\n"
        "class Fw:\n    def __init__(self):\n        in_library(None)\n\n\n"
        "class Exits:\n    def __init__(self):\n        sys.exit(3)\n")
    file = tmp_path / "userpkg" / "ctor.py"
    for name, message in [
            ("Helper", "raised ValueError: bad n -1 (at {}:8)"),
            ("Json", "raised JSONDecodeError: Expecting value: line 1 column 1 (char 0) (at {}:18)"),
            ("Fw", "raised TypeError: expected str, bytes or os.PathLike object, not NoneType (at {}:23)"),
            ("Exits", "called sys.exit(3) (at {}:28)")]:
        with pytest.raises(FwError) as e:
            instantiate({"class_path": f"userpkg.ctor.{name}"})
        assert str(e.value) == f"userpkg.ctor.{name}(**init_args) {message.format(file)}"
    with pytest.raises(FwError) as e:   # no line of the user's to name: Python's own class raised
        instantiate({"class_path": "fractions.Fraction", "init_args": {"numerator": "abc"}})
    assert str(e.value) == "fractions.Fraction(**init_args) raised ValueError: Invalid literal for Fraction: 'abc'"


def test_class_paths_are_checked_when_validating(tmp_path, user_modules):
    path = write(tmp_path, "c.yaml", MINIMAL + """\
callbacks:
  - class_path: userpkg.good.Scale
    init_args: {factor: 2}
  - class_path: userpkg.good.Scale
    init_args: {factr: 2}
  - class_path: userpkg.missing.Cb
reward:
  class_path: userpkg.good.Nope
data:
  task:
    class_path: userpkg.needs_dep.Task
""")
    with pytest.raises(ConfigError) as e:
        load_config([path], [])
    got = problems(e)
    assert len(got) == 4
    assert got[0].startswith(f"{path}:9:16: callbacks[1].init_args: init_args do not fit userpkg.good.Scale")
    assert got[1] == (f"{path}:10:17: callbacks[2].class_path: cannot import 'userpkg.missing.Cb': "
                      "no module named 'userpkg.missing'")
    assert got[2] == (f"{path}:12:15: reward.class_path: cannot import 'userpkg.good.Nope': "
                      "module 'userpkg.good' has no attribute 'Nope'")
    assert got[3].startswith(f"{path}:15:17: data.task.class_path: cannot import 'userpkg.needs_dep.Task': "
                             "importing module 'userpkg.needs_dep' failed")


def test_valid_class_paths_load(tmp_path, user_modules):
    path = write(tmp_path, "c.yaml", MINIMAL + "callbacks:\n  - class_path: userpkg.good.Scale\n"
                                               "    init_args: {factor: 2}\n")
    cfg = load_config([path], [])
    assert cfg["callbacks"] == [{"class_path": "userpkg.good.Scale", "init_args": {"factor": 2}}]
    assert instantiate(cfg["callbacks"][0]).factor == 2


STOP_AT = """\
import lightning
class StopAt(lightning.Callback):
    def __init__(self, step: int = 5):
        self.step = step
    def on_train_batch_end(self, trainer, *a):
        if trainer.global_step >= self.step: trainer.should_stop = True
"""


def test_an_init_arg_of_the_wrong_type_is_refused_through_the_cli(tmp_path, user_modules, capsys):
    """`step: three` for `step: int` fails `fw validate` (exit 2, one line), not `fw fit` at its first step."""
    from framework.cli import main

    (tmp_path / "userpkg" / "callbacks.py").write_text(STOP_AT)
    path = write(tmp_path, "c.yaml", MINIMAL + "data: {task: {name: digits}}\n")
    override = "--callbacks=[{class_path: userpkg.callbacks.StopAt, init_args: {step: three}}]"
    assert main(["validate", "--config", path, override]) == 2
    assert capsys.readouterr().err == (
        f"override '{override}': callbacks[0].init_args: init_args do not fit userpkg.callbacks.StopAt"
        "(step: int = 5): step must be int, got 'three' (str)\n")
    assert main(["validate", "--config", path, override.replace("three", "3")]) == 0


TYPED = """\
import typing
from pathlib import Path


class Typed:
    def __init__(self, step: int = 5, lr: float = 0.1, name: str | None = None, limit: typing.Optional[int] = None,
                 either: typing.Union[int, str] = 0, flag: bool = False, xs: list[int] | None = None,
                 weights: dict[str, float] | None = None, loose=None, path: Path = Path("."),
                 anything: typing.Any = None, fn: typing.Callable | None = None, **rest):
        pass
"""

FUTURE = """\
from __future__ import annotations


class Future:
    def __init__(self, step: int = 5, names: list[str] | None = None):
        pass


def make(k: float = 1.0):
    return k
"""

BROKEN_FUTURE = """\
from __future__ import annotations


class Broken:
    def __init__(self, step: int = 5, other: NoSuchName = None):
        pass
"""


@pytest.fixture
def typed_modules(user_modules, tmp_path):
    (tmp_path / "userpkg" / "typed.py").write_text(TYPED)
    (tmp_path / "userpkg" / "future.py").write_text(FUTURE)
    (tmp_path / "userpkg" / "broken_future.py").write_text(BROKEN_FUTURE)
    return user_modules


@pytest.mark.parametrize("class_path, init_args, message", [
    ("userpkg.typed.Typed", {"step": True}, "step must be int, got True (bool)"),
    ("userpkg.typed.Typed", {"step": 2.5}, "step must be int, got 2.5 (float)"),
    ("userpkg.typed.Typed", {"lr": "fast"}, "lr must be float, got 'fast' (str)"),
    ("userpkg.typed.Typed", {"lr": False}, "lr must be float, got False (bool)"),
    ("userpkg.typed.Typed", {"name": 3}, "name must be str | None, got 3 (int)"),
    ("userpkg.typed.Typed", {"limit": "x"}, "limit must be int | None, got 'x' (str)"),
    ("userpkg.typed.Typed", {"either": None}, "either must be int | str, got None"),
    ("userpkg.typed.Typed", {"flag": "yes"},
     "flag must be bool, got 'yes' (str) (YAML 1.2 reads on/off/yes/no as strings: write true or false)"),
    ("userpkg.typed.Typed", {"xs": [1, "a"]}, "xs must be list[int] | None, got 'a' (str) at xs[1]"),
    ("userpkg.typed.Typed", {"xs": 1}, "xs must be list[int] | None, got 1 (int)"),
    ("userpkg.typed.Typed", {"weights": {"a": "b"}},
     "weights must be dict[str, float] | None, got 'b' (str) at weights['a']"),
    ("userpkg.typed.Typed", {"weights": {1: 1.0}},
     "weights must be dict[str, float] | None, got 1 (int) as a key of weights"),
    ("userpkg.future.Future", {"step": "three"}, "step must be int, got 'three' (str)"),
    ("userpkg.future.Future", {"names": ["a", 2]}, "names must be list[str] | None, got 2 (int) at names[1]"),
    ("userpkg.future.make", {"k": "x"}, "k must be float, got 'x' (str)"),
])
def test_init_args_of_the_wrong_type_are_refused(typed_modules, class_path, init_args, message):
    with pytest.raises(FwError) as e:
        instantiate({"class_path": class_path, "init_args": init_args})
    assert str(e.value).startswith(f"init_args do not fit {class_path}(")
    assert str(e.value).endswith(f": {message}")


@pytest.mark.parametrize("class_path, init_args", [
    ("userpkg.typed.Typed", {"step": 3, "lr": 1, "flag": True}),   # an int is a float
    ("userpkg.typed.Typed", {"lr": 0.5, "name": None, "limit": None, "xs": None, "weights": None}),
    ("userpkg.typed.Typed", {"name": "a", "limit": 2, "either": "s", "xs": [1, 2], "weights": {"a": 1, "b": 0.5}}),
    ("userpkg.typed.Typed", {"either": 4, "xs": []}),
    # not checked: no annotation, a class, Any, Callable, a keyword of **rest
    ("userpkg.typed.Typed", {"loose": "x", "path": "some/dir", "anything": [1], "fn": "not callable", "other": 1}),
    ("userpkg.future.Future", {"step": 3, "names": ["a"]}),
    ("userpkg.future.make", {"k": 2}),
    ("userpkg.broken_future.Broken", {"step": "three"}),   # a name that does not resolve: nothing checked
])
def test_init_args_of_the_annotated_types_or_unchecked_ones_are_accepted(typed_modules, class_path, init_args):
    instantiate({"class_path": class_path, "init_args": init_args})


def test_an_init_arg_of_the_wrong_type_is_reported_at_its_line(tmp_path, typed_modules):
    path = write(tmp_path, "c.yaml", MINIMAL + "callbacks:\n  - class_path: userpkg.typed.Typed\n"
                                               "    init_args: {xs: [1, 2], step: true}\n")
    with pytest.raises(ConfigError) as e:
        load_config([path], [])
    signature = inspect.signature(import_object("userpkg.typed.Typed"))
    expected = (f"{path}:7:16: callbacks[0].init_args: init_args do not fit userpkg.typed.Typed{signature}: "
                "step must be int, got True (bool)")
    assert problems(e) == [expected]


def test_a_signature_of_postponed_annotations_is_shown_as_written(typed_modules):
    # `from __future__ import annotations` keeps each annotation as a string, which a signature would quote
    with pytest.raises(FwError) as e:
        instantiate({"class_path": "userpkg.future.Future", "init_args": {"step": "three"}})
    assert str(e.value) == ("init_args do not fit userpkg.future.Future(step: int = 5, names: list[str] | None = "
                            "None): step must be int, got 'three' (str)")


@pytest.mark.parametrize("value, hint", [
    ("12", "got the number 12; the nearest allowed are 8 and 16"),
    ("200", "got the number 200; the nearest allowed is 128"),
    ("4", "got the number 4; the nearest allowed is 8"),
    ('"16"', "got the string '16' (write it without quotes: 16)"),
])
def test_a_number_outside_an_enum_of_numbers_gets_the_nearest_ones(tmp_path, value, hint):
    # a spelling match would offer '128' for 12, quoted as if a string were wanted
    path = write(tmp_path, "c.yaml", MINIMAL + f"rollout:\n  block_size: {value}\n")
    with pytest.raises(ConfigError) as e:
        load_config([path], [])
    assert f"{path}:6:15: rollout.block_size: expected one of 8, 16, 32, 64, 128; {hint}" in problems(e)


def test_builtin_names_are_checked_against_the_registries(tmp_path):
    pytest.importorskip("framework.rewards")
    pytest.importorskip("framework.tasks")
    path = write(tmp_path, "c.yaml", MINIMAL + "reward: {name: numeric_matc}\ndata:\n  task: {name: arithmetc}\n")
    with pytest.raises(ConfigError) as e:
        load_config([path], [])
    got = problems(e)
    assert got[0].startswith(f"{path}:5:16: reward.name: unknown built-in 'numeric_matc' (built-ins: ")
    assert got[0].endswith("did you mean 'numeric_match'?")
    assert got[1].startswith(f"{path}:7:16: data.task.name: unknown built-in 'arithmetc'")
    assert got[1].endswith("did you mean 'arithmetic'?")


def test_a_range_error_on_a_key_that_takes_null_says_what_null_means(tmp_path):
    """0 is the usual "off" elsewhere; these keys take null for it, which the line says in the schema's words."""
    path = write(tmp_path, "c.yaml", MINIMAL + "eval:\n  every_n_steps: 0\ncheckpoint:\n  keep_last: 0\n"
                 "optimizer:\n  max_grad_norm: -1\ngrpo:\n  clip_ratio_c: 0\n")
    with pytest.raises(ConfigError) as e:
        load_config([path])
    assert problems(e) == [
        f"{path}:6:18: eval.every_n_steps: must be >= 1, got 0 (or null: not during training)",
        f"{path}:8:14: checkpoint.keep_last: must be >= 1, got 0 (or null: keep all)",
        f"{path}:10:18: optimizer.max_grad_norm: must be > 0, got -1 (or null: no clipping)",
        f"{path}:12:17: grpo.clip_ratio_c: must be > 1, got 0 (or null: off (verl uses 3.0))"]   # whole, past "3."
