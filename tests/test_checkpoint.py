"""Atomic checkpoint directories: round trip, manifest, verification, replace, prune, leftovers, callback."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from safetensors import safe_open
from scripts.ckpt_writer import assert_same, expected, make_cfg

from framework import checkpoint as ck
from framework.checkpoint.tensors import TensorRef
from framework.durable import exchange
from framework.errors import FwError


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.fixture
def run_dir(tmp_path):
    return tmp_path / "run"


def _save(run_dir, step, version=0, size_mb=1, use_exchange=True, cfg=None):
    cfg = cfg or make_cfg(str(run_dir))
    path = ck.checkpoints_dir(run_dir) / ck.step_dir_name(step)
    ck.write_checkpoint_dir(expected(step, version, size_mb), path, cfg, use_exchange=use_exchange)
    return path


def test_round_trip_through_checkpoint_io(run_dir):
    cfg = make_cfg(str(run_dir))
    io = ck.AtomicCheckpointIO(cfg)
    original = expected(7, 0, size_mb=1)
    original["fw_components"]["value"] = {
        "config": {"model_type": "qwen3", "value_head": True},
        "state_dict": {"score.weight": torch.randn(1, 64, dtype=torch.float64)},
    }
    given = expected(7, 0, size_mb=1)
    given["fw_components"]["value"] = original["fw_components"]["value"]
    path = ck.checkpoints_dir(run_dir) / "step-000007"
    io.save_checkpoint(given, path)
    assert "fw_components" not in given  # moved out, the rest went to trainer_state.pt

    loaded = io.load_checkpoint(path)
    original["fw_components"]["value"]["files"] = {}  # a component without extra files reads back with none
    assert_same(original, loaded)
    assert sorted(os.listdir(path)) == ["config.yaml", "manifest.json", "policy", "trainer_state.pt",
                                        "trainer_state.safetensors", "value"]
    assert sorted(os.listdir(path / "policy")) == ["config.json", "model.safetensors", "tokenizer.json"]


def test_sharded_component_round_trip(run_dir):
    path = ck.checkpoints_dir(run_dir) / "step-000002"
    ck.write_checkpoint_dir(expected(2, 0, 1), path, make_cfg(str(run_dir)), max_shard_size="600KB")
    names = sorted(os.listdir(path / "policy"))
    assert names == ["config.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                     "model.safetensors.index.json", "tokenizer.json"]
    assert_same(expected(2, 0, 1), ck.read_checkpoint_dir(path, verify=True))


def _large_state(step):
    """A checkpoint whose optimizer state is eight 256 KiB moments (2 MiB)."""
    state = expected(step, 0, 1)
    g = torch.Generator().manual_seed(step)
    state["optimizer_states"][0]["state"] = {i: {"exp_avg": torch.randn(64, 1024, generator=g)} for i in range(8)}
    state["optimizer_states"][0]["param_groups"][0]["params"] = list(range(8))
    return state


def test_a_large_trainer_state_spreads_over_the_writing_threads(run_dir, monkeypatch):
    """Above the minimum shard size the trainer state's tensors go to one shard per writing thread (a file
    hashes on one core at most), each a safetensors file, and the checkpoint reads back the same; below it
    they stay in one file."""
    from framework.checkpoint import directory

    cfg = make_cfg(str(run_dir))
    monkeypatch.setattr(directory, "io_threads", lambda: 4)
    path = ck.checkpoints_dir(run_dir) / "step-000005"
    ck.write_checkpoint_dir(_large_state(5), path, cfg)
    assert sorted(f for f in os.listdir(path) if f.endswith(".safetensors")) == ["trainer_state.safetensors"]

    monkeypatch.setattr(directory, "MIN_TRAINER_SHARD", 64 << 10)
    ck.write_checkpoint_dir(_large_state(5), path, cfg)   # replaces step 5
    shards = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    assert shards == [f"trainer_state-0000{i}-of-00004.safetensors" for i in range(1, 5)]
    for shard in shards:   # 2 MiB over 4 threads: two 256 KiB moments each
        with safe_open(path / shard, "pt") as f:
            assert len(f.keys()) == 2
    assert_same(_large_state(5), ck.read_checkpoint_dir(path, verify=True))


def test_manifest_matches_files_on_disk(run_dir):
    cfg = make_cfg(str(run_dir))
    path = _save(run_dir, 12, cfg=cfg)
    manifest = json.loads((path / "manifest.json").read_text())

    on_disk = {}
    for root, _, files in os.walk(path):
        for name in files:
            full = Path(root) / name
            rel = full.relative_to(path).as_posix()
            if rel != "manifest.json":
                on_disk[rel] = {"size": full.stat().st_size, "sha256": hashlib.sha256(full.read_bytes()).hexdigest()}
    assert manifest["files"] == on_disk
    assert manifest["format"] == "fw.checkpoint" and manifest["format_version"] == 2
    assert manifest["step"] == 12 and manifest["policy_version"] == 12 and manifest["global_step"] == 12
    assert manifest["components"] == ["policy"]
    canonical = json.dumps(cfg, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    assert manifest["config_sha256"] == hashlib.sha256(canonical.encode()).hexdigest()

    # the policy dir is plain HF layout, readable without fw
    with safe_open(path / "policy" / "model.safetensors", "pt") as f:
        assert f.metadata() == {"format": "pt"}
        assert set(f.keys()) == set(expected(12, 0)["fw_components"]["policy"]["state_dict"])
        assert f.get_tensor("model.layers.0.self_attn.q_proj.weight").dtype == torch.bfloat16
    assert json.loads((path / "policy" / "config.json").read_text())["step"] == 12
    # the trainer state's tensors sit in a safetensors file beside the pickled rest, under their path
    with torch.serialization.safe_globals([TensorRef]):
        state = torch.load(path / "trainer_state.pt", weights_only=True)
    assert "fw_components" not in state
    ref = state["optimizer_states"][0]["state"][0]["exp_avg"]
    assert type(ref) is TensorRef and ref == "optimizer_states.0.state.0.exp_avg"
    with safe_open(path / "trainer_state.safetensors", "pt") as f:
        original = expected(12, 0, 1)["optimizer_states"][0]["state"][0]["exp_avg"]
        assert torch.equal(f.get_tensor(ref), original)


@pytest.mark.parametrize("damage", ["flip", "truncate", "missing"])
@pytest.mark.parametrize("victim", ["policy/model.safetensors", "trainer_state.pt", "config.yaml"])
def test_verify_names_the_damaged_file(run_dir, damage, victim):
    path = _save(run_dir, 3)
    ck.verify_checkpoint(path)
    file = path / victim
    if damage == "flip":
        data = bytearray(file.read_bytes())
        data[len(data) // 2] ^= 0x01
        file.write_bytes(bytes(data))
    elif damage == "truncate":
        file.write_bytes(file.read_bytes()[:-1])
    else:
        file.unlink()
    with pytest.raises(FwError, match=str(file)):
        ck.verify_checkpoint(path)

    cfg = make_cfg(str(run_dir))
    cfg["checkpoint"]["verify"] = True
    with pytest.raises(FwError, match=str(file)):
        ck.AtomicCheckpointIO(cfg).load_checkpoint(path)
    # size checks are always on: truncated and missing files make the checkpoint damaged, and finding the
    # newest checkpoint says so instead of passing over it; the sha256 check finds flipped bytes
    assert ck.is_complete(path) is (damage == "flip")
    if damage == "flip":
        assert ck.find_latest(run_dir) == str(path)
        with pytest.raises(FwError, match=f"newest checkpoint {path} is damaged: {file}: sha256"):
            ck.find_latest(run_dir, verify=True)
    else:
        with pytest.raises(FwError, match=f"newest checkpoint {path} is damaged: {file}.*--skip-damaged"):
            ck.find_latest(run_dir)
    assert ck.find_latest(run_dir, skip_damaged=True, verify=True) is None


def test_missing_manifest_is_a_damaged_checkpoint(run_dir):
    path = _save(run_dir, 3)
    (path / "manifest.json").unlink()
    cfg = make_cfg(str(run_dir))
    assert ck.list_checkpoints(run_dir) == []
    with pytest.raises(FwError, match="manifest.json: missing"):
        ck.resolve_resume(str(path), cfg)
    with pytest.raises(FwError, match="newest checkpoint .*step-000003 is damaged: .*manifest.json: missing"):
        ck.resolve_resume("last", cfg)
    with pytest.raises(FwError, match="--resume last: no complete checkpoint under"):
        ck.resolve_resume("last", cfg, skip_damaged=True)
    with pytest.raises(FwError, match="already holds checkpoints"):   # a fresh run would mix with it
        ck.resolve_resume(None, cfg)


def test_skip_damaged_falls_back_and_says_so(run_dir, capsys):
    old = _save(run_dir, 2)
    newest = _save(run_dir, 4)
    (newest / "trainer_state.pt").unlink()
    cfg = make_cfg(str(run_dir))
    with pytest.raises(FwError, match=f"the newest checkpoint {newest} is damaged: {newest / 'trainer_state.pt'}: "
                                      "missing"):
        ck.resolve_resume("last", cfg)
    assert ck.resolve_resume("last", cfg, skip_damaged=True) == str(old)
    err = capsys.readouterr().err
    aside = newest.with_name("step-000004.damaged")
    assert err == (f"fw: warning: skipping damaged checkpoint {newest}: {newest / 'trainer_state.pt'}: missing from "
                   f"checkpoint {newest} (listed in its manifest)\nfw: moved the damaged checkpoint {newest} aside "
                   f"to {aside}, where no --resume or pruning reads it\nfw: resuming {old}\n")
    # kept for inspection under a name that discovery and pruning pass over
    assert sorted(os.listdir(ck.checkpoints_dir(run_dir))) == ["step-000002", "step-000004.damaged"]
    assert (aside / "manifest.json").is_file() and not (aside / "trainer_state.pt").exists()
    assert ck.prune(run_dir, 1) == [] and ck.find_latest(run_dir) == str(old)


def _flip(file: Path) -> None:
    """One flipped bit in the middle of `file`: its size stays, its sha256 changes."""
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0x01
    file.write_bytes(bytes(data))


def test_a_corrupt_newest_checkpoint_is_named_up_front_and_skipped_like_a_truncated_one(run_dir, capsys):
    """A flipped bit keeps every size, so only the sha256 shows it: `--resume last` names it before anything is
    loaded, with the same advice as for a truncated file, and `--skip-damaged` resumes the older checkpoint
    instead of refusing the corrupt one as a newer checkpoint of another timeline."""
    old = _save(run_dir, 2)
    newest = _save(run_dir, 4)
    weights = newest / "policy" / "model.safetensors"
    _flip(weights)
    digest = hashlib.sha256(weights.read_bytes()).hexdigest()
    cfg = make_cfg(str(run_dir))   # checkpoint.verify: true
    with pytest.raises(FwError) as e:
        ck.resolve_resume("last", cfg)
    assert str(e.value) == (f"the newest checkpoint {newest} is damaged: {weights}: sha256 {digest} does not match the "
                            f"manifest's {ck.read_manifest(newest)['files']['policy/model.safetensors']['sha256']}: "
                            "the file is corrupt; --skip-damaged uses the newest intact older one instead")
    assert ck.resolve_resume(str(run_dir), cfg, skip_damaged=True) == str(old)   # a run directory as the path
    err = capsys.readouterr().err.splitlines()
    aside = newest.with_name("step-000004.damaged")
    assert err[0].startswith(f"fw: warning: skipping damaged checkpoint {newest}: {weights}: sha256 {digest}")
    moved = f"fw: moved the damaged checkpoint {newest} aside to {aside}, where no --resume or pruning reads it"
    assert err[1:] == [moved, f"fw: resuming {old}"]
    assert hashlib.sha256((aside / "policy" / "model.safetensors").read_bytes()).hexdigest() == digest
    # the resumed run's own step 4 is published where the corrupt one was; a second corrupt one is kept too
    _save(run_dir, 4)
    _flip(weights)
    assert ck.resolve_resume("last", cfg, skip_damaged=True) == str(old)
    assert sorted(os.listdir(ck.checkpoints_dir(run_dir))) == ["step-000002", "step-000004.damaged",
                                                                 "step-000004.damaged-2"]
    assert ck.prune(run_dir, 1) == [] and ck.list_checkpoints(run_dir) == [str(old)]

    # resuming into a new run_dir from this run's directory skips its corrupt newest checkpoint but never moves
    # it: it is not the new run's to tidy
    _save(run_dir, 4)
    _flip(weights)
    capsys.readouterr()
    assert ck.resolve_resume(str(run_dir), make_cfg(str(run_dir.parent / "new")), skip_damaged=True) == str(old)
    assert "moved" not in capsys.readouterr().err and newest.is_dir()


def test_a_file_found_corrupt_while_a_run_directory_is_read_gets_the_skip_damaged_advice(run_dir):
    """fw eval, generate and export of a run directory hash its newest checkpoint while they read it: a corrupt file
    found then is refused as a missing one is, with the option that passes over it; a checkpoint named itself has
    no older one to turn to, so its refusal is the bare mismatch."""
    old = _save(run_dir, 2)
    newest = _save(run_dir, 4)
    weights = newest / "policy" / "model.safetensors"
    _flip(weights)
    digest = hashlib.sha256(weights.read_bytes()).hexdigest()
    mismatch = (f"{weights}: sha256 {digest} does not match the manifest's "
                f"{ck.read_manifest(newest)['files']['policy/model.safetensors']['sha256']}: the file is corrupt")
    with pytest.raises(FwError) as e:
        ck.read_resolved(run_dir, ck.verify_checkpoint)
    assert str(e.value) == (f"the newest checkpoint {newest} is damaged: {mismatch}; --skip-damaged uses the newest "
                            "intact older one instead")
    with pytest.raises(FwError) as e:
        ck.read_resolved(newest, ck.verify_checkpoint)
    assert str(e.value) == mismatch
    assert ck.read_resolved(run_dir, lambda path: path, skip_damaged=True) == old


def test_a_resume_hashes_each_file_of_its_checkpoint_once(run_dir, monkeypatch):
    """`--resume last` verifies the newest checkpoint before it loads it; the load does not hash the same files
    again. A file written after that verification is hashed again at the load, which refuses it."""
    from framework.checkpoint import directory

    newest = _save(run_dir, 4)
    for file in newest.rglob("*"):   # written a minute ago, as a checkpoint resumed is (see SETTLED_NS)
        os.utime(file, ns=(file.stat().st_atime_ns, file.stat().st_mtime_ns - 60 * 10**9))
    hashed = []
    real = directory.sha256
    monkeypatch.setattr(directory, "sha256", lambda path: hashed.append(Path(path)) or real(path))
    cfg = make_cfg(str(run_dir))   # checkpoint.verify: true
    assert ck.resolve_resume("last", cfg) == str(newest)
    listed = sorted(newest / rel for rel in ck.read_manifest(newest)["files"])
    assert sorted(hashed) == listed
    ck.AtomicCheckpointIO(cfg).load_checkpoint(newest)
    assert sorted(hashed) == listed   # loaded without a second hash
    _flip(newest / "policy" / "model.safetensors")   # in place: the same inode and size, a new modification time
    with pytest.raises(FwError, match="the file is corrupt"):
        ck.AtomicCheckpointIO(cfg).load_checkpoint(newest)


@pytest.mark.parametrize("use_exchange", [True, False])
def test_republish_replaces_the_step(run_dir, use_exchange):
    assert ck.exchange_supported()
    path = _save(run_dir, 4, version=0)
    _save(run_dir, 4, version=1, use_exchange=use_exchange)
    loaded = ck.read_checkpoint_dir(path, verify=True)
    assert_same(expected(4, 1, 1), loaded)
    assert sorted(os.listdir(path.parent)) == ["step-000004"]  # no hidden leftovers


@pytest.mark.parametrize("use_exchange", [True, False])
def test_republish_gap(run_dir, use_exchange):
    """While one thread re-publishes a step 15 times, a reader polls for its manifest: with RENAME_EXCHANGE it
    is never absent; the fallback's two renames do leave a moment without it (hence `recover`)."""
    path = _save(run_dir, 4, version=0)
    stop = threading.Event()
    seen = {"checks": 0, "gaps": 0}

    def reader():
        while not stop.is_set():
            seen["checks"] += 1
            seen["gaps"] += not (path / "manifest.json").is_file()

    t = threading.Thread(target=reader)
    t.start()
    try:
        for version in range(1, 16):
            _save(run_dir, 4, version=version, use_exchange=use_exchange)
    finally:
        stop.set()
        t.join()
    assert seen["checks"] > 100
    assert (seen["gaps"] == 0) if use_exchange else (seen["gaps"] > 0)
    assert ck.read_checkpoint_dir(path, verify=True)["recipe_state"]["version"] == 15


