"""Durable file operations: fsync, hashing while fsyncing, files replaced whole, hidden staging siblings, atomic
publish of a directory, removal. Checkpoints, exported models and the run's logs share them."""

from __future__ import annotations

import ctypes
import errno
import hashlib
import os
import re
import resource
import secrets
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from framework.errors import DiskFull

# hidden siblings: .staging-<name>-<pid>-<hex> (being built, or an old dir swapped out),
# .replaced-<name>-<pid>-<hex> (set aside by the fallback replace), .trash-<name>-<pid>-<hex> (being deleted)
_HIDDEN = re.compile(r"^\.(staging|replaced|trash)-(.+)-(\d+)-([0-9a-f]+)$")
_HASH_CHUNK = 8 << 20


def fsync_dir(path: str | os.PathLike) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: str | os.PathLike) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def fsync_tree(root: Path) -> None:
    """fsync every regular file and directory under `root`, `root` included."""
    for folder, _, files in os.walk(root):
        for name in files:
            file = os.path.join(folder, name)
            if stat.S_ISREG(os.lstat(file).st_mode):
                fsync_file(file)
        fsync_dir(Path(folder))


def write_new_file(path: Path, data: bytes) -> None:
    """`data` as a new file at `path`, fsynced. An existing file there is unlinked first, never written through:
    it may be a hard link shared with a published directory."""
    path.unlink(missing_ok=True)
    with open(path, "xb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def replace_file(path: str | os.PathLike, data: str | bytes) -> None:
    """Replace the file `path` with `data` in one rename of a fsynced temporary sibling: a crash leaves the old
    file or the new one, never a part."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        write_new_file(tmp, data.encode("utf-8") if isinstance(data, str) else data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def file_in_the_way(path: str | os.PathLike) -> Path | None:
    """The nearest existing ancestor of `path` when it is not a directory (a file where a folder of `path` must
    be created), else None."""
    parent = Path(path).parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    return None if parent.is_dir() else parent


def link_or_copy(src: str, dst: str) -> None:
    """`shutil.copytree`'s copy function that hard-links where it can (instant; safe where every later write
    is a new file, as `write_new_file` makes it) and copies elsewhere."""
    try:
        os.link(src, dst, follow_symlinks=False)
    except OSError:
        shutil.copy2(src, dst, follow_symlinks=False)


def _size_and_sha256(f: BinaryIO) -> tuple[int, str]:
    digest = hashlib.sha256()
    size = 0
    while chunk := f.read(_HASH_CHUNK):
        digest.update(chunk)
        size += len(chunk)
    return size, digest.hexdigest()


def hash_and_fsync(path: Path) -> tuple[int, str]:
    """Read the file back (what is on disk is what gets hashed), fsync it, return (size, sha256)."""
    with open(path, "rb") as f:
        result = _size_and_sha256(f)
        os.fsync(f.fileno())
    return result


def sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return _size_and_sha256(f)[1]


def hidden_sibling(final: Path, kind: str) -> Path:
    return final.parent / f".{kind}-{final.name}-{os.getpid()}-{secrets.token_hex(4)}"


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100
_libc = ctypes.CDLL(None, use_errno=True)
_renameat2 = getattr(_libc, "renameat2", None)


def exchange_supported() -> bool:
    """Whether this libc offers renameat2 (the kernel and file system may still refuse it)."""
    return _renameat2 is not None


def exchange(a: Path, b: Path) -> bool:
    """Atomically swap two existing paths; False when the platform or file system cannot."""
    if _renameat2 is None:
        return False
    rc = _renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(err, f"renameat2(RENAME_EXCHANGE) {a} <-> {b}: {os.strerror(err)}")


def publish_dir(staging: Path, final: Path, use_exchange: bool = True) -> None:
    """Make the complete, fsynced directory `staging` appear as `final` in one step.

    A new `final` is one rename. An existing `final` is swapped with `staging` by RENAME_EXCHANGE and
    the old contents (now under the staging name) deleted. Without RENAME_EXCHANGE the old dir is
    renamed aside to `.replaced-*` first; a crash between the two renames is undone by `recover`.
    """
    staging, final = Path(staging), Path(final)
    parent = final.parent
    if not final.exists():
        os.rename(staging, final)
        fsync_dir(parent)
        return
    if use_exchange and exchange(staging, final):
        fsync_dir(parent)
        remove_tree(staging)
        return
    aside = hidden_sibling(final, "replaced")
    os.rename(final, aside)
    fsync_dir(parent)
    os.rename(staging, final)
    fsync_dir(parent)
    remove_tree(aside)


def remove_tree(path: Path) -> None:
    """Delete a directory so that a crash midway leaves only a hidden `.trash-*` leftover. A symbolic link (a
    directory moved to other storage and linked back) is unlinked, its target kept: the link is what stood here."""
    path = Path(path)
    if path.is_symlink():
        path.unlink()
        fsync_dir(path.parent)
        return
    if not path.exists():
        return
    if not _HIDDEN.match(path.name):
        trash = hidden_sibling(path, "trash")
        os.rename(path, trash)
        fsync_dir(path.parent)
        path = trash
    shutil.rmtree(path)


def _chain(exc: BaseException | None) -> Iterator[BaseException]:
    """`exc`, its cause or context, theirs, and so on, each once."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


