"""A user logger (`logging.loggers`) whose `log_metrics`, `log_graph`, `save` or `finalize` raises, in `fw fit`: a
FwError is one `fw: error:` line naming the entry and the method (exit code 2), any other exception keeps its
traceback, and an exception of `finalize("failed")`, which Lightning calls while another error ends the run, leaves
that error the run's. The checkpoints published before the failure are read back whole."""

import json
from pathlib import Path

import lightning
import pytest
from lightning.pytorch.loggers import Logger

from framework.errors import FwError


class RaisesIn(Logger):
    """A Lightning logger that records nothing and raises in `method` (log_metrics, log_graph, save or finalize) at its
    `call`-th call (finalize: when its status is `status`): a FwError (`error: fw`) or a ValueError. Each call is
    written to the file `calls` (a line: the method and its argument)."""

    def __init__(self, method: str, calls: str, error: str = "value", call: int = 1, status: str = "success"):
        super().__init__()
        self.method, self.calls, self.error, self.call, self.status = method, calls, error, call, status
        self.seen = 0

    @property
    def name(self):
        return "raises"

    @property
    def version(self):
        return 0

    def log_metrics(self, metrics, step=None):
        self._maybe_raise("log_metrics", str(step))

    def log_hyperparams(self, params, *args, **kwargs):
        pass

    def _maybe_raise(self, method: str, arg: str = "") -> None:
        with open(self.calls, "a") as f:
            f.write(f"{method} {arg}\n")
        if method != self.method or (method == "finalize" and arg != self.status):
            return
        self.seen += 1
        if self.seen == self.call:
            if self.error == "fw":
                raise FwError(f"my_logger.project: no such project ({method})")
            raise ValueError(f"a bug in my_logger.{method}")

    def log_graph(self, model, input_array=None):
        self._maybe_raise("log_graph")

    def save(self):
        self._maybe_raise("save")

    def finalize(self, status):
        self._maybe_raise("finalize", status)


class FailAtStep(lightning.Callback):
    """Raises a FwError in the batch end of policy step `step`."""

    def __init__(self, step: int):
        self.step = step

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            raise FwError(f"my_callback.limit: reached at step {self.step}")


ROOT = Path(__file__).resolve().parent.parent


def fit_with(tmp_path: Path, capsys: pytest.CaptureFixture, logger: dict,
             callbacks: list | None = None) -> tuple[int, list[str], Path]:
    """`fw fit` (in this process) of 4 SFT steps with a checkpoint every 2 and the `RaisesIn` logger `logger`: its exit
    code, the lines of its stderr that start with `fw:` or `Traceback` (the plan and the data's note aside), its
    run_dir."""
    from framework.cli import main

    tmp_path.mkdir(parents=True, exist_ok=True)
    run = tmp_path / "run"
    cfg = {"recipe": "sft", "seed": 1, "run_dir": str(run), "model": {"policy": {"preset": "tiny"}},
           "data": {"path": str(ROOT / "recipes" / "data" / "arithmetic_chat.jsonl"), "max_seq_len": 64,
                    "batch_size": 2},
           "trainer": {"accelerator": "cpu", "max_steps": 4, "enable_progress_bar": False},
           "checkpoint": {"every_n_steps": 2}, "callbacks": callbacks or [],
           "logging": {"csv": False, "tensorboard": False, "loggers": [
               {"class_path": "test_logger_failures.RaisesIn",
                "init_args": {"calls": str(tmp_path / "calls"), **logger}}]}}
    path = tmp_path / "config.yaml"
    path.write_text(json.dumps(cfg))   # JSON is YAML
    code = main(["fit", "--config", str(path)])
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith(("fw:", "Traceback")) and not ln.startswith("fw plan")
             and not ln.startswith("fw: data.path:")]
    return code, lines, run


def checkpoints(run: Path) -> list[str]:
    """The checkpoints of `run`, each read back whole (every file against its recorded size and hash)."""
    from framework import checkpoint as ck

    found = sorted(p.name for p in (run / "checkpoints").iterdir()) if (run / "checkpoints").is_dir() else []
    for name in found:
        ck.verify_checkpoint(run / "checkpoints" / name)
    return found


def expected(method: str) -> list[str]:
    return [(f"fw: error: logging.loggers[0]: test_logger_failures.RaisesIn.{method} raised: "
             f"my_logger.project: no such project ({method})")]


@pytest.mark.parametrize("method, call, saved", [
    ("log_graph", 1, []),                    # as training starts
    ("log_metrics", 3, ["step-000002"]),     # step 3's record
    ("finalize", 1, ["step-000002", "step-000004"]),   # finalize("success"), after the last checkpoint
])
def test_a_fw_error_of_a_user_loggers_method_is_one_line_naming_the_entry_and_the_method(tmp_path, capsys, method,
                                                                                         call, saved):
    code, lines, run = fit_with(tmp_path, capsys, {"method": method, "call": call, "error": "fw"})
    assert code == 2, lines
    assert lines == expected(method)
    assert checkpoints(run) == saved


def test_a_user_loggers_save_failing_names_it_or_keeps_its_traceback(tmp_path, capsys):
    """`save`'s third call, the flush before step 4's checkpoint: a FwError is one line naming it (exit code 2); a
    ValueError leaves `main` as it was raised, for Python to print its traceback and exit with code 1, as a user
    callback's does. Either way the checkpoint of step 2 is whole and step 4's is not written."""
    code, lines, run = fit_with(tmp_path / "fw", capsys, {"method": "save", "call": 3, "error": "fw"})
    assert code == 2, lines
    assert lines == expected("save")
    assert checkpoints(run) == ["step-000002"]

    with pytest.raises(ValueError) as e:
        fit_with(tmp_path / "value", capsys, {"method": "save", "call": 3})
    assert str(e.value) == "a bug in my_logger.save" and e.traceback[-1].name == "_maybe_raise"
    run = tmp_path / "value" / "run"
    assert checkpoints(run) == ["step-000002"]
    # the traceback ends with what the run kept: the checkpoint of step 2, step 4's unwritten
    note = (f"fw: the run ended at step 4 on this error; the newest checkpoint is {run / 'checkpoints' / 'step-000002'}"
            f", and what came after it is not saved; continue with fw fit --config {run / 'config.yaml'} --resume last")
    assert e.value.__notes__ == [note]


@pytest.mark.parametrize("error", ["value", "fw"])
def test_a_logger_failing_to_finalize_a_failed_run_leaves_the_runs_error_its_own(tmp_path, capsys, error):
    """A callback's FwError at step 3 ends the run: Lightning then calls `finalize("failed")`, which raises. The run
    still ends with the callback's line and exit code 2, the logger's failure one line before it."""
    stop = {"class_path": "test_logger_failures.FailAtStep", "init_args": {"step": 3}}
    code, lines, run = fit_with(tmp_path, capsys, {"method": "finalize", "status": "failed", "error": error}, [stop])
    assert code == 2, lines
    raised = "ValueError: a bug in my_logger.finalize" if error == "value" else \
        "FwError: my_logger.project: no such project (finalize)"
    assert lines == [(f"fw: warning: logging.loggers[0]: test_logger_failures.RaisesIn.finalize raised {raised} "
                      "while the run ended on an earlier error, reported below"),
                     "fw: error: my_callback.limit: reached at step 3"]
    assert checkpoints(run) == ["step-000002"]
    assert (tmp_path / "calls").read_text().splitlines()[-1] == "finalize failed"   # it was called, and raised