def test_exchange_swaps_two_directories(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "x").write_text("a")
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "x").write_text("b")
    assert exchange(tmp_path / "a", tmp_path / "b")
    assert (tmp_path / "a" / "x").read_text() == "b" and (tmp_path / "b" / "x").read_text() == "a"


def test_fallback_replace_interrupted_between_renames_is_recovered(run_dir):
    """The state a crash leaves between the fallback's two renames: old dir set aside, new one still staged."""
    old = _save(run_dir, 5, version=0)
    pid = _dead_pid()
    aside = old.parent / f".replaced-step-000005-{pid}-0a0b"
    os.rename(old, aside)
    staged = _save(run_dir, 6, version=1)  # any complete dir will do as the stranded new copy
    os.rename(staged, old.parent / f".staging-step-000005-{pid}-0c0d")

    assert ck.list_checkpoints(run_dir) == []  # hidden dirs are never discovered
    assert ck.find_latest(run_dir) == str(old)  # ...but the set-aside copy is put back
    assert_same(expected(5, 0, 1), ck.read_checkpoint_dir(old, verify=True))
    assert ck.clean_leftovers(old.parent) == [f".staging-step-000005-{pid}-0c0d"]
    assert sorted(os.listdir(old.parent)) == ["step-000005"]


def test_staging_leftovers_ignored_then_cleaned(run_dir):
    good = _save(run_dir, 2)
    ckpt_dir = good.parent
    dead, alive = _dead_pid(), os.getppid()
    partial = ckpt_dir / f".staging-step-000003-{dead}-1234abcd"
    partial.mkdir()
    (partial / "trainer_state.pt").write_bytes(b"half a file")
    trash = ckpt_dir / f".trash-step-000001-{dead}-00ff"
    (trash / "policy").mkdir(parents=True)
    busy = ckpt_dir / f".staging-step-000003-{alive}-5678"
    busy.mkdir()
    incomplete = ckpt_dir / "step-000009"  # a published name without a manifest (e.g. hand-copied)
    incomplete.mkdir()

    assert ck.list_checkpoints(run_dir) == [str(good)]
    with pytest.raises(FwError, match="step-000009 is damaged"):
        ck.find_latest(run_dir)
    assert ck.find_latest(run_dir, skip_damaged=True) == str(good)
    assert ck.clean_leftovers(ckpt_dir) == [partial.name, trash.name]
    assert sorted(os.listdir(ckpt_dir)) == sorted([busy.name, "step-000002", "step-000009"])


