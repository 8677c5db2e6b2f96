"""A checkpoint moved to other storage and linked back (checkpoints/step-N -> elsewhere): pruning and the leftover
cleanup remove the link and keep its target, and a run resumed beside such a link goes on."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from scripts.ckpt_writer import assert_same, expected, make_cfg

from framework import checkpoint as ck
from framework.durable import remove_tree

REPO = Path(__file__).parents[1]


def _three_checkpoints(tmp_path: Path) -> tuple[Path, Path]:
    """A run with steps 1, 2, 3 whose step 1 lives in `archive/` and is linked back; (run_dir, archived copy)."""
    run_dir = tmp_path / "run"
    cfg = make_cfg(str(run_dir))
    for step in (1, 2, 3):
        ck.write_checkpoint_dir(expected(step, 0, 1), ck.checkpoints_dir(run_dir) / ck.step_dir_name(step), cfg)
    archive = tmp_path / "archive"
    archive.mkdir()
    linked = ck.checkpoints_dir(run_dir) / ck.step_dir_name(1)
    shutil.move(linked, archive / linked.name)
    linked.symlink_to(archive / linked.name)
    return run_dir, archive / linked.name


def test_pruning_a_linked_checkpoint_removes_the_link_and_keeps_its_target(tmp_path, capsys):
    run_dir, target = _three_checkpoints(tmp_path)
    link = ck.checkpoints_dir(run_dir) / "step-000001"
    assert ck.list_checkpoints(run_dir)[0] == str(link)   # a linked checkpoint is one of the run's

    assert ck.prune(run_dir, keep_last=2) == [str(link)]

    assert sorted(os.listdir(ck.checkpoints_dir(run_dir))) == ["step-000002", "step-000003"]   # no .trash-*
    assert_same(expected(1, 0, 1), ck.read_checkpoint_dir(target, verify=True))
    err = capsys.readouterr().err.splitlines()
    assert err == [f"fw: pruned {link}, a link: removed the link, kept its target {target}"]


def test_leftover_links_are_unlinked_and_their_targets_kept(tmp_path):
    """A `.trash-*` link (a removal cut short) and a `.staging-*` link that points nowhere, both of a dead process
    (this process counts as dead to the cleanup), go; the directory a link points to stays whole."""
    run_dir, target = _three_checkpoints(tmp_path)
    ckpts = ck.checkpoints_dir(run_dir)
    trash = ckpts / f".trash-step-000001-{os.getpid()}-0123abcd"
    os.rename(ckpts / "step-000001", trash)
    dangling = ckpts / f".staging-step-000004-{os.getpid()}-4567cdef"
    dangling.symlink_to(tmp_path / "nowhere")

    assert sorted(ck.clean_leftovers(ckpts)) == sorted([trash.name, dangling.name])

    assert sorted(os.listdir(ckpts)) == ["step-000002", "step-000003"]
    assert_same(expected(1, 0, 1), ck.read_checkpoint_dir(target, verify=True))


def test_remove_tree_unlinks_a_link_to_a_directory_and_a_dangling_one(tmp_path):
    target = tmp_path / "target"
    (target / "sub").mkdir(parents=True)
    (target / "sub" / "f").write_bytes(b"x")
    link, dangling = tmp_path / "link", tmp_path / "dangling"
    link.symlink_to(target)
    dangling.symlink_to(tmp_path / "nowhere")

    remove_tree(link)
    remove_tree(dangling)

    assert sorted(os.listdir(tmp_path)) == ["target"]
    assert (target / "sub" / "f").read_bytes() == b"x"


def test_fw_fit_resumed_beside_a_linked_checkpoint_prunes_the_link_and_resumes_again(tmp_path, capsys,
                                                                                     quiet_lightning):
    from framework.cli import main

    run_dir = tmp_path / "run"
    argv = ["fit", "--config", str(REPO / "recipes" / "sft.yaml"), f"--run_dir={run_dir}",
            f"--data.path={REPO / 'recipes' / 'data' / 'arithmetic_chat.jsonl'}", "--data.max_seq_len=64",
            "--data.batch_size=2", "--trainer.enable_progress_bar=false", "--checkpoint.every_n_steps=2",
            "--checkpoint.keep_last=2", "--logging.tensorboard=false", "--logging.csv=false"]
    assert main([*argv, "--trainer.max_steps=4"]) == 0
    archive = tmp_path / "archive"
    archive.mkdir()
    link = ck.checkpoints_dir(run_dir) / "step-000002"
    shutil.move(link, archive / link.name)
    link.symlink_to(archive / link.name)
    capsys.readouterr()

    assert main([*argv, "--trainer.max_steps=6", "--resume", "last"]) == 0   # saves step 6, prunes the link
    assert f"fw: pruned {link}, a link: removed the link, kept its target {archive / link.name}" in \
        capsys.readouterr().err
    assert sorted(os.listdir(ck.checkpoints_dir(run_dir))) == ["step-000004", "step-000006"]
    ck.verify_checkpoint(archive / link.name)

    assert main([*argv, "--trainer.max_steps=8", "--resume", "last"]) == 0
    assert sorted(os.listdir(ck.checkpoints_dir(run_dir))) == ["step-000006", "step-000008"]


def test_a_linked_checkpoint_whose_storage_is_gone_is_damage_not_passed_over(tmp_path, capsys, quiet_lightning):
    """The newest checkpoint linked to storage that is not mounted: `--resume last` used to pass over it without a
    word, train from the older one and crash publishing the link's step over it. It is refused now, naming the link
    and its target, as is a resume from an older checkpoint named by path; `--skip-damaged` moves the link aside
    (its target untouched) and resumes from the newest intact one."""
    from framework.cli import main

    run_dir = tmp_path / "run"
    argv = ["fit", "--config", str(REPO / "recipes" / "sft.yaml"), f"--run_dir={run_dir}",
            f"--data.path={REPO / 'recipes' / 'data' / 'arithmetic_chat.jsonl'}", "--data.max_seq_len=64",
            "--data.batch_size=2", "--trainer.enable_progress_bar=false", "--checkpoint.every_n_steps=2",
            "--logging.tensorboard=false", "--logging.csv=false"]
    assert main([*argv, "--trainer.max_steps=4"]) == 0
    archive, mounted = tmp_path / "archive", tmp_path / "unmounted"
    archive.mkdir()
    link = ck.checkpoints_dir(run_dir) / "step-000004"
    shutil.move(link, archive / link.name)
    link.symlink_to(archive / link.name)
    archive.rename(mounted)   # the storage goes away
    metrics = (run_dir / "metrics.jsonl").read_bytes()
    capsys.readouterr()

    assert main([*argv, "--trainer.max_steps=6", "--resume", "last"]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"fw: error: the newest checkpoint {link} is damaged: {link} is a link to {archive / link.name}, which does "
        "not exist (is its storage mounted?); --skip-damaged uses the newest intact older one instead")
    older = ck.checkpoints_dir(run_dir) / "step-000002"
    assert main([*argv, "--trainer.max_steps=6", "--resume", str(older)]) == 2
    assert "holds checkpoints past step 2 (step-000004)" in capsys.readouterr().err
    assert sorted(os.listdir(ck.checkpoints_dir(run_dir))) == ["step-000002", "step-000004"]
    assert (run_dir / "metrics.jsonl").read_bytes() == metrics

    assert main([*argv, "--trainer.max_steps=6", "--resume", "last", "--skip-damaged"]) == 0
    aside = link.with_name("step-000004.damaged")
    assert f"fw: moved the damaged checkpoint {link} aside to {aside}" in capsys.readouterr().err
    assert sorted(os.listdir(ck.checkpoints_dir(run_dir))) == [
        "step-000002", "step-000004", "step-000004.damaged", "step-000006"]
    assert os.readlink(aside) == str(archive / link.name)
    mounted.rename(archive)   # back: the target is whole
    ck.verify_checkpoint(aside)
