"""A run's checkpoints under `<run_dir>/checkpoints`: discovery, recovery, leftovers, pruning, resume."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from framework.checkpoint.directory import (
    MANIFEST,
    DamagedFile,
    Verifier,
    is_complete,
    mismatch,
    read_complete_manifest,
    read_manifest,
    verified,
)
from framework.console import say
from framework.durable import dead_leftovers, fsync_dir, remove_tree
from framework.errors import FwError
from framework.run_lock import LOCK_FILE

SKIP_DAMAGED_FLAG = "--skip-damaged"
# [run_dir, --resume value, the checkpoint it resolved to], for the processes Lightning launches (`pin_resume`)
RESUME_PIN = "FW_RESUME_PIN"

_STEP_DIR = re.compile(r"^step-(\d+)$")


def step_dir_name(step: int) -> str:
    return f"step-{step:06d}"


def checkpoints_dir(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / "checkpoints"


def recover(ckpt_dir: str | os.PathLike) -> None:
    """Put back a checkpoint that an interrupted fallback replace had set aside (its new copy never appeared)."""
    ckpt_dir = Path(ckpt_dir)
    for entry, kind, name in dead_leftovers(ckpt_dir):
        final = ckpt_dir / name
        if kind == "replaced" and not os.path.lexists(final) and is_complete(entry):
            try:
                os.rename(entry, final)
            except OSError:  # gone or target exists: another rank (same shared run_dir) recovered it first
                if not final.is_dir():
                    raise
            fsync_dir(ckpt_dir)


def clean_leftovers(ckpt_dir: str | os.PathLike) -> list[str]:
    """Recover, then delete hidden leftovers of dead processes (staging, replaced, trash); return their names.
    A leftover that is a symbolic link (a linked checkpoint whose removal was cut short) is unlinked, its target
    kept."""
    ckpt_dir = Path(ckpt_dir)
    recover(ckpt_dir)
    removed = []
    for entry, _, _ in dead_leftovers(ckpt_dir):
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        elif os.path.lexists(entry):
            entry.unlink()
        removed.append(entry.name)
    return removed


def step_dirs(run_dir: str | os.PathLike) -> list[Path]:
    """Every `step-*` directory under `<run_dir>/checkpoints`, complete or not, oldest step first; a link to one
    counts even where its target is missing (moved to storage that is not mounted): it stands for that checkpoint."""
    ckpt_dir = checkpoints_dir(run_dir)
    if not ckpt_dir.is_dir():
        return []
    found = [(int(m.group(1)), entry) for entry in ckpt_dir.iterdir()
             if (m := _STEP_DIR.match(entry.name)) and (entry.is_dir() or _dangling(entry))]
    return [p for _, p in sorted(found)]


def _dangling(path: Path) -> bool:
    """Whether `path` is a symbolic link whose target does not exist."""
    return path.is_symlink() and not path.exists()


def list_checkpoints(run_dir: str | os.PathLike) -> list[str]:
    """Complete checkpoints under `<run_dir>/checkpoints`, oldest step first (hidden leftovers ignored)."""
    return [str(p) for p in step_dirs(run_dir) if is_complete(p)]


def damage(path: str | os.PathLike, verify: bool = False) -> str | None:
    """Why checkpoint `path` cannot be used (a missing or wrong-sized file, an unreadable manifest, and with
    `verify` a wrong sha256), naming the file; None when it is complete."""
    path = Path(path)
    if _dangling(path):
        return f"{path} is a link to {os.readlink(path)}, which does not exist (is its storage mounted?)"
    try:
        manifest = read_complete_manifest(path)
    except FwError as e:
        return str(e)
    except (KeyError, TypeError, AttributeError) as e:
        return f"{path / MANIFEST}: malformed manifest ({type(e).__name__}: {e})"
    return Verifier(path, manifest).problem() if verify else None


def _inode(path: Path) -> int | None:
    try:
        return path.stat().st_ino
    except FileNotFoundError:
        return None


def _settled_damage(path: Path, verify: bool, attempts: int = 20, absent_wait_s: float = 1.0) -> str | None:
    """`damage(path)` of one and the same directory: a running writer that replaces `path` (an exchange, or two
    renames) while it is read makes the manifest and the files come from different directories, so the check
    is repeated until `path` names the same directory before and after it. A listed `path` that is absent is
    either pruned (it stays absent) or between the two renames of a replace, which fsync the directory in between
    (its new copy appears once that returns), so it is looked at again for up to `absent_wait_s` before it counts
    as gone."""
    deadline = time.monotonic() + absent_wait_s
    problem = None
    tries = 0
    while tries < attempts:
        before = _inode(path)
        if before is None:
            if time.monotonic() > deadline:
                break
            problem = None
            time.sleep(0.002)
            continue
        tries += 1
        problem = damage(path, verify)
        if problem is None or _inode(path) == before:
            return problem
    return problem if problem is not None else damage(path, verify)


def find_latest(run_dir: str | os.PathLike, skip_damaged: bool = False, verify: bool = False) -> str | None:
    """The newest checkpoint of the run, or None when it has none. First puts back a checkpoint left aside by
    an interrupted fallback replace, so a crash there never loses the newest checkpoint.

    A damaged newest checkpoint (see `damage`; `verify` adds the sha256 check) is an FwError naming it and
    the reason, unless `skip_damaged`: then each damaged one is reported on stderr and skipped."""
    return _newest(run_dir, skip_damaged, verify)[0]


def _newest(run_dir: str | os.PathLike, skip_damaged: bool, verify: bool) -> tuple[str | None, list[Path]]:
    """`find_latest`, and the damaged checkpoints it skipped, newest first."""
    recover(checkpoints_dir(run_dir))
    skipped: list[Path] = []
    gone: set[Path] = set()   # pruned while read
    listed = reversed(step_dirs(run_dir))
    while (path := next(listed, None)) is not None:
        if path in skipped or path in gone:
            continue
        problem = _settled_damage(path, verify)
        if problem is None:
            return str(path), skipped
        if not os.path.lexists(path):
            # pruned while it was read: a writer is running, and it published a newer checkpoint first
            gone.add(path)
            listed = reversed(step_dirs(run_dir))
            continue
        if not skip_damaged:
            raise FwError(_damaged_newest(path, problem))
        print(f"fw: warning: skipping damaged checkpoint {path}: {problem}", file=sys.stderr)
        skipped.append(path)
    return None, skipped


def _damaged_newest(path: Path, problem: str) -> str:
    """The refusal of a run directory's damaged newest checkpoint `path`, with the option that passes over it."""
    return (f"the newest checkpoint {path} is damaged: {problem}; {SKIP_DAMAGED_FLAG} uses the newest intact older "
            "one instead")


