"""Checkpoint save and load through fw's real checkpoint path, for a model-sized random state.

Builds policy weights in HF layout (Qwen3-like shapes) and an AdamW-like optimizer state (exp_avg,
exp_avg_sq and a step per parameter), on CUDA when present, then times `write_checkpoint_dir` (staging,
writing, hashing, fsync, publish) and `read_checkpoint_dir(verify=True)` (load and sha256 check).
fsync and hash times are summed over the threads that run them (wrappers around `os.fsync` and
`hashlib.sha256`); CPU time counts every thread of the process (on a shared machine it is steadier than
wall time); RSS is the peak above the level before each phase, sampled every 10 ms.

    python -m benchmarks.checkpoint_io --params 4e9 --dtype float32 --dir /tmp/x
    python -m benchmarks.checkpoint_io --gib 30 --dtype bfloat16 --save-only --dir /tmp/x   # N GiB of state
    FW_CHECKPOINT_DIRECT=0 python -m benchmarks.checkpoint_io ...   # buffered writes instead of O_DIRECT

After the save, the same number of bytes is written by plain O_DIRECT writes of 16 MiB from as many threads
as the save uses (no hashing, no staging): the disk's speed, the save's target. `--gather` first copies the
weights to host memory as `HfLayout.to_hf` does in a fit, and times that copy. Files written with O_DIRECT
leave nothing in the page cache, so the load that follows reads the device.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import resource
import shutil
import threading
import time
from pathlib import Path

import torch

from framework.checkpoint import checkpoints_dir, read_checkpoint_dir, step_dir_name, write_checkpoint_dir
from framework.checkpoint.directory import io_threads
from framework.config import resolve

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class Timed:
    """Sums the seconds spent in `os.fsync` and in sha256 updates, over all threads."""

    def __init__(self) -> None:
        self.fsync_s = 0.0
        self.hash_s = 0.0
        self.lock = threading.Lock()

    def add(self, attr: str, seconds: float) -> None:
        with self.lock:
            setattr(self, attr, getattr(self, attr) + seconds)

    def install(self) -> None:
        real_fsync, real_sha256 = os.fsync, hashlib.sha256
        timed = self

        def fsync(fd: int) -> None:
            t = time.perf_counter()
            real_fsync(fd)
            timed.add("fsync_s", time.perf_counter() - t)

        class Sha256:
            def __init__(self, data: bytes = b"") -> None:
                self._h = real_sha256()
                if data:
                    self.update(data)

            def update(self, data) -> None:
                t = time.perf_counter()
                self._h.update(data)
                timed.add("hash_s", time.perf_counter() - t)

            def hexdigest(self) -> str:
                return self._h.hexdigest()

        os.fsync = fsync
        hashlib.sha256 = Sha256

    def reset(self) -> None:
        self.fsync_s = self.hash_s = 0.0


class PeakRss:
    """Peak resident set size above the level at start, sampled by a thread."""

    def __enter__(self):
        self.base = self.peak = _rss()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self) -> None:
        while not self.stop.wait(0.01):
            self.peak = max(self.peak, _rss())

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()
        self.peak = max(self.peak, _rss())

    @property
    def above_gb(self) -> float:
        return (self.peak - self.base) / 1e9


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _measured(fn, *args, **kwargs):
    """fn(*args, **kwargs)'s result, wall seconds, CPU seconds (all threads) and the PeakRss around it."""
    with PeakRss() as rss:
        t, cpu = time.perf_counter(), _cpu_s()
        out = fn(*args, **kwargs)
        wall, cpu = time.perf_counter() - t, _cpu_s() - cpu
    return out, wall, cpu, rss


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def shapes(params: float) -> dict[str, tuple[int, ...]]:
    """HF-named Qwen3-like tensor shapes totalling about `params` parameters."""
    hidden = 1024 if params <= 1.5e9 else 2560 if params <= 5e9 else 4096
    inter, vocab = 3 * hidden, min(151936, max(1024, int(params * 0.1 / hidden)))
    per_layer = 4 * hidden * hidden + 3 * hidden * inter + 4 * hidden
    layers = max(1, round((params - 2 * vocab * hidden) / per_layer))
    out = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            out[f"{p}self_attn.{name}.weight"] = (hidden, hidden)
        out[f"{p}mlp.gate_proj.weight"] = (inter, hidden)
        out[f"{p}mlp.up_proj.weight"] = (inter, hidden)
        out[f"{p}mlp.down_proj.weight"] = (hidden, inter)
        for name in ("input_layernorm", "post_attention_layernorm", "self_attn.q_norm", "self_attn.k_norm"):
            out[f"{p}{name}.weight"] = (hidden,)
    out["model.norm.weight"] = (hidden,)
    out["lm_head.weight"] = (vocab, hidden)
    return out


