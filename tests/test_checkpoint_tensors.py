"""Tensor files of checkpoints: safetensors written in one pass (read back by safetensors itself), headers
checked on read, and the trainer state's tensors split out of the pickle and joined back."""

from __future__ import annotations

import hashlib

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from framework.checkpoint import tensors as ts
from framework.errors import FwError
from framework.models.hf_io import plan_shards


def _tensors(device: str) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(48, 40, generator=g)
    return {
        "w.f32": base.to(device),
        "w.bf16": torch.randn(7, 5, generator=g).to(torch.bfloat16).to(device),
        "w.f16.transposed": base.t().to(torch.float16).to(device),   # not contiguous
        "w.i64": torch.arange(9, dtype=torch.int64).to(device),
        "w.bool": (torch.randn(11, generator=g) > 0).to(device),
        "w.scalar": torch.tensor(3.5, dtype=torch.float64).to(device),
        "w.empty": torch.zeros(0, 4).to(device),
    }


def _check_file(path, tensors, size, digest):
    data = path.read_bytes()
    assert (size, digest) == (len(data), hashlib.sha256(data).hexdigest())
    loaded = load_file(path)
    assert loaded.keys() == tensors.keys()
    for name, t in tensors.items():
        assert loaded[name].dtype == t.dtype and torch.equal(loaded[name], t.cpu()), name
    with safe_open(path, "pt") as f:
        assert f.metadata() == {"format": "pt"}
    assert ts.check_header(path).keys() == {"__metadata__", *tensors}


@pytest.mark.parametrize("direct", ["1", "0"])   # O_DIRECT from the aligned staging buffers, or buffered writes
@pytest.mark.parametrize("chunk", [32 << 20, 8192])   # 8 KiB: tensors span several writes and buffer fills
@pytest.mark.parametrize("slots", [1, 4])   # one buffer (each chunk waits for its hash and write) or several
def test_write_safetensors_reads_back_with_safetensors(tmp_path, monkeypatch, chunk, direct, slots):
    monkeypatch.setattr(ts, "_CHUNK", chunk)
    monkeypatch.setattr(ts, "_SLOTS", slots)
    monkeypatch.setenv("FW_CHECKPOINT_DIRECT", direct)
    tensors = {**_tensors("cpu"), "big": torch.randn(3000)}   # 12000 bytes: not a multiple of a block
    size, digest = ts.write_safetensors(tmp_path / "a.safetensors", tensors, {"format": "pt"})
    _check_file(tmp_path / "a.safetensors", tensors, size, digest)


def test_o_direct_is_used_where_the_file_system_takes_it(tmp_path, monkeypatch):
    import os

    try:
        os.close(os.open(tmp_path / "probe", os.O_WRONLY | os.O_CREAT | os.O_DIRECT))
    except OSError:
        pytest.skip(f"{tmp_path} does not take O_DIRECT")
    for env, expected in (("1", True), ("0", False)):
        monkeypatch.setenv("FW_CHECKPOINT_DIRECT", env)
        sink = ts._Sink(tmp_path / f"file-{env}")
        sink.close()
        assert sink.direct is expected


@pytest.mark.gpu
@pytest.mark.parametrize("chunk", [32 << 20, 1000])   # 1000 bytes (a block): the pinned buffers take turns
def test_write_safetensors_from_cuda(tmp_path, monkeypatch, chunk):
    monkeypatch.setattr(ts, "_CHUNK", chunk)
    tensors = {**_tensors("cuda"), "big": torch.randn(300_000, device="cuda")}   # many chunks in flight
    size, digest = ts.write_safetensors(tmp_path / "a.safetensors", tensors, {"format": "pt"})
    _check_file(tmp_path / "a.safetensors", tensors, size, digest)
    mixed = {**tensors, "cpu.f32": torch.randn(5, 3)}
    size, digest = ts.write_safetensors(tmp_path / "b.safetensors", mixed, {"format": "pt"})
    _check_file(tmp_path / "b.safetensors", mixed, size, digest)


@pytest.mark.gpu
def test_cuda_tensors_are_copied_after_the_work_that_produces_them(tmp_path):
    """The side stream that copies to the host waits for the current stream: a tensor still being computed
    when the save starts is written with its final values."""
    x = torch.zeros(4 << 20, device="cuda")
    torch.cuda._sleep(200_000_000)   # keeps the current stream busy, so the fill below is still queued
    x.fill_(3.0)
    size, digest = ts.write_safetensors(tmp_path / "a.safetensors", {"x": x})
    assert torch.equal(load_file(tmp_path / "a.safetensors")["x"], torch.full((4 << 20,), 3.0))
    data = (tmp_path / "a.safetensors").read_bytes()
    assert (size, digest) == (len(data), hashlib.sha256(data).hexdigest())