def found_damage(path: str | os.PathLike, error: BaseException | None = None) -> DamagedFile | None:
    """The damage behind `error`, raised while checkpoint `path` was read without its files hashed: a file of it
    that the error names (an FwError names the files it is about) or, for another error or none, any file of it,
    whose sha256 differs from the manifest's or that is missing, as a DamagedFile; None when there is none, so
    that the error stands. An FwError that names no file of the checkpoint (a user's mistake) hashes nothing."""
    path = Path(path)
    try:
        manifest = read_manifest(path)
        files = manifest["files"]
        if isinstance(error, FwError):
            text = str(error)
            rels = [rel for rel in files if str(path / rel) in text]
            if not rels:
                return None
        else:
            if verified(path, manifest):   # hashed by this process, and unchanged since
                return None
            rels = None
        return mismatch(path, manifest, rels)
    except (FwError, KeyError, TypeError, AttributeError):   # no manifest to check against: the error stands
        return None


def resume_refusal(error: BaseException, checkpoint: str | os.PathLike, resume: str, skip_damaged: bool,
                   restoring: bool = False) -> FwError | None:
    """The refusal of `--resume resume` whose checkpoint failed to load or restore with `error` because a file of it
    is damaged, naming the file and what is wrong, with `--skip-damaged` where it would pass over the checkpoint;
    None when `error` is not such damage. `restoring`: the error came after the checkpoint was read, while its
    states were restored (names and values that a corrupt file holds fail there), and every file is hashed to find
    one that differs from the manifest."""
    path = Path(checkpoint)
    # a checkpoint gone meanwhile was pruned by the run writing it, which no damage explains
    if not isinstance(error, DamagedFile) and not (restoring and path.is_dir()):
        return None
    damaged = damage_in(path, error, every_file=True)
    return None if damaged is None else FwError(_damaged_resume(path, damaged.problem, resume, skip_damaged))


