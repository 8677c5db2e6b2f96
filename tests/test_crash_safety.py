"""SIGKILL at random moments, including during saves: the newest complete checkpoint always loads and verifies.

The writer (tests/scripts/ckpt_writer.py) saves ~12 MB checkpoints in a loop with AtomicCheckpointIO's
writer, re-publishing the previous step every third step, pruning to keep_last=2, and restarting from the
newest checkpoint like `--resume last`. Writers are real processes forked from a forkserver that has torch
and fw preloaded, so a kill cycle costs a fraction of a second instead of a fresh interpreter's import time.
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from scripts.ckpt_writer import assert_same, expected, make_cfg, write_forever
from scripts.preloaded import forkserver

from framework import checkpoint as ck
from framework.errors import FwError

WRITER = Path(__file__).parent / "scripts" / "ckpt_writer.py"


def _hidden_leftovers(run_dir: Path) -> list[str]:
    d = ck.checkpoints_dir(run_dir)
    return [n for n in os.listdir(d) if n.startswith(".")] if d.is_dir() else []


def _newest_step(run_dir: Path) -> int:
    """The newest published step while a writer runs. Between listing a checkpoint and reading its manifest the
    live writer may prune it, or (replacing a step without RENAME_EXCHANGE: two renames) have it renamed aside
    with the new copy not yet in place; both were seen on a loaded machine. So look again; a manifest that stays
    unreadable for a second is a real fault."""
    deadline = time.monotonic() + 1.0
    while True:
        latest = ck.find_latest(run_dir)
        try:
            return ck.read_manifest(latest)["step"] if latest else 0
        except FwError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.005)



class KillLog:
    """Checks the run dir after each kill and keeps score."""

    def __init__(self, run_dir: Path):
        self.run_dir = run_dir
        self.newest = 0
        self.kills_mid_save = 0
        self.leftovers: set[str] = set()

    def check_after_kill(self) -> None:
        leftovers = set(_hidden_leftovers(self.run_dir))
        if leftovers - self.leftovers:
            self.kills_mid_save += 1  # new staging/replaced/trash dirs: the kill hit a save or prune
        self.leftovers = leftovers
        latest = ck.find_latest(self.run_dir)
        if self.newest:
            assert latest is not None, "a published checkpoint disappeared after a kill"
        if latest is None:
            return
        loaded = ck.read_checkpoint_dir(latest, verify=True)
        step, version = loaded["global_step"], loaded["recipe_state"]["version"]
        assert Path(latest).name == ck.step_dir_name(step)
        assert step >= self.newest, f"newest checkpoint went back from step {self.newest} to {step}"
        self.newest = step
        assert_same(expected(step, version), loaded)
        # every checkpoint still listed is complete and intact, and pruning keeps at most keep_last + 1
        # (a kill between publish and prune), never fewer than one
        listed = ck.list_checkpoints(self.run_dir)
        assert 1 <= len(listed) <= 3, listed
        for path in listed:
            ck.verify_checkpoint(path)


# One forkserver per test session (multiprocessing keeps a single one), preloaded for every test here.
_forkserver = forkserver


def _kill_cycles(run_dir: Path, kills: int, seed: int) -> KillLog:
    """Even kills land at a random moment after the start (also during start-up recovery and cleanup); odd
    ones at a random moment after the writer published a new checkpoint, so progress never stalls."""
    ctx = _forkserver()
    rng = random.Random(seed)
    log = KillLog(run_dir)
    for i in range(kills):
        proc = ctx.Process(target=write_forever, args=(str(run_dir), i % 4 < 2))
        proc.start()
        if i % 2:
            deadline = time.monotonic() + 60
            while _newest_step(run_dir) <= log.newest and time.monotonic() < deadline:
                time.sleep(0.005)
        time.sleep(rng.uniform(0.0, 0.3))
        os.kill(proc.pid, signal.SIGKILL)
        proc.join()
        assert proc.exitcode == -signal.SIGKILL, f"writer exited on its own with {proc.exitcode}"
        log.check_after_kill()
    return log


def test_sigkill_writer_many_times(tmp_path):
    log = _kill_cycles(tmp_path / "run", kills=32, seed=0)
    assert log.newest >= 16  # every other cycle waited for a new step
    assert log.kills_mid_save >= 5, f"only {log.kills_mid_save} of 32 kills landed during a save"


def test_a_listed_checkpoint_between_the_two_renames_of_a_replace_is_read_once_back(tmp_path):
    """A replace without RENAME_EXCHANGE renames the old copy aside, then the new one in. A reader that listed the
    directory and finds it absent waits for the new copy instead of calling it damaged (or the run empty)."""
    import threading

    from framework.checkpoint.store import _settled_damage

    run_dir = tmp_path / "run"
    ckpt_dir = ck.checkpoints_dir(run_dir)
    cfg = make_cfg(str(run_dir))
    ck.write_checkpoint_dir(expected(14, 0, 1), ckpt_dir / "step-000014", cfg)
    ck.write_checkpoint_dir(expected(14, 1, 1), tmp_path / "new", cfg)
    listed = ck.step_dirs(run_dir)
    os.rename(listed[-1], tmp_path / "aside")
    # the writer fsyncs the directory between its two renames, which can take a while on a busy disk
    threading.Timer(0.1, os.rename, (tmp_path / "new", listed[-1])).start()
    assert _settled_damage(listed[-1], verify=True) is None
    assert ck.read_checkpoint_dir(str(listed[-1]))["recipe_state"]["version"] == 1
    # gone for good (pruned): it stays absent, and the reader moves on once the wait is over
    os.rename(listed[-1], tmp_path / "pruned")
    start = time.monotonic()
    assert "missing" in _settled_damage(listed[-1], verify=False, absent_wait_s=0.05)
    assert time.monotonic() - start < 1.0


@pytest.mark.slow
def test_sigkill_writer_many_more_times(tmp_path):
    log = _kill_cycles(tmp_path / "run", kills=200, seed=1)
    assert log.kills_mid_save >= 30


@pytest.mark.slow
def test_sigkill_writer_script(tmp_path):
    """The same with the writer as a fresh interpreter (no forkserver), killed once it has started saving."""
    run_dir = tmp_path / "run"
    log = KillLog(run_dir)
    rng = random.Random(2)
    for i in range(4):
        args = [sys.executable, str(WRITER), str(run_dir)] + ([] if i % 2 else ["--no-exchange"])
        pythonpath = os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")])
        env = dict(os.environ, PYTHONPATH=pythonpath)
        proc = subprocess.Popen(args, env=env)
        start = log.newest
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            latest = ck.find_latest(run_dir)  # wait until it publishes something new, then a little more
            if latest and int(Path(latest).name.split("-")[1]) > start:
                break
            time.sleep(0.05)
        time.sleep(rng.uniform(0.0, 0.5))
        proc.send_signal(signal.SIGKILL)
        assert proc.wait() == -signal.SIGKILL
        log.check_after_kill()
    assert log.newest > 4


# ---------------------------------------------------------------- end to end: `fw fit`, killed, `--resume last`

REPO = Path(__file__).parents[1]
def _fit_argv(run_dir: Path, resume: bool, max_steps: int, every: int = 1) -> list[str]:
    return ["fit", "--config", str(REPO / "recipes" / "sft.yaml"), f"--run_dir={run_dir}",
            f"--data.path={REPO / 'recipes' / 'data' / 'arithmetic_chat.jsonl'}", "--data.max_seq_len=64",
            "--data.batch_size=4", f"--trainer.max_steps={max_steps}", "--trainer.enable_progress_bar=false",
            f"--checkpoint.every_n_steps={every}", "--checkpoint.keep_last=2", "--checkpoint.verify=true",
            "--logging.tensorboard=false"] + (["--resume", "last"] if resume else [])


class Launcher:
    """Starts `fw fit` processes: forked from a forkserver with fw preloaded, or as fresh interpreters."""

    def __init__(self, fresh_interpreter: bool):
        self.fresh = fresh_interpreter
        if not fresh_interpreter:
            self.ctx = _forkserver()

    def start(self, argv: list[str]):
        if self.fresh:
            return subprocess.Popen([sys.executable, "-m", "framework", *argv], cwd=REPO)
        from scripts.fw_cli import run

        proc = self.ctx.Process(target=run, args=(argv,))
        proc.start()
        return proc

    @staticmethod
    def wait(proc) -> int:
        if isinstance(proc, subprocess.Popen):
            return proc.wait()
        proc.join()
        return proc.exitcode


def _fit_killed_then_resumed(run_dir: Path, max_steps: int, kills: int, seed: int, fresh_interpreter: bool) -> None:
    """Kill `fw fit` `kills` times, each time at a random moment after it published a new checkpoint,
    check the newest checkpoint, then let `--resume last` finish."""
    launcher = Launcher(fresh_interpreter)
    rng = random.Random(seed)
    newest = 0
    for _ in range(kills):
        proc = launcher.start(_fit_argv(run_dir, newest > 0, max_steps))
        deadline = time.monotonic() + 300
        while _newest_step(run_dir) <= newest:
            assert time.monotonic() < deadline, "fw fit published no new checkpoint within 300 s"
            time.sleep(0.02)
        time.sleep(rng.uniform(0.0, 1.0))
        try:
            os.kill(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass  # it finished (and was reaped) before the kill: the rc == 0 case below
        rc = launcher.wait(proc)
        latest = ck.find_latest(run_dir)
        assert rc == -signal.SIGKILL or (rc == 0 and Path(latest).name == ck.step_dir_name(max_steps)), rc
        loaded = ck.read_checkpoint_dir(latest, verify=True)
        assert loaded["policy_version"] >= newest
        newest = loaded["policy_version"]
        assert "policy" in loaded["fw_components"] and loaded["optimizer_states"]
        if newest == max_steps:
            break  # the run had finished (or was exiting) when the kill came
    assert launcher.wait(launcher.start(_fit_argv(run_dir, True, max_steps))) == 0
    final = ck.find_latest(run_dir)
    assert Path(final).name == ck.step_dir_name(max_steps)
    ck.verify_checkpoint(final)
    assert _hidden_leftovers(run_dir) == []


def _final_weights(run_dir: Path) -> dict:
    return ck.read_checkpoint_dir(ck.find_latest(run_dir))["fw_components"]["policy"]["state_dict"]


def test_fw_fit_killed_and_resumed_matches_an_uninterrupted_run(tmp_path):
    _fit_killed_then_resumed(tmp_path / "killed", max_steps=12, kills=2, seed=3, fresh_interpreter=False)
    launcher = Launcher(fresh_interpreter=False)
    # the reference saves only at the end: saving must not change the trajectory either
    assert launcher.wait(launcher.start(_fit_argv(tmp_path / "straight", False, 12, every=1000))) == 0
    killed, straight = _final_weights(tmp_path / "killed"), _final_weights(tmp_path / "straight")
    assert killed.keys() == straight.keys()
    for name in straight:
        assert torch.equal(killed[name], straight[name]), name


@pytest.mark.slow
def test_python_m_framework_fit_killed_many_times(tmp_path):
    # (kills during saves are asserted by the writer tests above, where saves are most of the time)
    _fit_killed_then_resumed(tmp_path / "run", max_steps=40, kills=8, seed=4, fresh_interpreter=True)


# ---------------------------------------------------------------- a full disk, damaged checkpoints: `fw fit`


@pytest.fixture
def tmpfs(tmp_path):
    """A real 4 MiB tmpfs (root only): room for one tiny-preset checkpoint (2.2 MB), not two."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)], capture_output=True,
                             text=True, check=False)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield mnt
    finally:
        gc.collect()   # loaded tensors may still map files there
        if subprocess.run(["umount", str(mnt)], capture_output=True, check=False).returncode != 0:
            subprocess.run(["umount", "--lazy", str(mnt)], check=True)


