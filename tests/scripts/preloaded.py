"""Real processes forked from one forkserver per test session that has torch, Lightning and fw imported: each
starts in well under a second instead of a fresh interpreter's seconds of imports on CI's 2 cores."""

from __future__ import annotations

import multiprocessing
import time
from collections.abc import Callable
from multiprocessing.context import ForkServerContext
from typing import Any

# multiprocessing keeps one forkserver per session and the test that starts it sets what it imports, so every
# test file takes this one list
PRELOAD = ["torch", "lightning.pytorch", "framework.checkpoint", "framework.cli", "framework.trainer",
           "framework.module", "recipes", "scripts.ckpt_writer", "scripts.fw_cli"]


def forkserver() -> ForkServerContext:
    """The session's forkserver context, with PRELOAD imported by the server once it starts."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def run_ranks(fn: Callable[..., Any], *args: Any, nprocs: int = 2, timeout: float = 300.0) -> None:
    """`fn(rank, *args)` in `nprocs` forkserver processes. A rank that raises fails the caller with its traceback
    (the others are ended); ranks still running after `timeout` seconds (one waiting in a collective that its
    peer never joins) are killed and fail it too. `fn` must be importable by name (a module-level function)."""
    import torch.multiprocessing

    forkserver()
    context = torch.multiprocessing.start_processes(fn, args, nprocs=nprocs, join=False, start_method="forkserver")
    deadline = time.monotonic() + timeout
    try:
        while not context.join(timeout=1.0):
            if time.monotonic() > deadline:
                raise AssertionError(f"ranks still running after {timeout:.0f} s: "
                                     f"{[i for i, p in enumerate(context.processes) if p.is_alive()]}")
    finally:
        for p in context.processes:
            if p.is_alive():
                p.kill()
                p.join()
