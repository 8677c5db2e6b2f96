"""A recipe of one's own, installed the way a package installs it (an `fw.recipes` entry point in a
dist-info directory on the path), trained by `fw fit` in a real process."""

import json
import os
import subprocess
import sys
from pathlib import Path

from framework.cli import main

ROOT = Path(__file__).resolve().parents[1]
PLUGINS = Path(__file__).parent / "plugins"


def site_with(tmp_path: Path, entries: dict[str, str], dist: str = "fw_copy_recipe") -> Path:
    site = tmp_path / f"site-{dist}"
    info = site / f"{dist}-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[fw.recipes]\n" + "".join(f"{k} = {v}\n" for k, v in entries.items()))
    return site


def fw(*argv: str, path: list[Path]) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, [*path, PLUGINS]))}
    return subprocess.run([sys.executable, "-m", "framework", *argv], capture_output=True, text=True, cwd=ROOT,
                          env=env, timeout=300, check=False)


def write_config(tmp_path: Path) -> Path:
    config = tmp_path / "copy.yaml"
    config.write_text(f"""recipe: copy
run_dir: {tmp_path / 'run'}
model: {{policy: {{preset: tiny}}}}
data: {{batch_size: 16}}
optimizer: {{lr: 3.0e-3}}
trainer: {{accelerator: cpu, max_steps: 40, log_every_n_steps: 10, enable_progress_bar: false}}
logging: {{csv: false, tensorboard: false}}
""")
    return config


def test_an_installed_recipe_validates_and_trains(tmp_path, monkeypatch, capsys):
    site = site_with(tmp_path, {"copy": "fw_copy_recipe:CopyRecipe"})
    config = write_config(tmp_path)
    # validate in this process, from the same entry point on sys.path: the real process is fit's below, and a
    # second one would only import Lightning again
    monkeypatch.syspath_prepend(str(PLUGINS))
    monkeypatch.syspath_prepend(str(site))
    assert main(["validate", "--config", str(config)]) == 0
    assert capsys.readouterr().out == f"{config}: valid (recipe copy)\n"
    done = fw("fit", "--config", str(config), path=[site])
    assert done.returncode == 0, done.stderr[-3000:]
    losses = [json.loads(line)["loss"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 4 and losses[-1] < 0.7 * losses[0], losses   # it learns to copy
    assert (tmp_path / "run" / "checkpoints" / "step-000040" / "manifest.json").is_file()


def test_a_recipe_that_is_not_installed_is_named_with_the_installed_ones(tmp_path):
    done = fw("validate", "--config", str(write_config(tmp_path)), path=[])
    assert done.returncode == 2
    assert done.stderr.endswith("1:9: recipe: expected one of sft, grpo, ppo; got the string 'copy'\n"), done.stderr


def test_two_packages_installing_one_name_are_refused(tmp_path):
    a = site_with(tmp_path, {"copy": "fw_copy_recipe:CopyRecipe"}, dist="one")
    b = site_with(tmp_path, {"copy": "somewhere_else:Copy"}, dist="two")
    done = fw("validate", "--config", str(write_config(tmp_path)), path=[a, b])
    assert done.returncode == 2 and "recipe 'copy' is installed twice" in done.stderr, done.stderr


def test_a_recipe_that_does_not_import_or_is_not_a_recipe_fails_validation(tmp_path):
    site = site_with(tmp_path, {"copy": "no_such_module_fw:CopyRecipe"})
    done = fw("validate", "--config", str(write_config(tmp_path)), path=[site])
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert ("1:9: recipe: cannot import recipe 'copy' (no_such_module_fw:CopyRecipe): ModuleNotFoundError"
            in done.stderr), done.stderr
    site = site_with(tmp_path, {"copy": "collections:OrderedDict"}, dist="not_a_recipe")
    done = fw("validate", "--config", str(write_config(tmp_path)), path=[site])
    assert done.returncode == 2 and "recipe: 'copy' (collections:OrderedDict) is not a recipe: it has no " \
        "requirements, train_dataloader, training_step" in done.stderr, done.stderr


def test_a_recipe_whose_requirements_raise_is_a_config_problem(tmp_path, monkeypatch, capsys):
    """The recipe's own requirements(cfg) is user code: what it raises is reported at `recipe` (exit 2), as a
    reward's or a callback's constructor is, not as a traceback."""
    (tmp_path / "fw_bad_requirements.py").write_text(
        "from fw_copy_recipe import CopyRecipe\n\n"
        "class BadRequirements(CopyRecipe):\n"
        "    @classmethod\n"
        "    def requirements(cls, cfg):\n"
        "        raise ValueError('needs a model.value section')\n")
    site = site_with(tmp_path, {"copy": "fw_bad_requirements:BadRequirements"})
    config = write_config(tmp_path)
    for path in (PLUGINS, tmp_path, site):
        monkeypatch.syspath_prepend(str(path))
    assert main(["validate", "--config", str(config)]) == 2
    assert capsys.readouterr().err == (f"{config}:1:9: recipe: copy's requirements(cfg) raised ValueError: needs a "
                                       f"model.value section (at {tmp_path / 'fw_bad_requirements.py'}:6)\n")
