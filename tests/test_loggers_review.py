"""The run's CSV and metrics.jsonl across a kill and a resume, with awkward metric names and values, and `fw plot`
on metrics.jsonl files that fw did not write whole: a resume keeps every earlier row, and a file that is no
metrics.jsonl is one line, exit 2."""

import csv
import json
import math

import pytest

from framework.cli import main
from framework.errors import FwError
from framework.loggers import build_loggers
from framework.metrics import JsonlLogger, read_metrics
from framework.plot import series


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


def test_a_resume_after_a_kill_that_cut_only_a_records_newline_keeps_metrics_jsonl_readable(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 1.0}\n{"step": 2, "loss": 0.5}')   # step 2's newline not written
    logger = JsonlLogger(path, name="fw")
    logger.truncate_after(2)
    logger.log_metrics({"loss": 0.25}, step=3)
    logger.finalize("success")
    assert read_metrics(path) == [{"step": 1, "loss": 1.0}, {"step": 2, "loss": 0.5}, {"step": 3, "loss": 0.25}]


def test_truncating_metrics_jsonl_refuses_a_line_it_cannot_place_and_keeps_the_file(tmp_path):
    """The resume checks metrics.jsonl at start-up (tests/test_resume.py); a line it cannot place that appears
    later, by the first record, is the same one line, and the file stays as it is."""
    path = tmp_path / "metrics.jsonl"
    text = b'{"step": 1, "loss": 1.0}\n[1, 2]\n{"step": 2, "loss": 0.5}\n'
    path.write_bytes(text)
    with pytest.raises(FwError, match=rf'^{path}:2: not a metrics record \(an array, not an object\); a resume '
                                      r'expects a JSON object with a number or null "step" on every line'):
        JsonlLogger(path, name="fw").truncate_after(1)
    assert path.read_bytes() == text


def test_truncating_metrics_jsonl_keeps_each_step_by_its_own_value_and_stepless_lines_before_the_first_past(tmp_path):
    """A line with a step is kept by its step alone; one without is kept only before the first line past the
    checkpoint, after which the resumed run logs it again."""
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": null, "a": 1}\n{"step": 5}\n{"b": 2}\n{"step": 3.0}\n{"step": 2}\n')
    JsonlLogger(path, name="fw").truncate_after(3)
    assert path.read_text() == '{"step": 1}\n{"step": null, "a": 1}\n{"step": 3.0}\n{"step": 2}\n'


@pytest.mark.parametrize(("text", "where"), [
    (b'{"step": 1, "loss": 1.0}\n5\n', "2: not a metrics record (a number, not an object)"),
    (b'[1, 2]\n{"step": 1, "loss": 1.0}\n', "1: not a metrics record (an array, not an object)"),
    (b'{"step": 1, "loss": 1.0}\n{"step": "two", "loss": 0.5}\n',
     "2: not a metrics record (its step is 'two', not a finite number)"),
    (b'{"step": 1e400, "loss": 1.0}\n', "1: not a metrics record (its step is inf, not a finite number)"),
    (b'{"step": true, "loss": 1.0}\n', "1: not a metrics record (its step is True, not a finite number)"),
    (b'{"step": 1, "loss": 1.0}\n{"step": 2, "loss": "\xff"}\n', "2:22: not UTF-8 (byte 0xff); save the file as UTF-8"),
])
def test_plot_of_a_file_that_is_no_metrics_jsonl_is_one_line(tmp_path, capsys, text, where):
    (tmp_path / "metrics.jsonl").write_bytes(text)
    assert main(["plot", "--run", str(tmp_path), "--metrics", "loss"]) == 2
    assert capsys.readouterr().err == f"fw: error: {tmp_path / 'metrics.jsonl'}:{where}\n"
    assert not (tmp_path / "metrics.png").exists()


def test_plot_draws_one_point_a_torn_last_line_missing_metrics_and_non_numeric_values(tmp_path, capsys):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (a / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 2.0}) + "\n" + '{"step": 2, "lo')
    records = [{"step": 1, "loss": "nan", "eval/loss": 3.0}, {"step": 2, "loss": "inf"}, {"step": 3, "loss": 0.5},
               {"step": None, "loss": 9.0}, {"step": 4, "loss": True}, {"step": 5, "loss": [1]}]
    (b / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / "out.png"
    assert main(["plot", "--run", str(a), "--run", str(b), "--metrics", "loss,eval/loss", "--out", str(out)]) == 0
    assert capsys.readouterr().out == f"wrote {out}\n"
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert series(read_metrics(a / "metrics.jsonl"), "loss") == ([1], [2.0])
    assert series(read_metrics(b / "metrics.jsonl"), "loss") == ([3], [0.5])
    assert series(read_metrics(a / "metrics.jsonl"), "eval/loss") == ([], [])