def build_state(params: float, dtype: torch.dtype, device: str, optimizer: bool = True) -> dict:
    """A Lightning checkpoint dict as FwModule hands it over: weights under fw_components, AdamW state
    (none with `optimizer` False)."""
    g = torch.Generator(device=device).manual_seed(0)

    def rand(shape):   # random, so nothing on the way can compress it; uniform_ fills fast on a CPU too
        return torch.empty(shape, device=device, dtype=dtype).uniform_(-1, 1, generator=g)

    weights = {name: rand(shape) for name, shape in shapes(params).items()}
    state = {i: {"step": torch.tensor(10.0), "exp_avg": rand(w.shape), "exp_avg_sq": rand(w.shape).abs()}
             for i, w in enumerate(weights.values())} if optimizer else {}
    groups = [{"lr": 1e-5, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "amsgrad": False,
               "foreach": None, "maximize": False, "capturable": False, "differentiable": False,
               "fused": None, "initial_lr": 1e-5, "params": list(state)}]
    config = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "torch_dtype": str(dtype)[6:]}
    return {
        "epoch": 0, "global_step": 10, "policy_version": 10, "pytorch-lightning_version": "2.6.6",
        "state_dict": {}, "loops": {}, "callbacks": {},
        "optimizer_states": [{"state": state, "param_groups": groups}],
        "lr_schedulers": [{"base_lrs": [1e-5], "last_epoch": 10, "_step_count": 11}],
        "fw_components": {"policy": {"config": config, "state_dict": weights,
                                     "files": {"tokenizer.json": b"{}"}}},
    }


def nbytes(checkpoint: dict) -> int:
    total = 0

    def walk(x):
        nonlocal total
        if isinstance(x, torch.Tensor):
            total += x.numel() * x.element_size()
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)

    walk(checkpoint)
    return total


def params_for(gib: float, dtype: torch.dtype, optimizer: bool) -> float:
    """The parameter count whose weights (and two optimizer moments) fill `gib` GiB."""
    per_param = torch.empty(0, dtype=dtype).element_size() * (3 if optimizer else 1)
    return gib * 2**30 / per_param


