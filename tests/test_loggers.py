"""logging.loggers with real Lightning loggers offline: W&B (WANDB_MODE=offline, its run file read back
record by record) and MLflow (a file store read back with MLflow's client) get every metric of
metrics.jsonl and the resolved config; a class that is not a logger is refused."""

import glob
import json
import struct
import time
from pathlib import Path

import pytest

from framework.config import resolve
from framework.errors import FwError
from framework.loggers import user_loggers
from framework.metrics import read_metrics
from framework.trainer import fit

ROOT = Path(__file__).resolve().parent.parent


def sft_config(run_dir, loggers, csv=False):
    return resolve({
        "recipe": "sft", "seed": 1, "run_dir": str(run_dir), "model": {"policy": {"preset": "tiny"}},
        "data": {"path": str(ROOT / "recipes" / "data" / "arithmetic_chat.jsonl"), "max_seq_len": 64,
                 "batch_size": 2},
        "trainer": {"accelerator": "cpu", "max_steps": 3, "enable_progress_bar": False},
        "logging": {"csv": csv, "tensorboard": False, "loggers": loggers}})


def wandb_records(path):
    """The protobuf records of a W&B run file: a 7-byte header, then LevelDB log blocks of 32 KiB whose
    chunks (crc32 u32, length u16, type u8: 1 full, 2 first, 3 middle, 4 last) hold the records."""
    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B"
    pos, block, out, pending = 7, 32768, [], b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:   # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 0:
            break
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            out.append(record)
    return out


def test_wandb_offline_gets_metrics_and_config(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = tmp_path / "run"
    wandb_logger = {"class_path": "lightning.pytorch.loggers.WandbLogger", "init_args": {"project": "fw-test"}}
    cfg = sft_config(run, [wandb_logger])
    try:
        fit(cfg)
    finally:
        import wandb

        wandb.finish()
    # no save_dir given: the run's logs/wandb/, not the working directory
    (path,) = glob.glob(str(run / "logs" / "wandb" / "wandb" / "offline-run-*" / "run-*.wandb"))
    # W&B's service process writes the file; its last record, "exit", says the run is complete
    deadline = time.monotonic() + 60
    records = wandb_records(path)
    while not any(r.WhichOneof("record_type") == "exit" for r in records):
        assert time.monotonic() < deadline, "the W&B run file has no exit record"
        time.sleep(0.5)
        records = wandb_records(path)
    history, config = [], {}
    for record in records:
        kind = record.WhichOneof("record_type")
        if kind == "history":
            history.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item})
        elif kind == "config":
            config.update({i.key: json.loads(i.value_json) for i in record.config.update})
    expected = read_metrics(run / "metrics.jsonl")
    assert [h["loss"] for h in history if "loss" in h] == [r["loss"] for r in expected]
    assert config["recipe"] == "sft" and config["trainer"]["max_steps"] == 3 and config["data"] == cfg["data"]


def test_mlflow_file_store_gets_metrics_and_config(tmp_path, monkeypatch):
    mlflow = pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")   # MLflow 3 asks for a database unless told
    run, store = tmp_path / "run", f"file:{tmp_path / 'mlruns'}"
    fit(sft_config(run, [{"class_path": "lightning.pytorch.loggers.MLFlowLogger",
                          "init_args": {"experiment_name": "fw-test", "tracking_uri": store}}]))
    client = mlflow.tracking.MlflowClient(store)
    (found,) = client.search_runs([client.get_experiment_by_name("fw-test").experiment_id])
    expected = read_metrics(run / "metrics.jsonl")
    history = client.get_metric_history(found.info.run_id, "loss")
    assert [m.value for m in sorted(history, key=lambda m: m.step)] == [r["loss"] for r in expected]
    assert [m.step for m in sorted(history, key=lambda m: m.step)] == [1, 2, 3]
    params = found.data.params
    assert params["recipe"] == "sft" and params["trainer/max_steps"] == "3" and params["seed"] == "1"


def test_builtin_csv_logger_records_the_config(tmp_path):
    import yaml

    run = tmp_path / "run"
    cfg = sft_config(run, [], csv=True)
    fit(cfg)
    (hparams,) = glob.glob(str(run / "logs" / "version_*" / "hparams.yaml"))
    assert yaml.safe_load(Path(hparams).read_text())["optimizer"] == cfg["optimizer"]


def test_a_class_that_is_not_a_logger_is_refused(tmp_path):
    cfg = sft_config(tmp_path / "run", [{"class_path": "framework.metrics.StepMetrics"}])
    with pytest.raises(FwError, match=r"logging.loggers\[0\]: framework.metrics.StepMetrics is not a "):
        user_loggers(cfg)


def test_fw_fit_reports_a_bad_logger_in_one_line(tmp_path, capsys):
    from framework.cli import main

    config = tmp_path / "train.yaml"
    config.write_text(json.dumps({**sft_config(tmp_path / "run", []), "logging": {
        "loggers": [{"class_path": "framework.metrics.StepMetrics"}]}}))
    assert main(["fit", "--config", str(config)]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("fw: error:")]
    assert len(errors) == 1 and "is not a lightning.pytorch.loggers.Logger subclass" in errors[0]
