"""SIGTERM, SIGINT and SIGUSR1 during `fw fit`: finish the step, publish its checkpoint, exit with 128 + the signal.

SIGTERM is what `timeout`, SLURM and Kubernetes send before they kill; SIGINT is Ctrl+C; SIGUSR1 is what a SLURM
job asks for ahead of its time limit (`--signal=USR1@SECONDS`). Taking SIGUSR1 also keeps Lightning's own SLURM
handler of it out, which writes an `hpc_ckpt_N.ckpt` into run_dir in the middle of a step, outside fw's checkpoints,
and finalizes the loggers of a run that goes on. While `StopSignals` is active, the first of them is a stop request:
before training starts it stops at once (`Stopped` is raised where the main thread is; there is nothing to save),
during training the step in progress finishes, its checkpoint is published and `fit` raises `Stopped` (the CLI exits
with 143 for SIGTERM, 130 for SIGINT, 138 for SIGUSR1); in the run's last step `fit` returns instead, saying that the
run ended. A second signal, or a step that has not finished
`trainer.stop_grace_s` seconds after the first (user code that does not return), ends the process at once with the
same code; the checkpoints already published stay as they are. `framework.callbacks.StopOnSignal` turns the request
into Lightning's `trainer.should_stop` at the end of a step.

Once the run's last step is done (trainer.max_steps reached, or a stop decided at the step's end) the run is ending:
its final save, the callbacks' and loggers' last work and Lightning's teardown follow. A first signal then lets them
finish (the closing line says how the run ended); a second one, or an ending that outlasts the grace, exits at once
with a line naming the newest intact checkpoint (the final save cut short publishes nothing) and the command that
continues the run. Once `fit` has decided the run's outcome, a signal exits at once with such a line. Under the `fw`
program the handlers stay in place after `fit` returns, through the CLI's last lines and the atexit hooks; only the
interpreter's own finalization runs without them (a signal there ends the process with no line, the run complete
and written).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable
from types import FrameType, TracebackType
from typing import Literal, final

from framework.console import say

# SIGUSR1 is POSIX only; installed before Lightning starts a stage, it is a handler Lightning leaves in place
SIGNALS = (signal.SIGTERM, signal.SIGINT) + ((signal.SIGUSR1,) if hasattr(signal, "SIGUSR1") else ())

# how long the line of an exit at once waits for `StopSignals.state` to read what the run has published: a file system
# that does not answer must not keep the process from exiting
STATE_WAIT_S = 5.0

# starting: before the first step; training: a step is in progress; ending: the last step is done, its final save and
# the teardown follow; ended: fit decided the run's outcome
Phase = Literal["starting", "training", "ending", "ended"]


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


class Stopped(Exception):
    """`fw fit` stopped on a signal; the CLI exits with `exit_code` (128 + the signal's number)."""

    def __init__(self, signum: int, message: str):
        super().__init__(message)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class Interrupted(Stopped):
    """A KeyboardInterrupt in user code (a reward): the run ends as Ctrl+C ends it, with exit code 130 and one line,
    which says "in" the call, not "raised by" it: without fit's stop handler (`fw eval`) a Ctrl+C during the call
    raises it there too. An Exception, not a KeyboardInterrupt, so that Lightning's handling of the latter (exit
    code 1, no line) is not met and every process of a multi-process job ends on it
    (framework.callbacks.StopEveryRankOnError)."""

    def __init__(self, what: str):
        super().__init__(signal.SIGINT, f"interrupted: KeyboardInterrupt in {what}")
        self.what = what


def _say_last(message: str) -> None:
    """The line before `os._exit`, a plain print: `say` would wait for the progress bar's lock and write to stdout,
    and a main thread stuck in the bar's write (stdout a pipe nobody reads) would keep the process from exiting.
    On a terminal it first clears the line the cursor is on, where the bar stands without its newline."""
    try:
        clear = "\r\x1b[2K" if sys.stderr.isatty() else ""
    except (AttributeError, ValueError):   # a replaced or closed stream
        clear = ""
    print(clear + message, file=sys.stderr, flush=True)


@final
class StopSignals:
    """Context manager: SIGTERM / SIGINT / SIGUSR1 handlers that turn the first signal into a stop request.

    `until_exit`: the process ends after the context; the handlers stay in place, answering a signal at once.
    `state(saving)` (set once the run is built) says what the run has published, for the line of an exit at once;
    `saving`: the run is ending, and its final save may be under way."""

    def __init__(self, grace_s: float, until_exit: bool = False):
        self.grace_s = grace_s
        self.until_exit = until_exit
        self.signum: int | None = None   # the first signal received (or, under DDP, seen by any rank)
        self.phase: Phase = "starting"
        self.state: Callable[[bool], str] | None = None
        self._previous: dict[int, object] = {}
        self._watchdog: threading.Timer | None = None

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():   # signal.signal works only there
            for signum in SIGNALS:
                self._previous[signum] = signal.getsignal(signum)
                signal.signal(signum, self._handle)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
        if self.until_exit and self._previous and self.phase != "starting":
            self.phase = "ended"   # a run took steps, and the process ends next: a signal until then gets its line
            return
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}

    def start_training(self) -> None:
        """From now on a signal ends the current step instead of the process. Installs the handlers
        again: Lightning puts its own SIGTERM handler in place when it starts a stage."""
        self.phase = "training"
        for signum in self._previous:
            signal.signal(signum, self._handle)

    def ending(self) -> None:
        """The run's last step is done: what follows is its final save and teardown."""
        if self.phase == "training":
            self.phase = "ending"

    def ended(self) -> None:
        """`fit` has decided the run's outcome: a signal from now on exits at once, saying what is published (with
        `until_exit`; a library caller's process goes on, and the signal only gets a line)."""
        self.phase = "ended"

    def request(self, signum: int) -> None:
        """Record a stop request that another rank received (it started the watchdog there)."""
        if self.signum is None:
            self.signum = signum

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal_name(signum)
        if self.phase == "ended":
            if not self.until_exit:   # a library caller's process goes on after fit, which is returning: no stop left
                say(f"fw: {name} came as the run had ended; nothing is left to stop", flush=True)
                return
            _say_last(f"fw: {name} came as the process was exiting after the run: {self._state(False)}")
            os._exit(128 + signum)
        if self.signum is not None:
            if self.phase == "ending":
                _say_last(f"fw: {name} again as the run was ending: exiting now; {self._state(True)}")
            else:
                _say_last(f"fw: {name} again: exiting now; the checkpoints published so far are kept")
            os._exit(128 + signum)
        self.signum = signum
        if self.phase == "starting":
            raise Stopped(signum, f"stopped by {name} before the first step; nothing to save")
        if self.phase == "ending":
            say(f"fw: {name} came as the run was ending: letting its final save and teardown finish (send it again "
                "to exit now)", flush=True)
        else:
            say(f"fw: {name}: finishing the current step and saving a checkpoint (send it again to exit now)",
                flush=True)
        self._watchdog = threading.Timer(self.grace_s, self._expire, args=(signum,))
        self._watchdog.daemon = True
        self._watchdog.start()

    def _expire(self, signum: int) -> None:
        name = signal_name(signum)
        if self.phase == "training":
            _say_last(f"fw: {name}: the step did not finish within trainer.stop_grace_s = {self.grace_s:g} s; "
                      "exiting without its checkpoint (the checkpoints published so far are kept)")
        else:
            _say_last(f"fw: {name}: the run's ending (its final save, the callbacks' and loggers' last work) did not "
                      f"finish within trainer.stop_grace_s = {self.grace_s:g} s of the signal; exiting now; "
                      f"{self._state(True)}")
        os._exit(128 + signum)

    def _state(self, saving: bool) -> str:
        """`state(saving)`, for the line before `os._exit`: reading the run's files must not keep the line from
        being said, nor the process from exiting (a final save stuck on a file system that does not answer is what
        a grace's expiry or a second signal ends), so an error there, or a read not done within `STATE_WAIT_S`,
        gives the general account."""
        found: list[str] = []
        state = self.state
        if state is not None:
            def read() -> None:
                with contextlib.suppress(Exception):   # the process exits next: a line without the state, not none
                    found.append(state(saving))

            reader = threading.Thread(target=read, name="fw-published", daemon=True)
            try:
                reader.start()
            except RuntimeError:   # the interpreter is finalizing (Python 3.12+ starts no thread then): read here
                read()
            else:
                reader.join(STATE_WAIT_S)
        return found[0] if found else "the checkpoints published so far are kept"
