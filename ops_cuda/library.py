"""The `fw` operator library and what every op module uses to join it.

Each op module (ops_cuda/<op>.py) calls `define` with its schema and torch reference: the schema exists on
every machine, with or without a compiler, and the reference is the CPU kernel. The CUDA kernels come from
the C++ extension (each csrc/<op>.cu has its own `TORCH_LIBRARY_IMPL(fw, CUDA, m)`), built on the first call
with a CUDA tensor: until then each CUDA key holds a small Python shim that builds and loads the extension,
removes itself and redispatches. If the build fails, the references are registered for CUDA instead, with
one warning. `register_autocast` gives an op autocast's rule for aten's 16-bit ops (matmul, attention). This module
imports no op module, and ops_cuda/extension.py does not import it.
"""
from __future__ import annotations

import threading
import warnings
from collections.abc import Callable

import torch
from torch import Tensor

from ops_cuda.extension import build

LIB = torch.library.Library("fw", "DEF")  # noqa: TOR901 (schemas defined once, here)
_CUDA_SHIMS = torch.library.Library("fw", "IMPL")  # noqa: TOR901
_CUDA_FALLBACK: list[torch.library.Library] = []
_cuda_lock = threading.Lock()
cuda_state = {"backend": None, "error": None, "path": None}  # backend: None (untried) | "kernels" | "reference"

# The torch reference behind each operator with a CUDA kernel (its CPU kernel and its CUDA fallback).
REFERENCES: dict[str, Callable] = {}


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The accumulation dtype of the references for inputs of `dtype`: float32, or float64 for float64."""
    return torch.promote_types(dtype, torch.float32)


def fail(op: str, what: str) -> None:
    raise ValueError(f"ops_cuda.{op}: {what}")


def need_dim(op: str, name: str, t: Tensor, ndim: int, layout: str) -> None:
    if not isinstance(t, Tensor):
        fail(op, f"`{name}` must be a torch.Tensor {layout}, got {type(t).__name__}")
    if t.dim() != ndim:
        fail(op, f"`{name}` must be {layout}, got shape {tuple(t.shape)}")


def need_device(op: str, anchor: str, x: Tensor, **others: Tensor | None) -> None:
    """Every tensor of `others` on `x`'s device: a CUDA kernel handed a host (or another GPU's) pointer faults,
    and the fault ends the process's CUDA context rather than naming the argument."""
    for name, t in others.items():
        if t is not None and t.device != x.device:
            fail(op, f"`{name}` is on {t.device}, `{anchor}` on {x.device}: every tensor must be on one device")


def heads_fit(hq: int, hk: int) -> bool:
    """Whether hq query heads share hk > 0 key/value heads in equal groups (no modulo by zero for hk = 0)."""
    return hk > 0 and hq % hk == 0


def need_float(op: str, **tensors: Tensor) -> None:
    """Every tensor of `tensors` floating-point: the references would otherwise compute in an integer (or bool,
    or complex) dtype and return its truncated result, where the CUDA kernels refuse it."""
    for name, t in tensors.items():
        if not t.dtype.is_floating_point:
            fail(op, f"`{name}` must be a floating-point tensor, got {t.dtype}")


def need_long(op: str, name: str, t: Tensor) -> None:
    if t.dtype != torch.int64:
        fail(op, f"`{name}` must be int64 (LongTensor), got {t.dtype}")


def _storages(args: tuple) -> set[int]:
    """The data pointers of the storages of the tensor arguments (Tensor[] included)."""
    ptrs = set()
    for a in args:
        for t in a if isinstance(a, (list, tuple)) else (a,):
            if isinstance(t, Tensor) and t.numel():
                ptrs.add(t.untyped_storage().data_ptr())
    return ptrs


def _owned(out: Tensor, taken: set[int]) -> Tensor:
    """`out` contiguous in a storage of its own, as the CUDA kernels allocate theirs: never a view, since code that
    tracks an output by its tensor (framework/models/recompute.py) must not lose it behind a view whose base is the
    tensor that stays alive. A view that spans the whole storage of a temporary (`q[0]` of a `[1, N, H, D]`
    result) becomes a tensor of that storage, no copy; a view of part of one, or of an input's or another
    output's storage, or an input itself, is copied."""
    storage = out.untyped_storage() if out.numel() else None
    shared = storage is not None and storage.data_ptr() in taken
    whole = (storage is not None and out.is_contiguous() and out.storage_offset() == 0
             and out.numel() * out.element_size() == storage.nbytes())
    if out._is_view() and whole and not shared:
        out = torch.empty(0, dtype=out.dtype, device=out.device).set_(storage, 0, out.shape, out.stride())
    elif out._is_view() or shared:
        out = out.clone(memory_format=torch.contiguous_format)
    else:
        out = out.contiguous()
    if out.numel():
        taken.add(out.untyped_storage().data_ptr())
    return out


def _owned_outputs(fn: Callable) -> Callable:
    """The reference with contiguous outputs that own their storage, matching the fake kernels and the CUDA
    kernels (None: an op that only mutates its arguments)."""
    def wrapped(*args):
        out = fn(*args)
        if out is None:
            return None
        taken = _storages(args)
        if isinstance(out, tuple):
            return tuple(_owned(o, taken) for o in out)
        return _owned(out, taken)

    wrapped.__name__ = fn.__name__
    return wrapped