def damage_in(path: Path, error: BaseException, every_file: bool = False) -> DamagedFile | None:
    """The damaged file of checkpoint `path` behind `error`: `error` itself when it is a DamagedFile, else what
    `found_damage` finds (among every file with `every_file`, else among those the error names); None when there is
    none, or when the file lies outside `path` (another checkpoint's)."""
    damaged = error if isinstance(error, DamagedFile) else found_damage(path, None if every_file else error)
    if damaged is None or not damaged.file.absolute().is_relative_to(path.absolute()):
        return None
    return damaged


def _damaged_resume(path: Path, problem: str, resume: str, skip_damaged: bool) -> str:
    """The refusal of `--resume resume` whose checkpoint `path` is damaged: the newest of a run directory gets the
    option that passes over it (unless given already), one named itself has no older one to turn to."""
    if not skip_damaged and (resume == "last" or checkpoints_dir(resume).is_dir()):
        return _damaged_newest(path, problem)
    if Path(resume) == path:
        return f"--resume {resume}: the checkpoint is damaged: {problem}"
    return f"--resume {resume}: its checkpoint {path} is damaged: {problem}"


def resolve_checkpoint(path: str | os.PathLike, skip_damaged: bool = False, verify: bool = False,
                       option: str = "--checkpoint") -> Path:
    """A checkpoint directory as given (which must be complete), or a run directory's newest checkpoint under
    `find_latest`'s rules."""
    return _resolve(path, skip_damaged, verify, option)[0]


def is_one_checkpoint(path: str | os.PathLike) -> bool:
    """Whether `path`, as `--checkpoint` or `--resume` gives it, names a checkpoint directory itself rather than a
    run directory (whose newest checkpoint it stands for)."""
    path = Path(path)
    return (not checkpoints_dir(path).is_dir() and path.is_dir()
            and ((path / MANIFEST).exists() or _STEP_DIR.match(path.name) is not None))


def _resolve(path: str | os.PathLike, skip_damaged: bool, verify: bool, option: str) -> tuple[Path, list[Path]]:
    """`resolve_checkpoint`, and the damaged checkpoints it skipped."""
    path = Path(path)
    if checkpoints_dir(path).is_dir():
        latest, skipped = _newest(path, skip_damaged, verify)
        if latest is None:
            raise FwError(f"{option} {path}: a run directory without a usable checkpoint under "
                          f"{checkpoints_dir(path)}")
        return Path(latest), skipped
    if is_one_checkpoint(path):
        problem = damage(path)
        if problem is not None:
            raise FwError(f"{option} {path}: the checkpoint is damaged: {problem}")
        return path, []
    if not path.exists():
        raise FwError(f"{option} {path}: no such directory")
    if not path.is_dir():
        raise FwError(f"{option} {path}: a file; expected a checkpoint directory or a run directory")
    if (path.parent / MANIFEST).exists():   # policy/ or value/ of a checkpoint
        raise FwError(f"{option} {path}: a folder inside checkpoint {path.parent}; give the checkpoint itself")
    if (path / LOCK_FILE).exists():   # every fit takes its run_dir's lock before it trains
        raise FwError(f"{option} {path}: a run directory whose run has saved no checkpoint (no checkpoints/)")
    if path == checkpoints_dir(path.parent):
        raise FwError(f"{option} {path}: the checkpoints/ folder of run directory {path.parent}; give the run "
                      "directory (for its newest checkpoint) or one of the checkpoints in it")
    raise FwError(f"{option} {path}: not a checkpoint (no {MANIFEST}) nor a run directory (no checkpoints/)")


def refuse_existing_checkpoints(run_dir: str | os.PathLike) -> None:
    """FwError if `run_dir` already holds checkpoints (complete or not): a fresh run there would prune them
    and mix its own in with them."""
    existing = step_dirs(run_dir)
    if existing:
        raise FwError(f"{checkpoints_dir(run_dir)} already holds checkpoints ({existing[-1].name} is the "
                      "newest): resume with --resume last, or choose another run_dir")


