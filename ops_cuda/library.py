"""The `fw` operator library: schemas, CPU kernels (the torch references), fake kernels, autograd.

Schemas live here, in Python, so that the operators exist on every machine, with or without a
compiler. The CUDA kernels come from the C++ extension (csrc/bindings.cpp, `TORCH_LIBRARY_IMPL(fw,
CUDA, m)`), built on the first call with a CUDA tensor: until then each CUDA key holds a small Python
shim that builds and loads the extension, removes itself and redispatches. If the build fails, the
references are registered for CUDA instead, with one warning.
"""
from __future__ import annotations

import threading
import warnings

import torch

from ops_cuda import reference as ref

LIB = torch.library.Library("fw", "DEF")  # noqa: TOR901 (schemas defined once, here)

SCHEMAS = {
    "rms_norm": "rms_norm(Tensor x, Tensor weight, float eps) -> Tensor",
    "rms_norm_backward": "rms_norm_backward(Tensor grad, Tensor x, Tensor weight, float eps) -> (Tensor, Tensor)",
    "rope": "rope(Tensor q, Tensor k, Tensor positions, float theta, bool inverse=False) -> (Tensor, Tensor)",
    "swiglu": "swiglu(Tensor gate_up) -> Tensor",
    "swiglu_backward": "swiglu_backward(Tensor grad, Tensor gate_up) -> Tensor",
    "attention": "attention(Tensor q, Tensor k, Tensor v, Tensor? positions, float scale) -> Tensor",
    "decode_attention": "decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor lengths, "
                        "float scale) -> Tensor",
    "linear_logprob": "linear_logprob(Tensor hidden, Tensor weight, Tensor targets, float temperature, "
                      "int save_chunk=0) -> (Tensor, Tensor, Tensor, Tensor, Tensor)",
    "linear_logprob_backward": "linear_logprob_backward(Tensor grad_logprob, Tensor grad_entropy, "
                               "Tensor hidden, Tensor weight, Tensor targets, Tensor lse, Tensor entropy, "
                               "Tensor saved, Tensor offsets, float temperature, int save_chunk=0) "
                               "-> (Tensor, Tensor)",
    "sample": "sample(Tensor logits, float temperature, int top_k, float top_p, float min_p, int seed) "
              "-> (Tensor, Tensor)",
}

# The torch reference behind each operator (CPU kernel and CUDA fallback).
REFERENCES = {
    "rms_norm": ref.rms_norm,
    "rms_norm_backward": ref.rms_norm_backward,
    "rope": ref.rope,
    "swiglu": ref.swiglu,
    "swiglu_backward": ref.swiglu_backward,
    "decode_attention": ref.decode_attention,
    "linear_logprob": ref.linear_logprob,
    "linear_logprob_backward": ref.linear_logprob_backward,
    "sample": ref.sample,
}
# attention is a composite of scaled_dot_product_attention (flash / memory-efficient kernels on CUDA):
# it decomposes under autograd and torch.compile, so it needs no fake, autograd or CUDA kernel of its own.
CUDA_OPS = tuple(REFERENCES)

for _name, _schema in SCHEMAS.items():
    LIB.define(_schema)
LIB.impl("attention", ref.attention, "CompositeImplicitAutograd")


def _contiguous_outputs(fn):
    """The reference with contiguous outputs, matching the fake kernels and the CUDA kernels."""
    def wrapped(*args):
        out = fn(*args)
        if isinstance(out, tuple):
            return tuple(o.contiguous() for o in out)
        return out.contiguous()

    wrapped.__name__ = fn.__name__
    return wrapped


REFERENCES = {name: _contiguous_outputs(fn) for name, fn in REFERENCES.items()}
for _name, _fn in REFERENCES.items():
    LIB.impl(_name, _fn, "CPU")


# ---------------------------------------------------------------- fake (meta) kernels
@torch.library.register_fake("fw::rms_norm")
def _(x, weight, eps):
    return x.new_empty(x.shape)


@torch.library.register_fake("fw::rms_norm_backward")
def _(grad, x, weight, eps):
    return x.new_empty(x.shape), weight.new_empty(weight.shape)


@torch.library.register_fake("fw::rope")
def _(q, k, positions, theta, inverse=False):
    return q.new_empty(q.shape), k.new_empty(k.shape)