def raw_disk_write(directory: Path, total: int, threads: int, chunk: int = 16 << 20) -> float:
    """Seconds to write `total` bytes of random data as `threads` files by O_DIRECT writes of `chunk` bytes
    (buffered where the file system refuses O_DIRECT), fsynced."""
    import mmap

    block = mmap.mmap(-1, chunk)   # page aligned, as O_DIRECT wants
    block.write(os.urandom(chunk))
    share = -(-total // threads // chunk) * chunk

    def one(i: int) -> None:
        path = directory / f"disk-probe-{i}"
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
        except OSError:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for _ in range(share // chunk):
                os.write(fd, block)
            os.fsync(fd)
        finally:
            os.close(fd)

    workers = [threading.Thread(target=one, args=(i,)) for i in range(threads)]
    t = time.perf_counter()
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    seconds = time.perf_counter() - t
    for i in range(threads):
        (directory / f"disk-probe-{i}").unlink()
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=float, default=1e8, help="parameter count of the policy")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default="float32", help="weights and optimizer state")
    parser.add_argument("--dir", default="/tmp/fw-checkpoint-io", help="run directory (deleted afterwards)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--keep", action="store_true", help="leave the checkpoint on disk")
    parser.add_argument("--weights-only", action="store_true",
                        help="no optimizer state: the weights' cost alone (a machine with little memory)")
    parser.add_argument("--gib", type=float, default=None,
                        help="size the state to this many GiB of tensors (instead of --params)")
    parser.add_argument("--save-only", action="store_true", help="no load + verify after the save")
    parser.add_argument("--gather", action="store_true",
                        help="copy the weights to host memory first, as a fit does, and time the copy")
    parser.add_argument("--no-disk", action="store_true", help="skip the raw O_DIRECT write of the same bytes")
    args = parser.parse_args()
    if args.gib is not None:
        args.params = params_for(args.gib, _DTYPES[args.dtype], not args.weights_only)

    run_dir = Path(args.dir)
    if run_dir.exists():
        shutil.rmtree(run_dir)
    cfg = resolve({"recipe": "sft", "run_dir": str(run_dir), "model": {"policy": {"preset": "tiny"}}})
    t = time.perf_counter()
    checkpoint = build_state(args.params, _DTYPES[args.dtype], args.device, optimizer=not args.weights_only)
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
    total = nbytes(checkpoint)
    n_params = sum(w.numel() for w in checkpoint["fw_components"]["policy"]["state_dict"].values())
    print(f"state: {n_params / 1e9:.2f}B params, {total / 1e9:.2f} GB of tensors on {args.device}, "
          f"built in {time.perf_counter() - t:.1f} s")

    rows = []
    if args.gather:
        weights = checkpoint["fw_components"]["policy"]["state_dict"]
        t = time.perf_counter()
        for name, w in weights.items():
            weights[name] = w.detach().to("cpu", copy=True)
        gather_s = time.perf_counter() - t
        size = sum(w.numel() * w.element_size() for w in weights.values())
        rows.append(("gather (weights to host, as a fit does)", f"{gather_s:8.2f} s",
                     f"{size / gather_s / 1e9:6.2f} GB/s"))

    timed = Timed()
    timed.install()
    path = checkpoints_dir(run_dir) / step_dir_name(10)
    manifest, save_s, save_cpu, save_rss = _measured(write_checkpoint_dir, checkpoint, path, cfg)
    save_fsync, save_hash = timed.fsync_s, timed.hash_s
    written = sum(meta["size"] for meta in manifest["files"].values())
    del checkpoint
    rows += [
        ("save (write + hash + fsync + publish)", f"{save_s:8.2f} s", f"{written / save_s / 1e9:6.2f} GB/s"),
        ("  CPU time (user + system, all threads)", f"{save_cpu:8.2f} s", ""),
        ("  fsync, summed over threads", f"{save_fsync:8.2f} s", ""),
        ("  sha256, summed over threads", f"{save_hash:8.2f} s", ""),
        ("  peak RSS above start", f"{save_rss.above_gb:8.2f} GB", ""),
    ]
    if not args.no_disk:
        threads = min(io_threads(), sum(1 for meta in manifest["files"].values() if meta["size"] >= 1 << 20))
        disk_s = raw_disk_write(path.parent, written, max(1, threads))
        rows.append((f"disk: raw O_DIRECT writes, {max(1, threads)} threads", f"{disk_s:8.2f} s",
                     f"{written / disk_s / 1e9:6.2f} GB/s  (save at {100 * disk_s / save_s:.0f}% of it)"))
    if not args.save_only:
        timed.reset()
        loaded, load_s, load_cpu, load_rss = _measured(read_checkpoint_dir, path, verify=True)
        load_hash = timed.hash_s
        del loaded
        rows += [
            ("load + verify", f"{load_s:8.2f} s", f"{written / load_s / 1e9:6.2f} GB/s"),
            ("  CPU time (user + system, all threads)", f"{load_cpu:8.2f} s", ""),
            ("  sha256, summed over threads", f"{load_hash:8.2f} s", ""),
            ("  peak RSS above start", f"{load_rss.above_gb:8.2f} GB", ""),
        ]
    print(f"checkpoint: {written / 1e9:.2f} GB in {len(manifest['files'])} files under {path}")
    width = max(len(r[0]) for r in rows)
    for name, value, rate in rows:
        print(f"{name:<{width}}  {value}  {rate}")
    if not args.keep:
        shutil.rmtree(run_dir)


if __name__ == "__main__":
    main()
