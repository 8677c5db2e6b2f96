"""The CUDA caching allocator's settings for long RL jobs, handing cached memory back, and host tensors
copied to the device through the pinned-memory cache.

An RL step alternates two very different memory shapes: the rollout (a KV cache of every row's whole
context, CUDA-graph pools) and the update (activations of one micro-batch, gradients). With fixed-size
segments the allocator keeps the first shape's blocks cached and splits them for the second, so a job
can fail with tens of GiB "reserved but unallocated". Expandable segments grow and shrink one mapping
per stream instead, so freed memory is reusable whatever its shape.
"""

from __future__ import annotations

import os

import torch

ENV = "PYTORCH_CUDA_ALLOC_CONF"   # read by every torch fw runs on
ENV_ALL = "PYTORCH_ALLOC_CONF"    # read too from torch 2.9, for every accelerator
DEFAULT = "expandable_segments:True"


def _reads_env_all() -> bool:
    """Whether this torch reads PYTORCH_ALLOC_CONF (its accelerator-wide allocator settings, from 2.9)."""
    major, minor = (int(part) for part in torch.__version__.split(".")[:2])
    return (major, minor) >= (2, 9)


def user_setting() -> str | None:
    """The allocator settings the user gave in PYTORCH_ALLOC_CONF or PYTORCH_CUDA_ALLOC_CONF, as this torch takes
    them, or None."""
    cuda, every = os.environ.get(ENV), os.environ.get(ENV_ALL)
    if every is None or not _reads_env_all():
        return cuda
    if cuda is None:
        return every
    # both: which one wins differs between torch versions (2.9 reads PYTORCH_ALLOC_CONF first, later ones the
    # other), so torch says where it can. Asking makes torch read the environment, which it does once per process:
    # safe here, where fw adds nothing to it
    in_force = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
    return in_force() if in_force is not None else every


def configure_allocator() -> str:
    """Use expandable segments unless the user set the allocator's settings (PYTORCH_ALLOC_CONF or
    PYTORCH_CUDA_ALLOC_CONF, where this torch reads it); returns the setting in force.

    Before CUDA starts the environment variable is enough; once it has, the setting is applied to the
    live allocator (it governs the segments allocated from then on).
    """
    user = user_setting()
    if user is not None:
        return user
    os.environ[ENV] = DEFAULT
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        # the accelerator-wide setter where this torch has it (the CUDA one is deprecated there)
        setter = (getattr(torch._C, "_accelerator_setAllocatorSettings", None)
                  or torch.cuda.memory._set_allocator_settings)
        setter(DEFAULT)
    return DEFAULT


def release_cached(device: torch.device) -> None:
    """Hand the allocator's cached, unused blocks (a finished rollout's KV cache and graph pool) back to
    the driver, so the next phase maps what it needs instead of splitting the last phase's blocks."""
    if device.type == "cuda":
        torch.cuda.empty_cache()


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """Host tensor `t` on `device` without a host sync: on CUDA a pinned, non-blocking copy (a plain copy
    from pageable memory synchronizes the stream); elsewhere `t.to(device)`, `t` itself on the CPU."""
    device = torch.device(device)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
