"""logging.loggers with real Lightning loggers offline: W&B (WANDB_MODE=offline, its run file read back
record by record) and MLflow (a file store read back with MLflow's client) get every metric of
metrics.jsonl and the resolved config; a class that is not a logger is refused. The built-in CSV and
TensorBoard logs of a run crashed and resumed are one folder holding each step once, with the values of
the uninterrupted run (the CSV read with the csv module, the event files with TensorBoard's reader or,
without tensorboard installed, record by record)."""

import csv
import enum
import glob
import json
import logging
import math
import os
import re
import struct
import sys
import threading
import time
from argparse import Namespace
from pathlib import Path

import pytest
import yaml
from conftest import TENSORBOARD_WRITERS, on_screen, use_tensorboard_writer
from lightning.pytorch.loggers import CSVLogger, Logger
from lightning.pytorch.utilities.imports import _OMEGACONF_AVAILABLE

from framework.callbacks import Callback
from framework.config import resolve
from framework.errors import FwError
from framework.loggers import build_loggers, user_loggers
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


class Unfinished(Logger):
    """A Logger subclass that implements none of Logger's abstract methods."""


def test_fw_validate_and_fit_report_a_bad_logger_at_its_key_before_building_anything(tmp_path, capsys):
    """A class that is no Logger, or an abstract one: one line each at the entry's class_path, from fw validate
    and from fw fit before anything is built or written (a logger's constructor may create runs)."""
    from framework.cli import main

    config = tmp_path / "train.yaml"
    config.write_text(json.dumps({**sft_config(tmp_path / "run", []), "logging": {
        "loggers": [{"class_path": "framework.metrics.StepMetrics"}, {"class_path": "test_loggers.Unfinished"}]}}))
    abstract = ", ".join(sorted(Logger.__abstractmethods__))   # in this Lightning: log_metrics, name, version, ...
    lines = [f"{config}:1:COL: logging.loggers[{i}].class_path: {problem}" for i, problem in [
        (0, "framework.metrics.StepMetrics is not a lightning.pytorch.loggers.Logger subclass"),
        (1, f"test_loggers.Unfinished is abstract: it does not implement {abstract}")]]
    for command in ("validate", "fit"):
        assert main([command, "--config", str(config)]) == 2
        err = capsys.readouterr().err
        assert re.sub(r":1:\d+: ", ":1:COL: ", err).splitlines() == lines, (command, err)
    assert not (tmp_path / "run").exists()


class NeedsProject(CSVLogger):
    """A logger with a required argument besides the save_dir fw gives it."""

    def __init__(self, save_dir, project):
        raise AssertionError("fw validate builds no logger")


def test_a_required_logger_argument_missing_from_init_args_is_named_before_anything_is_built(tmp_path, capsys):
    """fw validate names it at the entry's init_args, as fit then would only when building the logger."""
    from framework.cli import main

    config = tmp_path / "train.yaml"
    config.write_text(json.dumps({**sft_config(tmp_path / "run", []), "logging": {
        "loggers": [{"class_path": "test_loggers.NeedsProject", "init_args": {}}]}}))
    line = ("logging.loggers[0].init_args: init_args do not fit test_loggers.NeedsProject(save_dir, project): "
            "missing a required argument: 'project'")
    for command in ("validate", "fit"):
        assert main([command, "--config", str(config)]) == 2
        assert re.sub(r"^.*:1:\d+: ", "", capsys.readouterr().err).splitlines() == [line], command
    assert not (tmp_path / "run").exists()


class CrashAt(Callback):
    """Simulates a crash right after optimizer step `step` (the steps before it are logged, and flushed by
    Lightning's handling of the error)."""

    def __init__(self, step: int):
        self.step = step

    def after_optimizer_step(self, trainer, module, optimizer):
        if module.policy_version == self.step:
            raise RuntimeError(f"simulated crash after step {self.step}")


