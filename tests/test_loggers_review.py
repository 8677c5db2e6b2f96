"""The run's CSV and metrics.jsonl across a kill and a resume, with awkward metric names and values, and `fw plot`
on metrics.jsonl files that fw did not write whole: a resume keeps every earlier row, and a file that is no
metrics.jsonl is one line, exit 2."""

import csv
import math

import pytest

from framework.loggers import build_loggers


def csv_cfg(run_dir):
    return {"run_dir": str(run_dir), "name": "fw", "logging": {"csv": True, "tensorboard": False, "loggers": []}}


def csv_rows(run_dir):
    with open(run_dir / "logs" / "version_0" / "metrics.csv", newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


# a comma, a quote, CR and LF (which the csv module quotes), non-ASCII text, and characters str.splitlines
# breaks a line at but the csv module writes unquoted: form feed, NEL, U+2028
@pytest.mark.parametrize("name", ["a,b", 'say "hi"', "two\nlines", "cr\rname", "lösung/ü🙂", "ff\x0cname",
                                  "nel\x85name", "ls\u2028name"])
def test_a_resumed_csv_keeps_its_rows_whatever_the_metric_names(tmp_path, name):
    (_, first) = build_loggers(csv_cfg(tmp_path))
    first.log_metrics({"loss": 1.5, name: 2.0}, step=1)
    first.log_metrics({"loss": 0.5, name: 3.0}, step=2)
    first.log_metrics({"loss": 0.375, name: 9.0}, step=3)   # past the checkpoint: written again below
    first.finalize("failed")
    with open(tmp_path / "logs" / "version_0" / "metrics.csv", "a", newline="") as f:
        f.write("0.1,")   # step 4's row, cut short by a kill
    (_, second) = build_loggers(csv_cfg(tmp_path))
    second.truncate_after(2)
    second.log_metrics({"loss": 0.25, name: 4.0}, step=3)
    second.log_metrics({"loss": 0.125, name: 5.0, "grad_norm": 1.0}, step=4)   # a new column: the file rewritten
    second.finalize("success")
    assert csv_rows(tmp_path) == [
        {"step": "1", "loss": "1.5", name: "2.0", "grad_norm": ""},
        {"step": "2", "loss": "0.5", name: "3.0", "grad_norm": ""},
        {"step": "3", "loss": "0.25", name: "4.0", "grad_norm": ""},
        {"step": "4", "loss": "0.125", name: "5.0", "grad_norm": "1.0"}]


def test_a_resumed_csv_keeps_non_finite_values_and_hundreds_of_columns(tmp_path):
    names = [f"user/m{i:03d}" for i in range(300)]
    (_, first) = build_loggers(csv_cfg(tmp_path))
    first.log_metrics({"loss": math.nan, "grad_norm": math.inf, **{n: float(i) for i, n in enumerate(names)}}, step=1)
    first.log_metrics({"loss": 1.0, "grad_norm": -math.inf}, step=2)
    first.finalize("failed")
    (_, second) = build_loggers(csv_cfg(tmp_path))
    second.truncate_after(1)
    second.log_metrics({"loss": 0.5, "user/new": 7.0}, step=2)
    second.finalize("success")
    rows = csv_rows(tmp_path)
    assert len(rows) == 2 and set(rows[0]) == {"step", "loss", "grad_norm", "user/new", *names}
    assert (rows[0]["loss"], rows[0]["grad_norm"], rows[0]["user/m299"], rows[0]["user/new"]) == ("nan", "inf",
                                                                                                   "299.0", "")
    assert (rows[1]["step"], rows[1]["loss"], rows[1]["grad_norm"], rows[1]["user/new"]) == ("2", "0.5", "", "7.0")
    assert all(rows[1][n] == "" for n in names)