def refuse_missing_run_dir(resume: str | None, run_dir: str | os.PathLike) -> None:
    """FwError when `--resume last` names a run_dir that does not exist (a typo, most often): it holds no
    checkpoint. Called before the run lock, which would create it."""
    if resume == "last" and not Path(run_dir).is_dir():
        raise FwError(f"--resume last: run_dir {run_dir} does not exist, so it holds no checkpoint to resume; give "
                      "the run_dir of the run to continue, or leave out --resume to start a new run there")


def refuse_newer_checkpoints(run_dir: str | os.PathLike, checkpoint: str | os.PathLike, resume: str,
                             skipped: list[Path] | tuple[Path, ...] = ()) -> None:
    """FwError if `run_dir` holds complete checkpoints of later steps than `checkpoint`: a run resumed there would
    write its own steps beside another timeline's, `--resume last` would pick theirs, and `prune` (by step)
    would delete the run's newest checkpoints instead of theirs. The damaged ones in `skipped` do not count
    (`resolve_resume` moves them aside)."""
    step = read_manifest(checkpoint).get("step")
    passed = {p.absolute() for p in skipped}
    # a link whose target is missing counts: its checkpoint may be back once its storage is mounted, and the save of
    # its step could not publish over it
    newer = [p for p in step_dirs(run_dir)
             if step is not None and int(_STEP_DIR.match(p.name).group(1)) > step
             and (is_complete(p) or _dangling(p)) and p.absolute() not in passed]
    if newer:
        names = ", ".join(p.name for p in newer)
        raise FwError(f"--resume {resume}: {checkpoints_dir(run_dir)} holds checkpoints past step {step} ({names}); a "
                      "run resumed there would mix its steps with theirs and prune its own: resume into another "
                      "run_dir, or move them out of this one first")


def run_of_checkpoints_folder(path: str | os.PathLike) -> Path | None:
    """The run directory whose checkpoints/ folder `path` is or lies inside (one a fit locked, or that holds
    checkpoints), or None: fw reads what is there as that run's checkpoints."""
    folder = Path(os.path.abspath(path))
    return next((f.parent for f in (folder, *folder.parents) if f.name == "checkpoints"
                 and ((f.parent / LOCK_FILE).exists() or step_dirs(f.parent))), None)


def in_run_dir(run_dir: str | os.PathLike, checkpoint: str | os.PathLike) -> bool:
    """Whether `checkpoint` is one of `run_dir`'s own checkpoints (not another directory's, nor a copy)."""
    return Path(checkpoint).parent.resolve() == checkpoints_dir(run_dir).resolve()


def refuse_foreign_resume(run_dir: str | os.PathLike, checkpoint: str | os.PathLike, resume: str) -> None:
    """FwError if `run_dir` holds checkpoints of its own and `checkpoint`, from elsewhere, is not one of them: the
    run resumed there would write its steps beside theirs, and `prune` (by step) would delete theirs, the work of
    another timeline. An empty run_dir takes a checkpoint from anywhere."""
    existing = step_dirs(run_dir)
    if existing:
        raise FwError(f"--resume {resume}: {checkpoint} is not one of {checkpoints_dir(run_dir)}, which holds "
                      f"checkpoints of its own ({existing[-1].name} is the newest): a run resumed there would mix its "
                      "steps with theirs and prune them; resume into an empty run_dir, or give --resume last to "
                      "continue the run there")


def move_aside(path: Path) -> Path | None:
    """Rename the damaged checkpoint `path` to `<name>.damaged` (or `.damaged-2`, ...) beside it, a name that
    neither discovery nor pruning nor the leftover cleanup reads, and say so on stderr; None when it is gone
    already (another process of the run moved it)."""
    n = 1
    while True:
        target = path.with_name(f"{path.name}.damaged" + (f"-{n}" if n > 1 else ""))
        if not target.exists():
            break
        n += 1
    try:
        os.rename(path, target)
    except FileNotFoundError:
        return None
    except OSError as e:
        if not path.exists():
            return None
        raise FwError(f"cannot move the damaged checkpoint {path} aside to {target}: {e}") from None
    fsync_dir(path.parent)
    print(f"fw: moved the damaged checkpoint {path} aside to {target}, where no --resume or pruning reads it",
          file=sys.stderr)
    return target