# The errors of a write that finds no room, as a message words each: a full file system, a full quota, and a file
# past the largest size allowed: the process's file size limit (RLIMIT_FSIZE, `ulimit -f`; CPython ignores SIGXFSZ,
# so the write fails with EFBIG instead of the signal killing the process) or its file system's largest file.
_NO_ROOM = {errno.ENOSPC: "no space left on device", errno.EDQUOT: "disk quota exceeded",
            errno.EFBIG: "file size limit exceeded"}
# the same errors where torch and safetensors keep only their text (strerror, or Rust's io::ErrorKind)
_NO_ROOM_TEXT = {"No space left on device": errno.ENOSPC, "StorageFull": errno.ENOSPC,
                 "Disk quota exceeded": errno.EDQUOT, "FilesystemQuotaExceeded": errno.EDQUOT,
                 "File too large": errno.EFBIG, "FileTooLarge": errno.EFBIG}


def disk_full_cause(exc: BaseException | None) -> OSError | None:
    """The OSError in `exc`'s chain of a write that found no room (ENOSPC, EDQUOT, or EFBIG: a file size limit),
    or None."""
    return next((e for e in _chain(exc) if isinstance(e, OSError) and e.errno in _NO_ROOM), None)


def no_room(exc: BaseException | None) -> int | None:
    """The errno (ENOSPC, EDQUOT or EFBIG) of a write that found no room in `exc`'s chain: its OSError's, or the
    one its message names where torch and safetensors wrap it; None if none."""
    cause = disk_full_cause(exc)
    if cause is not None:
        return cause.errno
    return next((code for e in _chain(exc) for text, code in _NO_ROOM_TEXT.items() if text in str(e)), None)


def no_room_reason(code: int) -> str:
    """What a message calls the `no_room` error `code`: "no space left on device" and so on."""
    return _NO_ROOM[code]


def room_left(code: int, directory: str | os.PathLike) -> str:
    """The room that a write into `directory` failing with the `no_room` error `code` had, for a message: the space
    left, or for EFBIG the file size limit and how to raise it."""
    if code != errno.EFBIG:
        return f"{free_space(directory)} free"
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if limit == resource.RLIM_INFINITY:   # not this process's limit: the file system's largest file
        return "larger than its file system allows"
    return (f"this process's file size limit is {limit:,} bytes; `ulimit -f`, in blocks of 1024 bytes, raises it, "
            "`ulimit -f unlimited` lifts it")


def no_room_text(code: int, directory: str | os.PathLike, doing: str) -> str:
    """"<what found no room> while <doing> (<the room there was>)" for a message, of a write into `directory` that
    failed with the `no_room` error `code`."""
    return f"{no_room_reason(code)} while {doing} ({room_left(code, directory)})"


def free_space(directory: str | os.PathLike) -> str:
    """The space left to this user in the file system of `directory`, for a message."""
    try:
        st = os.statvfs(directory)
    except OSError:
        return "unknown space"
    return f"{st.f_bavail * st.f_frsize / 1e6:.1f} MB"


def disk_full(path: str | os.PathLike, what: str, key: str | None = None, *, cause: BaseException) -> Exception:
    """The one-line DiskFull (an FwError) for a run file `path` that found no room (`cause`: a full disk or quota,
    or a file size limit): it names the config `key` that writes it (if any), the file, `what` it holds, and the
    space left or the limit. It is met before a checkpoint's write starts or after one is published, so the
    published checkpoints are intact."""
    where = f"{key}: " if key else ""
    code = no_room(cause) or errno.ENOSPC
    return DiskFull(f"{where}{path}: {no_room_text(code, Path(path).parent, f'writing {what}')}; the run stopped, "
                    "its published checkpoints are intact")


def _other_process_alive(pid: int) -> bool:
    """Whether `pid` is a live process other than this one. Our own pid counts as dead: callers run when this
    process is not saving, and a restarted container often gets the crashed process's pid back."""
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by another user
        return True
    return True


def dead_leftovers(directory: Path) -> list[tuple[Path, str, str]]:
    """Hidden siblings in `directory` whose owning process is gone, sorted by name, as (path, kind, name of
    the directory they stand beside); none when `directory` does not exist."""
    if not directory.is_dir():
        return []
    found = []
    for entry in sorted(directory.iterdir()):
        m = _HIDDEN.match(entry.name)
        if m and not _other_process_alive(int(m.group(3))):
            found.append((entry, m.group(1), m.group(2)))
    return found
