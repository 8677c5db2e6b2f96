"""Build and load the CUDA extension (csrc/) that gives `torch.ops.fw.*` their CUDA kernels.

The extension is compiled with ninja by `torch.utils.cpp_extension.load` into a cache directory:
`$FW_OPS_CACHE`, else `~/.cache/fw/ops`, one subdirectory per torch/CUDA version and in it one per build key, a
sha256 of the csrc files' bytes and the flags (`build_dir`). A finished build marks its directory (`built`), and a
marked library loads as it is, with no toolkit or ninja: ninja compares file times, which differ between copies of
the same files, and a directory per key never holds a library of other sources. A build killed
mid-way leaves torch's `lock` file there, which makes every later build wait forever (torch does not clear it);
we record the building process in `owner` next to it, and report a lock whose owner is gone (or, with
no owner record, that is older than STALE_LOCK_AGE_S) instead of waiting on it.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import torch

CSRC = Path(__file__).resolve().parent / "csrc"
EXTENSION_NAME = "fw_ops"
STALE_LOCK_AGE_S = 900.0
# No -std flag: torch's own (C++20 since torch 2.10) must hold, since every csrc file includes torch's headers and
# a different standard there breaks the C++ exception path (a TORCH_CHECK aborts the process instead of raising).
NVCC_FLAGS = [
    "-O3", "-lineinfo",  # no --use_fast_math: rope needs accurate sincosf at large angles
    # sm_90a: sm_90 plus the Hopper-only instructions (wgmma, setmaxnreg) that linear_logprob_sm90.cuh uses
    "-gencode=arch=compute_90a,code=sm_90a",
    "-gencode=arch=compute_80,code=compute_80",  # PTX the driver JIT-compiles on other GPUs (sm_80+)
]
_loaded: dict[str, str] = {}


def running_libstdcxx() -> list[str]:
    """The libstdc++ shared library this process runs with (torch loaded it), as a linker input, or []."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                path = fields[5].strip() if len(fields) == 6 else ""
                # a library replaced on disk since it was loaded shows as "PATH (deleted)": not linkable
                if os.path.basename(path).startswith("libstdc++.so") and os.path.isfile(path):
                    return [path]
    except OSError:  # not Linux
        pass
    return []


class StaleBuildLock(RuntimeError):
    """A build lock left behind by a build that is no longer running."""


def cache_dir() -> Path:
    """Where the extension is built: $FW_OPS_CACHE or ~/.cache/fw/ops, per torch and CUDA version."""
    root = Path(os.environ.get("FW_OPS_CACHE") or Path.home() / ".cache" / "fw" / "ops")
    tag = f"torch{torch.__version__.split('+')[0]}-cu{(torch.version.cuda or 'none').replace('.', '')}"
    return root / tag


def sources() -> list[str]:
    return sorted(str(p) for p in CSRC.iterdir() if p.suffix in (".cu", ".cpp"))


def build_inputs() -> list[Path]:
    """Every file the build reads from csrc/: the sources and the headers they include."""
    return sorted(p for p in CSRC.rglob("*") if p.suffix in (".cu", ".cpp", ".cuh", ".h"))