def tb_points(log_dir, tag):
    """(step, value) of the scalar `tag` as TensorBoard shows the event files of `log_dir`: read with its own
    EventAccumulator where tensorboard is installed; else record by record (TFRecord: u64 length, u32 crc,
    the Event, u32 crc), files in name order, each SessionLog.START at step s hiding the points read before
    it with step >= s, as TensorBoard's accumulator does."""
    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    except ImportError:
        EventAccumulator = None
    if EventAccumulator is not None:
        accumulator = EventAccumulator(str(log_dir))
        accumulator.Reload()
        return [(e.step, e.value) for e in accumulator.Scalars(tag)] if tag in accumulator.Tags()["scalars"] else []
    from tensorboardX.proto.event_pb2 import Event, SessionLog

    points = []
    for path in sorted(Path(log_dir).glob("events.out.tfevents.*")):
        data, pos = path.read_bytes(), 0
        while pos + 12 <= len(data):
            (length,) = struct.unpack("<Q", data[pos:pos + 8])
            record = data[pos + 12:pos + 12 + length]
            if len(record) < length:
                break   # a record cut short by a kill
            pos += 12 + length + 4
            event = Event.FromString(record)
            if event.HasField("session_log") and event.session_log.status == SessionLog.START:
                points = [p for p in points if p[0] < event.step]
            points += [(event.step, v.simple_value) for v in event.summary.value if v.tag == tag]
    return points


def float32(x):
    return struct.unpack("<f", struct.pack("<f", x))[0]


def resume_config(run_dir, name, callbacks=()):
    cfg = sft_config(run_dir, [], csv=True)
    cfg["name"] = name
    cfg["logging"]["tensorboard"] = True
    cfg["trainer"].update(max_steps=7, log_every_n_steps=1)
    cfg["checkpoint"].update(every_n_steps=4, keep_last=None)
    cfg["callbacks"] = list(callbacks)
    return cfg