def test_prune_keeps_newest_complete(run_dir):
    for step in (1, 2, 10, 3):
        _save(run_dir, step)
    torn = ck.checkpoints_dir(run_dir) / "step-000011"
    torn.mkdir()
    assert ck.prune(run_dir, None) == []
    removed = ck.prune(run_dir, 2)

    def names(paths):
        return [Path(p).name for p in paths]

    assert names(removed) == ["step-000001", "step-000002"]
    assert names(ck.list_checkpoints(run_dir)) == ["step-000003", "step-000010"]
    assert torn.exists()  # never a complete checkpoint: prune leaves it alone
    with pytest.raises(FwError, match="keep_last: 0"):
        ck.prune(run_dir, 0)


# ---------------------------------------------------------------- the callback inside a real Trainer


class TinyModule(pl.LightningModule):
    """A Lightning module that hands its weights to the CheckpointIO as an fw component (like FwModule)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Linear(4, 1)
        self.policy_version = 0
        self.batches = 0

    def training_step(self, batch, batch_idx):
        self.batches += 1
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def optimizer_step(self, *args, **kwargs):
        super().optimizer_step(*args, **kwargs)
        self.policy_version += 1

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.05)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(1)
        x = torch.randn(8, 4, generator=g)
        data = torch.utils.data.TensorDataset(x.repeat(1000, 1), x.sum(1, keepdim=True).repeat(1000, 1))
        return torch.utils.data.DataLoader(data, batch_size=8)  # the same batch every time: resume is exact

    def on_save_checkpoint(self, checkpoint):
        sd = checkpoint.pop("state_dict")
        checkpoint["state_dict"] = {}
        checkpoint["policy_version"] = self.policy_version
        checkpoint["fw_components"] = {"policy": {"config": {"in": 4}, "state_dict": sd}}

    def on_load_checkpoint(self, checkpoint):
        checkpoint["state_dict"] = checkpoint.pop("fw_components")["policy"]["state_dict"]
        self.policy_version = checkpoint["policy_version"]


class RecordingIO(ck.AtomicCheckpointIO):
    def __init__(self, cfg, events):
        super().__init__(cfg)
        self.events = events

    def save_checkpoint(self, checkpoint, path, storage_options=None):
        self.events.append(("publish", Path(path).name, self.module.batches))
        super().save_checkpoint(checkpoint, path, storage_options)


class RecordingLogger(pl.loggers.Logger):
    def __init__(self, events):
        super().__init__()
        self.events = events

    name = "rec"
    version = 0

    def log_metrics(self, metrics, step=None):
        pass

    def log_hyperparams(self, params, *args, **kwargs):
        pass

    def save(self):
        self.events.append(("flush",))


def _fit(cfg, max_steps, accumulate=1, ckpt_path=None, events=None, accelerator="cpu"):
    events = [] if events is None else events
    cfg["trainer"]["max_steps"] = max_steps
    module = TinyModule()
    io = RecordingIO(cfg, events)
    io.module = module
    trainer = pl.Trainer(
        max_steps=max_steps, accelerator=accelerator, devices=1, accumulate_grad_batches=accumulate,
        plugins=[io], callbacks=[ck.CheckpointCallback(cfg)], logger=RecordingLogger(events),
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=cfg["run_dir"],
    )
    trainer.fit(module, ckpt_path=ckpt_path)
    return module, events


def test_callback_saves_every_n_and_at_end_then_prunes_and_resumes(run_dir):
    cfg = make_cfg(str(run_dir))
    cfg["checkpoint"].update(every_n_steps=2, keep_last=2)
    _, events = _fit(cfg, max_steps=5, accumulate=2)
    publishes = [e for e in events if e[0] == "publish"]
    # saved only in batches that completed an optimizer step (even batch counts), once per step
    assert publishes == [("publish", "step-000002", 4), ("publish", "step-000004", 8), ("publish", "step-000005", 10)]
    for i, e in enumerate(events):
        if e[0] == "publish":
            assert events[i - 1] == ("flush",)  # loggers flushed right before each publish
    assert [Path(p).name for p in ck.list_checkpoints(run_dir)] == ["step-000004", "step-000005"]

    with pytest.raises(FwError, match="already holds checkpoints"):
        _fit(cfg, max_steps=5)

    resumed, events = _fit(cfg, max_steps=9, accumulate=2, ckpt_path=ck.find_latest(run_dir))
    assert [e[1] for e in events if e[0] == "publish"] == ["step-000006", "step-000008", "step-000009"]
    assert [Path(p).name for p in ck.list_checkpoints(run_dir)] == ["step-000008", "step-000009"]

    straight, _ = _fit(make_cfg(str(run_dir.parent / "straight")), max_steps=9, accumulate=2)
    # Adam moments, step counts and weights all came back: same weights as an uninterrupted run
    assert torch.equal(resumed.net.weight, straight.net.weight)
    final = ck.read_checkpoint_dir(ck.find_latest(run_dir), verify=True)
    assert torch.equal(final["fw_components"]["policy"]["state_dict"]["net.weight"], straight.net.weight)


class TwoOptimizerModule(TinyModule):
    """Manual optimization stepping a policy and a critic optimizer per batch, like PPO: Lightning's
    global_step counts both, the checkpoint step must count only the policy's."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False
        self.critic = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.batches += 1
        policy_opt, critic_opt = self.optimizers()
        for opt, net in ((policy_opt, self.net), (critic_opt, self.critic)):
            opt.zero_grad()
            self.manual_backward(torch.nn.functional.mse_loss(net(x), y))
            opt.step()
        self.policy_version += 1

    def configure_optimizers(self):
        return [torch.optim.SGD(self.net.parameters(), lr=0.01), torch.optim.SGD(self.critic.parameters(), lr=0.01)]


