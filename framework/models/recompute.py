"""Selective recomputation (`model.policy.gradient_checkpointing: selective`): the outputs of a layer's cheap ops
(its two RMSNorms with autocast's cast, QK-norm with RoPE, SwiGLU) are not kept for the backward. The forward
marks them with `cheap`; while `SelectiveRecompute` is active, a saved-tensor hook replaces each marked tensor
(or a view of one) that the autograd graph saves by a recipe holding the op's inputs, which the backward keeps
anyway (RMSNorm, QK-norm and SwiGLU save their inputs), and the backward runs the op again when it unpacks it.

The recomputed tensors are bitwise the forward's: the same deterministic kernels on the same inputs. So the
gradients do not change, while a layer keeps about a third fewer bytes per token (framework/memory_plan.py
counts them), for one more pass of these memory-bound ops in the backward.
"""
from __future__ import annotations

import contextvars
from collections.abc import Callable
from typing import Any, Self

import torch
from torch import Tensor
from torch.utils.weak import WeakTensorKeyDictionary

_ACTIVE: contextvars.ContextVar[SelectiveRecompute | None] = contextvars.ContextVar("fw_recompute", default=None)


class _Recipe:
    """One cheap call: its function and inputs, and its outputs while saved references to them wait to be
    unpacked by the backward."""

    __slots__ = ("args", "fn", "outputs", "pending", "versions")

    def __init__(self, fn: Callable, args: tuple) -> None:
        self.fn, self.args = fn, args
        self.versions = [a._version for a in args if isinstance(a, Tensor)]
        self.outputs: tuple[Tensor, ...] | None = None
        self.pending = 0   # saved references not yet unpacked: the recomputed outputs stay until they are

    def output(self, index: int) -> Tensor:
        if self.outputs is None:
            now = [a._version for a in self.args if isinstance(a, Tensor)]
            if now != self.versions:
                raise RuntimeError("selective recomputation: an input of a recomputed op was modified in place "
                                   "after the forward; its output cannot be recomputed")
            with torch.no_grad():
                out = self.fn(*self.args)
            self.outputs = out if isinstance(out, tuple) else (out,)
        out = self.outputs[index]
        self.pending -= 1
        if self.pending <= 0:
            self.outputs = None
        return out


class _Saved:
    """What the autograd graph holds instead of a marked tensor: its recipe, and the view's geometry when the
    graph saved a view of it."""

    __slots__ = ("index", "recipe", "view")

    def __init__(self, recipe: _Recipe, index: int, view: tuple | None) -> None:
        self.recipe, self.index, self.view = recipe, index, view


class SelectiveRecompute:
    """A context in which tensors marked by `cheap` are recomputed in the backward instead of kept."""

    def __init__(self) -> None:
        self._marked = WeakTensorKeyDictionary()   # output tensor -> (recipe, output index)
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._token: contextvars.Token | None = None

    def __enter__(self) -> Self:
        self._hooks.__enter__()
        self._token = _ACTIVE.set(self)
        return self

    def __exit__(self, *exc: object) -> None:
        _ACTIVE.reset(self._token)
        self._hooks.__exit__(*exc)

    def mark(self, outputs: Tensor | tuple[Tensor, ...], fn: Callable, args: tuple) -> None:
        recipe = _Recipe(fn, args)
        for i, t in enumerate(outputs if isinstance(outputs, tuple) else (outputs,)):
            self._marked[t] = (recipe, i)

    def _pack(self, t: Tensor) -> Any:
        entry, view = self._marked.get(t), None
        if entry is None and t._base is not None:
            entry = self._marked.get(t._base)
            view = (t.size(), t.stride(), t.storage_offset() - t._base.storage_offset())
        if entry is None:
            return t
        recipe, index = entry
        recipe.pending += 1
        return _Saved(recipe, index, view)

    @staticmethod
    def _unpack(saved: Any) -> Tensor:
        if not isinstance(saved, _Saved):
            return saved
        out = saved.recipe.output(saved.index)
        if saved.view is None:
            return out
        size, stride, offset = saved.view
        return out.as_strided(size, stride, out.storage_offset() + offset)


def active() -> bool:
    """Whether the current forward marks cheap outputs for recomputation (never in code torch.compile traces,
    whose partitioner decides what to recompute)."""
    return not torch.compiler.is_compiling() and _ACTIVE.get() is not None


def cheap(fn: Callable, *args: Any) -> Any:
    """``fn(*args)``, marked for recomputation when a `SelectiveRecompute` is active. ``fn`` must be
    deterministic and independent of autocast (the backward runs outside it), with tensor outputs whose
    strides a second call reproduces."""
    out = fn(*args)
    recomputed_as(out, fn, *args)
    return out


def recomputed_as(out: Tensor | tuple[Tensor, ...], fn: Callable, *args: Any) -> None:
    """Mark ``out``, already computed, for recomputation by ``fn(*args)`` when a `SelectiveRecompute` is active:
    for one output of an op whose other outputs are kept. ``fn(*args)`` must give ``out``'s bits (as for
    `cheap`)."""
    if torch.compiler.is_compiling():
        return
    recorder = _ACTIVE.get()
    if recorder is not None and torch.is_grad_enabled():
        recorder.mark(out, fn, args)
