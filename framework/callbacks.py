"""fw callbacks: Lightning's `Callback` plus hooks around every real optimizer step, and the built-ins.

Order around each optimizer step (automatic and manual optimization, every optimizer):
gradients final -> clipped -> `before_optimizer_step` -> `optimizer.step()` -> `after_optimizer_step`
-> LR scheduler stepped (policy). Accumulation micro-steps fire nothing. At the end of the batch that
completes a step, the step's non-finite checks are read and raise (`StopOnNonFinite`), the evaluation
runs when due, the metrics are logged (`MetricsLogger`, every `log_every_n_steps`), user callbacks'
`on_train_batch_end` run, a stop request (a signal's, or `trainer.should_stop` set by a callback on any
rank) is taken by every rank (`StopOnSignal`), the last steps of an early stop are logged
(`FlushOnEarlyStop`), then the checkpoint callback's `on_train_batch_end` runs, in that order.
"""

from __future__ import annotations

import atexit
import contextlib
import math
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, NoReturn

import lightning
import torch
from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.callbacks.progress.tqdm_progress import convert_inf

from framework.cadence import crossed
from framework.console import say
from framework.errors import ConfigError, FwError
from framework.evaluation import (
    HELD_OUT_ENTRY,
    HELD_OUT_KEY,
    Evaluation,
    check_source,
    continued_steps,
    data_position,
    from_rank_zero,
    held_out_record,
    needs_draws,
)
from framework.metrics import StepMetrics, read_scalars
from framework.optim import grad_norm
from framework.signals import Stopped, StopSignals


class Callback(lightning.Callback):
    """A Lightning callback with two more hooks, fired exactly once around every real optimizer step.

    `optimizer` is the torch optimizer being stepped: the policy's, or the critic's in PPO
    (`module.optimizer_role(optimizer)` says which). Count steps with `module.policy_version`: it is
    incremented between the two hooks of a policy step in both modes, whereas Lightning updates
    `trainer.global_step` after the hook under automatic optimization and before it under manual.
    """

    def before_optimizer_step(self, trainer: lightning.Trainer, module: lightning.LightningModule,
                              optimizer: Any) -> None:
        """After gradients are final and clipped, before the parameters change."""

    def after_optimizer_step(self, trainer: lightning.Trainer, module: lightning.LightningModule,
                             optimizer: Any) -> None:
        """After the parameters changed, before the LR scheduler steps (`module.last_metrics` holds the
        previously logged metrics; this step's are logged at the end of the batch)."""


def fire(trainer: lightning.Trainer, module: lightning.LightningModule, hook: str, optimizer: Any) -> None:
    """Call `hook` ("before_optimizer_step" / "after_optimizer_step") on every fw callback of the trainer."""
    for cb in trainer.callbacks:
        if isinstance(cb, Callback):
            getattr(cb, hook)(trainer, module, optimizer)