@torch.library.register_fake("fw::swiglu")
def _(gate_up):
    return gate_up.new_empty((*gate_up.shape[:-1], gate_up.shape[-1] // 2))


@torch.library.register_fake("fw::swiglu_backward")
def _(grad, gate_up):
    return gate_up.new_empty(gate_up.shape)


@torch.library.register_fake("fw::decode_attention")
def _(q, k_cache, v_cache, lengths, scale):
    return q.new_empty(q.shape)


@torch.library.register_fake("fw::linear_logprob")
def _(hidden, weight, targets, temperature, save_chunk=0):
    acc = ref.acc_dtype(hidden.dtype)
    n, v = hidden.shape[0], weight.shape[0]
    save = ref.saves_logits(hidden.dtype, save_chunk)
    saved = hidden.new_empty((n, v) if save else (0,), dtype=torch.float16)
    offsets = hidden.new_empty((n, -(-v // save_chunk)) if save else (0,), dtype=torch.float32)
    return (hidden.new_empty(n, dtype=acc), hidden.new_empty(n, dtype=acc), hidden.new_empty(n, dtype=acc),
            saved, offsets)


@torch.library.register_fake("fw::linear_logprob_backward")
def _(grad_logprob, grad_entropy, hidden, weight, targets, lse, entropy, saved, offsets, temperature,
      save_chunk=0):
    return hidden.new_empty(hidden.shape), weight.new_empty(weight.shape)


@torch.library.register_fake("fw::sample")
def _(logits, temperature, top_k, top_p, min_p, seed):
    b = logits.shape[0]
    return logits.new_empty(b, dtype=torch.int64), logits.new_empty(b, dtype=torch.float32)


# ---------------------------------------------------------------- autograd (backwards are fw ops)
def _rms_norm_setup(ctx, inputs, output):
    x, weight, eps = inputs
    ctx.save_for_backward(x, weight)
    ctx.eps = eps


def _rms_norm_backward(ctx, grad):
    x, weight = ctx.saved_tensors
    gx, gw = torch.ops.fw.rms_norm_backward(grad, x, weight, ctx.eps)
    return gx, gw, None


def _rope_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[2])
    ctx.theta, ctx.inverse = inputs[3], inputs[4] if len(inputs) > 4 else False


def _rope_backward(ctx, grad_q, grad_k):
    (positions,) = ctx.saved_tensors
    gq, gk = torch.ops.fw.rope(grad_q, grad_k, positions, ctx.theta, not ctx.inverse)
    return gq, gk, None, None, None


def _swiglu_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])


def _swiglu_backward(ctx, grad):
    (gate_up,) = ctx.saved_tensors
    return torch.ops.fw.swiglu_backward(grad, gate_up)


def _linear_logprob_setup(ctx, inputs, output):
    hidden, weight, targets, temperature = inputs[:4]
    _, entropy, lse, saved, offsets = output
    ctx.save_for_backward(hidden, weight, targets, lse, entropy, saved, offsets)
    ctx.temperature, ctx.save_chunk = temperature, inputs[4] if len(inputs) > 4 else 0
    # Outputs without a gradient arrive as None instead of zeros: a zero [N, V] for `saved` cost 4.6 GiB and
    # 1.5 ms at N 16,384 (H200 profile).
    ctx.set_materialize_grads(False)


def _linear_logprob_backward(ctx, grad_logprob, grad_entropy, grad_lse, grad_saved, grad_offsets):
    # lse, saved and offsets are auxiliary outputs for the backward; the public API never returns them.
    hidden, weight, targets, lse, entropy, saved, offsets = ctx.saved_tensors
    if grad_logprob is None:
        grad_logprob = torch.zeros_like(lse)
    if grad_entropy is None:
        grad_entropy = torch.zeros_like(lse)
    gh, gw = torch.ops.fw.linear_logprob_backward(grad_logprob, grad_entropy, hidden, weight, targets,
                                                  lse, entropy, saved, offsets, ctx.temperature, ctx.save_chunk)
    return gh, gw, None, None, None


torch.library.register_autograd("fw::rms_norm", _rms_norm_backward, setup_context=_rms_norm_setup)
torch.library.register_autograd("fw::rope", _rope_backward, setup_context=_rope_setup)
torch.library.register_autograd("fw::swiglu", _swiglu_backward, setup_context=_swiglu_setup)
torch.library.register_autograd("fw::linear_logprob", _linear_logprob_backward,
                                setup_context=_linear_logprob_setup)


# Under autocast (e.g. Lightning bf16-mixed) the lm_head GEMM must run in bf16 like any matmul: the hidden
# states reaching it are fp32 (the residual stream), and an fp32 GEMM over a 151,936 vocabulary is ~10x slower.
for _device in ("cuda", "cpu"):
    torch.library.register_autocast("fw::linear_logprob", _device, torch.bfloat16, lib=LIB)


# ---------------------------------------------------------------- CUDA: build on first use
_CUDA_SHIMS = torch.library.Library("fw", "IMPL")  # noqa: TOR901
_CUDA_FALLBACK: list[torch.library.Library] = []
_cuda_lock = threading.Lock()
cuda_state = {"backend": None, "error": None, "path": None}  # backend: None (untried) | "kernels" | "reference"


def load_kernels(verbose: bool = False) -> str:
    """Build/load the extension and give it the CUDA keys; returns the library path. On failure the
    references take the CUDA keys (so CUDA tensors keep working) and the error is raised."""
    from ops_cuda.extension import build

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


def _make_shim(name: str):
    def shim(*args):
        activate_cuda()
        return getattr(torch.ops.fw, name).default(*args)

    return shim


for _name in CUDA_OPS:
    _CUDA_SHIMS.impl(_name, _make_shim(_name), "CUDA")