@pytest.mark.parametrize("pinned", [False, pytest.param(True, marks=pytest.mark.gpu)])
def test_staging_buffers_are_block_aligned(tmp_path, pinned):
    """O_DIRECT refuses buffers off a block boundary: every staging buffer of a file starts on one, whatever
    the allocator gives (malloc's large blocks start 16 bytes into a page)."""
    sizes = [ts._ALIGN, 3 * ts._ALIGN, (16 << 20) + 16]
    for nbytes in sizes:
        buffer = ts._aligned_buffer(nbytes, pinned)
        assert buffer.numel() == nbytes and buffer.data_ptr() % ts._ALIGN == 0
        assert buffer.is_pinned() is pinned
    sink = ts._Sink(tmp_path / "a", pinned)
    try:
        assert all(slot.data_ptr() % ts._ALIGN == 0 for slot in sink.slots) and len(sink.slots) == ts._SLOTS
    finally:
        sink.close()


@pytest.mark.parametrize("damage, message", [
    (lambda d: d[:5], "shorter than its header length"),
    (lambda d: (10**9).to_bytes(8, "little") + d[8:], "claims 1000000000 bytes"),
    (lambda d: d[:8] + b"x" + d[9:], "not JSON"),
    (lambda d: d[:-1], "the header describes"),
])
def test_corrupt_headers_are_named(tmp_path, damage, message):
    path = tmp_path / "a.safetensors"
    ts.write_safetensors(path, _tensors("cpu"), {"format": "pt"})
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(FwError, match=f"{path}: corrupt safetensors .*{message}"):
        ts.read_safetensors(path)


def test_split_and_join_trainer_state():
    big = torch.randn(128, 128)
    state = {"optimizer_states": [{"state": {0: {"exp_avg": big, "step": torch.tensor(4.0)},
                                             1: {"exp_avg": big}},   # the same tensor twice: one entry
                                   "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999)}]}],
             "rng": torch.zeros(5056, dtype=torch.uint8), "sparse": torch.eye(300).to_sparse(), "name": "x"}
    skeleton, tensors = ts.split_tensors(state)
    assert list(tensors) == ["optimizer_states.0.state.0.exp_avg"]   # small, sparse ones stay pickled
    assert skeleton["optimizer_states"][0]["state"][1]["exp_avg"] == "optimizer_states.0.state.0.exp_avg"
    assert skeleton["optimizer_states"][0]["param_groups"][0]["betas"] == (0.9, 0.999)
    joined = ts.join_tensors(skeleton, tensors, "ckpt")
    assert joined["optimizer_states"][0]["state"][0]["exp_avg"] is big
    assert torch.equal(joined["optimizer_states"][0]["state"][0]["step"], torch.tensor(4.0))
    with pytest.raises(FwError, match="ckpt: tensor 'optimizer_states.0.state.0.exp_avg' .* is missing"):
        ts.join_tensors(skeleton, {}, "ckpt")


def test_tensor_subclass_states_are_stored_as_plain_tensors():
    """torchao's 8-bit optimizer states travel as their inner tensors (codes, scales) in the safetensors
    files, and come back as the same class with equal values; a class not allowed for loading is refused."""
    subclass = pytest.importorskip("torchao.optim.subclass_8bit")
    state = subclass.OptimState8bit.zeros((512, 256), signed=True, block_size=256, device="cpu")
    state.copy_(torch.randn(512, 256))
    skeleton, tensors = ts.split_tensors({"state": {0: {"exp_avg": state}}})
    assert type(skeleton["state"][0]["exp_avg"]) is ts.SubclassRef
    assert tensors["state.0.exp_avg.codes"].dtype == torch.uint8 and set(tensors) == {"state.0.exp_avg.codes"}
    with torch.serialization.safe_globals([subclass.OptimState8bit]):
        back = ts.join_tensors(skeleton, tensors, "ckpt")["state"][0]["exp_avg"]
    assert type(back) is subclass.OptimState8bit and back.signed and back.shape == (512, 256)
    assert torch.equal(back.dequantize(), state.dequantize())
    allowed = torch.serialization.get_safe_globals()
    torch.serialization.clear_safe_globals()
    try:
        with pytest.raises(FwError, match="ckpt: the trainer state holds a torchao.optim.subclass_8bit:OptimState8bit"):
            ts.join_tensors(skeleton, tensors, "ckpt")
    finally:
        torch.serialization.add_safe_globals(allowed)


def test_plan_shards_matches_the_size_limit():
    tensors = {f"t{i}": torch.zeros(n) for i, n in enumerate([10, 10, 30, 5, 1])}   # float32: 4 bytes each
    assert plan_shards(tensors, 80) == [["t0", "t1"], ["t2"], ["t3", "t4"]]
    assert ts.shard_names("model", 3)[1] == "model-00002-of-00003.safetensors"
    assert ts.shard_names("trainer_state", 1) == ["trainer_state.safetensors"]