def build_key(files: list[Path], flags: list[str], root: Path = CSRC) -> str:
    """sha256 over what a build makes its library from: each file's path under `root` and bytes, the flags, and
    torch's and CUDA's versions; unlike file times, the same for every copy of the same files."""
    h = hashlib.sha256()
    for part in (torch.__version__, str(torch.version.cuda), *flags):
        h.update(part.encode() + b"\0")
    for f in files:
        h.update(f.relative_to(root).as_posix().encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def build_dir(key: str) -> Path:
    """Where the build of `key` lives: a directory of its own in the cache."""
    return cache_dir() / key[:16]


def built(directory: Path, name: str, key: str) -> bool:
    """Whether `directory` holds a finished build of `name` for `key`."""
    marker = directory / "built"
    return (directory / f"{name}.so").is_file() and marker.is_file() and marker.read_text().strip() == key


def load_or_compile(directory: Path, name: str, key: str, compile_library: Callable[[], object]) -> str:
    """The path of `<directory>/<name>.so` loaded into torch: as it is when the directory is marked as a finished
    build of `key`, else after `compile_library()` builds it there (and the mark is written)."""
    library = directory / f"{name}.so"
    if built(directory, name, key):
        return _load_built(library)
    path = Path(str(compile_library() or library))
    if path == library:   # torch names a second build of other sources in one process <name>_v1.so
        (directory / "built").write_text(key + "\n")
    return str(path)


def _load_built(library: Path) -> str:
    torch.ops.load_library(str(library))
    with contextlib.suppress(OSError):   # the mark's time says when the build was last used (prune_builds)
        os.utime(library.parent / "built")
    return str(library)


def pid_alive(pid: int) -> bool:
    """Whether a process `pid` exists (one we may not signal counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def lock_status(directory: Path | None = None) -> tuple[str, str]:
    """("none" | "held" | "stale", human-readable detail) for the build lock in `directory`."""
    d = directory or cache_dir()
    lock, owner_file = d / "lock", d / "owner"
    if not lock.exists():
        return "none", "no build lock"
    age = time.time() - lock.stat().st_mtime
    owner = None
    if owner_file.exists():
        try:
            owner = json.loads(owner_file.read_text())
        except (OSError, ValueError):
            owner = None
    if owner and owner.get("host") == socket.gethostname():
        if pid_alive(int(owner["pid"])):
            return "held", f"{lock} held by running pid {owner['pid']} for {age:.0f}s"
        return "stale", (f"{lock} left by pid {owner['pid']}, which is no longer running "
                         f"(a build killed mid-way); delete the file to build again")
    if age > STALE_LOCK_AGE_S:
        who = f"host {owner['host']} pid {owner['pid']}" if owner else "an unknown process"
        return "stale", (f"{lock} is {age:.0f}s old (owner: {who}); a build takes about a minute, so it was "
                         "most likely killed mid-way; delete the file to build again")
    return "held", f"{lock} created {age:.0f}s ago by another process (a build in progress?)"


def _cpp_extension():
    """torch.utils.cpp_extension, imported with its logger quiet: with a CUDA build of torch, a toolkit and no GPU
    (a CPU machine with nvcc) the import logs "No CUDA runtime is found" to stderr, which `fw doctor` reports itself
    as "GPU: none visible"."""
    log = logging.getLogger("torch.utils.cpp_extension")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        from torch.utils import cpp_extension
    finally:
        log.setLevel(level)
    return cpp_extension


def cuda_home() -> str | None:
    """The CUDA toolkit that builds the extension (torch's CUDA_HOME), or None."""
    return _cpp_extension().CUDA_HOME


def _toolkit_home() -> str | None:
    """CUDA_HOME as torch finds it ($CUDA_HOME, the nvcc on PATH, /usr/local/cuda), also under a CPU-only
    torch, which leaves cpp_extension.CUDA_HOME unset: doctor then reports the toolkit and why it cannot serve."""
    cpp_extension = _cpp_extension()
    if cpp_extension.CUDA_HOME:
        return cpp_extension.CUDA_HOME
    log = logging.getLogger("torch.utils.cpp_extension")
    level = log.level
    log.setLevel(logging.ERROR)   # it warns "No CUDA runtime is found", which doctor says in its GPU line
    try:
        return getattr(cpp_extension, "_find_cuda_home", lambda: None)()
    finally:
        log.setLevel(level)


def nvcc_problem() -> str | None:
    """Why the toolkit's nvcc cannot build the extension for this torch, or None when it can: it must run
    and be of the CUDA major version torch was built with."""
    home = _toolkit_home()
    if home is None:
        return "no CUDA toolkit found (nvcc); install one or set CUDA_HOME"
    nvcc = os.path.join(home, "bin", "nvcc")
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{nvcc} does not run ({e})"
    if out.returncode != 0:
        first = (out.stderr or out.stdout).strip().splitlines()
        return f"{nvcc} --version exits with {out.returncode}" + (f": {first[0]}" if first else "")
    m = re.search(r"release (\d+)\.(\d+)", out.stdout)
    if not m:
        return f"{nvcc} --version names no CUDA release: it is not a working nvcc"
    if torch.version.cuda is None:
        return f"nvcc is CUDA {m[1]}.{m[2]}, but torch {torch.__version__} is a CPU-only build"
    if m[1] != torch.version.cuda.split(".")[0]:
        return (f"{nvcc} is CUDA {m[1]}.{m[2]} but torch was built with CUDA {torch.version.cuda}; install a "
                f"CUDA {torch.version.cuda.split('.')[0]}.x toolkit and point CUDA_HOME at it")
    return None


def toolkit_report() -> str:
    """One line for `fw doctor`: the toolkit, its nvcc version, and what is wrong with it if anything."""
    home = _toolkit_home()
    if home is None:
        return "not found"
    problem = nvcc_problem()
    return f"{home} (unusable: {problem})" if problem else f"{home} (nvcc fits torch CUDA {torch.version.cuda})"


def _first_compiler_error(text: str) -> str:
    """The first line of a failed build's output that names an error, else its last line."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    errors = [line for line in lines if re.search(r"\berror\b", line, re.IGNORECASE)]
    return (errors or lines or ["no output"])[0]


def loaded_path() -> str | None:
    """The path of the extension this process loaded, or None."""
    return _loaded.get("path")


def build(verbose: bool = False) -> str:
    """Compile (if needed) and load the CUDA extension; returns the path of the loaded library.
    Raises RuntimeError when CUDA or the toolchain is missing, StaleBuildLock for a dead build's lock."""
    if "path" in _loaded:
        return _loaded["path"]
    cpp_extension = _cpp_extension()
    if torch.version.cuda is None:
        raise RuntimeError(f"torch {torch.__version__} is a CPU-only build; the CUDA kernels need a CUDA torch")
    key = build_key(build_inputs(), build_flags())
    d = build_dir(key)
    if built(d, EXTENSION_NAME, key) and lock_status(d)[0] == "none":
        # built from these very files (in another checkout or copy of them, say): no toolkit or compile needed
        _loaded["path"] = _load_built(d / f"{EXTENSION_NAME}.so")
        return _loaded["path"]
    problem = nvcc_problem()
    if problem:
        raise RuntimeError(problem)
    d.mkdir(parents=True, exist_ok=True)
    state, detail = lock_status(d)
    if state == "stale":
        raise StaleBuildLock(detail)
    owner_file = d / "owner"
    mine = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time()}
    if state == "none":
        owner_file.write_text(json.dumps(mine))
    try:
        path = load_or_compile(d, EXTENSION_NAME, key, lambda: _compile(cpp_extension, verbose, d))
    finally:
        if state == "none" and owner_file.exists():
            try:
                if json.loads(owner_file.read_text()).get("pid") == os.getpid():
                    owner_file.unlink()
            except (OSError, ValueError):
                pass
    prune_builds(d)
    _loaded["path"] = path
    return path


KEEP_BUILDS = 3


def prune_builds(current: Path, keep: int = KEEP_BUILDS) -> list[Path]:
    """Delete the cache's builds of other keys beyond the `keep` - 1 most recently finished, except those a build
    holds the lock of; returns what went. Each change of the sources builds into a new directory."""
    others = [b for b in current.parent.iterdir() if b.is_dir() and b != current and (b / "built").is_file()
              and lock_status(b)[0] == "none"]
    others.sort(key=lambda b: (b / "built").stat().st_mtime, reverse=True)
    gone = others[keep - 1:]
    for b in gone:
        shutil.rmtree(b, ignore_errors=True)
    return gone


def _ldflags() -> list[str]:
    # Linked against the libstdc++.so that torch runs with: a compiler that links libstdc++ statically by default
    # copies libstdc++ into fw_ops.so, and that copy's iostreams crash (SIGSEGV) formatting any TORCH_CHECK message:
    # a bad argument kills the process instead of raising. Resolved against the shared library first, nothing is
    # taken from the static archive (tests/test_ops.py::test_extension_links_the_running_libstdcxx shows it).
    return ["-lcublas", "-lcublasLt", *running_libstdcxx()]


def build_flags() -> list[str]:
    """The compiler and linker flags of a build, as its key counts them."""
    return ["-O3", *NVCC_FLAGS, *_ldflags()]


def _compile(cpp_extension, verbose: bool, d: Path):
    """cpp_extension.load into `d`; a failed compile is one line (its first error), the full output under verbose."""
    try:
        return cpp_extension.load(
            name=EXTENSION_NAME, sources=sources(), build_directory=str(d), verbose=verbose,
            is_python_module=False, extra_cflags=["-O3"], extra_cuda_cflags=NVCC_FLAGS, extra_ldflags=_ldflags(),
        )
    except RuntimeError as e:
        if verbose:
            raise
        raise RuntimeError(f"compiling the CUDA ops failed: {_first_compiler_error(str(e))} (the whole compiler "
                           "output: python -c 'import ops_cuda; ops_cuda.build(verbose=True)')") from e
