"""fw operators: the op seam between the model / losses and the kernels (ops_cuda/README.md).

Every function calls a `torch.ops.fw.*` operator: hand-written CUDA kernels on CUDA tensors (built on
first use, see `build`), the op's torch reference on CPU. One op lives in ops_cuda/<op>.py (schema, checks,
reference, fake, autograd) and ops_cuda/csrc/<op>.cu (kernels, host wrapper, CUDA registration); see
ops_cuda/README.md. The checks look at shapes and dtypes only, so they cost nothing under torch.compile.
"""
from __future__ import annotations

import torch

from ops_cuda import extension as _extension
from ops_cuda import library as _library
from ops_cuda.adamw_step import adamw_step
from ops_cuda.add_rms_norm import add_rms_norm
from ops_cuda.attention import attention
from ops_cuda.decode_attention import decode_attention
from ops_cuda.linear_logprob import SAVED_LOGITS_CHUNK, linear_logprob
from ops_cuda.merge_attention import merge_attention_states
from ops_cuda.paged_attention import paged_decode_attention, paged_prefill_attention
from ops_cuda.qk_norm_rope import qk_norm_rope
from ops_cuda.qk_norm_rope_write import qk_norm_rope_write
from ops_cuda.rms_norm import rms_norm
from ops_cuda.rope import rope
from ops_cuda.sample import sample
from ops_cuda.shared_prompt_attention import shared_prompt_attention
from ops_cuda.skinny_linear import linear, skinny_linear
from ops_cuda.swiglu import swiglu
from ops_cuda.varlen_attention import packed_sequences, varlen_attention, varlen_suffix_attention

__all__ = ["SAVED_LOGITS_CHUNK", "adamw_step", "add_rms_norm", "attention", "build", "cuda_backend",
           "decode_attention", "doctor", "linear", "linear_logprob", "merge_attention_states", "packed_sequences",
           "paged_decode_attention", "paged_prefill_attention", "qk_norm_rope", "qk_norm_rope_write", "rms_norm",
           "rope", "sample", "shared_prompt_attention", "skinny_linear", "swiglu", "varlen_attention",
           "varlen_suffix_attention"]


def build(verbose: bool = False) -> str:
    """Compile (if needed) and load the CUDA kernels now, e.g. on rank 0 before a multi-process job;
    returns the library path. Raises with the reason if it cannot (CUDA then uses the references)."""
    return _library.load_kernels(verbose)


def cuda_backend() -> str | None:
    """What serves the fw ops on CUDA tensors: None (not decided yet: nothing has run on CUDA and `build`
    was not called), "kernels" (the CUDA extension) or "reference" (the torch references: it failed to build)."""
    return _library.cuda_state["backend"]


def doctor() -> str:
    """A report: torch, CUDA, GPU, whether the extension is built/loaded, cache path, lock status."""
    lines = [f"torch: {torch.__version__}", f"torch CUDA: {torch.version.cuda or 'none (CPU build)'}"]
    lines.append(f"CUDA toolkit (nvcc): {_extension.toolkit_report()}")
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            cap = torch.cuda.get_device_capability(i)
            lines.append(f"GPU {i}: {torch.cuda.get_device_name(i)} (capability {cap[0]}.{cap[1]})")
    else:
        lines.append("GPU: none visible (CPU: the operators run the torch references)")
    key = _extension.build_key(_extension.build_inputs(), _extension.build_flags())
    d = _extension.build_dir(key)
    lines.append(f"cache: {d} (the build of these sources)")
    built = _extension.built(d, _extension.EXTENSION_NAME, key)
    lines.append(f"extension built: {'yes, ' + str(d / (_extension.EXTENSION_NAME + '.so')) if built else 'no'}")
    lines.append(f"extension loaded: {'yes' if _extension.loaded_path() else 'no'}")
    served = {None: "not decided yet (built on first CUDA call)", "kernels": "the CUDA kernels",
              "reference": f"the torch references ({_library.cuda_state['error']})"}
    lines.append(f"CUDA ops served by: {served[cuda_backend()]}")
    lines.append(f"build lock: {_extension.lock_status(d)[1]}")
    return "\n".join(lines)
