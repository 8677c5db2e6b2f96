"""A plugin recipe's saved state that a resume's weights-only load refuses stops the run at the save."""

import json
from pathlib import Path

PLUGINS = Path(__file__).parent / "plugins"


def test_a_recipe_state_that_a_resume_cannot_load_stops_the_run_at_its_first_save(tmp_path, install_recipe,
                                                                                   monkeypatch, capsys):
    """Such a state used to be saved without a word, and every resume from the run's checkpoints then failed."""
    from framework import checkpoint as ck
    from framework.cli import main

    monkeypatch.syspath_prepend(str(PLUGINS))
    install_recipe({"keeps_deque": "fw_deque_recipe:KeepsDeque"})
    run_dir = tmp_path / "run"
    config = tmp_path / "train.yaml"
    config.write_text(f"""recipe: keeps_deque
run_dir: {run_dir}
model: {{policy: {{preset: tiny}}}}
data: {{batch_size: 4}}
trainer: {{accelerator: cpu, max_steps: 3, log_every_n_steps: 1, enable_progress_bar: false}}
checkpoint: {{every_n_steps: 2}}
logging: {{csv: false, tensorboard: false}}
""")
    code = main(["fit", "--config", str(config)])
    err = capsys.readouterr().err
    assert code == 2, err[-3000:]
    (line,) = [ln for ln in err.splitlines() if ln.startswith("fw: error: ")]
    assert line.startswith("fw: error: checkpoint step-000002: the state of recipe keeps_deque "
                           "(fw_deque_recipe.KeepsDeque) holds collections.deque, which a resume's weights-only "
                           "load refuses"), line
    assert "Traceback" not in err
    assert ck.list_checkpoints(run_dir) == []
    checkpoints = run_dir / "checkpoints"
    assert not checkpoints.exists() or list(checkpoints.iterdir()) == []
    assert [json.loads(ln)["step"] for ln in (run_dir / "metrics.jsonl").read_text().splitlines()] == [1, 2]
