"""The README's callback example is real code: it runs inside `fw fit` and logs its metric."""

import json
import re
import sys
from pathlib import Path

from framework.config import load_config
from framework.trainer import fit

REPO = Path(__file__).parents[1]


def _callbacks_example() -> str:
    readme = (REPO / "README.md").read_text()
    section = readme.split("## Callbacks", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1)


def test_readme_callback_example_runs_and_logs(tmp_path, monkeypatch):
    (tmp_path / "my_readme_callbacks.py").write_text(_callbacks_example())
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = load_config([str(REPO / "recipes" / "sft.yaml")], [
        f"--run_dir={tmp_path / 'run'}", f"--data.path={REPO / 'recipes' / 'data' / 'arithmetic_chat.jsonl'}",
        "--data.max_seq_len=64", "--data.batch_size=2", "--trainer.max_steps=3", "--trainer.log_every_n_steps=1",
        "--trainer.enable_progress_bar=false", "--logging.tensorboard=false",
        "--callbacks=[{class_path: my_readme_callbacks.UpdateRatio}]"])
    try:
        fit(cfg)
    finally:
        sys.modules.pop("my_readme_callbacks", None)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    ratios = [r["update_ratio"] for r in records if "update_ratio" in r]
    assert len(ratios) == 3 and all(0 < r < 1 for r in ratios), records