def test_callback_counts_policy_steps_not_global_steps(run_dir):
    cfg = make_cfg(str(run_dir))
    cfg["checkpoint"].update(every_n_steps=2, keep_last=None)
    cfg["trainer"]["max_steps"] = 5
    module = TwoOptimizerModule()
    trainer = pl.Trainer(max_steps=10, accelerator="cpu", devices=1, plugins=[ck.AtomicCheckpointIO(cfg)],
                         callbacks=[ck.CheckpointCallback(cfg)], logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(run_dir))
    trainer.fit(module)
    assert trainer.global_step == 10 and module.policy_version == 5
    found = ck.list_checkpoints(run_dir)
    assert [Path(p).name for p in found] == ["step-000002", "step-000004", "step-000005"]
    manifest = ck.read_manifest(found[-1])
    assert (manifest["step"], manifest["policy_version"], manifest["global_step"]) == (5, 5, 10)


@pytest.mark.gpu
def test_gpu_state_saves_and_resumes_exactly(run_dir):
    """CUDA weights and Adam state go to disk through the CPU and come back onto the GPU."""
    cfg = make_cfg(str(run_dir))
    cfg["checkpoint"].update(every_n_steps=3, keep_last=1)
    _fit(cfg, max_steps=3, accelerator="gpu")
    state = ck.read_checkpoint_dir(ck.find_latest(run_dir), verify=True)
    assert state["fw_components"]["policy"]["state_dict"]["net.weight"].device.type == "cpu"
    assert state["optimizer_states"][0]["state"][0]["exp_avg"].device.type == "cpu"
    resumed, _ = _fit(cfg, max_steps=7, ckpt_path=ck.find_latest(run_dir), accelerator="gpu")
    straight, _ = _fit(make_cfg(str(run_dir.parent / "straight")), max_steps=7, accelerator="gpu")
    # (Lightning moves the module back to the CPU when fit ends)
    assert torch.equal(resumed.net.weight, straight.net.weight)


