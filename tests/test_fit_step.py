"""What `fw fit` does per training step besides the step itself: reads from the device, one per step.

A read is counted where the host asks a tensor for its value (`item`, `tolist`, `bool`, `float`, `int`,
`nonzero`, boolean-mask indexing, `cpu`) or makes a device tensor from host data: on a GPU each waits for
the work queued before it. The count runs through a real TorchFunctionMode over the real training loop;
torch's own calls (the optimizer's step counters live on the host) and the DataLoader's (batches are built
on the host) are left out. On CUDA, `torch.cuda.set_sync_debug_mode` counts the synchronisations themselves.
"""

import json
import os
import sys
import warnings
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode

from framework.callbacks import Callback
from framework.config import resolve
from framework.metrics import StepMetrics, read_scalars
from framework.trainer import fit

DATA = "recipes/data/arithmetic_chat.jsonl"
REPO = Path(__file__).resolve().parent.parent
TORCH_DIR = os.path.dirname(torch.__file__)
DATA_LOADING = os.path.join(TORCH_DIR, "utils", "data")
T = torch.Tensor
READS = {T.item, T.tolist, T.__bool__, T.__float__, T.__int__, T.__index__, T.nonzero, torch.nonzero, T.cpu,
         T.numpy, T.masked_select, torch.masked_select}


def _bool_index(index) -> bool:
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool
               for i in (index if isinstance(index, tuple) else (index,)))


class _Reads(TorchFunctionMode):
    def __init__(self, sink: list[str]):
        super().__init__()
        self.sink = sink

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if (func in READS or (func is T.__getitem__ and _bool_index(args[1]))
                or (func in (torch.tensor, torch.as_tensor) and kwargs.get("device") is not None
                    and not isinstance(args[0], torch.Tensor))):
            self._record(getattr(func, "__name__", str(func)))
        return func(*args, **kwargs)

    def _record(self, name: str) -> None:
        caller = sys._getframe(2)
        if caller.f_code.co_filename.startswith(TORCH_DIR):
            return
        frame = caller
        while frame is not None:
            if frame.f_code.co_filename.startswith(DATA_LOADING):
                return
            frame = frame.f_back
        path = Path(caller.f_code.co_filename).resolve()
        where = path.relative_to(REPO) if path.is_relative_to(REPO) else path
        self.sink.append(f"{name} {where}:{caller.f_code.co_name}")


class HostReads(Callback):
    """The host reads of each policy step, from the start of its first batch to the start of the next step's
    (its batch end: metrics, checks, checkpoint callback; the next batch's fetch and copy)."""

    def __init__(self):
        self.sink: list[str] = []
        self.steps: list[list[str]] = []
        self._step = None
        self._mode = None

    def on_train_start(self, trainer, module):
        self._mode = _Reads(self.sink)
        self._mode.__enter__()

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if trainer.global_step != self._step:
            self._step = trainer.global_step
            self.steps.append(self.sink[:])
            self.sink.clear()

    def on_train_end(self, trainer, module):
        self._mode.__exit__(None, None, None)


def sft_cfg(tmp_path, **trainer):
    return resolve({
        "recipe": "sft", "run_dir": str(tmp_path / "run"), "model": {"policy": {"preset": "tiny"}},
        "data": {"path": DATA, "max_seq_len": 64, "batch_size": 2},
        "trainer": {"accelerator": "cpu", "max_steps": 5, "enable_progress_bar": True, **trainer},
        "checkpoint": {"every_n_steps": 100}, "logging": {"csv": True, "tensorboard": True},
        "callbacks": [{"class_path": "test_fit_step.HostReads"}]})


def of_fw(reads: list[str]) -> Counter:
    """The reads made by fw's training path (framework/, recipes/); ops_cuda's and the models' are left out
    (packed attention reads its sequence count and longest sequence, as the bare benchmark step does)."""
    return Counter(r for r in reads if r.split()[1].startswith(("framework/", "recipes/")))


