"""Tensor files: safetensors written in one pass, hashed while written and fsynced; their headers checked on
read; and the trainer state's tensors moved out of the pickle into such files and back.

One pass per file matters for large checkpoints: each tensor's bytes are copied once, into an aligned
staging buffer (pinned, for CUDA tensors), from which they are hashed and written at the same time, without
a read back; filling, hashing and writing overlap, and several files are written by several threads (one
file hashes on one core at most, sha256 being sequential).
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import re
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from framework.durable import no_room, no_room_reason
from framework.errors import DiskFull, FwError

SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}
_CHUNK = 16 << 20            # bytes per write and per staging buffer
_SLOTS = 4                   # staging buffers per file: one filling, the others hashing and writing
_MAX_HEADER = 100 << 20      # what safetensors itself accepts
# trainer-state tensors below this size stay in the pickle (step counts, RNG states): cheap there, and
# readers of trainer_state.pt keep seeing them as tensors
_MIN_SPLIT_BYTES = 64 << 10
_TRAINER_TENSORS = re.compile(r"^trainer_state(-\d{5}-of-\d{5})?\.safetensors$")
TRAINER_TENSORS_PREFIX = "trainer_state"


def shard_names(stem: str, count: int) -> list[str]:
    """`stem.safetensors`, or `stem-00001-of-0000N.safetensors` for several shards (HF's naming)."""
    if count == 1:
        return [f"{stem}.safetensors"]
    return [f"{stem}-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


_ALIGN = 4096   # O_DIRECT wants offsets, lengths and buffers aligned to the device's blocks


def _aligned_buffer(nbytes: int, pinned: bool) -> torch.Tensor:
    """A uint8 tensor of `nbytes` starting on an `_ALIGN` boundary (pinned host memory for CUDA copies).
    Pinned blocks come page aligned and rounded up to a power of two, so one of the exact size is tried
    first; an unaligned one is given back for one a block larger."""
    raw = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
    if raw.data_ptr() % _ALIGN == 0:
        return raw
    del raw
    raw = torch.empty(nbytes + _ALIGN, dtype=torch.uint8, pin_memory=pinned)
    skip = -raw.data_ptr() % _ALIGN
    return raw[skip:skip + nbytes]


class _Sink:
    """Writes a byte stream to a new file and its sha256, the stages overlapping.

    The caller packs the bytes into one of `_SLOTS` aligned staging buffers of `_CHUNK` bytes (CUDA tensors
    by an asynchronous copy on a side stream); a full buffer goes to a hashing thread (in order: sha256 is
    sequential) and, at the same time, to a writing thread (`pwrite` at its offset), and is reused once both
    are done. So the disk writes while the next chunk is hashed and the one after is filled, and a file
    streams at the slowest stage's speed rather than at the sum of their times.

    Where the file system takes O_DIRECT the buffers go straight to the device: no page cache to fill
    (costly on a host that hands out fresh pages slowly) and no dirty pages for fsync to wait on. Elsewhere
    (tmpfs, or FW_CHECKPOINT_DIRECT=0) writes are buffered. fsync follows in both cases.
    """

    def __init__(self, path: Path, pinned: bool = False):
        from concurrent.futures import ThreadPoolExecutor

        self.path, self.digest, self.size, self.fill = path, hashlib.sha256(), 0, 0
        # whole blocks, so every write but the padded last one is aligned (whatever _CHUNK is)
        self.capacity = -(-_CHUNK // _ALIGN) * _ALIGN
        block = _aligned_buffer(_SLOTS * self.capacity, pinned)   # one allocation: one pinned block
        self.slots = [block[i * self.capacity:(i + 1) * self.capacity] for i in range(_SLOTS)]
        self.arrays = [slot.numpy() for slot in self.slots]
        self.views = [memoryview(array) for array in self.arrays]
        self.pending: list[tuple[Any, ...]] = [() for _ in range(_SLOTS)]   # futures still using each slot
        self.slot = 0
        self.offset = 0   # file offset of the current slot
        self.streams: dict[torch.device, torch.cuda.Stream] = {}
        self.copied: set[torch.device] = set()   # devices with copies into the current slot
        self.hasher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fw-ckpt-hash")
        self.writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fw-ckpt-write")
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        self.direct = os.environ.get("FW_CHECKPOINT_DIRECT", "1") != "0" and hasattr(os, "O_DIRECT")
        self.fd = -1
        if self.direct:
            try:
                self.fd = os.open(path, flags | os.O_DIRECT, 0o666)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                self.direct = False
        if self.fd < 0:
            self.fd = os.open(path, flags, 0o666)

    def put(self, flat: torch.Tensor) -> None:
        """Append the bytes of a 1-D uint8 tensor (CPU or CUDA)."""
        cuda = flat.device.type == "cuda"
        if cuda:
            stream = self._stream(flat.device)
            flat.record_stream(stream)   # its memory stays allocated until the copies out of it have run
        else:
            # numpy copies on this thread's core without the GIL; torch's copy_ would start a team of
            # threads in each of the files' threads at once
            source = flat.cpu().numpy()
        start, total = 0, flat.numel()
        while start < total:
            if self.fill == 0:
                self._wait(self.slot)
            n = min(total - start, self.capacity - self.fill)
            if cuda:
                with torch.cuda.stream(stream):
                    self.slots[self.slot][self.fill:self.fill + n].copy_(flat[start:start + n], non_blocking=True)
                self.copied.add(flat.device)
            else:
                self.arrays[self.slot][self.fill:self.fill + n] = source[start:start + n]
            self.fill, self.size, start = self.fill + n, self.size + n, start + n
            if self.fill == self.capacity:
                self._submit()

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        if device not in self.streams:
            stream = torch.cuda.Stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))   # the tensors' producers come first
            self.streams[device] = stream
        return self.streams[device]

    def _wait(self, slot: int) -> None:
        for future in self.pending[slot]:
            future.result()
        self.pending[slot] = ()

    def _submit(self) -> None:
        """Hand the current slot to the hashing and the writing thread; move on to the next slot."""
        slot, used = self.slot, self.fill
        events = []
        for device in self.copied:
            event = torch.cuda.Event()
            event.record(self.streams[device])
            events.append(event)
        self.copied = set()
        length = used
        if self.direct and used % _ALIGN:
            length = used + (-used % _ALIGN)   # the last chunk: padded to a block, cut back by finish()
            self.slots[slot][used:length].zero_()
        view = self.views[slot]
        self.pending[slot] = (self.hasher.submit(self._hash, view[:used], events),
                              self.writer.submit(self._write, view[:length], self.offset, events))
        self.offset += length
        self.slot, self.fill = (slot + 1) % _SLOTS, 0

    def _hash(self, view: memoryview, events: list) -> None:
        for event in events:
            event.synchronize()
        self.digest.update(view)

    def _write(self, view: memoryview, offset: int, events: list) -> None:
        for event in events:
            event.synchronize()
        try:
            _pwrite_all(self.fd, view, offset)
        except OSError as e:
            if e.errno != errno.EINVAL or not self.direct:
                raise
            # the file system opened it O_DIRECT but refuses such writes: continue buffered, same offset
            fcntl.fcntl(self.fd, fcntl.F_SETFL, fcntl.fcntl(self.fd, fcntl.F_GETFL) & ~os.O_DIRECT)
            _pwrite_all(self.fd, view, offset)

    def finish(self) -> None:
        """Write what is left, wait for every hash and write, cut the file to its real size and fsync."""
        if self.fill:
            self._submit()
        for slot in range(_SLOTS):
            self._wait(slot)
        if self.offset != self.size:
            os.ftruncate(self.fd, self.size)
        os.fsync(self.fd)

    def close(self) -> None:
        # no thread may still touch the file or the buffers once the caller removes them
        self.hasher.shutdown(wait=True, cancel_futures=True)
        self.writer.shutdown(wait=True, cancel_futures=True)
        os.close(self.fd)
        self.views = self.arrays = self.slots = []


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None
                      ) -> tuple[int, str]:
    """Write `tensors` as a safetensors file (readable by safetensors and transformers), fsync it and return
    (size, sha256) of the bytes written. Tensors may live on any device; CUDA ones stream through pinned
    memory. A write that finds no room (a full disk or quota, a file size limit) raises DiskFull naming the
    file."""
    for name, t in tensors.items():
        if t.dtype not in SAFETENSORS_DTYPES:
            raise ValueError(f"{path}: tensor {name} has dtype {t.dtype}, which safetensors cannot hold")
    # widest elements first keeps every tensor aligned to its element size (as safetensors orders them)
    order = sorted(tensors, key=lambda n: -tensors[n].element_size())
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name in order:
        t = tensors[name]
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    try:
        sink = _Sink(path, pinned=any(t.device.type == "cuda" for t in tensors.values()))
        try:
            sink.put(torch.frombuffer(bytearray(struct.pack("<Q", len(text)) + text), dtype=torch.uint8))
            for name in order:   # one tensor made contiguous at a time: no second copy of the whole file
                sink.put(_flat_bytes(tensors[name]))
            sink.finish()
        finally:
            sink.close()
    except OSError as e:
        code = no_room(e)
        if code is not None:   # the OSError stays its __context__, which `no_room` finds
            raise DiskFull(f"{path}: {no_room_reason(code)} while writing the checkpoint") from None
        raise
    return sink.size, sink.digest.hexdigest()