def _sft_config(tmp_path, run_dir, **trainer):
    """A config file for `fw fit`: tiny SFT, a checkpoint every 2 steps, keeping 1."""
    from test_resume import config

    cfg = config(run_dir, str(REPO / "recipes" / "data" / "arithmetic_chat.jsonl"), 1)
    cfg["trainer"].update(trainer)
    cfg["checkpoint"].update(every_n_steps=2, keep_last=1)
    cfg["logging"]["csv"] = False
    path = tmp_path / "train.yaml"
    path.write_text(json.dumps(cfg))   # JSON is YAML
    return str(path)


def fw_lines(err: str) -> list[str]:
    """The lines on stderr but the memory plan's table that fit prints at start, none of them a traceback."""
    assert "Traceback" not in err
    lines, in_plan = [], False
    for line in err.splitlines():
        in_plan = line.startswith("fw plan:") or (in_plan and line.startswith(("  ", "fits:", "does not fit")))
        if not in_plan:
            lines.append(line)
    return lines


def test_writer_on_a_full_disk_keeps_the_previous_checkpoint(tmpfs):
    run_dir = tmpfs / "run"
    cfg = make_cfg(str(run_dir))
    first = ck.checkpoints_dir(run_dir) / "step-000001"
    ck.write_checkpoint_dir(expected(1, 0, 1), first, cfg)
    free = os.statvfs(tmpfs).f_bavail
    with pytest.raises(FwError, match=r"step-000002/.*: no space left on device while writing the checkpoint "
                                      r"\(.* MB free\); the checkpoint step-000002 was not written") as e:
        ck.write_checkpoint_dir(expected(2, 0, 1), ck.checkpoints_dir(run_dir) / "step-000002", cfg)
    assert "\n" not in str(e.value) and ".staging" not in str(e.value)
    assert os.listdir(ck.checkpoints_dir(run_dir)) == ["step-000001"]   # staging removed, space given back
    assert os.statvfs(tmpfs).f_bavail == free
    assert_same(expected(1, 0, 1), ck.read_checkpoint_dir(first, verify=True))