@pytest.mark.parametrize("log_every, accumulate", [(1, 1), (2, 2)])
def test_a_fit_step_reads_the_device_once(tmp_path, log_every, accumulate):
    trainer = fit(sft_cfg(tmp_path, log_every_n_steps=log_every, accumulate_grad_batches=accumulate))
    counter = next(c for c in trainer.callbacks if isinstance(c, HostReads))
    # steps[0]: before the first batch; steps[1]: step 1 (optimizer set-up); steps 2..4: full steps recorded
    # at the next step's start (step 5, the last, checkpoints and is not recorded)
    full = counter.steps[2:]
    assert len(full) == 3
    for reads in full:
        # one batched transfer per step: the non-finite checks, with the metrics when the step is logged
        assert of_fw(reads) == Counter({"tolist framework/metrics.py:read_scalars": 1}), reads
    logged = [json.loads(ln)["step"] for ln in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert logged == ([1, 2, 3, 4, 5] if log_every == 1 else [2, 4, 5])


class SyncWarnings(Callback):
    """The synchronisations `torch.cuda.set_sync_debug_mode("warn")` reports in each policy step, as the
    file:line of the Python code that caused them."""

    def __init__(self):
        self.steps: list[list[str]] = []
        self._step = None

    def on_train_start(self, trainer, module):
        self._catch = warnings.catch_warnings(record=True)
        self.records = self._catch.__enter__()
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if trainer.global_step != self._step:
            self._step = trainer.global_step
            self.steps.append([f"{Path(w.filename).resolve()}:{w.lineno}" for w in self.records
                               if "synchroniz" in str(w.message)])
            self.records.clear()

    def on_train_end(self, trainer, module):
        torch.cuda.set_sync_debug_mode("default")
        self._catch.__exit__(None, None, None)


@pytest.mark.gpu
def test_a_cuda_fit_step_synchronises_once(tmp_path):
    """On the GPU itself, per step: one synchronisation from fw's training path (the batched read); the
    models' packed attention has its own two, as in the bare benchmark step."""
    cfg = sft_cfg(tmp_path, accelerator="gpu", devices=1, precision="bf16-mixed", log_every_n_steps=1)
    cfg["callbacks"] = [{"class_path": "test_fit_step.SyncWarnings", "init_args": {}}]
    trainer = fit(cfg)
    sync = next(c for c in trainer.callbacks if isinstance(c, SyncWarnings))
    assert len(sync.steps) == 5
    for where in sync.steps[2:]:
        mine = [w for w in where if w.startswith((str(REPO / "framework"), str(REPO / "recipes")))
                and not w.startswith(str(REPO / "framework" / "models"))]
        assert len(mine) == 1 and "metrics.py" in mine[0], where


@pytest.mark.gpu
def test_fit_profile_names_where_each_synchronisation_comes_from(tmp_path):
    from benchmarks.fit_profile import main

    out = main(["--config", "recipes/sft.yaml", "--trace", str(tmp_path / "t.json"), "--model.policy.preset=tiny",
                "--trainer.accelerator=gpu", "--trainer.precision=bf16-mixed", "--trainer.log_every_n_steps=1",
                "--logging.tensorboard=false", "--warmup", "1", "--steps", "2", "--stacks"])
    lines = out.splitlines()
    syncs = next(ln for ln in lines if ln.startswith("| cudaStreamSynchronize calls"))
    mean_syncs = float(syncs.strip().strip("|").split("|")[-1])
    for name in ("cudaDeviceSynchronize", "cudaEventSynchronize"):
        row = next(ln for ln in lines if ln.startswith(f"| {name} calls"))
        mean_syncs += float(row.strip().strip("|").split("|")[-1])
    start = lines.index("| synchronisations a step | which, in which ops; where (innermost first) |")
    sites = lines[start + 2:]
    assert mean_syncs >= 1 and sites, out   # fw's own read at least
    assert sum(float(ln.strip("|").split("|")[0]) for ln in sites) == pytest.approx(mean_syncs), out
    assert all(" in " in ln for ln in sites), out   # each names its synchronisation and its enclosing ops


@pytest.mark.gpu
def test_sft_batches_come_pinned_for_a_cuda_device(tmp_path):
    from framework.data import sft_dataloader
    from framework.module import FwModule

    module = FwModule(sft_cfg(tmp_path))
    loader = sft_dataloader(module.recipe.stream, 0, module.cfg, module.tokenizer.pad_id, 0, 1, pin_memory=True)
    batch = next(iter(loader))
    assert all(batch[k].is_pinned() for k in ("input_ids", "position_ids", "targets", "loss_index"))


def test_metrics_read_ahead_with_other_values_in_one_transfer():
    m = StepMetrics()
    m.update("loss", torch.tensor(2.0), torch.tensor(1.0))
    m.update("loss", torch.tensor(4.0), 3.0)   # a Python weight: filled in on the device
    m.update("tokens", 5, reduce="sum")
    m.update("lr", torch.tensor(0.25), reduce="last")
    assert m.read_ahead([torch.tensor(7.0), torch.tensor(True)]) == [7.0, 1.0]
    assert m.compute() == {"loss": 3.5, "tokens": 5.0, "lr": 0.25}   # (2 + 12) / 4
    # a value logged after the read-ahead joins the interval: compute reads again
    m.update("loss", torch.tensor(1.0), 1.0)
    m.read_ahead([])
    m.update("loss", torch.tensor(3.0), 1.0)
    assert m.compute() == {"loss": 2.0}
    m.update("loss", torch.tensor(float("nan")), 1.0)
    m.read_ahead([])
    with pytest.raises(Exception, match="metric 'loss' is NaN"):
        m.compute()


def test_a_user_value_that_is_not_one_number_is_refused_naming_the_metric():
    """User code's log_metric takes one real number a call: a string, None or a list names the metric (it was
    float()'s own error), a tensor of 3 values is refused rather than reduced element by element; one-element
    tensors of any shape, Python and numpy numbers, and bools stay accepted."""
    import numpy as np

    m = StepMetrics()
    for bad, error, text in (("0.5", TypeError, "got str '0.5'"), (None, TypeError, "got NoneType None"),
                             ([1.0, 2.0], TypeError, "got list"), (torch.ones(3), ValueError, "shape \\(3,\\)"),
                             (torch.tensor(1j), ValueError, "complex64")):
        with pytest.raises(error, match=f"log_metric\\('user/x'\\): .*{text}"):
            m.update("user/x", bad, user=True, site="here.py:1")
    for good in (torch.tensor([[2.0]]), 3, np.float32(4.0), True):
        m.update("user/y", good, user=True, site="here.py:2")
    assert m.compute() == {"user/y": 2.5}   # (2 + 3 + 4 + 1) / 4


def test_read_scalars_keeps_order_across_devices():
    values = [torch.tensor(1.5), torch.tensor(3, dtype=torch.long), torch.tensor([False]), torch.tensor(-2.0)]
    if torch.cuda.is_available():
        values[1] = values[1].cuda()
    assert read_scalars(values) == [1.5, 3.0, 0.0, -2.0]


@pytest.mark.parametrize("stacks", [False, True], ids=["ops", "with-stacks"])
def test_fit_profile_prints_its_table_and_writes_a_trace(tmp_path, capsys, stacks):
    from benchmarks.fit_profile import main

    trace = tmp_path / "trace.json"
    out = main(["--config", "recipes/sft.yaml", "--trace", str(trace), "--model.policy.preset=tiny",
                "--trainer.accelerator=cpu", "--trainer.enable_progress_bar=false", "--data.max_seq_len=64",
                "--data.batch_size=2", "--logging.tensorboard=false", "--warmup", "1", "--steps", "3"]
               + (["--stacks"] if stacks else []))
    lines = out.splitlines()
    assert lines[0].startswith("fw fit profile: recipe sft, model tiny, 32-true, 2 x 64, CPU; 1 warm-up steps")
    header = next(ln for ln in lines if ln.startswith("| |"))
    assert header == "| | step 2 | step 3 | step 4 | mean |"
    cells = [[c.strip() for c in ln.strip().strip("|").split("|")] for ln in lines if ln.startswith("| ")]
    rows = {c[0]: c[1:] for c in cells}
    walls = [float(v) for v in rows["wall s"]]
    assert all(w > 0 for w in walls) and walls[3] == pytest.approx(sum(walls[:3]) / 3, abs=1e-4)
    assert rows["cudaStreamSynchronize calls"] == ["0"] * 4   # no CUDA on this run
    ops = [k for k in rows if k.startswith("self CPU ms: ")]
    assert len(ops) == 12 and any("aten::mm" in k or "aten::addmm" in k or "aten::bmm" in k for k in ops)
    assert not any(".py(" in k or "<built-in" in k for k in ops)   # --stacks' Python frames are not ops
    events = json.loads(trace.read_text())["traceEvents"]
    assert sum(e.get("name") == "fw_profile_boundary" for e in events) == 4   # 3 windows: 4 boundaries
    assert out in capsys.readouterr().out


def test_enclosing_ops_names_the_ranges_around_an_event_innermost_first():
    from torch.profiler import ProfilerActivity, profile, record_function

    from benchmarks.fit_profile import enclosing_ops

    with profile(activities=[ProfilerActivity.CPU]) as prof, record_function("outer"), record_function("inner"):
        torch.ones(4, 4) @ torch.ones(4, 4)
    mm = next(e for e in prof.events() if e.name == "aten::mm")
    assert enclosing_ops(mm).startswith("aten::matmul < inner < outer")
    top = next(e for e in prof.events() if e.name == "outer")
    assert enclosing_ops(top) == "(no enclosing op)"


def test_python_stack_comes_from_the_nearest_range_that_has_one():
    from torch.profiler import ProfilerActivity, profile, record_function

    from benchmarks.fit_profile import python_stack

    def here():
        with record_function("site"):
            torch.ones(3) + 1

    with profile(activities=[ProfilerActivity.CPU], with_stack=True) as prof:
        here()
    add = next(e for e in prof.events() if e.name == "aten::add")
    fill = next(e for e in prof.events() if e.name == "aten::fill_")   # inside aten::ones: a stack of its own or not
    assert any("here" in frame for frame in python_stack(add))
    assert any("here" in frame for frame in python_stack(fill))


def _x(cat, name, ts, dur, tid=1, **args):
    return {"ph": "X", "cat": cat, "name": name, "pid": 7, "tid": tid, "ts": ts, "dur": dur, "args": args}


def test_trace_gaps_charges_each_idle_stretch_to_the_launch_that_ends_it(tmp_path):
    from benchmarks.trace_gaps import analyse, load, main

    # one window, 100..200 µs (boundaries end at 100 and 200; the second starts at 190). Kernels: 100-110 and
    # 105-120 (two streams, overlapping), 150-160, 170-185. Idle: 120-150 (30 µs, ended by the copy that
    # aten::item queued in recipes/losses.py), 160-170 (10 µs, ended by a graph launch under a record_function
    # range) and 185-190 (5 µs, the window's end).
    events = [
        _x("user_annotation", "fw_profile_boundary", 90, 10), _x("user_annotation", "fw_profile_boundary", 190, 10),
        _x("kernel", "k0", 100, 10, tid=50, correlation=1), _x("kernel", "k1", 105, 15, tid=51, correlation=2),
        _x("kernel", "k2", 150, 10, tid=50, correlation=3), _x("gpu_memcpy", "copy", 170, 15, tid=50, correlation=4),
        _x("python_function", "lightning/pytorch/loops/loop.py(10): run", 95, 95),
        _x("python_function", "/repo/recipes/rl.py(581): on_batch", 112, 45),
        _x("python_function", "/repo/recipes/losses.py(88): reduce", 120, 30),
        _x("cpu_op", "aten::item", 125, 20),
        _x("cuda_runtime", "cudaLaunchKernel", 140, 2, correlation=3),
        _x("python_function", "/repo/framework/rollout/engine.py(459): _decode", 158, 14),
        _x("user_annotation", "fw.rollout.decode", 159, 12),
        _x("cuda_runtime", "cudaGraphLaunch", 165, 3, correlation=4),
        _x("cuda_runtime", "cudaLaunchKernel", 96, 2, correlation=1),
        _x("cuda_runtime", "cudaLaunchKernel", 99, 2, correlation=2),
    ]
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": events + [{"ph": "M", "name": "process_name", "pid": 7}]}))
    report = analyse(load(path))
    assert report["windows"] == [{"wall_us": 100.0, "idle_us": 45.0}]
    by_launch = {k: tuple(v) for k, v in report["by_launch"].items()}
    assert by_launch == {
        "recipes/losses.py(88): reduce < recipes/rl.py(581): on_batch; op aten::item": (30.0, 1),
        "framework/rollout/engine.py(459): _decode; ranges fw.rollout.decode": (10.0, 1),
        "(window's end: the host's last work)": (5.0, 1)}
    by_host = {k: tuple(v) for k, v in report["by_host"].items()}
    assert by_host == {"recipes/losses.py(88): reduce < recipes/rl.py(581): on_batch": (30.0, 1),
                       "framework/rollout/engine.py(459): _decode": (10.0, 1),
                       "lightning/pytorch/loops/loop.py(10): run": (5.0, 1)}
    out = main([str(path), "--min-us", "8"])   # the 5 µs gap counts in the total only
    assert out.splitlines()[0] == "1 window(s): wall 0.10 ms, GPU idle 0.04 ms a window (45.0%)"
    assert "| 0.03 | 1 | `recipes/losses.py(88): reduce < recipes/rl.py(581): on_batch; op aten::item` |" in out
    assert "| 0.01 | 1 | `framework/rollout/engine.py(459): _decode; ranges fw.rollout.decode` |" in out
    assert "window's end" not in out
    # without --stacks' Python frames the main thread's ranges and innermost op say what it was doing
    bare = [e for e in events if e["cat"] != "python_function"]
    by_host = {k: tuple(v) for k, v in analyse(bare)["by_host"].items()}
    assert by_host == {"op aten::item": (30.0, 1), "ranges fw.rollout.decode; op cudaGraphLaunch": (10.0, 1),
                       "(outside every range and op)": (5.0, 1)}


def test_an_rl_step_names_its_phases_for_the_profiler(tmp_path):
    from benchmarks.fit_profile import main as profile_main
    from benchmarks.trace_gaps import Thread, load
    from benchmarks.trace_gaps import main as gaps_main

    trace = tmp_path / "t.json"
    profile_main(["--config", "train.yaml", "--trace", str(trace), "--trainer.accelerator=cpu",
                  "--trainer.log_every_n_steps=1", "--logging.tensorboard=false", "--warmup", "1", "--steps", "1"])
    events = load(trace)
    main_thread = Thread()
    main_thread.events = [e for e in events if e.get("cat") == "user_annotation"]
    main_thread.index()

    def inside(name: str) -> set[str]:   # the ranges around each range called `name`
        return {p["name"] for e in main_thread.events if e["name"] == name
                for p in main_thread.around(e["ts"] + e["dur"] / 2) if p is not e}

    step = {"fw.training_step"}
    for name in ("fw.rl.prompts", "fw.rl.generate", "fw.rl.reward", "fw.rl.loss", "fw.backward",
                 "fw.optimizer_step"):
        assert step <= inside(name), name
    assert {"fw.rl.generate", "fw.training_step"} <= inside("fw.rollout.result")
    assert {"fw.rl.generate"} <= inside("fw.rollout.decode")
    assert "fw.metrics.flush" in {e["name"] for e in main_thread.events}
    out = gaps_main([str(trace)])   # no device here: the window is one stretch with nothing queued
    assert out.startswith("1 window(s): wall ") and "| 1 | `(window's end: the host's last work)` |" in out