def resolve_resume(resume: str | None, cfg: dict, skip_damaged: bool = False) -> str | None:
    """`--resume` value -> checkpoint dir: None stays None (after refusing a run_dir that holds checkpoints),
    "last" -> the newest under `find_latest`'s rules (FwError if none), a path -> that checkpoint (which must
    be complete) or that run directory's newest. The newest is verified with `checkpoint.verify` or
    `skip_damaged`, so a corrupt one is named here, as a truncated one is, with the advice to skip it, and
    skipped when asked to. The new config `cfg` is then checked against the checkpoint's
    (`resume.check_resume_config`); a config.yaml that fails to load there is hashed, and named when corrupt.

    The damaged checkpoints of this run_dir skipped on the way (`skip_damaged`) are moved aside (`move_aside`)
    once the resume is sure to go ahead: left in place, one whose sizes are right (a corrupt file) would count
    as complete to a later `--resume last` and to pruning, which could delete the resumed run's own newer
    checkpoints."""
    from framework.checkpoint.resume import check_resume_config
    from framework.yaml12 import inline as shown

    run_dir = cfg["run_dir"]
    resume = _pinned(run_dir, resume)
    if resume is None:
        refuse_existing_checkpoints(run_dir)
        return None
    refuse_missing_run_dir(resume, run_dir)
    # skipping damaged checkpoints hashes them: a corrupt file of the right size is damage it must pass over
    verify = cfg["checkpoint"]["verify"] or skip_damaged
    if resume == "last":
        latest, skipped = _newest(run_dir, skip_damaged, verify)
        if latest is None:
            raise FwError(f"--resume last: no complete checkpoint under {checkpoints_dir(run_dir)}")
    else:
        found, skipped = _resolve(resume, skip_damaged, verify, option="--resume")
        latest = str(found)
    skipped = [p for p in skipped if in_run_dir(run_dir, p)]   # another run's are left alone
    refuse_newer_checkpoints(run_dir, latest, resume, skipped)
    if not in_run_dir(run_dir, latest):
        refuse_foreign_resume(run_dir, latest, resume)
    try:
        changes = check_resume_config(latest, cfg)
    except FwError as e:   # a config.yaml that does not load: corrupt (hashed now, unless verified), or not
        damaged = found_damage(latest, e)
        if damaged is None:
            raise
        raise FwError(_damaged_resume(Path(latest), damaged.problem, resume, skip_damaged)) from None
    # the manifest's step, as refuse_newer_checkpoints reads it: a checkpoint given by path may have any name
    step, max_steps = read_manifest(latest).get("step"), cfg["trainer"]["max_steps"]
    if step is not None and step > max_steps:   # nothing can train, and config.yaml would record a max_steps
        raise FwError(f"--resume {resume}: {Path(latest).name} is past trainer.max_steps ({step} > {max_steps}); "
                      f"a resume only trains further: set --trainer.max_steps above {step}")
    for path in skipped:
        move_aside(path)
    if os.environ.get("LOCAL_RANK", "0") == "0" and os.environ.get("NODE_RANK", "0") == "0":
        changed = ", ".join(f"{k} {shown(a)} -> {shown(b)}" for k, a, b in changes)
        print(f"fw: resuming {latest}" + (f" with changed settings: {changed}" if changes else ""), file=sys.stderr)
        pruned = _pruned_by_a_change(run_dir, changes)
        if pruned:
            print(pruned, file=sys.stderr)
        if step == max_steps:
            print(f"fw: {Path(latest).name} is at trainer.max_steps ({max_steps}) already: nothing to train; "
                  "raise --trainer.max_steps to continue", file=sys.stderr)
    return latest


def _pruned_by_a_change(run_dir: str, changes: list[tuple[str, Any, Any]]) -> str | None:
    """The warning for a resume whose checkpoint.keep_last is smaller than the run's (or set where the run's is null)
    and whose first save therefore deletes checkpoints that the run's own setting keeps: most often an override the
    run was started with that this command leaves out. None where it deletes none of them."""
    from framework.yaml12 import inline as shown

    change = next(((a, b) for k, a, b in changes if k == "checkpoint.keep_last"), None)
    if change is None or change[1] is None:
        return None
    before, after = change
    held = list_checkpoints(run_dir)
    lost = held[:max(0, len(held) + 1 - after)]                                  # with the first save's own
    lost = lost[max(0, len(held) + 1 - before) if before is not None else 0:]    # what the run's value deletes too
    if not lost:
        return None
    names = ", ".join(Path(p).name for p in lost)
    return (f"fw: warning: checkpoint.keep_last {shown(before)} -> {after}: the first save of this resume deletes "
            f"{names}, which the run's setting keeps (Ctrl+C twice ends the resume before that save); fw fit --config "
            f"{Path(run_dir) / 'config.yaml'} --resume last resumes with the settings the run ran with")