def test_a_resumed_run_continues_one_csv_and_one_tensorboard_run(tmp_path, tensorboard_writer):
    straight, broken = tmp_path / "straight", tmp_path / "broken"
    fit(resume_config(straight, "first"))
    expected = read_metrics(straight / "metrics.jsonl")
    assert [r["step"] for r in expected] == [1, 2, 3, 4, 5, 6, 7]

    crash = {"class_path": "test_loggers.CrashAt", "init_args": {"step": 6}}
    with pytest.raises(RuntimeError, match="simulated crash"):
        fit(resume_config(broken, "first", [crash]))
    logs = broken / "logs"
    assert [p.name for p in logs.iterdir()] == ["version_0"]   # CSV and TensorBoard in one folder
    log_dir = logs / "version_0"
    # steps 5 (past the checkpoint of step 4) is on disk in both: the resume logs it again
    with open(log_dir / "metrics.csv", newline="") as f:
        assert [r["step"] for r in csv.DictReader(f)] == ["1", "2", "3", "4", "5"]
    assert [s for s, _ in tb_points(log_dir, "loss")] == [1, 2, 3, 4, 5]

    fit(resume_config(broken, "second"), resume="last")
    assert [p.name for p in logs.iterdir()] == ["version_0"]
    keys = [k for k in expected[0] if k not in ("step", "tokens_per_s")]   # tokens_per_s: wall-clock
    assert {"loss", "lr", "grad_norm"} <= set(keys)
    with open(log_dir / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == [1, 2, 3, 4, 5, 6, 7]
    for row, ref in zip(rows, expected, strict=True):
        assert {k: float(row[k]) for k in keys} == {k: ref[k] for k in keys}, row["step"]
    for key in keys:   # TensorBoard keeps float32
        assert tb_points(log_dir, key) == [(r["step"], float32(r[key])) for r in expected], key
    # hparams.yaml: the config of the resumed run, as config.yaml
    hparams = yaml.safe_load((log_dir / "hparams.yaml").read_text())
    assert hparams["name"] == "second" and hparams["trainer"] == resume_config(broken, "second")["trainer"]


def csv_rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_a_resumed_csv_keeps_earlier_rows_and_columns_and_drops_a_torn_row(tmp_path):
    """Rows up to the resume step stay as written, with a column that only they have; the new run's column
    joins the header; a row past the step and a last row cut short by a kill go."""
    cfg = {"run_dir": str(tmp_path), "name": "fw", "logging": {"csv": True, "tensorboard": False, "loggers": []}}
    (_, first) = build_loggers(cfg)
    first.log_metrics({"loss": 1.5}, step=1)
    first.log_metrics({"loss": 0.5, "eval/acc": 0.25}, step=2)
    first.log_metrics({"loss": 0.375}, step=3)
    first.finalize("failed")
    path = tmp_path / "logs" / "version_0" / "metrics.csv"
    with open(path, "a") as f:
        f.write("0.1")   # step 4's row, cut short
    (_, second) = build_loggers(cfg)
    second.truncate_after(2)
    second.log_metrics({"loss": 0.25, "grad_norm": 2.0}, step=3)
    second.finalize("success")
    assert [p.name for p in (tmp_path / "logs").iterdir()] == ["version_0"]
    assert csv_rows(path) == [
        {"step": "1", "loss": "1.5", "eval/acc": "", "grad_norm": ""},
        {"step": "2", "loss": "0.5", "eval/acc": "0.25", "grad_norm": ""},
        {"step": "3", "loss": "0.25", "eval/acc": "", "grad_norm": "2.0"}]


def test_dropping_rows_never_loses_the_csv(tmp_path, monkeypatch):
    """The rows kept are written to a new file renamed over the old: a crash before the rename leaves the old
    file whole."""
    cfg = {"run_dir": str(tmp_path), "name": "fw", "logging": {"csv": True, "tensorboard": False, "loggers": []}}
    (_, first) = build_loggers(cfg)
    for step in (1, 2, 3):
        first.log_metrics({"loss": 1.0 / step}, step=step)
    first.finalize("failed")
    path = tmp_path / "logs" / "version_0" / "metrics.csv"
    before = path.read_bytes()

    def crash(*args):
        raise OSError("simulated crash before the rename")

    monkeypatch.setattr(os, "replace", crash)
    (_, second) = build_loggers(cfg)
    with pytest.raises(OSError, match="simulated crash"):
        second.truncate_after(1)
    assert path.read_bytes() == before


@pytest.mark.parametrize("opened_early", [False, True])
def test_tensorboard_resume_in_the_same_second_keeps_and_purges(tmp_path, monkeypatch, opened_early):
    """Event writers opened within one second (tensorboardX names files by the whole second, and a second
    writer's file of the same name would overwrite the first's): the earlier points stay, the resume's follow
    them, and the stale point past the resume step is hidden, also when something opened the writer before
    the resume's first metrics. tensorboardX's writer alone: torch.utils.tensorboard's file names put the process
    id and a counter before fw's suffix, so under a frozen clock their order is the counter's (in real time a
    resume's file waits for a later second: the next test)."""
    use_tensorboard_writer(monkeypatch, "tensorboardX")
    monkeypatch.setattr(time, "time", lambda: 1_700_000_000.0)
    cfg = {"run_dir": str(tmp_path), "name": "fw", "logging": {"csv": False, "tensorboard": True, "loggers": []}}
    (_, first) = build_loggers(cfg)
    for step in (1, 2, 3):
        first.log_metrics({"loss": float(step)}, step=step)
    first.finalize("failed")
    (_, second) = build_loggers(cfg)
    if opened_early:
        second.experiment.add_scalar("other", 5.0, 0)
    second.truncate_after(2)
    second.log_metrics({"loss": 30.0}, step=3)
    second.log_metrics({"loss": 40.0}, step=4)
    second.finalize("success")
    assert [p.name for p in (tmp_path / "logs").iterdir()] == ["version_0"]
    log_dir = tmp_path / "logs" / "version_0"
    assert tb_points(log_dir, "loss") == [(1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0)]
    assert tb_points(log_dir, "other") == ([(0, 5.0)] if opened_early else [])


def test_a_new_event_file_waits_for_a_later_second_than_the_folders_files(tmp_path):
    """TensorBoard reads event files in name order, which begins with the second a file was opened in: a writer
    opening in the second of a file already there waits for the next second (so a resume's points follow the
    crashed run's under either writer's names)."""
    from framework.loggers import _after_the_second_of

    start = time.monotonic()
    _after_the_second_of(tmp_path)   # nothing there: no wait
    assert time.monotonic() - start < 0.05
    now = int(time.time())
    (tmp_path / f"events.out.tfevents.{now:010d}.host.1.2.3").write_bytes(b"")
    _after_the_second_of(tmp_path)
    assert int(time.time()) > now


class Precision(enum.Enum):
    BF16 = "bf16-mixed"


def test_hparams_yaml_is_the_file_lightnings_writer_writes(tmp_path):
    """hparams.yaml of the CSV logger, byte for byte the file Lightning's `save_hparams_to_yaml` writes for the
    same values: a resolved config with values PyYAML writes in other styles (a tuple, non-ASCII text, a
    multi-line string, an Enum member, a tiny float, an int key); and from a Namespace."""
    from lightning.pytorch.core.saving import save_hparams_to_yaml

    from framework.loggers import RunCSVLogger, hparams_yaml

    def values():
        return {**sft_config(tmp_path / "run", []), "shape": (2, 3), "note": "héllo – ✓\nsecond line",
                "precision": Precision.BF16, "eps": 1e-12, 7: ["int key"]}

    RunCSVLogger(tmp_path / "run").log_hyperparams(values())
    written = (tmp_path / "run" / "logs" / "version_0" / "hparams.yaml").read_bytes()
    save_hparams_to_yaml(tmp_path / "lightning.yaml", values())
    assert written == (tmp_path / "lightning.yaml").read_bytes()
    assert [p.name for p in written_dir(tmp_path)] == ["hparams.yaml"]

    namespace = Namespace(lr=0.5, name="run-ä", layers=[1, 2])
    save_hparams_to_yaml(tmp_path / "namespace.yaml", namespace)
    assert hparams_yaml(namespace).encode() == (tmp_path / "namespace.yaml").read_bytes()


@pytest.mark.skipif(_OMEGACONF_AVAILABLE, reason="Lightning's OmegaConf path copies the values first, which a "
                                                 "lock refuses")
def test_hparams_yaml_leaves_out_a_value_pyyaml_cannot_write_as_lightning_does(tmp_path):
    from lightning.pytorch.core.saving import save_hparams_to_yaml

    from framework.loggers import hparams_yaml

    def values():
        return {"lr": 0.5, "lock": threading.Lock(), "shape": (2, 3), "name": "ü"}

    with pytest.warns(UserWarning, match="Skipping 'lock' parameter"):
        text = hparams_yaml(values())
    with pytest.warns(UserWarning, match="Skipping 'lock' parameter"):
        save_hparams_to_yaml(tmp_path / "lightning.yaml", values())
    assert text.encode() == (tmp_path / "lightning.yaml").read_bytes()
    assert yaml.full_load(text) == {"lr": 0.5, "shape": (2, 3), "name": "ü"}


def written_dir(tmp_path):
    return sorted((tmp_path / "run" / "logs" / "version_0").iterdir())


def test_an_hparams_write_that_fails_leaves_the_previous_file_alone(tmp_path):
    """Values that Lightning's writer fails on partway (a key PyYAML cannot represent) raise as they did, and
    leave the previous hparams.yaml as it was, with no temporary file beside it."""
    from framework.loggers import RunCSVLogger

    logger = RunCSVLogger(tmp_path / "run")
    logger.log_hyperparams({"lr": 0.1})
    before = (tmp_path / "run" / "logs" / "version_0" / "hparams.yaml").read_bytes()
    assert yaml.safe_load(before) == {"lr": 0.1}
    with pytest.raises(TypeError, match="cannot pickle"):
        logger.log_hyperparams({"lr": 0.2, threading.Lock(): 1})
    assert [p.name for p in written_dir(tmp_path)] == ["hparams.yaml"]
    assert (tmp_path / "run" / "logs" / "version_0" / "hparams.yaml").read_bytes() == before


class FailAtFirstStep(Callback):
    """A failure before the first point is logged (an out-of-memory error, a reward that raises)."""

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        raise RuntimeError("simulated failure in the first step")


def test_a_run_that_failed_before_logging_can_be_started_again(tmp_path, tensorboard_writer):
    """Lightning opens TensorBoard's writer at setup, so a run that fails before its first point leaves an event
    file holding only the file-version record; that is no earlier run, and the same command runs again."""
    from framework.loggers import earlier_logs

    run_dir = tmp_path / "run"
    cfg = resume_config(run_dir, "first", [{"class_path": "test_loggers.FailAtFirstStep"}])
    with pytest.raises(RuntimeError, match="simulated failure"):
        fit(cfg)
    log_dir = run_dir / "logs" / "version_0"
    assert list(log_dir.glob("events.out.tfevents.*"))   # the writer did open a file
    assert earlier_logs(run_dir) is None
    fit(resume_config(run_dir, "again"))
    assert [s for s, _ in tb_points(log_dir, "loss")] == [1, 2, 3, 4, 5, 6, 7]
    # that run's points make its folder an earlier run's logs; of the event files, the one holding them is named
    assert earlier_logs(run_dir) == log_dir / "metrics.csv"
    (log_dir / "metrics.csv").unlink()
    named = earlier_logs(run_dir)
    assert named is not None and named.name.startswith("events.out.tfevents.")
    assert len(list(log_dir.glob("events.out.tfevents.*"))) > 1 and named.stat().st_size > 40
    for f in log_dir.glob("events.out.tfevents.*"):   # a file cut short inside its first point counts too
        data = f.read_bytes()
        if len(data) > 60:
            f.write_bytes(data[:60])
        else:
            f.unlink()
    named = earlier_logs(run_dir)
    assert named is not None and len(named.read_bytes()) == 60


@pytest.mark.parametrize("writer", TENSORBOARD_WRITERS)
def test_event_files_are_read_without_tensorboardx(tmp_path, monkeypatch, writer):
    """Whether an event file holds points is read from its records alone: with tensorboardX not importable (Lightning
    then writes with torch's writer), a file holding only the writer's file-version record holds none, one with a
    scalar does, as does one cut short inside a record; an empty file holds none. Files of either writer."""
    if writer == "torch":
        pytest.importorskip("tensorboard")
        from torch.utils.tensorboard import SummaryWriter
    else:
        from tensorboardX import SummaryWriter

    from framework.loggers import _holds_events

    def written(name, points):
        writer = SummaryWriter(str(tmp_path / name))
        for step in range(points):
            writer.add_scalar("loss", 1.0 / (step + 1), step)
        writer.close()
        (f,) = (tmp_path / name).glob("events.out.tfevents.*")
        return f

    empty_run, run = written("empty", 0), written("points", 2)
    writer = SummaryWriter(str(tmp_path / "tagged"))
    writer.add_scalar("brain.Event:x", 1.0, 0)
    writer.close()
    (tagged,) = (tmp_path / "tagged").glob("events.out.tfevents.*")
    for name in [n for n in sys.modules if n.split(".")[0] == "tensorboardX"] + ["tensorboardX"]:
        monkeypatch.setitem(sys.modules, name, None)   # importing it, or any of its modules, now raises
    with pytest.raises(ImportError):
        from tensorboardX.proto.event_pb2 import Event  # noqa: F401
    assert not _holds_events(empty_run) and _holds_events(run)
    version_only = empty_run.read_bytes()
    cut = tmp_path / "cut"
    cut.write_bytes(run.read_bytes()[: len(version_only) + 5])
    assert _holds_events(cut)
    cut.write_bytes(version_only[:-3])   # inside the file-version record itself
    assert _holds_events(cut)
    cut.write_bytes(b"")
    assert not _holds_events(cut)
    # a first record that is a point, even one whose tag reads like the version string (where the writer keeps it)
    data = tagged.read_bytes()
    (length,) = struct.unpack_from("<Q", data, 0)
    cut.write_bytes(data[12 + length + 4:])   # without its file-version record
    assert _holds_events(cut)


def test_during_a_fit_only_torchs_writer_thread_leaves_its_error_to_the_writer(monkeypatch):
    """torch.utils.tensorboard's writer thread re-raises the error it keeps for its writer's caller: inside
    `quiet_event_writer_threads` that thread's error is not printed again, another thread's still reaches the hook
    that was set before, and that hook comes back afterwards."""
    pytest.importorskip("tensorboard")
    import queue as queues

    from tensorboard.summary.writer.event_file_writer import _AsyncWriterThread

    from framework.loggers import quiet_event_writer_threads

    class FullDisk:
        def write(self, data):
            raise OSError(28, "No space left on device")

    seen = []
    before = seen.append   # the hook a user (or pytest) had set
    monkeypatch.setattr(threading, "excepthook", before)

    def run(thread):
        thread.start()
        thread.join(10)

    def torch_writer_thread():
        q = queues.Queue()
        q.put(b"event")
        thread = _AsyncWriterThread(q, FullDisk(), 120)
        run(thread)
        return thread

    def failing():
        raise ValueError("another thread's error")

    with quiet_event_writer_threads():
        writer_thread = torch_writer_thread()
        run(threading.Thread(target=failing))
        assert isinstance(writer_thread.exception, OSError)   # kept for the writer's caller, who raises it
        assert [args.exc_type for args in seen] == [ValueError]
    assert threading.excepthook is before
    torch_writer_thread()   # outside a fit: the previous hook sees it again
    assert [args.exc_type for args in seen] == [ValueError, OSError]


class QuietLogger(Logger):
    """A Lightning logger that records nothing: the base of the failing ones below."""

    @property
    def name(self):
        return "quiet"

    @property
    def version(self):
        return 0

    def log_metrics(self, metrics, step=None):
        pass

    def log_hyperparams(self, params, *args, **kwargs):
        pass


class FailsToBuild(QuietLogger):
    """Refuses its tracking URI in its constructor, as MLflow's client does a sqlite store without SQLAlchemy."""

    def __init__(self, tracking_uri="sqlite:///mlflow.db"):
        raise ValueError(f"unsupported URI {tracking_uri!r} for model registry data storage")


class FailsToOpen(QuietLogger):
    """Builds, then fails when its run is first opened (`experiment`), as a W&B or MLflow logger whose server
    refuses it does."""

    @property
    def experiment(self):
        raise ConnectionError("tracking server refused the run")

    def log_hyperparams(self, params, *args, **kwargs):
        self.experiment.log(params)


class InterruptedWhileBuilding(QuietLogger):
    def __init__(self, exit_code=None):
        raise KeyboardInterrupt if exit_code is None else SystemExit(exit_code)


def test_a_logger_that_raises_while_set_up_is_one_config_error_line(tmp_path, capsys):
    """A logger whose constructor, or whose first use (the config logged as hyperparameters), raises ends
    `fw fit` with exit code 2 and one line naming logging.loggers[i], the class and the exception; the traceback
    only with --debug; an interrupt or exit still goes through as one. The run_dir is left ready for the same
    command without that logger."""
    from framework.cli import main

    def run(name, spec, *extra):
        config = tmp_path / f"{name}.yaml"
        config.write_text(json.dumps(sft_config(tmp_path / name, [spec], csv=True)))
        code = main(["fit", "--config", str(config), *extra])
        return code, capsys.readouterr().err

    build = {"class_path": "test_loggers.FailsToBuild", "init_args": {"tracking_uri": "sqlite:///x.db"}}
    code, err = run("build", build)
    assert code == 2 and "Traceback" not in err
    assert [line for line in err.splitlines() if line.startswith("fw:") and "fw plan" not in line] == [
        ("fw: error: logging.loggers[0]: building test_loggers.FailsToBuild raised ValueError: unsupported URI "
         f"'sqlite:///x.db' for model registry data storage (at {__file__}:"
         f"{FailsToBuild.__init__.__code__.co_firstlineno + 1})")]
    code, err = run("build", build, "--debug")
    assert code == 2 and "Traceback" in err and "raise ValueError(" in err

    code, err = run("open", {"class_path": "test_loggers.FailsToOpen"})
    assert code == 2 and "Traceback" not in err
    assert err.splitlines()[-1] == ("fw: error: logging.loggers[0]: test_loggers.FailsToOpen raised ConnectionError: "
                                    "tracking server refused the run when given the run's config (its first use, "
                                    "log_hyperparams)")
    # nothing was trained or logged: the same run_dir takes the command again without that logger
    config = tmp_path / "again.yaml"
    config.write_text(json.dumps(sft_config(tmp_path / "open", [], csv=True)))
    assert main(["fit", "--config", str(config)]) == 0
    assert [r["step"] for r in read_metrics(tmp_path / "open" / "metrics.jsonl")] == [1, 2, 3]

    assert run("interrupted", {"class_path": "test_loggers.InterruptedWhileBuilding"})[0] == 130
    with pytest.raises(SystemExit) as e:
        run("exited", {"class_path": "test_loggers.InterruptedWhileBuilding", "init_args": {"exit_code": 3}})
    assert e.value.code == 3


def test_readme_mlflow_sqlite_example_without_sqlalchemy_is_one_line(tmp_path, capsys):
    """The README's MLflow logger with a sqlite tracking URI, where mlflow-skinny is installed without SQLAlchemy:
    MLflow's client refuses the URI in the logger's constructor; fw says so in one line, exit code 2."""
    pytest.importorskip("mlflow")
    try:
        import sqlalchemy  # noqa: F401
        pytest.skip("SQLAlchemy is installed: MLflow serves a sqlite store")
    except ImportError:
        pass
    from framework.cli import main

    spec = {"class_path": "lightning.pytorch.loggers.MLFlowLogger",
            "init_args": {"experiment_name": "fw", "tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}"}}
    config = tmp_path / "train.yaml"
    config.write_text(json.dumps(sft_config(tmp_path / "run", [spec])))
    assert main(["fit", "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.splitlines()[-1].startswith("fw: error: logging.loggers[0]: building "
                                           "lightning.pytorch.loggers.MLFlowLogger raised ")


def test_the_run_tensorboard_logger_pickles_with_its_writer_open(tmp_path, tensorboard_writer):
    """A logger pickles as Lightning's own do (a copy of the trainer with its loggers): an open event writer (its
    queue and thread, and the guard that holds them) stays behind, as Lightning's own TensorBoardLogger leaves its
    writer."""
    import pickle

    from framework.loggers import RunTensorBoardLogger

    logger = RunTensorBoardLogger(tmp_path)
    logger.log_metrics({"loss": 1.0}, step=1)   # opens the writer
    copy = pickle.loads(pickle.dumps(logger))
    assert copy._experiment is None and copy._guard is None
    logger.finalize("success")


def test_a_non_finite_value_is_recorded_and_named_once_per_metric(tmp_path, capsys, caplog, monkeypatch):
    """tensorboardX warns `NaN or Inf found in input tensor.` for every non-finite scalar and names none: the run's
    logger names each such metric once on stderr instead, and TensorBoard's events hold the values as logged."""
    import torch
    from tensorboardX.x2num import make_np

    use_tensorboard_writer(monkeypatch, "tensorboardX")

    from framework.loggers import RunTensorBoardLogger

    logger = RunTensorBoardLogger(tmp_path)
    with caplog.at_level(logging.WARNING):
        logger.log_metrics({"grad_norm": math.inf, "loss": 1.0, "mine": torch.tensor(math.nan)}, step=1)
        logger.log_metrics({"grad_norm": -math.inf, "loss": 2.0, "mine": math.nan}, step=2)
        logger.log_metrics({"grad_norm": 0.5, "loss": 3.0, "mine": 1.0}, step=3)
        assert not caplog.records
        make_np(math.nan)   # tensorboardX's check itself is left as it is outside the logger
    assert [r.getMessage() for r in caplog.records] == ["NaN or Inf found in input tensor."]
    logger.finalize("success")
    assert capsys.readouterr().err.splitlines() == [
        "fw: warning: metric 'grad_norm' is inf at step 1; TensorBoard records it as logged (said once per metric)",
        "fw: warning: metric 'mine' is nan at step 1; TensorBoard records it as logged (said once per metric)"]
    log_dir = tmp_path / "logs" / "version_0"
    assert tb_points(log_dir, "grad_norm") == [(1, math.inf), (2, -math.inf), (3, 0.5)]
    assert tb_points(log_dir, "loss") == [(1, 1.0), (2, 2.0), (3, 3.0)]
    mine = tb_points(log_dir, "mine")
    assert [step for step, _ in mine] == [1, 2, 3] and math.isnan(mine[0][1]) and math.isnan(mine[1][1])
    assert mine[2][1] == 1.0


def test_on_screen_overwrites_from_a_carriage_return():
    assert on_screen("step 0|\rstep 1|\r      \rfw: warning\nstep 1|") == ["fw: warning", "step 1|"]
    assert on_screen("step 0|fw: warning\n\rstep 1|") == ["step 0|fw: warning", "step 1|"]


class InfiniteMetric(Callback):
    """Logs a metric that is infinite at every step."""

    def after_optimizer_step(self, trainer, module, optimizer):
        module.log_metric("mine", math.inf)


def test_a_non_finite_metric_is_named_on_a_line_of_its_own_above_the_progress_bar(tmp_path, monkeypatch,
                                                                                  tensorboard_writer):
    """A terminal shows the progress bar (stdout) and fw's warnings (stderr) on one screen: the warning of a
    non-finite metric is a line of its own, the bar drawn again below it, instead of following the bar's
    unfinished line."""
    import io
    import sys

    screen = io.StringIO()   # stdout and stderr, as one terminal receives them
    monkeypatch.setattr(sys, "stdout", screen)
    monkeypatch.setattr(sys, "stderr", screen)
    cfg = resume_config(tmp_path / "run", "bar", [{"class_path": "test_loggers.InfiniteMetric"}])
    cfg["trainer"].update(enable_progress_bar=True, max_steps=3)
    fit(cfg)
    lines = on_screen(screen.getvalue())
    warning = "fw: warning: metric 'mine' is inf at step 1; TensorBoard records it as logged (said once per metric)"
    assert [line for line in lines if "fw: warning" in line] == [warning]
    after = lines[lines.index(warning) + 1:]
    assert after and all(line.startswith("step: ") for line in after if line), after
    assert re.match(r"step: 100%.* 3/3 ", [line for line in after if line][-1])
    assert tb_points(tmp_path / "run" / "logs" / "version_0", "mine") == [(1, math.inf), (2, math.inf),
                                                                          (3, math.inf)]


def test_a_tensorboardx_writer_the_guard_cannot_read_is_named_once_and_still_written(tmp_path, capsys, monkeypatch):
    """The guard reads private attributes of tensorboardX's event writer; a tensorboardX without one (here its
    writer thread under another name) leaves the writer unguarded and says so once, naming tensorboardX's version
    and what is missing, and the run's points are still written."""
    import tensorboardX
    from tensorboardX.event_file_writer import EventFileWriter

    use_tensorboard_writer(monkeypatch, "tensorboardX")

    from framework.loggers import RunTensorBoardLogger

    opened = []
    init, close = EventFileWriter.__init__, EventFileWriter.close

    def renamed(self, *args, **kwargs):   # a tensorboardX whose writer calls its thread `_thread`
        init(self, *args, **kwargs)
        self._thread = self.__dict__.pop("_worker")
        opened.append(self)

    def close_renamed(self):
        self._worker = self.__dict__.pop("_thread", None)
        close(self)

    monkeypatch.setattr(EventFileWriter, "__init__", renamed)
    monkeypatch.setattr(EventFileWriter, "close", close_renamed)
    logger = RunTensorBoardLogger(tmp_path)
    logger.log_metrics({"loss": 1.0}, step=1)
    logger.log_metrics({"loss": 2.0}, step=2)
    logger.truncate_after(1)   # a new writer, which lacks it too: not said again
    logger.log_metrics({"loss": 3.0}, step=2)
    logger.finalize("success")
    warning = (f"fw: warning: logging.tensorboard: tensorboardX {tensorboardX.__version__}'s event writer has no "
               "EventFileWriter._worker, which fw reads to stop the run when the event file cannot be written (a "
               "full disk); without it such a run may wait forever instead. With tensorboard installed, Lightning "
               "writes through torch.utils.tensorboard, which reports that error itself")
    assert capsys.readouterr().err.splitlines() == [warning]
    assert not logger._guard.active
    assert len(opened) == 2
    assert tb_points(tmp_path / "logs" / "version_0", "loss") == [(1, 1.0), (2, 3.0)]


def test_a_writer_of_another_layout_is_left_alone_and_checks_clean(tmp_path):
    """Where the `tensorboard` package is installed, Lightning writes through torch.utils.tensorboard, whose writer
    the guard does not wrap (it hands its own errors to the caller): the guard's checks then pass, and a run logs
    through it (before, its check read an attribute set only for tensorboardX's writer: every run with
    `tensorboard` installed stopped at its first logged value)."""
    from types import SimpleNamespace

    from framework.loggers import _EventWriterGuard

    guard = _EventWriterGuard(SimpleNamespace(file_writer=SimpleNamespace()))   # no tensorboardX event writer
    assert not guard.active and not guard.thread_gone()
    guard.check()


def test_the_run_tensorboard_logger_writes_through_torch_utils_tensorboard(tmp_path, monkeypatch):
    """The other layout itself, where the `tensorboard` package is installed (Lightning then prefers it)."""
    use_tensorboard_writer(monkeypatch, "torch")
    from framework.loggers import RunTensorBoardLogger

    logger = RunTensorBoardLogger(tmp_path)
    logger.log_hyperparams({"lr": 0.1})
    logger.log_metrics({"loss": 1.0}, step=1)
    logger.finalize("success")
    assert list(tmp_path.rglob("events.out.tfevents.*"))