def test_a_write_failing_on_its_thread_stops_the_file_and_names_it(tmpfs, monkeypatch):
    """ENOSPC met by a file's writing thread while later chunks wait behind it: DiskFull names the file, no
    hashing or writing thread outlives the call, and deleting the file gives its space back (it is closed)."""
    import threading

    from framework.checkpoint import tensors as ts

    monkeypatch.setattr(ts, "_CHUNK", 64 << 10)
    free = os.statvfs(tmpfs).f_bavail
    path = tmpfs / "big.safetensors"
    with pytest.raises(ts.DiskFull, match=f"{path}: no space left on device"):
        ts.write_safetensors(path, {"t": torch.randn(2 << 20)})   # 8 MiB on a 4 MiB file system
    assert not [t.name for t in threading.enumerate() if t.name.startswith("fw-ckpt-")]
    path.unlink()
    assert os.statvfs(tmpfs).f_bavail == free


def test_fw_fit_on_a_full_disk_exits_2_with_one_line(tmp_path, tmpfs, capsys, quiet_lightning):
    from framework.cli import main

    run_dir = tmpfs / "run"
    assert main(["fit", "--config", _sft_config(tmp_path, run_dir, max_steps=4)]) == 2
    (error,) = fw_lines(capsys.readouterr().err)
    step4 = ck.checkpoints_dir(run_dir) / "step-000004"
    assert error.startswith(f"fw: error: {step4}/") and "no space left on device" in error
    assert os.listdir(ck.checkpoints_dir(run_dir)) == ["step-000002"]
    ck.verify_checkpoint(ck.checkpoints_dir(run_dir) / "step-000002")