def check_header(path: Path) -> dict:
    """The parsed header of a safetensors file; FwError naming the file when it is not a valid one."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise FwError(f"{path}: corrupt safetensors file ({size} bytes, shorter than its header length)")
        n = struct.unpack("<Q", head)[0]
        if n > min(_MAX_HEADER, size - 8):
            raise FwError(f"{path}: corrupt safetensors header (it claims {n} bytes, the file has {size})")
        try:
            header = json.loads(f.read(n))
        except ValueError as e:
            raise FwError(f"{path}: corrupt safetensors header (not JSON: {e})") from None
    if not isinstance(header, dict):
        raise FwError(f"{path}: corrupt safetensors header (not a JSON object)")
    end = 0
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        try:
            start, stop = meta["data_offsets"]
            end = max(end, stop)
            ok = 0 <= start <= stop and isinstance(meta["dtype"], str) and isinstance(meta["shape"], list)
        except (KeyError, TypeError, ValueError):
            ok = False
        if not ok:
            raise FwError(f"{path}: corrupt safetensors header (entry {name!r} is malformed)")
    if 8 + n + end != size:
        raise FwError(f"{path}: corrupt safetensors file (the header describes {8 + n + end} bytes, the file has "
                      f"{size})")
    return header


def read_safetensors(path: Path, device: str = "cpu") -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file, its header checked first; FwError naming the file if corrupt."""
    check_header(path)
    try:
        return load_file(path, device=device)
    except SafetensorError as e:
        raise FwError(f"{path}: corrupt safetensors file ({e})") from None


