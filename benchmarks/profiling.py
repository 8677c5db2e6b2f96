"""The kernels that take the most device time in a piece of work, as torch.profiler's table."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile


def kernel_table(prof: Any, count: int = 12, host: bool = False) -> str:
    """The top `count` rows of a finished profile by self device time (CPU, or `host`: self host time)."""
    cuda = any(e.device_type == torch.autograd.DeviceType.CUDA for e in prof.events())
    key = "self_device_time_total" if cuda and not host else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=key, row_limit=count)


def top_kernels(run: Callable[[], Any], count: int = 12, host: bool = False, trace: str | None = None) -> str:
    """`run()` once under torch.profiler (CPU and, where there is one, CUDA activity); its `kernel_table`, and
    with `host` the table of the ops of most self host time after it; `trace`: where its chrome trace goes."""
    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        run()
        if cuda:
            torch.cuda.synchronize()
    if trace:
        prof.export_chrome_trace(trace)
    table = kernel_table(prof, count)
    return table + ("\nby self host time:\n" + kernel_table(prof, count, host=True) if host and cuda else "")
