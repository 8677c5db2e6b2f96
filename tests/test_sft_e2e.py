"""The shipped SFT example end to end through the real CLI: it learns, and its files appear."""

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors import safe_open

from framework.config import load_config
from framework.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[1]


def run_fw(*args, timeout=600):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}   # 2 shared cores: intra-op threads only contend
    return subprocess.run([sys.executable, "-m", "framework", *args], check=False, cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_example_config_is_cpu_friendly_and_gpu_ready():
    cfg = load_config([str(ROOT / "recipes" / "sft.yaml")], [])
    assert (ROOT / "recipes" / "sft.yaml").read_text().startswith(
        "# yaml-language-server: $schema=../schemas/train.schema.json\n")
    assert cfg["recipe"] == "sft" and cfg["trainer"]["accelerator"] == "auto"
    assert cfg["model"]["policy"]["preset"] == "tiny"
    assert Path(ROOT / cfg["data"]["path"]).is_file()


def test_sft_example_learns_and_writes_its_files(tmp_path):
    run_dir = tmp_path / "run"
    steps = 40
    proc = run_fw("fit", "--config", "recipes/sft.yaml", f"--run_dir={run_dir}", f"--trainer.max_steps={steps}",
                  "--checkpoint.every_n_steps=20", "--trainer.enable_progress_bar=false")
    assert proc.returncode == 0, proc.stderr[-3000:]

    metrics = read_metrics(run_dir / "metrics.jsonl")
    every = load_config([str(ROOT / "recipes" / "sft.yaml")], [])["trainer"]["log_every_n_steps"]
    assert [m["step"] for m in metrics] == list(range(every, steps + 1, every))
    first, last = metrics[0]["loss"], metrics[-1]["loss"]
    assert last < 0.3 * first, (first, last)             # falls far below its start
    assert metrics[-1]["token_accuracy"] > 0.6
    for m in metrics:
        assert {"loss", "token_accuracy", "grad_norm", "lr", "tokens", "tokens_per_s"} <= set(m)

    # Resolved config, CSV and TensorBoard logs, checkpoints with HF-layout policy weights.
    assert load_config([str(run_dir / "config.yaml")], [])["trainer"]["max_steps"] == steps
    (csv_file,) = (run_dir / "logs").glob("version_*/metrics.csv")
    rows = list(csv.DictReader(csv_file.open()))
    assert [float(r["loss"]) for r in rows if r.get("loss")] == pytest.approx([m["loss"] for m in metrics])
    assert list((run_dir / "logs").glob("version_*/events.out.tfevents.*"))
    ckpts = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert ckpts == ["step-000020", "step-000040"]
    final = run_dir / "checkpoints" / "step-000040"
    manifest = json.loads((final / "manifest.json").read_text())
    assert manifest["step"] == steps
    config = json.loads((final / "policy" / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"] and config["hidden_size"] == 64
    with safe_open(str(final / "policy" / "model.safetensors"), "pt") as f:
        assert "model.layers.1.mlp.down_proj.weight" in f.keys()  # noqa: SIM118 (a safetensors handle)
    assert (final / "policy" / "tokenizer.json").is_file()