class ProgressBar(TQDMProgressBar):
    """Counts optimizer steps up to `max_steps` (the data is an endless stream, so batches have no total)."""

    SHOWN = ("loss", "token_accuracy", "reward/mean", "lr", "tokens_per_s", "eval/loss", "eval/accuracy")

    def on_train_start(self, trainer: lightning.Trainer, *_: Any) -> None:
        super().on_train_start(trainer)
        self._count_steps(trainer)   # a resume inside an epoch gets no on_train_epoch_start

    def on_train_epoch_start(self, trainer: lightning.Trainer, *_: Any) -> None:
        super().on_train_epoch_start(trainer)
        self._count_steps(trainer)

    def _count_steps(self, trainer: lightning.Trainer) -> None:
        bar = self.train_progress_bar
        bar.total = convert_inf(trainer.max_steps)
        bar.n = bar.initial = trainer.global_step
        bar.set_description("step")
        bar.refresh()

    def on_train_batch_end(self, trainer: lightning.Trainer, module: lightning.LightningModule, outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        bar = self.train_progress_bar
        if bar is not None and bar.n != trainer.global_step:
            bar.n = trainer.global_step
            bar.set_postfix(self.get_metrics(trainer, module), refresh=True)

    def get_metrics(self, trainer: lightning.Trainer, module: lightning.LightningModule) -> dict[str, Any]:
        metrics = {**getattr(module, "last_eval_metrics", {}), **getattr(module, "last_metrics", {})}
        return {k: f"{metrics[k]:.4g}" for k in self.SHOWN if k in metrics}

    def show_phase(self, phase: str) -> None:
        """The bar's label: "step" while training, "eval" while evaluating (framework/evaluation.py)."""
        bar = self._train_progress_bar
        if bar is not None:
            bar.set_description(phase, refresh=True)

    def on_exception(self, trainer: lightning.Trainer, module: lightning.LightningModule,
                     exception: BaseException) -> None:
        self.end_line()

    def end_line(self) -> None:
        """Close the bar: tqdm leaves its line open, and closing it ends the line, so an error that follows starts
        its own."""
        bar = self._train_progress_bar
        if bar is not None:
            bar.close()


EXIT_FW_ERROR = 2   # the CLI's exit code for a FwError
EXIT_ERROR = 1      # Python's for an exception nothing catches
FAILURE_POLL_S = 0.1       # how often each rank looks for another rank's failure
FAILURE_ACK_S = 10.0       # the longest the failed rank waits for every other rank to have seen its failure
FAILURE_REPORT_S = 30.0    # the longest the other ranks wait for the failed rank to print its report
DEPARTURE_S = 30.0         # the longest global rank 0 waits for the other ranks' last use of its store
LAUNCHER_EXIT_S = 10.0     # the longest a process of Lightning's launcher waits for the launcher to end
STORE_TIMEOUT_S = 10.0     # a TCP store operation that takes longer fails
# Under torchrun, its agent names the first process it sees end as the failure's root cause, so the failed rank must
# be seen to end first: a rank on its host waits until its process is gone (the agent has reaped it), a rank on
# another host this long after the failed rank's departure
TORCHRUN_GRACE_S = 2.0


def _alive(pid: int) -> bool:
    """Whether process `pid` exists, an unreaped one included (its parent has not yet seen it end)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:   # another user's: it exists
        return True
    return True


class StopEveryRankOnError(lightning.Callback):
    """Under several processes, one rank's failure ends every process within moments, and only the failed rank
    reports it: its `fw: error: global rank N: ...` line (a FwError, exit code 2) or its traceback (anything else,
    exit code 1). A signal's stop before the first step (framework.signals.Stopped) ends them the same way, with
    its exit code (143 for SIGTERM) and its one line.

    Otherwise the other ranks wait for the failed one in their next collective: gloo then fails them with its own
    traceback; under NCCL they wait until Lightning's launcher kills them all (exit code 137, no line from the
    launcher's process) or, when the failed rank was the launcher's, until NCCL's timeout. The first rank to fail
    claims the failure in the process group's TCP store (`on_exception`); every other rank has a thread that watches
    for the claim and acknowledges it (the failed rank waits for that before it prints, so that no other rank's
    exception comes first), waits until the failed rank has printed its report, and ends its process with the same
    exit code, printing nothing, even when it is blocked in a collective. A rank whose own exception comes after the
    claim (often its consequence, a collective's connection closed) ends the same way; a rank whose part of a
    `raise_on_every_rank` error is `quiet` ends through the CLI, after global rank 0 has reported it.
    KeyboardInterrupt is left to Lightning, which ends every process on it.

    The order of the ends: global rank 0 hosts the store, and a store operation after its end fails with a warning
    and a C++ stack on stderr, so it ends after every other rank's last one; Lightning's launcher (local rank 0) kills
    every process as soon as one that it started ends with a non-zero exit code, so such a process ends after it.

    Each run (`trainer.fit`, ...) has keys of its own: a script that fits several times keeps the process group, and
    so the store, from one fit to the next.
    """

    # the multi-process runs set up in this process so far: every rank runs the same ones, so each run's number, and
    # so its keys, are the same on every rank without an exchange
    _runs = 0

    def __init__(self) -> None:
        self._store: Any = None
        self._keys = ""
        self._rank = 0
        self._world_size = 1
        self._trainer: lightning.Trainer | None = None
        self._child = False   # started by Lightning's launcher, the process of local rank 0
        self._parent = 0
        self._watcher: threading.Thread | None = None
        self._done = threading.Event()   # the watcher stops
        self._failed_here = False
        self._acked = False
        self._departed = False
        self._once = threading.Lock()   # held by the thread that ends this process as the failed rank did
        self._lock = threading.Lock()

    def setup(self, trainer: lightning.Trainer, module: lightning.LightningModule, stage: str) -> None:
        # Lightning sets callbacks up once a run; a callback that a later run (another Trainer) reuses starts afresh,
        # its earlier runs' exit hooks holding copies of their own state (`_at_exit`)
        if self._watcher is not None:   # an earlier run's: stopped unless a KeyboardInterrupt ended that run
            self._done.set()
            self._watcher.join()
        self.__init__()
        if trainer.world_size < 2:
            return
        import torch.distributed as dist
        from lightning.fabric.plugins.environments import LightningEnvironment

        StopEveryRankOnError._runs += 1
        run = StopEveryRankOnError._runs
        try:   # a connection of its own: the process group's is blocked while one of its own waits lasts
            self._store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                                        timeout=timedelta(seconds=STORE_TIMEOUT_S), wait_for_workers=False)
        except (KeyError, ValueError, RuntimeError):   # no store to reach: the failure stays Lightning's to handle
            return
        # torchrun keeps its store when it restarts the job, so each attempt has keys of its own too
        self._keys = f"fw/failure/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{run}/"
        self._rank, self._world_size, self._trainer = trainer.global_rank, trainer.world_size, trainer
        self._child = trainer.local_rank != 0 and isinstance(trainer.strategy.cluster_environment,
                                                             LightningEnvironment)
        self._parent = os.getppid()
        self._watcher = threading.Thread(target=self._watch, name="fw-failure-watch", daemon=True)
        self._watcher.start()

    def teardown(self, trainer: lightning.Trainer, module: lightning.LightningModule, stage: str) -> None:
        """The end of a run this rank finished: when another rank failed meanwhile, this one ends as it does."""
        if self._store is None or self._failed_here:
            return
        self._done.set()
        if self._watcher is not None:
            self._watcher.join()   # forever when it follows a failure: it ends the process
        try:
            claim = self._claim()
        except RuntimeError:   # the store is gone
            return
        if claim is not None:
            self._follow(claim)
        if self._rank == 0:
            self._at_exit(StopEveryRankOnError._await_departures)
        else:
            self._acknowledge()   # nothing more to report: a failed rank need not wait for this one
            self._depart()

    def __getstate__(self) -> dict[str, Any]:
        # picklable as Lightning's callbacks are (a copy of the trainer, callbacks included): the thread state is
        # made afresh in the copy
        return {k: v for k, v in self.__dict__.items() if k not in ("_done", "_once", "_lock", "_watcher")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._watcher = None
        self._done, self._once, self._lock = threading.Event(), threading.Lock(), threading.Lock()

    def on_exception(self, trainer: lightning.Trainer, module: lightning.LightningModule,
                     exception: BaseException) -> None:
        if self._store is None or not isinstance(exception, Exception):
            return
        if self._once.locked():   # the watcher ends this process already
            threading.Event().wait()
        self._failed_here = True   # before the claim: this rank's watcher leaves its own claim alone
        self._done.set()
        if isinstance(exception, FwError) and exception.quiet:   # global rank 0 raises it too, and reports it
            self._acknowledge()
            self._at_exit(StopEveryRankOnError._await_report)   # the CLI exits 2 without a line (--debug: a traceback)
            return
        code = exception.exit_code if isinstance(exception, Stopped) else \
            EXIT_FW_ERROR if isinstance(exception, FwError) else EXIT_ERROR
        mine = f"{self._rank}:{code}:{os.getpid()}:{socket.gethostname()}"
        try:
            claim = self._store.compare_set(self._keys + "claim", "", mine).decode()
        except RuntimeError:   # the store is gone: the failure stays Lightning's to handle
            return
        if claim != mine:   # another rank failed first
            self._follow(claim)
        if isinstance(exception, FwError) and not exception.every_rank and not isinstance(exception, ConfigError):
            exception.args = (f"global rank {self._rank}: {exception}",)
        self._wait(lambda: self._store.add(self._keys + "acks", 0) >= self._world_size - 1, FAILURE_ACK_S)
        self._at_exit(StopEveryRankOnError._reported)   # after the CLI's line or Python's traceback is printed

    def _at_exit(self, hook: Callable[[StopEveryRankOnError], None]) -> None:
        """Run `hook` at this process's exit on a copy of this run's state (store, keys, rank), which a later run of
        this callback leaves alone. This callback and the copy let go of the trainer and of the module's `log` and
        `log_dict` (Lightning sets them on every callback): a process that goes on (another fit, or a caller that
        handles this run's error) does not keep this run's model and optimizer state until it exits."""
        self._trainer = None
        for name in ("log", "log_dict"):
            vars(self).pop(name, None)
        state = StopEveryRankOnError.__new__(StopEveryRankOnError)
        state.__setstate__(self.__getstate__())
        atexit.register(hook, state)

    def _claim(self) -> str | None:
        """The failure claimed ("rank:exit code:pid:host" of the failed rank), or None; RuntimeError when the store
        is gone."""
        key = self._keys + "claim"
        return self._store.get(key).decode() if self._store.check([key]) else None

    def _watch(self) -> None:
        while not self._done.wait(FAILURE_POLL_S):
            try:
                claim = self._claim()
            except RuntimeError:   # the store is gone
                return
            if claim is not None and not self._failed_here:
                self._follow(claim)

    def _follow(self, claim: str) -> NoReturn:
        """End this process with the exit code of the failure `claim`, once the failed rank reported it; print
        nothing."""
        if not self._once.acquire(blocking=False):   # the other thread ends the process
            threading.Event().wait()
        self._done.set()
        self._acknowledge()
        self._await_report()
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        _, code, pid, host = claim.split(":", 3)
        if "TORCHELASTIC_RUN_ID" in os.environ:
            if host == socket.gethostname():
                self._wait(lambda: not _alive(int(pid)), FAILURE_REPORT_S)
            else:
                time.sleep(TORCHRUN_GRACE_S)
        os._exit(int(code))

    def _acknowledge(self) -> None:
        """Tell the failed rank that this one has seen its failure (once)."""
        with self._lock:
            if self._acked:
                return
            self._acked = True
        trainer = self._trainer
        if trainer is not None and trainer.is_global_zero:   # the failed rank's report starts a line
            for bar in trainer.callbacks:
                if isinstance(bar, ProgressBar):
                    bar.end_line()
        with contextlib.suppress(RuntimeError):
            self._store.add(self._keys + "acks", 1)

    def _await_report(self) -> None:
        """Until the failed rank has printed its report; then depart."""
        self._wait(lambda: self._store.check([self._keys + "reported"]), FAILURE_REPORT_S)
        self._depart()
        self._await_launcher()

    def _reported(self) -> None:
        """At the exit of the failed rank, its report printed: the other ranks may end."""
        with contextlib.suppress(RuntimeError):
            self._store.set(self._keys + "reported", "1")
        self._depart()
        self._await_launcher()

    def _await_departures(self) -> None:
        """At the exit of global rank 0 after a run it finished: the others' departures, or a late failure."""
        deadline = time.monotonic() + DEPARTURE_S
        with contextlib.suppress(RuntimeError):
            while time.monotonic() < deadline:
                claim = self._claim()
                if claim is not None:
                    self._follow(claim)
                if self._store.add(self._keys + "departed", 0) >= self._world_size - 1:
                    return
                time.sleep(FAILURE_POLL_S / 2)

    def _depart(self) -> None:
        """This process's last use of the store; global rank 0, its host, waits for every other one's."""
        with self._lock:
            if self._departed:
                return
            self._departed = True
        if self._rank == 0:
            self._wait(lambda: self._store.add(self._keys + "departed", 0) >= self._world_size - 1, DEPARTURE_S)
        else:
            with contextlib.suppress(RuntimeError):
                self._store.add(self._keys + "departed", 1)

    def _await_launcher(self) -> None:
        """Until the launcher that started this process has ended (which hands the process to another parent)."""
        if self._child:
            self._wait(lambda: os.getppid() != self._parent, LAUNCHER_EXIT_S)

    @staticmethod
    def _wait(done: Any, limit_s: float) -> None:
        """Until `done()` is true, `limit_s` passed or the store is gone (`done()` raises)."""
        deadline = time.monotonic() + limit_s
        with contextlib.suppress(RuntimeError):
            while not done() and time.monotonic() < deadline:
                time.sleep(FAILURE_POLL_S / 2)


class LearningRateMonitor(Callback):
    """Logs each optimizer's learning rate as used by the step: `lr` (policy), `critic_lr` (PPO critic).

    Lightning's own monitor logs once per batch at its own step count, which differs from the policy
    step count when a recipe steps several times per batch; this one rides on the optimizer-step hooks.
    """

    def before_optimizer_step(self, trainer: lightning.Trainer, module: lightning.LightningModule,
                              optimizer: Any) -> None:
        name = "lr" if module.optimizer_role(optimizer) == "policy" else f"{module.optimizer_role(optimizer)}_lr"
        module.log_fw_metric(name, optimizer.param_groups[0]["lr"], reduce="last")


class MetricsLogger(lightning.Callback):
    """Sends the module's aggregated metrics to the loggers every `log_every_n_steps` policy steps.

    It runs in `on_train_batch_end` ahead of the checkpoint callback (the trainer puts it first), so a
    checkpoint published at step k always comes after the metrics of step k were handed to the loggers.
    Metrics are logged with `step` = the number of policy optimizer steps done (1 for the first step).
    """

    def __init__(self, log_every_n_steps: int):
        self.every = log_every_n_steps
        self.logged_step = self.start_step = 0
        self.truncated = False

    def on_train_start(self, trainer: lightning.Trainer, module: lightning.LightningModule) -> None:
        self.logged_step = self.start_step = trainer.global_step
        self.truncated = False

    def on_train_batch_end(self, trainer: lightning.Trainer, module: lightning.LightningModule, outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        if self.due(trainer):
            self.flush(trainer, module)

    def flush(self, trainer: lightning.Trainer, module: lightning.LightningModule) -> None:
        """Send the open interval's metrics to the loggers now, as a record of the current step."""
        self.truncate_once(trainer)
        module.flush_metrics()
        self.logged_step = trainer.global_step

    def due(self, trainer: lightning.Trainer) -> bool:
        """Whether this batch's end logs the metrics (an optimizer step landed on the logging cadence)."""
        step = trainer.global_step
        return step != self.logged_step and (crossed(self.logged_step, step, self.every) or step >= trainer.max_steps)

    def truncate_once(self, trainer: lightning.Trainer) -> None:
        """A resumed run writes the steps after its checkpoint again: drop lines a crashed run wrote past
        it, before the first line of this run (once every start-up check has passed)."""
        if not self.truncated:
            for logger in trainer.loggers:
                if hasattr(logger, "truncate_after"):
                    logger.truncate_after(self.start_step)
            self.truncated = True


class FlushOnEarlyStop(lightning.Callback):
    """Logs the last steps of a run that a user callback (or Lightning's EarlyStopping) stops early.

    It comes after the user callbacks, which set `trainer.should_stop` in their batch end after the metrics
    logger ran, and after `StopOnSignal`, which makes one rank's request every rank's, and before the checkpoint
    callback, which saves that step: the checkpoint then holds no part of an interval already written. A stop by
    signal keeps its interval open instead: its resume continues it, as the uninterrupted run would.
    """

    def __init__(self, metrics: MetricsLogger, stop: StopSignals | None = None):
        self.metrics = metrics
        self.stop = stop

    def on_train_batch_end(self, trainer: lightning.Trainer, module: lightning.LightningModule, outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        signalled = self.stop is not None and self.stop.signum is not None
        if trainer.should_stop and not signalled and trainer.global_step != self.metrics.logged_step:
            self.metrics.flush(trainer, module)


class StopOnSignal(lightning.Callback):
    """Ends training on every rank at the end of the step in progress once a signal (framework/signals.py) or a
    callback (`trainer.should_stop = True`) on any rank asked to stop.

    It comes after the user callbacks, which may set `trainer.should_stop` on one rank only (an early-stopping rule
    that reads a rank-local value, say), and before the last steps' record and the checkpoint callback. It decides
    only in a batch where the policy step advanced: a request made in the middle of gradient accumulation waits for
    the end of that step, so the checkpoint callback, which runs later in the same batch, saves a step an
    uninterrupted run also passes through. Under several processes the signal and the callbacks' request of every
    rank are combined in one small all-reduce per step, so that no rank leaves the loop while another waits for it
    in the next step's collectives. A request made before the first step (in `setup`, `on_fit_start` or
    `on_train_start`) is agreed on the same way, before Lightning reads it. In the batch that ends the loop (a stop,
    or trainer.max_steps reached) it tells the signal handlers that the run is ending. A signal that comes while the
    checkpoint callback saves, after this decision, is `StopAfterSave`'s.
    """

    def __init__(self, stop: StopSignals | None = None):
        self.stop = stop
        self._step = 0
        self._asked = False   # a callback asked to stop within the step in progress

    def on_fit_start(self, trainer: lightning.Trainer, module: lightning.LightningModule) -> None:
        _agree_on_stop(trainer)   # a request from `setup` or `on_fit_start`: Lightning skips the training loop

    def on_train_start(self, trainer: lightning.Trainer, module: lightning.LightningModule) -> None:
        _agree_on_stop(trainer)   # a request from `on_train_start`: Lightning leaves the loop before the first batch
        if self.stop is not None:
            self.stop.start_training()   # after Lightning installed its SIGTERM handler, which this replaces
        self._step = trainer.global_step
        self._asked = False

    def on_train_batch_end(self, trainer: lightning.Trainer, module: lightning.LightningModule, outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        self._asked = self._asked or bool(trainer.should_stop)
        if trainer.global_step == self._step:
            trainer.should_stop = False   # within an accumulation window: the request waits for the step's end
            return
        self._step = trainer.global_step
        signum = (self.stop.signum if self.stop is not None else None) or 0
        asked = int(self._asked)
        if trainer.world_size > 1:
            flags = torch.tensor([signum, asked], device=trainer.strategy.root_device)
            signum, asked = (int(v) for v in trainer.strategy.reduce(flags, reduce_op="max").tolist())
        if signum and self.stop is not None:
            self.stop.request(signum)
        self._asked = False
        trainer.should_stop = bool(signum or asked)
        if self.stop is not None and (trainer.should_stop or 0 <= trainer.max_steps <= trainer.global_step):
            self.stop.ending()   # the loop ends after this batch: the final save and the teardown follow


class StopAfterSave(lightning.Callback):
    """Ends training on every rank after a checkpoint save during which a signal came (framework/signals.py).

    `StopOnSignal` decides before the checkpoint callback saves, so a signal that comes while that save is written
    would wait for the next step's end: one more step trained and saved again, against the grace the signal's sender
    gives. Coming after the checkpoint callback, this one stops the loop once that save is published: the step the
    signal found in progress is then the one saved. It acts only in a batch where the checkpoint callback saved the
    step just taken, which every rank does together, so its agreement across ranks costs one all-reduce a save.
    """

    def __init__(self, stop: StopSignals | None, saved_step: Callable[[], int | None]):
        self.stop = stop
        self.saved_step = saved_step   # the step of the checkpoint callback's newest save
        self._saved: int | None = None   # that step at the previous batch's end

    def on_train_start(self, trainer: lightning.Trainer, module: lightning.LightningModule) -> None:
        self._saved = self.saved_step()

    def on_train_batch_end(self, trainer: lightning.Trainer, module: lightning.LightningModule, outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        previous, self._saved = self._saved, self.saved_step()
        if self.stop is None or trainer.should_stop or self._saved == previous:   # no save in this batch
            return
        if 0 <= trainer.max_steps <= trainer.global_step:
            return   # the run's last step: the loop ends here anyway
        signum = self.stop.signum or 0
        if trainer.world_size > 1:
            flag = torch.tensor([signum], device=trainer.strategy.root_device)
            signum = int(trainer.strategy.reduce(flag, reduce_op="max").item())
        if signum:
            self.stop.request(signum)
            trainer.should_stop = True
            self.stop.ending()


def _agree_on_stop(trainer: lightning.Trainer) -> None:
    """Sets `trainer.should_stop` on every rank when any rank set it, so that all leave or all enter the loop."""
    if trainer.world_size > 1:
        flag = torch.tensor([int(bool(trainer.should_stop))], device=trainer.strategy.root_device)
        trainer.should_stop = bool(trainer.strategy.reduce(flag, reduce_op="max").item())


def _by_device(tensors: list[torch.Tensor]) -> dict[torch.device, list[torch.Tensor]]:
    # An offloaded optimizer's groups hold host copies of the large parameters and the small ones on the GPU.
    groups: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault(t.device, []).append(t)
    return groups


def _finite(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Per device, whether every tensor is finite (a bool tensor on that device), from the largest |x| of
    each tensor in fused launches (inf for an infinity, NaN for a NaN); nothing is read back here."""
    return [torch.stack(torch._foreach_norm(group, math.inf)).isfinite().all()
            for group in _by_device(tensors).values()]


def _grads(optimizer: Any) -> list[torch.Tensor]:
    return [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]


class StopOnNonFinite(Callback):
    """Stops the run (FwError, exit 2) at the first non-finite loss, gradient or weight.

    The loss is checked before each backward; the policy's gradients before clipping, by their norm
    (clipping an infinite norm would zero them: an `FwModule` hands over the norm it clips with, any other
    module gets it measured); other optimizers' gradients after clipping, where a non-finite norm leaves
    NaN; every optimizer's weights after its step. Each check stays on the device until the end of the
    batch that completes the optimizer step, where all of them are read in one transfer (with the metrics
    when the step is logged) and the first that failed raises; this callback comes before the evaluation,
    the metrics and the checkpoint, so no record or checkpoint of a diverged step is written and the
    newest checkpoint is the last good one. Under `16-mixed` gradients are left to the loss scaler, which
    skips steps with infinite gradients by design.
    """

    def __init__(self, precision: str):
        self.check_gradients = precision != "16-mixed"
        # (message with {} for the value, policy steps done, finite flag, value): checked at the batch end
        self.pending: list[tuple[str, int | None, torch.Tensor, torch.Tensor]] = []
        self._step: int | None = None

    def _expect(self, module: lightning.LightningModule, message: str, finite: torch.Tensor,
                value: torch.Tensor | None = None) -> None:
        steps = getattr(module, "policy_version", None)
        self.pending.append((message, steps, finite, finite if value is None else value))

    @staticmethod
    def _role(module: lightning.LightningModule, optimizer: Any) -> str:
        return module.optimizer_role(optimizer) if hasattr(module, "optimizer_role") else "policy"

    def on_before_backward(self, trainer: lightning.Trainer, module: lightning.LightningModule,
                           loss: torch.Tensor) -> None:
        loss = loss.detach()
        self._expect(module, "the loss is {}", loss.isfinite().all(), loss.float().sum())

    def on_before_optimizer_step(self, trainer: lightning.Trainer, module: lightning.LightningModule,
                                 optimizer: Any) -> None:
        # Lightning calls this for the optimizers it steps (the policy's) before the module clips; an
        # FwModule's own norm comes in before_optimizer_step
        grads = _grads(optimizer)
        if self.check_gradients and grads and not isinstance(getattr(module, "grad_norms", None), dict):
            norm = grad_norm(grads)
            role = self._role(module, optimizer)
            self._expect(module, f"the {role} gradient's norm is {{}}", norm.isfinite(), norm)

    def before_optimizer_step(self, trainer: lightning.Trainer, module: lightning.LightningModule,
                              optimizer: Any) -> None:
        if not self.check_gradients:
            return
        role = self._role(module, optimizer)
        if role == "policy":
            norm = getattr(module, "grad_norms", {}).get(role)
            if norm is not None:
                self._expect(module, f"the {role} gradient's norm is {{}}", norm.isfinite(), norm)
        elif _grads(optimizer):
            for finite in _finite(_grads(optimizer)):
                self._expect(module, f"a {role} gradient is not finite", finite)

    def after_optimizer_step(self, trainer: lightning.Trainer, module: lightning.LightningModule,
                             optimizer: Any) -> None:
        for finite in _finite([p.detach() for g in optimizer.param_groups for p in g["params"]]):
            self._expect(module, f"a {self._role(module, optimizer)} weight is not finite", finite)

    def on_train_start(self, trainer: lightning.Trainer, module: lightning.LightningModule) -> None:
        self._step = trainer.global_step
        self.pending = []

    def on_train_batch_end(self, trainer: lightning.Trainer, module: lightning.LightningModule, outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self._step:
            return   # within an accumulation window: its checks wait for the step
        self._step = trainer.global_step
        logger = next((cb for cb in trainer.callbacks if isinstance(cb, MetricsLogger)), None)
        metrics = getattr(module, "step_metrics", None)
        if logger is not None and isinstance(metrics, StepMetrics) and logger.due(trainer):
            self.check(metrics.read_ahead([t for *_, f, v in self.pending for t in (f, v)]))
        else:
            self.check()

    def check(self, values: list[float] | None = None) -> None:
        """Raise for the first pending check that failed; `values`: the pending (flag, value) pairs read
        already (None: read them now, in one transfer)."""
        pending, self.pending = self.pending, []
        if values is None:
            values = read_scalars([t for *_, f, v in pending for t in (f, v)])
        for i, (message, steps, _, _) in enumerate(pending):
            if not values[2 * i]:
                what = message.format(values[2 * i + 1]) if "{}" in message else message
                raise FwError(f"{what} after {steps} policy steps: the run has diverged; it stops without saving "
                              "this step, so every checkpoint holds finite weights (lower optimizer.lr, keep "
                              "optimizer.max_grad_norm set, or use bf16 instead of fp16)")


# the keys of a checkpoint that Lightning writes itself (besides its precision plugin's state, under the plugin's class
# name); fw's own are added after the callbacks' `on_save_checkpoint`
LIGHTNING_CHECKPOINT_KEYS = ("epoch", "global_step", "pytorch-lightning_version", "state_dict", "loops", "callbacks",
                             "optimizer_states", "lr_schedulers", "hparams_name", "hyper_parameters", "hparams_type")


class RestorableState(lightning.Callback):
    """Refuses to save a checkpoint that a resume could not load: a user callback's state (`state_dict`), or a key
    that a callback's `on_save_checkpoint` added, holding an object that the resume's weights-only load refuses (a
    NumPy scalar, a deque, a Path, an instance of the user's class). Such a checkpoint would be written, and every
    resume from it would fail; the run stops instead at the save, naming the callback and the object's type.

    It comes after the user callbacks, whose `on_save_checkpoint` Lightning calls in order, so it sees what they
    added."""

    def __init__(self, specs: Sequence[dict], user: Sequence[lightning.Callback]):
        self.names = [f"callbacks[{i}] ({spec['class_path']})" for i, spec in enumerate(specs)]
        self.user = list(user)

    def on_save_checkpoint(self, trainer: lightning.Trainer, module: lightning.LightningModule,
                           checkpoint: dict[str, Any]) -> None:
        names = {cb.state_key: name for name, cb in zip(self.names, self.user, strict=True)}
        parts = [(f"the state of {names.get(key, f'callback {key}')}", state)
                 for key, state in (checkpoint.get("callbacks") or {}).items()]
        known = (*LIGHTNING_CHECKPOINT_KEYS, type(trainer.precision_plugin).__qualname__)
        # Lightning hands every callback the same dict, so the key's author is one of those that override the hook
        adders = [name for name, cb in zip(self.names, self.user, strict=True)
                  if type(cb).on_save_checkpoint is not lightning.Callback.on_save_checkpoint]
        by = adders[0] if len(adders) == 1 else f"one of {', '.join(adders)}" if adders else "a callback"
        parts += [(f"the checkpoint's key {key!r} (added by the on_save_checkpoint of {by})", value)
                  for key, value in checkpoint.items() if key not in known]
        step = getattr(module, "policy_version", trainer.global_step)
        for what, value in parts:
            check_restorable(step, what, value)


def check_restorable(step: int, what: str, value: Any) -> None:
    """Raise FwError when `value`, a part of step `step`'s checkpoint described by `what`, holds an object that a
    resume's weights-only load refuses: the save stops there, before anything of the step is written."""
    from framework.checkpoint import step_dir_name
    from framework.checkpoint.directory import weights_only_refusal

    refused = weights_only_refusal(value)
    if refused is not None:
        raise FwError(f"checkpoint {step_dir_name(step)}: {what} holds {refused}, which a resume's "
                      "weights-only load refuses; keep a checkpointed state to tensors, Python numbers, "
                      "strings, None and lists, tuples, sets and dicts of them (float(x), list(q), str(path)); "
                      "the run stops without saving this step, and the earlier checkpoints are intact")


def builtin_callbacks(cfg: dict, evaluation: Sequence[lightning.Callback] = (),
                      progress_bar: bool = True) -> list[lightning.Callback]:
    """The non-finite check, the `evaluation` callbacks, metrics logging, learning-rate monitor and the progress
    bar (when enabled, unless `progress_bar` is false: a user's bar replaces it), in that order; the trainer adds
    user callbacks, the stop request (`StopOnSignal`) and checkpointing after these. The non-finite check reads the
    step's checks at the end of its batch, so it comes before anything that evaluates, logs or saves the step."""
    out: list[lightning.Callback] = [StopOnNonFinite(cfg["trainer"]["precision"]), *evaluation]
    out += [MetricsLogger(cfg["trainer"]["log_every_n_steps"]), LearningRateMonitor()]
    if cfg["trainer"]["enable_progress_bar"] and progress_bar:
        out.append(ProgressBar())
    return out


def callback_problems(built: list[tuple[int, str, Any]], progress_bar: bool = True) -> list[tuple[int, str]]:
    """(index, problem) of the user's callbacks, each (its index in `callbacks`, class_path, the object built): one
    that is not a Lightning callback, one that keeps a state under another's `state_key` (a checkpoint holds one
    state per key, so Lightning refuses the second), or a progress bar that Lightning refuses: a second one, or one
    while `progress_bar` (trainer.enable_progress_bar) is false. A single bar replaces fw's own."""
    from lightning.pytorch.callbacks.progress import ProgressBar as LightningProgressBar
    from lightning.pytorch.utilities.model_helpers import is_overridden

    problems, keys, bars = [], {}, []
    for i, class_path, cb in built:
        if not isinstance(cb, lightning.Callback):
            problem = (f"{class_path} is a {type(cb).__name__}, not a lightning.Callback (subclass "
                       "framework.callbacks.Callback)")
            problems.append((i, problem))
        elif isinstance(cb, LightningProgressBar):
            bars.append(i)
            if not progress_bar:
                problem = (f"{class_path} is a progress bar, but trainer.enable_progress_bar is false; set it to true "
                           "to show this bar instead of fw's")
                problems.append((i, problem))
            elif len(bars) > 1:
                problem = f"{class_path} is a progress bar, as callbacks[{bars[0]}] is, and a run shows one: keep one"
                problems.append((i, problem))
        elif is_overridden("state_dict", instance=cb, parent=lightning.Callback):
            first = keys.setdefault(cb.state_key, i)
            if first != i:
                problem = (f"{class_path} keeps its state under the state_key of callbacks[{first}] ({cb.state_key}), "
                           "and a checkpoint holds one state per key: give the class a state_key property that "
                           "tells its instances apart")
                problems.append((i, problem))
    return problems


def user_callbacks(cfg: dict) -> list[lightning.Callback]:
    """`callbacks: [{class_path, init_args}]` instantiated; FwError at the first `callback_problems`."""
    from framework.imports import instantiate_once

    # within `fw fit`, the objects that its checks built (validate.py)
    built = [(i, spec["class_path"], instantiate_once(spec, f"callbacks[{i}]"))
             for i, spec in enumerate(cfg["callbacks"])]
    for i, problem in callback_problems(built, cfg["trainer"]["enable_progress_bar"]):
        raise FwError(f"callbacks[{i}]: {problem}")
    return [cb for _, _, cb in built]


class EvalCallback(lightning.Callback):
    """Evaluates every `eval.every_n_steps` policy steps (and at step 0 with `eval.at_start`), logging the
    metrics at that step: with the step's training metrics when the step is logged (the trainer puts this
    callback ahead of `MetricsLogger`), else in a record of their own. Either way before the step's
    checkpoint is saved, so a checkpoint of step k comes after step k's eval. It keeps the held-out bound
    (`held_out_record`) in the checkpoints, for a resumed run and for `fw eval`."""

    def __init__(self, cfg: dict):
        check_source(cfg)
        self.cfg = cfg
        self.every = cfg["eval"]["every_n_steps"]
        self.evaluation: Evaluation | None = None
        self._step = 0
        self.history: list[tuple[int, dict[str, float]]] = []   # (step, metrics) of this process's evals
        self.held_out: dict[str, int] | None = None   # held_out_record of this run
        self._saved: dict[str, int] | None = None   # the checkpoint's, until training starts
        self._resumed = False   # whether a checkpoint was loaded, until training starts

    # A checkpoint entry of its own rather than Lightning's callback state, which a run resumed without evaluation
    # would be warned about.
    def on_save_checkpoint(self, trainer: lightning.Trainer, module: lightning.LightningModule,
                           checkpoint: dict[str, Any]) -> None:
        if self.held_out:
            checkpoint[HELD_OUT_ENTRY] = dict(self.held_out)

    def on_load_checkpoint(self, trainer: lightning.Trainer, module: lightning.LightningModule,
                           checkpoint: dict[str, Any]) -> None:
        self._saved = checkpoint.get(HELD_OUT_ENTRY)
        self._resumed = True

    def on_train_start(self, trainer: lightning.Trainer, module: lightning.LightningModule) -> None:
        saved, self._saved = self._saved, None
        resumed, self._resumed = self._resumed, False
        earlier = saved.get("draws") if saved else None
        if needs_draws(self.cfg):
            if resumed and not saved and trainer.is_global_zero:
                say("fw: warning: eval: the checkpoint records no held-out bound (written by an older fw, or by a "
                    "run that did not hold out eval data), so the eval set is chosen anew for this run; the eval "
                    "metrics from here on are not comparable with the earlier ones", flush=True)
            recipe = getattr(module, "recipe", None)
            world_size, step = trainer.world_size, trainer.global_step
            # every rank reaches the collective (the same config on each); rank 0 alone counts the draws (SFT from a
            # task: packs every row the run trains on)
            self.held_out = from_rank_zero(lambda: held_out_record(
                self.cfg, module.tokenizer, world_size, step, data_position(recipe), saved,
                continued_steps(recipe, world_size)))
            draws = self.held_out["draws"]
        else:   # kept for a later start that holds out again
            held_out = self.cfg["eval"]["held_out"]
            self.held_out, draws = ({**(saved or {}), "key": HELD_OUT_KEY} if held_out else saved), 0
        # a record without the key is an older fw's (a run without one at all was warned about above)
        older = (saved or {}).get("key") != HELD_OUT_KEY and not (needs_draws(self.cfg) and not saved)
        if resumed and older and self.cfg["eval"]["held_out"] and trainer.is_global_zero:
            say("fw: warning: eval: the checkpoint was written by an older fw, which held eval samples out by their "
                "whole record; they are now held out by prompt (an eval sample whose prompt the run trains on is "
                "left out), so the eval set may differ and the eval metrics from here on may not be comparable "
                "with the earlier ones", flush=True)
        self.evaluation = Evaluation(self.cfg, module.tokenizer, trainer.world_size, draws=draws, earlier=earlier)
        if self.evaluation.changed and trainer.is_global_zero:
            say(f"fw: warning: eval: this run can draw {draws} training samples, more than the {earlier} its eval "
                "set was chosen against (a larger trainer.max_steps or global batch), and some eval samples are "
                "among them; they are replaced by others, so the eval metrics from here on are not comparable "
                "with the earlier ones", flush=True)
        self._step = trainer.global_step
        if self.cfg["eval"]["at_start"] and trainer.global_step == 0:
            self._evaluate(trainer, module)

    def on_train_batch_end(self, trainer: lightning.Trainer, module: lightning.LightningModule, outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        step = trainer.global_step
        if step == self._step:
            return
        due = self.every is not None and crossed(self._step, step, self.every)
        self._step = step
        if due:
            self._evaluate(trainer, module)

    def _evaluate(self, trainer: lightning.Trainer, module: lightning.LightningModule) -> None:
        bars = [cb for cb in trainer.callbacks if isinstance(cb, ProgressBar)]
        for bar in bars:
            bar.show_phase("eval")
        try:
            with trainer.precision_plugin.forward_context(), module.off_the_clock():
                # the run's rollout engine when it is kept between rollouts (its cache is allocated anyway)
                engine = module.recipe.engine if getattr(module.recipe, "keep_engine", None) else None
                metrics = self.evaluation.run(module.policy, trainer.global_rank, trainer.world_size, engine)
        finally:
            for bar in bars:
                bar.show_phase("step")
        metrics_logger = next(cb for cb in trainer.callbacks if isinstance(cb, MetricsLogger))
        if metrics_logger.due(trainer):   # logged with the step's training metrics, in the same record
            for name, value in metrics.items():
                module.log_fw_metric(name, value, reduce="last")
        else:   # step 0, or a step the logging cadence skips: a record of its own
            metrics_logger.truncate_once(trainer)   # a resumed run drops a crashed run's lines first
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)
        module.last_eval_metrics = metrics
        self.history.append((trainer.global_step, metrics))