def define(schema: str, reference: Callable, fake: Callable | None = None, composite: bool = False,
           cuda: Callable | None = None) -> str:
    """Define `fw::<name>` from its schema and return the name. composite: `reference` is the op itself
    (CompositeImplicitAutograd: it decomposes under autograd and torch.compile, no fake or CUDA kernel).
    Otherwise `reference` is the CPU kernel and the CUDA fallback, `fake` the meta kernel, and the CUDA key
    gets the build-on-first-use shim that csrc/<name>'s TORCH_LIBRARY_IMPL replaces. cuda: a Python CUDA
    kernel instead (no csrc file, no build), e.g. over PyTorch's own kernels, or the reference itself."""
    name = schema.split("(", 1)[0]
    if cuda_state["backend"] is not None:
        raise RuntimeError(f"fw::{name} is defined after the CUDA backend was chosen; import it with ops_cuda")
    LIB.define(schema)
    if composite:
        LIB.impl(name, reference, "CompositeImplicitAutograd")
        return name
    if fake is not None:
        torch.library.register_fake(f"fw::{name}", fake)
    if cuda is not None:
        LIB.impl(name, _owned_outputs(reference), "CPU")
        LIB.impl(name, _owned_outputs(cuda), "CUDA")
        return name
    REFERENCES[name] = _owned_outputs(reference)
    LIB.impl(name, REFERENCES[name], "CPU")
    _CUDA_SHIMS.impl(name, _make_shim(name), "CUDA")
    return name


# ---------------------------------------------------------------- autocast
# The dtypes that autocast casts for its lower-precision ops; float64 and integer tensors keep theirs.
_AUTOCAST_CASTS = (torch.float16, torch.bfloat16, torch.float32)


def _autocast_cast(x, device_type: str, dtype: torch.dtype):
    if isinstance(x, Tensor):
        return x.to(dtype) if x.dtype in _AUTOCAST_CASTS and x.device.type == device_type else x
    if isinstance(x, (list, tuple)):  # a Tensor[] argument
        return type(x)(_autocast_cast(t, device_type, dtype) for t in x)
    return x


def register_autocast(name: str) -> None:
    """Under autocast `fw::<name>` computes in the region's dtype, read at each call, as aten's matmuls do."""
    # torch.library.register_autocast fixes the dtype when it registers: under fp16 autocast a bf16 rule would cast
    # to the other 16-bit type. Like it, this keeps no cast cache: each call casts its float32 operands anew.
    op = getattr(torch.ops.fw, name).default
    for device_type in ("cuda", "cpu"):
        key = "Autocast" + torch._C._dispatch_key_for_device(device_type)
        LIB.impl(name, _autocast_kernel(op, device_type, getattr(torch._C.DispatchKey, key)), key)


def _autocast_kernel(op: Callable, device_type: str, key: torch._C.DispatchKey) -> Callable:
    excluded = torch._C.DispatchKeySet(key)

    def kernel(*args, **kwargs):
        dtype = torch.get_autocast_dtype(device_type)
        args = [_autocast_cast(a, device_type, dtype) for a in args]
        kwargs = {k: _autocast_cast(v, device_type, dtype) for k, v in kwargs.items()}
        with torch._C._ExcludeDispatchKeyGuard(excluded):  # the op's own kernels run, not this one again
            return op(*args, **kwargs)

    return kernel


# ---------------------------------------------------------------- CUDA: build on first use
def load_kernels(verbose: bool = False) -> str:
    """Build/load the extension and give it the CUDA keys; returns the library path. On failure the
    references take the CUDA keys (so CUDA tensors keep working) and the error is raised."""
    with _cuda_lock:
        if cuda_state["backend"] == "kernels":
            return cuda_state["path"]
        if cuda_state["backend"] is None:
            _CUDA_SHIMS._destroy()  # before the C++ registrations arrive: no double registration
        try:
            cuda_state["path"] = build(verbose)
            cuda_state["backend"], cuda_state["error"] = "kernels", None
            return cuda_state["path"]
        except Exception as e:  # any build/load failure: the references keep CUDA working, then re-raise
            cuda_state["error"] = f"{type(e).__name__}: {e}"
            if cuda_state["backend"] is None:
                fallback = torch.library.Library("fw", "IMPL")  # noqa: TOR901
                for name, fn in REFERENCES.items():
                    fallback.impl(name, fn, "CUDA")
                _CUDA_FALLBACK.append(fallback)
            cuda_state["backend"] = "reference"
            raise


def activate_cuda() -> str:
    """Called on the first CUDA call of any fw op: load the kernels, or fall back to the references
    with one warning. Returns the backend now serving CUDA: "kernels" or "reference"."""
    if cuda_state["backend"] is not None:
        return cuda_state["backend"]
    try:
        load_kernels()
    except Exception:  # noqa: BLE001 (reported once; the references serve CUDA from now on)
        warnings.warn(f"fw ops: the CUDA extension is unavailable ({cuda_state['error']}); CUDA tensors "
                      "use the torch reference implementations (correct, slower). Run `fw doctor`.",
                      stacklevel=3)
    return cuda_state["backend"]


def _make_shim(name: str) -> Callable:
    def shim(*args):
        activate_cuda()
        return getattr(torch.ops.fw, name).default(*args)

    return shim
