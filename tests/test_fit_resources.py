"""What fits leave behind: several fits in one process (a notebook) keep no earlier run's eval samples, and each start
of a run, a resume's too, adds one TensorBoard event file, which holds its points."""

import gc
import struct
import weakref
from pathlib import Path

from framework.config import resolve
from framework.tasks import Digits
from framework.trainer import fit

ROOT = Path(__file__).resolve().parent.parent


ALIVE: "weakref.WeakSet[Marker]" = weakref.WeakSet()   # the Markers not yet freed


class Marker:
    """An object a task's sample carries in its metadata."""

    def __init__(self) -> None:
        ALIVE.add(self)


class MarkedDigits(Digits):
    """The digits task, each sample's metadata holding a new Marker."""

    def sample(self, index: int) -> dict:
        sample = super().sample(index)
        sample["metadata"]["marker"] = Marker()
        return sample


def marked_grpo(run_dir) -> dict:
    return resolve({
        "recipe": "grpo", "seed": 3, "run_dir": str(run_dir), "model": {"policy": {"preset": "tiny"}},
        "data": {"task": {"class_path": "test_fit_resources.MarkedDigits", "init_args": {"num_digits": 3}},
                 "chat_template": False},
        "rollout": {"prompts_per_step": 4, "max_new_tokens": 2}, "reward": {"name": "exact_match"},
        "grpo": {"group_size": 2}, "trainer": {"accelerator": "cpu", "max_steps": 2, "enable_progress_bar": False},
        "checkpoint": {"every_n_steps": 100}, "logging": {"csv": False, "tensorboard": False},
        "eval": {"every_n_steps": 2, "max_prompts": 5, "samples_per_prompt": 1}})


def test_fits_in_one_process_keep_no_earlier_runs_eval_samples(tmp_path):
    alive = []
    for i in range(3):
        fit(marked_grpo(tmp_path / f"run{i}"))   # a run_dir of its own: another config each time
        gc.collect()
        alive.append(len(ALIVE))
    # at most one run's eval set (5 prompts), however many runs the process has fitted
    assert alive[0] <= 5 and alive == [alive[0]] * 3


def records(event_file: Path) -> int:
    """The number of TFRecords in a TensorBoard event file (each: u64 length, u32 crc, the data, u32 crc)."""
    data, pos, n = event_file.read_bytes(), 0, 0
    while pos < len(data):
        (length,) = struct.unpack_from("<Q", data, pos)
        pos += 12 + length + 4
        n += 1
    assert pos == len(data)
    return n


def test_each_start_of_a_run_adds_one_event_file_with_its_points(tmp_path, tensorboard_writer):
    def config(max_steps: int) -> dict:
        return resolve({
            "recipe": "sft", "seed": 1, "run_dir": str(tmp_path / "run"), "model": {"policy": {"preset": "tiny"}},
            "data": {"path": str(ROOT / "recipes" / "data" / "arithmetic_chat.jsonl"), "max_seq_len": 64,
                     "batch_size": 2},
            "trainer": {"accelerator": "cpu", "max_steps": max_steps, "log_every_n_steps": 1,
                        "enable_progress_bar": False},
            "checkpoint": {"every_n_steps": 1}, "logging": {"csv": False, "tensorboard": True}})

    fit(config(1))
    fit(config(2), resume="last")
    fit(config(3), resume="last")
    files = sorted((tmp_path / "run" / "logs" / "version_0").glob("events.out.tfevents.*"))
    # three starts, three files: the file-version record, then at least the step's loss
    assert len(files) == 3 and all(records(f) > 1 for f in files)