class TensorRef(str):
    """Stands in the pickled trainer state for a tensor stored in the trainer state's safetensors files."""

    __slots__ = ()


class SubclassRef(tuple):
    """Stands in the pickled trainer state for a tensor subclass (torchao's 8-bit optimizer states) whose
    inner tensors are stored like plain ones: (class "module:qualname", flatten context, {attr: inner},
    size, stride). Pickling such a tensor whole would stream it through one thread's torch.save."""

    __slots__ = ()


def _subclass_name(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def _flattenable(x: Any) -> bool:
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    return type(x) not in (torch.Tensor, torch.nn.Parameter) and is_traceable_wrapper_subclass(x)


def _rebuild_subclass(ref: SubclassRef, inner: dict[str, torch.Tensor], source: str) -> torch.Tensor:
    """The tensor `ref` stands for; only classes allowed for weights-only loading are rebuilt (the same trust
    as torch.load's: `framework.optim.allow_optimizer_states` allows torchao's)."""
    name, context, _, size, stride = ref
    allowed = [g[0] if isinstance(g, tuple) else g for g in torch.serialization.get_safe_globals()]
    cls = next((g for g in allowed if isinstance(g, type) and _subclass_name(g) == name), None)
    if cls is None:
        raise FwError(f"{source}: the trainer state holds a {name} tensor, a class not allowed for loading "
                      "(its optimizer is not the configured one)")
    return cls.__tensor_unflatten__(inner, context, torch.Size(size), tuple(stride))


def _storable(x: Any) -> bool:
    return (type(x) in (torch.Tensor, torch.nn.Parameter) and x.layout == torch.strided
            and x.dtype in SAFETENSORS_DTYPES and x.numel() * x.element_size() >= _MIN_SPLIT_BYTES)


def split_tensors(obj: Any) -> tuple[Any, dict[str, torch.Tensor]]:
    """`obj` with every plain tensor of 64 KiB or more inside dicts, lists and tuples replaced by a TensorRef
    (and every tensor subclass by a SubclassRef of its inner tensors, treated alike), and the tensors by name
    (their path, e.g. `optimizer_states.0.state.3.exp_avg`). A tensor met twice is one entry."""
    tensors: dict[str, torch.Tensor] = {}
    names: dict[int, str] = {}

    def walk(x: Any, path: str) -> Any:
        if _storable(x):
            if id(x) not in names:
                name = path
                while name in tensors:
                    name += "'"
                names[id(x)] = name
                tensors[name] = x
            return TensorRef(names[id(x)])
        if _flattenable(x):
            attrs, context = x.__tensor_flatten__()
            inner = {a: walk(getattr(x, a), f"{path}.{a}") for a in attrs}
            return SubclassRef((_subclass_name(type(x)), context, inner, list(x.shape), list(x.stride())))
        if isinstance(x, dict) and type(x) is dict:
            return {k: walk(v, f"{path}.{k}" if path else str(k)) for k, v in x.items()}
        if type(x) in (list, tuple):
            return type(x)(walk(v, f"{path}.{i}") for i, v in enumerate(x))
        return x

    return walk(obj, ""), tensors


def join_tensors(obj: Any, tensors: dict[str, torch.Tensor], source: str) -> Any:
    """The inverse of `split_tensors`; FwError when a referenced tensor is missing from `source`."""

    def walk(x: Any) -> Any:
        if type(x) is TensorRef:
            if x not in tensors:
                raise FwError(f"{source}: tensor {str(x)!r} of the trainer state is missing")
            return tensors[x]
        if type(x) is SubclassRef:
            return _rebuild_subclass(x, {a: walk(t) for a, t in x[2].items()}, source)
        if type(x) is dict:
            return {k: walk(v) for k, v in x.items()}
        if type(x) in (list, tuple):
            return type(x)(walk(v) for v in x)
        return x

    return walk(obj)


def is_trainer_tensor_file(rel: str) -> bool:
    return _TRAINER_TENSORS.match(rel) is not None


def run_parallel(jobs: list[Callable[[], Any]], workers: int) -> list[Any]:
    """Run `jobs` on up to `workers` threads; results in order; the first failure (in job order) is raised
    after every job has finished, so no thread is still writing when the caller cleans up."""
    from concurrent.futures import ThreadPoolExecutor

    if len(jobs) <= 1 or workers <= 1:
        return [job() for job in jobs]
    with ThreadPoolExecutor(max_workers=min(workers, len(jobs))) as pool:
        futures = [pool.submit(job) for job in jobs]
    errors = [f.exception() for f in futures]
    for error in errors:
        if error is not None:
            raise error
    return [f.result() for f in futures]