@pytest.mark.gpu
def test_fw_fit_bf16_on_gpu_checkpoints_resumes_and_exports(tmp_path):
    import transformers

    from framework.config import resolve
    from framework.export import export_checkpoint
    from framework.trainer import fit

    pytest.importorskip("torchao")   # bf16 weights train with stochastic rounding (the lean extra)

    def cfg(steps):
        return resolve({"recipe": "sft", "run_dir": str(tmp_path / "run"), "model": {"policy": {"preset": "tiny"}},
                        "data": {"path": str(Path(__file__).parents[1] / "recipes/data/arithmetic_chat.jsonl"),
                                 "max_seq_len": 128},
                        "optimizer": {"stochastic_rounding": True},
                        "trainer": {"accelerator": "gpu", "devices": 1, "precision": "bf16-true",
                                    "max_steps": steps, "enable_progress_bar": False},
                        "checkpoint": {"every_n_steps": 5, "verify": True},
                        "logging": {"tensorboard": False}})

    fit(cfg(5))
    trainer = fit(cfg(10), resume="last")
    assert trainer.lightning_module.policy_version == 10
    final = ck.find_latest(tmp_path / "run")
    assert Path(final).name == "step-000010"
    with safe_open(Path(final) / "policy" / "model.safetensors", "pt") as f:
        assert f.get_tensor("model.norm.weight").dtype == torch.bfloat16
    out = export_checkpoint(final, tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    ids = torch.tensor([[1, 2, 3, 4]])
    policy = trainer.lightning_module.policy.float().cpu().eval()
    with torch.no_grad():
        assert (hf.eval()(input_ids=ids).logits - policy(ids)).abs().max().item() <= 1e-4


DDP_SCRIPT = """
import json, sys
from framework.config import resolve
from framework.trainer import fit
fit(resolve(json.loads(sys.argv[1])), resume=sys.argv[2] or None)
"""


@pytest.mark.slow  # three 2-process Lightning start-ups
def test_ddp_two_ranks_save_prune_refuse_and_resume(tmp_path):
    """Only rank 0 writes; both ranks refuse a fresh start over existing checkpoints (no rank left hanging);
    `--resume last` continues under DDP."""
    root = Path(__file__).resolve().parents[1]
    script = tmp_path / "ddp_fit.py"
    script.write_text(DDP_SCRIPT)
    run_dir = tmp_path / "run"

    def fit_ddp(max_steps, resume):
        cfg = {"recipe": "sft", "run_dir": str(run_dir), "model": {"policy": {"preset": "tiny"}},
               "data": {"path": str(root / "recipes" / "data" / "arithmetic_chat.jsonl"), "max_seq_len": 64,
                        "batch_size": 2},
               "trainer": {"accelerator": "cpu", "devices": 2, "strategy": "ddp", "max_steps": max_steps,
                           "enable_progress_bar": False},
               "checkpoint": {"every_n_steps": 2, "keep_last": 1, "verify": True},
               "logging": {"csv": False, "tensorboard": False}}
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(root)}
        return subprocess.run([sys.executable, str(script), json.dumps(cfg), resume], check=False, cwd=root, env=env,
                              capture_output=True, text=True, timeout=300)

    first = fit_ddp(4, "")
    assert first.returncode == 0, first.stderr[-3000:]
    assert [Path(p).name for p in ck.list_checkpoints(run_dir)] == ["step-000004"]
    assert [n for n in os.listdir(ck.checkpoints_dir(run_dir)) if n.startswith(".")] == []
    ck.verify_checkpoint(ck.find_latest(run_dir))

    again = fit_ddp(4, "")  # each rank refuses by itself, none is left waiting in a collective
    assert again.returncode != 0 and again.stderr.count("already holds checkpoints") >= 2, again.stderr[-3000:]

    resumed = fit_ddp(6, "last")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert [Path(p).name for p in ck.list_checkpoints(run_dir)] == ["step-000006"]
    assert ck.read_manifest(ck.find_latest(run_dir))["policy_version"] == 6