def test_fw_fit_past_the_file_size_limit_exits_2_with_one_line(tmp_path, capsys, quiet_lightning):
    """A real `fw fit --resume last` process whose file size limit (RLIMIT_FSIZE, `ulimit -f`) lets it write its
    config and logs but not its next checkpoint's larger files: the write fails with EFBIG (CPython ignores
    SIGXFSZ), and the run ends as on a full disk, with one line naming the checkpoint and the limit to raise, exit
    2, and the checkpoint it resumed from intact. Under 100,000 bytes torch's pickle of the trainer state fails
    first (an error of torch's own, the OSError its context); under 500,000 one of the safetensors files does."""
    import resource

    from framework.cli import main
    from framework.metrics import read_metrics

    run_dir = tmp_path / "run"
    train = _sft_config(tmp_path, run_dir, max_steps=2)
    assert main(["fit", "--config", train]) == 0
    capsys.readouterr()
    ckpts = ck.checkpoints_dir(run_dir)
    step4 = ckpts / "step-000004"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    for limit in (100_000, 500_000):
        def limited(limit: int = limit) -> None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

        done = subprocess.run([sys.executable, "-m", "framework", "fit", "--config", train, "--resume", "last",
                               "--trainer.max_steps=4"], capture_output=True, text=True, preexec_fn=limited,
                              cwd=REPO, env=env, check=False)
        assert done.returncode == 2, done.stderr[-3000:]
        (error,) = fw_lines(done.stderr)[1:]   # after the line on the resumed checkpoint's changed max_steps
        limit_line = (f"(this process's file size limit is {limit:,} bytes; `ulimit -f`, in blocks of 1024 bytes, "
                      "raises it, `ulimit -f unlimited` lifts it)")
        if limit == 100_000:
            assert error == (f"fw: error: {ckpts}: file size limit exceeded while writing the checkpoint step-000004 "
                             f"{limit_line}; the earlier checkpoints are intact")
        else:
            assert error.startswith(f"fw: error: {step4}/"), error
            assert error.endswith(f".safetensors: file size limit exceeded while writing the checkpoint {limit_line}; "
                                  "the checkpoint step-000004 was not written, the earlier checkpoints are intact")
        assert os.listdir(ckpts) == ["step-000002"]   # no staging directory left beside it
        ck.verify_checkpoint(ckpts / "step-000002")
        assert [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")][:2] == [1, 2]


def test_fw_fit_resume_names_a_corrupt_checkpoint(tmp_path, capsys, quiet_lightning):
    from framework.cli import main

    run_dir = tmp_path / "run"
    train = _sft_config(tmp_path, run_dir, max_steps=4)
    assert main(["fit", "--config", train]) == 0
    ckpts = ck.checkpoints_dir(run_dir)
    assert main(["fit", "--config", train, "--checkpoint.keep_last=2", "--trainer.max_steps=6"]
                + ["--resume", "last"]) == 0
    weights = ckpts / "step-000006" / "policy" / "model.safetensors"
    original = weights.read_bytes()
    data = bytearray(original)
    data[-7] ^= 0x40   # one flipped bit in a weight
    weights.write_bytes(bytes(data))
    capsys.readouterr()

    resume = ["fit", "--config", train, "--checkpoint.keep_last=2", "--trainer.max_steps=8", "--resume", "last"]
    assert main(resume) == 2   # verify is on by default: the flipped bit is found before anything loads
    [error] = fw_lines(capsys.readouterr().err)
    assert error.startswith(f"fw: error: the newest checkpoint {ckpts / 'step-000006'} is damaged: {weights}: sha256 ")
    assert error.endswith("; --skip-damaged uses the newest intact older one instead")

    header = bytearray(original)
    header[0:8] = (len(original) * 2).to_bytes(8, "little")   # a header longer than the file
    weights.write_bytes(bytes(header))
    assert main([*resume, "--checkpoint.verify=false"]) == 2
    # unhashed, it fails to load; then hashed, it is named as the sha256 check names it, with the same advice
    error = fw_lines(capsys.readouterr().err)[1:]
    digest = hashlib.sha256(bytes(header)).hexdigest()
    assert len(error) == 1 and error[0].startswith(
        f"fw: error: the newest checkpoint {ckpts / 'step-000006'} is damaged: {weights}: sha256 {digest} ")
    assert error[0].endswith("the file is corrupt; --skip-damaged uses the newest intact older one instead")

    weights.unlink()   # a missing file: named; --skip-damaged resumes from the older checkpoint, saying so
    assert main(resume) == 2
    assert f"the newest checkpoint {ckpts / 'step-000006'} is damaged" in fw_lines(capsys.readouterr().err)[-1]
    assert main([*resume, "--skip-damaged"]) == 0
    err = capsys.readouterr().err
    assert f"fw: warning: skipping damaged checkpoint {ckpts / 'step-000006'}: {weights}: missing" in err
    assert [Path(p).name for p in ck.list_checkpoints(run_dir)] == ["step-000006", "step-000008"]
    ck.verify_checkpoint(ckpts / "step-000006")   # re-published by the run that continued from step 4
