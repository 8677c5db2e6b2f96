"""benchmarks.gc_pauses: collections charged to the training batch they ran in, and the freeze at the start."""
import gc

import lightning

from benchmarks.gc_pauses import FreezeAtStart, GCPauses
from framework.config import resolve
from framework.trainer import fit


class CollectInBatch(lightning.Callback):
    """Runs one generation-1 collection inside every training batch (after GCPauses marked its start)."""

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        gc.collect(1)


def tiny_sft(tmp_path, callbacks):
    return resolve({"recipe": "sft", "run_dir": str(tmp_path / "run"), "model": {"policy": {"preset": "tiny"}},
                    "data": {"path": "recipes/data/arithmetic_chat.jsonl", "max_seq_len": 64, "batch_size": 2},
                    "trainer": {"accelerator": "cpu", "max_steps": 3, "enable_progress_bar": False},
                    "checkpoint": {"every_n_steps": 100}, "logging": {"csv": False, "tensorboard": False},
                    "callbacks": callbacks})


def test_collections_are_charged_to_their_batch(tmp_path, capsys):
    trainer = fit(tiny_sft(tmp_path, [{"class_path": "benchmarks.gc_pauses.GCPauses"},
                                      {"class_path": "test_gc_pauses.CollectInBatch"}]))
    pauses = next(c for c in trainer.callbacks if isinstance(c, GCPauses))
    assert len(pauses.steps) == 3
    for step in pauses.steps:
        n, seconds = step["gen1"]
        assert n >= 1 and 0 < seconds < step["seconds"]
    assert capsys.readouterr().out.count("gc_pauses batch ") == 3
    assert pauses._on_gc not in gc.callbacks   # removed at the end of training


def test_freeze_at_start_freezes_what_is_alive(tmp_path):
    gc.unfreeze()
    try:
        trainer = fit(tiny_sft(tmp_path, [{"class_path": "benchmarks.gc_pauses.FreezeAtStart"}]))
        assert any(isinstance(c, FreezeAtStart) for c in trainer.callbacks)
        assert gc.get_freeze_count() > 1000   # the model, the data, the framework's objects
    finally:
        gc.unfreeze()