def test_resuming_a_finished_run_removes_a_dead_writers_leftovers(run_dir):
    # A run killed while it pruned after its last step leaves a .trash-* directory; resuming it trains no step
    # (max_steps is reached), and the leftover must go all the same.
    cfg = make_cfg(str(run_dir))
    _fit(cfg, max_steps=2)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True)
    leftover = ck.checkpoints_dir(run_dir) / f".trash-step-000001-{int(dead.stdout)}-0123abcd"
    (leftover / "policy").mkdir(parents=True)
    (leftover / "policy" / "model.safetensors").write_bytes(b"partly deleted")
    _fit(cfg, max_steps=2, ckpt_path=ck.find_latest(run_dir))
    assert not leftover.exists()


def test_fit_reports_large_saves_with_their_size_and_speed(tmp_path, capsys, monkeypatch):
    """A save of at least REPORT_BYTES prints one line: the checkpoint, the bytes its manifest lists, the
    write's time and speed, and the whole save's time (with gathering the states). Here every save counts
    as large; by default the tiny model's saves stay quiet."""
    from framework.checkpoint import lightning_io
    from framework.config import resolve
    from framework.trainer import fit

    monkeypatch.setattr(lightning_io, "REPORT_BYTES", 0)

    cfg = resolve({"recipe": "sft", "run_dir": str(tmp_path / "run"), "model": {"policy": {"preset": "tiny"}},
                   "data": {"path": str(Path(__file__).parents[1] / "recipes/data/arithmetic_chat.jsonl"),
                            "max_seq_len": 64, "batch_size": 4},
                   "trainer": {"accelerator": "cpu", "max_steps": 2, "enable_progress_bar": False},
                   "checkpoint": {"every_n_steps": 1, "keep_last": None},
                   "logging": {"csv": False, "tensorboard": False}})
    capsys.readouterr()
    fit(cfg)
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("fw: saved ")]
    assert [line.split(":")[1].strip() for line in lines] == ["saved step-000001", "saved step-000002"]
    step2 = ck.checkpoints_dir(tmp_path / "run") / "step-000002"
    size = sum(f["size"] for f in ck.read_manifest(step2)["files"].values())
    amount, unit = lines[1].split(": ")[2].split(" written in ")[0].split()
    assert unit == "MiB" and abs(float(amount) - size / 2**20) <= 0.05 and " GB/s), " in lines[1]