@contextlib.contextmanager
def pin_resume(run_dir: str, resume: str | None, checkpoint: str | None) -> Iterator[None]:
    """While inside: the processes that Lightning launches on this node (which run the command again and resolve
    `--resume` themselves) resolve it to `checkpoint`, the one this process resolved. A run directory that another
    run is writing may publish a newer checkpoint meanwhile, and every rank must load the same one."""
    if checkpoint is None or os.environ.get("LOCAL_RANK", "0") != "0":
        yield
        return
    before = os.environ.get(RESUME_PIN)
    os.environ[RESUME_PIN] = json.dumps([str(run_dir), resume, str(checkpoint)])
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(RESUME_PIN, None)
        else:
            os.environ[RESUME_PIN] = before


def _pinned(run_dir: str, resume: str | None) -> str | None:
    """`resume`, or in a process launched under `pin_resume` for the same run and `--resume` value, the checkpoint
    its launcher resolved."""
    pin = os.environ.get(RESUME_PIN)
    if resume is None or not pin or os.environ.get("LOCAL_RANK", "0") == "0":
        return resume
    try:
        pinned_run, pinned_resume, checkpoint = json.loads(pin)
    except ValueError:
        return resume
    return checkpoint if (pinned_run, pinned_resume) == (str(run_dir), resume) else resume


def prune(run_dir: str | os.PathLike, keep_last: int | None) -> list[str]:
    """Delete all but the newest `keep_last` complete checkpoints (None keeps all); return the deleted paths.
    A checkpoint that is a symbolic link (moved to other storage and linked back) loses the link alone, which
    is said on stderr: its target is the user's copy."""
    if keep_last is None:
        return []
    if keep_last < 1:
        raise FwError(f"checkpoint.keep_last: {keep_last} is not allowed, expected an integer >= 1 or null")
    old = list_checkpoints(run_dir)[:-keep_last]
    for path in old:
        target = os.readlink(path) if os.path.islink(path) else None
        remove_tree(Path(path))
        if target is not None:
            say(f"fw: pruned {path}, a link: removed the link, kept its target {target}", flush=True)
    return old


T = TypeVar("T")


def read_resolved(checkpoint: str | os.PathLike, read: Callable[[Path], T], skip_damaged: bool = False,
                  settled: bool = True, option: str = "--checkpoint") -> T:
    """`read(path)` of the checkpoint directory that `checkpoint` resolves to (`resolve_checkpoint`).

    One resolved from a run directory may be pruned by the fit writing that run while it is read: then the
    run directory is resolved again (its newer checkpoint) and read once more, and a second loss is a
    one-line FwError. A read that fails, or with `settled` (a read that may pass over a missing file, such
    as an optional tokenizer) one that succeeds, counts as lost when the directory is gone or replaced."""
    for _ in range(2):
        path = resolve_checkpoint(checkpoint, skip_damaged=skip_damaged, verify=skip_damaged, option=option)
        named = path == Path(checkpoint)   # named itself: nothing newer to turn to
        before = _inode(path)
        try:
            result = read(path)
        except Exception as e:
            if named or (before is not None and _inode(path) == before):
                # a read without `checkpoint.verify` fails on a corrupt file without saying so: its hash does
                damaged = damage_in(path, e)
                if damaged is None:
                    raise
                if not named and not skip_damaged:
                    raise FwError(_damaged_newest(path, damaged.problem)) from None
                if damaged is e:
                    raise
                raise damaged from None
        else:
            if named or not settled or (before is not None and _inode(path) == before):
                return result
    raise FwError(f"{option} {checkpoint}: {path.name} was pruned by the run writing it while it was read; "
                  "run again")


def _inode(path: Path) -> int | None:
    try:
        return path.stat().st_ino
    except FileNotFoundError:
        return None
